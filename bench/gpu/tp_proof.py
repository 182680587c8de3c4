#!/usr/bin/env python3
"""Tensor parallelism (TP=2) through `frmps serve`: real MPS faults on either GPU.

One deployment of the reference engine with --tensor-parallel-size 2 (each engine
a group of two processes, rank r on GPU r; the active group in one MPS daemon
covering both GPUs, the standby group outside MPS). The same load as
failback_proof.py (--streams concurrent streams, each repeating its request and
comparing every finished output, token ids included, with its no-fault output
taken first on the same deployment). Then --faults times: wait until the
placement is restored (failover, then failback), make a co-located MPS client
pinned to GPU 0, then GPU 1, alternately, fault (bench/faults triggers,
rotating), and record:

- the failover record: cause, detail (a fault on GPU 1 may kill rank 1 only:
  rank 0 then reports "tensor-parallel rank 1 ... died"), ok;
- fault -> death detected, death -> first resumed token (the promoted group's
  rank-0 log), the longest client-visible gap from the fault;
- the standby group's GPU memory per GPU (nvidia-smi per process: the standby
  group's rank 0 and its worker), at start and after every restore.

    python3 bench/gpu/tp_proof.py --frmps bin/frmps --model qwen2.5-7b --faults 10 --out tp.json

--cpu runs the same sequence on the CPU (the MPS control daemon's test double;
the "fault" is SIGKILL of rank 0, then rank 1, of the active group): a check of
this script, not of GPU faults. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from failback_proof import (  # noqa: E402  (same folder, standard library only)
    FAKE_MPS, FAULTS, add_count_args, apply_prefill_chunk, engines, events_of, first_resumed, grep_all, restored,
    run_controls, started, stream_report)
from proof_load import Load, bodies, burst_bodies, gaps_after, max_gap_in, no_fault_run  # noqa: E402
from failover_proof import (Deployment, failover_after, failover_seq, get, mps_trigger,  # noqa: E402
                            stop_on_sigterm)

from bench.procs import alive, live_children  # noqa: E402  (standard library only)


def now() -> float:
    return time.time()


def group_pids(engine: dict) -> list[int]:
    """Every process of an engine group: the engine the supervisor launched, then its
    children (vLLM's: one worker per rank and multiprocessing's resource tracker)."""
    pid = int(get(engine, "pid", default=0) or 0)
    return [pid] + sorted(live_children(pid)) if pid else []


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def gpu_ranks(engine: dict, kind: str) -> list[int]:
    """The processes that hold a rank's GPU: the reference engine's rank 0 and its
    workers; vLLM's workers (its rank 0 opens no device; the resource tracker none)."""
    pids = group_pids(engine)
    if kind == "vllm":
        return [p for p in pids[1:] if "resource_tracker" not in _cmdline(p)]
    return pids


RANK_DIGEST = re.compile(r"Worker_TP(\d+).*frmps (\w+) placement digest ([0-9a-f]+)")


def rank_digests(log_path: str | None) -> dict:
    """A vLLM group's placement digests per rank ("rank1 weights": digest), from its
    workers' lines in the engine log: the same digests in the active and the standby
    group mean each rank's shard and KV cache sit at the same places in the same pools."""
    out = {}
    for line in grep_all(log_path, "placement digest"):
        m = RANK_DIGEST.search(line)
        if m:
            out[f"rank{m[1]} {m[2]}"] = m[3]
    return out


def gpu_memory(pids: list[int]) -> dict:
    """MiB per GPU index used by the given processes, from nvidia-smi's per-process view."""
    out: dict = {"per_gpu_mib": {}, "gpu_used_mib": {}}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
        index = {}
        for line in q.stdout.strip().splitlines():
            i, uuid, used = [p.strip() for p in line.split(",")]
            index[uuid] = int(i)
            out["gpu_used_mib"][int(i)] = int(used)
        q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
        for line in q.stdout.strip().splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 3 and parts[0].isdigit() and int(parts[0]) in pids and parts[2].isdigit():
                gpu = index.get(parts[1], parts[1])
                out["per_gpu_mib"][gpu] = out["per_gpu_mib"].get(gpu, 0) + int(parts[2])
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        out["error"] = str(e)
    return out


