"""The engine side's one seed rule.

A request's seed travels as uint64 (``SamplingParams.seed`` in control.proto,
and the ring's seed column); the front door maps a client's int64 ``seed`` to
uint64 by two's complement, so every client value stays distinct.

- A request without a seed gets ``derive_seed(key)``: a function of its ring
  key only, so a standby that adopts a request that never reached a ring sync
  samples it exactly like the active did. It lies in [0, 2**63), a value every
  engine can hold, signed (vLLM keeps seeds in int64 tensors) or not.
- An engine that keeps seeds as int64 uses ``to_int64`` of the wire value and
  publishes ``to_uint64`` of its own value back, so the round trip is exact
  for every wire seed, the client's or the derived one.
"""

from __future__ import annotations

_M64 = (1 << 64) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def splitmix64(x: int) -> int:
    """One step of splitmix64 (the reference engine's sampler keys use it too)."""
    x = (int(x) + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def derive_seed(key: int) -> int:
    """The seed of request ``key`` when its client gave none, in [0, 2**63)."""
    return splitmix64(int(key) & _M64) >> 1


def check_wire_seed(seed: int) -> int:
    seed = int(seed)
    if not 0 <= seed <= _M64:
        raise ValueError(f"seed {seed} is not a uint64")
    return seed


def resolve_seed(key: int, seed: int | None) -> int:
    """The wire (uint64) seed of a request: the client's, or derived from the key."""
    return derive_seed(key) if seed is None else check_wire_seed(seed)


def to_int64(seed: int) -> int:
    """The wire seed as the int64 an engine with signed seeds uses (two's complement)."""
    seed = check_wire_seed(seed)
    return seed - (1 << 64) if seed > INT64_MAX else seed


def to_uint64(seed: int) -> int:
    """An int64 (or uint64) engine seed back as the wire value."""
    seed = int(seed)
    if not INT64_MIN <= seed <= _M64:
        raise ValueError(f"seed {seed} is neither an int64 nor a uint64")
    return seed & _M64
