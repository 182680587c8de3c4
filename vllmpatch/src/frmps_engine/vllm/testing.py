"""TEST DOUBLES for running the vLLM adapter without a GPU: vLLM's real
scheduler (FrmpsScheduler through ``scheduler_cls``) and the adapter's
VllmCore over it, with ``FakeModel`` standing in for the model runner
(deterministic tokens, no computation) and ``SchedulerCore`` standing in for
vLLM's in-process EngineCore. Built from real vLLM config objects, by hand, as
vLLM's own tests/v1/core tests do (no weights, no GPU, no network: the model
config is a tiny Qwen2 config.json written to a directory).

Used by the adapter's tests (tests/vllm) and by the CPU check of the bench's
sync-overhead measurement; never by an engine that serves.
"""

from __future__ import annotations

import json
import time
from collections import deque
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


def write_tiny_model(dirpath: Path, **overrides: Any) -> str:
    dirpath.mkdir(parents=True, exist_ok=True)
    (dirpath / "config.json").write_text(json.dumps({**TINY_QWEN2, **overrides}))
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


def fake_token(request_id: str, position: int) -> int:
    """The token the fake model samples at ``position`` (deterministic, never EOS)."""
    h = sum(ord(c) for c in request_id) * 131 + position * 17
    return 3 + h % 500


class StandInKVConnector:
    """TEST DOUBLE of vLLM's V2 model runner's KV connector (a no-op one by
    default): FakeModel.run calls ``pre_forward`` where V2's execute_model does,
    after the host work on its own buffers and before the forward pass."""

    def pre_forward(self, scheduler_output: Any, *args: Any) -> None:
        pass


@dataclass
class FakeModel:
    """Test double for the model runner: records every token it is asked to compute
    (per request, by position) and returns one sampled token per request whose
    scheduled chunk reaches the end of its known tokens. Its block tables are its
    host work; computing (the forward pass, which would write the KV cache) comes
    after ``kv_connector.pre_forward``, as in vLLM's V2 model runner."""

    computed: dict[str, list[int]] = field(default_factory=dict)  # positions computed per request
    blocks: dict[str, list[int]] = field(default_factory=dict)  # block table per request, as a worker keeps it
    sampled: dict[str, list[int]] = field(default_factory=dict)  # tokens sampled per request
    steps: list[Any] = field(default_factory=list)
    kv_connector: StandInKVConnector = field(default_factory=StandInKVConnector)

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
        if req_ids:
            self.kv_connector.pre_forward(so)
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


def seeded_token(seed: int, position: int) -> int:
    """The token the seeded stand-in model samples at ``position`` for ``seed``."""
    return 3 + (int(seed) * 1000003 + position * 7919) % 500  # never EOS (2)


class SeededFakeModel(FakeModel):
    """TEST DOUBLE of the model runner: FakeModel's scheduling bookkeeping, with
    each sampled token ``seeded_token(seed, position)`` of the request's own seed:
    the stateless (seed, position) sampling a standby relies on, so an engine that
    lost or changed a seed, repeated a token or skipped one gives another stream."""

    def run(self, scheduler, so):
        out = super().run(scheduler, so)
        for i, rid in enumerate(out.req_ids):
            if out.sampled_token_ids[i]:
                req = scheduler.requests[rid]
                tok = seeded_token(req.sampling_params.seed, req.num_computed_tokens)
                out.sampled_token_ids[i] = [tok]
                self.sampled[rid][-1] = tok
        return out


@dataclass
class SchedulerCore:
    """Test double for vllm.v1.engine.core.EngineCore: same methods the adapter uses.

    ``batch_queue_size`` 2 stands in for vLLM's async scheduling (EngineCore's
    batch queue, v1/engine/core.py ``step_with_batch_queue``): a step schedules
    the next batch and "launches" it (FakeModel runs it at once, as the device
    would start it) before the previous batch's output is processed, so the
    scheduler always has one step in flight. ``step_fn`` is the step the engine
    loop calls, chosen as EngineCore chooses it.

    ``device_s`` (benchmarks): the "device" runs one batch at a time, each for
    that long from its launch or the end of the batch before it; the host waits
    for a batch's output sleeping with the GIL free, as a CUDA sync does. With the
    batch queue, the host's work between launch and wait overlaps the device's."""

    scheduler: object
    model: FakeModel = field(default_factory=FakeModel)
    request_block_hasher: object = None
    batch_queue_size: int = 1
    device_s: float = 0.0

    @property
    def model_runner(self) -> FakeModel:
        """Where VllmCore.gate_device finds the runner (vLLM: the executor's worker's)."""
        return self.model

    def __post_init__(self):
        self._device_free_at = 0.0
        self.batch_queue = deque(maxlen=self.batch_queue_size) if self.batch_queue_size > 1 else None
        self.step_fn = self.step if self.batch_queue is None else self.step_with_batch_queue

    def add_request(self, request):
        self.scheduler.add_request(request)

    def abort_requests(self, ids):
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def step(self):
        if not self.scheduler.has_requests():
            return {}, False
        so = self.scheduler.schedule()
        out = self.model.run(self.scheduler, so)
        ready_at = self._launch()
        self.scheduler.get_grammar_bitmask(so)  # where EngineCore.step asks, between launch and wait
        self._wait(ready_at)
        outs = self.scheduler.update_from_output(so, out)
        return outs, so.total_num_scheduled_tokens > 0

    def _launch(self) -> float:
        """When the batch launched now is done on the serial device."""
        self._device_free_at = max(time.monotonic(), self._device_free_at) + self.device_s
        return self._device_free_at

    @staticmethod
    def _wait(ready_at: float) -> None:
        left = ready_at - time.monotonic()
        if left > 0:
            time.sleep(left)

    def step_with_batch_queue(self):
        """EngineCore.step_with_batch_queue without the executor: None when it only
        scheduled (the queue was not full), else the oldest batch's outputs."""
        q = self.batch_queue
        executed = False
        if self.scheduler.has_requests():
            so = self.scheduler.schedule()
            executed = so.total_num_scheduled_tokens > 0
            q.appendleft((so, self.model.run(self.scheduler, so), self._launch()))
            if len(q) < self.batch_queue_size and (executed or self.scheduler.has_requests()):
                return None, executed
        elif not q:
            return None, False
        so, out, ready_at = q.pop()
        self._wait(ready_at)
        return self.scheduler.update_from_output(so, out), executed


