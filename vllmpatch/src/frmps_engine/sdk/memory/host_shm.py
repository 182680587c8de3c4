"""host-shm: pools are /dev/shm files shared by the active and standby engines (CPU path).

Each pool is created with O_EXCL and mode 0600 and unlinked at once, so only
file descriptors keep it alive: the active exports them, the supervisor holds
them, a standby maps them. Mappings go through libc mmap so a standby can
replace its reservation in place (MAP_FIXED) and map read-only for real:
a standby write to the shared pools faults instead of corrupting them.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
import stat
from typing import Sequence

from . import _libc
from .base import MemoryBackend, MemoryError_, Pool, PoolSpec, as_spec, checked_map_args

log = logging.getLogger(__name__)

BACKEND_NAME = "host-shm"


def _tensor_at(addr: int, size: int):
    """A uint8 tensor over [addr, addr+size).

    torch.frombuffer wants a writable buffer object, so it gets a ctypes array
    over the mapping; the mapping's protection (PROT_READ for a standby) is
    what actually enforces read-only, independent of the tensor.
    """
    import torch

    buf = (ctypes.c_ubyte * size).from_address(addr)
    return torch.frombuffer(buf, dtype=torch.uint8)


class HostShmBackend(MemoryBackend):
    name = BACKEND_NAME

    def __init__(self, shm_dir: str = "/dev/shm", preallocate: bool = True):
        self._dir = shm_dir
        # Preallocating turns "/dev/shm is full" into a clear error now instead of a SIGBUS later.
        self._preallocate = preallocate
        self._pools: dict[tuple[str, int], Pool] = {}
        self._reserved: dict[tuple[str, int], Pool] = {}

    # -- creation -----------------------------------------------------------
    def _create_fd(self, spec: PoolSpec) -> int:
        name = f"frmps-pool-{os.getpid()}-{spec.tag}-{spec.index}-{secrets.token_hex(6)}"
        try:
            path = os.path.join(self._dir, name)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            os.unlink(path)
        except FileNotFoundError:
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, spec.size)
            if self._preallocate:
                os.posix_fallocate(fd, 0, spec.size)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOSPC, errno.ENOMEM):
                raise MemoryError_(f"allocate pool {spec.tag}[{spec.index}] ({spec.size} bytes): not enough space in {self._dir}") from e
            raise MemoryError_(f"allocate pool {spec.tag}[{spec.index}]: {e}") from e
        return fd

    @staticmethod
    def _check_spec(spec: PoolSpec) -> None:
        if spec.size <= 0:
            raise MemoryError_(f"pool {spec.tag}[{spec.index}]: size must be > 0, got {spec.size}")

    def allocate(self, specs: Sequence[PoolSpec]) -> list[Pool]:
        out: list[Pool] = []
        try:
            for s in map(as_spec, specs):
                self._check_spec(s)
                if s.key in self._pools:
                    raise MemoryError_(f"allocate: pool {s.tag}[{s.index}] already exists")
                fd = self._create_fd(s)
                try:
                    addr = _libc.mmap(0, s.size, _libc.PROT_READ | _libc.PROT_WRITE, _libc.MAP_SHARED, fd)
                except OSError as e:
                    os.close(fd)
                    raise MemoryError_(f"map pool {s.tag}[{s.index}]: {e}") from e
                pool = Pool(s, _tensor_at(addr, s.size), fd=fd, address=addr)
                self._pools[s.key] = pool
                out.append(pool)
        except BaseException:
            self.close()
            raise
        return out

    def reserve(self, specs: Sequence[PoolSpec]) -> list[Pool]:
        out = []
        for s in map(as_spec, specs):
            self._check_spec(s)
            # Private, lazily backed and never shared: whatever a standby does
            # before Sleep (building, warm-up) lands here, not in the active's pools.
            addr = _libc.mmap(
                0, s.size, _libc.PROT_READ | _libc.PROT_WRITE,
                _libc.MAP_PRIVATE | _libc.MAP_ANONYMOUS | _libc.MAP_NORESERVE, -1,
            )
            pool = Pool(s, _tensor_at(addr, s.size), address=addr)
            self._reserved[s.key] = pool
            out.append(pool)
        return out

    # -- standby ------------------------------------------------------------
    def map(self, specs: Sequence[PoolSpec], fds: Sequence[int], readonly: bool) -> list[Pool]:
        def fd_problem(s: PoolSpec, fd: int) -> str | None:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return f"{s.tag}[{s.index}]: fd {fd} is not a shared-memory file"
            if st.st_size != s.size:
                return f"{s.tag}[{s.index}]: fd holds {st.st_size} bytes, layout says {s.size}"
            return None

        specs, fds = checked_map_args(specs, fds, reserved=self._reserved, mapped=self._pools,
                                      check_spec=self._check_spec, fd_problem=fd_problem)
        prot = _libc.PROT_READ if readonly else _libc.PROT_READ | _libc.PROT_WRITE
        out = []
        for i, (s, fd) in enumerate(zip(specs, fds)):
            r = self._reserved.pop(s.key, None)
            try:
                if r is not None:
                    # Same address: tensors (and anything built on them) now see the shared pool.
                    addr = _libc.mmap(r.address, s.size, prot, _libc.MAP_SHARED | _libc.MAP_FIXED, fd)
                    tensor = r.tensor
                else:
                    addr = _libc.mmap(0, s.size, prot, _libc.MAP_SHARED, fd)
                    tensor = _tensor_at(addr, s.size)
            except OSError as e:
                for f in fds[i:]:
                    os.close(f)
                raise MemoryError_(f"map pool {s.tag}[{s.index}]: {e}") from e
            pool = Pool(s, tensor, fd=fd, address=addr, readonly=readonly)
            self._pools[s.key] = pool
            out.append(pool)
        return out

    def _set_access(self, pool: Pool, readonly: bool) -> None:
        prot = _libc.PROT_READ if readonly else _libc.PROT_READ | _libc.PROT_WRITE
        _libc.mprotect(pool.address, pool.spec.size, prot)

    def pools(self) -> list[Pool]:
        return list(self._pools.values())

    def close(self) -> None:
        for pool in list(self._pools.values()) + list(self._reserved.values()):
            try:
                _libc.munmap(pool.address, pool.spec.size)
            except OSError as e:
                log.warning("unmap pool %s[%d]: %s", pool.spec.tag, pool.spec.index, e)
            if pool.fd >= 0:
                os.close(pool.fd)
                pool.fd = -1
        self._pools.clear()
        self._reserved.clear()
