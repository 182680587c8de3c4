"""How long the engine's step in progress has run, and how long it should take.

The engine loop times every serving step (``begin`` / ``end``, on the loop
thread). The heartbeat thread reads ``progress`` without a lock: the loop
thread replaces whole attributes (an int, a float), which other threads read
atomically. The supervisor fails over when a step's age passes its bound,
``max(min, factor × expected)``; the engine supplies ``expected``.

The estimate for a step of n tokens errs long. Small steps (decodes) cost mostly a
fixed amount, large ones (prefill chunks) mostly per token, so two scales are kept:

- the slowest of the last ``window`` steps, ``max t_i``: no step is expected to be
  faster than that (a decode right after a long prefill is given the prefill's time);
- a per-token cost. For a step of at least ``large_tokens`` tokens it is the highest
  ``t_i / n_i`` of the last ``large_window`` such steps however long ago (a cost
  measured on steps of that kind); for a smaller step, or before any large step was
  measured, the highest ``t_i / n_i`` of the recent steps, which overstates a large
  step's cost by the small steps' fixed part.

Prefill cost grows faster than linearly with the context (attention), so a step more
than ``max_scale`` times larger than the steps its per-token cost comes from, and
larger than ``small_step_tokens``, gets no estimate: the supervisor then applies its
generous default bound. So do the first ``min_samples`` serving steps (first-use
costs, compiles), and every step of a core that does not say how many tokens it
computes.
"""

from __future__ import annotations

import collections
import time
from typing import Callable


class StepTimer:
    def __init__(
        self,
        *,
        window: int = 64,
        large_window: int = 16,
        large_tokens: int = 64,
        min_samples: int = 4,
        max_scale: float = 4.0,
        small_step_tokens: int = 512,
        clock: Callable[[], int] = time.monotonic_ns,
    ):
        self._clock = clock
        self._min_samples = min_samples
        self._max_scale = max_scale
        self._small = small_step_tokens
        self._large = large_tokens
        self._t: collections.deque[int] = collections.deque(maxlen=window)
        self._rate: collections.deque[float] = collections.deque(maxlen=window)
        self._n: collections.deque[int] = collections.deque(maxlen=window)
        self._large_rate: collections.deque[float] = collections.deque(maxlen=large_window)
        self._large_n: collections.deque[int] = collections.deque(maxlen=large_window)
        self.measured = 0
        # Read by other threads: each replaced whole, never mutated.
        self._started = 0  # monotonic ns of the step in progress; 0 between steps
        self._max_t = 0
        self._max_rate = 0.0
        self._max_n = 0
        self._max_large_rate = 0.0
        self._max_large_n = 0
        self._known = False

    # -- the loop thread --------------------------------------------------------------
    def begin(self) -> None:
        self._started = self._clock() or 1

    def end(self, tokens: int | None) -> None:
        """The step is over; it computed ``tokens`` tokens (None: not a step to learn
        from, e.g. an idle device check, or a core that does not say)."""
        started, self._started = self._started, 0
        if not started or not tokens or tokens <= 0:
            return
        took = max(1, self._clock() - started)
        self._t.append(took)
        self._rate.append(took / tokens)
        self._n.append(tokens)
        if tokens >= self._large:
            self._large_rate.append(took / tokens)
            self._large_n.append(tokens)
            self._max_large_rate, self._max_large_n = max(self._large_rate), max(self._large_n)
        self.measured += 1
        self._max_t, self._max_rate, self._max_n = max(self._t), max(self._rate), max(self._n)
        self._known = self.measured >= self._min_samples

    # -- any thread ---------------------------------------------------------------------
    def expected_ns(self, tokens: int | None) -> int:
        """The estimate for a step of ``tokens`` tokens; 0 = none."""
        if not self._known or tokens is None or tokens < 0:
            return 0
        if tokens >= self._large and self._max_large_n:
            rate, measured = self._max_large_rate, self._max_large_n
        else:
            rate, measured = self._max_rate, self._max_n
        if tokens > max(self._max_scale * measured, self._small):
            return 0
        return int(max(self._max_t, tokens * rate))

    def progress(self, tokens: int | None) -> tuple[int, int]:
        """(age, expected) in ns of the step in progress, which computes ``tokens``
        tokens; (0, 0) between steps."""
        started = self._started
        if not started:
            return 0, 0
        return max(1, self._clock() - started), self.expected_ns(tokens)
