"""Committed per-request state, read from vLLM's scheduler for the ring.

Plain logic over duck-typed vLLM ``Request`` objects (attributes used:
``request_id``, ``all_token_ids``, ``num_prompt_tokens``, ``num_computed_tokens``,
``num_in_flight_tokens``, ``sampling_params.seed``, ``status``).

What "committed" means in vLLM 0.33.0: ``Scheduler._update_after_schedule``
advances ``num_computed_tokens`` as soon as a step is *scheduled*
(scheduler.py:1845-1860) and counts those tokens in ``num_in_flight_tokens``;
``update_from_output`` subtracts them when the step's output arrives
(scheduler.py:2318). With async scheduling the next step is already scheduled
when the previous output is processed, so the committed count is
``num_computed_tokens - num_in_flight_tokens`` — the same expression vLLM uses
itself (scheduler.py:2414, 3372). Sampled tokens join ``all_token_ids`` only in
``update_from_output``, so the token list is committed as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ..sdk.seeds import to_uint64

REQUEST_ID_PREFIX = "frmps-"


def request_id_for_key(key: int) -> str:
    """The vLLM request id of ring key ``key``."""
    key = int(key)
    if key < 0 or key >= 1 << 64:
        raise ValueError(f"request key {key} out of range: must fit in uint64")
    return f"{REQUEST_ID_PREFIX}{key}"


def key_for_request_id(request_id: str) -> int | None:
    """The ring key of a vLLM request id, or None for requests frmps did not submit
    (vLLM's own warm-up requests, for instance)."""
    if not request_id.startswith(REQUEST_ID_PREFIX):
        return None
    digits = request_id[len(REQUEST_ID_PREFIX):]
    if not digits.isdigit():
        return None
    return int(digits)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class CommittedView:
    """One request's committed state; satisfies the ring's RequestView protocol."""

    key: int
    seed: int
    block_ids: list[int]
    token_ids: list[int]
    num_prompt: int
    num_computed: int
    finished: bool = False
    aborted: bool = False
    # Output tokens that were folded into the prompt when this request was adopted
    # on a V1-runner engine (see adoption.py); the ring sees the original prompt.
    extra: dict = field(default_factory=dict)


def committed_num_computed(request: Any) -> int:
    return max(0, int(request.num_computed_tokens) - int(getattr(request, "num_in_flight_tokens", 0)))


def committed_view(
    request: Any,
    key: int,
    block_ids: Sequence[int],
    block_size: int,
    *,
    num_folded: int = 0,
    finished: bool = False,
    aborted: bool = False,
) -> CommittedView:
    """Build the committed view of ``request``.

    ``block_ids`` are the request's blocks (one KV-cache group). Only the blocks
    that hold committed tokens are published: blocks allocated for in-flight or
    look-ahead tokens carry nothing a standby could reuse, and keeping the list
    to ``cdiv(num_computed, block_size)`` keeps it append-only across syncs.
    ``num_folded`` output tokens were folded into the prompt at adoption; the
    ring keeps reporting the original prompt length.
    """
    num_computed = committed_num_computed(request)
    tokens = list(request.all_token_ids)
    num_computed = min(num_computed, len(tokens))
    blocks = [int(b) for b in block_ids[: cdiv(num_computed, block_size)]]
    seed = request.sampling_params.seed if request.sampling_params is not None else None
    if seed is None:
        raise ValueError(f"request {request.request_id} has no explicit seed; frmps assigns one to every request")
    return CommittedView(
        key=key,
        seed=to_uint64(seed),  # vLLM's int64 -> the ring's uint64 (sdk/seeds.py)
        block_ids=blocks,
        token_ids=tokens,
        num_prompt=int(request.num_prompt_tokens) - num_folded,
        num_computed=num_computed,
        finished=finished,
        aborted=aborted,
    )


class SyncPolicy:
    """Publish every ``every`` committed steps (``every`` >= 1)."""

    def __init__(self, every: int):
        if int(every) < 1:
            raise ValueError(f"sync interval must be >= 1, got {every}")
        self.every = int(every)
        self.steps = 0

    def tick(self) -> bool:
        """Count one committed step; True when this step must be published."""
        self.steps += 1
        return self.steps % self.every == 0


def views_sorted(views: Iterable[CommittedView]) -> list[CommittedView]:
    """Deterministic publish order (by key), so records are reproducible."""
    return sorted(views, key=lambda v: v.key)
