"""Test-side builders around real vLLM scheduler objects. The shared TEST
DOUBLES (``FakeModel`` standing in for the model runner, ``SchedulerCore`` for
vLLM's EngineCore) and the config builders live in frmps_engine.vllm.testing
(the bench's CPU check uses them too); ``RecordingTracker`` here stands in for
the ring's DeltaTracker (it records what would be published).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from frmps_engine.vllm.testing import (  # noqa: F401  (re-exported for the tests)
    BLOCK_SIZE,
    EOS,
    TINY_QWEN2,
    FakeModel,
    SchedulerCore,
    fake_token,
    make_kv_cache_config,
    make_scheduler,
    make_vllm_config,
    write_tiny_model,
)


def block_hasher(block_size: int = BLOCK_SIZE):
    """vLLM's own request block hasher (as EngineCore builds it, core.py:219-230)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(block_size, sha256)


def make_request(key: int, prompt: list[int], *, max_tokens: int = 40, seed: int | None = None, temperature: float = 0.0, hasher=None):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from frmps_engine.sdk.seeds import resolve_seed, to_int64
    from frmps_engine.vllm.state import request_id_for_key

    sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=to_int64(resolve_seed(key, seed)), ignore_eos=True)
    return Request(
        request_id=request_id_for_key(key), prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None, block_hasher=hasher
    )


def step(scheduler, model: FakeModel):
    so = scheduler.schedule()
    mro = model.run(scheduler, so)
    scheduler.update_from_output(so, mro)
    return so


@dataclass
class RecordingTracker:
    """Test double for frmps_engine.ring.DeltaTracker: records each sync's views (copied)."""

    records: list[tuple[int, list[Any]]] = field(default_factory=list)

    def sync(self, step_no: int, states) -> int:
        import copy

        self.records.append((step_no, [copy.deepcopy(s) for s in states]))
        return len(self.records)


def block_pool_invariants(scheduler) -> dict:
    """Check BlockPool bookkeeping against the requests that hold blocks; return a summary.

    Every block with ref_cnt 0 (but the null block) is in the free queue exactly
    once; every block held by a request has ref_cnt equal to the number of
    requests holding it; num_free + held == num_blocks - 1.
    """
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    (manager,) = kv.coordinator.single_type_managers
    holders: dict[int, int] = {}
    for rid, blocks in manager.req_to_blocks.items():
        for b in blocks:
            if not b.is_null:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
    free_ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    assert len(free_ids) == len(set(free_ids)), "a block is in the free queue twice"
    assert len(free_ids) == pool.get_num_free_blocks()
    for b in pool.blocks:
        if b.is_null:
            assert b.block_id not in free_ids
            continue
        assert b.ref_cnt == holders.get(b.block_id, 0), f"block {b.block_id}: ref_cnt {b.ref_cnt}, held by {holders.get(b.block_id, 0)}"
        assert (b.ref_cnt == 0) == (b.block_id in free_ids), f"block {b.block_id}: ref_cnt {b.ref_cnt}, in free queue: {b.block_id in free_ids}"
    return {"free": len(free_ids), "held": len(holders)}
