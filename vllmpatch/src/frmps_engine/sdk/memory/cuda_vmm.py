"""cuda-vmm: pools as CUDA VMM allocations with POSIX-fd handles, through the
interceptor library (libfrmps_vmm.so).

Only the interface and the library loading live here. The real wiring (the
C functions below, mapping into the engine's VA ranges, torch tensors over
device memory) belongs to the GPU issue. Until then every operation raises
a clear error rather than pretending to work.

Functions expected from libfrmps_vmm.so (all return 0 or a CUresult / -errno):
  int frmps_vmm_create(int device, uint64_t size, uint64_t *handle);
  int frmps_vmm_export(uint64_t handle, int *fd);
  int frmps_vmm_import(int fd, uint64_t *handle);
  int frmps_vmm_map(uint64_t handle, uint64_t size, uint64_t *va);   /* reserve VA + map */
  int frmps_vmm_set_access(uint64_t va, uint64_t size, int device, int writable);
"""

from __future__ import annotations

import ctypes
import os
from typing import Sequence

from .base import MemoryBackend, MemoryError_, Pool, PoolSpec

BACKEND_NAME = "cuda-vmm"
LIBRARY_ENV = "FRMPS_VMM_LIBRARY"
_FUNCTIONS = ("frmps_vmm_create", "frmps_vmm_export", "frmps_vmm_import", "frmps_vmm_map", "frmps_vmm_set_access")


class VmmUnavailable(MemoryError_):
    pass


def load_library(path: str | None = None) -> ctypes.CDLL:
    """Load the interceptor library and check it has every function the backend needs."""
    path = path or os.environ.get(LIBRARY_ENV) or "libfrmps_vmm.so"
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise VmmUnavailable(f"cuda-vmm backend needs libfrmps_vmm.so and a GPU: cannot load {path}: {e}") from e
    missing = [f for f in _FUNCTIONS if not hasattr(lib, f)]
    if missing:
        raise VmmUnavailable(f"cuda-vmm backend: {path} lacks {', '.join(missing)}")
    return lib


class CudaVmmBackend(MemoryBackend):
    name = BACKEND_NAME

    def __init__(self, device: str = "cuda", library: str | None = None):
        if not device.startswith("cuda"):
            raise VmmUnavailable(f"cuda-vmm backend needs a GPU device, got --device {device}")
        self._lib = load_library(library)
        self._device = device

    def _not_wired(self, what: str):
        return VmmUnavailable(
            f"cuda-vmm backend: {what} is not wired yet (the GPU issue connects libfrmps_vmm.so to torch tensors); use --memory host-shm"
        )

    def allocate(self, specs: Sequence[PoolSpec]) -> list[Pool]:
        raise self._not_wired("allocate")

    def reserve(self, specs: Sequence[PoolSpec]) -> list[Pool]:
        raise self._not_wired("reserve")

    def map(self, specs: Sequence[PoolSpec], fds: Sequence[int], readonly: bool) -> list[Pool]:
        for fd in fds:
            os.close(fd)
        raise self._not_wired("map")

    def make_writable(self, tag: str) -> None:
        raise self._not_wired("make_writable")

    def close(self) -> None:
        pass
