"""FRMPS_DEBUG_MEMORY_PHASES (sdk/memphase.py): the per-phase memory lines, against
a TEST DOUBLE of NVML (ctypes calls answered from a table of processes per GPU).
On a GPU the lines come from the real library (bench/results/ once run)."""

from __future__ import annotations

import ctypes
import logging
import os

import pytest

from frmps_engine.sdk import memphase


class FakeNvml:
    """TEST DOUBLE of libnvidia-ml: GPUs, each a list of (pid, bytes); a process list
    that grows between the size query and the read once, as a real one may."""

    def __init__(self, gpus, grow_once=False, init_rc=0):
        self.gpus, self.grow_once, self.init_rc = gpus, grow_once, init_rc

    def nvmlInit_v2(self):
        return self.init_rc

    def nvmlDeviceGetCount_v2(self, n):
        n._obj.value = len(self.gpus)
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, i, dev):
        dev._obj.value = i + 1
        return 0

    def nvmlDeviceGetComputeRunningProcesses_v3(self, dev, count, infos):
        procs = self.gpus[dev.value - 1]
        if self.grow_once:
            self.grow_once = False
            procs.append((99999, 1))
        if count._obj.value < len(procs):
            count._obj.value = len(procs)
            return 7  # NVML_ERROR_INSUFFICIENT_SIZE
        for j, (pid, used) in enumerate(procs):
            infos[j].pid, infos[j].usedGpuMemory = pid, used
        count._obj.value = len(procs)
        return 0


def test_used_bytes_sums_this_process_over_its_gpus():
    mib = 2**20
    r = memphase.ProcessMemory(FakeNvml([[(10, 612 * mib), (11, 5 * mib)], [(11, 7 * mib)], []], grow_once=True))
    assert r.used_bytes(11) == 12 * mib
    assert r.used_bytes(10) == 612 * mib
    assert r.used_bytes(12) is None
    mps = memphase.ProcessMemory(FakeNvml([[(13, memphase.NOT_AVAILABLE)]]))
    assert mps.used_bytes(13) is None  # listed without a figure (an MPS client)
    assert "NVML 12 MiB for this process" in memphase.measure(11, r)


def test_no_nvml_is_an_error_at_init():
    with pytest.raises(RuntimeError, match="nvmlInit_v2: NVML return 9"):
        memphase.ProcessMemory(FakeNvml([], init_rc=9))


def test_note_logs_only_when_asked(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="frmps_engine.sdk.memphase")
    monkeypatch.setattr(memphase, "_reader", memphase.ProcessMemory(FakeNvml([[(os.getpid(), 3 * 2**20)]])))
    monkeypatch.delenv(memphase.ENV, raising=False)
    memphase.note("engine built")
    assert not caplog.records
    monkeypatch.setenv(memphase.ENV, "1")
    memphase.note("engine built")
    (rec,) = caplog.records
    assert rec.getMessage().startswith("memory at engine built: NVML 3 MiB for this process; torch")


def test_without_a_driver_the_line_says_so(monkeypatch):
    monkeypatch.setattr(memphase, "_reader", None)
    monkeypatch.setattr(memphase, "_reader_error", "")
    monkeypatch.setenv(memphase.NVML_ENV, "/nonexistent/libnvidia-ml.so.1")
    line = memphase.measure()
    assert line.startswith("NVML: unavailable (") and "/nonexistent/libnvidia-ml.so.1" in line


def test_process_info_layout_matches_nvml():
    # nvmlProcessInfo_t (v2/v3): uint pid, (pad), ulonglong usedGpuMemory, uint, uint: 24 bytes
    assert ctypes.sizeof(memphase._ProcessInfo) == 24


def test_phase_lines_read_back(tmp_path, monkeypatch):
    """What the engine logs is what the bench's standby-memory experiment records."""
    from bench import loglines

    monkeypatch.setenv(memphase.ENV, "1")
    log = tmp_path / "standby.log"
    lines = ["2026-11-28 06:00:00,000 INFO frmps_engine.sdk.memphase: memory at engine start (pools reserved): "
             + memphase.measure(7, memphase.ProcessMemory(FakeNvml([[(7, 612 * 2**20)]]))),
             "x INFO frmps_engine.sdk.memphase: memory at asleep (brokered pools mapped): NVML: no GPU memory for this "
             "process; torch 90.0 MiB reserved, 75.8 MiB allocated"]
    log.write_text("\n".join(lines) + "\n")
    got = loglines.memory_phases(str(log))
    assert [g["phase"] for g in got] == ["engine start (pools reserved)", "asleep (brokered pools mapped)"]
    assert got[0]["nvml_mib"] == 612.0
    assert got[1] == {"phase": "asleep (brokered pools mapped)", "nvml_mib": None, "torch_reserved_mib": 90.0,
                      "torch_allocated_mib": 75.8}
    assert loglines.memory_phases(str(tmp_path / "none.log")) == []
