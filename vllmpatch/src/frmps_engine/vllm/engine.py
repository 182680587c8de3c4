"""The core the SDK's runner drives, on top of vLLM's in-process EngineCore.

``python -m frmps_engine.cli serve --engine vllm --model <hf-dir> ...`` makes the
SDK runner call ``make_adapter(args)``; the adapter derives the pool layout and
builds a ``VllmCore`` (the SDK's ``Core`` protocol, sdk/engine_api.py: add_request,
adopt_request, abort, step, has_work, request_views, tokenizer, counters; and the
optional LoadReport, StepSize and Resettable).

The vLLM side is built with official knobs only:
- ``scheduler_cls`` = FrmpsScheduler (committed views, adoption, counters);
- ``enable_sleep_mode`` + ``sleep_mode_backend="frmps"`` (pools.PoolController);
- ``num_gpu_blocks_override`` so both engines have the same block count;
- ``load_format="safetensors"`` for the active when the model directory holds
  ``*.safetensors`` (vLLM's own loader reads them into the weights pool), else
  ``"dummy"``; ``load_format="dummy"`` always for a standby, so it never loads
  weights: whatever it initialises lands in its private placeholder pools, and
  it serves the active's weights pool once it maps it;
- ``tensor_parallel_size=1`` and the in-process executor (the worker shares this
  process, hence the pool controller).
- every request carries an explicit seed (the SDK's one rule, sdk/seeds.py;
  vLLM keeps it as int64).

This module imports vLLM only inside functions, so the SDK can list engines
without vLLM installed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, MutableMapping, Protocol, Sequence, runtime_checkable

from . import SCHEDULER_CLS, SLEEP_BACKEND_NAME, phases
from .adoption import AdoptResult, DeferredPrefixCache, plan_adoption
from . import sizing
from .pools import PoolSpec, kv_cache_bytes, pool_layout
from .tp import WORKER_EXTENSION as TP_WORKER_EXTENSION
from .triton_watch import watch_from_env
from ..modeldir import weights_source
from ..sdk.engine_api import rank_death, throwaway_takeover
from ..sdk.seeds import derive_seed, resolve_seed, to_int64, to_uint64
from .state import CommittedView, key_for_request_id, request_id_for_key

# vllm.v1.engine.FinishReason values; others (error, repetition) end the request too.
_FINISH = {0: "stop", 1: "length", 2: "abort"}


@dataclass
class Output:
    key: int
    new_token_ids: list[int]
    output_index: int
    finished: bool
    finish_reason: str | None
    stop_reason: Any = None


@dataclass
class _Track:
    num_out: int  # output tokens delivered so far (including those before a takeover)
    stop: list[str] = field(default_factory=list)
    text_tail: str = ""


def _backend_decoder(tok: Any) -> Callable[..., str] | None:
    """The Rust decode under a Hugging Face fast tokenizer, where it gives the same
    text as tok.decode: transformers' decode of a fast tokenizer is the backend's
    decode followed by an optional clean-up (`clean_up_tokenization_spaces`), and
    vLLM wraps it in a borrow from its tokenizer pool. Per call that is ~4x the
    backend's own cost, paid for every token a resumed stream replays (its
    delivered output, in the first step after a takeover). Checked on a sample at
    load (every special token and a spread of the vocabulary, alone and in pairs);
    None (use tok.decode) if any differs or the tokenizer has no such backend."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or getattr(tok, "clean_up_tokenization_spaces", True) is not False:
        return None
    decode = getattr(backend, "decode", None)
    try:
        n = int(backend.get_vocab_size(with_added_tokens=True))
        special = [int(i) for i in (getattr(tok, "all_special_ids", None) or [])][:64]
        spread = list(range(0, n, max(1, n // 512)))[:512] + list(range(max(0, n - 64), n))
        sample = [[i] for i in special + spread] + [[a, b] for a, b in zip(spread, reversed(spread))]
        sample += [special + spread[:8], spread[:32]]
        for ids in sample:
            if decode(ids, skip_special_tokens=True) != tok.decode(ids, skip_special_tokens=True):
                return None
    except Exception:  # any surprise: the tokenizer's own decode
        return None
    return decode


class VllmTokenizer:
    """The SDK's Tokenizer protocol over vLLM's tokenizer (HF fast tokenizer + chat template)."""

    def __init__(self, tok: Any):
        if tok is None:
            raise ValueError("vLLM was configured without a tokenizer (skip_tokenizer_init)")
        self._tok = tok
        self.eos_token_id = tok.eos_token_id
        self._backend = _backend_decoder(tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend(list(ids), skip_special_tokens=True)
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        ids = self._tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding (a Mapping, not a dict)
            ids = ids["input_ids"]
        return list(ids)


@runtime_checkable
class FrmpsSchedulerAPI(Protocol):
    """What VllmCore needs of vLLM's scheduler beyond vLLM's own API: the members
    scheduler.FrmpsScheduler (and FrmpsAsyncScheduler) add."""

    frmps_counters: Mapping[str, int]
    frmps_scheduled_tokens: int

    def frmps_adopt(self, plan: Any, sampling_params: Any, *, block_hasher: Any = None,
                    fold_outputs: bool | None = None, request_kwargs: dict | None = None,
                    deferred: Any = None) -> AdoptResult: ...
    frmps_hold: bool

    def frmps_views(self) -> list[CommittedView]: ...
    def frmps_reset(self) -> None: ...


def _runner_of(core: Any) -> Any:
    """vLLM's model runner when it runs in this process (UniProcExecutor); the test
    double's stand-in (SchedulerCore.model_runner); None otherwise."""
    try:
        return core.model_executor.driver_worker.worker.model_runner
    except AttributeError:
        return getattr(core, "model_runner", None)


def _pre_forward_owner(core: Any) -> Any:
    """The object whose ``pre_forward`` vLLM's V2 model runner calls right before
    its forward pass (its KV connector, a no-op one by default), when the runner
    runs in this process; None otherwise."""
    kvc = getattr(_runner_of(core), "kv_connector", None)
    return kvc if callable(getattr(kvc, "pre_forward", None)) else None


class VllmCore:
    """The SDK's Core over a vLLM ``EngineCore`` whose scheduler is a FrmpsScheduler.

    ``core`` is vLLM's in-process EngineCore (built by ``VllmAdapter.create_core``);
    anything with ``scheduler``, ``step_fn()``, ``batch_queue``,
    ``add_request(Request)``, ``abort_requests(ids)`` and ``request_block_hasher``
    works (tests drive the real scheduler with a labelled fake model through this
    seam).

    Each ``step()`` runs the core's ``step_fn``, the step vLLM's own busy loop
    runs: ``EngineCore.step`` without async scheduling; with it,
    ``step_with_batch_queue``, which schedules and launches batch N+1 before it
    waits for batch N, so the host's work (this step's outputs, the ring publish,
    the next schedule) overlaps the device's. The scheduler then has one step in
    flight whenever the engine loop holds the GIL, and its views stay committed
    only (FrmpsAsyncScheduler: ``num_computed_tokens - num_in_flight_tokens``).
    """

    def param_checksums(self) -> dict[str, str]:
        """Debug hook (sdk/debug_fault.py PARAM_CHECKSUM_ENV): every parameter of the
        model vLLM built, by name, as debug_fault.tensor_checksum (a one-rank engine:
        its worker is in this process)."""
        from ..sdk.debug_fault import tensor_checksum

        def checksums(worker: Any) -> dict[str, str]:
            return {n: tensor_checksum(p) for n, p in worker.get_model().named_parameters()}

        return self.core.model_executor.collective_rpc(checksums)[0]

    def __init__(self, core: Any, tokenizer: Any = None, kv_reuse: bool = True):
        self.core = core
        # False: the no-KV ablation (--no-kv-reuse): an adopted request's KV is computed again, a prefill
        # of its prompt and delivered tokens into fresh blocks, instead of read from the snapshot's blocks.
        self.kv_reuse = kv_reuse
        self.scheduler = core.scheduler
        if not isinstance(self.scheduler, FrmpsSchedulerAPI):
            raise TypeError(f"vLLM scheduler is {type(self.scheduler).__name__}; set scheduler_cls={SCHEDULER_CLS}")
        self.tokenizer = tokenizer
        self._tracks: dict[int, _Track] = {}
        self._step_fn = core.step_fn
        # Called on the engine loop's thread with each step's outputs as vLLM's
        # scheduler made them ({client index: EngineCoreOutputs}), before they are
        # turned into the SDK's Outputs: the engine-core protocol server
        # (frontend/engine_server.py) forwards them to vLLM's frontend as they are.
        self.engine_outputs: Callable[[Any], None] | None = None
        # An adopted request's prefix-cache work waits for its second step's launch
        # (adoption.DeferredPrefixCache), off the path to the first resumed token.
        hasher = core.request_block_hasher
        self.deferred_prefix_cache = DeferredPrefixCache(hasher) if hasher is not None else None
        # Diagnostics (FRMPS_DEBUG_STEP_PHASES): vLLM's calls timed in the traced steps.
        self.step_phases = phases.install(core, _runner_of(core), frmps=self)

    @property
    def counters(self) -> dict[str, int]:
        return dict(self.scheduler.frmps_counters)

    @staticmethod
    def _vllm_seed(key: int, wire_seed: int | None) -> int:
        """The int64 seed vLLM gets for a request (sdk/seeds.py: the one rule).
        vLLM reads -1 as "no seed" (SamplingParams turns it into None), so -1
        gets the derived seed too, on the active and on a standby alike."""
        seed = to_int64(resolve_seed(key, wire_seed))
        return to_int64(derive_seed(key)) if seed == -1 else seed

    def _params(self, key: int, params: Any, seed: int | None = None) -> Any:
        """A copy of ``params`` with the request's seed: the wire ``seed`` when
        given (adoption), else what the params carry (None: derived)."""
        from .adoption import copy_params

        params = copy_params(params)
        if seed is None:
            seed = None if params.seed is None else to_uint64(params.seed)
        params.seed = self._vllm_seed(key, seed)
        return params

    def add_request(self, key: int, prompt_token_ids: list[int], params: Any) -> None:
        from vllm.v1.request import Request

        self._check_new(key, prompt_token_ids)
        self.add_vllm_request(key, Request(
            request_id=request_id_for_key(key),
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=self._params(key, params),
            pooling_params=None,
            block_hasher=self.core.request_block_hasher,
        ))

    def _check_new(self, key: int, prompt_token_ids: list[int] | None) -> None:
        if key in self._tracks:
            raise ValueError(f"request {key} already exists")
        if not prompt_token_ids:
            raise ValueError(f"request {key}: empty prompt")

    def add_vllm_request(self, key: int, request: Any) -> None:
        """Add a vLLM ``Request`` built by the caller (``Request.from_engine_core_request``:
        the engine-core protocol server), named ``frmps-<key>``. Its sampling params
        are taken as they are (the frontend fixed the seed); a structured-output
        request has its grammar compiled first, as vLLM's EngineCore does when it
        receives a request (``preprocess_add_request``, v1/engine/core.py:1126-1148;
        0.26: :954-976)."""
        self._check_new(key, request.prompt_token_ids)
        if request.request_id != request_id_for_key(key):
            raise ValueError(f"request {request.request_id} is not named {request_id_for_key(key)}")
        if request.use_structured_output:
            self.scheduler.structured_output_manager.grammar_init(request)
        self.core.add_request(request)
        self._tracks[key] = _Track(0, list(request.sampling_params.stop or []))

    def adopt_request(
        self,
        key: int,
        params: Any,
        token_ids: list[int],
        num_prompt: int,
        num_computed: int,
        block_ids: list[int],
        seed: int,
        delivered_token_ids: list[int],
        request_kwargs: dict | None = None,
    ) -> AdoptResult:
        if key in self._tracks:
            raise ValueError(f"request {key} already exists")
        seed = to_uint64(self._vllm_seed(key, seed))
        if not self.kv_reuse:
            num_computed, block_ids = 0, []
        plan = plan_adoption(
            key=key,
            token_ids=token_ids,
            num_prompt=num_prompt,
            num_computed=num_computed,
            block_ids=block_ids,
            seed=seed,
            delivered_token_ids=delivered_token_ids,
            block_size=self.scheduler.block_size,
            num_blocks=self.scheduler.kv_cache_manager.block_pool.num_gpu_blocks,
        )
        # adopt() copies the params and sets the plan's seed on its copy (the one
        # _params would set): no copy here as well.
        result = self.scheduler.frmps_adopt(plan, params, block_hasher=self.core.request_block_hasher,
                                            request_kwargs=request_kwargs, deferred=self.deferred_prefix_cache)
        self._tracks[key] = _Track(len(plan.output_token_ids), list(params.stop or []))
        return result

    def abort(self, key: int) -> bool:
        if key not in self._tracks:
            return False
        self.core.abort_requests([request_id_for_key(key)])
        return True

    def reset(self) -> None:
        """Forget every request (a planned handover gave them to another engine) and the prefix cache:
        abort them in vLLM's scheduler, which frees their blocks, run the step that
        tells the model runner to drop their state (SchedulerOutput.finished_req_ids;
        it computes no token), and drop what the ring would still report. Runs on
        the engine loop's thread, like every step."""
        ids = [request_id_for_key(k) for k in self._tracks]
        if ids:
            self.core.abort_requests(ids)
        # One step delivers the finished ids (with a batch queue, one more drains
        # the batch in flight); bounded all the same.
        for _ in range(8):
            if not self.has_work():
                break
            self._step_fn()
        if self.has_work():
            raise RuntimeError("vLLM still has requests after the handover's reset")
        # The next engine owns the KV cache now and will overwrite these blocks: the
        # hashes vLLM keeps for freed blocks would let a request this engine serves
        # after a later takeover skip its prefill over foreign contents.
        if not self.scheduler.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after the handover's reset")
        self._tracks.clear()
        if self.deferred_prefix_cache is not None:
            self.deferred_prefix_cache.clear()
        self.scheduler.frmps_reset()

    # ---- negative controls (engine_api.TakeoverFaultHooks; tests and benches only) ----
    def check_takeover_faults(self, cases: Sequence[str]) -> None:
        """The KV-content cases need the model runner's KV caches in this process
        (not with tensor parallelism: the runner is in other processes, each with a
        shard); sampler-offset needs the V2 model runner's stateless sampler."""
        runner = _runner_of(self.core)
        if any(c != "sampler-offset" for c in cases) and not getattr(runner, "kv_caches", None):
            raise ValueError("the KV-content negative controls need vLLM's model runner and its KV caches in this "
                             "process (one GPU, the in-process executor; the CPU stand-in keeps no KV)")
        if "sampler-offset" in cases and not (hasattr(getattr(runner, "sampler", None), "sample")
                                              and hasattr(getattr(runner, "req_states", None), "req_id_to_index")):
            raise ValueError("sampler-offset needs vLLM's V2 model runner (its sampler draws from (seed, position)) "
                             "in this process")

    def fault_kv(self, op: str, block: int, other: int, slot: int) -> None:
        """Zero a block (or one slot of it) or swap two blocks in every layer's KV
        cache. Each of the runner's KV tensors has one dimension of
        ``num_gpu_blocks`` entries (K and V in one tensor, or per layer, whatever
        the attention backend's layout): the first such dimension is the block's."""
        import torch

        runner = _runner_of(self.core)
        caches = list(getattr(runner, "kv_caches", None) or [])
        if not caches:
            raise RuntimeError("fault_kv: vLLM's model runner holds no KV caches")
        nb = int(self.scheduler.kv_cache_manager.block_pool.num_gpu_blocks)
        bs = int(self.scheduler.block_size)
        with torch.no_grad():
            for t in caches:
                dims = [d for d in range(t.dim()) if t.shape[d] == nb]
                if not dims:
                    raise RuntimeError(f"fault_kv: a KV cache of shape {tuple(t.shape)} has no dimension of "
                                       f"{nb} blocks")
                d = dims[0]
                a = t.select(d, block)
                if op == "zero":
                    if slot >= 0:
                        sd = [i for i in range(a.dim()) if a.shape[i] == bs]
                        if not sd:
                            raise RuntimeError(f"fault_kv: a KV block of shape {tuple(a.shape)} has no dimension "
                                               f"of {bs} slots")
                        a = a.select(sd[0], slot)
                    a.zero_()
                elif op == "swap":
                    b = t.select(d, other)
                    tmp = a.clone()
                    a.copy_(b)
                    b.copy_(tmp)
                else:
                    raise ValueError(f"fault_kv: unknown op {op!r}")

    def shift_sampler(self, key: int, n: int) -> None:
        """vLLM's V2 sampler draws a token's noise from (seed, position of the
        sampled row): wrap the runner's sampler once so that the rows of request
        ``key`` draw with position + n."""
        runner = _runner_of(self.core)
        sampler = runner.sampler
        shifts = vars(sampler).get("_frmps_shifts")
        if shifts is None:
            shifts = {}
            inner = sampler.sample
            states = runner.req_states

            def sample(logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, pos, *a, **kw):
                for rid, k in list(shifts.items()):
                    idx = states.req_id_to_index.get(rid)
                    if idx is not None:
                        pos = pos + (expanded_idx_mapping == idx).to(pos.dtype) * k
                return inner(logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, pos, *a, **kw)

            sampler.sample = sample
            sampler._frmps_shifts = shifts
        rid = request_id_for_key(key)
        shifts[rid] = shifts.get(rid, 0) + n

    def gate_device(self, wait: Callable[[], None]) -> bool:
        """engine_api.DeviceGate, with vLLM's V2 model runner in this process (its
        default for Qwen2 and Llama on the GPU): its ``execute_model`` updates the
        request states, stages the block tables and prepares the inputs and the
        attention metadata in its own buffers, then calls ``kv_connector.pre_forward``
        right before the forward pass (the first work that touches the KV cache;
        gpu/model_runner.py, 0.26 and 0.33): the gate wraps that call once.
        False (the loop starts after the flip) with the V1 runner, which has no such
        call, and where the runner is in other processes (tensor parallelism)."""
        kvc = _pre_forward_owner(self.core)
        if kvc is None:
            return False
        own = vars(kvc).get("pre_forward")  # an instance's own, else the class's is called
        inner = kvc.pre_forward

        def gated(*args: Any, **kwargs: Any) -> Any:
            if own is None:
                vars(kvc).pop("pre_forward", None)
            else:
                kvc.pre_forward = own
            wait()
            return inner(*args, **kwargs)

        kvc.pre_forward = gated
        return True

    def warm_takeover(self) -> None:
        """engine_api.TakeoverWarmup: two throwaway requests (greedy, and seeded with
        top-k/top-p) adopted on blocks 1-4, stepped until each has a token, reset
        (which also empties the prefix cache). Only for a standby's own memory,
        before its pools are mapped: the steps write those blocks."""
        from vllm import SamplingParams

        if self.scheduler.kv_cache_manager.block_pool.num_gpu_blocks < 5:
            return
        throwaway_takeover(self, (SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                                  SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, top_k=50, ignore_eos=True)),
                           int(self.scheduler.block_size), self.scheduler.frmps_counters)
        self._warm_structured_outputs()

    def _warm_structured_outputs(self) -> None:
        """A third throwaway request, with a grammar any text fits: it builds vLLM's
        structured-output backend (importing its grammar library, indexing the
        vocabulary) and runs the grammar-bitmask path once. Otherwise the first
        takeover with a structured-output request in flight pays for that: the
        H100 proof runs measured 609 ms of adoption CPU time at a first takeover
        of 20 requests (5 with grammars), 6 ms at the later ones. Which backend:
        the configured one; under "auto" xgrammar (vLLM's first choice), and the
        first real structured-output request still decides, as in vLLM: if it
        asks for another, the warmed backend is dropped (_first_request_decides).
        A failure here costs only the warming (logged)."""
        import logging

        manager = getattr(self.scheduler, "structured_output_manager", None)
        if manager is None or manager.backend is not None:
            return
        so_config = manager.vllm_config.structured_outputs_config
        if so_config.reasoning_parser or manager.vllm_config.model_config.skip_tokenizer_init:
            return  # adoption refuses grammars behind a reasoning parser; no tokenizer, no grammars
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        kind = so_config.backend if so_config.backend != "auto" else "xgrammar"
        so = StructuredOutputsParams(regex="(.|\n)*")
        so._backend = kind
        try:
            throwaway_takeover(self, (SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, structured_outputs=so),),
                               int(self.scheduler.block_size), self.scheduler.frmps_counters)
        except Exception as e:  # noqa: BLE001 - the warm-up is an optimisation
            logging.getLogger(__name__).warning("structured outputs not warmed (%s: %s): a first takeover with a "
                                                "structured-output request will build the backend", type(e).__name__, e)
        if manager.backend is not None:
            _first_request_decides(manager, kind)

    def has_work(self) -> bool:
        # A batch in flight has outputs to process even when its requests were aborted.
        return bool(self.scheduler.has_requests()) or bool(self.core.batch_queue)

    # Optional Core capabilities (engine_api): LoadReport and StepSize.
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def scheduled_tokens(self) -> int:
        return int(self.scheduler.frmps_scheduled_tokens)

    def request_views(self) -> Iterable[CommittedView]:
        return self.scheduler.frmps_views()

    def _check_stop_strings(self, tr: _Track, new: list[int]) -> str | None:
        # vLLM matches stop strings in the front end's detokenizer, which this
        # in-process core bypasses; check here on a bounded tail of the text.
        if not tr.stop or self.tokenizer is None:
            return None
        tr.text_tail += self.tokenizer.decode(new)
        for s in tr.stop:
            if s in tr.text_tail:
                return s
        keep = max(len(s) for s in tr.stop) * 2
        tr.text_tail = tr.text_tail[-keep:]
        return None

    @property
    def launch_hook(self) -> bool:
        """engine_api.LaunchHook, for vLLM's synchronous step only (no batch queue):
        EngineCore.step launches the batch (``execute_model(non_block=True)``), asks
        the scheduler for the grammar bitmask and only then waits for the device, so
        the scheduler runs ``on_launch`` there (FrmpsScheduler.get_grammar_bitmask)
        and the ring publish overlaps the forward pass instead of leaving the device
        idle. With async scheduling the next batch is in flight between steps anyway."""
        return self.core.batch_queue is None

    def step(self, on_launch: Callable[[], None] | None = None) -> list[Output]:
        deferred = self.deferred_prefix_cache
        if deferred is not None and not deferred.due():
            deferred = None
        if deferred:
            # Adopted requests' prefix-cache work, in the step after their first,
            # once its forward pass is enqueued: at the launch (synchronous step), or
            # right after vLLM's step returns with the batch in flight (async
            # scheduling); after the step where nothing was launched.
            def launched(then: Callable[[], None] | None = on_launch) -> None:
                deferred.run(self.scheduler)
                if then is not None:
                    then()

            on_launch = launched
        if on_launch is not None and self.launch_hook:
            self.scheduler.frmps_on_launch = on_launch  # taken (and cleared) by the scheduler at the launch
        try:
            outputs_by_client, _ = self._step_fn()
        finally:
            self.scheduler.frmps_on_launch = None  # not launched (nothing to schedule): the loop publishes after
        if deferred:
            deferred.run(self.scheduler)  # a no-op once run at the launch
        return self._outputs(outputs_by_client)

    def finish_in_flight(self) -> list[Output]:
        """engine_api.Pipelined: process the batches in flight (async scheduling)
        without scheduling new ones. The scheduler reports no requests meanwhile,
        so vLLM's own step_with_batch_queue only waits for the oldest batch and
        processes it."""
        result: list[Output] = []
        if not self.core.batch_queue:
            return result
        self.scheduler.frmps_hold = True
        try:
            while self.core.batch_queue:
                outputs_by_client, _ = self._step_fn()
                result.extend(self._outputs(outputs_by_client))
        finally:
            self.scheduler.frmps_hold = False
        return result

    def _outputs(self, outputs_by_client: Any) -> list[Output]:
        result: list[Output] = []
        if not outputs_by_client:  # the batch queue only took a new batch
            return result
        if self.engine_outputs is not None:
            self.engine_outputs(outputs_by_client)
        stopped: list[int] = []
        for eco in outputs_by_client.values():
            for out in eco.outputs:
                key = key_for_request_id(out.request_id)
                tr = self._tracks.get(key) if key is not None else None
                if tr is None:
                    continue
                new = list(out.new_token_ids)
                index = tr.num_out
                tr.num_out += len(new)
                reason = _FINISH.get(int(out.finish_reason), "abort") if out.finish_reason is not None else None
                stop_reason = out.stop_reason
                if reason is None:
                    hit = self._check_stop_strings(tr, new)
                    if hit is not None:
                        reason, stop_reason = "stop", hit
                        stopped.append(key)
                finished = reason is not None
                result.append(Output(key, new, index, finished, reason, stop_reason))
                if finished:
                    del self._tracks[key]
        if stopped:
            self.core.abort_requests([request_id_for_key(k) for k in stopped])
        return result


# -- configuration -------------------------------------------------------------
def _hf_config(model: str) -> dict:
    path = os.path.join(model, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as exc:
        raise ValueError(f"model directory {model!r} has no readable config.json: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from exc


def _tokenizer_config(model: str) -> dict | None:
    """The model directory's tokenizer_config.json (None without one): vLLM caps
    the context length with its model_max_length."""
    try:
        with open(os.path.join(model, "tokenizer_config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_DECODERS = {"Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM"}
# transformers' defaults (its config classes) for fields a config.json may leave
# out, as vLLM then sees them: every decoder here defaults to untied embeddings;
# the position count differs by architecture.
_DEFAULT_POSITIONS = {"Qwen2ForCausalLM": 32768, "Qwen3ForCausalLM": 32768, "LlamaForCausalLM": 2048,
                      "MistralForCausalLM": 4096 * 32}


def _field(cfg: dict, name: str, default: Any = None) -> Any:
    """A config.json field with JSON null read as absent, as transformers reads it
    (it writes null for unset optional fields: num_key_value_heads, head_dim).
    The fields the formulas read are top-level in what transformers 4 and 5
    write alike; only RoPE moved (rope_parameters), which the formulas do not read."""
    v = cfg.get(name)
    return default if v is None else v


def _weight_tensors(cfg: dict, dtype: str, allocated: bool = False, tp: int = 1) -> list[int]:
    """Bytes of each parameter tensor of a Llama-family decoder (Qwen2/Qwen3/
    Llama/Mistral), in vLLM's construction order (vllm/model_executor/models/
    qwen2.py: embed_tokens; per layer qkv_proj, o_proj, mlp, two norms; norm;
    lm_head). Vocabulary-sized tensors are padded to 64 rows, as
    VocabParallelEmbedding does. ``allocated``: every tensor vLLM allocates,
    including a tied lm_head's own weight, which ParallelLMHead creates before
    tie_weights replaces it (qwen2.py:480-487) and whose memory then stays
    cached in the pool's MemPool. ``tp``: one rank's shard of a tensor-parallel
    group, as vLLM's parallel layers split it (vocabulary rows and attention heads
    and MLP columns divided by ``tp``, KV heads too or one replicated per rank when
    there are fewer than ranks, norms whole: layers/vocab_parallel_embedding.py,
    layers/linear.py QKVParallelLinear)."""
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in _DECODERS:
        raise ValueError(f"architecture {arch} has no frmps weights-pool formula yet (known: {sorted(_DECODERS)})")
    nb = _DTYPE_BYTES[dtype]
    h, i, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    v = -(-cfg["vocab_size"] // 64) * 64
    heads = cfg["num_attention_heads"]
    kvh = _field(cfg, "num_key_value_heads", heads)
    hd = _field(cfg, "head_dim") or h // heads
    if tp < 1 or heads % tp or i % tp or v % tp or (kvh >= tp and kvh % tp) or (kvh < tp and tp % kvh):
        raise ValueError(f"tensor parallel size {tp} does not divide the model ({heads} heads, {kvh} KV heads, "
                         f"intermediate {i}, vocabulary {v})")
    heads, kvh, i, v = heads // tp, max(1, kvh // tp), i // tp, v // tp
    per_layer = [h * (heads + 2 * kvh) * hd]  # fused qkv (vLLM's QKVParallelLinear)
    if arch == "Qwen2ForCausalLM":
        per_layer.append((heads + 2 * kvh) * hd)  # Qwen2 has q/k/v biases
    per_layer.append(heads * hd * h)  # o_proj
    if arch == "Qwen3ForCausalLM":
        per_layer += [hd, hd]  # q_norm, k_norm
    per_layer += [2 * i * h, i * h, h, h]  # fused gate_up, down, two RMSNorms
    tensors = [v * h] + per_layer * L + [h]
    if allocated or not _field(cfg, "tie_word_embeddings", False):
        tensors.append(v * h)
    return [n * nb for n in tensors]


def weight_bytes(cfg: dict, dtype: str) -> int:
    """Parameter bytes of a Llama-family decoder, each tensor padded to the
    512 bytes torch's caching allocator rounds every block to."""
    return sum(-(-n // 512) * 512 for n in _weight_tensors(cfg, dtype))


def weights_pool_bytes(cfg: dict, dtype: str, tp: int = 1) -> int:
    """The weights pool: what vLLM's model loader allocates inside it
    (patches.py, loader-weights-pool), in the segments torch asks for.

    The parameters (and a tied lm_head's discarded weight) as torch's caching
    allocator packs them in construction order (pools.torch_segments_bytes);
    the rotary embedding's cos/sin cache (one buffer, max_position_embeddings x
    head_dim in the model dtype) and its float32 intermediates
    (vllm/model_executor/layers/rotary_embedding/base.py:94-103; freed, but
    their segments stay cached in the pool's MemPool); and one more small
    (2 MiB) and large (20 MiB) segment for what this formula does not list
    (attention scales, loader temporaries). An estimate of vLLM's allocation
    sequence, not a replay of it: the GPU validation logs the bytes actually
    placed (VLLM.md), and a pool that is too small stops the load with
    PoolFull.

    Plus headroom (2 %, at least 64 MiB) for fragmentation: when an allocation
    misses, torch releases its cached free segments and retries, which leaves
    holes in the pool's first-fit carve-out that a large tensor allocated last
    (the lm_head) cannot use. Without it, qwen2.5-7b on vLLM 0.26 (H100) missed
    its 1.02 GiB lm_head with 1.07 GiB free in the pool, in pieces."""
    from .pools import TORCH_LARGE_SEGMENT, TORCH_SMALL_SEGMENT, torch_segments_bytes

    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    hd = _field(cfg, "head_dim") or h // heads
    arch = (cfg.get("architectures") or ["?"])[0]
    positions = int(_field(cfg, "max_position_embeddings", _DEFAULT_POSITIONS.get(arch, 0)))
    rope = positions * hd * _DTYPE_BYTES[dtype] + positions * hd * 4 * 5 // 2  # cache + cat, freqs, cos, sin (fp32)
    allocated = _weight_tensors(cfg, dtype, allocated=True, tp=tp)
    est = torch_segments_bytes(allocated) + rope + TORCH_SMALL_SEGMENT + TORCH_LARGE_SEGMENT
    return est + max(64 << 20, est // 50)


def startup_memory_fraction(free: int, total: int, wanted: float) -> float:
    """The gpu_memory_utilization to hand vLLM. Its worker refuses to start
    unless free memory >= gpu_memory_utilization x total (v1/worker/utils.py:
    716-770, called from gpu_worker.py:542), but frmps allocated the shared
    pools before vLLM starts (and the other engine shares the GPU), so the
    fraction is capped at what is free then. With ``kv_cache_memory_bytes``
    given and the block count pinned, vLLM sizes nothing else from it
    (gpu_worker.py:656-681 skips the memory profiling)."""
    if total <= 0 or free < 0:
        raise ValueError(f"bad device memory figures: {free} free of {total}")
    return max(0.01, min(float(wanted), 0.98 * free / total))


@dataclass
class VllmEngineConfig:
    model: str
    device: str = "cuda"
    num_blocks: int = 0  # 0: sized from --gpu-memory-utilization (sizing.py)
    block_size: int = 16
    max_model_len: int = 0  # 0: the model's own context length, as vLLM derives it
    dtype: str = "bfloat16"
    # "load": the active reads the model directory's *.safetensors into the weights
    # pool (a standby never loads: it maps that pool); "dummy": random weights.
    weights: str = "dummy"
    sync_every: int = 1
    # None: vLLM decides (on where its executor and model runner support it, as
    # for vLLM alone); the scheduler class follows its decision (scheduler_cls_for).
    async_scheduling: bool | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int | None = None  # None: vLLM's default for `vllm serve`
    max_num_batched_tokens: int | None = None
    # vLLM's StructuredOutputsConfig fields (None: vLLM's defaults); from
    # FRMPS_VLLM_STRUCTURED_OUTPUTS_CONFIG.
    structured_outputs: dict | None = None
    # EngineArgs fields from --vllm-arg (vllm_overrides): vLLM's own flags,
    # applied over frmps's choices except those frmps owns.
    overrides: dict = field(default_factory=dict)
    # Ranks of a tensor-parallel group (tp.py); 1: the in-process executor.
    tensor_parallel_size: int = 1
    # False: the no-KV ablation (--no-kv-reuse, frmps bench's baseline): a standby recomputes adopted KV.
    kv_reuse: bool = True


def scheduler_cls_for(vllm_config: Any) -> str:
    """The frmps scheduler for a built VllmConfig: the async variant where vLLM
    settled on async scheduling (its platform hook has the last word, after
    EngineArgs), else the synchronous one. A synchronous scheduler under async
    scheduling would misread the in-flight step's placeholders."""
    from . import ASYNC_SCHEDULER_CLS

    return ASYNC_SCHEDULER_CLS if vllm_config.scheduler_config.async_scheduling else SCHEDULER_CLS


class VllmAdapter:
    """The SDK's EngineAdapter for the supported vLLM versions (``compat``)."""

    name = "vllm"

    def __init__(self, cfg: VllmEngineConfig):
        from .compat import current

        self.compat = current()
        self.version = self.compat.VERSION
        if cfg.dtype not in _DTYPE_BYTES:
            raise ValueError(f"dtype {cfg.dtype!r} not supported (use one of {sorted(_DTYPE_BYTES)})")
        if not 0 < cfg.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {cfg.gpu_memory_utilization}")
        if cfg.weights not in ("load", "dummy"):
            raise ValueError(f"weights {cfg.weights!r}: want load or dummy")
        self.cfg = cfg
        self.hf = _hf_config(cfg.model)
        self.model, self.device = cfg.model, cfg.device
        self._gpu_name = ""  # set by _gpu()
        if cfg.max_model_len < 1:  # vLLM's own derivation, which vLLM checks again when it builds
            cfg.max_model_len = sizing.model_max_len(self.hf, _tokenizer_config(cfg.model))
        # Hello.weights (sdk/runner.py logs it at start).
        self.weights = weights_source(cfg.model, cfg.weights == "load")
        if cfg.device.startswith("cuda"):  # refused here, at the start, not once vLLM builds its sampler
            flashinfer_sampler_default(dict(os.environ), _importable("flashinfer"))
        self.block_size, self.num_blocks, self.max_model_len = cfg.block_size, cfg.num_blocks, cfg.max_model_len
        # sizing.KVBudget: the runner's Hello carries it (control.proto KVBudget).
        self.kv_budget: sizing.KVBudget | None = None
        if cfg.num_blocks < 1:
            self.kv_budget = self._size_kv_cache()
            self.num_blocks = cfg.num_blocks = self.kv_budget.num_blocks
        elif cfg.device.startswith("cuda"):
            self.kv_budget = self._given_budget()
        # The largest FULL ring record this engine can publish (runner: checked against the ring).
        self.ring_record_bytes = 0
        if self.kv_budget is not None:
            from ..ring.layout import PAYLOAD_PER_ENTRY

            seqs, _ = self.batch_limits(self.kv_budget.gpu_total_bytes, self._gpu_name)
            self.ring_record_bytes = sizing.ring_record_bytes(
                max_num_seqs=seqs, max_model_len=self.max_model_len, block_size=self.block_size,
                kv_tokens=self.num_blocks * self.block_size, entry_bytes=PAYLOAD_PER_ENTRY)
        logging.getLogger(__name__).info("max_model_len %d, %s", self.max_model_len,
                                         self.kv_budget.line() if self.kv_budget else f"KV cache: {self.num_blocks} blocks (--num-blocks)")
        self._tokenizer = None
        self._gen_config: dict | None = None
        self._engine_core = False  # serve_engine_core(): cores without a detokenizer
        self._peer_death: Callable[[str], None] | None = None
        self._group_memory: Any = None  # tp.VllmGroupMemory of a tensor-parallel engine

    def _gpu(self) -> tuple[int, str]:
        """The GPU's memory and name, from NVML as vLLM reads them (no CUDA context)."""
        from vllm.platforms import current_platform

        dev = self.cfg.device
        index = int(dev.split(":", 1)[1]) if dev.startswith("cuda:") else 0
        total, self._gpu_name = int(current_platform.get_device_total_memory(index)), str(current_platform.get_device_name(index))
        return total, self._gpu_name

    def batch_limits(self, gpu_total: int, gpu_name: str) -> tuple[int, int]:
        """(max_num_seqs, max_num_batched_tokens) this engine runs with: the flags or
        --vllm-arg where given, else `vllm serve`'s defaults for this GPU."""
        seqs, tokens = sizing.serve_batch_defaults(gpu_total, gpu_name)
        seqs = self.cfg.overrides.get("max_num_seqs") or self.cfg.max_num_seqs or seqs
        tokens = self.cfg.overrides.get("max_num_batched_tokens") or self.cfg.max_num_batched_tokens or tokens
        return int(seqs), int(tokens)

    def block_bytes(self) -> int:
        """One KV block of every layer on one rank."""
        h, tp = self.hf, self.cfg.tensor_parallel_size
        heads = h["num_attention_heads"]
        return kv_cache_bytes(num_layers=h["num_hidden_layers"], num_blocks=1, block_size=self.block_size,
                              num_kv_heads=max(1, h.get("num_key_value_heads", heads) // tp),
                              head_size=h.get("head_dim") or h["hidden_size"] // heads,
                              dtype_bytes=_DTYPE_BYTES[self.cfg.dtype])

    def _size_kv_cache(self, gpu: tuple[int, str] | None = None, env: Mapping[str, str] | None = None) -> "sizing.KVBudget":
        """The block count from --gpu-memory-utilization (sizing.size_kv), per rank.
        Both engines compute the same from the same configuration and GPU; the
        supervisor still launches every later engine with the active's count."""
        env = os.environ if env is None else env
        try:
            total, name = gpu or self._gpu()
        except Exception as e:  # noqa: BLE001 - NVML's or the platform's errors
            raise ValueError(f"--engine vllm: cannot read the GPU's memory to size the KV cache ({e}); "
                             "give --num-blocks") from None
        self._gpu_name = name
        seqs, tokens = self.batch_limits(total, name)
        tp = self.cfg.tensor_parallel_size
        weights = self._layout(1)[0].size
        report = sizing.MemoryReport(
            gpu_total=total, utilization=self.cfg.gpu_memory_utilization, weights=weights,
            activations=sizing.activation_bytes(self.hf, max_num_batched_tokens=tokens, max_num_seqs=seqs,
                                                dtype_bytes=_DTYPE_BYTES[self.cfg.dtype], tp=tp),
            # The MPS server's context, where the engines run under MPS (the supervisor's client environment).
            mps=sizing.MPS_SERVER_BYTES if env.get("CUDA_MPS_PIPE_DIRECTORY") else 0)
        try:
            return sizing.size_kv(report, block_bytes=self.block_bytes(), layers=self.hf["num_hidden_layers"],
                                  min_blocks=-(-self.max_model_len // self.block_size) + 1,
                                  kv_pool_bytes=lambda n: self._layout(n)[1].size)
        except sizing.SizingError as exc:
            raise ValueError(f"--engine vllm: {exc}") from None

    def _given_budget(self) -> "sizing.KVBudget | None":
        """What --num-blocks gives, reported with the GPU's figures (None where NVML cannot say)."""
        try:
            total, _ = self._gpu()
        except Exception as e:  # noqa: BLE001 - a report only
            logging.getLogger(__name__).warning("the GPU's memory (NVML): %s", e)
            return None
        layout = self.pool_layout()
        return sizing.given_blocks(self.num_blocks, block_bytes=self.block_bytes(), weights=layout[0].size,
                                   kv_bytes=layout[1].size, gpu_total=total,
                                   utilization=self.cfg.gpu_memory_utilization)

    def _log_measured(self, device: Any) -> None:
        """The active, once built: the device's memory in use against the budget
        (MPS or not, cudaMemGetInfo counts every process on the GPU: here the
        active, its pools and the MPS server; the standby comes later)."""
        b = self.kv_budget
        if b is None:
            return
        try:
            import torch

            free, total = torch.cuda.mem_get_info(device)
        except Exception as e:  # noqa: BLE001 - a report only
            logging.getLogger(__name__).warning("device memory after the build: %s", e)
            return
        used = total - free
        est = b.weights_bytes + b.kv_bytes + (b.reserved_bytes - b.reserved.get("mps", 0)) // 2 + b.reserved.get("mps", 0)
        logging.getLogger(__name__).info(
            "device memory with the active built: %.2f GiB in use of %.2f GiB (the sizing counted %.2f GiB for "
            "the active, its pools and MPS; with the standby the deployment may use %.2f GiB)",
            used / sizing.GiB, total / sizing.GiB, est / sizing.GiB, b.budget_bytes / sizing.GiB)

    # engine_api.ProcessGroup: a tensor-parallel engine's ranks are vLLM's worker processes (tp.py).
    @property
    def workers_own_pools(self) -> bool:
        """Every rank builds its own pools in its worker: this process needs no memory
        backend of its own (cli.py passes memory.BackendName), and opens no device."""
        return self.cfg.tensor_parallel_size > 1

    def group_memory(self, local: Any) -> Any:
        if self.cfg.tensor_parallel_size == 1:
            return local
        from .tp import VllmGroupMemory

        local.close()  # rank 0 holds no pool memory (cli.py gives it a BackendName): the workers do
        self._group_memory = VllmGroupMemory(local.name, self.cfg.tensor_parallel_size)
        return self._group_memory

    def on_peer_death(self, fn: Callable[[str], None]) -> None:
        self._peer_death = fn

    def _worker_died(self) -> None:
        """vLLM's executor saw a worker process exit (its failure callback)."""
        if self._peer_death is not None:
            self._peer_death(self._dead_worker() or "a tensor-parallel worker of vLLM's executor died")

    def _dead_worker(self) -> str | None:
        """Which of vLLM's worker processes has exited, if one has. vLLM's executor
        shuts the others down once it saw one die (they exit 0 or by SIGTERM): a
        worker that died otherwise is the one to name."""
        executor = self._group_memory.executor if self._group_memory is not None else None
        dead = []
        for i, handle in enumerate(getattr(executor, "workers", None) or []):
            proc = getattr(handle, "proc", None)
            code = proc.exitcode if proc is not None else None
            if code is not None:
                dead.append((code in (0, -signal.SIGTERM), getattr(handle, "rank", i), proc.pid, code))
        if not dead:
            return None
        _, rank, pid, code = min(dead)  # a worker that died otherwise first, then by rank
        return rank_death(rank, f"vLLM worker pid {pid}", code)

    def dead_peer(self, wait_s: float) -> str | None:
        """engine_api.ProcessGroup: a step failed (vLLM's executor raises "Executor
        failed" once its monitor saw a worker die, before the failure callback runs):
        the dead worker, if one exits within wait_s seconds."""
        if self.cfg.tensor_parallel_size == 1:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            cause = self._dead_worker()
            if cause or time.monotonic() >= deadline:
                return cause
            time.sleep(0.01)

    def serve_engine_core(self) -> None:
        """engine_api.EngineCoreProtocol: the runner's core mode. Cores built from
        now on have no tokenizer of their own: vLLM's API server detokenizes and
        matches stop strings (a core that matched them would end requests behind
        the frontend's back), and requests arrive as token ids. vLLM's EngineCore
        keeps its tokenizer for structured outputs (the grammar compiler)."""
        self._engine_core = True

    def engine_core_server(self, core: VllmCore, input_address: str, output_address: str, **kw: Any) -> Any:
        """engine_api.EngineCoreProtocol: ``frontend.engine_server.EngineCoreServer`` over ``core``."""
        from .frontend.engine_server import EngineCoreServer

        return EngineCoreServer(core, input_address, output_address, **kw)

    def pool_layout(self):
        return self._layout(self.num_blocks)

    def _layout(self, num_blocks: int):
        h = self.hf
        heads = h["num_attention_heads"]
        layers = h["num_hidden_layers"]
        kv = kv_cache_bytes(
            num_layers=layers,
            num_blocks=num_blocks,
            block_size=self.block_size,
            # one rank's KV heads: vLLM divides them, or replicates one per rank when fewer
            num_kv_heads=max(1, _field(h, "num_key_value_heads", heads) // self.cfg.tensor_parallel_size),
            head_size=_field(h, "head_dim") or h["hidden_size"] // heads,
            dtype_bytes=_DTYPE_BYTES[self.cfg.dtype],
        )
        allocations = self.compat.kv_cache_allocations(layers, kv // layers)
        # Diagnostic knob: room beyond the estimate (both engines read the same
        # environment, so their layouts still agree).
        slack = int(os.environ.get("FRMPS_VLLM_WEIGHTS_SLACK_MIB", "0") or 0) << 20
        tp = self.cfg.tensor_parallel_size
        one = pool_layout(weights_pool_bytes(h, self.cfg.dtype, tp) + slack, allocations)
        if tp == 1:
            return one
        # Every rank the same sizes, a pool's index its rank: weights then kv_cache of rank 0, then of rank 1, ...
        return [PoolSpec(s.tag, rank, s.size) for rank in range(tp) for s in one]

    def engine_args(self, load_weights: bool, gpu_memory_utilization: float | None = None) -> Any:
        from vllm.engine.arg_utils import EngineArgs

        from . import ASYNC_SCHEDULER_CLS

        return EngineArgs(
            model=self.cfg.model,
            dtype=self.cfg.dtype,
            max_model_len=self.cfg.max_model_len,
            block_size=self.cfg.block_size,
            num_gpu_blocks_override=self.cfg.num_blocks,
            load_format=self.load_format(load_weights),
            enable_sleep_mode=True,
            **self.compat.engine_args(SLEEP_BACKEND_NAME),
            # Replaced by scheduler_cls_for once vLLM has settled async_scheduling.
            scheduler_cls=ASYNC_SCHEDULER_CLS if self.cfg.async_scheduling else SCHEDULER_CLS,
            async_scheduling=self.cfg.async_scheduling,
            additional_config={"frmps": {"sync_every": self.cfg.sync_every}},
            tensor_parallel_size=self.cfg.tensor_parallel_size,
            # One rank: the worker in this process. Several: vLLM's worker processes (tp.py); its custom
            # all-reduce (CUDA IPC buffers between the ranks) is off until it is checked inside MPS.
            distributed_executor_backend="uni" if self.cfg.tensor_parallel_size == 1 else "mp",
            # Its workers register frmps's plugin through a worker extension (tp_worker.py).
            **({} if self.cfg.tensor_parallel_size == 1 else {
                "disable_custom_all_reduce": True,
                "worker_extension_cls": TP_WORKER_EXTENSION}),
            # The KV cache is the kv_cache pool, allocated before vLLM starts:
            # vLLM must not size it from free memory (per rank with tensor parallelism).
            kv_cache_memory_bytes=self.pool_layout()[1].size,
            gpu_memory_utilization=gpu_memory_utilization or self.cfg.gpu_memory_utilization,
            seed=0,
            **{**{k: v for k, v in (("max_num_seqs", self.cfg.max_num_seqs),
                                    ("max_num_batched_tokens", self.cfg.max_num_batched_tokens)) if v},
               **self._structured_outputs_arg(), **self.cfg.overrides},
        )

    def load_format(self, load_weights: bool) -> str:
        """vLLM's load_format: "safetensors" (its DefaultModelLoader, which reads
        the directory's *.safetensors into the parameters the loader patch placed
        in the weights pool, converting them to the engine's dtype) for the active
        of a model with weights; "dummy" for a standby (it never loads: its
        placeholder parameters are replaced by the active's pool when it maps it)
        and for dummy weights."""
        return "safetensors" if (load_weights and self.cfg.weights == "load") else "dummy"

    def _structured_outputs_arg(self) -> dict:
        if not self.cfg.structured_outputs:
            return {}
        from vllm.config import StructuredOutputsConfig

        return {"structured_outputs_config": StructuredOutputsConfig(**self.cfg.structured_outputs)}

    def create_core(self, pools: dict, load_weights: bool) -> VllmCore:
        """Build vLLM in this process on the given pools (GPU path; see VLLM.md).

        ``pools`` maps (tag, index) to the SDK's pool tensors (cuda-vmm: CUDA
        tensors over the interceptor's pools; a standby's are its scratch-backed
        reservations). They are wrapped in a PoolController with the allocation
        contexts of allocation.py, through which vLLM's model loader places the
        model in the weights pool and its worker the KV cache in the kv_cache
        pool. CPU pools are refused here, before vLLM is built.
        """
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.executor.abstract import Executor

        from .allocation import cuda_contexts
        from .plugin import register
        from .pools import PoolController, install_controller, set_context_factory

        register()
        import torch

        sampler_note = flashinfer_sampler_default(os.environ, _importable("flashinfer"))
        if sampler_note:
            logging.getLogger(__name__).info("%s", sampler_note)
        ptxas = triton_ptxas_default(os.environ, os.path.dirname(torch.__file__))
        if ptxas:
            logging.getLogger(__name__).info("Triton's ptxas: %s (%s)", ptxas, TRITON_PTXAS_ENV)
        if mega_aot_default(os.environ, torch.__version__):
            import vllm.envs

            triton_dir = triton_cache_default(os.environ, vllm.envs.VLLM_CACHE_ROOT)
            logging.getLogger(__name__).info(
                "torch.compile artifacts loaded whole (%s=1, frmps's default on torch %s; 0 turns it off); "
                "Triton's kernel cache: %s", MEGA_AOT_ENV, torch.__version__.split("+")[0], triton_dir)
        tp = self.cfg.tensor_parallel_size
        if tp == 1:
            controller = PoolController.external(pools, "active" if load_weights else "standby")
            contexts = cuda_contexts(controller)
            install_controller(controller)
            set_context_factory(contexts)
            free, total = torch.cuda.mem_get_info(controller.pool_device("kv_cache"))
            fraction = startup_memory_fraction(free, total, self.cfg.gpu_memory_utilization)
        else:
            fraction = self._tp_prepare(load_weights)
        from vllm.usage.usage_lib import UsageContext

        # `vllm serve`'s usage context: its batch defaults (EngineArgs.get_batch_defaults) where none is given.
        vllm_config = self.engine_args(load_weights, fraction).create_engine_config(
            usage_context=UsageContext.OPENAI_API_SERVER)
        self.compat.finish_config(vllm_config, SLEEP_BACKEND_NAME)
        vllm_config.scheduler_config.scheduler_cls = scheduler_cls_for(vllm_config)
        watch = watch_from_env()  # what Triton compiled during this build, and why (triton_watch.py)
        core = EngineCore(vllm_config, Executor.get_class(vllm_config), log_stats=False,
                          executor_fail_callback=self._worker_died if tp > 1 else None)
        if load_weights and tp == 1:
            self._log_measured(controller.pool_device("kv_cache"))
        if watch is not None and tp == 1:  # a tensor-parallel rank 0 compiles nothing: its ranks do (below)
            logging.getLogger(__name__).info("%s", watch.start_summary())
        if tp > 1:
            self._group_memory.attach(core.model_executor)
            try:
                for rank, line in enumerate(self._group_memory.rank_triton_summaries()):
                    logging.getLogger(__name__).info("rank %d: %s", rank, line)
            except Exception as e:  # noqa: BLE001 - diagnostics must not fail the build
                logging.getLogger(__name__).warning("the ranks' Triton summaries: %s", e)
            if load_weights:
                self._group_memory.collect()  # every rank's fds, which the runner exports
        return VllmCore(core, None if self._engine_core else self.tokenizer(), kv_reuse=self.cfg.kv_reuse)

    def _tp_prepare(self, load_weights: bool) -> float:
        """Before a tensor-parallel EngineCore (tp.py): tell vLLM's
        workers (through their inherited environment) this engine's role and every
        rank's pools; each builds its own after its device is up. Returns the
        startup-memory fraction: a rank's check (free >= fraction x total) runs
        before it allocates its pools, and frmps sized those itself, so only a
        nominal fraction is asked (vLLM does not size the KV cache from it:
        kv_cache_memory_bytes)."""
        from .tp import MULTIPROC_METHOD_ENV, POOLS_ENV, pools_env

        gm = self._group_memory
        if gm is None:
            raise ValueError("a tensor-parallel vLLM engine needs its group memory (the runner's ProcessGroup path)")
        if gm.name != "cuda-vmm":
            raise ValueError(f"--engine vllm needs --memory cuda-vmm (got {gm.name})")
        os.environ[POOLS_ENV] = pools_env(self.pool_layout(), "active" if load_weights else "standby", gm.name)
        # spawn, not vLLM's default fork: a forked worker would inherit every descriptor of this
        # process — its connection to the supervisor among them, which would then not close when
        # this process dies, and the supervisor would not see the death — and its gRPC threads' state.
        os.environ[MULTIPROC_METHOD_ENV] = "spawn"
        return min(self.cfg.gpu_memory_utilization, 0.01)

    def sampling_params(self, params: Any, seed: int) -> Any:
        """control_pb2.SamplingParams (validated by the SDK; ``seed`` resolved) -> vllm SamplingParams,
        with the model's end-of-sequence tokens as vLLM's own input processor sets them
        (v1/engine/input_processor.py: update_from_generation_config)."""
        # From its module: ``from vllm import`` goes through vllm's lazy __getattr__ and
        # import_module on every call (~4 us, per request and per adopted request).
        from vllm.sampling_params import SamplingParams

        sp = SamplingParams(
            # vLLM requires max_tokens (vllm/v1/request.py:114); 0 on the wire means "up to the context".
            max_tokens=int(params.max_tokens) or self.max_model_len,
            temperature=float(params.temperature),
            top_p=float(params.top_p) if params.top_p else 1.0,
            top_k=int(params.top_k) if params.top_k else 0,
            stop=list(params.stop) or None,
            stop_token_ids=[int(t) for t in params.stop_token_ids] or None,
            ignore_eos=bool(params.ignore_eos),
            include_stop_str_in_output=bool(params.include_stop_str_in_output),
            seed=to_int64(seed),
        )
        sp.update_from_generation_config(self._generation_config(), self.tokenizer().eos_token_id)
        return sp

    def _generation_config(self) -> dict:
        """The model directory's generation_config.json ({} without one), which vLLM
        reads for the end-of-sequence ids (ModelConfig.try_get_generation_config)."""
        if self._gen_config is None:
            path = os.path.join(self.cfg.model, "generation_config.json")
            try:
                with open(path) as f:
                    self._gen_config = dict(json.load(f))
            except FileNotFoundError:
                self._gen_config = {}
            except (OSError, ValueError, TypeError) as exc:
                raise ValueError(f"{path}: {exc}") from exc
        return self._gen_config

    def tokenizer(self) -> VllmTokenizer:
        if self._tokenizer is None:
            tok = _PRELOADED_TOKENIZERS.pop(self.cfg.model, None)  # a spare's (preload)
            if tok is None:
                from vllm.tokenizers.registry import get_tokenizer

                tok = get_tokenizer(self.cfg.model)
            self._tokenizer = VllmTokenizer(tok)
        return self._tokenizer


def async_scheduling_from_env(env: Mapping[str, str]) -> bool | None:
    """FRMPS_VLLM_ASYNC_SCHEDULING (both engines read the same environment): unset,
    empty or auto: vLLM decides, as for vLLM alone (on unless the model, the
    speculative decoding or the executor rules it out); 1: on; 0: off (the
    synchronous step).

    vLLM's default since frmps 03baebc's measurement on the H100
    (bench/results/2026-11-27-h100x4-vllm-03baebc): with every request of an engine
    on one generation stream, the pipelined step took frmps + vLLM's decode
    throughput at 0.5B to 1.9 / 0.7 / 48 % below vLLM alone at 1 / 8 / 64 streams,
    against 20 / 23 / 52 % for the synchronous step; takeovers with it are
    token-exact on the H100 (7B: 2026-11-23-h100-vllm-7b; 0.5B:
    2026-11-26-h100-vllm-bench/async-scheduling)."""
    v = env.get("FRMPS_VLLM_ASYNC_SCHEDULING", "").strip()
    if v in ("", "auto"):
        return None
    if v == "1":
        return True
    if v == "0":
        return False
    raise ValueError(f"FRMPS_VLLM_ASYNC_SCHEDULING={v!r}: use auto (the default: vLLM decides), 1 (on) or 0 (off)")


MEGA_AOT_ENV = "VLLM_USE_MEGA_AOT_ARTIFACT"


def mega_aot_default(env: MutableMapping[str, str], torch_version: str) -> bool:
    """Sets VLLM_USE_MEGA_AOT_ARTIFACT=1 in ``env`` (the engine's own environment,
    before vLLM reads it) unless it is set already, or vLLM's AOT compile cache is
    off (VLLM_USE_AOT_COMPILE=0, VLLM_DISABLE_COMPILE_CACHE=1) or torch is older
    than 2.10 (no AOT compile); returns whether it is on.

    With it, an engine whose model vLLM compiled before loads the compiled model
    whole from vLLM's cache instead of unpickling its FX graph, splitting it again
    and loading each piece (vLLM 0.26, vllm/compilation/caching.py). vLLM turns it
    on by itself from torch 2.12; on torch 2.11 (vLLM 0.26's pin) it is opt-in.
    What it changed on the H200 (bench/results/2026-11-27-h200-vllm-restore/):
    the placement restored after a failover in 12.4 s instead of 20.4 s at 14B and
    10.7 s instead of 13.9 s at 7B (median of 12 faults each, lanes of one machine),
    11.3 s instead of 17.1 s at 14B on another, every stream token-identical to the
    no-fault run; loading the compiled model went from 3.5-4.6 s to 0.1-0.2 s per
    engine at 14B and vLLM's first (profile) run from 4.4-5.6 s to 1.4-1.8 s."""
    if MEGA_AOT_ENV in env:
        return env[MEGA_AOT_ENV].strip() == "1"
    if env.get("VLLM_USE_AOT_COMPILE", "").strip() == "0" or env.get("VLLM_DISABLE_COMPILE_CACHE", "").strip() not in ("", "0"):
        return False
    try:
        major, minor = (int(x) for x in torch_version.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    if (major, minor) < (2, 10):
        return False
    env[MEGA_AOT_ENV] = "1"
    return True


FLASHINFER_SAMPLER_ENV = "VLLM_USE_FLASHINFER_SAMPLER"


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def flashinfer_sampler_default(env: MutableMapping[str, str], have_flashinfer: bool) -> str:
    """vLLM samples top-k/top-p with FlashInfer unless VLLM_USE_FLASHINFER_SAMPLER=0
    (its default is 1), and an engine whose interpreter has no flashinfer package
    fails while it starts. Where flashinfer is missing and the variable is unset,
    sets it to 0 in ``env`` (the engine's own environment, before vLLM reads it:
    vLLM's PyTorch/Triton sampler) and returns the line to log; where it is set to
    1 without flashinfer, refuses (ValueError: an engine option refused) with what
    to do. Returns "" where nothing changes."""
    v = env.get(FLASHINFER_SAMPLER_ENV, "").strip()
    if have_flashinfer:
        return ""
    if v == "":
        env[FLASHINFER_SAMPLER_ENV] = "0"
        return (f"flashinfer is not installed: {FLASHINFER_SAMPLER_ENV}=0 (vLLM's PyTorch/Triton top-k/top-p "
                f"sampler; install flashinfer or set {FLASHINFER_SAMPLER_ENV} yourself to choose)")
    if v not in ("0", "false", "False"):
        raise ValueError(f"{FLASHINFER_SAMPLER_ENV}={v} asks vLLM for FlashInfer's sampler, but flashinfer is not "
                         f"installed in the engines' interpreter: install it, or unset the variable "
                         f"(frmps then sets it to 0)")
    return ""


TRITON_CACHE_ENV = "TRITON_CACHE_DIR"


def triton_cache_default(env: MutableMapping[str, str], vllm_cache_root: str) -> str:
    """Points TRITON_CACHE_DIR at ``<vLLM's cache root>/triton_cache`` in ``env`` (the
    engine's own environment) unless it is set; returns the directory in use.

    Where an engine loads vLLM's compiled model whole (mega_aot_default), vLLM
    initialises its compiler's cache with ``disable_cache=True`` and so never sets
    TRITON_CACHE_DIR (vllm/compilation/compiler_interface.py, initialize_cache).
    The kernels vLLM's warm-up compiles outside torch.compile (its V2 runner's and
    sampler's) then land in whichever directory the variable names at that moment:
    unset (Triton's own ~/.triton/cache) until inductor loads one of its kernels,
    which sets it to ``<inductor cache>/triton/<device>``
    (torch/_inductor/runtime/triton_heuristics.py). One directory per cache root
    keeps every engine's kernels in one place the operator manages with vLLM's
    cache. It did not stop the rare restore that compiles every kernel again: on
    the H100 one restored 14B engine of 21 did so under this very directory, after
    nine had read all their kernels from it (bench/results/2026-11-27-h100-vllm-
    restore/; triton_watch.py logs such a miss with its cache key's parts). Triton
    keys its cache by the kernel's source, options and target, so models and
    engines can share the directory."""
    if env.get(TRITON_CACHE_ENV, "").strip():
        return env[TRITON_CACHE_ENV]
    path = os.path.join(vllm_cache_root, "triton_cache")
    env[TRITON_CACHE_ENV] = path
    return path


TRITON_PTXAS_ENV = "TRITON_PTXAS_PATH"


def triton_ptxas_default(env: MutableMapping[str, str], torch_dir: str) -> str:
    """Points TRITON_PTXAS_PATH at torch's own ptxas (``<torch>/bin/ptxas``) in
    ``env`` before anything compiles, unless it is set or torch ships none; returns
    the path in use ("" where Triton keeps its bundled ptxas).

    Triton keys its disk cache with its backend's hash, ``ptxas --version`` and the
    GPU's arch, and reads the version once per process (lru_cache,
    triton/backends/nvidia/compiler.py). Inductor sets TRITON_PTXAS_PATH to torch's
    ptxas the first time it compiles a Triton kernel
    (torch/_inductor/runtime/compile_tasks.py, _set_triton_ptxas_path), so an engine
    that read the version before that keys its cache with Triton's bundled ptxas
    (CUDA 12.8 in Triton 3.6.0) and one that read it after with torch's (13.0 in
    torch 2.11+cu130) — which order, each engine's first compiles decide. The two
    backend hashes seen in one deployment are exactly those two; on 2 × H200 (bench/results/2026-11-27-h200x2-vllm-tp-drills/) 3 of 14 engines of a
    14B deployment had the other hash and one of them compiled all 29 of its kernels
    again (12 s of its restore), a first 7B standby its 26 (11 s). Setting it first,
    as inductor would, gives every engine one hash."""
    if env.get(TRITON_PTXAS_ENV, "").strip():
        return env[TRITON_PTXAS_ENV]
    ptxas = os.path.join(torch_dir, "bin", "ptxas")
    if not (os.path.isfile(ptxas) and os.access(ptxas, os.X_OK)):
        return ""
    env[TRITON_PTXAS_ENV] = ptxas
    return ptxas


STRUCTURED_OUTPUTS_ENV = "FRMPS_VLLM_STRUCTURED_OUTPUTS_CONFIG"


def structured_outputs_from_env(env: Mapping[str, str]) -> dict | None:
    """FRMPS_VLLM_STRUCTURED_OUTPUTS_CONFIG: vLLM's ``--structured-outputs-config``
    as JSON (e.g. ``{"backend": "xgrammar", "disable_any_whitespace": true}``) for
    every engine (both read the same environment). The grammar runs in the engine,
    so with ``--frontend vllm`` give the API server the same through
    ``--frontend-arg=--structured-outputs-config=...``. Unset: vLLM's defaults."""
    import json

    from vllm.config import StructuredOutputsConfig

    v = env.get(STRUCTURED_OUTPUTS_ENV, "").strip()
    if not v:
        return None
    try:
        cfg = json.loads(v)
    except ValueError as exc:
        raise ValueError(f"{STRUCTURED_OUTPUTS_ENV}: not JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{STRUCTURED_OUTPUTS_ENV}: want a JSON object, got {type(cfg).__name__}")
    try:
        StructuredOutputsConfig(**cfg)  # vLLM's own checks of names and values
    except Exception as exc:  # noqa: BLE001 - vLLM raises TypeError, ValueError or pydantic's errors
        raise ValueError(f"{STRUCTURED_OUTPUTS_ENV}: vLLM refuses {cfg}: {exc}") from None
    return cfg


# EngineArgs fields that frmps sets itself: the shared pools are sized and
# placed from them (both engines must agree), or the engine's role depends on
# them. --vllm-arg refuses them, naming frmps's flag where there is one.
FRMPS_OWNED_ENGINE_ARGS = {
    "model": "--model", "max_model_len": "--max-model-len", "dtype": "frmps's dtype (bfloat16)",
    "block_size": "frmps's KV block size (16)", "num_gpu_blocks_override": "--num-blocks",
    "kv_cache_memory_bytes": "--num-blocks", "gpu_memory_utilization": "frmps's start-up memory fraction",
    "kv_cache_dtype": "frmps's KV pool layout", "quantization": "frmps's weights pool layout",
    "load_format": "--weights (the active loads the model directory's *.safetensors into the shared weights pool, "
                   "the standby maps it; dummy only where the directory has none)",
    "enable_sleep_mode": "frmps's standby",
    "scheduler_cls": "frmps's scheduler", "async_scheduling": "FRMPS_VLLM_ASYNC_SCHEDULING",
    "additional_config": "frmps's engine configuration", "tensor_parallel_size": "--tensor-parallel-size",
    "pipeline_parallel_size": "one engine process", "data_parallel_size": "one engine process",
    "distributed_executor_backend": "one engine process", "seed": "frmps's seed rule",
    "sleep_mode_backend": "frmps's sleep backend", "worker_cls": "frmps's worker", "worker_extension_cls": "frmps's worker",
}


def _first_request_decides(manager: Any, warmed: str) -> None:
    """After a warm-up built ``manager``'s structured-output backend ``warmed``:
    the first real request with structured outputs keeps it if it resolved to the
    same backend, else drops it so that request builds its own (vLLM builds the
    backend the first request resolved to; 0.33 also remembers its name). The
    check runs once, then grammar_init is vLLM's own again."""
    original = manager.grammar_init

    def grammar_init(request: Any) -> Any:
        if getattr(request, "structured_output_request", None) is not None:
            del manager.grammar_init  # the class's method from now on
            so = request.sampling_params.structured_outputs
            if so is not None and so._backend not in (None, warmed):
                manager.backend = None
                if hasattr(manager, "backend_name"):
                    manager.backend_name = None
        return original(request)

    manager.grammar_init = grammar_init


def vllm_overrides(argv: list[str]) -> dict:
    """The EngineArgs fields that ``--vllm-arg`` flags set, as vLLM parses them
    (its own ``EngineArgs.add_cli_args`` parser: the flags as ``vllm serve``
    spells them, e.g. ``--max-logprobs=50``, ``--enable-prefix-caching``,
    ``--structured-outputs-config '{"backend": "xgrammar"}'``). Only the flags
    given; frmps's own (FRMPS_OWNED_ENGINE_ARGS) are refused with ValueError,
    as is anything vLLM's parser refuses."""
    import argparse

    if not argv:
        return {}
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="--vllm-arg", add_help=False))
    for action in parser._actions:  # only what is given ends up in the namespace
        action.default, action.required = argparse.SUPPRESS, False
    try:
        given = vars(parser.parse_args(list(argv)))
    except SystemExit:  # argparse printed why (to the engine's log)
        raise ValueError(f"--vllm-arg: vLLM's engine arguments refuse {' '.join(argv)!r} (the reason is above)") from None
    owned = sorted(k for k in given if k in FRMPS_OWNED_ENGINE_ARGS)
    if owned:
        raise ValueError("--vllm-arg: frmps sets " + ", ".join(
            f"{k.replace('_', '-')} (use {FRMPS_OWNED_ENGINE_ARGS[k]})" for k in owned))
    return given


def make_adapter(args: Any) -> VllmAdapter:
    """Build the adapter from the CLI's parsed arguments (``serve --engine vllm``)."""
    from frmps_engine.sdk.adapters import AdapterError

    if getattr(args, "exact", None):
        raise AdapterError("--exact is the reference engine's scheduler mode; for vLLM set VLLM_BATCH_INVARIANT=1 "
                           "in the engines' environment (vLLM's batch-invariant kernels) instead")
    tp = int(getattr(args, "tensor_parallel_size", 1) or 1)
    from ..modeldir import has_weights

    choice = getattr(args, "weights", None) or "auto"
    if choice not in ("auto", "dummy"):
        raise AdapterError(f"--weights {choice!r}: want auto or dummy")
    try:
        # Not a directory: VllmAdapter says so (no config.json).
        weights = "load" if choice == "auto" and os.path.isdir(args.model) and has_weights(args.model) else "dummy"
    except ValueError as exc:
        raise AdapterError(str(exc)) from exc
    try:
        async_scheduling = async_scheduling_from_env(os.environ)
        structured_outputs = structured_outputs_from_env(os.environ)
        overrides = vllm_overrides(list(getattr(args, "vllm_args", None) or ()))
    except ValueError as exc:
        raise AdapterError(str(exc)) from exc
    return VllmAdapter(
        VllmEngineConfig(
            model=args.model,
            device=getattr(args, "device", None) or "cuda",
            num_blocks=int(getattr(args, "num_blocks", 0) or 0),
            block_size=int(getattr(args, "block_size", 16) or 16),
            max_model_len=int(getattr(args, "max_model_len", 0) or 0),
            gpu_memory_utilization=float(getattr(args, "gpu_memory_utilization", None) or 0.9),
            dtype=getattr(args, "dtype", None) or "bfloat16",
            weights=weights,
            sync_every=int(getattr(args, "sync_every", 1) or 1),
            async_scheduling=async_scheduling,
            max_num_seqs=getattr(args, "max_num_seqs", None),
            max_num_batched_tokens=getattr(args, "max_num_batched_tokens", None),
            structured_outputs=structured_outputs,
            overrides=overrides,
            tensor_parallel_size=tp,
            kv_reuse=getattr(args, "kv_reuse", True) is not False,
        )
    )


# What a spare imports ahead of need (sdk/spare.py): vLLM's engine core, its
# GPU worker and model runner (torch._dynamo and the rest come with them) and
# this adapter's vLLM-side modules. The model's own module comes from the list
# a served engine wrote. Importing these never initialises CUDA.
_PRELOAD = (
    "vllm", "vllm.engine.arg_utils", "vllm.v1.engine.core", "vllm.v1.executor.abstract", "vllm.v1.request",
    "vllm.tokenizers.registry", "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner",
    "frmps_engine.vllm.scheduler", "frmps_engine.vllm.sleep_backend", "frmps_engine.vllm.plugin",
    # The structured-output backend a standby builds in its warm-up (VllmCore.warm_takeover):
    # importing its grammar library takes most of that.
    "vllm.v1.structured_output.backend_xgrammar", "xgrammar",
)


# Tokenizers a spare loaded before it knew its role, by model: the adapter built
# after the activation takes its own from here (vLLM's get_tokenizer caches
# nothing; Qwen2.5's takes about a second).
_PRELOADED_TOKENIZERS: dict[str, Any] = {}


def preload(model: str | None = None) -> None:
    """The factory's preload hook (proto/frmps/v1/ENGINE.md, spares): vLLM's modules,
    and the model's tokenizer (no GPU involved)."""
    from ..sdk.spare import import_modules

    import_modules(_PRELOAD)  # a module that initialised CUDA is caught by the spare's check
    if model:
        try:
            from vllm.tokenizers.registry import get_tokenizer

            _PRELOADED_TOKENIZERS[model] = get_tokenizer(model)
        except Exception as e:  # only a head start: the engine loads it itself, and says why not
            logging.getLogger(__name__).warning("spare: could not preload the tokenizer of %s: %s", model, e)
            return
        tok = _seed_vllm_tokenizer_cache(model)
        if tok is not None:
            _seed_xgrammar_tokenizer_info(model, tok)


def _seed_vllm_tokenizer_cache(model: str) -> Any:
    """vLLM's engine core reads the tokenizer once more for its structured-output
    manager, through ``cached_tokenizer_from_config`` (an lru_cache over
    ``get_tokenizer``, keyed by the model config's tokenizer fields): 0.6 s of a 14B
    restore on the H200 (2026-11-27-h200-vllm-restore, B0's start profiles). A spare
    fills that cache with the fields of the model config frmps's engine arguments
    give (``engine_args``: the model directory as tokenizer, the defaults
    otherwise), so the engine built after the activation finds it; a config that
    differs is a miss, which only costs the read. vLLM's object stays its own (the
    engine's own tokenizer is a separate one, used from the gRPC threads)."""
    from types import SimpleNamespace

    try:
        from vllm.tokenizers.registry import cached_tokenizer_from_config

        return cached_tokenizer_from_config(SimpleNamespace(
            skip_tokenizer_init=False, hf_config=None, model=model, tokenizer=model, code_revision=None,
            runner_type="generate", tokenizer_mode="auto", tokenizer_revision=None, trust_remote_code=False))
    except Exception as e:  # a head start only
        logging.getLogger(__name__).warning("spare: could not fill vLLM's tokenizer cache for %s: %s", model, e)
        return None


_XGRAMMAR_HANDED_OVER: list[str] = []  # the models whose prebuilt vocabulary index vLLM took (tests read it)


def _seed_xgrammar_tokenizer_info(model: str, tok: Any) -> None:
    """vLLM's xgrammar backend indexes the tokenizer's vocabulary when it is built
    (``xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=<the model's>)``,
    vllm/v1/structured_output/backend_xgrammar.py), which a standby does in its
    takeover warm-up (``VllmCore._warm_structured_outputs``): 0.45 s of a 14B restore
    on the H200 (2026-11-27-h200-vllm-restore, B0's start profiles). A spare builds
    it ahead for vLLM's cached tokenizer (``_seed_vllm_tokenizer_cache``) and the
    model's vocabulary size, and hands it over once: the first call with that very
    tokenizer object and those arguments gets it, every other call builds its own.
    The index is a pure function of the tokenizer and the size."""
    try:
        import xgrammar as xgr

        vocab = int(_hf_config(model)["vocab_size"])
        built = [xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)]
        build = xgr.TokenizerInfo.from_huggingface

        def from_huggingface(tokenizer: Any, **kw: Any) -> Any:
            if built and tokenizer is tok and kw == {"vocab_size": vocab}:
                _XGRAMMAR_HANDED_OVER.append(model)
                return built.pop()
            return build(tokenizer, **kw)

        xgr.TokenizerInfo.from_huggingface = staticmethod(from_huggingface)
    except Exception as e:  # a head start only
        logging.getLogger(__name__).warning("spare: could not index the vocabulary for grammars ahead (%s): %s", model, e)


make_adapter.preload = preload  # type: ignore[attr-defined]
