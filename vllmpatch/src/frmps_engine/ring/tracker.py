"""DeltaTracker: turns the engine's per-request state into ring records.

It remembers, per request, what it last published and emits only what changed
since: appended block IDs and tokens and the new computed count. It emits a
RESET entry (complete state) the first time it sees a request, when the block
list changed other than by appending, and in FULL records (after attach and
whenever the reader asks for a resync).

The append check is O(1) per request so that publishing stays flat in the
sequence length: the block list must not have shrunk and its first and last
previously published block IDs must be unchanged. An engine that re-arranges
blocks in the middle of a list while keeping both ends and the length should
publish that request with ``reset()`` (its scheduler knows when it preempts).
"""

from __future__ import annotations

from array import array
from typing import Iterable, Protocol, runtime_checkable

import numpy as np

from .layout import FLAG_ABORTED, FLAG_FINISHED, FLAG_RESET
from .writer import RingWriter


class RequestView(Protocol):
    """What the tracker reads of one request (optionally also ViewParts)."""

    key: int
    seed: int
    block_ids: list[int]
    token_ids: list[int]  # prompt then output
    num_prompt: int
    num_computed: int
    finished: bool
    aborted: bool


@runtime_checkable
class ViewParts(Protocol):
    """An optional capability of a view: ``parts()`` -> (blocks, n_blocks, tokens,
    n_tokens), lists valid up to those lengths (the engine's own, appended to in
    place). The tracker then copies only the new entries instead of reading
    ``block_ids`` / ``token_ids`` (which copy whole lists)."""

    def parts(self) -> tuple[list[int], int, list[int], int]: ...


class DeltaTracker:
    def __init__(self, writer: RingWriter) -> None:
        self._w = writer
        # key -> (n_blocks, n_tokens, first_block, last_block, num_computed) as published
        self._pub: dict[int, tuple[int, int, int, int, int]] = {}
        self._need_full = True  # a writer's first record after attach is FULL
        self._gone: list[int] = []  # forgotten keys the reader must drop
        self._reset: set[int] = set()
        self._has_parts: dict[type, bool] = {}  # ViewParts, probed once per view class

    def forget(self, key: int) -> None:
        """Drop a request the engine no longer has; the next record tells the
        reader (as ABORTED) if the request was published."""
        if self._pub.pop(key, None) is not None:
            self._gone.append(key)
        self._reset.discard(key)

    def reset(self, key: int) -> None:
        """Publish this request's complete state next time (e.g. after the
        engine re-arranged its blocks in a way the append check cannot see)."""
        self._reset.add(key)

    def request_full(self) -> None:
        self._need_full = True

    def sync(self, step: int, states: Iterable[RequestView]) -> int:
        """Publish one record (DELTA, or FULL when needed); returns its seq."""
        full = self._need_full or self._w.resync_requested()
        pub = self._pub
        if full:
            pub.clear()
            self._gone.clear()
        # Row-major scratch columns (one extend per entry is cheaper in Python
        # than seven appends); publish_columns takes the strided views.
        ks = array("Q")  # key, seed
        cols = array("I")  # num_computed, num_prompt, flags, n_blocks, n_tokens
        blocks = array("I")
        tokens = array("I")
        ks_extend, cols_extend = ks.extend, cols.extend
        blocks_extend, tokens_extend = blocks.extend, tokens.extend
        done = []
        force = self._reset
        has_parts = self._has_parts
        for v in states:
            key = v.key
            fin = FLAG_FINISHED if v.finished else 0
            if v.aborted:
                fin |= FLAG_ABORTED
            if full and fin:
                continue  # absent from a FULL record = gone
            prev = pub.get(key)
            cls = type(v)
            parts = has_parts.get(cls)
            if parts is None:
                parts = has_parts[cls] = isinstance(v, ViewParts)
            if parts:
                # Live lists valid up to nb / nt: nothing is copied but what is new.
                b, nb, t, nt = v.parts()
            else:
                b = v.block_ids
                t = v.token_ids
                nb = len(b)
                nt = len(t)
            nc = v.num_computed
            if (
                prev is None
                or nb < prev[0]
                or nt < prev[1]
                or (prev[0] and (b[0] != prev[2] or b[prev[0] - 1] != prev[3]))
                or (force and key in force)
            ):
                blocks_extend(b if len(b) == nb else b[:nb])
                tokens_extend(t if len(t) == nt else t[:nt])
                cols_extend((nc, v.num_prompt, FLAG_RESET | fin, nb, nt))
            else:
                pb, pt = prev[0], prev[1]
                if nb == pb and nt == pt and nc == prev[4] and not fin:
                    continue
                if nb > pb:
                    blocks_extend(b[pb:nb])
                if nt > pt:
                    tokens_extend(t[pt:nt])
                cols_extend((nc, 0, fin, nb - pb, nt - pt))
            ks_extend((key, v.seed))
            if fin:
                done.append(key)
            elif nb:
                pub[key] = (nb, nt, b[0], b[nb - 1], nc)
            else:
                pub[key] = (0, nt, 0, 0, nc)
        for key in self._gone:
            ks_extend((key, 0))
            cols_extend((0, 0, FLAG_ABORTED, 0, 0))
        k = np.frombuffer(ks, dtype=np.uint64).reshape(-1, 2)
        c = np.frombuffer(cols, dtype=np.uint32).reshape(-1, 5)
        # pub was updated in place: if publishing fails, the next record must
        # be FULL to put reader and tracker back in agreement.
        self._need_full = True
        seq = self._w.publish_columns(
            step, k[:, 0], k[:, 1], c[:, 0], c[:, 1], c[:, 2], c[:, 3], c[:, 4],
            np.frombuffer(blocks, dtype=np.uint32), np.frombuffer(tokens, dtype=np.uint32), full=full,
        )  # fmt: skip
        self._need_full = False
        self._gone.clear()
        force.clear()
        for key in done:
            pub.pop(key, None)
        return seq
