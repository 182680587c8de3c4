"""What a takeover spends on the requests' prompts, per input the front door resumes with.

A standby adopting a request checks its prompt against the ring's snapshot. Resumed with
the request's text (or chat messages) it must tokenize it again; resumed with the token ids
the active reported in its first chunk (the default since frmps 2026-11-26) it only checks
them. Prints both for a batch of short and of long prompts, with a real Qwen2.5 tokenizer
(`frmps model init`'s byte-level BPE, through vLLM when it is installed, else
transformers):

    PYTHONPATH=vllmpatch/src python bench/takeover_prompt.py [--requests 8] [--long-words 2000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from frmps_engine import modeldir
from frmps_engine.sdk.genapi import input_to_ids


def load_tokenizer(path: str):
    try:
        from vllm.tokenizers.registry import get_tokenizer

        from frmps_engine.vllm.tokenizer import VllmTokenizer

        return VllmTokenizer(get_tokenizer(path)), "vLLM"
    except ImportError:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path), "transformers"


def timed(fn, reps: int) -> float:
    """Median wall time of fn() over reps runs, in ms."""
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--long-words", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        modeldir.write("qwen2.5-0.5b", d, force=True)
        tok, via = load_tokenizer(d)
        for name, words in (("short", 24), ("long", a.long_words)):
            prompts = [f"Request {i}: " + " ".join(f"w{(i * 7 + j) % 50}" for j in range(words + 11 * i))
                       for i in range(a.requests)]
            ids = [input_to_ids(tok, prompt=p) for p in prompts]
            text_ms = timed(lambda: [input_to_ids(tok, prompt=p) for p in prompts], a.reps)
            ids_ms = timed(lambda: [input_to_ids(tok, prompt_token_ids=x) for x in ids], a.reps)
            print(f"{a.requests} {name} prompts ({min(map(len, ids))}-{max(map(len, ids))} tokens, {via} tokenizer): "
                  f"resumed with text {text_ms:.2f} ms, with the reported ids {ids_ms:.2f} ms")


if __name__ == "__main__":
    main()
