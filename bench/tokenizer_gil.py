#!/usr/bin/env python3
"""Does the engine's prompt tokenization let the step loop run? The engines
tokenize prompts on their generation threads while the loop thread steps the
engine; both need the GIL. This runs each engine's encode on one thread for a
while, a spinning Python thread beside it standing in for the loop, and prints
how far the spinner got, against the spinner alone (1.0: encode never held the
GIL the spinner wanted; ~0.5 on a free core: it held it about half the time).

    PYTHONPATH=vllmpatch/src .venv/bin/python bench/tokenizer_gil.py <hf model dir> [--words 2000] [--seconds 2]

Paths: the Hugging Face tokenizer's encode (transformers; it calls the tokenizers
library's encode_batch), the tokenizers library's encode and encode_batch, and
the engines' encode (refengine HFTokenizer; the vLLM adapter's VllmTokenizer over
the Hugging Face tokenizer). One JSON line per path. CPU figures: with fewer free cores than
threads the spinner's share also measures the scheduler, so compare the lines of
one run.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Callable


def spin_share(fn: Callable[[], object], seconds: float, alone: float) -> dict:
    """Call fn for `seconds` with a spinning thread beside it: fn's calls per second
    and the spinner's rate as a share of `alone` (its rate beside nothing)."""
    stop, count = threading.Event(), [0]

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1
        count[0] = n

    t = threading.Thread(target=spin)
    t.start()
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        calls += 1
    wall = time.perf_counter() - t0
    stop.set()
    t.join()
    rate = count[0] / wall
    return {"calls_per_s": round(calls / wall, 1), "spinner_share": round(rate / alone, 3) if alone else None,
            "spinner_rate": rate}


def _alone_rate(seconds: float) -> float:
    """The spinner's rate beside a thread that only sleeps."""
    return spin_share(lambda: time.sleep(0.01), seconds, 0)["spinner_rate"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--words", type=int, default=2000, help="words per prompt (the line says its tokens)")
    ap.add_argument("--seconds", type=float, default=2.0, help="per path")
    args = ap.parse_args()

    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from frmps_engine.refengine.tokenizer import HFTokenizer
    from frmps_engine.vllm.tokenizer import VllmTokenizer

    raw = Tokenizer.from_file(f"{args.model_dir}/tokenizer.json")
    hf = AutoTokenizer.from_pretrained(args.model_dir)
    words = "the engine keeps serving through a fault while its standby adopts the cache 12,345 naïve 日本 🙂".split()
    text = " ".join(words[i % len(words)] for i in range(args.words))
    ref_tok, vllm_tok = HFTokenizer(args.model_dir), VllmTokenizer(hf)
    paths: dict[str, Callable[[], object]] = {
        "transformers encode": lambda: hf.encode(text, add_special_tokens=False),
        "tokenizers encode": lambda: raw.encode(text, add_special_tokens=False),
        "tokenizers encode_batch": lambda: raw.encode_batch([text], add_special_tokens=False),
        "refengine HFTokenizer.encode": lambda: ref_tok.encode(text),
        "vllm VllmTokenizer.encode": lambda: vllm_tok.encode(text),
    }
    n_ids = len(hf.encode(text, add_special_tokens=False))
    alone = _alone_rate(args.seconds)
    for name, fn in paths.items():
        r = spin_share(fn, args.seconds, alone)
        r.pop("spinner_rate")
        print(json.dumps({"path": name, "prompt_tokens": n_ids, **r}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
