#!/usr/bin/env python3
"""Where a standby's GPU memory goes, beyond the CUDA context (GPU machine).

Builds a reference-engine core the way a standby does (no weight load, exact mode,
decode graph captured, warm-up, allocator cache emptied) on private pools, then
prints torch's allocator segments grouped by (pool, stream, size) and the process's
memory as nvidia-smi sees it, next to a bare context measured in a child process.
Pool memory (weights, KV) is excluded: it is the shared memory a real standby maps.

    python3 bench/gpu/standby_mem_probe.py --model qwen2.5-0.5b [--max-num-seqs 8]
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time


def smi_mib(pid: int) -> int | None:
    q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, timeout=30)
    for line in q.stdout.splitlines():
        p, m = (x.strip() for x in line.split(","))
        if p == str(pid):
            return int(m)
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    a = ap.parse_args()
    bare = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "ctx_mem.py")],
                          capture_output=True, text=True, timeout=120).stdout.strip()
    from frmps_engine.refengine.config import apply_cuda_env

    apply_cuda_env("cuda")  # the engine's cuBLAS workspace unless the environment sets one
    import torch

    from frmps_engine.refengine import EngineConfig, RefCore

    cfg = EngineConfig.from_preset(a.model, device="cuda", max_num_seqs=a.max_num_seqs)
    pools = RefCore.allocate_pools(cfg)
    pool_bytes = sum(t.numel() for t in pools.values())
    pool_mib = pool_bytes / 2**20
    stages = []

    def stage(name: str) -> None:
        torch.cuda.synchronize()
        m = smi_mib(os.getpid())
        stages.append((name, None if m is None else m - pool_mib, (torch.cuda.memory_reserved() - pool_bytes) / 2**20))

    stage("context + pools")
    core = RefCore(cfg, pools, load_weights=False)
    stage("core built (no weights)")
    core.warmup(on_stage=stage)  # the standby's own warm-up, measured after each of its stages
    for name, m, r in stages:
        print(f"  stage {name:45s} process {m if m is None else round(m)} MiB (pools excluded), "
              f"torch reserved {r:.1f} MiB")
    time.sleep(0.3)
    total = smi_mib(os.getpid())
    reserved = torch.cuda.memory_reserved()
    groups: dict = collections.Counter()
    for seg in torch.cuda.memory_snapshot():
        lo, hi = seg["address"], seg["address"] + seg["total_size"]
        if any(lo <= t.data_ptr() < hi for t in pools.values()):
            continue  # a pool's segment: shared memory in a real standby
        key = (str(seg.get("segment_pool_id")), seg.get("stream"), seg["segment_type"])
        groups[key] += seg["total_size"]
    print(bare)
    print(f"{a.model} exact, max_num_seqs {a.max_num_seqs}: process {total} MiB on nvidia-smi, of which "
          f"pools {pool_bytes / 2**20:.0f} MiB; torch reserved {reserved / 2**20:.1f} MiB incl. pools "
          f"({(reserved - pool_bytes) / 2**20:.1f} MiB without)")
    for (pool, stream, kind), size in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  segments pool={pool} stream={stream} {kind}: {size / 2**20:.1f} MiB")
    print(f"  cuBLAS workspace size per handle/stream: "
          f"{getattr(torch._C, '_cuda_getCublasWorkspaceSize', lambda: 'unknown')()}  "
          f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG', '(default)')}")
    without = total - pool_bytes / 2**20 if total is not None else None
    print(f"  => standby-equivalent process memory (pools excluded): {without:.0f} MiB" if without else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
