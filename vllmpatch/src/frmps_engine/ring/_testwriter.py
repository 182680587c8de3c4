"""A real writer process for the cross-language tests (not used in production).

A fake engine drives a DeltaTracker + RingWriter with a seeded random
workload: requests arrive, decode tokens, grow blocks, get preempted (new block
IDs, so the tracker must RESET them), finish, abort or are forgotten. Before
publishing step s it appends "s <digest>" to a log, where digest is
state_digest() of what the reader's snapshot must hold after that record; the
Go tests compare their snapshot against it, also when the writer is SIGKILLed.

    python -m frmps_engine.ring._testwriter run RING LOG --seed S --steps N [--sync-every K] [--final JSON]
    python -m frmps_engine.ring._testwriter forkserver RING LOGDIR
        stdin: "run ID SEED" -> forks a writer (steps unbounded), prints "pid PID";
        the caller SIGKILLs it; we reap it and print "dead PID". "quit" ends.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import struct
import sys
import time
from array import array

from .tracker import DeltaTracker
from .writer import RingWriter

BLOCK_SIZE = 16
_REQ = struct.Struct("<QQIII")


class FakeRequest:
    __slots__ = ("key", "seed", "block_ids", "token_ids", "num_prompt", "num_computed", "finished", "aborted")

    def __init__(self, key, seed, prompt, blocks):
        self.key = key
        self.seed = seed
        self.token_ids = prompt
        self.block_ids = blocks
        self.num_prompt = len(prompt)
        self.num_computed = len(prompt)
        self.finished = False
        self.aborted = False


def state_digest(reqs) -> str:
    """sha256 over the live requests sorted by key: key, seed u64; num_prompt,
    num_computed, n_blocks u32; blocks; n_tokens u32; tokens (little-endian).
    ringbuf's tests compute the same over their snapshot."""
    h = hashlib.sha256()
    for r in sorted(reqs, key=lambda r: r.key):
        h.update(_REQ.pack(r.key, r.seed, r.num_prompt, r.num_computed, len(r.block_ids)))
        h.update(array("I", r.block_ids).tobytes())
        h.update(struct.pack("<I", len(r.token_ids)))
        h.update(array("I", r.token_ids).tobytes())
    return h.hexdigest()


class Workload:
    def __init__(self, seed: int, max_live: int = 48) -> None:
        self.rnd = random.Random(seed)
        self.live: dict[int, FakeRequest] = {}
        self.next_key = (seed % 1000) * 1_000_000 + 1
        self.next_block = 1
        self.max_live = max_live

    def _blocks(self, n_tokens: int) -> list[int]:
        n = -(-n_tokens // BLOCK_SIZE)
        b = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return b

    def step(self, tracker: DeltaTracker) -> list[FakeRequest]:
        """Advance one engine step; returns the views to sync (live + just done)."""
        rnd = self.rnd
        views = []
        for _ in range(rnd.randint(0, 3)):
            if len(self.live) < self.max_live:
                prompt = [rnd.randrange(1 << 17) for _ in range(rnd.randint(1, 80))]
                r = FakeRequest(self.next_key, rnd.getrandbits(64), prompt, self._blocks(len(prompt)))
                self.next_key += 1
                self.live[r.key] = r
        for key in list(self.live):
            r = self.live[key]
            x = rnd.random()
            if x < 0.25:
                pass
            elif x < 0.88:
                for _ in range(rnd.choice((1, 1, 1, 4, 16))):
                    r.token_ids.append(rnd.randrange(1 << 17))
                    if len(r.token_ids) > BLOCK_SIZE * len(r.block_ids):
                        r.block_ids.append(self.next_block)
                        self.next_block += 1
                r.num_computed = len(r.token_ids) - rnd.randint(0, 1)
            elif x < 0.91:  # preempted and recomputed into fresh blocks
                r.block_ids = self._blocks(len(r.token_ids))
                r.num_computed = rnd.randint(0, len(r.token_ids))
            elif x < 0.95:
                r.finished = True
            elif x < 0.97:
                r.aborted = True
            elif x < 0.98:
                tracker.forget(key)
                del self.live[key]
                continue
            views.append(r)
            if r.finished or r.aborted:
                del self.live[key]
        return views


def run_writer(ring: str, log_path: str, seed: int, steps: int, sync_every: int = 1, final: str | None = None,
               linger_s: float = 0.0, sync_delay_s: float = 0.0) -> None:
    w = RingWriter.attach(ring)
    t = DeltaTracker(w)
    wl = Workload(seed)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, f"0 {state_digest([])}\n".encode())
        t.sync(0, [])  # FULL after attach
        s = 0
        pending: dict[int, FakeRequest] = {}
        while steps < 0 or s < steps:
            s += 1
            for v in wl.step(t):
                pending[v.key] = v
            for k in [k for k, v in pending.items() if k not in wl.live and not (v.finished or v.aborted)]:
                del pending[k]  # forgotten: the tracker already queued its removal
            if s % sync_every:
                continue
            os.write(fd, f"{s} {state_digest(wl.live.values())}\n".encode())
            t.sync(s, list(pending.values()) + [r for r in wl.live.values() if r.key not in pending])
            pending.clear()
            if sync_delay_s:
                time.sleep(sync_delay_s)  # an engine's pace: a reader on a loaded machine keeps up
        if final:
            with open(final, "w") as f:
                json.dump(
                    {
                        "step": s,
                        "requests": [
                            {
                                "key": r.key, "seed": r.seed, "num_prompt": r.num_prompt,
                                "num_computed": r.num_computed, "blocks": r.block_ids, "tokens": r.token_ids,
                            }
                            for r in wl.live.values()
                        ],
                    },
                    f,
                )  # fmt: skip
        # Like an engine that keeps running: a reader that fell behind near the
        # end asks for a resync, and only a live writer can answer it.
        deadline = time.monotonic() + linger_s
        while time.monotonic() < deadline:
            if w.resync_requested():
                t.sync(s, list(wl.live.values()))
            time.sleep(0.001)
    finally:
        os.close(fd)
        w.close()


def forkserver(ring: str, logdir: str) -> None:
    out = sys.stdout
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] == "quit":
            return
        _, ident, seed = parts
        pid = os.fork()
        if pid == 0:  # the writer; runs until the test SIGKILLs it
            try:
                run_writer(ring, os.path.join(logdir, f"{ident}.log"), int(seed), -1)
            finally:
                os._exit(1)
        out.write(f"pid {pid}\n")
        out.flush()
        os.waitpid(pid, 0)
        out.write(f"dead {pid}\n")
        out.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="frmps_engine.ring._testwriter")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("ring")
    r.add_argument("log")
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--steps", type=int, default=1000)
    r.add_argument("--sync-every", type=int, default=1)
    r.add_argument("--final")
    r.add_argument("--linger", type=float, default=0.0, help="seconds to keep answering resync requests at the end")
    r.add_argument("--sync-delay", type=float, default=0.0, help="seconds to pause after each record")
    f = sub.add_parser("forkserver")
    f.add_argument("ring")
    f.add_argument("logdir")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        run_writer(a.ring, a.log, a.seed, a.steps, a.sync_every, a.final, a.linger, a.sync_delay)
    else:
        forkserver(a.ring, a.logdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
