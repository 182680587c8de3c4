"""TEST DOUBLE for frmps_engine.ring: same Python API, records as JSON lines.

Each publish appends one line {"step", "full", "epoch", "entries": [...]}; a
test reads the file to rebuild the per-request snapshot a supervisor would have.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Sequence


@dataclass
class RequestDelta:
    key: int
    seed: int
    num_computed: int
    num_prompt: int = 0
    reset: bool = False
    finished: bool = False
    aborted: bool = False
    blocks: Sequence[int] = ()
    tokens: Sequence[int] = ()


class RingWriter:
    def __init__(self, path: str):
        self._f = open(path, "a", encoding="utf-8")
        self._seq = 0
        self.epoch = sum(1 for line in open(path, encoding="utf-8") if '"attach"' in line) + 1
        self._f.write(json.dumps({"attach": self.epoch}) + "\n")
        self._f.flush()

    @classmethod
    def attach(cls, path: str) -> "RingWriter":
        return cls(path)

    def resync_requested(self) -> bool:
        return False

    def publish(self, step: int, entries, full: bool = False) -> int:
        self._seq += 1
        rec = {"step": step, "full": full, "epoch": self.epoch, "entries": [
            {**asdict(e), "blocks": list(e.blocks), "tokens": list(e.tokens)} for e in entries]}
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        return self._seq

    def close(self) -> None:
        self._f.close()


class DeltaTracker:
    """Publishes every view as a RESET entry (simple, not compact). Like the real
    tracker, its first record after attach (or after request_full) is FULL."""

    def __init__(self, writer: RingWriter):
        self._w = writer
        self._need_full = True

    def request_full(self) -> None:
        self._need_full = True

    def sync(self, step: int, states) -> int:
        full, self._need_full = self._need_full, False
        entries = [RequestDelta(key=v.key, seed=v.seed, num_computed=v.num_computed, num_prompt=v.num_prompt,
                                reset=True, finished=v.finished, aborted=v.aborted,
                                blocks=list(v.block_ids), tokens=list(v.token_ids)) for v in states]
        return self._w.publish(step, entries, full=full)

    def forget(self, key: int) -> None:
        pass


def read_snapshot(path: str) -> dict[int, dict]:
    """What a supervisor would hold after consuming every record (test helper)."""
    snap: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if "attach" in rec:
                continue
            if rec["full"]:
                snap.clear()
            for e in rec["entries"]:
                if e["finished"] or e["aborted"]:
                    snap.pop(e["key"], None)
                else:
                    snap[e["key"]] = {**e, "step": rec["step"]}
    return snap
