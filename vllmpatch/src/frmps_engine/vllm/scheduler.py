"""vLLM scheduler subclasses (selected with ``scheduler_cls``) that report the
committed forward state of their requests (``frmps_views``) and adopt requests
on takeover.

Thin: the logic is in ``state`` (committed views) and ``adoption``. When the
views go to the ring, and how often, is the engine loop's (sdk/loop.py
``EngineLoop``: every ``sync_every`` steps, after a request's first token, and
when going idle), through ``VllmCore.request_views``. This module imports vLLM;
load it only where vLLM runs.
"""

from __future__ import annotations

from typing import Any, Callable

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from .adoption import AdoptPlan, AdoptResult, adopt
from .state import CommittedView, committed_view, key_for_request_id, views_sorted


_NO_BLOCKS: list[Any] = []  # never mutated: a request without blocks yet (or freed)


class _Pub:
    """What a publish keeps of one frmps request between steps: its ring key, vLLM's
    live block list last seen, and the block ids read from it so far."""

    __slots__ = ("key", "live", "ids")

    def __init__(self, key: int | None):
        self.key, self.live, self.ids = key, None, []


def _appending_block_lists(scheduler: Any) -> Any:
    """The one KV-cache manager's request -> live block list lookup where every
    request's list only grows while it runs (one group of full attention: the models
    frmps serves), else None: sliding-window and other managers replace blocks in
    place, so their ids are read afresh every publish."""
    try:
        managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    except AttributeError:
        return None
    if len(managers) != 1 or type(managers[0]).__name__ != "FullAttentionManager":
        return None
    return managers[0].req_to_blocks.get  # what KVCacheCoordinator.get_blocks reads, without its tuple


