"""frmps demo: serve a model on the CPU, stream a completion, kill the active
engine in the middle of the stream, and show the stream finishing unharmed.

Run by `make demo`. Everything is real: the supervisor, both engine
processes, the shared-memory pools, the ring and the failover; only the model
is small and randomly initialised so it runs on a laptop CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 10.0) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"{}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base: str, admin: str, proc: subprocess.Popen, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"frmps serve exited early with code {proc.returncode}")
        try:
            st = http_json("GET", f"{admin}/v1/admin/status")
            last = st
            if st.get("state") == "serving_ready":
                return st
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise SystemExit(f"frmps did not become ready in {timeout:.0f}s; last status: {last}")


def active_pid(status: dict) -> int:
    for e in status.get("engines", []):
        if e.get("role") == "active" and e.get("pid"):
            return int(e["pid"])
    raise RuntimeError(f"no active engine in status: {status}")


def stream_completion(base: str, prompt: str, max_tokens: int, seed: int, on_chunk=None) -> tuple[str, int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8,
            "seed": seed, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    text, tokens, n = [], 0, 0  # n: tokens received so far
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                break
            ev = json.loads(payload)
            if "error" in ev:
                raise RuntimeError(f"stream ended with an error: {ev['error']}")
            for ch in ev.get("choices", []):
                text.append(ch.get("text", ""))
                n += len(ch.get("token_ids") or [])
                if on_chunk:
                    on_chunk(n)
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
    return "".join(text), tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--frmps", default=os.environ.get("FRMPS_BIN", "bin/frmps"))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--port", type=int, default=0, help="OpenAI endpoint port (0: a free one)")
    ap.add_argument("--admin-port", type=int, default=0, help="admin API port (0: a free one)")
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--kill-after", type=int, default=40, help="kill the active after this many streamed tokens")
    args = ap.parse_args()
    args.port = args.port or free_port()
    args.admin_port = args.admin_port or free_port()

    base = f"http://127.0.0.1:{args.port}"
    admin = f"http://127.0.0.1:{args.admin_port}"
    run_dir = tempfile.mkdtemp(prefix="frmps-demo-")
    cmd = [args.frmps, "serve", "--model", "tiny", "--engine", "ref", "--device", "cpu", "--no-mps",
           "--sync-every", "16", "--port", str(args.port), "--admin-addr", f"127.0.0.1:{args.admin_port}",
           "--run-dir", os.path.join(run_dir, "run"), "--python", args.python]
    print("$", " ".join(cmd), flush=True)
    log = open(os.path.join(run_dir, "serve.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        st = wait_ready(base, admin, proc, timeout=120)
        print(f"ready in {time.monotonic() - t0:.1f}s: active pid {active_pid(st)}, standby asleep", flush=True)

        prompt = "The quick brown fox"
        ref_text, ref_tokens = stream_completion(base, prompt, args.max_tokens, seed=7)
        print(f"no-fault run: {ref_tokens} tokens", flush=True)

        victim = active_pid(http_json("GET", f"{admin}/v1/admin/status"))
        killed = threading.Event()

        def kill_midway(n: int) -> None:
            if n >= args.kill_after and not killed.is_set():
                killed.set()
                os.kill(victim, signal.SIGKILL)
                print(f"  ... SIGKILL active pid {victim} after {n} streamed tokens", flush=True)

        text, tokens = stream_completion(base, prompt, args.max_tokens, seed=7, on_chunk=kill_midway)
        st = http_json("GET", f"{admin}/v1/admin/status")
        fo = (st.get("failovers") or [{}])[0]
        same = text == ref_text and tokens == ref_tokens
        print(f"failover run: {tokens} tokens; identical to the no-fault run: {same}", flush=True)
        print(f"failover: cause={fo.get('cause')}; death detected -> standby resumed {1000 * float(fo.get('duration_seconds', 0)):.2f} ms, "
              f"-> first resumed token at the client {1000 * float(fo.get('first_token_seconds', 0)):.2f} ms; "
              f"requests resumed {fo.get('resumed_requests')}, KV tokens reused {fo.get('reused_tokens')}, "
              f"recomputed {fo.get('prefilled_tokens')}", flush=True)
        print(f"new active pid {active_pid(st)}; state {st.get('state')} (a fresh standby is starting)", flush=True)
        return 0 if same and killed.is_set() else 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        print(f"supervisor exited with {proc.returncode}; logs in {run_dir}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
