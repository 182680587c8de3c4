"""Memory for the sleep-only baseline: pools whose virtual address range stays
reserved while their physical memory is released and later re-created, the way
vLLM's sleep mode (its CuMemAllocator) does it. The engine and its CUDA graphs
are built once on those addresses; sleeping unmaps and releases the physical
memory (weights and KV cache: level 1, weights kept in pinned host memory by the
caller), waking creates and maps fresh physical memory at the same addresses.

GPU: CUDA driver VMM calls through ctypes (cuMemAddressReserve / cuMemCreate /
cuMemMap / cuMemSetAccess / cuMemUnmap / cuMemRelease), on the calling thread's
current context. CPU: the same life cycle with mmap (PROT_NONE reservation,
MAP_FIXED anonymous memory on wake, dropped again on sleep) — a check of the
harness only.
"""

from __future__ import annotations

import ctypes
from typing import Any, Sequence

CUDA_SUCCESS = 0
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


# The driver declarations above, by their cuda.h names. vllmpatch/tests/
# test_sleep_memory.py checks every layout and value against the interceptor's
# interceptor/src/cuda_decls.h, which bench/gpu/check_decls.c checks against cuda.h.
CUDA_STRUCTS = {"CUmemLocation": _Location, "CUmemAllocationProp": _AllocProp, "CUmemAccessDesc": _AccessDesc}
CUDA_CONSTANTS = {name: globals()[name] for name in ("CUDA_SUCCESS", "CU_MEM_ALLOCATION_TYPE_PINNED",
                                                     "CU_MEM_LOCATION_TYPE_DEVICE", "CU_MEM_ACCESS_FLAGS_PROT_READWRITE",
                                                     "CU_MEM_ALLOC_GRANULARITY_MINIMUM")}


class SleepMemoryError(RuntimeError):
    pass


