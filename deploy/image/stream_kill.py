"""Streams a completion from a running frmps and, once a few chunks have
arrived, runs a command that kills the active engine; checks that the
stream ends with [DONE], no error event and every requested token.

    python3 stream_kill.py URL MAX_TOKENS -- KILL_COMMAND...

Standard library only (it runs on the host, outside the image)."""

import json
import subprocess
import sys
import urllib.request


def main() -> int:
    url, max_tokens = sys.argv[1], int(sys.argv[2])
    kill = sys.argv[sys.argv.index("--") + 1 :]
    body = json.dumps({
        "model": "tiny", "prompt": "The quick brown fox", "max_tokens": max_tokens,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    chunks, killed, done, tokens = 0, False, False, None
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            if '"error"' in data:
                print(f"FAIL: error event after {chunks} chunks: {data}")
                return 1
            ev = json.loads(data)
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            chunks += 1
            if chunks == 5 and not killed:
                killed = True
                out = subprocess.run(kill, capture_output=True, text=True)
                print(f"killed the active after 5 chunks: {' '.join(kill)} -> rc {out.returncode} {out.stdout.strip()} {out.stderr.strip()}")
                if out.returncode != 0:
                    return 1
    if not killed or not done or tokens != max_tokens:
        print(f"FAIL: killed={killed} done={done} completion_tokens={tokens} want {max_tokens} ({chunks} chunks)")
        return 1
    print(f"ok: {chunks} chunks, {tokens} tokens, [DONE] across the SIGKILL of the active")
    return 0


if __name__ == "__main__":
    sys.exit(main())
