"""Is a test model's output decided by its context (its KV cache)?

``python -m bench.sensitivity --model DIR [--engine ref|transformers|vllm[,...]]
[--pairs 12] [--context 60] [--tokens 32] [--baselines] [--out JSON]``

An exactness check (a resumed request reproduces the no-fault output) proves
something about the KV cache only if the output depends on it. This tool makes
``--pairs`` pairs of prompts of ``--context`` + 1 tokens that differ in every
context token and share only the last one, generates ``--tokens`` tokens for
each greedily and by seeded sampling (temperature 1, the two prompts of a pair
with the same seed, so the sampler's random numbers are the same), and reports
(``--differ-at POS``: the two prompts differ only at that context position):

- ``greedy_identical`` / ``seeded_identical``: the fraction of pairs whose
  continuations are identical (a context-blind model: 1; wanted: ~0), and the
  median position of the first difference;
- ``distinct``: distinct tokens / tokens per continuation (mean, min), and
  ``looping``: the fraction of continuations whose second half repeats with a
  period of at most 4 tokens;
- ``seeded_first_is_greedy``: how often a prompt's first sampled token is its
  greedy one (near the top-1 probability when the distribution decides the
  sample, near 0 when the sampler's noise does);
- ``top1_prob`` and ``margin`` (top-1 minus top-2 logit, nats) over the
  greedy positions: percentiles 10/50/90;
- with ``--baselines``: the same for weights of the same shapes drawn as vLLM's
  dummy weights (uniform +-1e-3, norms included; with --engine vllm it is
  vLLM's own load_format="dummy") and as normal(0, 0.02) with unit norms;
- with two engines: how often their greedy continuations agree.

A row's verdict is "sensitive" when greedy and seeded identical fractions are
<= 0.1, the median top-1 probability >= 0.3 and the mean distinct ratio >= 0.5.

Engines: ``ref`` (frmps's reference engine, float32 on the CPU), ``transformers``
(Qwen2ForCausalLM from the same files; sampling through the reference
engine's sampler, so seeded rows compare like for like), ``vllm`` (``vllm.LLM``
on a GPU, bfloat16; each weight set in its own process). Seeded sampling
uses each engine's own sampler for ref and vllm.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from .procs import with_bench_path

WEIGHT_FILES = (".safetensors", ".safetensors.index.json", "frmps_weights.json")


@dataclass
class Gen:
    """Continuations of every prompt, and (greedy runs) per-position top-1 probability and margin."""

    tokens: list[list[int]]
    top1: list[float]
    margin: list[float]


# ---- prompts and measures -------------------------------------------------------------------


def make_pairs(vocab: int, pairs: int, context: int, seed: int = 0,
               differ_at: int | None = None) -> list[tuple[list[int], list[int]]]:
    """``pairs`` pairs of prompts of context + 1 regular tokens that end with the
    same token: the two differ in every context position, or (``differ_at``) only
    at that one position (0: the first token, the farthest from the end)."""
    from frmps_engine.modeldir import regular_tokens

    if differ_at is not None and not 0 <= differ_at < context:
        raise ValueError(f"differ_at {differ_at} is outside the context (0..{context - 1})")
    top = regular_tokens(vocab) if vocab > 300 else vocab
    rng = random.Random(seed)
    out = []
    for _ in range(pairs):
        a = [rng.randrange(top) for _ in range(context)]
        b = list(a)
        for j, t in enumerate(a):
            u = rng.randrange(top - 1)
            if differ_at is None or j == differ_at:
                b[j] = u + 1 if u >= t else u  # any token but a's
        last = rng.randrange(top)
        out.append((a + [last], b + [last]))
    return out


def first_difference(x: list[int], y: list[int]) -> int | None:
    for i, (s, t) in enumerate(zip(x, y)):
        if s != t:
            return i
    return None if len(x) == len(y) else min(len(x), len(y))


def looping(toks: list[int], max_period: int = 4) -> bool:
    """The second half of toks repeats with a period of at most max_period."""
    half = toks[len(toks) // 2:]
    for p in range(1, max_period + 1):
        if len(half) > p and all(half[i] == half[i - p] for i in range(p, len(half))):
            return True
    return False


def percentiles(xs: list[float], ps=(10, 50, 90)) -> dict[str, float | None]:
    if not xs:
        return {f"p{p}": None for p in ps}
    s = sorted(xs)
    out = {}
    for p in ps:
        k = (len(s) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        out[f"p{p}"] = s[lo] + (s[hi] - s[lo]) * (k - lo)
    return out


def pair_stats(gen: Gen) -> dict[str, Any]:
    conts = gen.tokens
    n = len(conts) // 2
    firsts = [first_difference(conts[2 * i], conts[2 * i + 1]) for i in range(n)]
    diff = [f for f in firsts if f is not None]
    return {
        "identical": sum(f is None for f in firsts) / n if n else None,
        "first_difference_median": percentiles([float(f) for f in diff], (50,))["p50"],
        "first_differences": firsts,
    }


def measure(greedy: Gen, seeded: Gen) -> dict[str, Any]:
    g, s = pair_stats(greedy), pair_stats(seeded)
    distinct = [len(set(c)) / len(c) for c in greedy.tokens if c]
    distinct_s = [len(set(c)) / len(c) for c in seeded.tokens if c]
    row = {
        "greedy_identical": g["identical"],
        "greedy_first_difference_median": g["first_difference_median"],
        "greedy_first_differences": g["first_differences"],
        "seeded_identical": s["identical"],
        "seeded_first_difference_median": s["first_difference_median"],
        "seeded_first_differences": s["first_differences"],
        "distinct_mean": sum(distinct) / len(distinct) if distinct else None,
        "distinct_min": min(distinct) if distinct else None,
        "distinct_seeded_mean": sum(distinct_s) / len(distinct_s) if distinct_s else None,
        "looping": sum(looping(c) for c in greedy.tokens) / len(greedy.tokens) if greedy.tokens else None,
        # Seeded first token = greedy first token (same prompt): about the top-1
        # probability when the distribution decides, about 1/vocab when the noise does.
        "seeded_first_is_greedy": (
            sum(a[:1] == b[:1] for a, b in zip(greedy.tokens, seeded.tokens)) / len(greedy.tokens)
            if greedy.tokens else None),
        "top1_prob": percentiles(greedy.top1),
        "margin": percentiles(greedy.margin),
        "positions": len(greedy.top1),
        "greedy_tokens": greedy.tokens,
        "seeded_tokens": seeded.tokens,
    }
    row["verdict"], row["reasons"] = verdict(row)
    return row


def verdict(row: dict) -> tuple[str, list[str]]:
    why = []
    if row["greedy_identical"] is None or row["greedy_identical"] > 0.1:
        why.append(f"greedy identical {row['greedy_identical']}")
    if row["seeded_identical"] is None or row["seeded_identical"] > 0.1:
        why.append(f"seeded identical {row['seeded_identical']}")
    p50 = row["top1_prob"]["p50"]
    if p50 is None or p50 < 0.3:
        why.append(f"median top-1 probability {p50 if p50 is None else round(p50, 4)}")
    if row["distinct_mean"] is None or row["distinct_mean"] < 0.5:
        why.append(f"distinct ratio {row['distinct_mean']}")
    return ("sensitive" if not why else "INSENSITIVE"), why


# ---- engines ----------------------------------------------------------------------------------


def _top_stats(logits) -> tuple[list[float], list[float]]:
    import torch

    lp = torch.log_softmax(logits.float(), dim=-1)
    v = lp.topk(2, dim=-1).values
    return v[:, 0].exp().tolist(), (v[:, 0] - v[:, 1]).tolist()


def run_ref(model_dir: str, prompts: list[list[int]], tokens: int, sample_seed: int,
            device: str = "cpu") -> tuple[Gen, Gen]:
    """The reference engine on the directory's weights (its safetensors loader):
    every prompt greedily and by seeded sampling, in one batch (rows are
    independent: the engine's results do not depend on the batch)."""
    import torch

    from frmps_engine.refengine import EngineConfig
    from frmps_engine.refengine.engine import RefCore
    from frmps_engine.refengine.sampling import SamplingParams

    n = len(prompts)
    mml = max(len(p) for p in prompts) + tokens + 1
    blocks = 2 * n * math.ceil(mml / 16) + 1
    cfg = EngineConfig.from_preset(model_dir, device=device, max_model_len=mml, num_blocks=blocks,
                                   max_num_seqs=2 * n)
    if cfg.weights == "dummy":
        raise SystemExit(f"{model_dir}: no *.safetensors (the reference engine would draw dummy weights)")
    stats: dict[int, tuple[list[float], list[float]]] = {k: ([], []) for k in range(2 * n)}

    class Probe(RefCore):
        def _forward(self, batch, on_launch=None):
            logits = super()._forward(batch, on_launch)
            p1, m = _top_stats(logits)
            for row, a, b in zip(batch.sampled, p1, m):
                stats[row.request.key][0].append(a)
                stats[row.request.key][1].append(b)
            return logits

    core = Probe(cfg, RefCore.allocate_pools(cfg), load_weights=True)
    reqs = [(k, p, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)) for k, p in enumerate(prompts)]
    reqs += [(n + k, p, SamplingParams(max_tokens=tokens, temperature=1.0, seed=sample_seed + k // 2, ignore_eos=True))
             for k, p in enumerate(prompts)]
    with torch.inference_mode():
        outs = core.generate(reqs)
    greedy = Gen([outs[k] for k in range(n)], [x for k in range(n) for x in stats[k][0]],
                 [x for k in range(n) for x in stats[k][1]])
    return greedy, Gen([outs[n + k] for k in range(n)], [], [])


def run_transformers(model_dir: str, prompts: list[list[int]], tokens: int, sample_seed: int,
                     device: str = "cpu") -> tuple[Gen, Gen]:
    """transformers' Qwen2ForCausalLM from the same files (float32 on the CPU,
    bfloat16 on a GPU): every prompt greedily and by seeded sampling, in one
    batch (all prompts of one length, no padding); the seeded rows sample with
    the reference engine's sampler (same seed per pair)."""
    import torch
    from transformers import Qwen2ForCausalLM

    from frmps_engine.refengine.sampling import SamplingParams, sample

    dt = torch.float32 if device == "cpu" else torch.bfloat16
    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=dt).to(device).eval()
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("transformers path: every prompt must have the same length")
    n, plen = len(prompts), len(prompts[0])
    ids = torch.tensor(prompts + prompts, dtype=torch.long, device=device)
    params = [SamplingParams(max_tokens=tokens, temperature=1.0, seed=sample_seed + k // 2) for k in range(n)]
    seeds = [sample_seed + k // 2 for k in range(n)]
    conts: list[list[int]] = [[] for _ in range(2 * n)]
    top1: list[list[float]] = [[] for _ in range(n)]
    margin: list[list[float]] = [[] for _ in range(n)]
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        for i in range(tokens):
            logits = out.logits[:, -1].float()
            p1, m = _top_stats(logits[:n])
            nxt = logits[:n].argmax(dim=-1).tolist() + sample(logits[n:], params, seeds, [plen + i] * n)
            for k in range(2 * n):
                conts[k].append(int(nxt[k]))
            for k in range(n):
                top1[k].append(p1[k])
                margin[k].append(m[k])
            if i + 1 < tokens:
                out = model(input_ids=torch.tensor(nxt, device=device)[:, None], past_key_values=out.past_key_values,
                            use_cache=True)
    del model
    return (Gen(conts[:n], [x for r in top1 for x in r], [x for r in margin for x in r]), Gen(conts[n:], [], []))


def run_vllm(model_dir: str, prompts: list[list[int]], tokens: int, sample_seed: int, dummy: bool = False,
             gpu_memory_utilization: float = 0.6) -> tuple[Gen, Gen]:
    """vLLM's LLM on the directory (load_format "dummy" when ``dummy``): greedy
    with top-2 logprobs, then seeded sampling (temperature 1, per-request seed)."""
    from vllm import LLM, SamplingParams

    mml = max(len(p) for p in prompts) + tokens + 16
    llm = LLM(model=model_dir, dtype="bfloat16", seed=0, max_model_len=mml,
              gpu_memory_utilization=gpu_memory_utilization, load_format="dummy" if dummy else "auto", max_num_seqs=max(len(prompts), 1))
    inputs = [{"prompt_token_ids": p} for p in prompts]
    g = llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=2, ignore_eos=True))
    conts, top1, margin = [], [], []
    for o in g:
        c = o.outputs[0]
        conts.append(list(c.token_ids))
        for pos in c.logprobs or []:
            lps = sorted((lp.logprob for lp in pos.values()), reverse=True)
            top1.append(math.exp(lps[0]))
            margin.append(lps[0] - lps[1] if len(lps) > 1 else float("nan"))
    s = llm.generate(inputs, [SamplingParams(temperature=1.0, max_tokens=tokens, seed=sample_seed + k // 2,
                                             ignore_eos=True) for k in range(len(prompts))])
    return Gen(conts, top1, margin), Gen([list(o.outputs[0].token_ids) for o in s], [], [])


# ---- rows -------------------------------------------------------------------------------------


def baseline_dir(model_dir: str, scheme: str, root: str) -> str:
    """A copy of model_dir's config and tokenizer with the baseline scheme's weights."""
    from frmps_engine import seeded_weights
    from frmps_engine.refengine.config import shape_from_hf_config

    out = os.path.join(root, scheme)
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(model_dir):
        src = os.path.join(model_dir, f)
        if os.path.isfile(src) and not f.endswith(WEIGHT_FILES):
            shutil.copy(src, os.path.join(out, f))
    seeded_weights.write_seeded_checkpoint(out, shape_from_hf_config(model_dir), 0, scheme=scheme)
    return out


def run_row(engine: str, model_dir: str, pairs, tokens: int, sample_seed: int, device: str,
            dummy: bool = False) -> dict[str, Any]:
    prompts = [p for ab in pairs for p in ab]
    t0 = time.monotonic()
    if engine == "vllm":
        greedy, seeded = run_vllm(model_dir, prompts, tokens, sample_seed, dummy=dummy)
    elif engine == "ref":
        greedy, seeded = run_ref(model_dir, prompts, tokens, sample_seed, device)
    elif engine == "transformers":
        greedy, seeded = run_transformers(model_dir, prompts, tokens, sample_seed, device)
    else:
        raise SystemExit(f"unknown engine {engine!r} (ref, transformers, vllm)")
    row = measure(greedy, seeded)
    row["seconds"] = round(time.monotonic() - t0, 1)
    return row


def _vllm_row_in_child(model_dir: str, args, dummy: bool) -> dict:
    """One vLLM row in its own process (a process holds one vLLM engine at a time)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, "-m", "bench.sensitivity", "--model", model_dir, "--engine", "vllm",
           "--pairs", str(args.pairs), "--context", str(args.context), "--tokens", str(args.tokens),
           "--prompt-seed", str(args.prompt_seed), "--sample-seed", str(args.sample_seed), "--row-json", path]
    if args.differ_at is not None:
        cmd += ["--differ-at", str(args.differ_at)]
    if dummy:
        cmd.append("--vllm-dummy")
    try:
        subprocess.run(cmd, check=True, env=with_bench_path(dict(os.environ)))
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    finally:
        os.unlink(path)


def _fmt(v, nd=3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _prob(v) -> str:
    return "-" if v is None else (f"{v:.3f}" if v >= 0.01 else f"{v:.1e}")


def table(rows: list[dict]) -> str:
    head = ("weights", "engine", "greedy ident", "1st diff", "seeded ident", "distinct", "loops",
            "sampled=greedy", "top1 p10/p50/p90", "margin p10/p50/p90", "verdict")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        t, m = r["top1_prob"], r["margin"]
        lines.append("| " + " | ".join([
            r["weights"], r["engine"], _fmt(r["greedy_identical"], 2), _fmt(r["greedy_first_difference_median"], 1),
            _fmt(r["seeded_identical"], 2), _fmt(r["distinct_mean"], 2), _fmt(r["looping"], 2),
            _fmt(r.get("seeded_first_is_greedy"), 2),
            f"{_prob(t['p10'])}/{_prob(t['p50'])}/{_prob(t['p90'])}",
            f"{_fmt(m['p10'], 2)}/{_fmt(m['p50'], 2)}/{_fmt(m['p90'], 2)}", r["verdict"],
        ]) + " |")
    return "\n".join(lines)


def agreement(a: dict, b: dict) -> dict:
    """How often two engines' greedy continuations agree (whole, and tokens before the first difference)."""
    same = sum(x == y for x, y in zip(a["greedy_tokens"], b["greedy_tokens"]))
    firsts = [first_difference(x, y) for x, y in zip(a["greedy_tokens"], b["greedy_tokens"])]
    total = sum(len(x) for x in a["greedy_tokens"])
    prefix = sum(len(x) if f is None else f for x, f in zip(a["greedy_tokens"], firsts))
    same_s = sum(x == y for x, y in zip(a["seeded_tokens"], b["seeded_tokens"]))
    return {"engines": [a["engine"], b["engine"]], "weights": a["weights"], "greedy_identical": same,
            "seeded_identical": same_s, "continuations": len(firsts), "agreeing_prefix_tokens": prefix,
            "tokens": total}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sensitivity", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True,
                   help="model directory with safetensors (frmps model init --weights seeded)")
    p.add_argument("--engine", default="ref", help="ref, transformers, vllm, or a comma list (ref,transformers)")
    p.add_argument("--pairs", type=int, default=12)
    p.add_argument("--context", type=int, default=60, help="context tokens before the shared last one")
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--prompt-seed", type=int, default=0)
    p.add_argument("--differ-at", type=int, metavar="POS",
                   help="the prompts of a pair differ only at this context position (default: at every one); "
                        "0 asks whether the first token, the farthest from the end, still decides the output")
    p.add_argument("--sample-seed", type=int, default=1234, help="seed of the seeded rows (pair i: this + i)")
    p.add_argument("--device", default="cpu", help="ref and transformers: cpu or cuda")
    p.add_argument("--baselines", action="store_true",
                   help="also measure vLLM-style uniform +-1e-3 weights and normal(0, 0.02) of the same shapes")
    p.add_argument("--baseline-engines", help="engines of the baseline rows (default: --engine)")
    p.add_argument("--baseline-dir", help="where to write the baseline checkpoints (default: a temporary directory)")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--row-json", help=argparse.SUPPRESS)  # internal: one vLLM row, in a child process
    p.add_argument("--vllm-dummy", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.pairs < 1 or args.context < 1 or args.tokens < 2:
        p.error("--pairs and --context must be >= 1, --tokens >= 2")
    model_dir = os.path.abspath(args.model)
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        vocab = int(json.load(f)["vocab_size"])
    try:
        pairs = make_pairs(vocab, args.pairs, args.context, args.prompt_seed, args.differ_at)
    except ValueError as e:
        p.error(str(e))

    if args.row_json:
        row = run_row("vllm", model_dir, pairs, args.tokens, args.sample_seed, "cuda", dummy=args.vllm_dummy)
        with open(args.row_json, "w", encoding="utf-8") as f:
            json.dump(row, f)
        return 0

    engines = [e.strip() for e in args.engine.split(",") if e.strip()]
    base_engines = [e.strip() for e in (args.baseline_engines or args.engine).split(",") if e.strip()]
    from frmps_engine import seeded_weights

    desc = seeded_weights.read_description(model_dir)
    name = (f"{desc['scheme']['name']} seed {desc['seed']}" if desc else os.path.basename(model_dir))
    sets: list[tuple[str, str, bool]] = [(name, model_dir, False)]
    tmp = None
    if args.baselines:
        root = args.baseline_dir or tempfile.mkdtemp(prefix="frmps-sensitivity-")
        tmp = None if args.baseline_dir else root
        if engines != ["vllm"]:  # vLLM alone: its own dummy weights are that baseline
            sets.append(("uniform ±1e-3", baseline_dir(model_dir, "uniform", root), False))
        sets.append(("normal(0,0.02)", baseline_dir(model_dir, "normal", root), False))
        if "vllm" in engines:
            sets.append(("vLLM dummy", model_dir, True))
    rows: list[dict] = []
    try:
        for wname, d, dummy in sets:
            for e in engines:
                if dummy and e != "vllm":
                    continue
                if wname != name and e not in base_engines:
                    continue
                if e == "vllm":
                    row = _vllm_row_in_child(d, args, dummy)
                else:
                    row = run_row(e, d, pairs, args.tokens, args.sample_seed, args.device)
                row.update(weights=wname, engine=e, model_dir=d)
                rows.append(row)
                print(f"{wname} / {e}: {row['verdict']} ({row['seconds']} s)", file=sys.stderr, flush=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    agree = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if a["weights"] == b["weights"] and a["engine"] != b["engine"]:
                agree.append(agreement(a, b))
    print(table(rows))
    for a in agree:
        print(f"{a['weights']}: {a['engines'][0]} vs {a['engines'][1]}: greedy continuations identical "
              f"{a['greedy_identical']}/{a['continuations']}, seeded {a['seeded_identical']}/{a['continuations']}, "
              f"tokens before the first difference {a['agreeing_prefix_tokens']}/{a['tokens']}")
    if args.out:
        from .envinfo import git_commit

        doc = {"model": model_dir, "weights": desc, "pairs": args.pairs, "context": args.context,
               "differ_at": args.differ_at,
               "tokens": args.tokens, "prompt_seed": args.prompt_seed, "sample_seed": args.sample_seed,
               "device": args.device, "commit": git_commit(), "command": " ".join(sys.argv),
               "rows": rows, "agreement": agree}
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return 0 if rows and rows[0]["verdict"] == "sensitive" else 1


if __name__ == "__main__":
    sys.exit(main())
