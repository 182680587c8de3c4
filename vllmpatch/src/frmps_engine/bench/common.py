"""Shared by every experiment: result files (append-only, resumable), the
environment a run measured on, progress lines, the time budget, small process
and HTTP helpers. Standard library only: the driver runs where only the
engine's own dependencies are installed.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable

SCHEMA = 1


def now() -> float:
    return time.time()


# ----------------------------------------------------------------------------- results


def key_id(key: dict) -> str:
    """The canonical id of a point's key (sorted JSON)."""
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


class ResultFile:
    """``<out>/<experiment>.jsonl``: one JSON object per measured point, appended
    (and flushed to disk) as soon as it is measured. A point is identified by its
    key (a dict such as ``{"model": ..., "system": ..., "trial": 0}``); a re-run
    skips keys that already have an ok record and retries failed ones up to
    ``max_attempts`` in all. Every attempt stays in the file: a failure is never
    dropped, a later success just supersedes it in the summaries."""

    def __init__(self, out_dir: str, experiment: str, run_id: str, max_attempts: int = 2):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, f"{experiment}.jsonl")
        self.experiment = experiment
        self.run_id = run_id
        self.max_attempts = max(1, int(max_attempts))
        self._lock = threading.Lock()
        self.new_records: list[dict] = []

    def records(self) -> list[dict]:
        return load_records(self.path)

    def _by_key(self) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for r in self.records():
            out.setdefault(key_id(r["key"]), []).append(r)
        return out

    def status(self, key: dict) -> str:
        """"done" (an ok record exists), "failed" (attempts used up), "unsupported" (the
        newest record says the engine cannot run it) or "pending"."""
        return self._status(self._by_key().get(key_id(key), []))

    def _status(self, recs: list[dict]) -> str:
        if any(r.get("ok") for r in recs):
            return "done"
        tried = [r for r in recs if not r.get("unsupported")]
        if len(tried) >= self.max_attempts:
            return "failed"
        if recs and recs[-1].get("unsupported"):
            return "unsupported"
        return "pending"

    def attempts(self, key: dict) -> int:
        return sum(1 for r in self._by_key().get(key_id(key), []) if not r.get("unsupported"))

    def pending(self, keys: Iterable[dict]) -> list[dict]:
        """Keys to measure in this run: not done, attempts left. Unsupported ones are
        included (the capability is checked again, which is cheap)."""
        by = self._by_key()
        return [k for k in keys if self._status(by.get(key_id(k), [])) in ("pending", "unsupported")]

    def add(self, key: dict, data: dict | None, error: str | None, elapsed_s: float, unsupported: bool = False) -> dict:
        rec = {"schema": SCHEMA, "experiment": self.experiment, "key": key, "ok": error is None, "error": error,
               "run_id": self.run_id, "t": round(now(), 3), "elapsed_s": round(elapsed_s, 3), "data": data or {}}
        if unsupported:
            rec["unsupported"] = True
        line = json.dumps(rec, sort_keys=True, default=_json_default)
        with self._lock:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.new_records.append(rec)
        return rec


def _json_default(o: Any):
    if isinstance(o, (set, tuple)):
        return list(o)
    if hasattr(o, "item"):  # numpy scalars
        return o.item()
    return str(o)


