"""Diagnostics: an engine's GPU memory at the phases of its start
(``FRMPS_DEBUG_MEMORY_PHASES=1``; off by default, and then free).

A standby holds memory beyond a bare CUDA context that neither torch's allocator
nor vLLM's CUDA graphs nor the driver's per-thread stack account for. With this set, the engine logs
one line per phase — engine start, model constructed and weights initialised (vLLM),
weights placed, KV cache placed (vLLM), engine built, takeover warmed (standby),
asleep (standby) — with what NVML reports for this
process (every byte the driver holds for it: context, loaded kernels, library
workspaces, allocations) and torch's reserved and allocated bytes, so the phase that
adds the unexplained memory shows as a difference between two lines.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

log = logging.getLogger(__name__)

ENV = "FRMPS_DEBUG_MEMORY_PHASES"
NVML_ENV = "FRMPS_LIBNVML"
# NVML_VALUE_NOT_AVAILABLE: what NVML may report for a process it cannot account (e.g. an MPS client).
NOT_AVAILABLE = 2**64 - 1


def enabled(env: dict[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(ENV, "") not in ("", "0")


class _ProcessInfo(ctypes.Structure):
    # nvmlProcessInfo_t (the v2/v3 layout): pid, usedGpuMemory, gpuInstanceId, computeInstanceId
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong), ("gpuInstanceId", ctypes.c_uint),
                ("computeInstanceId", ctypes.c_uint)]


class ProcessMemory:
    """This process's GPU memory as NVML reports it, summed over the GPUs it uses.
    ``nvml`` is the library (a ctypes CDLL, or a test double with the same functions)."""

    def __init__(self, nvml: Any = None):
        self._nvml = nvml if nvml is not None else ctypes.CDLL(os.environ.get(NVML_ENV) or "libnvidia-ml.so.1")
        rc = self._nvml.nvmlInit_v2()
        if rc != 0:
            raise RuntimeError(f"nvmlInit_v2: NVML return {rc}")

    def used_bytes(self, pid: int) -> int | None:
        """Bytes NVML counts for ``pid`` on every GPU; None if it lists it on none, or
        only without a figure."""
        n = ctypes.c_uint()
        if self._nvml.nvmlDeviceGetCount_v2(ctypes.byref(n)) != 0:
            return None
        total, seen = 0, False
        for i in range(n.value):
            dev = ctypes.c_void_p()
            if self._nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(dev)) != 0:
                continue
            for info in self._processes(dev):
                if info.pid == pid and info.usedGpuMemory != NOT_AVAILABLE:
                    total, seen = total + int(info.usedGpuMemory), True
        return total if seen else None

    def _processes(self, dev: ctypes.c_void_p) -> list[_ProcessInfo]:
        count = ctypes.c_uint(0)
        for _ in range(4):  # the list may grow between the two calls
            infos = (_ProcessInfo * max(count.value, 1))()
            rc = self._nvml.nvmlDeviceGetComputeRunningProcesses_v3(dev, ctypes.byref(count), infos)
            if rc == 0:
                return list(infos[: count.value])
            if rc != 7:  # NVML_ERROR_INSUFFICIENT_SIZE: count holds what is needed now
                return []
            count = ctypes.c_uint(count.value + 8)
        return []


_reader: ProcessMemory | None = None
_reader_error = ""


def _torch_note() -> str:
    try:
        import torch

        if not torch.cuda.is_initialized():
            return "torch: CUDA not initialised"
        return (f"torch {torch.cuda.memory_reserved() / 2**20:.1f} MiB reserved, "
                f"{torch.cuda.memory_allocated() / 2**20:.1f} MiB allocated")
    except Exception as e:  # noqa: BLE001 - a diagnostic line
        return f"torch: unknown ({e})"


def measure(pid: int | None = None, reader: ProcessMemory | None = None) -> str:
    """'NVML <MiB> MiB for this process; torch …' (what the phase line says)."""
    global _reader, _reader_error
    if reader is None:
        if _reader is None and not _reader_error:
            try:
                _reader = ProcessMemory()
            except Exception as e:  # noqa: BLE001
                _reader_error = str(e)
        reader = _reader
    if reader is None:
        nv = f"NVML: unavailable ({_reader_error})"
    else:
        used = reader.used_bytes(os.getpid() if pid is None else pid)
        nv = "NVML: no GPU memory for this process" if used is None else f"NVML {used / 2**20:.0f} MiB for this process"
    return f"{nv}; {_torch_note()}"


def note(phase: str) -> None:
    """Log the memory at ``phase`` when FRMPS_DEBUG_MEMORY_PHASES is set; nothing otherwise."""
    if enabled():
        log.info("memory at %s: %s", phase, measure())
