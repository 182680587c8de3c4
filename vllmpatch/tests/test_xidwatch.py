"""The Xid listener of a sleeping standby (sdk/xidwatch.py), against a TEST DOUBLE of
NVML's event API (ctypes calls answered from a queue of events). The real library is
exercised on a GPU (bench/results/, the early-flip lines of a fault run)."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from frmps_engine.sdk import xidwatch
from frmps_engine.sdk.xidwatch import NVML_EVENT_TYPE_XID_CRITICAL_ERROR as XID


class FakeNvml:
    """TEST DOUBLE of libnvidia-ml's event API: GPUs by UUID; ``post`` queues an event."""

    def __init__(self, uuids=("GPU-a",), register_rc=0, wait_error=None):
        self.uuids, self.register_rc, self.wait_error = list(uuids), register_rc, wait_error
        self.events: queue.Queue = queue.Queue()
        self.registered, self.calls = [], []

    def post(self, event_type, data):
        self.events.put((event_type, data))

    def nvmlInit_v2(self):
        self.calls.append("init")
        return 0

    def nvmlShutdown(self):
        self.calls.append("shutdown")
        return 0

    def nvmlEventSetCreate(self, out):
        out._obj.value = 0x5E7
        return 0

    def nvmlEventSetFree(self, s):
        assert s.value == 0x5E7
        self.calls.append("free")
        return 0

    def nvmlDeviceGetHandleByUUID(self, uuid, dev):
        u = uuid.decode()
        if u not in self.uuids:
            return 13  # NVML_ERROR_NOT_FOUND
        dev._obj.value = 0x100 + self.uuids.index(u)
        return 0

    def nvmlDeviceRegisterEvents(self, dev, mask, s):
        if self.register_rc:
            return self.register_rc
        self.registered.append((dev.value, mask.value, s.value))
        return 0

    def nvmlEventSetWait_v2(self, s, data, timeout_ms):
        if self.wait_error is not None:
            return self.wait_error
        try:
            event_type, value = self.events.get(timeout=timeout_ms.value / 1000)
        except queue.Empty:
            return xidwatch.NVML_ERROR_TIMEOUT
        data._obj.eventType, data._obj.eventData = event_type, value
        return 0


def test_every_xid_reaches_the_callback_and_close_ends_the_thread():
    nvml, got = FakeNvml(["GPU-a", "GPU-b"]), []
    w = xidwatch.XidWatch(["GPU-a", "GPU-b"], lambda x, t: got.append(x), nvml=nvml, poll_ms=20)
    assert nvml.registered == [(0x100, XID, 0x5E7), (0x101, XID, 0x5E7)]
    nvml.post(XID, 43)
    nvml.post(0x1, 0)  # another kind of event (single-bit ECC): not an Xid
    nvml.post(XID, 13)
    deadline = time.monotonic() + 10
    while len(got) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert got == [43, 13]
    t = time.monotonic()
    w.close()
    assert time.monotonic() - t < 2
    assert not any(th.name == "frmps-xid-watch" for th in threading.enumerate())
    assert nvml.calls == ["init", "free", "shutdown"]
    w.close()  # idempotent
    assert nvml.calls == ["init", "free", "shutdown"]


def test_a_gpu_nvml_cannot_watch_is_an_error_and_nvml_is_released():
    nvml = FakeNvml(["GPU-a"], register_rc=3)  # NVML_ERROR_NOT_SUPPORTED
    with pytest.raises(xidwatch.NvmlError, match=r"nvmlDeviceRegisterEvents\(GPU-a, Xid\): NVML return 3"):
        xidwatch.XidWatch(["GPU-a"], lambda x, t: None, nvml=nvml)
    assert nvml.calls == ["init", "free", "shutdown"]
    with pytest.raises(xidwatch.NvmlError, match=r"GetHandleByUUID\(GPU-z\): NVML return 13"):
        xidwatch.XidWatch(["GPU-z"], lambda x, t: None, nvml=FakeNvml(["GPU-a"]))
    with pytest.raises(xidwatch.NvmlError, match="no GPU to watch"):
        xidwatch.XidWatch([], lambda x, t: None, nvml=FakeNvml())


def test_a_failing_wait_stops_the_watch_with_a_warning(caplog):
    caplog.set_level("WARNING", logger="frmps_engine.sdk.xidwatch")
    w = xidwatch.XidWatch(["GPU-a"], lambda x, t: None, nvml=FakeNvml(wait_error=999), poll_ms=20)
    w._thread.join(10)
    assert not w._thread.is_alive()
    assert "nvmlEventSetWait_v2 returned 999" in caplog.text
    w.close()


def test_a_failing_callback_does_not_end_the_watch(caplog):
    nvml, got = FakeNvml(), []

    def on_xid(x, t):
        got.append(x)
        if x == 43:
            raise RuntimeError("flip failed")

    w = xidwatch.XidWatch(["GPU-a"], on_xid, nvml=nvml, poll_ms=20)
    nvml.post(XID, 43)
    nvml.post(XID, 31)
    deadline = time.monotonic() + 10
    while len(got) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    w.close()
    assert got == [43, 31] and "Xid 43: the early flip failed" in caplog.text


def test_uuids_are_named_as_nvml_names_them():
    assert xidwatch.nvml_uuid("5c3a-01") == "GPU-5c3a-01"
    assert xidwatch.nvml_uuid("GPU-5c3a-01") == "GPU-5c3a-01"
