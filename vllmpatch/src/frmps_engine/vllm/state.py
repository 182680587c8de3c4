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


class CommittedView:
    """One request's committed state; satisfies the ring's RequestView protocol
    and its ViewParts capability.

    A snapshot taken in O(1): ``token_ids`` may be the request's own token list
    (vLLM's ``Request.all_token_ids``, which only grows while frmps drives it) with
    ``n_tokens``, its length at the time of the view. ``token_ids`` returns a copy of
    those entries; the ring's DeltaTracker reads the live list through ``parts()``
    and copies only what it has not published, so a publish stays flat in the
    sequence length."""

    __slots__ = ("key", "seed", "num_prompt", "num_computed", "finished", "aborted", "_b", "_nb", "_t", "_nt")

    def __init__(self, key: int, seed: int, block_ids: list[int], token_ids: Sequence[int], num_prompt: int,
                 num_computed: int, finished: bool = False, aborted: bool = False, n_tokens: int | None = None,
                 n_blocks: int | None = None):
        self.key, self.seed, self.num_prompt, self.num_computed = key, seed, num_prompt, num_computed
        self.finished, self.aborted = finished, aborted
        self._b, self._t = block_ids, token_ids
        self._nb = len(block_ids) if n_blocks is None else n_blocks
        self._nt = len(token_ids) if n_tokens is None else n_tokens

    @property
    def block_ids(self) -> list[int]:
        return list(self._b[: self._nb])

    @property
    def token_ids(self) -> list[int]:  # prompt + output
        return list(self._t[: self._nt])

    def parts(self) -> tuple[list[int], int, Sequence[int], int]:
        """(blocks, n_blocks, tokens, n_tokens): the lists may be live ones, valid up to the counts."""
        return self._b, self._nb, self._t, self._nt

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CommittedView):
            return NotImplemented
        return (self.key, self.seed, self.block_ids, self.token_ids, self.num_prompt, self.num_computed,
                self.finished, self.aborted) == (other.key, other.seed, other.block_ids, other.token_ids,
                                                 other.num_prompt, other.num_computed, other.finished, other.aborted)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"CommittedView(key={self.key}, seed={self.seed}, blocks={len(self._b)}, tokens={self._nt}, "
                f"num_prompt={self.num_prompt}, num_computed={self.num_computed}, finished={self.finished}, "
                f"aborted={self.aborted})")


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
    tokens = request.all_token_ids  # vLLM's read-only wrapper of the live list: not copied
    n_tokens = len(tokens)
    num_computed = min(num_computed, n_tokens)
    seed = request.sampling_params.seed if request.sampling_params is not None else None
    if seed is None:
        raise ValueError(f"request {request.request_id} has no explicit seed; frmps assigns one to every request")
    # block_ids may be a list the caller extends later (the scheduler's cache): the view
    # keeps its length now, as it does the live token list's.
    return CommittedView(key, to_uint64(seed), block_ids, tokens, int(request.num_prompt_tokens) - num_folded, num_computed,
                         finished, aborted, n_tokens, min(len(block_ids), cdiv(num_computed, block_size)))


def views_sorted(views: Iterable[CommittedView]) -> list[CommittedView]:
    """Deterministic publish order (by key), so records are reproducible."""
    return sorted(views, key=lambda v: v.key)
