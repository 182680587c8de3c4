#!/usr/bin/env python3
"""Decode speed of the reference engine against the memory-bandwidth bound.

Every decode step must read all weights once, so a step cannot be faster than
weight bytes / memory bandwidth (H100 SXM: 3.35 TB/s). This prints, per model
and batch size, the measured step time next to that bound.

    python bench/engine_speed.py                                  # GPU: 0.5b and 7b, batch 1/8/32
    python bench/engine_speed.py --device cpu --model tiny        # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vllmpatch", "src"))

import torch  # noqa: E402

from frmps_engine.refengine import EngineConfig, RefCore, SamplingParams, weights_bytes  # noqa: E402


def sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def bench_model(args, model: str) -> list[dict]:
    batches = [int(b) for b in args.batch.split(",")]
    bmax = max(batches)
    per_seq = -(-(args.context + args.steps + args.warmup + 2) // 16)
    kw = dict(max_num_seqs=max(bmax, 1), max_num_batched_tokens=max(args.context * bmax, 512))
    if args.device != "cpu":
        kw.update(cuda_graphs=not args.no_graphs, attention=args.attention)
    if args.no_batch_invariant:
        kw.update(batch_invariant=False)
    cfg = EngineConfig.from_preset(model, device=args.device, num_blocks=bmax * per_seq + 1,
                                   max_model_len=max(args.context + args.steps + args.warmup + 16, 256),
                                   dtype=args.dtype, **kw)
    t0 = time.perf_counter()
    core = RefCore(cfg, RefCore.allocate_pools(cfg), load_weights=True)
    sync(args.device)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    core.warmup()
    warm_s = time.perf_counter() - t0
    wbytes = weights_bytes(cfg)
    bound_ms = wbytes / args.bandwidth * 1e3
    print(f"# {model}: {wbytes / 1e9:.2f} GB of weights ({cfg.dtype}), bound {bound_ms:.3f} ms/step "
          f"at {args.bandwidth / 1e12:.2f} TB/s; init {load_s:.1f}s, graph capture {warm_s:.1f}s", flush=True)
    g = torch.Generator().manual_seed(0)
    rows = []
    key = 0
    for b in batches:
        keys = []
        for _ in range(b):
            key += 1
            keys.append(key)
            prompt = torch.randint(0, 256, (args.context,), generator=g).tolist()
            core.add_request(key, prompt, SamplingParams(max_tokens=args.steps + args.warmup + 4,
                                                         temperature=0.0, ignore_eos=True))
        sync(args.device)
        t0 = time.perf_counter()
        produced = 0
        while produced < b:  # prefill until every request has its first token
            produced += sum(1 for o in core.step() if o.output_index == 0)
        sync(args.device)
        prefill_s = time.perf_counter() - t0
        for _ in range(args.warmup):
            core.step()
        times = []
        gs0 = core.counters["graph_steps"]
        for _ in range(args.steps):
            sync(args.device)
            t = time.perf_counter()
            outs = core.step()
            sync(args.device)
            times.append(time.perf_counter() - t)
            assert len(outs) == b, f"expected {b} decodes, got {len(outs)}"
        for k in keys:
            core.abort(k)
        med = statistics.median(times) * 1e3
        row = dict(model=model, device=args.device, dtype=cfg.dtype, batch=b, context=args.context,
                   step_ms_median=round(med, 3), step_ms_mean=round(statistics.fmean(times) * 1e3, 3),
                   step_ms_p90=round(sorted(times)[int(0.9 * (len(times) - 1))] * 1e3, 3),
                   tokens_per_s=round(b / (med / 1e3), 1), bound_ms=round(bound_ms, 3),
                   x_bound=round(med / bound_ms, 2), graph_steps=core.counters["graph_steps"] - gs0,
                   prefill_ms=round(prefill_s * 1e3, 1))
        rows.append(row)
        vs_bound = (f"   bound {bound_ms:7.3f} ms  = {row['x_bound']:.2f}x bound  graphs {row['graph_steps']}/{args.steps}"
                    if args.device != "cpu" else "")
        print(f"{model:>14} batch {b:>3}: step {med:8.3f} ms (mean {row['step_ms_mean']:.3f}, p90 {row['step_ms_p90']:.3f})"
              f"  {row['tokens_per_s']:9.1f} tok/s{vs_bound}  prefill({b}x{args.context}) {row['prefill_ms']:.1f} ms",
              flush=True)
    del core
    if args.device != "cpu":
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="comma-separated presets (default: qwen2.5-0.5b,qwen2.5-7b on GPU)")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=50, help="timed decode steps per batch size")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--attention", default="triton", choices=["triton", "torch"])
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--no-batch-invariant", action="store_true", help="CPU: do not pad GEMMs to 16 rows")
    ap.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s for the bound (H100 SXM HBM3)")
    ap.add_argument("--threads", type=int, default=0, help="CPU: torch threads (0 = torch default)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    models = args.model or ("qwen2.5-0.5b,qwen2.5-7b" if args.device != "cpu" else "tiny")
    if args.device != "cpu":
        print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    else:
        print(f"# cpu, torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    rows = []
    for m in models.split(","):
        rows += bench_model(args, m.strip())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