class SleepPools:
    """Pools for `specs` (objects with tag, index, size). reserve() once, wake(),
    then tensors() (built while mapped: wrapping an unmapped range may be refused);
    then sleep()/wake() any number of times. The tensors keep their addresses;
    their memory exists, zero-filled on the CPU, undefined on the GPU, only while awake."""

    def reserve(self) -> None:
        raise NotImplementedError

    def tensors(self) -> dict[tuple[str, int], Any]:
        raise NotImplementedError

    def wake(self) -> None:
        raise NotImplementedError

    def sleep(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class CudaSleepPools(SleepPools):
    def __init__(self, specs: Sequence[Any], device: int = 0, libcuda: str = "libcuda.so.1"):
        import torch

        torch.cuda.init()
        torch.cuda.set_device(device)
        torch.zeros(1, device=f"cuda:{device}")  # the primary context, current on this thread
        self._dev = device
        self._cu = ctypes.CDLL(libcuda)
        self._specs = [(str(s.tag), int(s.index), int(s.size)) for s in specs]
        self._va: dict[tuple[str, int], tuple[int, int]] = {}
        self._handles: dict[tuple[str, int], int] = {}
        prop = self._prop()
        gran = ctypes.c_size_t()
        self._check("cuMemGetAllocationGranularity",
                    self._cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop),
                                                           CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        self.granularity = gran.value

    def _prop(self) -> _AllocProp:
        p = _AllocProp()
        p.type = CU_MEM_ALLOCATION_TYPE_PINNED
        p.requestedHandleTypes = 0
        p.location = _Location(CU_MEM_LOCATION_TYPE_DEVICE, self._dev)
        return p

    def _check(self, call: str, rc: int) -> None:
        if rc != CUDA_SUCCESS:
            s = ctypes.c_char_p()
            self._cu.cuGetErrorString(rc, ctypes.byref(s))
            raise SleepMemoryError(f"{call} failed: {rc} {(s.value or b'').decode(errors='replace')}")

    def _rounded(self, size: int) -> int:
        g = self.granularity
        return (size + g - 1) // g * g

    def reserve(self) -> None:
        for tag, idx, size in self._specs:
            ptr = ctypes.c_ulonglong()
            rsize = self._rounded(size)
            self._check("cuMemAddressReserve", self._cu.cuMemAddressReserve(
                ctypes.byref(ptr), ctypes.c_size_t(rsize), ctypes.c_size_t(0), ctypes.c_ulonglong(0),
                ctypes.c_ulonglong(0)))
            self._va[(tag, idx)] = (ptr.value, rsize)

    def tensors(self):
        from frmps_engine.sdk.memory.cuda_vmm import cuda_tensor

        sizes = {(t, i): s for t, i, s in self._specs}
        return {k: cuda_tensor(va, sizes[k], self._dev) for k, (va, _) in self._va.items()}

    def wake(self) -> None:
        prop = self._prop()
        desc = _AccessDesc(_Location(CU_MEM_LOCATION_TYPE_DEVICE, self._dev), CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        for key, (va, size) in self._va.items():
            if key in self._handles:
                continue
            h = ctypes.c_ulonglong()
            self._check("cuMemCreate", self._cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(prop),
                                                            ctypes.c_ulonglong(0)))
            rc = self._cu.cuMemMap(ctypes.c_ulonglong(va), ctypes.c_size_t(size), ctypes.c_size_t(0), h,
                                   ctypes.c_ulonglong(0))
            if rc != CUDA_SUCCESS:
                self._cu.cuMemRelease(h)
                self._check("cuMemMap", rc)
            self._handles[key] = h.value
            self._check("cuMemSetAccess", self._cu.cuMemSetAccess(ctypes.c_ulonglong(va), ctypes.c_size_t(size),
                                                                  ctypes.byref(desc), ctypes.c_size_t(1)))

    def sleep(self) -> None:
        import torch

        torch.cuda.synchronize(self._dev)
        for key, h in list(self._handles.items()):
            va, size = self._va[key]
            self._check("cuMemUnmap", self._cu.cuMemUnmap(ctypes.c_ulonglong(va), ctypes.c_size_t(size)))
            self._check("cuMemRelease", self._cu.cuMemRelease(ctypes.c_ulonglong(h)))
            del self._handles[key]

    def close(self) -> None:
        self.sleep()
        for va, size in self._va.values():
            self._cu.cuMemAddressFree(ctypes.c_ulonglong(va), ctypes.c_size_t(size))
        self._va.clear()


class HostSleepPools(SleepPools):
    """CPU analog: a PROT_NONE reservation; wake maps fresh zero pages in place, sleep drops them."""

    def __init__(self, specs: Sequence[Any]):
        self._specs = [(str(s.tag), int(s.index), int(s.size)) for s in specs]
        self._va: dict[tuple[str, int], tuple[int, int]] = {}
        self.awake = False

    def reserve(self) -> None:
        from frmps_engine.sdk.memory import _libc

        for tag, idx, size in self._specs:
            addr = _libc.mmap(0, size, _libc.PROT_NONE, _libc.MAP_PRIVATE | _libc.MAP_ANONYMOUS | _libc.MAP_NORESERVE, -1)
            self._va[(tag, idx)] = (addr, size)

    def tensors(self):
        from frmps_engine.sdk.memory.host_shm import _tensor_at

        return {k: _tensor_at(addr, size) for k, (addr, size) in self._va.items()}

    def wake(self) -> None:
        from frmps_engine.sdk.memory import _libc

        for addr, size in self._va.values():
            _libc.mmap(addr, size, _libc.PROT_READ | _libc.PROT_WRITE,
                       _libc.MAP_PRIVATE | _libc.MAP_ANONYMOUS | _libc.MAP_FIXED, -1)
        self.awake = True

    def sleep(self) -> None:
        from frmps_engine.sdk.memory import _libc

        for addr, size in self._va.values():
            _libc.mmap(addr, size, _libc.PROT_NONE,
                       _libc.MAP_PRIVATE | _libc.MAP_ANONYMOUS | _libc.MAP_FIXED | _libc.MAP_NORESERVE, -1)
        self.awake = False

    def close(self) -> None:
        from frmps_engine.sdk.memory import _libc

        for addr, size in self._va.values():
            _libc.munmap(addr, size)
        self._va.clear()


def make_sleep_pools(specs: Sequence[Any], device: str) -> SleepPools:
    if device == "cpu":
        return HostSleepPools(specs)
    from frmps_engine.sdk.memory.cuda_vmm import parse_device

    return CudaSleepPools(specs, parse_device(device))
