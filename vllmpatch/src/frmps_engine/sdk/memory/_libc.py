"""mmap/mprotect/munmap through libc: Python's mmap module cannot map at a fixed
address (MAP_FIXED), which the in-place remap of a reserved range needs."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap as _mmap
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.restype = ctypes.c_int
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

PROT_READ = _mmap.PROT_READ
PROT_WRITE = _mmap.PROT_WRITE
PROT_NONE = 0
MAP_SHARED = _mmap.MAP_SHARED
MAP_PRIVATE = _mmap.MAP_PRIVATE
MAP_ANONYMOUS = _mmap.MAP_ANONYMOUS
MAP_FIXED = 0x10
MAP_NORESERVE = getattr(_mmap, "MAP_NORESERVE", 0x4000)
_MAP_FAILED = ctypes.c_void_p(-1).value


def _err(what: str) -> OSError:
    e = ctypes.get_errno()
    return OSError(e, f"{what}: {os.strerror(e)}")


def mmap(addr: int, length: int, prot: int, flags: int, fd: int, offset: int = 0) -> int:
    p = _libc.mmap(addr or None, length, prot, flags, fd, offset)
    if p is None or p == _MAP_FAILED:
        raise _err("mmap")
    return int(p)


def munmap(addr: int, length: int) -> None:
    if _libc.munmap(addr, length) != 0:
        raise _err("munmap")


def mprotect(addr: int, length: int, prot: int) -> None:
    if _libc.mprotect(addr, length, prot) != 0:
        raise _err("mprotect")