def main() -> int:
    stop_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frmps", default="bin/frmps")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--engine", default="ref", choices=["ref", "vllm"],
                    help="vllm: --model is then a "
                         "`frmps model init` directory and --num-blocks is required")
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--tensor-parallel-size", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--memory", default="cuda-vmm")
    ap.add_argument("--sync-every", type=int, default=1)
    ap.add_argument("--num-blocks", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=0)
    ap.add_argument("--faults", type=int, default=10)
    ap.add_argument("--fault-kinds", default=",".join(FAULTS))
    ap.add_argument("--faults-dir", default="bench/build/faults")
    ap.add_argument("--min-fault-interval", type=float, default=13.0,
                    help="seconds between faults (frmps serve's crash-loop breaker: see failback_proof.py)")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--workdir", default="/tmp/frmps-tp")
    ap.add_argument("--out", default="tp_proof.json")
    ap.add_argument("--time-budget", type=float, default=0, help="no new fault after this many seconds of faults")
    ap.add_argument("--engine-arg", action="append", default=[])
    ap.add_argument("--serve-arg", action="append", default=[], help="more frmps serve flags")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment of frmps and its engines (e.g. NCCL_DEBUG=INFO)")
    ap.add_argument("--cpu", action="store_true", help="CPU check of this script: MPS test double, SIGKILL of a rank")
    add_count_args(ap)
    args = ap.parse_args()
    apply_prefill_chunk(args)
    args.port, args.mps_control = 0, ""
    args.serve_arg = [*args.serve_arg, f"--tensor-parallel-size={args.tensor_parallel_size}"]
    args.env = dict(kv.split("=", 1) for kv in args.env)
    if args.cpu:
        args.device, args.memory, args.mps_control = "cpu", "host-shm", FAKE_MPS
        args.serve_arg = [*args.serve_arg, "--mps-control", FAKE_MPS]
        args.env.setdefault("FRMPS_TEST_STEP_DELAY_MS", "10")
    n_ranks = args.tensor_parallel_size
    t_begin = now()
    os.makedirs(args.workdir, exist_ok=True)
    report: dict = {"engine": args.engine, "model": args.model, "device": args.device, "tensor_parallel_size": n_ranks,
                    "sync_every": args.sync_every, "streams": args.streams, "max_tokens": args.max_tokens,
                    "faults": [], "standby_memory": []}

    def save() -> None:
        report["elapsed_s"] = round(now() - t_begin, 1)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)

    def standby_memory(st: dict, when: str) -> None:
        sb = engines(st).get("standby") or {}
        pids = group_pids(sb)
        rec = {"when": when, "pids": pids}
        if not args.cpu:
            rec.update(gpu_memory(pids))
        report["standby_memory"].append(rec)

    report.update(burst=args.burst, prefill_chunk=args.prefill_chunk)
    if not run_controls(args, report, save, [k for k in args.fault_kinds.split(",") if k][0]):
        save()
        print(f"error: {report['error']}", flush=True)
        return 1
    dep = Deployment(args, f"{args.engine}-tp{n_ranks}-{os.path.basename(os.path.normpath(args.model))}", args.workdir)
    load = None
    try:
        t0 = now()
        dep.start()
        st, t_ready = dep.wait(lambda s: started(dep, s), 900, "active serving + standby ready")
        report["startup_s"] = round(t_ready - t0, 2)
        if int(get(st, "tensor_parallel_size", default=1) or 1) != n_ranks:
            raise RuntimeError(f"status says tensor_parallel_size {get(st, 'tensor_parallel_size')}, want {n_ranks}")
        for role, e in engines(st).items():
            if len(gpu_ranks(e, args.engine)) != n_ranks:
                raise RuntimeError(f"{role} group has ranks {gpu_ranks(e, args.engine)} of {group_pids(e)}, "
                                   f"want {n_ranks}")
        standby_memory(st, "start")
        if args.engine == "vllm":
            e0 = engines(st)
            a, b = rank_digests(get(e0["active"], "log_path")), rank_digests(get(e0["standby"], "log_path"))
            report["placement_digests"] = {"active": a, "standby": b, "equal": bool(a) and a == b}
            print(f"placement digests per rank: {a} (active), equal in the standby: {bool(a) and a == b}", flush=True)
        save()

        reqs = bodies(args.streams, args.max_tokens) + burst_bodies(args.burst, args.max_tokens, args.prefill_chunk)
        ref, report["reference"] = no_fault_run(dep, args.model, reqs)
        if report["reference"]["errors"]:
            raise RuntimeError(f"the no-fault run failed: {report['reference']['errors'][:3]}")
        save()
        load = Load(dep, args.model, reqs, ref, n_loop=args.streams)
        load.start()
        kinds = [k for k in args.fault_kinds.split(",") if k]
        t_faults, last_fault = now(), 0.0
        for n in range(1, args.faults + 1):
            if args.time_budget and now() - t_faults > args.time_budget:
                report["stopped"] = f"time budget after {n - 1} faults"
                break
            gpu = (n - 1) % n_ranks
            spec = kinds[(n - 1) % len(kinds)]
            rec: dict = {"n": n, "fault": spec, "gpu": gpu}
            report["faults"].append(rec)
            st, _ = dep.wait(lambda s: restored(s, n - 1), 300, f"placement restored before fault {n}")
            if last_fault:
                time.sleep(max(0.0, last_fault + args.min_fault_interval - now()))
            e = engines(st)
            act, sb = e["active"], e["standby"]
            rec["active_ranks"] = group_pids(act)
            n_fo = failover_seq(st)
            if args.cpu:
                victim = rec["active_ranks"][gpu]
                prepare, inject = (lambda: None), None
            else:
                prepare, inject = mps_trigger(args, spec, gpu=gpu)(dep, act)
            prepare()
            load.wait_all_streaming(5)  # the fault lands mid-stream for every stream
            if load.burst():  # and requests still queued or in their chunked prefill
                time.sleep(args.burst_lead)
            if args.cpu:
                t_fault = now()
                os.kill(victim, signal.SIGKILL)
                rec["inject"] = {"how": f"SIGKILL of rank {gpu} (pid {victim}; cpu check)"}
            else:
                inj = inject()
                t_fault = inj.get("t_fault") or now()
                rec["inject"] = {k: v for k, v in inj.items() if k != "t_fault"}
            last_fault = t_fault
            st, _ = dep.wait(lambda s: failover_after(s, n_fo), 120, "the failover record")
            fo = (get(st, "failovers") or [])[0]
            detect = int(get(fo, "unix_nanos", default=0)) / 1e9
            rec["failover"] = {k: get(fo, k) for k in ("cause", "detail", "ok", "duration_seconds", "resumed_requests",
                                                       "reused_tokens", "prefilled_tokens", "first_token_seconds")}
            rec["fault_to_detect_s"] = round(detect - t_fault, 4)
            rec["t_fault"], rec["t_detect"] = t_fault, detect  # the event windows of the stream count
            rec["old_ranks_left"] = [p for p in rec["active_ranks"] if alive(p)]
            st, t_restored = dep.wait(lambda s: restored(s, n), 300, f"failback after fault {n}")
            rec["restored_s_after_detect"] = round(t_restored - detect, 3)
            fb = get(st, "failback") or {}
            fb_done = int(get(fb, "last_unix_nanos", default=0) or 0) / 1e9
            if fb_done:
                rec["t_handover"] = [fb_done - float(get(fb, "last_duration_seconds", default=0) or 0), fb_done]
            fr = first_resumed(get(sb, "log_path"), detect)  # the group the failover promoted
            rec["detect_to_first_resumed_token_s"] = round(fr - detect, 4) if fr else None
            rec["old_ranks_left_after_restore"] = [p for p in rec["active_ranks"] if alive(p)]
            standby_memory(st, f"after fault {n}")
            time.sleep(0.5)
            times = load.chunk_times()
            rec["client_gap_from_fault_s"] = gaps_after(times, t_fault)
            # The longest silence a client saw around the failover (a chunk that still comes from the
            # dying group right after the fault does not end it): failback_proof.py's measure.
            rec["client_max_gap_s"] = max_gap_in(times, t_fault, t_fault + 1.0)
            print(f"fault {n} {spec} on GPU {gpu}: cause={rec['failover']['cause']} ok={rec['failover']['ok']} "
                  f"detail={rec['failover']['detail']!r} fault->detect={rec['fault_to_detect_s']} "
                  f"detect->tok={rec['detect_to_first_resumed_token_s']} client_gap={rec['client_gap_from_fault_s']} "
                  f"max_gap={rec['client_max_gap_s']} restored={rec['restored_s_after_detect']}s "
                  f"standby MiB/GPU={report['standby_memory'][-1].get('per_gpu_mib')}", flush=True)
            save()
    except Exception as ex:  # keep what was measured
        report["error"] = f"{type(ex).__name__}: {ex}"
    finally:
        if load is not None:
            load.finish(120)
            h = stream_report(report, list(load.done), events_of(report["faults"]),
                              (report.get("reference") or {}).get("prompt_tokens") or [], args.prefill_chunk)
            print(h + ("" if args.controls else " [controls OFF]"), flush=True)
        dep.stop()
        fos = [f["failover"] for f in report["faults"] if "failover" in f]
        report["takeovers_ok"] = sum(1 for f in fos if f.get("ok"))
        report["takeovers"] = len(fos)
        report["ranks_left"] = sorted({p for f in report["faults"] for p in f.get("old_ranks_left_after_restore", [])})
        save()
    summary = {k: report.get(k) for k in ("startup_s", "takeovers", "takeovers_ok", "streams_total", "streams_exact",
                                          "headline", "controls_mode", "ranks_left", "error", "elapsed_s")}
    print(json.dumps(summary, default=str), flush=True)
    ok = (not report.get("error") and report["takeovers"] == report["takeovers_ok"] > 0
          and report.get("streams_exact") == report.get("streams_total") and not report["ranks_left"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
