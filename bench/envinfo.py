"""Where and with what a run measured (GPU, driver, CUDA, torch, commit), the
machine's GPU memory per process, and where results go by default. Standard
library only.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import uuid
from typing import Any


def nvidia_smi_apps() -> dict[int, dict]:
    """pid -> {"name", "used_mib"} from nvidia-smi --query-compute-apps on the engines'
    GPU (smi_select); {} without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return {}
    q = subprocess.run(["nvidia-smi", *smi_select(), "--query-compute-apps=pid,process_name,used_memory",
                        "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    apps: dict[int, dict] = {}
    for line in q.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit():
            apps[int(parts[0])] = {"name": parts[1], "used_mib": int(parts[2]) if parts[2].isdigit() else None}
    return apps


def smi_select(env: dict[str, str] | None = None) -> list[str]:
    """nvidia-smi's -i for the GPU the engines use: the first of CUDA_VISIBLE_DEVICES
    (an index or a UUID, as nvidia-smi takes both), else none (its first GPU)."""
    first = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return ["-i", first] if first else []


def nvidia_smi_gpu() -> dict:
    if shutil.which("nvidia-smi") is None:
        return {}
    q = subprocess.run(["nvidia-smi", *smi_select(), "--query-gpu=name,driver_version,memory.used,memory.total,pci.bus_id",
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
    # <repo>/bench/envinfo.py
    return os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


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


# Without a GPU to describe, the versions alone: read from torch's version module and the
# packages' metadata, so that a CPU run's record costs no import of torch (2 CPU-s).
_VERSIONS_PROBE = r"""
import importlib.metadata, importlib.util, json, os, sys
out = {"python": sys.version.split()[0]}
try:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        raise ImportError("No module named 'torch'")
    ns = {}
    with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as f:
        exec(f.read(), ns)
    out["torch"] = ns["__version__"]
    out["torch_cuda"] = ns.get("cuda")
    try:
        out["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
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
        # Other work on the machine when the run started (1, 5, 15 min): CPU figures depend on it.
        "load_avg": [round(x, 2) for x in os.getloadavg()],
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
        probe = _VERSIONS_PROBE if device == "cpu" else _TORCH_PROBE
        r = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
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
