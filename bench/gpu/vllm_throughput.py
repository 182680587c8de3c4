#!/usr/bin/env python3
"""Decode throughput: `frmps serve --engine vllm` (its defaults: active in MPS,
standby asleep, sync every step) against the same vLLM without frmps, at
several batch sizes, in one run on one GPU.

For each batch size B the same B prompts (token ids) are generated twice,
with max_tokens=T and max_tokens=1, after a warm-up; decode throughput is
B*(T-1) / (time(T) - time(1)), so prefill and per-request set-up cancel out.
frmps is driven through its OpenAI endpoint with streaming clients (what a
user sees), split over --client-procs processes so that the clients' own SSE
parsing (one GIL per process) does not cap the rate; the front door's own
figures for each run (tokens delivered, its time per chunk) come from /metrics; vLLM alone through its offline LLM API with its own defaults
(async scheduling included, where it applies), in a fresh process.

    PYTHONPATH=<vllm site>:vllmpatch/src python3 bench/gpu/vllm_throughput.py \\
        --frmps bin/frmps --model /tmp/models/qwen2.5-0.5b --batches 1,8,64 --out tp.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from failover_proof import Deployment  # noqa: E402

from failback_proof import started  # noqa: E402
from proof_load import stream  # noqa: E402

from bench.procs import collect  # noqa: E402  (standard library only)
from bench.serving.profile import VIEWS as PY_SPY_VIEWS, read_stacks  # noqa: E402  (py-spy's views, its raw format's one parser)


def prompts(b: int, n: int = 32) -> list[list[int]]:
    return [[1000 + 37 * i + j for j in range(n)] for i in range(b)]


def _client_proc(base: str, model: str, ps: list[list[int]], tokens: int, start, q) -> None:
    """One client process: its share of the streams, one thread each (a process
    per few streams keeps SSE parsing off one GIL)."""
    res: list[dict] = [{}] * len(ps)

    def one(i: int) -> None:
        res[i] = stream(base, model, {"prompt": ps[i], "max_tokens": tokens, "ignore_eos": True, "temperature": 0.0})

    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(ps))]
    start.wait()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    q.put([r.get("error") or ("" if len(r.get("ids", [])) == tokens else f"{len(r.get('ids', []))} tokens") for r in res])


def scrape(base: str) -> dict[str, float]:
    """The front door's own counters (/metrics): tokens delivered and its time per streamed chunk."""
    want = ("frmps_tokens_generated_total", "frmps_stream_chunk_overhead_seconds_sum",
            "frmps_stream_chunk_overhead_seconds_count")
    out = dict.fromkeys(want, 0.0)
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in out:
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def frmps_times(dep: Deployment, model: str, ps: list[list[int]], tokens: int, procs: int,
                server: list | None = None) -> float:
    """Wall time of the batch, from the moment every client process is ready;
    ``server`` gets the front door's figures for the run."""
    ctx = mp.get_context("spawn")
    start, q = ctx.Event(), ctx.Queue()
    shares = [ps[i::procs] for i in range(min(procs, len(ps)))]
    cs = [ctx.Process(target=_client_proc, args=(dep.base, model, sh, tokens, start, q), daemon=True) for sh in shares]
    for c in cs:
        c.start()
    try:
        time.sleep(2.0)  # interpreters started and imports done before the clock starts
        m0 = scrape(dep.base)
        t0 = time.perf_counter()
        start.set()
        errs = [e for r in collect(q, cs, 900) for e in r if e]
        dt = time.perf_counter() - t0
        m1 = scrape(dep.base)
    finally:
        for c in cs:
            c.join(30)
            if c.is_alive():
                c.kill()
                c.join()
    if errs:
        raise RuntimeError(f"frmps requests failed: {errs[:3]}")
    if server is not None:
        chunks = m1["frmps_stream_chunk_overhead_seconds_count"] - m0["frmps_stream_chunk_overhead_seconds_count"]
        server.append({"tokens": m1["frmps_tokens_generated_total"] - m0["frmps_tokens_generated_total"], "chunks": chunks,
                       "front_door_us_per_chunk": round(1e6 * (m1["frmps_stream_chunk_overhead_seconds_sum"]
                                                               - m0["frmps_stream_chunk_overhead_seconds_sum"]) / chunks, 2)
                       if chunks else None})
    return dt


