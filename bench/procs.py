"""Child processes the driver starts (process groups, cleanup however the run
ends, death with the driver) and small HTTP and log helpers. Standard library
only.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any, Callable


def now() -> float:
    return time.time()


# The directory holding the bench package (the repository root).
BENCH_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def with_bench_path(env: dict[str, str]) -> dict[str, str]:
    """env with the bench package's directory on PYTHONPATH (appended, unless
    there), for a child run as `python -m bench.<module>` from any directory."""
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if BENCH_ROOT not in parts:
        parts.append(BENCH_ROOT)
    return {**env, "PYTHONPATH": os.pathsep.join(parts)}


class Cleanup:
    """Process groups and callbacks to stop when the run ends, however it ends."""

    def __init__(self):
        self._procs: list[subprocess.Popen] = []
        self._fns: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def add_proc(self, p: subprocess.Popen) -> subprocess.Popen:
        with self._lock:
            self._procs.append(p)
        return p

    def add(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._fns.append(fn)

    def remove(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if fn in self._fns:
                self._fns.remove(fn)

    def run(self) -> None:
        with self._lock:
            fns, self._fns = list(reversed(self._fns)), []
            procs, self._procs = list(self._procs), []
        for fn in fns:
            try:
                fn()
            except Exception as e:  # best effort: keep cleaning
                print(f"cleanup: {e}", file=sys.stderr)
        for p in procs:
            kill_group(p)


_PR_SET_PDEATHSIG = 1
_prctl = None


def die_with_parent():
    """A preexec_fn: the child gets SIGTERM when the driver dies, even by SIGKILL, so
    a killed run leaves no deployment behind. The kernel sends it when the *thread*
    that forked exits, so use it only for children started on the main thread."""
    global _prctl
    if threading.current_thread() is not threading.main_thread():
        return None
    if _prctl is None:
        import ctypes

        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    fn = _prctl

    def preexec() -> None:
        fn(_PR_SET_PDEATHSIG, int(signal.SIGTERM))

    return preexec


def proc_state(pid: int) -> str | None:
    """The one-letter state of pid from /proc (R, S, Z, ...), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """pid exists and is not a zombie."""
    return proc_state(pid) not in (None, "Z")


def children_of(pid: int) -> list[tuple[int, str]]:
    """(pid, state) of every process whose parent is pid (zombies included)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            out.append((int(name), fields[0]))
    return out


def live_children(pid: int) -> list[int]:
    """The children of pid that are alive (not zombies)."""
    return [c for c, state in children_of(pid) if state != "Z"]


def wait_gone(pids, timeout: float = 30.0) -> list[int]:
    """Wait until none of pids is alive; returns those still alive at the timeout."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if alive(p)]
    return left


def collect(q, procs: list, timeout: float) -> list:
    """One result per client process from q (a multiprocessing queue); a process
    that died without one is an error (not a wait until the timeout)."""
    import queue

    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < len(procs):
        try:
            out.append(q.get(timeout=1.0))
        except queue.Empty:
            if time.monotonic() > deadline:
                raise TimeoutError(f"client processes gave {len(out)} of {len(procs)} results in {timeout:.0f}s")
            if sum(p.is_alive() for p in procs) < len(procs) - len(out) and q.empty():
                raise RuntimeError(f"a client process died (exit codes {[p.exitcode for p in procs]})")
    return out


def kill_group(p: subprocess.Popen, sig: int = signal.SIGKILL, wait_s: float = 10.0) -> None:
    """Kill the process group a child leads (started with start_new_session) and reap it."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass
    try:
        p.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        pass


def stop_group(p: subprocess.Popen, grace_s: float = 30.0) -> int | None:
    """SIGTERM the child, wait up to grace_s, then SIGKILL its process group."""
    if p.poll() is None:
        try:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            pass
    rc = p.poll()
    # Anything left in its group (an engine it did not reap) goes too.
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if rc is None:
        try:
            rc = p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            rc = None
    return rc


def tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, timeout: float = 10.0) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def field(d: dict, name: str, default: Any = None) -> Any:
    """A field by proto name or lowerCamelCase (grpc-gateway's JSON)."""
    if name in d:
        return d[name]
    camel = re.sub(r"_([a-z])", lambda m: m.group(1).upper(), name)
    return d.get(camel, default)
