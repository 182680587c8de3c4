"""The memory-backend interface shared by host-shm and cuda-vmm."""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence


class MemoryError_(Exception):
    """A pool could not be created, mapped or changed (name avoids the builtin MemoryError)."""


class SizeMismatch(MemoryError_):
    """The brokered pools do not match the layout this engine derived; the engine must not start."""


@dataclass(frozen=True)
class PoolSpec:
    """One pool of the layout: tag ("weights" | "kv_cache"), index within the tag, size in bytes."""

    tag: str
    index: int
    size: int

    @property
    def key(self) -> tuple[str, int]:
        return (self.tag, self.index)


@dataclass
class Pool:
    spec: PoolSpec
    tensor: Any  # torch.Tensor, uint8, 1-D, spec.size bytes
    fd: int = -1  # exportable handle owned by the backend (-1: none)
    address: int = 0
    readonly: bool = False
    extra: dict = field(default_factory=dict)


def as_spec(obj: Any) -> PoolSpec:
    """Accept our PoolSpec, an engine's own PoolSpec-like object, or a control_pb2.Pool."""
    return PoolSpec(str(obj.tag), int(obj.index), int(obj.size))


def check_specs_match(want: Sequence[Any], got: Sequence[Any]) -> None:
    """Raise SizeMismatch listing every difference between two layouts (order matters)."""
    want_s = [as_spec(s) for s in want]
    got_s = [as_spec(s) for s in got]
    problems: list[str] = []
    if len(want_s) != len(got_s):
        problems.append(f"engine expects {len(want_s)} pools, got {len(got_s)}")
    for i, (w, g) in enumerate(zip(want_s, got_s)):
        if w != g:
            problems.append(f"pool {i}: engine expects {w.tag}[{w.index}] {w.size} bytes, got {g.tag}[{g.index}] {g.size} bytes")
    if problems:
        raise SizeMismatch("pool layout mismatch: " + "; ".join(problems))


def checked_map_args(
    specs: Sequence[Any],
    fds: Sequence[int],
    *,
    reserved: Mapping[tuple[str, int], "Pool"],
    mapped: Mapping[tuple[str, int], "Pool"],
    check_spec: Callable[[PoolSpec], None],
    fd_problem: Callable[[PoolSpec, int], str | None] | None = None,
) -> tuple[list[PoolSpec], list[int]]:
    """The checks every backend's ``map`` makes before touching memory: one fd
    per pool, valid specs, sizes that agree with the standby's reservation, no
    pool mapped twice, plus the backend's own per-fd check. Raises SizeMismatch
    listing every problem, after closing all the fds (map owns them)."""
    specs_l = [as_spec(s) for s in specs]
    fds_l = list(fds)
    try:
        if len(specs_l) != len(fds_l):
            raise SizeMismatch(f"map: {len(specs_l)} pools but {len(fds_l)} fds")
        problems: list[str] = []
        seen: set[tuple[str, int]] = set()
        for s, fd in zip(specs_l, fds_l):
            check_spec(s)
            if fd_problem is not None and (why := fd_problem(s, fd)):
                problems.append(why)
            r = reserved.get(s.key)
            if r is not None and r.spec.size != s.size:
                problems.append(f"{s.tag}[{s.index}]: reserved {r.spec.size} bytes, brokered {s.size}")
            if s.key in mapped or s.key in seen:
                problems.append(f"{s.tag}[{s.index}]: already mapped")
            seen.add(s.key)
        if problems:
            raise SizeMismatch("pool size mismatch: " + "; ".join(problems))
    except BaseException:
        for fd in fds_l:
            os.close(fd)
        raise
    return specs_l, fds_l


class MemoryBackend(abc.ABC):
    """Creates, exports and maps the shared pools.

    Active: ``allocate(specs)`` creates fresh pools (writable) whose ``fd`` the
    engine exports to the supervisor. Standby: ``reserve(specs)`` gives
    placeholder pools at fixed addresses so the engine can be built before it
    has the shared memory (backed by private, untouched memory), then
    ``map(specs, fds, readonly=True)`` maps the brokered handles *in place*
    (same addresses, so tensors built on the reservation stay valid), and
    ``make_writable("kv_cache")`` flips the KV pools on takeover; ``make_readonly``
    flips them back when an active hands over and sleeps.
    """

    name: str = ""

    @abc.abstractmethod
    def allocate(self, specs: Sequence[PoolSpec]) -> list[Pool]: ...

    @abc.abstractmethod
    def reserve(self, specs: Sequence[PoolSpec]) -> list[Pool]: ...

    @abc.abstractmethod
    def map(self, specs: Sequence[PoolSpec], fds: Sequence[int], readonly: bool) -> list[Pool]:
        """Map brokered fds (the backend takes ownership of ``fds`` and closes them on close())."""

    @abc.abstractmethod
    def pools(self) -> list[Pool]:
        """The pools allocated or mapped so far (not the reservations)."""

    @abc.abstractmethod
    def _set_access(self, pool: Pool, readonly: bool) -> None:
        """Make one pool read-only or read-write (the backend's own call)."""

    def make_writable(self, tag: str) -> None:
        """Flip every mapped pool of ``tag`` to read-write (a standby's wake)."""
        self._flip(tag, readonly=False, what="make_writable")

    def make_readonly(self, tag: str) -> None:
        """Flip every pool of ``tag`` to read-only (an active handing over: it is a
        standby afterwards, and a standby never writes the shared memory)."""
        self._flip(tag, readonly=True, what="make_readonly")

    def _flip(self, tag: str, readonly: bool, what: str) -> None:
        found = False
        for pool in self.pools():
            if pool.spec.tag != tag:
                continue
            found = True
            if pool.readonly != readonly:
                self._set_access(pool, readonly)
                pool.readonly = readonly
        if not found:
            raise MemoryError_(f"{what}: no mapped pool has tag {tag!r}")

    @abc.abstractmethod
    def close(self) -> None:
        """Unmap and close everything. Tensors of this backend's pools must not be used afterwards."""
