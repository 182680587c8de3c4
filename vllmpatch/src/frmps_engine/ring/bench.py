"""Publish-cost benchmark of the ring writer (the project's demo job).

    python -m frmps_engine.ring.bench [--repeat N] [--quick] [--no-go]

Measures, per step batch (one record), the time the engine spends publishing:
  columns  RingWriter.publish_columns with numpy columns (the fast path)
  deltas   RingWriter.publish with a list of RequestDelta
  tracker  DeltaTracker.sync over the engine's request views (diffing included)
for 1, 64 and 256 running requests with 1 and 16 new tokens each, and for
sequences of 8 to 16,000 tokens (tracker path: the cost must stay flat).
Per-delta figures are the batch time divided by the number of requests. On a
shared machine p10 approximates the cost without preemption; p99 shows the
scheduler as much as the writer.

When run from a source checkout with Go installed it also runs the Go
reader's BenchmarkConsume (consume + compact throughput on one core).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from . import _crc32c
from .tracker import DeltaTracker
from .writer import RequestDelta, RingWriter, create_ring

BLOCK = 16


class _View:
    __slots__ = ("key", "seed", "block_ids", "token_ids", "num_prompt", "num_computed", "finished", "aborted")

    def __init__(self, key: int, seq_len: int) -> None:
        self.key = key
        self.seed = key * 7919
        self.token_ids = list(range(seq_len))
        self.block_ids = list(range(key * 100_000, key * 100_000 + -(-seq_len // BLOCK)))
        self.num_prompt = min(seq_len, 8)
        self.num_computed = seq_len
        self.finished = False
        self.aborted = False

    def advance(self, k: int) -> None:
        t = self.token_ids
        for _ in range(k):
            t.append(len(t))
            if len(t) > BLOCK * len(self.block_ids):
                self.block_ids.append(self.block_ids[-1] + 1)
        self.num_computed = len(t) - 1


def _stats(samples_ns: list[int], n: int) -> tuple[float, float, float, float, float]:
    s = sorted(samples_ns)
    p10 = s[int(0.10 * len(s))] / 1e3
    med = statistics.median(s) / 1e3
    p99 = s[min(len(s) - 1, int(0.99 * len(s)))] / 1e3
    return p10, med, p99, med / max(n, 1), p99 / max(n, 1)


def _columns_case(w: RingWriter, n: int, k: int, repeat: int) -> list[int]:
    keys = np.arange(1, n + 1, dtype=np.uint64)
    seeds = keys * np.uint64(7919)
    nc = np.full(n, 1000, dtype=np.uint32)
    npr = np.zeros(n, dtype=np.uint32)
    flags = np.zeros(n, dtype=np.uint32)
    nt = np.full(n, k, dtype=np.uint32)
    tokens = np.arange(n * k, dtype=np.uint32)
    out = []
    for i in range(repeat):
        # A new block for 1 request in 16 per token, like a decode step.
        nb = (np.arange(n) % BLOCK < k).astype(np.uint32) if k < BLOCK else np.ones(n, dtype=np.uint32)
        blocks = np.arange(int(nb.sum()), dtype=np.uint32)
        t0 = time.perf_counter_ns()
        w.publish_columns(i, keys, seeds, nc, npr, flags, nb, nt, blocks, tokens)
        out.append(time.perf_counter_ns() - t0)
    return out


def _deltas_case(w: RingWriter, n: int, k: int, repeat: int) -> list[int]:
    out = []
    toks = list(range(k))
    for i in range(repeat):
        entries = [RequestDelta(key, key * 7919, 1000, blocks=[key] if key % BLOCK < k else (), tokens=toks) for key in range(1, n + 1)]
        t0 = time.perf_counter_ns()
        w.publish(i, entries)
        out.append(time.perf_counter_ns() - t0)
    return out


def _tracker_case(w: RingWriter, n: int, k: int, seq_len: int, repeat: int) -> list[int]:
    t = DeltaTracker(w)
    views = [_View(key, seq_len) for key in range(1, n + 1)]
    t.sync(0, views)  # FULL with every request (not measured)
    out = []
    for i in range(1, repeat + 1):
        for v in views:
            v.advance(k)
        t0 = time.perf_counter_ns()
        t.sync(i, views)
        out.append(time.perf_counter_ns() - t0)
    return out


def _repo_root() -> Path | None:
    for d in Path(__file__).resolve().parents:
        if (d / "go.mod").is_file() and (d / "ringbuf").is_dir():
            return d
    return None


def _go_consume() -> None:
    """Run the Go reader's benchmark and print its throughput, if we can."""
    root, go = _repo_root(), shutil.which("go")
    print()
    if root is None or go is None:
        print("Go reader (BenchmarkConsume): skipped (needs a source checkout and the go tool)")
        return
    cmd = [go, "test", "-run", "^$", "-bench", "BenchmarkConsume", "-benchtime", "3x", "-cpu", "1", "./ringbuf"]
    try:
        out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        print("Go reader (BenchmarkConsume): timed out")
        return
    rows = re.findall(r"BenchmarkConsume/requests=(\d+)/tokens=(\d+)\S*\s+\d+\s+\d+ ns/op\s+([\d.]+) deltas/s\s+([\d.]+) ns/delta", out.stdout)
    if out.returncode != 0 or not rows:
        print(f"Go reader (BenchmarkConsume): failed\n{out.stdout}{out.stderr}")
        return
    print("Go reader: consume + compact on one core (target >= 1M request-deltas/s)")
    hdr = f"{'requests':>8} {'new tok':>7} | {'deltas/s':>12} {'ns/delta':>9}"
    print(hdr)
    print("-" * len(hdr))
    for n, k, rate, ns in rows:
        print(f"{n:>8} {k:>7} | {float(rate):>12,.0f} {float(ns):>9.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m frmps_engine.ring.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=400, help="batches measured per case")
    ap.add_argument("--quick", action="store_true", help="fewer cases and repeats (smoke run)")
    ap.add_argument("--no-go", action="store_true", help="skip the Go reader benchmark")
    a = ap.parse_args(argv)
    repeat = 50 if a.quick else a.repeat

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = tempfile.mkdtemp(prefix="frmps-ring-bench-", dir=shm)
    path = os.path.join(d, "ring")
    create_ring(path, 1 << 26)
    w = RingWriter.attach(path)
    w.publish(0, [], full=True)
    try:
        crc = "crc32c package (hardware)" if _crc32c.HAVE_HW else "numpy tables (no compiled crc32c package)"
        print(f"frmps ring writer: publish cost per step batch   [{platform.machine()}, Python {platform.python_version()}, numpy {np.__version__}]")
        print(f"CRC-32C: {crc}; {repeat} batches per case; targets: <= 2 us per delta (median), <= 50 us per batch of 256")
        hdr = (
            f"{'path':8} {'requests':>8} {'new tok':>7} {'seq len':>7} | {'batch p10':>9} {'batch med':>9} {'batch p99':>9}"
            f" | {'delta med':>9} {'delta p99':>9}  (us)"
        )
        print()
        print(hdr)
        print("-" * len(hdr))

        def row(path_: str, n: int, k: int, seq: str, samples: list[int]) -> None:
            p10, med, p99, dmed, dp99 = _stats(samples, n)
            print(
                f"{path_:8} {n:>8} {k:>7} {seq:>7} | {p10:>9.1f} {med:>9.1f} {p99:>9.1f} | {dmed:>9.2f} {dp99:>9.2f}",
                flush=True,
            )

        for n in (1, 64, 256):
            for k in (1, 16):
                row("columns", n, k, "-", _columns_case(w, n, k, repeat))
        for n in (1, 64, 256):
            for k in (1, 16):
                row("deltas", n, k, "-", _deltas_case(w, n, k, repeat))
        for n in (1, 64, 256):
            for k in (1, 16):
                row("tracker", n, k, "1000", _tracker_case(w, n, k, 1000, repeat))
        seq_lens = (8, 1000, 16000) if a.quick else (8, 128, 1000, 4000, 16000)
        for L in seq_lens:
            row("tracker", 256, 1, str(L), _tracker_case(w, 256, 1, L, repeat))
        print()
        print("columns: publish_columns (numpy columns, what an engine with array state calls);")
        print("deltas: publish(list[RequestDelta]); tracker: DeltaTracker.sync (diff + publish).")
    finally:
        w.close()
        os.unlink(path)
        os.rmdir(d)
    if not a.no_go:
        _go_consume()
    return 0


if __name__ == "__main__":
    sys.exit(main())
