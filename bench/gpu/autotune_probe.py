#!/usr/bin/env python3
"""Does Inductor's timing of a compiled reduction change its result, and does
TORCHINDUCTOR_DETERMINISTIC=1 (what `frmps serve --exact` sets) fix it?

vLLM compiles its models with torch.compile; Inductor lowers the fused residual
add and RMSNorm (vllm.ir.ops.fused_add_rms_norm, its native form, as the engines'
`triton_red_fused_fused_add_rms_norm_*` kernels) to a Triton reduction with
several candidate block sizes and warp counts. Unless Inductor is in its
deterministic mode it times the candidates when the kernel first runs in a process
and keeps the fastest: a choice made by one process, from what else ran on the GPU
while it timed. A reduction's rounding depends on that choice. Two engines of one
deployment could then compute a token differently.

This runs that function in fresh processes, each with its own empty Inductor cache
(so each one compiles and times), at the hidden sizes given (5120: Qwen2.5-14B,
3584: 7B, 896: 0.5B), on the same seeded inputs, and hashes every output:

- timed, with the choice forced to each candidate in turn (the timing replaced by
  the forced order; a negative control: if the candidates round alike, the check
  below cannot see a difference either, and the run says so);
- timed, as Inductor chooses (--runs processes);
- deterministic (TORCHINDUCTOR_DETERMINISTIC=1, pinned as the engines pin it
  under --exact), with the same forcing: no reduction is timed, so every process
  computes the same bits.

Prints one line per process and a summary; writes --out (JSON). Exit status 0
when the deterministic processes agree bit for bit and timed ones were seen to
time at least one reduction; 1 otherwise.

    python3 bench/gpu/autotune_probe.py --out autotune-probe.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

SIZES = (1, 7, 64, 300, 2048)


def child(hidden: list[int], force: int, seed: int) -> dict:
    """One process: compile fused_add_rms_norm per hidden size (dynamic in the
    token count, as vLLM compiles), run it on seeded inputs, hash the outputs.
    force >= 0 replaces the timing of every timed kernel so that the candidate at
    that index (candidates in a fixed order) wins."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "vllmpatch", "src"))
    from frmps_engine.vllm.envpolicy import pin_inductor_deterministic

    pin_inductor_deterministic(os.environ)  # as the engines do under --exact (TORCHINDUCTOR_DETERMINISTIC=1)
    import torch
    from torch._inductor.runtime import triton_heuristics as th

    timed: list[dict] = []
    orig = th.CachingAutotuner.benchmark_all_configs

    def benchmark_all_configs(self, *args, **kwargs):
        timings = orig(self, *args, **kwargs)
        order = sorted(timings, key=lambda launcher: str(launcher.config))
        pick = order[force % len(order)] if force >= 0 else min(timings, key=timings.get)
        if force >= 0:
            timings = {launcher: (0.0 if launcher is pick else 1.0 + v) for launcher, v in timings.items()}
        timed.append({"kernel": self.fn.__name__, "candidates": len(order), "chosen": order.index(pick),
                      "config": str(pick.config)})
        return timings

    th.CachingAutotuner.benchmark_all_configs = benchmark_all_configs

    def fused_add_rms_norm(x, residual, weight, eps: float):
        orig_dtype = x.dtype
        x = x.to(torch.float32) + residual.to(torch.float32)
        residual = x.to(orig_dtype)
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        x = x * torch.rsqrt(variance + eps)
        return (x.to(weight.dtype) * weight).to(orig_dtype), residual

    fn = torch.compile(fused_add_rms_norm, dynamic=True)
    hashes: dict[str, str] = {}
    g = torch.Generator(device="cuda").manual_seed(seed)
    for h in hidden:
        weight = (1 + 0.1 * torch.randn(h, generator=g, device="cuda")).to(torch.bfloat16)
        for n in SIZES:
            x = (4 * torch.randn(n, h, generator=g, device="cuda")).to(torch.bfloat16)
            res = (4 * torch.randn(n, h, generator=g, device="cuda")).to(torch.bfloat16)
            out, new_res = fn(x, res, weight, 1e-6)
            torch.cuda.synchronize()
            d = hashlib.sha256(out.view(torch.int16).cpu().numpy().tobytes())
            d.update(new_res.view(torch.int16).cpu().numpy().tobytes())
            hashes[f"{h}x{n}"] = d.hexdigest()[:16]
    import torch._inductor.config as ic

    return {"force": force, "deterministic": bool(ic.deterministic), "timed": timed, "hashes": hashes,
            "torch": torch.__version__, "device": torch.cuda.get_device_name()}


