"""The engine process's diagnostics: the notes its start and sleep lines carry
(device memory, torch's allocator by kind of pool, threads), the start's phases,
and the start's stacks and profile (FRMPS_DEBUG_STARTUP_STACKS,
FRMPS_DEBUG_STARTUP_PROFILE: sdk/README.md, "Diagnostic switches")."""

from __future__ import annotations

import faulthandler
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from typing import Any, Callable

from frmps_engine._proto.frmps.v1 import control_pb2

# The runner's logger: these are the engine process's lifecycle lines, under one name.
log = logging.getLogger("frmps_engine.sdk.runner")


def _torch_cuda_note(device: str, what: str, note: Callable[[Any], str]) -> str:
    """``note(torch.cuda)`` on a GPU whose CUDA this process has initialised, '' elsewhere
    (e.g. rank 0 of a group whose ranks are other processes); '; <what>: unknown (…)' if
    it fails: a note in a log line is not worth failing a start for."""
    if not device.startswith("cuda"):
        return ""
    try:
        import torch

        if not torch.cuda.is_initialized():
            return ""
        return note(torch.cuda)
    except Exception as e:
        return f"; {what}: unknown ({e})"


def device_memory_note(device: str) -> str:
    """'; torch allocator: N MiB reserved' on a GPU (what the standby keeps besides the
    CUDA context, its loaded kernels and library workspaces), '' elsewhere."""
    return _torch_cuda_note(device, "torch allocator", lambda cuda: (
        f"; torch allocator: {cuda.memory_reserved() / 2**20:.1f} MiB reserved, "
        f"{cuda.memory_allocated() / 2**20:.1f} MiB allocated"))


def torch_pools_breakdown(segments: list[dict]) -> dict[str, dict[str, float]]:
    """torch's CUDA segments (``torch.cuda.memory_snapshot()``) summed by the kind of
    pool that owns them, in MiB: ``default`` (pool id (0, 0): the process's own
    allocations), ``graphs`` (ids (n, 0): CUDA-graph private pools, which a
    captured graph's intermediate tensors live in) and ``mempools`` (ids (0, n):
    MemPools such as the frmps pools' contexts — on a standby after Sleep, backed by
    the brokered pools, not by memory of its own). Each: reserved, allocated, pools."""
    out: dict[str, dict[str, float]] = {}
    pools: dict[str, set] = {}
    for seg in segments:
        pid = tuple(seg.get("segment_pool_id") or (0, 0))
        kind = "default" if pid == (0, 0) else "graphs" if pid[1] == 0 else "mempools"
        d = out.setdefault(kind, {"reserved": 0.0, "allocated": 0.0, "pools": 0})
        d["reserved"] += seg.get("total_size", 0) / 2**20
        d["allocated"] += seg.get("allocated_size", 0) / 2**20
        pools.setdefault(kind, set()).add(pid)
    for kind, d in out.items():
        d["pools"] = len(pools[kind])
    return out


def standby_memory_note(device: str) -> str:
    """After Sleep, on a GPU: what the standby keeps of its own in torch's allocator,
    by kind of pool (torch_pools_breakdown), '' elsewhere."""
    return _torch_cuda_note(device, "torch allocator by pool",
                            lambda cuda: pools_note(torch_pools_breakdown(cuda.memory_snapshot())))


def threads_note(task_dir: str = "/proc/self/task", top: int = 6) -> str:
    """'; N threads (name n, ...)': this process's threads by name, most first. The
    supervisor fences a dead active with a SIGKILL whose sender wakes every thread of it
    before the Resume can go (the more threads, the longer), so the count is on a
    takeover's path.
    '' where the kernel does not list them."""
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return ""
    names: dict[str, int] = {}
    for tid in tids:
        try:
            with open(os.path.join(task_dir, tid, "comm")) as f:
                name = f.read().strip() or "?"
        except OSError:  # the thread ended meanwhile
            continue
        names[name] = names.get(name, 0) + 1
    most = sorted(names.items(), key=lambda kv: (-kv[1], kv[0]))
    shown = ", ".join(f"{n} {c}" for n, c in most[:top]) + (", ..." if len(most) > top else "")
    return f"; {sum(names.values())} threads ({shown})"


