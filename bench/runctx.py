"""What every experiment runs in: its context (options, results, cleanup), the
time budget, progress lines, and the error a failed trial raises. Standard
library only.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from .procs import Cleanup
from .results import ResultFile, key_id


# The fault kinds of the GPU soaks (bench/gpu/failback_proof.py): every bench/faults trigger
# whose fault reaches the other clients of an MPS server. `--fault all` takes them in turn.
FAULT_KINDS = ["misaligned:load", "illegal_instruction:jump-far", "shared_oob:shared", "shared_oob:local",
               "invalid_address_space:ld-global-shared", "stack_overflow:recursion", "oob_write:write"]


def fault_kinds(spec: str) -> list[str]:
    """--fault's triggers, in order: a comma-separated list of <program>:<variant>, or 'all'. A
    program without a variant is its default one, named as in FAULT_KINDS ("shared_oob" ->
    "shared_oob:shared"), so that trials of one kind group together however it was given."""
    kinds = [k.strip() for k in spec.split(",") if k.strip()]
    if kinds == ["all"]:
        return list(FAULT_KINDS)
    if not kinds or "all" in kinds:
        raise ValueError(f"--fault {spec!r}: give <program>:<variant>[,...] or 'all'")
    default = {}
    for k in FAULT_KINDS:
        default.setdefault(k.partition(":")[0], k)
    return [default.get(k, k) if ":" not in k else k for k in kinds]


def fmt_dur(s: float) -> str:
    s = max(0, int(round(s)))
    return f"{s // 60}:{s % 60:02d}"


def fmt_s(v: float | None) -> str:
    """Seconds for a progress line: ms below 10 s."""
    if v is None:
        return "-"
    return f"{v * 1e3:.1f} ms" if abs(v) < 10 else f"{v:.1f} s"


class Progress:
    """Progress lines on stderr: ``[recovery 3/30 0:42 left ~5:10] message``."""

    def __init__(self, experiment: str, total: int, stream=None):
        self.experiment = experiment
        self.total = total
        self.done = 0
        self.t0 = time.monotonic()
        self.stream = stream or sys.stderr
        self._durations: list[float] = []

    def point_done(self, elapsed: float) -> None:
        self.done += 1
        self._durations.append(elapsed)

    def eta(self) -> float | None:
        if not self._durations:
            return None
        return statistics.fmean(self._durations) * max(0, self.total - self.done)

    def __call__(self, msg: str) -> None:
        el = time.monotonic() - self.t0
        eta = self.eta()
        left = f" left ~{fmt_dur(eta)}" if eta is not None else ""
        print(f"[{self.experiment} {self.done}/{self.total} {fmt_dur(el)}{left}] {msg}", file=self.stream, flush=True)


class BudgetExhausted(Exception):
    pass


class Budget:
    """Stop before starting work that would not fit in the run's wall time.
    ``allows(estimate)`` is asked before each point and each setup; 0 = no limit."""

    def __init__(self, seconds: float):
        self.seconds = float(seconds or 0)
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def remaining(self) -> float:
        return float("inf") if not self.seconds else self.seconds - self.elapsed()

    def check(self, estimate_s: float, what: str) -> None:
        if self.seconds and self.elapsed() + max(0.0, estimate_s) > self.seconds:
            raise BudgetExhausted(f"time budget: {what} (~{estimate_s:.0f} s) does not fit in the "
                                  f"{self.remaining():.0f} s left of --budget {self.seconds:.0f}")


# ----------------------------------------------------------------------------- context


@dataclass
class Ctx:
    """What every experiment gets: options, where results go, budget, progress."""

    args: Any
    out_dir: str
    run_id: str
    budget: Budget
    results: ResultFile
    progress: Progress | None = None
    cleanup: Cleanup | None = None
    fault: str = ""  # the trigger of the point being measured (run_point sets it from --fault and the trial)

    def fault_for(self, key: dict) -> str:
        """The trigger of a point: with several --fault kinds, trial t takes the (t mod n)-th."""
        kinds = fault_kinds(self.args.fault)
        return kinds[int(key.get("trial", 0) or 0) % len(kinds)]

    @property
    def cpu(self) -> bool:
        return self.args.device == "cpu"

    def log(self, msg: str) -> None:
        if self.progress is not None:
            self.progress(msg)
        else:
            print(f"[{self.results.experiment}] {msg}", file=sys.stderr, flush=True)

    def run_point(self, key: dict, fn: Callable[[], dict], estimate_s: float = 0.0,
                  describe: Callable[[dict], str] | None = None) -> dict | None:
        """Measure one point unless it is done; record its data or its error at once."""
        if self.results.status(key) not in ("pending", "unsupported"):
            return None
        self.budget.check(estimate_s, f"point {key_id(key)}")
        self.fault = self.fault_for(key)
        t0 = time.monotonic()
        data, err = None, None
        try:
            data = fn()
        except BudgetExhausted:
            raise
        except Exception as e:  # one failed point must not stop the sweep
            err = f"{type(e).__name__}: {e}"
            data = getattr(e, "partial", None)
        if isinstance(data, dict) and data.get("inject"):
            data.setdefault("fault", self.fault if self.args.mps else "SIGKILL")
        el = time.monotonic() - t0
        rec = self.results.add(key, data, err, el)
        if self.progress is not None:
            self.progress.point_done(el)
        what = " ".join(f"{v}" for v in key.values())
        if err:
            self.log(f"{what}: FAILED ({err[:300]})")
        else:
            self.log(f"{what}: {describe(data) if describe else 'ok'}")
        return rec

    def fail_points(self, keys: list[dict], error: str) -> None:
        """A setup shared by these points failed: record the failure on each."""
        for k in keys:
            if self.results.status(k) in ("pending", "unsupported"):
                self.results.add(k, None, error, 0.0)
                if self.progress is not None:
                    self.progress.point_done(0.0)
        self.log(f"{len(keys)} point(s) failed: {error[:300]}")

    def unsupported(self, keys: list[dict], why: str) -> None:
        """The engine cannot run these points (a missing capability): recorded as such,
        not as failures; a later run checks again."""
        for k in keys:
            self.results.add(k, None, f"unsupported: {why}", 0.0, unsupported=True)
            if self.progress is not None:
                self.progress.point_done(0.0)
        self.log(f"{len(keys)} point(s) not measured: unsupported: {why}")


class TrialError(Exception):
    """A trial failed; ``partial`` holds what was measured before the failure."""

    def __init__(self, msg: str, partial: dict | None = None):
        super().__init__(msg)
        self.partial = partial
