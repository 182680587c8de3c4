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
from typing import Iterable, Protocol

import numpy as np

from .layout import FLAG_ABORTED, FLAG_FINISHED, FLAG_RESET
from .writer import RingWriter


class RequestView(Protocol):
    key: int
    seed: int
    block_ids: list[int]
    token_ids: list[int]  # prompt then output
    num_prompt: int
    num_computed: int
    finished: bool
    aborted: bool


class DeltaTracker:
    def __init__(self, writer: RingWriter) -> None:
        self._w = writer
        # key -> [n_blocks, n_tokens, first_block, last_block, num_computed, seed]
        self._pub: dict[int, list[int]] = {}
        self._need_full = True  # a writer's first record after attach is FULL
        self._gone: list[int] = []  # forgotten keys the reader must drop
        self._reset: set[int] = set()

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
        keys = array("Q")
        seeds = array("Q")
        nc_col = array("I")
        np_col = array("I")
        fl_col = array("I")
        nb_col = array("I")
        nt_col = array("I")
        blocks = array("I")
        tokens = array("I")
        done = []
        force = self._reset
        for v in states:
            key = v.key
            fin = FLAG_FINISHED if v.finished else 0
            if v.aborted:
                fin |= FLAG_ABORTED
            prev = pub.get(key)
            if full and fin:
                continue  # absent from a FULL record = gone
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
                or key in force
            ):
                flags = FLAG_RESET | fin
                blocks.extend(b)
                tokens.extend(t)
                nb_col.append(nb)
                nt_col.append(nt)
                np_col.append(v.num_prompt)
            else:
                pb, pt = prev[0], prev[1]
                if nb == pb and nt == pt and nc == prev[4] and not fin:
                    continue
                flags = fin
                if nb > pb:
                    blocks.extend(b[pb:])
                if nt > pt:
                    tokens.extend(t[pt:])
                nb_col.append(nb - pb)
                nt_col.append(nt - pt)
                np_col.append(0)
            keys.append(key)
            seeds.append(v.seed)
            nc_col.append(nc)
            fl_col.append(flags)
            if fin:
                done.append(key)
            elif prev is None:
                pub[key] = [nb, nt, b[0] if nb else 0, b[-1] if nb else 0, nc]
            else:
                prev[0] = nb
                prev[1] = nt
                if nb:
                    prev[2] = b[0]
                    prev[3] = b[-1]
                prev[4] = nc
        for key in self._gone:
            keys.append(key)
            seeds.append(0)
            nc_col.append(0)
            np_col.append(0)
            fl_col.append(FLAG_ABORTED)
            nb_col.append(0)
            nt_col.append(0)
        u64 = np.frombuffer
        # pub was updated in place: if publishing fails, the next record must
        # be FULL to put reader and tracker back in agreement.
        self._need_full = True
        seq = self._w.publish_columns(
            step,
            u64(keys, dtype=np.uint64),
            u64(seeds, dtype=np.uint64),
            u64(nc_col, dtype=np.uint32),
            u64(np_col, dtype=np.uint32),
            u64(fl_col, dtype=np.uint32),
            u64(nb_col, dtype=np.uint32),
            u64(nt_col, dtype=np.uint32),
            u64(blocks, dtype=np.uint32),
            u64(tokens, dtype=np.uint32),
            full=full,
        )
        self._need_full = False
        self._gone.clear()
        force.clear()
        for key in done:
            pub.pop(key, None)
        return seq
