#!/usr/bin/env python3
"""Where an engine's start goes, from the py-spy stacks FRMPS_DEBUG_STARTUP_PROFILE
writes (py-spy's raw collapsed format with --threads: "thread;frame;…;frame count"
per line, root first; frames "function (path:line)").

For each file: the samples per thread, and for the busiest thread (the one that
builds the engine) the inclusive time of each function — the samples in which it
is anywhere on the stack, counted once per stack — as seconds at the sampling rate.

    python3 bench/gpu/start_profile.py --rate 200 --top 40 start-standby-*.stacks [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the bench package
from bench.serving.profile import read_stacks  # noqa: E402  (py-spy's raw format, one parser)

_LINE = re.compile(r":\d+\)$")


def function_of(frame: str) -> str:
    """'load_model (vllm/model_executor/model_loader/base_loader.py:54)' ->
    'load_model (vllm/model_executor/model_loader/base_loader.py)': the function, not the line."""
    return _LINE.sub(")", frame.strip())


def short_path(frame: str) -> str:
    """Paths cut to the package: '.../site-packages/vllm/x.py' -> 'vllm/x.py'."""
    return re.sub(r"\((?:[^()]*/)?(?:site-packages|dist-packages|src)/", "(", frame)


def summarize(stacks: list[tuple[list[str], int]], rate: float, top: int) -> dict:
    per_thread: Counter = Counter()
    for frames, n in stacks:
        per_thread[frames[0]] += n
    if not per_thread:
        return {"threads": {}, "busiest": None, "inclusive_s": []}
    busiest = per_thread.most_common(1)[0][0]
    inclusive: Counter = Counter()
    for frames, n in stacks:
        if frames[0] != busiest:
            continue
        for fn in {short_path(function_of(f)) for f in frames[1:]}:
            inclusive[fn] += n
    return {
        "threads": {t: round(n / rate, 2) for t, n in per_thread.most_common()},
        "busiest": busiest,
        "busiest_s": round(per_thread[busiest] / rate, 2),
        "inclusive_s": [(fn, round(n / rate, 2)) for fn, n in inclusive.most_common(top)],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--rate", type=float, default=200, help="py-spy's samples per second (the engine's hook: 200)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--json", default="", help="also write the summaries here")
    a = ap.parse_args(argv)
    res = {}
    for path in a.files:
        s = res[path] = summarize(read_stacks(path), a.rate, a.top)
        print(f"== {path}: {s.get('busiest')} {s.get('busiest_s', 0)} s sampled "
              f"(threads: {', '.join(f'{t} {v} s' for t, v in list(s['threads'].items())[:4])})")
        for fn, sec in s["inclusive_s"]:
            print(f"{sec:8.2f} s  {fn}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