def run_child(args, force: int, deterministic: bool) -> dict:
    env = dict(os.environ)
    env.pop("TORCHINDUCTOR_DETERMINISTIC", None)
    if deterministic:
        env["TORCHINDUCTOR_DETERMINISTIC"] = "1"
    with tempfile.TemporaryDirectory(prefix="autotune-probe-") as cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache  # empty: this process compiles and times
        env["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--hidden", args.hidden,
                            "--force", str(force), "--seed", str(args.seed)],
                           env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"force": force, "deterministic": deterministic, "error": (p.stderr or p.stdout)[-2000:]}
    return json.loads(lines[-1])


def summarise(runs: list[dict]) -> dict:
    """Distinct output hashes among the timed and the deterministic processes
    (a process's outputs as one tuple), the timed reductions seen, failures."""
    def distinct(rs):
        return len({tuple(sorted(r["hashes"].items())) for r in rs})

    ok = [r for r in runs if "hashes" in r]
    timed = [r for r in ok if not r["deterministic"]]
    det = [r for r in ok if r["deterministic"]]
    forced = [r for r in timed if r["force"] >= 0]
    return {
        "processes": len(runs), "failed": len(runs) - len(ok),
        "timed_processes": len(timed), "timed_distinct_outputs": distinct(timed) if timed else 0,
        "timed_forced_distinct_outputs": distinct(forced) if forced else 0,
        "timed_kernels_in_timed_processes": max((len(r["timed"]) for r in timed), default=0),
        "deterministic_processes": len(det), "deterministic_distinct_outputs": distinct(det) if det else 0,
        "timed_kernels_in_deterministic_processes": max((len(r["timed"]) for r in det), default=0),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", default="5120,3584,896", help="hidden sizes, comma-separated")
    ap.add_argument("--forces", type=int, default=3, help="forced choices 0..N-1, in each mode")
    ap.add_argument("--runs", type=int, default=1, help="processes that time as Inductor does (nothing forced)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per process")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "autotune-probe.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--force", type=int, default=-1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child([int(h) for h in args.hidden.split(",")], args.force, args.seed)), flush=True)
        return 0
    plan = ([(f, False) for f in range(args.forces)] + [(-1, False)] * args.runs
            + [(f, True) for f in range(args.forces)] + [(-1, True)] * args.runs)
    runs = []
    for force, det in plan:
        r = run_child(args, force, det)
        runs.append(r)
        what = f"{'deterministic' if det else 'timed'} force={force}"
        if "error" in r:
            print(f"{what}: failed: {r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'}", flush=True)
            continue
        kinds = ", ".join(f"{t['kernel']} {t['chosen']}/{t['candidates']}" for t in r["timed"]) or "none timed"
        print(f"{what}: outputs {','.join(r['hashes'][k][:8] for k in sorted(r['hashes']))}; {kinds}", flush=True)
    s = summarise(runs)
    print(json.dumps(s), flush=True)
    with open(args.out, "w") as f:
        json.dump({"summary": s, "runs": runs, "sizes": SIZES, "hidden": args.hidden}, f, indent=1)
    good = s["failed"] == 0 and s["deterministic_distinct_outputs"] == 1 and s["timed_kernels_in_timed_processes"] > 0
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
