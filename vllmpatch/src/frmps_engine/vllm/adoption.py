"""Standby takeover: re-create requests in vLLM's scheduler on the KV blocks the
active engine left in the shared pool.

vLLM 0.33.0 has no API to hand a request a given list of block IDs. What P/D
disaggregation does after remote KV arrives is the model here
(scheduler.py:3467-3517, 1266-1270): the request holds its blocks, sits in the
waiting queue with ``num_computed_tokens`` > 0, and the scheduler's waiting loop
then skips the prefix-cache lookup, calls ``allocate_slots`` for the tokens past
``num_computed_tokens`` only, and emits a ``NewRequestData`` whose ``block_ids``
are the request's blocks and whose ``num_computed_tokens`` is ours.

Adoption therefore:
1. pins the block IDs in the ``BlockPool`` with ``touch`` (block_pool.py:792-810):
   a free block leaves the free queue and every block's ``ref_cnt`` grows by one,
   exactly as a prefix-cache hit does, so ``free_blocks`` later returns them
   correctly;
2. sets the single-type manager's per-request state (``req_to_blocks``,
   ``num_cached_block``; single_type_kv_cache_manager.py:124-131);
3. sets ``num_computed_tokens`` and enters the request through
   ``Scheduler.add_request``, which queues a request holding KV blocks in
   ``kv_holding_waiting`` (scheduler.py:2697-2715).

A request with structured outputs also needs its grammar in the state the
output so far left it in: vLLM compiles a grammar when the engine first receives
a request (``EngineCore.preprocess_add_request`` → ``grammar_init``,
core.py:1140-1147; 0.26: :968-975) and advances it by every sampled token
(``Scheduler.update_from_output``, scheduler.py:2432; 0.26: :1745). Adoption
compiles it through the scheduler's ``StructuredOutputManager``, waits for it,
and feeds it the tokens the client has received; the request then waits as an
ordinary one. Output tokens that do not fit the grammar are refused.

Plain logic (``plan_adoption``) is separated from the part that touches vLLM
objects (``adopt``); ``adopt`` imports vLLM lazily.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Sequence

from ..sdk.seeds import to_int64
from .state import cdiv, request_id_for_key


class AdoptionError(ValueError):
    """A resume entry cannot be adopted as given (the engine stays up)."""


@dataclass(frozen=True)
class AdoptPlan:
    key: int
    seed: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the request's output so far: what the client has been given
    num_computed: int  # leading tokens of prompt+output whose KV is in block_ids
    block_ids: list[int]  # exactly cdiv(num_computed, block_size) blocks

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass(frozen=True)
class AdoptResult:
    key: int
    request_id: str
    reused_tokens: int  # tokens whose KV came from the shared cache
    prefill_tokens: int  # tokens the next step computes (one prefill pass)
    num_folded: int  # output tokens folded into the prompt (V1 model runner)


def _int_list(seq: Sequence[int]) -> list[int]:
    """``seq`` as a new list of ints. A list is taken to hold ints already (what the
    SDK hands the core: lists read from the Resume message) and copied in C; every
    other sequence (numpy arrays, ranges) gets an int() per token, which a takeover
    would otherwise pay on each of its lists."""
    return seq[:] if type(seq) is list else list(map(int, seq))


_ATOMS = (type(None), bool, int, float, complex, str, bytes)  # immutable, nothing inside to share


def copy_params(params: Any) -> Any:
    """An independent copy of vLLM's ``SamplingParams``, as ``copy.deepcopy`` makes
    it, at a fraction of the cost (it runs once per adopted request):
    a msgspec Struct is copied shallowly in C, then every field that is not an
    immutable atom or an enum member is replaced by its own copy — a list, set,
    tuple or dict of atoms by a new one of the same type, anything else by
    ``copy.deepcopy``. So nothing mutable is shared with ``params`` (adoption
    changes the copy's seed and max_tokens; vLLM updates its own copy as it runs).
    The instance ``__dict__`` (vLLM's cached properties, ``sampling_type``) is
    left empty: its values are derived from the fields and recomputed on first
    use, from the copy's own seed. Anything but a msgspec Struct: deepcopy."""
    fields = getattr(type(params), "__struct_fields__", None)
    if fields is None:
        return copy.deepcopy(params)
    out = copy.copy(params)
    for name in fields:
        v = getattr(params, name)
        t = type(v)
        if t in _ATOMS or isinstance(v, Enum):
            continue
        if t in (list, tuple, set, frozenset):
            if all(type(x) in _ATOMS for x in v):
                setattr(out, name, t(v))
                continue
        elif t is dict and all(type(k) in _ATOMS and type(x) in _ATOMS for k, x in v.items()):
            setattr(out, name, dict(v))
            continue
        setattr(out, name, copy.deepcopy(v))
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C: a takeover's path
        return n
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return n


def plan_adoption(
    *,
    key: int,
    token_ids: Sequence[int],
    num_prompt: int,
    num_computed: int,
    block_ids: Sequence[int],
    seed: int,
    delivered_token_ids: Sequence[int] | None,
    block_size: int,
    num_blocks: int,
) -> AdoptPlan:
    """Decide what to adopt from a ring snapshot entry plus what the client received.

    ``token_ids`` (prompt + output at the last sync), ``num_computed`` and
    ``block_ids`` come from the snapshot; ``delivered_token_ids`` are the output
    tokens the client already has (they may run ahead of the sync, or lag it).
    The request resumes with prompt + delivered tokens; KV is reused only for
    the tokens the snapshot and the delivered output agree on, and at least one
    token is always left to compute so the next step yields logits.
    """
    if block_size < 1:
        raise AdoptionError(f"block size must be >= 1, got {block_size}")
    if not 0 < num_prompt <= len(token_ids):
        raise AdoptionError(f"request {key}: num_prompt {num_prompt} outside 1..{len(token_ids)}")
    if num_computed < 0 or num_computed > len(token_ids):
        raise AdoptionError(f"request {key}: num_computed {num_computed} outside 0..{len(token_ids)}")
    token_ids = _int_list(token_ids)
    prompt = token_ids[:num_prompt]
    synced_out = token_ids[num_prompt:]
    delivered = synced_out if delivered_token_ids is None else _int_list(delivered_token_ids)
    agree = num_prompt + _common_prefix(synced_out, delivered)
    covered = min(num_computed, agree, num_prompt + len(delivered) - 1)
    covered = max(covered, 0)
    need = cdiv(covered, block_size)
    if len(block_ids) < need:
        raise AdoptionError(
            f"request {key}: {covered} computed tokens need {need} blocks of {block_size}, snapshot has {len(block_ids)}"
        )
    blocks = _int_list(block_ids[:need])
    # Block 0 is vLLM's null block (block_pool.py:187-190); it is never handed out.
    if blocks and not (min(blocks) > 0 and max(blocks) < num_blocks):
        b = next(b for b in blocks if not 0 < b < num_blocks)
        raise AdoptionError(f"request {key}: block id {b} outside 1..{num_blocks - 1}")
    if len(set(blocks)) != len(blocks):
        raise AdoptionError(f"request {key}: block list repeats a block: {blocks}")
    return AdoptPlan(
        key=int(key),
        seed=int(seed),
        prompt_token_ids=prompt,
        output_token_ids=delivered,
        num_computed=covered,
        block_ids=blocks,
    )


# num_cached_block of a request whose prefix-cache work is deferred: vLLM's
# cache_blocks returns at once while it is larger than the request's full blocks
# (single_type_kv_cache_manager.py, 0.26 and 0.33), and the key's presence still
# marks the request as holding blocks (no prefix lookup for it).
_NOT_YET_CACHED = 1 << 62


class DeferredPrefixCache:
    """The prefix-cache work of adopted requests, done once the step after the
    takeover's first has been launched instead of before the first.

    With vLLM's prefix caching on (its default), adopting a request hashes every
    full block of its prompt and output (sha256 over each block's tokens, chained)
    and enters the blocks in the prefix cache: a large share of an adoption's CPU
    time, all of it before the first resumed token although the first step needs
    none of it — the step reads the blocks through the request's block table, not
    through the cache. Deferred, the request is built without its block hasher and
    held out of vLLM's cache_blocks (``_NOT_YET_CACHED``); ``run`` gives each
    request its hasher back, hashes its full blocks and caches them as an adoption
    would. The core runs it once the second step's forward pass is enqueued, beside
    that step's device work: after the first step's launch it could still land on
    the first token's path (a first step run without a CUDA graph can have finished
    its device work by the time its launch returns). Until then nothing can hit the adopted blocks in the
    prefix cache (a new request computes its prompt), and a sibling adopted in
    the same takeover may share their leading full blocks (``full_blocks``: what a
    hash said before)."""

    def __init__(self, block_hasher: Callable[[Any], list]):
        self.block_hasher = block_hasher
        self.pending: list[tuple[Any, int]] = []  # (vLLM Request, tokens whose KV the adoption reused)
        self.full_blocks: set[int] = set()  # block ids of the pending requests' full blocks
        self.steps_to_wait = 0  # steps the core lets pass before run (set by add)

    def __bool__(self) -> bool:
        return bool(self.pending)

    def add(self, request: Any, num_computed: int, block_ids: Sequence[int], block_size: int) -> None:
        self.pending.append((request, num_computed))
        self.full_blocks.update(block_ids[: num_computed // block_size])
        self.steps_to_wait = 1  # the adopted requests' first step

    def due(self) -> bool:
        """Whether the step now starting is the one to run in (each call is a step)."""
        if not self.pending:
            return False
        if self.steps_to_wait:
            self.steps_to_wait -= 1
            return False
        return True

    def clear(self) -> None:
        self.pending.clear()
        self.full_blocks.clear()
        self.steps_to_wait = 0

    def run(self, scheduler: Any) -> int:
        """Hash and cache the pending requests' blocks, in adoption order (a sibling
        sharing a prefix finds its leading blocks cached by the first). Requests
        that finished meanwhile are skipped (their blocks went back uncached); one
        preempted meanwhile gets its hashes (its prefill again looks the prefix
        cache up and caches its blocks as any request's) but holds no blocks to
        cache. Returns how many requests had their blocks cached."""
        kv = scheduler.kv_cache_manager
        (manager,) = kv.coordinator.single_type_managers
        done = 0
        for request, num_computed in self.pending:
            rid = request.request_id
            if scheduler.requests.get(rid) is not request:
                continue
            request._block_hasher = self.block_hasher
            request.update_block_hashes()
            if manager.num_cached_block.get(rid) != _NOT_YET_CACHED:
                continue
            hashed = 0
            for blk in manager.req_to_blocks.get(rid, ()):
                if blk.block_hash is None:
                    break
                hashed += 1
            manager.num_cached_block[rid] = hashed
            kv.cache_blocks(request, num_computed)
            done += 1
        self.clear()
        return done


def adopt(
    scheduler: Any,
    plan: AdoptPlan,
    sampling_params: Any,
    *,
    enqueue: Callable[[Any], None] | None = None,
    block_hasher: Callable[[Any], list] | None = None,
    fold_outputs: bool | None = None,
    grammar_timeout: float = 30.0,
    request_kwargs: dict | None = None,
    deferred: DeferredPrefixCache | None = None,
) -> tuple[Any, AdoptResult]:
    """Adopt ``plan`` into a vLLM 0.33.0 ``Scheduler``; returns (vllm Request, result).

    ``enqueue`` adds the request to the scheduler (default: ``scheduler.add_request``;
    a Scheduler subclass that intercepts add_request passes the base method).
    ``fold_outputs``: the V1 model runner builds a new request from
    ``prompt_token_ids`` alone (scheduler.py:1655-1661), so already generated
    tokens must be folded into the prompt there; the V2 runner receives all
    token ids (scheduler.py:1642-1652) and keeps them as outputs. Default: fold
    unless the scheduler uses the V2 runner.
    ``grammar_timeout``: how long to wait for a structured-output grammar to compile.
    ``request_kwargs``: more of vLLM's ``Request`` fields, as the request was sent
    (``request_fields``: priority, arrival time, cache salt, trace headers, …).
    ``deferred``: with prefix caching, leave the request's block hashes and its
    blocks' entry in the prefix cache to ``deferred.run`` (DeferredPrefixCache).
    """
    from vllm.v1.request import Request

    request_id = request_id_for_key(plan.key)
    if request_id in scheduler.requests:
        raise AdoptionError(f"request {plan.key} already exists in this engine")
    kv = scheduler.kv_cache_manager
    managers = kv.coordinator.single_type_managers
    if len(managers) != 1:
        raise AdoptionError(
            f"adoption supports one KV-cache group (full attention); this model has {len(managers)} groups"
        )
    manager = managers[0]
    pool = kv.block_pool
    if manager.block_size != scheduler.block_size:
        raise AdoptionError(f"manager block size {manager.block_size} != scheduler block size {scheduler.block_size}")
    if plan.block_ids and max(plan.block_ids) >= pool.num_gpu_blocks:
        raise AdoptionError(f"request {plan.key}: block id {max(plan.block_ids)} >= pool size {pool.num_gpu_blocks}")

    if fold_outputs is None:
        fold_outputs = not scheduler.use_v2_model_runner
    params = copy_params(sampling_params)
    params.seed = to_int64(plan.seed)  # the ring's uint64 -> vLLM's int64 (sdk/seeds.py)
    outs = list(plan.output_token_ids)
    if fold_outputs and outs:
        if params.max_tokens is not None:
            if params.max_tokens <= len(outs):
                raise AdoptionError(
                    f"request {plan.key}: {len(outs)} tokens delivered, max_tokens {params.max_tokens}: nothing left to generate"
                )
            params.max_tokens -= len(outs)
        params.min_tokens = max(0, int(params.min_tokens or 0) - len(outs))
        prompt = plan.prompt_token_ids + outs
    else:
        if params.max_tokens is not None and params.max_tokens <= len(outs):
            raise AdoptionError(
                f"request {plan.key}: {len(outs)} tokens delivered, max_tokens {params.max_tokens}: nothing left to generate"
            )
        prompt = list(plan.prompt_token_ids)

    blocks = [pool.blocks[b] for b in plan.block_ids]
    for blk in blocks:
        if blk.is_null:
            raise AdoptionError(f"request {plan.key}: block {blk.block_id} is the null block")
        shared_prefix = pool.enable_caching and (
            blk.block_hash is not None or (deferred is not None and blk.block_id in deferred.full_blocks))
        if blk.ref_cnt > 0 and not shared_prefix:
            raise AdoptionError(f"request {plan.key}: block {blk.block_id} is already in use by another request")

    defer = deferred is not None and block_hasher is not None and pool.enable_caching and bool(blocks)
    build = functools.partial(Request, request_id=request_id, prompt_token_ids=prompt, sampling_params=params,
                              pooling_params=None, **(request_kwargs or {}))
    request = build(block_hasher=None if defer else block_hasher)
    if defer and not hasattr(request, "_block_hasher"):
        # A vLLM whose Request keeps its hasher elsewhere: hash now, in the adoption.
        defer = False
        request = build(block_hasher=block_hasher)
    if not fold_outputs and outs:
        request.append_output_token_ids(outs)
    if request.use_structured_output:
        _advance_grammar(scheduler, request, plan, grammar_timeout)

    if blocks:
        # A free block may still carry a prefix-cache hash from this engine's own past
        # (a stale eviction candidate); its contents are now the adopted request's.
        stale = {blk.block_id for blk in blocks if blk.ref_cnt == 0 and blk.block_hash is not None}
        if stale:
            pool.evict_blocks(stale)
        pool.touch(blocks)
        manager.req_to_blocks[request_id] = list(blocks)
        # Leading blocks already hashed (a prefix shared with an adopted sibling) are
        # cached; the rest are hashed by cache_blocks once the request runs.
        hashed = 0
        for blk in blocks:
            if blk.block_hash is None:
                break
            hashed += 1
        manager.num_cached_block[request_id] = _NOT_YET_CACHED if defer else hashed
    # else: no KV to reuse (never synced, or the no-KV-reuse ablation): the request
    # goes in as a new one, with nothing registered in the KV manager, so vLLM
    # looks its prompt up in the prefix cache like any new request's (a request
    # registered there counts as running, and vLLM asserts it gets no cache hit).
    request.num_computed_tokens = plan.num_computed
    (enqueue or scheduler.add_request)(request)
    if defer:
        assert deferred is not None
        deferred.add(request, plan.num_computed, plan.block_ids, manager.block_size)
    elif pool.enable_caching and plan.num_computed:
        # Hash the adopted full blocks now, so a sibling adopted next that shares
        # this prefix finds them cached (and so new requests can hit them).
        kv.cache_blocks(request, plan.num_computed)
    return request, AdoptResult(
        key=plan.key,
        request_id=request_id,
        reused_tokens=plan.num_computed,
        prefill_tokens=plan.num_tokens - plan.num_computed,
        num_folded=len(outs) if fold_outputs else 0,
    )


def _advance_grammar(scheduler: Any, request: Any, plan: AdoptPlan, timeout: float) -> None:
    """Compile ``request``'s grammar and feed it the output so far (see the module
    docstring). Raises AdoptionError; leaves the scheduler untouched."""
    import time

    from vllm.v1.request import RequestStatus

    manager = getattr(scheduler, "structured_output_manager", None)
    if manager is None:
        raise AdoptionError(f"request {plan.key}: structured outputs, and the scheduler has no StructuredOutputManager")
    if manager.vllm_config.structured_outputs_config.reasoning_parser:
        # The grammar starts after the reasoning ends; which of the delivered
        # tokens were reasoning is not carried across a takeover yet.
        raise AdoptionError(f"request {plan.key}: not yet: adopting a structured-output request with a reasoning parser")
    try:
        manager.grammar_init(request)
    except Exception as e:
        raise AdoptionError(f"request {plan.key}: structured outputs: {e}") from e
    deadline = time.monotonic() + timeout
    grammar = request.structured_output_request.grammar
    while grammar is None:  # compiling on the manager's executor
        if time.monotonic() > deadline:
            raise AdoptionError(f"request {plan.key}: grammar not compiled within {timeout:g}s")
        time.sleep(0.001)
        grammar = request.structured_output_request.grammar
    if isinstance(grammar, Exception):
        raise AdoptionError(f"request {plan.key}: structured outputs: {grammar}") from grammar
    outs = list(plan.output_token_ids)
    if outs and not grammar.accept_tokens(request.request_id, outs):
        raise AdoptionError(
            f"request {plan.key}: the {len(outs)} tokens the client received do not fit the request's grammar")
    request.status = RequestStatus.WAITING


# Fields of vLLM's EngineCoreRequest that a Request keeps and adoption carries
# over as sent (Request.from_engine_core_request passes them, v1/request.py:218-242;
# 0.33: :244-270): the cache salt above all (the prefix cache's tenant isolation:
# without it an adopted request's blocks would hash as unsalted ones), and the
# priority, arrival time, trace headers, client index, reasoning state.
REQUEST_FIELDS = ("client_index", "arrival_time", "cache_salt", "priority", "trace_headers", "reasoning_ended",
                  "reasoning_parser_kwargs")


@functools.cache
def _request_takes() -> tuple[str, ...]:
    """The REQUEST_FIELDS this vLLM's Request takes (read once: adoption is on
    the takeover's critical path)."""
    import inspect

    from vllm.v1.request import Request

    params = inspect.signature(Request.__init__).parameters
    return tuple(f for f in REQUEST_FIELDS if f in params)


def request_fields(engine_core_request: Any) -> dict:
    """The REQUEST_FIELDS of ``engine_core_request`` that this vLLM's Request takes."""
    return {f: getattr(engine_core_request, f) for f in _request_takes() if hasattr(engine_core_request, f)}
