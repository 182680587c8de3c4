#!/usr/bin/env python3
"""The negative controls of takeover exactness, through `frmps serve`: a check
that a proof's comparison can fail, to run before the proof's own figures at
each model size.

For the positive run (no control) and each control case (FRMPS_TEST_TAKEOVER_FAULT,
proto/frmps/v1/ENGINE.md §7): a fresh deployment whose engines have
FRMPS_TEST_MODE=1 and the case in their environment; a no-fault batch of
--requests streaming completions (different prompts of several KV blocks, half
greedy, half sampled with a seed), then the same batch again with the active
SIGKILLed once stream 0 has --kill-after tokens; each resumed output compared with
its no-fault one (bench.exactness). Exits 1, naming it, if a control
passed unnoticed (applied, and the request it hit still compares exact or
margin-bounded), was never applied, or the positive run is not exact.

    python3 bench/gpu/controls_check.py --frmps bin/frmps --engine vllm --model qwen2.5-0.5b --out controls.json

--cpu runs it on the CPU with the reference engine's tiny model (--no-mps, host-shm
pools, steps slowed by 10 ms so the kill lands mid-decode): a check of this script.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import signal
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "vllmpatch", "src"))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # the bench package
from proof_load import stream, wait_endpoint  # noqa: E402  (same folder)
from failover_proof import Deployment, failover_after, failover_seq, get, http_json  # noqa: E402

from bench import exactness  # noqa: E402

PROMPT = "Once upon a time, in a land of shared GPUs, the standby kept watch over the active. " * 8


def bodies(n: int, max_tokens: int) -> list[dict]:
    """Different prompts of 5-9 blocks of 16 tokens (byte-level tokenizers: more with
    subword ones), alternately greedy and sampled with a seed."""
    out = []
    for i in range(n):
        b = {"prompt": f"[{i}] " + PROMPT[13 * i: 13 * i + 90 + 17 * i], "max_tokens": max_tokens,
             "ignore_eos": True, "temperature": 0.0}
        if i % 2:
            b.update(temperature=0.9, top_k=50, seed=4000 + i)
        out.append(b)
    return out


def batch(dep: Deployment, model: str, reqs: list[dict], kill_after: int = 0) -> list[dict]:
    """The requests at once; with kill_after, SIGKILL the active once stream 0 has that many chunks."""
    live: list[float] = []
    fired = threading.Event()
    pid = 0
    if kill_after:
        act = dep.engines(dep.status()).get("active") or {}
        pid = int(get(act, "pid", default=0) or 0)
        if not pid:
            raise RuntimeError(f"no active engine pid in the status: {dep.status()}")

    def watch():
        while not fired.is_set():
            if len(live) >= kill_after:
                os.kill(pid, signal.SIGKILL)
                fired.set()
                return
            time.sleep(0.001)

    with cf.ThreadPoolExecutor(len(reqs) + 1) as pool:
        if kill_after:
            w = pool.submit(watch)
        futs = [pool.submit(stream, dep.base, model, b, 900, live if i == 0 else None) for i, b in enumerate(reqs)]
        outs = [f.result() for f in futs]
        if kill_after:
            fired.set()
            w.result()
    return outs


def log_text(log_dir: str) -> str:
    parts = []
    for root, _, files in os.walk(log_dir):
        for name in sorted(files):
            try:
                with open(os.path.join(root, name), errors="replace") as f:
                    parts.append(f.read())
            except OSError:
                pass
    return "\n".join(parts)


def make_run_case(args, record: dict):
    reqs = bodies(args.requests, args.max_tokens)
    lengths: list[int] = []

    def run_case(case: str | None) -> exactness.ControlRun:
        name = case or "none"
        a = argparse.Namespace(**vars(args))
        a.env = {**exactness.control_env(case), **({"FRMPS_TEST_STEP_DELAY_MS": "10"} if args.cpu else {})}
        dep = Deployment(a, name, args.workdir)
        dep.start()
        try:
            dep.wait(dep.ready_pair, args.start_timeout, "an active serving and a standby ready")
            wait_endpoint(dep.base, args.start_timeout)
            if not lengths:
                lengths.extend(prompt_lengths(dep, args.model, reqs))
            ref = batch(dep, args.model, reqs)
            bad = [i for i, r in enumerate(ref) if r["error"] or len(r["ids"]) != args.max_tokens]
            if bad:
                raise RuntimeError(f"{name}: the no-fault run failed for requests {bad}: {[ref[i]['error'] for i in bad]}")
            seq = failover_seq(dep.status())
            pid = int(get(dep.engines(dep.status()).get("active") or {}, "pid", default=0) or 0)
            got = batch(dep, args.model, reqs, args.kill_after)
            dep.wait(lambda st: failover_after(st, seq) and dep.ready_pair(st, pid), args.start_timeout,
                     "the failover and a standby re-armed")
            text = log_text(dep.log_dir)
        finally:
            dep.stop()
        hit = exactness.applied_prompt_lengths(text)
        record[name] = {"applied": hit, "errors": [g["error"] for g in got],
                        "first_divergence": [exactness.first_divergence(r["ids"], g["ids"]) for r, g in zip(ref, got)]}
        # The controls' lines name the engine's key, which a client never sees, and
        # the hit request's prompt length in tokens, which it does (usage).
        by_len = {n: i for i, n in enumerate(lengths)}
        lines = [f"takeover fault control {c} applied to request {by_len.get(n, -1)} (prompt of {n} tokens)"
                 for c, n in hit]
        return exactness.ControlRun(
            reference={i: r["ids"] for i, r in enumerate(ref)},
            observed={i: (g["ids"] if not g["error"] else []) for i, g in enumerate(got)},
            log_text="\n".join(lines))

    return run_case


def prompt_lengths(dep: Deployment, model: str, reqs: list[dict]) -> list[int]:
    """Each request's prompt length in tokens (the usage of a one-token completion);
    they must differ, so that a control's line identifies the request it hit."""
    out = []
    for b in reqs:
        r = http_json(dep.base + "/v1/completions", {**b, "model": model, "max_tokens": 1}, timeout=300)
        out.append(int(r["usage"]["prompt_tokens"]))
    if len(set(out)) != len(out):
        raise RuntimeError(f"the prompts' token counts are not all different: {out}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frmps", default="bin/frmps")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--engine", default="vllm")
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--memory", default="cuda-vmm")
    ap.add_argument("--sync-every", type=int, default=1000,
                    help="no periodic sync within a request (the engine still publishes after its first token): at "
                         "the kill the clients hold tokens past the snapshot, which the position control needs "
                         "(with a sync every 8 steps a kill right after a sync left no request fitting)")
    ap.add_argument("--num-blocks", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=0)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--kill-after", type=int, default=37)
    ap.add_argument("--cases", default=",".join(exactness.CONTROL_CASES))
    ap.add_argument("--engine-arg", action="append", default=[])
    ap.add_argument("--serve-arg", action="append", default=[])
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--workdir", default="/tmp/frmps-controls")
    ap.add_argument("--out", default="controls.json")
    ap.add_argument("--cpu", action="store_true", help="CPU check of this script (reference engine, tiny model)")
    args = ap.parse_args()
    args.port = 0
    if args.cpu:
        args.engine, args.model, args.device, args.memory = "ref", "tiny", "cpu", "host-shm"
        args.serve_arg = list(args.serve_arg) + ["--max-restarts=1000000"]
        args.engine_arg = list(args.engine_arg) + ["--max-num-batched-tokens=64"]
    os.makedirs(args.workdir, exist_ok=True)
    record: dict = {"args": {k: v for k, v in vars(args).items() if k != "env"}}
    cases = [c for c in args.cases.split(",") if c]
    try:
        results = exactness.run_controls(make_run_case(args, record), cases)
        record["ok"] = True
        record["results"] = [r.line() for r in results]
        print(f"controls: all {len(cases)} detected, the positive run exact")
        rc = 0
    except exactness.ControlsError as e:
        record["ok"] = False
        record["error"] = str(e)
        print(f"controls FAILED: {e}", file=sys.stderr)
        rc = 1
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