def pools_note(b: dict[str, dict[str, float]]) -> str:
    """torch_pools_breakdown as the standby's log line says it (bench/loglines.py reads it)."""
    parts = [f"{k} {b[k]['reserved']:.1f} MiB reserved ({b[k]['allocated']:.1f} allocated"
             + (f", {b[k]['pools']:.0f} pools)" if k != "default" else ")")
             for k in ("default", "graphs", "mempools") if k in b]
    return "; torch allocator by pool: " + ", ".join(parts) if parts else "; torch allocator: empty"


def log_start_phases(t: int, t_ring: int, t_pools: int) -> None:
    now = time.perf_counter_ns()
    log.info("start phases: ring warm-up %.0f ms, pools %.0f ms, engine core %.0f ms",
             (t_ring - t) / 1e6, (t_pools - t_ring) / 1e6, (now - t_pools) / 1e6)


def startup_stacks(on: bool) -> None:
    """Diagnostics (FRMPS_DEBUG_STARTUP_STACKS=<seconds>): every so many seconds
    while the engine starts, every thread's stack to stderr (the engine log), to
    see where a slow start spends its time; off once the engine is up."""
    every = os.environ.get("FRMPS_DEBUG_STARTUP_STACKS", "")
    if not every:
        return
    if on:
        faulthandler.dump_traceback_later(float(every), repeat=True)
    else:
        faulthandler.cancel_dump_traceback_later()


_profiler: subprocess.Popen | None = None


def startup_profile(on: bool, role: int = 0) -> None:
    """Diagnostics (FRMPS_DEBUG_STARTUP_PROFILE=<dir>): py-spy (FRMPS_PY_SPY, else
    py-spy on PATH) samples every thread of this process from the start until the
    engine is up, without pausing it (--nonblocking), waits included (--idle: the
    wall clock of the start, the GPU's share too), into
    <dir>/start-<role>-<pid>.stacks (py-spy's raw collapsed stacks;
    bench/gpu/start_profile.py sums them per function). py-spy must be allowed to
    trace this process (root, or CAP_SYS_PTRACE). It stays in the engine's process
    group, so the supervisor's fence stops it with the engine."""
    global _profiler
    out_dir = os.environ.get("FRMPS_DEBUG_STARTUP_PROFILE", "")
    if not out_dir:
        return
    if not on:
        p, _profiler = _profiler, None
        if p is not None:
            p.send_signal(signal.SIGINT)  # py-spy writes its output when interrupted
            threading.Thread(target=_reap_profiler, args=(p,), name="frmps-start-profile", daemon=True).start()
        return
    exe = os.environ.get("FRMPS_PY_SPY", "") or shutil.which("py-spy")
    if not exe:
        log.warning("FRMPS_DEBUG_STARTUP_PROFILE is set but there is no py-spy (FRMPS_PY_SPY or PATH): no start profile")
        return
    role_name = control_pb2.Role.Name(role).removeprefix("ROLE_").lower() if role else "engine"
    path = os.path.join(out_dir, f"start-{role_name}-{os.getpid()}.stacks")
    try:
        os.makedirs(out_dir, exist_ok=True)
        _profiler = subprocess.Popen(
            [exe, "record", "--pid", str(os.getpid()), "--rate", "200", "--nonblocking", "--threads", "--idle",
             "--format", "raw", "--duration", "900", "--output", path],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError as e:
        log.warning("start profile: cannot run %s: %s", exe, e)
        return
    log.info("start profile: py-spy (pid %d) samples this engine's start into %s", _profiler.pid, path)


def _reap_profiler(p: subprocess.Popen) -> None:
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