class _FrmpsSchedulerMixin:
    """Adds ring publishing and adoption to a vLLM Scheduler (mixed in first)."""

    def _frmps_init(self) -> None:
        # Every frmps request seen and not yet published as finished: request id ->
        # vLLM Request. Requests leave self.requests when they finish; keeping the
        # object lets the next sync publish the finish once.
        self._frmps_live: dict[str, Any] = {}
        self._frmps_folded: dict[str, int] = {}
        # Per frmps request, what a publish needs from one step to the next. The block
        # ids are extended as blocks are appended, not rebuilt every step (rebuilding
        # them would be a large part of every publish); a request's finished
        # view uses the last ones after vLLM has freed the blocks.
        self._frmps_pub: dict[str, _Pub] = {}
        # None: no cache of block ids (block lists that change in place).
        self._frmps_blocks_of = _appending_block_lists(self)
        # While set, the scheduler reports no requests, so EngineCore's
        # step_with_batch_queue only finishes the batches in flight
        # (VllmCore.finish_in_flight, before a planned handover).
        self.frmps_hold = False
        # The engine loop's publish, run once the step's batch is launched (see
        # get_grammar_bitmask); set by VllmCore.step for one step.
        self.frmps_on_launch: Callable[[], None] | None = None
        # Tokens of the batch scheduled last (the step in progress): the SDK's hang
        # estimate reads it from its heartbeat thread.
        self.frmps_scheduled_tokens = 0
        # Set by an adoption: the next schedule runs the requests whose KV the ring
        # had before any whole-prompt prefill (_frmps_hold_prefills).
        self._frmps_decodes_first = False
        # What the engine computed, so tests and the supervisor can prove that a
        # takeover did not recompute tokens the last sync covered.
        self.frmps_counters = {
            "steps": 0,
            "prefill_tokens_computed": 0,
            "decode_tokens": 0,
            "adopted_tokens_reused": 0,
            "requests_adopted": 0,
        }

    def get_grammar_bitmask(self, scheduler_output: Any) -> Any:
        """vLLM's EngineCore.step calls this right after ``execute_model(non_block=True)``
        has launched the batch and before it waits for the result (0.26.0 and 0.33.0,
        VLLM.md): the engine loop's pending publish runs here, overlapping the device's
        work on that batch. The views it reads are the committed state (the batch's
        tokens are in flight: ``num_in_flight_tokens``)."""
        fn, self.frmps_on_launch = self.frmps_on_launch, None
        if fn is not None:
            fn()
        return super().get_grammar_bitmask(scheduler_output)  # type: ignore[misc]

    # -- committed state ---------------------------------------------------------
    def frmps_views(self) -> list[CommittedView]:
        """Committed state of every frmps request, plus a last entry for each that
        finished since the previous call (which is then forgotten here)."""
        views: list[CommittedView] = []
        bs = self.block_size
        requests, folded_of, pubs = self.requests, self._frmps_folded, self._frmps_pub
        for rid, req in list(self._frmps_live.items()):
            pub = pubs.get(rid)
            if pub is None:
                pub = pubs[rid] = _Pub(key_for_request_id(rid))
            folded = folded_of.get(rid, 0) if folded_of else 0
            if requests.get(rid) is req and not req.is_finished():
                views.append(committed_view(req, pub.key, self._frmps_block_ids(rid, pub), bs, num_folded=folded))
                continue
            aborted = req.status == RequestStatus.FINISHED_ABORTED
            views.append(
                committed_view(req, pub.key, pub.ids, bs, num_folded=folded, finished=not aborted, aborted=aborted)
            )
            del self._frmps_live[rid]
            del pubs[rid]
            folded_of.pop(rid, None)
        return views_sorted(views)

    def _frmps_block_ids(self, rid: str, pub: _Pub) -> list[int]:
        """The request's block ids (its one KV-cache group), valid until the next call:
        the cached list, extended with the blocks vLLM appended since; rebuilt when
        vLLM's list is a new one (freed and allocated again: a preemption) or its
        cached ends no longer match."""
        if self._frmps_blocks_of is None:
            pub.ids = self.kv_cache_manager.get_block_ids(rid)[0]  # a new list per call
            return pub.ids
        live = self._frmps_blocks_of(rid) or _NO_BLOCKS
        ids = pub.ids
        n = len(ids)
        if pub.live is not live or len(live) < n or (n and (live[0].block_id != ids[0] or live[n - 1].block_id != ids[n - 1])):
            pub.live, pub.ids = live, [b.block_id for b in live]
            return pub.ids
        if len(live) > n:
            ids.extend([b.block_id for b in live[n:]])
        return ids

    def frmps_reset(self) -> None:
        """Forget every frmps request's ring state (after they were aborted for a
        planned handover: the next engine publishes them now)."""
        self._frmps_live.clear()
        self._frmps_folded.clear()
        self._frmps_pub.clear()

    # -- requests ---------------------------------------------------------------
    @staticmethod
    def _frmps_check(request: Any) -> bool:
        """True for a frmps request (refused without an explicit seed), False for others."""
        if key_for_request_id(request.request_id) is None:
            return False
        if request.sampling_params is None or request.sampling_params.seed is None:
            # Without an explicit seed a resumed request could not sample the same
            # tokens (V2 picks a random one: v1/worker/gpu/sample/states.py:54-58).
            raise ValueError(f"frmps request {request.request_id} has no explicit seed")
        return True

    def _frmps_track(self, request: Any, folded: int = 0) -> None:
        if not self._frmps_check(request):
            return
        self._frmps_live[request.request_id] = request
        if folded:
            self._frmps_folded[request.request_id] = folded

    def add_request(self, request: Any) -> None:
        self._frmps_check(request)  # refuse before vLLM queues it
        super().add_request(request)  # type: ignore[misc]
        # A repeated id is a streaming-input chunk for the request already tracked.
        if self.requests.get(request.request_id) is request:
            self._frmps_track(request)

    def frmps_adopt(
        self, plan: AdoptPlan, sampling_params: Any, *, block_hasher: Any = None, fold_outputs: bool | None = None,
        request_kwargs: dict | None = None, deferred: Any = None,
    ) -> AdoptResult:
        base_add = super().add_request  # type: ignore[misc]
        request, result = adopt(
            self, plan, sampling_params, enqueue=base_add, block_hasher=block_hasher, fold_outputs=fold_outputs,
            request_kwargs=request_kwargs, deferred=deferred,
        )
        self._frmps_track(request, result.num_folded)
        self._frmps_decodes_first = True
        self.frmps_counters["adopted_tokens_reused"] += result.reused_tokens
        self.frmps_counters["requests_adopted"] += 1
        return result

    def _frmps_count(self, scheduler_output: Any) -> None:
        c = self.frmps_counters
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None:
                continue
            # Before update_from_output, num_computed_tokens already includes this
            # step's tokens (and, with async scheduling, later in-flight ones).
            start = req.num_computed_tokens - req.num_in_flight_tokens
            if n == 1 and start >= req.num_tokens - 1:
                c["decode_tokens"] += 1
            else:
                c["prefill_tokens_computed"] += n

    def has_requests(self) -> bool:
        return False if self.frmps_hold else super().has_requests()  # type: ignore[misc]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        held = self._frmps_hold_prefills() if self._frmps_decodes_first else ()
        self._frmps_decodes_first = False
        try:
            out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            for queue, reqs in held:  # back where they were, ahead of what came since
                for r in reversed(reqs):
                    queue.prepend_request(r)
        self.frmps_scheduled_tokens = int(out.total_num_scheduled_tokens)
        return out

    def _frmps_hold_prefills(self) -> list[tuple[Any, list[Any]]]:
        """The first step after a takeover resumes the streams whose KV the ring
        had; a waiting request with its whole prompt to compute (adopted before its
        prompt's KV was published, or new) waits one step. In one batch with the
        resumed streams such a prefill can make the step too large for vLLM's CUDA
        graphs, and every resumed stream waits for it.
        A resumed stream's replay (the tokens past its last sync, --sync-every > 1)
        stays in the first step. Held only when some waiting request holds KV; the
        held ones are taken out of vLLM's waiting queues for this schedule and put
        back after it."""
        queues = [q for q in (getattr(self, n, None) for n in ("waiting", "skipped_waiting", "kv_holding_waiting"))
                  if q is not None]
        if not any(r.num_computed_tokens > 0 for q in queues for r in q):
            return []
        held = []
        for q in queues:
            big = [r for r in q if r.num_computed_tokens == 0]
            if big:
                q.remove_requests(big)
                held.append((q, big))
        return held

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if scheduler_output.total_num_scheduled_tokens > 0:
            self._frmps_count(scheduler_output)
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        # Only steps that computed something count.
        if scheduler_output.total_num_scheduled_tokens > 0:
            self.frmps_counters["steps"] += 1
        return outputs


class FrmpsScheduler(_FrmpsSchedulerMixin, Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._frmps_init()


class FrmpsAsyncScheduler(_FrmpsSchedulerMixin, AsyncScheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._frmps_init()
