"""Explicit per-request seeds.

vLLM's V2 model runner draws each sample from (seed, position), and picks a
random seed for a request that has none (vllm/v1/worker/gpu/sample/states.py:54-58),
which a standby could never reproduce. So every request gets an explicit seed
before it reaches vLLM, and the seed is published to the ring with the request.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1
# V2 keeps seeds in an int64 tensor; stay non-negative and inside it.
SEED_LIMIT = 1 << 63


def derive_seed(key: int) -> int:
    """A seed for request ``key`` (splitmix64 of the key), in [0, 2**63).

    Deterministic, so a request whose seed never reached the ring (it died
    before the first sync) still gets the same seed on the standby.
    """
    z = (int(key) + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z % SEED_LIMIT


def resolve_seed(key: int, seed: int | None) -> int:
    """The seed to use: the caller's, checked, or one derived from the key."""
    if seed is None:
        return derive_seed(key)
    seed = int(seed)
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed {seed} out of range: must be in [0, 2**63)")
    return seed