def load_records(path: str) -> list[dict]:
    """Every record of a JSONL result file; a torn last line (a run killed while
    writing) is skipped, not fatal."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        pass
    return out


def latest_ok(records: list[dict]) -> list[dict]:
    """Per key, the newest ok record, else the newest record (an error), in file order of first appearance."""
    order: list[str] = []
    best: dict[str, dict] = {}
    for r in records:
        k = key_id(r["key"])
        if k not in best:
            order.append(k)
            best[k] = r
        elif r.get("ok") or not best[k].get("ok"):
            best[k] = r
    return [best[k] for k in order]


def write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- progress and budget


def fmt_dur(s: float) -> str:
    s = max(0, int(round(s)))
    return f"{s // 60}:{s % 60:02d}"


def fmt_s(v: float | None) -> str:
    """Seconds for a progress line: ms below 10 s."""
    if v is None:
        return "-"
    return f"{v * 1e3:.1f} ms" if abs(v) < 10 else f"{v:.1f} s"


class Progress:
    """Progress lines on stderr: ``[recovery 3/30 0:42 left ~5:10] message``."""

    def __init__(self, experiment: str, total: int, stream=None):
        self.experiment = experiment
        self.total = total
        self.done = 0
        self.t0 = time.monotonic()
        self.stream = stream or sys.stderr
        self._durations: list[float] = []

    def point_done(self, elapsed: float) -> None:
        self.done += 1
        self._durations.append(elapsed)

    def eta(self) -> float | None:
        if not self._durations:
            return None
        return statistics.fmean(self._durations) * max(0, self.total - self.done)

    def __call__(self, msg: str) -> None:
        el = time.monotonic() - self.t0
        eta = self.eta()
        left = f" left ~{fmt_dur(eta)}" if eta is not None else ""
        print(f"[{self.experiment} {self.done}/{self.total} {fmt_dur(el)}{left}] {msg}", file=self.stream, flush=True)


class BudgetExhausted(Exception):
    pass


class Budget:
    """Stop before starting work that would not fit in the run's wall time.
    ``allows(estimate)`` is asked before each point and each setup; 0 = no limit."""

    def __init__(self, seconds: float):
        self.seconds = float(seconds or 0)
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def remaining(self) -> float:
        return float("inf") if not self.seconds else self.seconds - self.elapsed()

    def check(self, estimate_s: float, what: str) -> None:
        if self.seconds and self.elapsed() + max(0.0, estimate_s) > self.seconds:
            raise BudgetExhausted(f"time budget: {what} (~{estimate_s:.0f} s) does not fit in the "
                                  f"{self.remaining():.0f} s left of --budget {self.seconds:.0f}")


# ----------------------------------------------------------------------------- context


@dataclass
class Ctx:
    """What every experiment gets: options, where results go, budget, progress."""

    args: Any
    out_dir: str
    run_id: str
    budget: Budget
    results: ResultFile
    progress: Progress | None = None
    cleanup: "Cleanup | None" = None

    @property
    def cpu(self) -> bool:
        return self.args.device == "cpu"

    def log(self, msg: str) -> None:
        if self.progress is not None:
            self.progress(msg)
        else:
            print(f"[{self.results.experiment}] {msg}", file=sys.stderr, flush=True)

    def run_point(self, key: dict, fn: Callable[[], dict], estimate_s: float = 0.0,
                  describe: Callable[[dict], str] | None = None) -> dict | None:
        """Measure one point unless it is done; record its data or its error at once."""
        if self.results.status(key) not in ("pending", "unsupported"):
            return None
        self.budget.check(estimate_s, f"point {key_id(key)}")
        t0 = time.monotonic()
        data, err = None, None
        try:
            data = fn()
        except BudgetExhausted:
            raise
        except Exception as e:  # one failed point must not stop the sweep
            err = f"{type(e).__name__}: {e}"
            data = getattr(e, "partial", None)
        el = time.monotonic() - t0
        rec = self.results.add(key, data, err, el)
        if self.progress is not None:
            self.progress.point_done(el)
        what = " ".join(f"{v}" for v in key.values())
        if err:
            self.log(f"{what}: FAILED ({err[:300]})")
        else:
            self.log(f"{what}: {describe(data) if describe else 'ok'}")
        return rec

    def fail_points(self, keys: list[dict], error: str) -> None:
        """A setup shared by these points failed: record the failure on each."""
        for k in keys:
            if self.results.status(k) in ("pending", "unsupported"):
                self.results.add(k, None, error, 0.0)
                if self.progress is not None:
                    self.progress.point_done(0.0)
        self.log(f"{len(keys)} point(s) failed: {error[:300]}")

    def unsupported(self, keys: list[dict], why: str) -> None:
        """The engine cannot run these points (a missing capability): recorded as such,
        not as failures; a later run checks again."""
        for k in keys:
            self.results.add(k, None, f"unsupported: {why}", 0.0, unsupported=True)
            if self.progress is not None:
                self.progress.point_done(0.0)
        self.log(f"{len(keys)} point(s) not measured: unsupported: {why}")


class TrialError(Exception):
    """A trial failed; ``partial`` holds what was measured before the failure."""

    def __init__(self, msg: str, partial: dict | None = None):
        super().__init__(msg)
        self.partial = partial


# ----------------------------------------------------------------------------- processes


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


def med(xs: Iterable[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return statistics.median(v) if v else None


# ----------------------------------------------------------------------------- GPU and environment


def nvidia_smi_apps() -> dict[int, dict]:
    """pid -> {"name", "used_mib"} from nvidia-smi --query-compute-apps; {} without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return {}
    q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, timeout=30)
    apps: dict[int, dict] = {}
    for line in q.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit():
            apps[int(parts[0])] = {"name": parts[1], "used_mib": int(parts[2]) if parts[2].isdigit() else None}
    return apps


