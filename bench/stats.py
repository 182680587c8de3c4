"""Small statistics shared by the trials and the reports."""

from __future__ import annotations

import statistics
from typing import Iterable


def med(xs: Iterable[float | None]) -> float | None:
    """The median of the values that are not None (None if there are none)."""
    v = [float(x) for x in xs if x is not None]
    return statistics.median(v) if v else None


def gaps(times: list[float]) -> list[float]:
    """Differences between consecutive times."""
    return [b - a for a, b in zip(times, times[1:])]