def py_spy_profile(py_spy: str, pid: int, seconds: float, out_path: str, run, view: str = "cpu") -> dict:
    """Samples every thread of the engine process `pid` with py-spy (raw collapsed
    stacks into out_path, the process not paused) while run() generates; returns
    the samples per thread and the hottest frames (own samples) of each. view:
    a key of PY_SPY_VIEWS (bench/serving/profile.py: on the CPU, holding the
    GIL, or everything, waits included)."""
    p = subprocess.Popen([py_spy, "record", "--pid", str(pid), "--rate", "500", "--duration", str(int(seconds) + 1),
                          "--format", "raw", "--output", out_path, "--threads", "--nonblocking", *PY_SPY_VIEWS[view]],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)  # attached before the clients start
        run()
    finally:
        _, err = p.communicate(timeout=seconds + 60)
    if not os.path.exists(out_path):
        return {"error": (err or "")[-500:]}
    return summarize_stacks(out_path)


def summarize_stacks(path: str, top: int = 15) -> dict:
    """py-spy's raw format ("thread;frame;...;frame count" per line, root first):
    per thread, its samples and its hottest leaf frames."""
    threads: dict[str, dict] = {}
    for frames, n in read_stacks(path):
        t = threads.setdefault(frames[0], {"samples": 0, "leaf": {}})
        t["samples"] += n
        leaf = frames[-1]
        t["leaf"][leaf] = t["leaf"].get(leaf, 0) + n
    return {name: {"samples": t["samples"],
                   "top": sorted(t["leaf"].items(), key=lambda kv: -kv[1])[:top]}
            for name, t in sorted(threads.items(), key=lambda kv: -kv[1]["samples"])}


VLLM_ALONE = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
a = json.loads(sys.argv[1])
llm = LLM(model=a["model"], load_format="dummy", max_model_len=a["max_model_len"], max_num_seqs=a["max_num_seqs"],
          num_gpu_blocks_override=a["num_blocks"], gpu_memory_utilization=a["util"], seed=0)
cfg = llm.llm_engine.vllm_config
out = {"async_scheduling": bool(getattr(cfg.scheduler_config, "async_scheduling", False)),
       "v2_model_runner": bool(getattr(cfg, "use_v2_model_runner", False)), "batches": {}}
def run(ps, n):
    sp = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
    t0 = time.perf_counter()
    r = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    assert all(len(x.outputs[0].token_ids) == n for x in r)
    return dt
for b in a["batches"]:
    ps = [[1000 + 37 * i + j for j in range(32)] for i in range(b)]
    run(ps, a["tokens"]); run(ps, 1)  # warm-up
    tt = [run(ps, a["tokens"]) for _ in range(a["reps"])]
    t1 = [run(ps, 1) for _ in range(a["reps"])]
    out["batches"][str(b)] = {"t_tokens_s": tt, "t_one_s": t1}
