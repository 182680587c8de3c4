#!/usr/bin/env python3
"""The margin bound B of "exact" (bench/README.md, "What exact means") for vLLM, measured.

No-fault runs that differ only in batch composition: each of --prompts prompts
generated alone (greedy, top-2 logprobs), then all of them in one batch with
--fillers other prompts of other lengths. Where a prompt's two outputs first
differ, the alone run's top-1/top-2 logprob margin there is a near tie that a
pass shape flipped; B = the largest such margin x --safety (0 when none differ:
then nothing is excused). Prints every disagreement, the share of prompts that
disagree and B, and writes them to --out (JSON). Run it with and without
--batch-invariant (VLLM_BATCH_INVARIANT=1 and TORCHINDUCTOR_DETERMINISTIC=1, set before vLLM is
imported, as `frmps serve --exact` sets them): if
prompts disagree at margins that are not small without it, a vLLM proof needs
batch-invariant kernels (or a pass-shape discipline) to claim exactness.

    python3 bench/gpu/margin_bound.py --model /models/qwen2.5-7b --out margin-7b.json
    python3 bench/gpu/margin_bound.py --model /models/qwen2.5-7b --batch-invariant --out margin-7b-bi.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "vllmpatch", "src"))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # the bench package

TEXT = ("The standby engine keeps its weights mapped and waits; when the active dies it adopts the requests, "
        "their KV blocks and their sampling state, and continues every stream where the client left it. ")


def prompt(i: int, filler: bool = False) -> str:
    n = 40 + (i * 37) % 400 if not filler else 20 + (i * 53) % 900
    words = (TEXT * 40).split()
    start = (i * 11) % 50
    return (f"Filler {i}: " if filler else f"Prompt {i}: ") + " ".join(words[start:start + n])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hugging Face model directory")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--fillers", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--safety", type=float, default=2.0)
    ap.add_argument("--batch-invariant", action="store_true",
                    help="VLLM_BATCH_INVARIANT=1 and TORCHINDUCTOR_DETERMINISTIC=1, as frmps serve --exact sets them")
    ap.add_argument("--inductor-timing", action="store_true",
                    help="with --batch-invariant: leave TORCHINDUCTOR_DETERMINISTIC unset, so that Inductor times its "
                         "reductions' candidates in this process, as frmps serve --exact did before it set the variable")
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile and CUDA graphs")
    ap.add_argument("--attention-backend", default="", help="vLLM's attention backend (e.g. TRITON_ATTN; default: vLLM's choice)")
    ap.add_argument("--keep-aot", action="store_true",
                    help="with --batch-invariant: keep vLLM's AOT compile on (FRMPS_DEBUG_BI_KEEP_AOT=1, the engines' "
                         "experiment; vLLM 0.26 turns it off in batch-invariant mode); the engine core runs in this "
                         "process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the switch reaches its worker. Run it "
                         "twice: the second run loads the compiled model the first saved, as a restored engine does")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--out", default="margin_bound.json")
    ap.add_argument("--token-log", default="",
                    help="append every generated output to <dir>/tokens-<pid>.jsonl as the engines' FRMPS_DEBUG_TOKEN_LOG "
                         "does, so that `python3 -m bench.token_logs <dir>` compares runs in separate processes "
                         "(session.sh engine-repeat)")
    args = ap.parse_args()
    deterministic = args.batch_invariant and not args.inductor_timing  # Inductor's mode, as under --exact
    if args.batch_invariant:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
    if deterministic:
        from frmps_engine.vllm.envpolicy import INDUCTOR_DETERMINISTIC_ENV, pin_inductor_deterministic

        # pinned as the engines pin it, in this process: vLLM's engine core runs here
        os.environ[INDUCTOR_DETERMINISTIC_ENV] = "1"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        pin_inductor_deterministic(os.environ)
    if args.keep_aot:
        if not args.batch_invariant or args.enforce_eager:
            ap.error("--keep-aot wants --batch-invariant, without --enforce-eager")
        from frmps_engine.vllm.envpolicy import BI_KEEP_AOT_ENV, keep_aot_in_batch_invariant_mode

        os.environ[BI_KEEP_AOT_ENV] = "1"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if not keep_aot_in_batch_invariant_mode(os.environ):
            print("--keep-aot: this vLLM does not turn the AOT compile off in batch-invariant mode", flush=True)
    from vllm import LLM, SamplingParams

    from bench import exactness, token_logs

    extra = {"enforce_eager": True} if args.enforce_eager else {}
    if args.attention_backend:
        extra["attention_backend"] = args.attention_backend
    if deterministic:
        from frmps_engine.vllm.envpolicy import exact_compilation_config

        extra["compilation_config"] = exact_compilation_config(None)  # as the engines' under --exact
    llm = LLM(model=args.model, seed=0, gpu_memory_utilization=args.gpu_memory_utilization, **extra)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=2)
    prompts = [prompt(i) for i in range(args.prompts)]

    def run(ps):
        outs = llm.generate(ps, sp, use_tqdm=False)
        toks = [list(o.outputs[0].token_ids) for o in outs]
        if args.token_log:
            token_logs.append(args.token_log, [o.prompt_token_ids for o in outs], toks)
        margins = [[exactness.top2_margin({k: v.logprob for k, v in pos.items()}) for pos in o.outputs[0].logprobs]
                   for o in outs]
        return toks, margins

    alone_t, alone_m = [], []
    for p in prompts:
        t, m = run([p])
        alone_t.append(t[0])
        alone_m.append(m[0])
    batched_t, _ = run(prompts + [prompt(i, filler=True) for i in range(args.fillers)])
    bound, seen = exactness.margin_bound_from_runs(alone_t, alone_m, batched_t[:len(prompts)], args.safety)
    for d in seen:
        print(f"prompt {d.index}: alone and batched differ first at token {d.position}, "
              f"alone-run top-2 margin {d.margin:.5f}")
    smallest = [min(m) for m in alone_m]
    rec = {
        "model": args.model, "batch_invariant": args.batch_invariant, "enforce_eager": args.enforce_eager,
        "keep_aot": args.keep_aot, "inductor_deterministic": deterministic,
        "attention_backend": args.attention_backend or "vLLM's choice", "prompts": args.prompts,
        "fillers": args.fillers, "max_tokens": args.max_tokens, "safety": args.safety,
        "disagreeing_prompts": len(seen), "bound": bound,
        "disagreements": [d.__dict__ for d in seen],
        "smallest_margin_per_prompt": smallest,
    }
    print(f"{len(seen)}/{args.prompts} prompts differ between alone and batched; margin bound B = {bound:.5f} "
          f"(largest disagreeing margin x {args.safety}); batch-invariant {'on' if args.batch_invariant else 'off'}, "
          f"eager {'on' if args.enforce_eager else 'off'}, attention {args.attention_backend or 'default'}")
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
