"""Prompt and output lengths of the outage experiment's request stream: a
seeded, ShareGPT-like distribution (no dataset is downloaded).

Each length is a lognormal draw, rounded and clipped to [lo, hi]. The
lognormal's mean is the ShareGPT figure the vLLM paper reports (Kwon et al.,
SOSP 2023, Fig. 11: 161 prompt and 338 output tokens on average); its spread
(sigma of log length: 1.0 for prompts, 0.8 for outputs, heavy right tails) and
the clip bounds are this bench's choice, not fitted to the dataset. bench/
README.md lists the parameters and the resulting moments (``table_rows``);
vllmpatch/tests/test_bench.py checks the generator against them. Standard
library only.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


@dataclass(frozen=True)
class LogNormalLengths:
    """round(X) clipped to [lo, hi], X lognormal with mean ``mean`` and log-sd ``sigma``."""

    mean: float  # of the lognormal before clipping
    sigma: float
    lo: int
    hi: int

    def __post_init__(self):
        if not (self.mean > 0 and self.sigma > 0 and 1 <= self.lo <= self.hi):
            raise ValueError(f"bad length distribution {self}")

    @property
    def mu(self) -> float:
        return math.log(self.mean) - self.sigma ** 2 / 2

    def sample(self, rng: random.Random) -> int:
        return min(self.hi, max(self.lo, round(rng.lognormvariate(self.mu, self.sigma))))

    def moments(self) -> tuple[float, float]:
        """Mean and standard deviation of the clipped lognormal (before rounding, which
        moves the mean by less than 0.5 and adds 1/12 to the variance)."""
        mu, s, a, b = self.mu, self.sigma, float(self.lo), float(self.hi)
        la, lb = math.log(a), math.log(b)
        p_lo, p_hi = _phi((la - mu) / s), 1.0 - _phi((lb - mu) / s)

        def partial(k: int) -> float:  # E[X^k; a <= X <= b]
            return math.exp(k * mu + k * k * s * s / 2) * (_phi((lb - mu - k * s * s) / s) - _phi((la - mu - k * s * s) / s))

        m1 = a * p_lo + b * p_hi + partial(1)
        m2 = a * a * p_lo + b * b * p_hi + partial(2)
        return m1, math.sqrt(max(0.0, m2 - m1 * m1))

    def scaled(self, f: float) -> "LogNormalLengths":
        """The same shape with every length times f (the CPU check's short requests)."""
        return replace(self, mean=self.mean * f, lo=max(1, round(self.lo * f)), hi=max(1, round(self.hi * f)))


@dataclass(frozen=True)
class UniformLengths:
    lo: int
    hi: int

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    def moments(self) -> tuple[float, float]:
        n = self.hi - self.lo + 1
        return (self.lo + self.hi) / 2, math.sqrt((n * n - 1) / 12)


SHAREGPT_PROMPT = LogNormalLengths(mean=161.0, sigma=1.0, lo=4, hi=1024)
SHAREGPT_OUTPUT = LogNormalLengths(mean=338.0, sigma=0.8, lo=4, hi=1024)


class RequestLengths:
    """(prompt length, output length) of each request of each client, from a seed:
    client i's sequence depends on (seed, i) only, so a run's requests do not depend
    on how fast each client went."""

    def __init__(self, prompt, output, seed: int):
        self.prompt, self.output, self.seed = prompt, output, int(seed)

    def client(self, i: int) -> "ClientLengths":
        return ClientLengths(self, random.Random(self.seed * 1_000_003 + i))


class ClientLengths:
    def __init__(self, dist: RequestLengths, rng: random.Random):
        self.dist, self.rng = dist, rng

    def next(self) -> tuple[int, int, int]:
        """(prompt length, output length, a seed for the prompt's token ids)."""
        return self.dist.prompt.sample(self.rng), self.dist.output.sample(self.rng), self.rng.randrange(1 << 30)


def sharegpt(scale: float = 1.0) -> tuple[LogNormalLengths, LogNormalLengths]:
    if scale == 1.0:
        return SHAREGPT_PROMPT, SHAREGPT_OUTPUT
    return SHAREGPT_PROMPT.scaled(scale), SHAREGPT_OUTPUT.scaled(scale)


def describe(d) -> dict:
    m, s = d.moments()
    if isinstance(d, LogNormalLengths):
        return {"kind": "lognormal", "mean_unclipped": round(d.mean, 2), "sigma_log": d.sigma, "lo": d.lo, "hi": d.hi,
                "mean": round(m, 1), "std": round(s, 1)}
    return {"kind": "uniform", "lo": d.lo, "hi": d.hi, "mean": round(m, 1), "std": round(s, 1)}


def table_rows() -> list[str]:
    """The README's rows for the ShareGPT-like distribution (checked by a test)."""
    rows = []
    for name, d in (("prompt", SHAREGPT_PROMPT), ("output", SHAREGPT_OUTPUT)):
        m, s = d.moments()
        rows.append(f"| {name} | lognormal, mean {d.mean:g} before clipping, σ(log) {d.sigma:g} | "
                    f"[{d.lo}, {d.hi}] | {m:.1f} | {s:.1f} |")
    return rows
