"""Where a server's host CPU goes during a trial: the CPU seconds of every
process of the server (its process tree, read from /proc before and after the
trial; nothing is paused or sampled), and, with --py-spy, one more saturation
run per system (not counted among the trials) during which py-spy samples the
engine process's threads: frmps's active engine, vLLM's EngineCore.

Per process, `cpu_s / wall_s` is the share of one core it used; `cpu_ms_per_token`
is its CPU per output token of the trial. The engine process of either system
runs the step loop; a loop at one core's worth is the host-bound sign.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(ppid, utime + stime seconds) of pid, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    # comm may hold spaces and parentheses: the fields after it follow the last ')'.
    rest = s[s.rfind(")") + 2:].split()
    try:
        return int(rest[1]), (int(rest[11]) + int(rest[12])) / CLK_TCK
    except (IndexError, ValueError):
        return None


def _label(pid: int) -> str:
    """The process's name: its command line's first words (setproctitle'd names
    such as vLLM's VLLM::EngineCore included), else comm."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        argv = []
    if argv:
        words = [os.path.basename(argv[0])] + argv[1:]
        text = " ".join(words)
        return text if len(text) <= 80 else text[:77] + "..."
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _tree_cpu(root: int) -> dict[int, float]:
    """root and all its descendants that exist now, each with its CPU seconds
    (one read of each process's stat)."""
    stats: dict[int, tuple[int, float]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st:
                stats[int(name)] = st
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[int, float] = {}
    todo = [root]
    while todo:
        p = todo.pop()
        if p in stats:
            out[p] = stats[p][1]
            todo.extend(children.get(p, []))
    return out


def tree(root: int) -> list[int]:
    """root and all its descendants that exist now."""
    return list(_tree_cpu(root))


class CpuMeter:
    """CPU seconds of a server's process tree over an interval. roles: pid ->
    a role to name the process by (e.g. the active engine)."""

    def __init__(self, root: int | None, roles: dict[int, str] | None = None):
        self.root = root
        self.roles = roles or {}
        self.t0 = 0.0
        self.before: dict[int, float] = {}

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.before = _tree_cpu(self.root) if self.root else {}

    def stop(self, output_tokens: int | None = None) -> dict:
        wall = time.monotonic() - self.t0
        procs = []
        for p, total in (_tree_cpu(self.root) if self.root else {}).items():
            cpu = total - self.before.get(p, 0.0)
            if cpu <= 0:
                continue
            rec = {"pid": p, "name": _label(p), "cpu_s": round(cpu, 3), "cores": round(cpu / wall, 3) if wall else None}
            if p in self.roles:
                rec["role"] = self.roles[p]
            if output_tokens:
                rec["cpu_ms_per_token"] = round(cpu * 1e3 / output_tokens, 4)
            procs.append(rec)
        procs.sort(key=lambda r: -r["cpu_s"])
        return {"wall_s": round(wall, 3), "cpu_s": round(sum(r["cpu_s"] for r in procs), 3), "processes": procs}


def engine_pid(root: int | None, active: int | None = None) -> int | None:
    """The process that runs the engine loop: frmps's active engine when given,
    else vLLM's EngineCore among root's descendants (vllm serve's default
    multiprocessing engine), else root itself (an in-process engine)."""
    if active:
        return active
    if not root:
        return None
    for p in tree(root):
        if "EngineCore" in _label(p):
            return p
    return root


# py-spy's views: on the CPU (threads waiting in a system call, for the GIL or
# the device included, are left out), holding the GIL (where the one
# interpreter lock goes), and everything, waits included (where a thread that
# is not on the CPU waits).
VIEWS = {"cpu": [], "gil": ["--gil"], "idle": ["--idle"]}


def py_spy(py_spy_path: str, pid: int, seconds: float, out_path: str, run, view: str = "cpu") -> dict:
    """py-spy record (raw collapsed stacks, every thread, the process not paused)
    of pid while run() runs (at most `seconds`: stopped by SIGINT when run()
    returns); returns its samples per thread and each thread's
    hottest frames."""
    p = subprocess.Popen([py_spy_path, "record", "--pid", str(pid), "--rate", "250", "--duration",
                          str(int(seconds) + 1), "--format", "raw", "--output", out_path, "--threads",
                          "--nonblocking", *VIEWS[view]], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)  # attached before the requests start
        run()
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)  # py-spy writes what it has and exits
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
    if not os.path.exists(out_path):
        return {"error": (err or "")[-500:] or f"py-spy exited {p.returncode} without output"}
    return summarize(out_path)


def read_stacks(path: str) -> list[tuple[list[str], int]]:
    """py-spy's raw format ("thread;frame;...;frame count" per line, root first):
    (frames, count) per line; lines that are not one are skipped."""
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if stack and n.isdigit():
                out.append((stack.split(";"), int(n)))
    return out


def summarize(path: str, top: int = 12) -> dict:
    """Per thread of a raw py-spy profile: its samples, its hottest leaf frames
    and the frames it spends the most time under (inclusive)."""
    threads: dict[str, dict] = {}
    for frames, k in read_stacks(path):
        t = threads.setdefault(frames[0], {"samples": 0, "leaf": {}, "incl": {}})
        t["samples"] += k
        t["leaf"][frames[-1]] = t["leaf"].get(frames[-1], 0) + k
        for fr in set(frames[1:]):
            t["incl"][fr] = t["incl"].get(fr, 0) + k
    out = {}
    for name, t in sorted(threads.items(), key=lambda kv: -kv[1]["samples"]):
        out[name] = {"samples": t["samples"],
                     "leaf": sorted(t["leaf"].items(), key=lambda kv: -kv[1])[:top],
                     "inclusive": sorted(t["incl"].items(), key=lambda kv: -kv[1])[:top * 2]}
    return out


# The compiled model's origin, from an engine's log (vLLM 0.26's lines): traced
# and compiled in this start, or its AOT-compiled artifact loaded from vLLM's
# cache (what every engine after the first does, a restored or promoted one
# included).
_LOADED = ("Directly load AOT compilation", "Directly load the compiled graph")
_COMPILED = ("saved AOT compiled function", "Compiling a graph for")


def compile_state(log_text: str) -> str:
    """'loaded', 'compiled', 'eager' or 'unknown' for the last engine start in log_text."""
    loaded = max((log_text.rfind(m) for m in _LOADED), default=-1)
    compiled = max((log_text.rfind(m) for m in _COMPILED), default=-1)
    if loaded < 0 and compiled < 0:
        return "eager" if "enforce_eager=True" in log_text else "unknown"
    return "loaded" if loaded > compiled else "compiled"
