"""Early warning of a GPU fault for a sleeping standby: NVML's Xid events.

When a client of the MPS server faults, the driver reports an Xid (13, 31, 43, ...)
through NVML's event API before the MPS server has torn the faulted clients' contexts
down and before the supervisor sees the active die (H100, a private MPS daemon: 26-27
ms before a co-located client's CUDA call returned the error, once 282 ms). A standby
whose KV cache is mapped read-only (``FRMPS_STANDBY_KV=early``, the default) listens
for them while it sleeps and makes its KV mapping writable at once, so that the flip
(milliseconds for a large pool, more while the MPS server tears a context down) is
done before the Resume arrives. The standby still writes nothing before it is resumed:
the flip changes only its own mapping's access, and it runs no device work while
asleep. NVML's events carry no pid, so an Xid of any process on a watched GPU arms the
standby; if no Resume follows within the hold time, the runner makes the KV cache
read-only again (``runner.Runner._on_xid``).

``XidWatch`` is the listener: one thread blocked in ``nvmlEventSetWait_v2`` (ctypes
releases the GIL) with a short timeout so that ``close`` ends it promptly.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from typing import Any, Callable, Sequence

log = logging.getLogger(__name__)

NVML_ENV = "FRMPS_LIBNVML"
NVML_EVENT_TYPE_XID_CRITICAL_ERROR = 0x8
NVML_SUCCESS = 0
NVML_ERROR_TIMEOUT = 10


class _EventData(ctypes.Structure):
    # nvmlEventData_t
    _fields_ = [("device", ctypes.c_void_p), ("eventType", ctypes.c_ulonglong), ("eventData", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


class NvmlError(RuntimeError):
    pass


def nvml_uuid(uuid: str) -> str:
    """NVML names a GPU "GPU-<uuid>"; torch's device properties give the bare UUID."""
    uuid = str(uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def visible_gpu_uuids() -> list[str]:
    """The UUIDs of the GPUs this process's CUDA sees (torch), as NVML names them.
    NVML itself ignores CUDA_VISIBLE_DEVICES, so a GPU is named by its UUID."""
    import torch

    return [nvml_uuid(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


class XidWatch:
    """Calls ``on_xid(xid, perf_counter_ns)`` on its own thread for every Xid NVML
    reports on the GPUs ``uuids`` name. ``nvml``: the library (a ctypes CDLL, or a
    test double with the same functions). Raises NvmlError when NVML cannot watch."""

    def __init__(self, uuids: Sequence[str], on_xid: Callable[[int, int], None], nvml: Any = None,
                 poll_ms: int = 200):
        if not uuids:
            raise NvmlError("no GPU to watch")
        self._nvml = nvml if nvml is not None else ctypes.CDLL(os.environ.get(NVML_ENV) or "libnvidia-ml.so.1")
        self._on_xid = on_xid
        self._poll_ms = poll_ms
        self._stop = threading.Event()
        self._set = ctypes.c_void_p()
        self.uuids = list(uuids)
        self._check("nvmlInit_v2", self._nvml.nvmlInit_v2())
        try:
            self._check("nvmlEventSetCreate", self._nvml.nvmlEventSetCreate(ctypes.byref(self._set)))
            for u in self.uuids:
                dev = ctypes.c_void_p()
                self._check(f"nvmlDeviceGetHandleByUUID({u})",
                            self._nvml.nvmlDeviceGetHandleByUUID(u.encode(), ctypes.byref(dev)))
                self._check(f"nvmlDeviceRegisterEvents({u}, Xid)",
                            self._nvml.nvmlDeviceRegisterEvents(dev, ctypes.c_ulonglong(NVML_EVENT_TYPE_XID_CRITICAL_ERROR),
                                                                self._set))
        except NvmlError:
            self._release()
            raise
        self._thread = threading.Thread(target=self._run, name="frmps-xid-watch", daemon=True)
        self._thread.start()

    def _check(self, what: str, rc: int) -> None:
        if rc != NVML_SUCCESS:
            raise NvmlError(f"{what}: NVML return {rc}")

    def _run(self) -> None:
        data = _EventData()
        while not self._stop.is_set():
            rc = self._nvml.nvmlEventSetWait_v2(self._set, ctypes.byref(data), ctypes.c_uint(self._poll_ms))
            if rc == NVML_ERROR_TIMEOUT:
                continue
            if rc != NVML_SUCCESS:
                if not self._stop.is_set():
                    log.warning("Xid watch stopped: nvmlEventSetWait_v2 returned %d; the KV cache flips at a "
                                "takeover instead", rc)
                return
            if data.eventType & NVML_EVENT_TYPE_XID_CRITICAL_ERROR and not self._stop.is_set():
                try:
                    self._on_xid(int(data.eventData), time.perf_counter_ns())
                except Exception:  # noqa: BLE001 - the watch outlives one bad callback
                    log.exception("Xid %d: the early flip failed", int(data.eventData))

    def _release(self) -> None:
        if self._set.value:
            self._nvml.nvmlEventSetFree(self._set)
            self._set = ctypes.c_void_p()
        self._nvml.nvmlShutdown()

    def close(self) -> None:
        """Stop the thread (within one poll) and release NVML. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._release()
