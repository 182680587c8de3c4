"""The negative controls of takeover exactness (FRMPS_TEST_TAKEOVER_FAULT,
sdk/takeover_fault.py) on the vLLM adapter, on the CPU.

The CPU stand-in (vllm/testing.py: vLLM's real scheduler over a FakeModel)
computes no attention and keeps no KV cache, so it cannot show a KV-content
control changing tokens: that is the GPU's (bench/exactness.py run_controls).
What it can show: the switch reaches vLLM's adoption (the block table rotated,
one more computed token), the core refuses at start what it cannot apply here,
and VllmCore's hooks do what they say on tensors laid out as vLLM's KV caches
and with a sampler called as V2's.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from frmps_engine.sdk import takeover_fault
from frmps_engine.vllm.state import request_id_for_key
from test_engine import engine, model_dir, params  # noqa: F401  (fixture)

BS = 16


def _adopt_two(eng, cases):
    armed = takeover_fault.TakeoverFaults(cases, BS).arm(eng)
    armed.install()
    try:
        p1, p2 = list(range(10, 50)), list(range(60, 95))  # 40 and 35 prompt tokens: 3 blocks each
        # The clients hold 3 output tokens past the snapshot's (num_computed = prompt).
        eng.adopt_request(1, params(20), p1 + [7], len(p1), len(p1), [1, 2, 3], 11, [7, 8, 9])
        eng.adopt_request(2, params(20), p2 + [7], len(p2), len(p2), [4, 5, 6], 12, [7, 8, 9])
    finally:
        armed.remove()
    return armed


def _vllm_request(eng, key):
    sched = eng.scheduler
    rid = request_id_for_key(key)
    (manager,) = sched.kv_cache_manager.coordinator.single_type_managers
    return sched.requests[rid], [b.block_id for b in manager.req_to_blocks[rid]]


def test_shift_table_and_position_reach_vllms_adoption(model_dir, caplog):  # noqa: F811
    eng = engine(model_dir)
    with caplog.at_level("WARNING"):
        armed = _adopt_two(eng, ("shift-table", "position"))
    req1, blocks1 = _vllm_request(eng, 1)
    req2, blocks2 = _vllm_request(eng, 2)
    assert blocks1 == [2, 3, 1], "the block table rotated by one"
    assert req1.num_computed_tokens == 41, "one more computed token than the snapshot's 40"
    assert blocks2 == [4, 5, 6] and req2.num_computed_tokens == 35, "one request only"
    assert armed.kv_ops == [("zero", 1, -1, 40 % BS)], "the extra token's slot: index 2 of the rotated table"
    lines = [r.getMessage() for r in caplog.records if takeover_fault.APPLIED in r.getMessage()]
    assert len(lines) == 2 and all("request 1 (prompt of 40 tokens)" in m for m in lines), lines


def test_without_the_control_vllm_adopts_the_snapshot_as_is(model_dir):  # noqa: F811
    """The other side of the test above: no control, the snapshot's table and count."""
    eng = engine(model_dir)
    _adopt_two(eng, ())
    req1, blocks1 = _vllm_request(eng, 1)
    assert blocks1 == [1, 2, 3] and req1.num_computed_tokens == 40


def test_stand_in_refuses_what_it_cannot_apply(model_dir):  # noqa: F811
    eng = engine(model_dir)
    for case in ("zero-block", "swap-block", "position", "sampler-offset"):
        with pytest.raises(takeover_fault.ControlError, match="KV caches|V2 model runner"):
            takeover_fault.TakeoverFaults((case,), BS).check_core(eng)
    takeover_fault.TakeoverFaults(("shift-table",), BS).check_core(eng)  # needs nothing of the engine


def _v2_sample_signature() -> inspect.Signature:
    """The installed vLLM's V2 ``Sampler.sample`` signature (its parameters'
    order differs between versions)."""
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    return inspect.signature(Sampler.sample)


