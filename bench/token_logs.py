"""The engines' own token logs, compared across engines.

With FRMPS_DEBUG_TOKEN_LOG=<dir> (the GPU proofs set it) every engine appends one JSON line
per finished request to <dir>/tokens-<pid>.jsonl: its finish time `t`, the prompt's token ids,
the output's token ids and the engine's pid. This reads any number of such folders (or
.tar.gz packs of them) and says, per prompt, how many different outputs the engines gave,
which engine gave each one first, and where each differs from the prompt's reference.

The reference of a prompt is the output of its first completion (`--reference first`: what
the proofs compare with, the no-fault run's) or its most frequent output (`majority`). A
prompt with more than one output is a difference; the exit status is 1 when there is one.

    python3 -m bench.token_logs DIR_OR_TGZ [...] [--reference first|majority] [--json OUT]

Where outputs differ, the table tells apart an engine that computes differently from the
others (all of its outputs differ, from its first one) from a takeover that went wrong (one
completion differs, from a position after its prompt).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from bench import jsonl


@dataclass
class Completion:
    t: float
    pid: int
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    source: str


@dataclass
class Variant:
    output: tuple[int, ...]
    count: int = 0
    pids: list[int] = field(default_factory=list)   # the engines that finished it, first first
    first_t: float = 0.0
    first_diff: int | None = None                   # vs the reference; None: it is the reference


def first_diff(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    """The first position where a and b differ (the shorter length when one is a prefix of
    the other), None when they are equal."""
    if a == b:
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _lines(name: str, text: Iterable[str]) -> Iterator[Completion]:
    for n, line in enumerate(text, 1):
        line = line.strip()
        if not line:
            continue
        try:
            r = json.loads(line)
            yield Completion(float(r["t"]), int(r["pid"]), tuple(r["prompt"]), tuple(r["output"]), name)
        except (ValueError, KeyError, TypeError) as e:
            # a line cut by a SIGKILL of its engine mid-write is expected; say so, skip it
            print(f"token_logs: {name}:{n}: skipped ({type(e).__name__})", file=sys.stderr)


def read(paths: Iterable[str]) -> list[Completion]:
    """Every completion in the tokens-*.jsonl files under the given folders or .tar.gz packs."""
    out: list[Completion] = []
    for name, lines in jsonl.files(paths, "tokens-"):
        out.extend(_lines(name, lines))
    out.sort(key=lambda c: c.t)
    return out


def firsts(comps: list[Completion]) -> dict[tuple[int, ...], Completion]:
    """Each prompt's first completion (comps in time order, as read() returns them), in the
    order of the prompts' first completions."""
    out: dict[tuple[int, ...], Completion] = {}
    for c in comps:
        out.setdefault(c.prompt, c)
    return out


def references(comps: list[Completion], reference: str = "first") -> dict[tuple[int, ...], tuple[int, ...]]:
    """Each prompt's reference output: its first completion's, or its most frequent one (the
    earliest of a tie)."""
    if reference == "majority":
        counts: dict[tuple[int, ...], collections.Counter] = collections.defaultdict(collections.Counter)
        for c in comps:
            counts[c.prompt][c.output] += 1  # insertion (time) order breaks most_common's ties
        return {p: cnt.most_common(1)[0][0] for p, cnt in counts.items()}
    return {p: c.output for p, c in firsts(comps).items()}


def compare(comps: list[Completion], reference: str = "first") -> list[dict]:
    """Per prompt (in the order of their first completion): the variants of its output."""
    by_prompt: dict[tuple[int, ...], list[Completion]] = {}
    for c in comps:
        by_prompt.setdefault(c.prompt, []).append(c)
    refs = references(comps, reference)
    rows = []
    for prompt, cs in by_prompt.items():
        variants: dict[tuple[int, ...], Variant] = {}
        for c in cs:
            v = variants.get(c.output)
            if v is None:
                v = variants[c.output] = Variant(c.output, first_t=c.t, first_diff=first_diff(c.output, refs[prompt]))
            v.count += 1
            if c.pid not in v.pids:
                v.pids.append(c.pid)
        rows.append({
            "prompt_tokens": len(prompt),
            "completions": len(cs),
            "engines": sorted({c.pid for c in cs}),
            "variants": [{"count": v.count, "engines": v.pids, "first_t": v.first_t, "tokens": len(v.output),
                          "first_diff": v.first_diff}
                         for v in sorted(variants.values(), key=lambda v: v.first_t)],
        })
    return rows


def engine_summary(comps: list[Completion], reference: str = "first") -> dict[int, dict]:
    """Per engine: completions, and how many of them differ from their prompt's reference."""
    refs = references(comps, reference)
    out: dict[int, dict] = {}
    for c in comps:
        e = out.setdefault(c.pid, {"completions": 0, "differ": 0, "first_t": c.t})
        e["completions"] += 1
        e["differ"] += c.output != refs[c.prompt]
    return out


def append(folder: str, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    """Append one line per output to <folder>/tokens-<pid>.jsonl, in the format the engines write
    with FRMPS_DEBUG_TOKEN_LOG (frmps_engine/sdk/loop.py), for a process that is not an engine
    (bench/gpu/margin_bound.py --token-log)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"tokens-{os.getpid()}.jsonl"), "a", encoding="utf-8") as f:
        for p, o in zip(prompts, outputs):
            f.write(json.dumps({"t": time.time(), "key": 0, "prompt": list(p), "output": list(o),
                                "finish_reason": "length", "pid": os.getpid()}) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.token_logs", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="folders of tokens-<pid>.jsonl, or .tar.gz packs of them")
    ap.add_argument("--reference", choices=("first", "majority"), default="first")
    ap.add_argument("--json", help="write the comparison here too")
    args = ap.parse_args(argv)
    comps = read(args.paths)
    if not comps:
        print("token_logs: no completions found", file=sys.stderr)
        return 2
    rows = compare(comps, args.reference)
    engines = engine_summary(comps, args.reference)
    differ = sum(len(r["variants"]) > 1 for r in rows)
    for r in rows:
        vs = " ".join(f"[{v['count']}x engines {','.join(map(str, v['engines']))}"
                      f"{'' if v['first_diff'] is None else ' differs at ' + str(v['first_diff'])}]"
                      for v in r["variants"])
        print(f"prompt of {r['prompt_tokens']} tokens: {r['completions']} completions, "
              f"{len(r['variants'])} output(s): {vs}")
    for pid, e in sorted(engines.items(), key=lambda kv: kv[1]["first_t"]):
        print(f"engine {pid}: {e['completions']} completions, {e['differ']} differ from the reference")
    print(f"{len(comps)} completions of {len(rows)} prompts by {len(engines)} engines: "
          f"{differ} prompt(s) with more than one output (reference: {args.reference})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"reference": args.reference, "completions": len(comps), "prompts": rows,
                       "engines": {str(k): v for k, v in engines.items()}}, f, indent=1)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
