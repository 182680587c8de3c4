#!/usr/bin/env python3
"""Speed and memory of the reference engine under different cuBLAS workspace sizes
(GPU machine). torch gives every (cuBLAS handle, stream) pair a workspace, 32 MiB on
Hopper by default; CUBLAS_WORKSPACE_CONFIG=:SIZE_KIB:COUNT shrinks it. A standby
keeps its workspace for its whole life, so a smaller one is memory every standby
saves, if the GEMMs do not get slower.

Each configuration runs in its own process (torch reads the variable once), and the
configurations alternate over --rounds, so drift weighs on all alike. Per model:
median exact-mode decode step at batch 8 and at --big-batch, a 2,048-token prefill,
the process's GPU memory (nvidia-smi) and torch's reserved memory without the pools.

    python3 bench/gpu/workspace_speed.py --models qwen2.5-0.5b,qwen2.5-14b --configs default,:4096:1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def child(model: str, big: int, steps: int) -> dict:
    import torch

    from frmps_engine.refengine import EngineConfig, RefCore, SamplingParams

    cfg = EngineConfig.from_preset(model, device="cuda", max_num_seqs=big, max_model_len=4096,
                                   num_blocks=big * 24 + 160, exact=True)
    pools = RefCore.allocate_pools(cfg)
    pool_bytes = sum(t.numel() for t in pools.values())
    core = RefCore(cfg, pools, load_weights=True)
    core.warmup()
    torch.cuda.synchronize()
    res: dict = {"model": model, "config": os.environ.get("CUBLAS_WORKSPACE_CONFIG", "default")}
    # Prefill: one 2,048-token prompt (exact mode: aligned chunks, padded GEMMs).
    core.add_request(1, list(range(100, 2148)), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while core.has_work():
        core.step()
    torch.cuda.synchronize()
    res["prefill_2048_ms"] = round(1e3 * (time.perf_counter() - t0), 3)
    core.request_views()
    for label, n in (("decode_b8_ms", 8), (f"decode_b{big}_ms", big)):
        keys = list(range(1000 * n, 1000 * n + n))
        for k in keys:
            core.add_request(k, [5 + k % 200] * 64, SamplingParams(max_tokens=steps + 40, temperature=0.0,
                                                                    ignore_eos=True))
        while core.num_waiting() or any(len(r.token_ids) == r.num_prompt for r in core.scheduler.requests.values()):
            core.step()
        for _ in range(5):
            core.step()
        times = []
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t0)
        times.sort()
        res[label] = round(1e3 * times[len(times) // 2], 4)
        for k in keys:
            core.abort(k)
        core.request_views()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    res["torch_reserved_mib_without_pools"] = round((torch.cuda.memory_reserved() - pool_bytes) / 2**20, 1)
    q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, timeout=30).stdout
    for line in q.splitlines():
        p, m = (x.strip() for x in line.split(","))
        if p == str(os.getpid()):
            res["process_mib_without_pools"] = round(int(m) - pool_bytes / 2**20, 1)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-14b")
    ap.add_argument("--configs", default="default,:4096:1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--big-batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--child", default="")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.big_batch, a.steps)), flush=True)
        return 0
    rows = []
    for model in a.models.split(","):
        for rnd in range(a.rounds):
            cfgs = a.configs.split(",")
            for c in (cfgs if rnd % 2 == 0 else cfgs[::-1]):
                env = dict(os.environ)
                env.pop("CUBLAS_WORKSPACE_CONFIG", None)
                if c != "default":
                    env["CUBLAS_WORKSPACE_CONFIG"] = c
                p = subprocess.run([sys.executable, __file__, "--child", model, "--big-batch", str(a.big_batch),
                                    "--steps", str(a.steps)], env=env, capture_output=True, text=True, timeout=600)
                if p.returncode:
                    print(f"{model} {c}: failed\n{p.stderr[-2000:]}", file=sys.stderr)
                    continue
                r = json.loads(p.stdout.strip().splitlines()[-1])
                r["round"] = rnd
                rows.append(r)
                print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
