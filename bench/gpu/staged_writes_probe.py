#!/usr/bin/env python3
"""Where a takeover's adoption of many requests goes in vLLM's V2 runner, outside an engine.

A takeover of 8 streams at 14B (H200) spent ~4 ms in the runner's add_requests before its
first forward launch, against ~0.5 ms in a steady step: req_states.add_request ~0.6 ms for
the first request and 0.03 for each later one, req_states.apply_staged_writes ~2.6 ms. This
builds the V2 runner's RequestState alone on the GPU (no model) and times, in one fresh
process: a warm-up as the standby's takeover warm-up does it (two short requests), then 8
requests of ~400 tokens on the thread that warmed (cold sizes), the same again (warm), and
the same on a new thread — each split into add_request calls, the staged writes' pieces
(UVA copies, the pinned host copy, the write kernel) and a device sync. Prints one JSON line
per round. Needs vLLM 0.26's V2 runner (vllm.v1.worker.gpu.states) and a GPU."""

from __future__ import annotations

import json
import sys
import threading
import time

import torch


def _ms(t0: int) -> float:
    return round((time.perf_counter_ns() - t0) / 1e6, 3)


def main() -> int:
    from vllm.v1.worker.gpu import buffer_utils
    from vllm.v1.worker.gpu.states import RequestState

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    st = RequestState(max_num_reqs=256, max_model_len=4096, max_num_batched_tokens=8192,
                      num_speculative_steps=0, vocab_size=152064, device=torch.device("cuda"))

    # The pieces of StagedWriteTensor.apply_write, timed by wrapping what it calls.
    pieces: dict[str, float] = {}

    def timed(name, fn):
        def w(*a, **k):
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                pieces[name] = pieces.get(name, 0.0) + (time.perf_counter_ns() - t0) / 1e6
        return w

    buffer_utils.async_tensor_h2d = timed("host_to_device_list", buffer_utils.async_tensor_h2d)
    pool_copy = buffer_utils.UvaBufferPool.copy_to_uva
    buffer_utils.UvaBufferPool.copy_to_uva = lambda self, x: timed("uva_pool_copy", pool_copy)(self, x)
    kernel = buffer_utils._apply_write_kernel
    if hasattr(kernel, "run"):  # a Triton JITFunction: fn[grid](...) calls its run
        kernel.run = timed("write_kernel_launch", kernel.run)

    n_round = [0]

    def round_(label: str, n: int, tokens: int) -> dict:
        pieces.clear()
        ids = [f"{label}-{i}" for i in range(n)]
        per = []
        t_all = time.perf_counter_ns()
        for r in ids:
            t0 = time.perf_counter_ns()
            st.add_request(r, prompt_len=min(32, tokens), all_token_ids=list(range(1000, 1000 + tokens)),
                           num_computed_tokens=tokens - 1, max_tokens=512)
            per.append(_ms(t0))
        t0 = time.perf_counter_ns()
        st.apply_staged_writes()
        apply_ms = _ms(t0)
        host_ms = _ms(t_all)
        t0 = time.perf_counter_ns()
        torch.cuda.synchronize()
        sync_ms = _ms(t0)
        for r in ids:
            st.remove_request(r)
        n_round[0] += 1
        return {"round": n_round[0], "what": label, "thread": threading.current_thread().name, "requests": n,
                "tokens_each": tokens, "add_request_ms": per, "apply_staged_writes_ms": apply_ms,
                "apply_pieces_ms": {k: round(v, 3) for k, v in pieces.items()}, "host_ms": host_ms,
                "then_sync_ms": sync_ms}

    out = [round_("warm-up as the standby's", 2, 8),
           round_("cold sizes", 8, 400), round_("warm", 8, 400), round_("warm again", 8, 400)]
    box: list = []
    t = threading.Thread(target=lambda: box.extend([round_("new thread", 8, 400), round_("new thread again", 8, 400)]),
                         name="fresh")
    t.start()
    t.join()
    out += box
    out.append(round_("one request", 1, 8))
    for rec in out:
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
