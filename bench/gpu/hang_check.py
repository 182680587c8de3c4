#!/usr/bin/env python3
"""Hang detection through the real supervisor (`frmps serve`), standard library only.

One deployment (active inside MPS, standby outside, --memory cuda-vmm), at frmps's
default hang thresholds:

1. no false hang: a long prompt (--long-prompt tokens, 32,000 by default, prefilled in
   the engine's chunks) beside decoding requests; no failover may happen;
2. hung kernel: the active's next step launches a kernel that spins for ever on its
   stream (the engine's debug hook: FRMPS_DEBUG_HANG_SIGNAL=1 + SIGUSR2), while
   requests stream; the supervisor must see the step overrun its bound, fence the
   engine (SIGKILL of its group while the kernel spins) and fail over. The first round
   hangs the active inside MPS, later rounds the promoted engine outside MPS;
3. stopped process: SIGSTOP of the active (no heartbeat at all).

Per round: signal -> detected, signal -> takeover acked (targets: 2 s for a hung kernel,
1.5 s for SIGSTOP), detected -> the fenced process gone, the failover class, and the
streams' texts and token ids (the engines' token logs) against a no-fault run. Results: --out JSON and a summary on stdout.

    python3 bench/gpu/hang_check.py --frmps bin/frmps --model qwen2.5-0.5b --out hang.json

--cpu runs the same sequence on the CPU path (--no-mps, host-shm, the tiny model):
a check of this script, not of GPU hangs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from failover_proof import Deployment, Stream, compare, compare_ids, get, nvidia_smi, run_batch  # noqa: E402

TARGET_S = {"hung": 2.0, "stalled": 1.5}


def now() -> float:
    return time.time()


def failovers(dep: Deployment) -> list[dict]:
    return get(dep.status(), "failovers", default=[]) or []


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def long_prompt_phase(dep: Deployment, args) -> dict:
    """A long prefill beside decodes must not look like a hang."""
    before = len(failovers(dep))
    ids = [32 + (7 * i + 11) % 95 for i in range(args.long_prompt)]  # printable bytes: valid ids for every preset
    long = Stream(dep.base, args.model, "long", ids, dict(max_tokens=8, ignore_eos=True, temperature=0.0))
    decodes = [Stream(dep.base, args.model, f"d{i}", f"Request {i}: tell a story", dict(max_tokens=args.max_tokens,
                      ignore_eos=True, temperature=0.0)) for i in range(args.requests)]
    for s in decodes:
        s.start()
    time.sleep(0.3)
    long.start()
    long.join(900)
    long_s = round(now() - long.t_start, 3)
    for s in decodes:
        s.join(900)
    recs = failovers(dep)
    # Dummy weights often decode to empty text (no chunk, so no first-token time): the
    # whole request's time bounds the prefill from above.
    return {"prompt_tokens": args.long_prompt, "request_s": long_s,
            "ttft_s": round(long.chunks[0][0] - long.t_start, 3) if long.chunks else None,
            "long_result": long.result() | {"text": None}, "decode_errors": [s.error for s in decodes if s.error],
            "failovers_during": len(recs) - before, "ok": len(recs) == before and long.error is None,
            "records": recs[: len(recs) - before]}


def signal_phase(dep: Deployment, args, ref: list[dict], ref_ids: dict, sig: int, want: str) -> dict:
    e0 = dep.engines(dep.status())
    old_active = e0["active"]
    pid = int(get(old_active, "pid"))
    n0 = len(failovers(dep))
    res: dict = {"signal": signal.Signals(sig).name, "want_class": want, "active_in_mps": get(old_active, "in_mps"),
                 "active_pid": pid}
    box: dict = {}

    def watch_gone() -> None:
        """The fenced pid disappears once the supervisor killed and reaped it."""
        deadline = now() + 60
        while not pid_gone(pid) and now() < deadline:
            time.sleep(0.002)
        if pid_gone(pid):
            box["t_gone"] = now()

    def inject() -> dict:
        box["t"] = now()
        os.kill(pid, sig)
        box["watch"] = threading.Thread(target=watch_gone, daemon=True)
        box["watch"].start()
        return {"t_signal": box["t"]}

    streams, inj, ids = run_batch(dep, args, inject=inject)
    t_sig = box["t"]
    res["inject"] = inj
    res["outputs_exact"] = compare(ref, [s.result() for s in streams])
    res["ids_exact"] = compare_ids(ref_ids, ids)  # the engines' token logs

    def done(st):
        recs = get(st, "failovers", default=[]) or []
        return len(recs) > n0 and get(recs[0], "cause") != "pending"

    st, _ = dep.wait(done, 120, "the failover record")
    rec = (get(st, "failovers") or [])[0]
    detect = int(get(rec, "unix_nanos", default=0)) / 1e9
    acked = detect + float(get(rec, "duration_seconds", default=0) or 0)
    res["record"] = {k: get(rec, k) for k in ("cause", "detail", "ok", "error", "duration_seconds", "resumed_requests")}
    res["signal_to_detect_s"] = round(detect - t_sig, 4)
    res["signal_to_takeover_s"] = round(acked - t_sig, 4)
    box["watch"].join(70)
    res["fenced_gone"] = "t_gone" in box
    res["detect_to_gone_s"] = round(box["t_gone"] - detect, 4) if res["fenced_gone"] else None
    st, t_rearmed = dep.wait(lambda s: dep.ready_pair(s, fenced_pid=pid), 300,
                             "the re-armed standby")
    res["rearm_s_from_detect"] = round(t_rearmed - detect, 3)
    res["mps_state"] = get(st, "mps_state")
    if not args.cpu:
        res["gpu_after_rearm"] = nvidia_smi()
    ex, xi = res["outputs_exact"], res["ids_exact"]
    res["ok"] = bool(res["record"]["ok"] and res["record"]["cause"] == want and res["fenced_gone"]
                     and ex["errors"] == 0 and ex["text_equal"] == ex["requests"] and xi["ids_equal"] == xi["requests"])
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frmps", default="bin/frmps")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--memory", default="cuda-vmm")
    ap.add_argument("--sync-every", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--long-prompt", type=int, default=32000, help="tokens of the no-false-hang prompt (0: skip)")
    ap.add_argument("--hang-rounds", type=int, default=3, help="hung-kernel failovers (the first inside MPS)")
    ap.add_argument("--stop-rounds", type=int, default=1, help="SIGSTOP failovers")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--inject-delay", type=float, default=0.5, help="signal this long after the requests went out")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--workdir", default="/tmp/frmps-hang")
    ap.add_argument("--out", default="hang_check.json")
    ap.add_argument("--cpu", action="store_true", help="CPU check of this script: --no-mps, host-shm, tiny model")
    ap.add_argument("--engine-arg", action="append", default=[])
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="another frmps serve flag (repeatable); the crash-loop breaker is opened wide already")
    args = ap.parse_args()
    if args.cpu:
        args.device, args.memory, args.model = "cpu", "host-shm", "tiny"
        args.max_model_len = min(args.max_model_len, 4096)
        args.long_prompt = min(args.long_prompt, 3500)
        args.max_tokens = min(args.max_tokens, 200)
        os.environ.setdefault("FRMPS_TEST_STEP_DELAY_MS", "10")  # streams long enough to signal into
    args.inject_after = 1 << 30  # signal at --inject-delay
    args.serve_arg = ["--max-restarts=1000000", *args.serve_arg]  # every round kills the active on purpose
    os.makedirs(args.workdir, exist_ok=True)
    os.environ["FRMPS_DEBUG_HANG_SIGNAL"] = "1"  # inherited by the engines
    report: dict = {"model": args.model, "device": args.device, "mode": "cpu-check" if args.cpu else "gpu",
                    "targets_s": TARGET_S, "rounds": []}
    t0 = now()
    dep = Deployment(args, f"hang-{args.model}", args.workdir)

    def save():
        report["elapsed_s"] = round(now() - t0, 1)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    try:
        dep.start()
        _, t_ready = dep.wait(lambda s: dep.ready_pair(s), 900, "active serving + standby ready")
        report["startup_s"] = round(t_ready - t0, 2)
        if args.long_prompt:
            report["long_prompt"] = long_prompt_phase(dep, args)
            save()
            print(f"long prompt ({args.long_prompt} tokens): request {report['long_prompt']['request_s']} s, "
                  f"failovers during it {report['long_prompt']['failovers_during']}", flush=True)
        ref_streams, _, ref_ids = run_batch(dep, args)
        ref = [s.result() for s in ref_streams]
        report["reference_errors"] = [r["error"] for r in ref if r["error"]]
        plan = [(signal.SIGUSR2, "hung")] * args.hang_rounds + [(signal.SIGSTOP, "stalled")] * args.stop_rounds
        for sig, want in plan:
            r = {"signal": signal.Signals(sig).name, "want_class": want}
            report["rounds"].append(r)
            try:
                r.update(signal_phase(dep, args, ref, ref_ids, sig, want))
            except Exception as ex:  # keep the rounds that ran
                r["error"] = f"{type(ex).__name__}: {ex}"
            save()
            print(line(r), flush=True)
            if r.get("error"):
                break
    except Exception as ex:
        report["error"] = f"{type(ex).__name__}: {ex}"
    finally:
        dep.stop()
        save()
    print(summary(report), flush=True)
    return 0 if ok(report) else 1


def line(r: dict) -> str:
    if r.get("error"):
        return f"{r.get('signal')}: ERROR {r['error']}"
    ex = r["outputs_exact"]
    return (f"{r['signal']} (active in MPS: {r['active_in_mps']}): class {r['record']['cause']} ok={r['ok']} "
            f"signal->detect {r['signal_to_detect_s']} s, ->takeover {r['signal_to_takeover_s']} s "
            f"(target {TARGET_S[r['want_class']]} s), detect->fenced gone {r['detect_to_gone_s']} s, "
            f"texts {ex['text_equal']}/{ex['requests']} equal, token ids {r['ids_exact']['ids_equal']}/"
            f"{r['ids_exact']['requests']}, errors {ex['errors']}, mps {r['mps_state']}; "
            f"{r['record']['detail']}")


def ok(report: dict) -> bool:
    lp = report.get("long_prompt")
    return (not report.get("error") and (lp is None or lp["ok"]) and bool(report["rounds"])
            and all(r.get("ok") and r["signal_to_takeover_s"] <= TARGET_S[r["want_class"]] for r in report["rounds"]))


def summary(report: dict) -> str:
    out = [f"== hang check {report['model']} on {report['device']}: {'PASS' if ok(report) else 'FAIL'}"]
    if report.get("error"):
        out.append(f"error: {report['error']}")
    lp = report.get("long_prompt")
    if lp:
        out.append(f"long prompt {lp['prompt_tokens']} tokens: request {lp['request_s']} s, failovers during it: "
                   f"{lp['failovers_during']}")
    for want in TARGET_S:
        xs = [r["signal_to_takeover_s"] for r in report["rounds"] if r.get("want_class") == want and "signal_to_takeover_s" in r]
        if xs:
            out.append(f"{want}: signal -> takeover {', '.join(f'{x:.3f}' for x in xs)} s (max {max(xs):.3f}, "
                       f"target {TARGET_S[want]} s)")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
