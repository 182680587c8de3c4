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

A record never exceeds a quarter of the ring (the ring takes records of up to
capacity/2, but a record of nearly that size right after a PAD would put the
write cursor more than capacity/2 ahead of a reader that had read everything,
which the reader must take for an overrun: ringbuf/FORMAT.md). When a record
would be larger (a FULL record of many long requests, e.g. after a takeover at a
large batch), the requests that do not fit are left out of the reader's snapshot
instead: absent from a FULL record, and as a RESET+ABORTED tombstone in a DELTA
record (the reader drops the request, whether it knew it or not). The reader then holds
nothing for them, so a takeover re-prefills them from the prompt and the
delivered tokens, which is exact, only slower; the tracker tries them again (as
RESET) at every later record. Engine and reader stay in agreement, and the
engine keeps serving. A ring that is too small for the engine's working set is
logged once, with the size it would have needed.
"""

from __future__ import annotations

import logging
from array import array
from typing import Iterable, Protocol, runtime_checkable

import numpy as np

from .layout import FLAG_ABORTED, FLAG_FINISHED, FLAG_RESET, PAYLOAD_PER_ENTRY, RECORD_HEADER_SIZE, align_up, payload_len
from .writer import RingError, RingWriter

log = logging.getLogger(__name__)


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
        self._warned = False  # a record too large for the ring was logged

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
            if fin and prev is None:
                continue  # done, and the reader never had it (or was told to drop it): nothing to say
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
        b = np.frombuffer(blocks, dtype=np.uint32)
        tk = np.frombuffer(tokens, dtype=np.uint32)
        # pub was updated in place: if publishing fails, the next record must
        # be FULL to put reader and tracker back in agreement.
        self._need_full = True
        need = align_up(RECORD_HEADER_SIZE + payload_len(len(k), b.size, tk.size))
        if need > self._w.max_record // 2:
            k, c, b, tk, left = self._fit(k, c, b, tk, full, need)
            for key in left:
                pub.pop(key, None)
            done = [key for key in done if key not in left]
        seq = self._w.publish_columns(
            step, k[:, 0], k[:, 1], c[:, 0], c[:, 1], c[:, 2], c[:, 3], c[:, 4], b, tk, full=full,
        )  # fmt: skip
        self._need_full = False
        self._gone.clear()
        force.clear()
        for key in done:
            pub.pop(key, None)
        return seq

    def _fit(self, k, c, b, tk, full: bool, need: int):
        """The record's entries (``need`` bytes as a whole record) cut to what the
        ring takes: entries in order while they fit, each entry that does not fit
        left out (FULL) or replaced by a RESET+ABORTED tombstone (DELTA). Returns
        the columns and the set of keys left out of the reader's snapshot."""
        n = len(k)
        nb, nt = c[:, 3].astype(np.int64), c[:, 4].astype(np.int64)
        size = PAYLOAD_PER_ENTRY + 4 * (nb + nt)
        tomb = 0 if full else PAYLOAD_PER_ENTRY
        # Room for the payload: a quarter of the ring (module docstring), less the
        # header, the fixed part and the alignment.
        budget = self._w.max_record // 2 - RECORD_HEADER_SIZE - payload_len(0, 0, 0) - 32
        keep = np.zeros(n, dtype=bool)
        # The tombstones of the entries after this one must still fit: reserve them.
        used = tomb * n
        for i in range(n):
            extra = int(size[i]) - tomb
            if used + extra <= budget:
                keep[i] = True
                used += extra
        if used > budget:
            raise RingError(f"publish: {n} requests do not fit in a ring record of {self._w.max_record} bytes "
                            f"even without their tokens; raise the ring's capacity")
        left = {int(key) for key in k[~keep, 0]}
        if not self._warned:
            self._warned = True
            log.warning("ring: a record of %d requests needs %d bytes and the ring takes %d (capacity/4): "
                        "%d requests left out of the supervisor's snapshot (a takeover re-prefills them); "
                        "size the ring (frmps serve --ring-capacity) to at least %d bytes",
                        n, need, self._w.max_record // 2, len(left), 1 << (4 * need - 1).bit_length())
        if full:
            rows = keep
        else:
            rows = np.ones(n, dtype=bool)
            c = c.copy()
            k = k.copy()
            c[~keep] = (0, 0, FLAG_RESET | FLAG_ABORTED, 0, 0)
            k[~keep, 1] = 0
        bkeep = np.repeat(keep, nb)
        tkeep = np.repeat(keep, nt)
        return k[rows], c[rows], b[bkeep], tk[tkeep], left
