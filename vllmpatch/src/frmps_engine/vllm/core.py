"""``VllmCore``: the core the SDK's runner drives (the SDK's ``Core`` protocol,
sdk/engine_api.py: add_request, adopt_request, abort, step, has_work,
request_views, tokenizer, counters; and the optional LoadReport, StepSize,
Resettable, LaunchHook, Pipelined, DeviceGate, TakeoverWarmup and the negative
controls' TakeoverFaultHooks), on top of vLLM's in-process EngineCore whose
scheduler is a FrmpsScheduler. The adapter (engine.py) builds it.

Every request carries an explicit seed (the SDK's one rule, sdk/seeds.py; vLLM
keeps it as int64).

This module imports vLLM only inside functions.
"""

from __future__ import annotations

import inspect

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence, runtime_checkable

from . import SCHEDULER_CLS, phases
from .adoption import AdoptResult, DeferredPrefixCache, plan_adoption
from ..sdk.engine_api import throwaway_takeover
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
    logprobs: list | None = None  # per new token, when the request asked (_logprobs)


@dataclass
class _Track:
    num_out: int  # output tokens delivered so far (including those before a takeover)
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # the request's SamplingParams.logprobs
    text_tail: str = ""


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
        self._choose_grammar_backend(params)
        return params

    def _choose_grammar_backend(self, params: Any) -> None:
        """A structured-output request gets its grammar backend (and vLLM's own checks of
        the request) where vLLM's input processor gives them, from the engine's
        structured-outputs config: SamplingParams.verify. A request that a frontend
        already processed (``_backend`` set) keeps its own."""
        so = getattr(params, "structured_outputs", None)
        if so is None or so._backend is not None:
            return
        manager = self.scheduler.structured_output_manager
        vc = manager.vllm_config
        params.verify(vc.model_config, vc.speculative_config, vc.structured_outputs_config,
                      getattr(manager, "tokenizer", None))

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
        sp = request.sampling_params
        self._tracks[key] = _Track(0, list(sp.stop or []), sp.logprobs)

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
        self._choose_grammar_backend(params)
        # adopt() copies the params and sets the plan's seed on its copy (the one
        # _params would set): no copy here as well.
        result = self.scheduler.frmps_adopt(plan, params, block_hasher=self.core.request_block_hasher,
                                            request_kwargs=request_kwargs, deferred=self.deferred_prefix_cache)
        self._tracks[key] = _Track(len(plan.output_token_ids), list(params.stop or []), params.logprobs)
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
        if "sampler-offset" in cases:
            sample = getattr(getattr(runner, "sampler", None), "sample", None)
            if sample is None or not hasattr(getattr(runner, "req_states", None), "req_id_to_index"):
                raise ValueError("sampler-offset needs vLLM's V2 model runner (its sampler draws from (seed, "
                                 "position)) in this process")
            missing = {"expanded_idx_mapping", "pos"} - set(inspect.signature(sample).parameters)
            if missing:
                raise ValueError(f"sampler-offset: this vLLM's V2 sampler.sample takes no {', '.join(sorted(missing))}")

    def _kv_dims(self, who: str) -> tuple[list[tuple[Any, int, int]], int]:
        """The model runner's KV tensors (this process's, one per layer, whatever the
        attention backend's layout), each with its block dimension (the first of
        ``num_gpu_blocks`` entries) and its slot dimension (the first after it of
        ``block_size``); and the block size."""
        caches = list(getattr(_runner_of(self.core), "kv_caches", None) or [])
        if not caches:
            raise RuntimeError(f"{who}: vLLM's model runner holds no KV caches")
        nb, bs = int(self.scheduler.kv_cache_manager.block_pool.num_gpu_blocks), int(self.scheduler.block_size)
        dims = []
        for t in caches:
            b = next((d for d in range(t.dim()) if t.shape[d] == nb), None)
            s = next((d for d in range(b + 1, t.dim()) if t.shape[d] == bs), None) if b is not None else None
            if b is None or s is None:
                raise RuntimeError(f"{who}: a KV cache of shape {tuple(t.shape)} has no dimension of {nb} blocks "
                                   f"followed by one of {bs} slots")
            dims.append((t, b, s))
        return dims, bs

    def fault_kv(self, op: str, block: int, other: int, slot: int) -> None:
        """Zero a block (or one slot of it) or swap two blocks in every layer's KV
        cache (_kv_dims: where each tensor keeps its blocks and slots)."""
        import torch

        dims, _ = self._kv_dims("fault_kv")
        with torch.no_grad():
            for t, d, sd in dims:
                a = t.select(d, block)
                if op == "zero":
                    (a.select(sd - 1, slot) if slot >= 0 else a).zero_()
                elif op == "swap":
                    b = t.select(d, other)
                    tmp = a.clone()
                    a.copy_(b)
                    b.copy_(tmp)
                else:
                    raise ValueError(f"fault_kv: unknown op {op!r}")

    def kv_token_digests(self, block_ids: Sequence[int], n: int) -> list[int]:
        """sdk/kv_digest.KvDigests over the model runner's KV caches (_kv_dims)."""
        from ..sdk.kv_digest import torch_token_digests

        dims, bs = self._kv_dims("kv_token_digests")
        return torch_token_digests(dims, block_ids, n, bs)

    def shift_sampler(self, key: int, n: int) -> None:
        """vLLM's V2 sampler draws a token's noise from (seed, position of the
        sampled row): wrap the runner's sampler once so that the rows of request
        ``key`` draw with position + n. The arguments are bound by name: the
        order of sample's parameters differs between vLLM versions (0.26 has no
        idx_mapping before idx_mapping_np)."""
        runner = _runner_of(self.core)
        sampler = runner.sampler
        shifts = vars(sampler).get("_frmps_shifts")
        if shifts is None:
            shifts = {}
            inner = sampler.sample
            sig = inspect.signature(inner)
            states = runner.req_states

            def sample(*args, **kwargs):
                bound = sig.bind(*args, **kwargs)
                pos, mapping = bound.arguments["pos"], bound.arguments["expanded_idx_mapping"]
                for rid, k in list(shifts.items()):
                    idx = states.req_id_to_index.get(rid)
                    if idx is not None:
                        pos = pos + (mapping == idx).to(pos.dtype) * k
                bound.arguments["pos"] = pos
                return inner(*bound.args, **bound.kwargs)

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
        takeover with a structured-output request in flight pays for that in its
        adoption, on the path to the first resumed token. Which backend:
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
                lps = _logprobs(out.new_logprobs, len(new), tr.logprobs) if tr.logprobs is not None else None
                result.append(Output(key, new, index, finished, reason, stop_reason, lps))
                if finished:
                    del self._tracks[key]
        if stopped:
            self.core.abort_requests([request_id_for_key(k) for k in stopped])
        return result


def _logprobs(lists: Any, n: int, k: int) -> list | None:
    """A request's new tokens' logprobs from vLLM's per-request LogprobsLists (rows:
    the new tokens; column 0 the sampled token, then the batch's most likely tokens,
    most likely first): per token (logprob, rank, top ids, top logprobs), the top
    cut to the request's own k, as vLLM's output processor cuts it. None where
    vLLM sent none."""
    if lists is None:
        return None
    ids, lps, ranks = lists.logprob_token_ids, lists.logprobs, lists.sampled_token_ranks
    out = []
    for r in range(min(n, len(ranks))):
        row_ids, row_lps = [int(t) for t in ids[r]], [float(v) for v in lps[r]]
        out.append((row_lps[0], int(ranks[r]), row_ids[1 : k + 1], row_lps[1 : k + 1]))
    return out


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