print("RESULT " + json.dumps(out), flush=True)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frmps", default="bin/frmps")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--model", required=True, help="model directory (frmps model init)")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--util", type=float, default=0.5, help="vLLM alone's gpu_memory_utilization")
    ap.add_argument("--workdir", default="/tmp/frmps-tp")
    ap.add_argument("--out", default="vllm_throughput.json")
    ap.add_argument("--client-procs", type=int, default=8,
                    help="client processes for frmps's streams (streams split between them, a thread per stream)")
    ap.add_argument("--skip", default="", help="frmps or vllm: skip that side")
    ap.add_argument("--py-spy", default="", help="py-spy executable: profile the active engine's threads during three "
                                                  "more runs at the largest batch, on the CPU, holding the GIL and with "
                                                  "waits (raw stacks beside --out)")
    ap.add_argument("--frmps-modes", default="default",
                    help="comma list of frmps runs: default (the engines' environment as given), sync, async "
                         "(FRMPS_VLLM_ASYNC_SCHEDULING=0 / 1), each a deployment of its own, in this order")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",") if x]
    report: dict = {"model": args.model, "tokens": args.tokens, "reps": args.reps, "batches": batches}

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    modes = {"default": ("frmps", {}), "sync": ("frmps-sync", {"FRMPS_VLLM_ASYNC_SCHEDULING": "0"}),
             "async": ("frmps-async", {"FRMPS_VLLM_ASYNC_SCHEDULING": "1"})}
    sides = []
    for mode in (m for m in args.frmps_modes.split(",") if m and args.skip != "frmps"):
        if mode not in modes:
            ap.error(f"--frmps-modes: unknown mode {mode!r} (default, sync, async)")
        key, env = modes[mode]
        sides.append(key)
        a = argparse.Namespace(frmps=args.frmps, python=args.python, model=args.model, device="cuda", memory="cuda-vmm",
                               cpu=False, sync_every=1, num_blocks=args.num_blocks, max_model_len=args.max_model_len,
                               engine="vllm", engine_arg=[f"--max-num-seqs={max(batches)}"], serve_arg=[], port=0,
                               mps_control="", env=env)
        os.makedirs(args.workdir, exist_ok=True)
        dep = Deployment(a, key, args.workdir)
        fr: dict = {"env": env}
        report[key] = fr
        try:
            t0 = time.perf_counter()
            dep.start()
            dep.wait(lambda s: started(dep, s), 900, "active serving + standby ready")
            fr["startup_s"] = round(time.perf_counter() - t0, 1)
            for b in batches:
                ps = prompts(b)
                n = args.client_procs
                frmps_times(dep, args.model, ps, args.tokens, n)
                frmps_times(dep, args.model, ps, 1, n)
                server: list[dict] = []
                tt = [frmps_times(dep, args.model, ps, args.tokens, n, server) for _ in range(args.reps)]
                t1 = [frmps_times(dep, args.model, ps, 1, n) for _ in range(args.reps)]
                fr[str(b)] = {"t_tokens_s": tt, "t_one_s": t1, "client_procs": min(n, b), "server": server}
                if args.py_spy and b == max(batches):
                    active = dep.engines(dep.status()).get("active") or {}
                    for view in PY_SPY_VIEWS:  # one more run each
                        suffix = "" if view == "cpu" else f"-{view}"
                        raw = f"{os.path.splitext(args.out)[0]}-{key}-b{b}{suffix}.stacks"
                        fr[str(b)]["py_spy" + suffix.replace("-", "_")] = py_spy_profile(
                            args.py_spy, int(active.get("pid", 0)), max(tt) + 2, raw,
                            lambda: frmps_times(dep, args.model, ps, args.tokens, n), view)
                save()
        except Exception as e:
            fr["error"] = f"{type(e).__name__}: {e}"
        finally:
            dep.stop()
            save()
    if args.skip != "vllm":
        spec = json.dumps({"model": args.model, "max_model_len": args.max_model_len, "max_num_seqs": max(batches),
                           "num_blocks": args.num_blocks, "util": args.util, "batches": batches, "tokens": args.tokens,
                           "reps": args.reps})
        p = subprocess.run([args.python, "-c", VLLM_ALONE, spec], capture_output=True, text=True, timeout=900)
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        report["vllm"] = json.loads(line[7:]) if line else {"error": (p.stderr or p.stdout)[-3000:]}
        save()
    rows = []
    for b in batches:
        row = {"batch": b}
        got = {k: report.get(k, {}).get(str(b)) for k in sides}
        got["vllm"] = (report.get("vllm", {}).get("batches") or {}).get(str(b))
        for side, d in got.items():
            if d:
                dec = min(d["t_tokens_s"]) - min(d["t_one_s"])
                row[f"{side}_decode_tok_s"] = round(b * (args.tokens - 1) / dec, 1) if dec > 0 else None
        for side in sides:
            if row.get(f"{side}_decode_tok_s") and row.get("vllm_decode_tok_s"):
                row[f"{side}_overhead_pct"] = round(100 * (1 - row[f"{side}_decode_tok_s"] / row["vllm_decode_tok_s"]), 2)
        rows.append(row)
    report["table"] = rows
    save()
    for r in rows:
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
