"""frmps demo: serve a model on the CPU, stream a completion, kill the active
engine in the middle of the stream, and show the stream finishing unharmed.

Run by `make demo`. Everything is real: the supervisor, both engine
processes, the shared-memory pools, the ring and the failover; only the model
is small and randomly initialised so it runs on a laptop CPU.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the bench package

from bench import sse  # noqa: E402
from bench.serve import Serve, ServeOpts  # noqa: E402


class DemoServe(Serve):
    """The demo's `frmps serve`: a failed start ends the demo with its message."""

    error = SystemExit


def active_pid(status: dict) -> int:
    for e in status.get("engines", []):
        if e.get("role") == "active" and e.get("pid"):
            return int(e["pid"])
    raise RuntimeError(f"no active engine in status: {status}")


def stream_completion(base: str, prompt: str, max_tokens: int, seed: int, on_chunk=None) -> tuple[str, int]:
    body = sse.stream_body({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8,
                            "seed": seed})
    text, tokens, n = [], 0, 0  # n: tokens received so far
    with urllib.request.urlopen(sse.request(f"{base}/v1/completions", body), timeout=120) as resp:
        for ev in sse.events(resp):
            if ev == sse.DONE:
                break
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

    run_dir = tempfile.mkdtemp(prefix="frmps-demo-")
    opts = ServeOpts(frmps=args.frmps, python=args.python, model="tiny", engine="ref", device="cpu", memory=None,
                     mps=False, sync_every=16)
    srv = DemoServe(opts, os.path.join(run_dir, "run"), os.path.join(run_dir, "serve.log"), port=args.port,
                    admin_port=args.admin_port)
    base = srv.base
    print("$", " ".join(srv.command()), flush=True)
    srv.start()
    try:
        t0 = time.monotonic()
        st = srv.wait_state("serving_ready", timeout=120, poll=0.2)
        print(f"ready in {time.monotonic() - t0:.1f}s: active pid {active_pid(st)}, standby asleep", flush=True)

        prompt = "The quick brown fox"
        ref_text, ref_tokens = stream_completion(base, prompt, args.max_tokens, seed=7)
        print(f"no-fault run: {ref_tokens} tokens", flush=True)

        victim = active_pid(srv.status())
        killed = threading.Event()

        def kill_midway(n: int) -> None:
            if n >= args.kill_after and not killed.is_set():
                killed.set()
                os.kill(victim, signal.SIGKILL)
                print(f"  ... SIGKILL active pid {victim} after {n} streamed tokens", flush=True)

        text, tokens = stream_completion(base, prompt, args.max_tokens, seed=7, on_chunk=kill_midway)
        st = srv.status()
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
        srv.terminate(30)
        print(f"supervisor exited with {srv.proc.returncode}; logs in {run_dir}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