class _Runner:
    """A model runner as VllmCore's hooks reach it: ``kv_caches`` (one tensor per
    layer, K and V stacked first, as FlashAttention's layout), a sampler whose
    ``sample`` has the installed vLLM's V2 signature, and
    ``req_states.req_id_to_index``."""

    def __init__(self, nb):
        self.kv_caches = [torch.randn(2, nb, BS, 2, 4) for _ in range(2)]
        self.req_states = types.SimpleNamespace(req_id_to_index={request_id_for_key(1): 0, request_id_for_key(2): 1})
        self.seen = []
        runner, sig = self, _v2_sample_signature()

        class Sampler:
            def sample(self, *args, **kwargs):
                got = sig.bind(self, *args, **kwargs).arguments
                runner.seen.append({name: got.get(name) for name in ("pos", "input_ids")})
                return got["pos"]

        Sampler.sample.__signature__ = sig
        self.sampler = Sampler()

    def call_sample(self, **named):
        """sampler.sample called as vLLM calls it: every argument by position, in the
        installed version's order (None for those not named)."""
        names = [p for p in _v2_sample_signature().parameters if p != "self"]
        return self.sampler.sample(*[named.get(p) for p in names if p != "return_logprobs"])


def test_vllm_hooks_write_kv_blocks_and_shift_the_sampler(model_dir):  # noqa: F811
    eng = engine(model_dir)
    nb = int(eng.scheduler.kv_cache_manager.block_pool.num_gpu_blocks)
    runner = _Runner(nb)
    eng.core.__class__ = type("WithRunner", (type(eng.core),), {"model_runner": property(lambda s: runner)})
    takeover_fault.TakeoverFaults(takeover_fault.CASES, BS).check_core(eng)
    before = [t.clone() for t in runner.kv_caches]
    eng.fault_kv("zero", 3, -1, 5)
    eng.fault_kv("swap", 1, 2, -1)
    eng.fault_kv("zero", 7, -1, -1)
    for t, b in zip(runner.kv_caches, before):
        assert torch.all(t[:, 3, 5] == 0) and torch.equal(t[:, 3, :5], b[:, 3, :5]), "one slot of block 3"
        assert torch.equal(t[:, 1], b[:, 2]) and torch.equal(t[:, 2], b[:, 1]), "blocks 1 and 2 swapped"
        assert torch.all(t[:, 7] == 0) and torch.equal(t[:, 8], b[:, 8]), "block 7 zeroed, its neighbour kept"
    eng.shift_sampler(2, 1)
    pos, ids = torch.tensor([40, 35, 36]), torch.tensor([5, 6, 7])
    mapping = torch.tensor([0, 1, 1])
    runner.call_sample(expanded_idx_mapping=mapping, idx_mapping=mapping, idx_mapping_np=mapping.numpy(), pos=pos,
                       input_ids=ids)
    assert runner.seen[-1]["pos"].tolist() == [40, 36, 37], "request 2's rows draw one position further on"
    assert runner.seen[-1]["input_ids"].tolist() == [5, 6, 7], "and nothing else changes"


def test_sampler_offset_is_refused_where_sample_takes_no_position(model_dir):  # noqa: F811
    eng = engine(model_dir)
    runner = _Runner(int(eng.scheduler.kv_cache_manager.block_pool.num_gpu_blocks))

    class Sampler:
        def sample(self, logits, expanded_idx_mapping, positions):  # not V2's parameter names
            return positions

    runner.sampler = Sampler()
    eng.core.__class__ = type("WithRunner", (type(eng.core),), {"model_runner": property(lambda s: runner)})
    with pytest.raises(takeover_fault.ControlError, match="takes no pos"):
        takeover_fault.TakeoverFaults(("sampler-offset",), BS).check_core(eng)


def test_vllm_kv_digests_follow_a_block_where_the_runner_keeps_it(model_dir):  # noqa: F811
    """FRMPS_DEBUG_KV_DIGESTS on vLLM (VllmCore.kv_token_digests, sdk/kv_digest.py): per token,
    over every layer's KV cache (blocks in the second dimension here); a block swapped
    elsewhere keeps its digests, a zeroed slot changes its token's only."""
    eng = engine(model_dir)
    nb = int(eng.scheduler.kv_cache_manager.block_pool.num_gpu_blocks)
    runner = _Runner(nb)
    eng.core.__class__ = type("WithRunner", (type(eng.core),), {"model_runner": property(lambda s: runner)})
    a = eng.kv_token_digests([1, 2], 20)
    assert len(a) == 20 and len(set(a)) == 20
    eng.fault_kv("swap", 1, 5, -1)
    eng.fault_kv("swap", 2, 6, -1)
    assert eng.kv_token_digests([5, 6], 20) == a
    eng.fault_kv("zero", 6, -1, 3)
    b = eng.kv_token_digests([5, 6], 20)
    assert [i for i in range(20) if a[i] != b[i]] == [16 + 3]
