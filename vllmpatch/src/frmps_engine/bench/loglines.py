"""Engine log lines that harnesses read (standard library only): the patterns match
what sdk/runner.py and sdk/loop.py log, in one place for `frmps bench` and the
GPU failover proof (bench/gpu/failover_proof.py)."""

from __future__ import annotations

import os
import re

# runner.on_resume; the adoption/ring-attach tail and the adoption's CPU time are optional (engine logs kept
# in older result folders lack them).
TAKEOVER = re.compile(r"took over (\d+) requests in ([\d.]+) ms \((\d+) reused tokens, (\d+) to prefill; "
                      r"KV writable in ([\d.]+) ms(?:; adoption ([\d.]+) ms, ring attach ([\d.]+) ms)?"
                      r"(?:; adoption CPU ([\d.]+) ms[^)]*)?\)")
FIRST = re.compile(r"first resumed token: key=\d+ index=\d+ at ([\d.]+)")
SLEEP = re.compile(r"mapped read-only \(map ([\d.]+) ms, ready (\d+) ms after start\)")
INIT = re.compile(r"standby built \(init (\d+) ms\)")
ALLOC = re.compile(r"torch allocator: ([\d.]+) MiB reserved, ([\d.]+) MiB allocated")


def grep_first(path: str | None, rx: re.Pattern) -> list[str] | None:
    """The groups of rx's first match in the file at path (None: no file or no match)."""
    if not path or not os.path.exists(path):
        return None
    with open(path, errors="replace") as f:
        for line in f:
            m = rx.search(line)
            if m:
                return list(m.groups())
    return None


def grep_last(path: str | None, rx: re.Pattern) -> list[str] | None:
    """The groups of rx's last match in the file at path (None: no file or no match):
    an engine that took over, went back to sleep (failback) and took over again
    logs one takeover per time."""
    if not path or not os.path.exists(path):
        return None
    last = None
    with open(path, errors="replace") as f:
        for line in f:
            m = rx.search(line)
            if m:
                last = list(m.groups())
    return last


def first_time_after(path: str | None, rx: re.Pattern, after: float) -> float | None:
    """The earliest time (rx's first group, unix seconds) at or after `after`."""
    if not path or not os.path.exists(path):
        return None
    with open(path, errors="replace") as f:
        ts = [float(m.group(1)) for m in map(rx.search, f) if m]
    ts = [t for t in ts if t >= after]
    return min(ts) if ts else None


def takeover_fields(groups: list[str]) -> dict:
    """TAKEOVER's groups as a record."""
    out = {"requests": int(groups[0]), "resume_ms": float(groups[1]), "reused_tokens": int(groups[2]),
           "prefilled_tokens": int(groups[3]), "kv_writable_ms": float(groups[4])}
    if groups[5] is not None:
        out.update(adoption_ms=float(groups[5]), ring_attach_ms=float(groups[6]))
    if groups[7] is not None:
        out.update(adoption_cpu_ms=float(groups[7]))
    return out