def cpu_engine_core(model_dir: str, *, num_blocks: int, max_num_seqs: int, max_model_len: int,
                    max_num_batched_tokens: int = 0, tokenizer: Any = None):
    """The adapter's VllmCore over the real FrmpsScheduler and the stand-in model."""
    from . import SCHEDULER_CLS
    from .core import VllmCore

    cfg = make_vllm_config(model_dir, num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                           max_num_batched_tokens=max(max_num_batched_tokens, max_model_len, 256),
                           scheduler_cls=SCHEDULER_CLS)
    return VllmCore(SchedulerCore(make_scheduler(cfg)), tokenizer)


def cpu_adapter(model_dir: str, *, num_blocks: int = 64, max_num_seqs: int = 8, max_model_len: int = 512,
                model_factory: Any = FakeModel, device_s: float = 0.0, async_scheduling: bool = False):
    """TEST DOUBLE of the vLLM adapter, for driving the SDK's Runner in process on
    the CPU: ``VllmAdapter`` (name, version, layout checks, the runner's core mode:
    ``serve_engine_core`` / ``engine_core_server`` unchanged) whose ``create_core``
    builds the VllmCore over ``SchedulerCore`` (the real FrmpsScheduler, the
    stand-in model ``model_factory()``, ``device_s`` per step) instead of vLLM's
    EngineCore on the GPU, and whose pools are two small host-memory pools that
    nothing reads or writes (the stand-in model keeps no KV). ``async_scheduling``:
    FrmpsAsyncScheduler behind SchedulerCore's batch queue (one step in flight)."""
    from ..sdk.memory.base import PoolSpec
    from . import ASYNC_SCHEDULER_CLS, SCHEDULER_CLS
    from .core import VllmCore
    from .engine import VllmAdapter, VllmEngineConfig

    class CpuVllmAdapter(VllmAdapter):
        def pool_layout(self):
            return [PoolSpec("weights", 0, 1 << 16), PoolSpec("kv_cache", 0, 1 << 16)]

        def create_core(self, pools: dict, load_weights: bool) -> VllmCore:
            cfg = make_vllm_config(self.cfg.model, num_blocks=self.num_blocks, max_num_seqs=max_num_seqs,
                                   max_model_len=self.max_model_len, async_scheduling=async_scheduling,
                                   scheduler_cls=ASYNC_SCHEDULER_CLS if async_scheduling else SCHEDULER_CLS)
            core = SchedulerCore(make_scheduler(cfg), model=model_factory(), device_s=device_s,
                                 batch_queue_size=2 if async_scheduling else 1)
            return VllmCore(core, None if self._engine_core else self.tokenizer(), kv_reuse=self.cfg.kv_reuse)

    return CpuVllmAdapter(VllmEngineConfig(model=model_dir, device="cpu", num_blocks=num_blocks,
                                           max_model_len=max_model_len, dtype="float32"))


def cpu_engine(opts: Any):
    """TEST DOUBLE of ``--engine vllm`` for end-to-end runs of ``frmps serve`` on the
    CPU (``--engine frmps_engine.vllm.testing:cpu_engine --device cpu --memory
    host-shm``): ``cpu_adapter`` (vLLM's real scheduler and the adapter's code,
    the runner's core mode included) over ``SeededFakeModel``, 10 ms of stand-in
    device time per step so that a test can kill an engine mid-stream. Never an
    engine that serves a model."""
    return cpu_adapter(opts.model, num_blocks=opts.num_blocks or 256, max_num_seqs=opts.max_num_seqs or 8,
                       max_model_len=opts.max_model_len or 512, model_factory=SeededFakeModel, device_s=0.01)
