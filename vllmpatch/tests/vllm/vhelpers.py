"""Builders for real vLLM 0.33.0 scheduler objects, by hand, as vLLM's own
tests/v1/core tests do (no model weights, no GPU, no network: the model config
is a tiny Qwen2 config.json written to a temp dir).

Test doubles here are labelled: ``FakeModel`` stands in for the model runner
(it produces ModelRunnerOutputs with deterministic tokens); ``RecordingTracker``
stands in for the ring's DeltaTracker (it records what would be published).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TINY_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
EOS = 2
BLOCK_SIZE = 16


def write_tiny_model(dirpath: Path) -> str:
    dirpath.mkdir(parents=True, exist_ok=True)
    (dirpath / "config.json").write_text(json.dumps(TINY_QWEN2))
    return str(dirpath)


def make_vllm_config(
    model_dir: str,
    *,
    num_blocks: int = 64,
    block_size: int = BLOCK_SIZE,
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 8,
    max_model_len: int = 512,
    enable_prefix_caching: bool = False,
    async_scheduling: bool = False,
    scheduler_cls: str | None = None,
    additional_config: dict | None = None,
    tokenizer: bool = False,
    structured_outputs_config: object | None = None,
):
    """``tokenizer``: load the model directory's tokenizer (structured outputs need it)."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

    mc = ModelConfig(model=model_dir, skip_tokenizer_init=not tokenizer, max_model_len=max_model_len, dtype="float32",
                     seed=0)
    sc = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
        scheduler_cls=scheduler_cls,
    )
    cc = CacheConfig(block_size=block_size, cache_dtype="auto", enable_prefix_caching=enable_prefix_caching)
    cc.num_gpu_blocks = num_blocks
    return VllmConfig(
        model_config=mc,
        cache_config=cc,
        scheduler_config=sc,
        device_config=DeviceConfig(device="cpu"),
        additional_config=additional_config or {},
        **({"structured_outputs_config": structured_outputs_config} if structured_outputs_config is not None else {}),
    )


def make_kv_cache_config(num_blocks: int, block_size: int = BLOCK_SIZE):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.float32)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"], spec)],
    )


def make_scheduler(vllm_config, cls=None):
    from vllm.v1.structured_output import StructuredOutputManager

    if cls is None:
        cls = vllm_config.scheduler_config.get_scheduler_cls()
    kvc = make_kv_cache_config(vllm_config.cache_config.num_gpu_blocks, vllm_config.cache_config.block_size)
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kvc,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=vllm_config.cache_config.block_size,
        log_stats=False,
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


def fake_token(request_id: str, position: int) -> int:
    """The token the fake model samples at ``position`` (deterministic, never EOS)."""
    h = sum(ord(c) for c in request_id) * 131 + position * 17
    return 3 + h % 500


@dataclass
class FakeModel:
    """Test double for the model runner: records every token it is asked to compute
    (per request, by position) and returns one sampled token per request whose
    scheduled chunk reaches the end of its known tokens."""

    computed: dict[str, list[int]] = field(default_factory=dict)  # positions computed per request
    blocks: dict[str, list[int]] = field(default_factory=dict)  # block table per request, as a worker keeps it
    sampled: dict[str, list[int]] = field(default_factory=dict)  # tokens sampled per request
    steps: list[Any] = field(default_factory=list)

    def _apply_block_updates(self, so) -> None:
        for new in so.scheduled_new_reqs:
            (ids,) = new.block_ids
            self.blocks[new.req_id] = list(ids)
        cached = so.scheduled_cached_reqs
        for rid, new_ids in zip(cached.req_ids, cached.new_block_ids):
            if new_ids is None:
                continue
            (ids,) = new_ids
            if rid in cached.resumed_req_ids:
                self.blocks[rid] = list(ids)
            else:
                self.blocks.setdefault(rid, []).extend(ids)

    def run(self, scheduler, so):
        from vllm.v1.outputs import ModelRunnerOutput

        self.steps.append(so)
        self._apply_block_updates(so)
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            req = scheduler.requests[rid]
            n = so.num_scheduled_tokens[rid]
            start = req.num_computed_tokens - n  # _update_after_schedule already advanced it
            self.computed.setdefault(rid, []).extend(range(start, start + n))
            end = start + n
            if end >= req.num_tokens:
                tok = fake_token(rid, end)
                self.sampled.setdefault(rid, []).append(tok)
                sampled.append([tok])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled)


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