def nvidia_smi_gpu() -> dict:
    if shutil.which("nvidia-smi") is None:
        return {}
    q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.used,memory.total,pci.bus_id",
                        "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    line = (q.stdout.strip().splitlines() or [""])[0]
    parts = [p.strip() for p in line.split(",")]
    if len(parts) < 4:
        return {"error": (q.stderr or q.stdout).strip()[:300]}
    out = {"name": parts[0], "driver": parts[1], "used_mib": _int(parts[2]), "total_mib": _int(parts[3])}
    v = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    m = re.search(r"CUDA Version:\s*([\d.]+)", v)
    if m:
        out["cuda_driver_api"] = m.group(1)
    return out


def _int(s: str) -> int | None:
    try:
        return int(s)
    except ValueError:
        return None


def private_mib(pid: int) -> float | None:
    """Private resident memory of a process (MiB), from /proc/<pid>/smaps_rollup."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            kb = 0
            for line in f:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    kb += int(line.split()[1])
        return round(kb / 1024, 1)
    except (OSError, ValueError):
        return None


def gpu_short_name(name: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "h100"; "" -> "cpu"."""
    if not name:
        return "cpu"
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    return (m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")).lower()


def repo_root() -> str:
    # <repo>/vllmpatch/src/frmps_engine/bench/common.py
    return os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))


def git_commit() -> str | None:
    root = repo_root()
    try:  # a COMMIT file written when the tree was copied wins: a copied tree's .git may be stale
        with open(os.path.join(root, "COMMIT")) as f:
            c = f.read().strip()
            if c:
                return c
    except OSError:
        pass
    try:
        r = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if r.returncode == 0:
            dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return r.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    try:  # a copy of the tree without .git: a COMMIT file written when it was copied
        with open(os.path.join(root, "COMMIT")) as f:
            return f.read().strip() or None
    except OSError:
        return None


_TORCH_PROBE = r"""
import json, sys
out = {"python": sys.version.split()[0]}
try:
    import torch
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        p = torch.cuda.get_device_properties(0)
        out["gpu_total_mib"] = p.total_memory // (1 << 20)
        out["gpu_sm"] = f"{p.major}.{p.minor}"
    try:
        import triton
        out["triton"] = triton.__version__
    except Exception:
        pass
except Exception as e:
    out["torch_error"] = str(e)
print(json.dumps(out))
"""


def capture_env(python: str, frmps: str | None, device: str) -> dict:
    """Where and with what a run measured: date, GPU, driver, CUDA, torch, commit."""
    env: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device, "driver_python": sys.version.split()[0], "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "commit": git_commit(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.+)", f.read())
            env["cpu_model"] = m.group(1).strip() if m else None
        with open("/proc/meminfo") as f:
            m = re.search(r"MemTotal:\s*(\d+)", f.read())
            env["host_mem_gib"] = round(int(m.group(1)) / (1 << 20), 1) if m else None
    except OSError:
        pass
    try:
        r = subprocess.run([python, "-c", _TORCH_PROBE], capture_output=True, text=True, timeout=120)
        env["engine"] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-500:]}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        env["engine"] = {"error": str(e)}
    if device != "cpu":
        try:
            env["nvidia_smi"] = nvidia_smi_gpu()
        except (OSError, subprocess.SubprocessError) as e:
            env["nvidia_smi"] = {"error": str(e)}
    if frmps:
        try:
            r = subprocess.run([frmps, "version"], capture_output=True, text=True, timeout=20)
            env["frmps_version"] = r.stdout.strip()
        except OSError as e:
            env["frmps_version"] = f"error: {e}"
    return env


def default_out_dir(device: str) -> str:
    """bench/results/<date>-<gpu> (UTC date; gpu from nvidia-smi). CPU runs check the
    harness and measure nothing: they go under bench/build/ (ignored by git)."""
    if device == "cpu":
        return os.path.join(repo_root(), "bench", "build", "bench-cpu")
    gpu = ""
    try:
        gpu = nvidia_smi_gpu().get("name", "")
    except (OSError, subprocess.SubprocessError):
        gpu = ""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return os.path.join(repo_root(), "bench", "results", f"{date}-{gpu_short_name(gpu)}")


def new_run_id() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]
