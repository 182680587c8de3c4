"""The bench driver's MPS daemons, through the supervisor's own MPS handling
(`frmps bench mps`, supervisor/mps): private 0700 directories owned by us, a
stale daemon in the same directories quit first, every control command under a
timeout, a daemon that ignores `quit` killed through its pid file, and an
outside-MPS pipe directory refused if a daemon's control socket is in it.
Standard library only.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from .runctx import TrialError

CONTROL = "nvidia-cuda-mps-control"


def _frmps_mps(frmps: str, verb: str, run_dir: str, timeout: float = 60.0) -> dict[str, str]:
    """Run `frmps bench mps <verb> --run-dir <run_dir>`; the environment it printed."""
    try:
        r = subprocess.run([frmps, "bench", "mps", verb, "--run-dir", run_dir], capture_output=True, text=True,
                           timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        raise TrialError(f"frmps bench mps {verb} --run-dir {run_dir}: {e}") from e
    if r.returncode != 0:
        raise TrialError(f"frmps bench mps {verb} --run-dir {run_dir}: {(r.stderr or r.stdout).strip()[-600:]}")
    env = {}
    for line in r.stdout.splitlines():
        name, sep, value = line.partition("=")
        if sep and name.startswith("CUDA_MPS_"):
            env[name] = value
    return env


class MpsDaemon:
    """A private MPS control daemon under run_dir (for a baseline's victim), started
    and stopped the way frmps serve starts and stops its own."""

    def __init__(self, frmps: str, run_dir: str):
        self.frmps = frmps
        self.run_dir = run_dir
        os.makedirs(run_dir, mode=0o700, exist_ok=True)
        self.env: dict[str, str] = {}
        self.running = False

    def start(self) -> None:
        if shutil.which(CONTROL) is None:
            raise TrialError(f"{CONTROL} not found: run with --no-mps (SIGKILL instead of MPS faults)")
        self.env = _frmps_mps(self.frmps, "start", self.run_dir)
        if "CUDA_MPS_PIPE_DIRECTORY" not in self.env:
            self.stop()
            raise TrialError(f"frmps bench mps start printed no pipe directory: {self.env}")
        self.running = True

    def stop(self) -> None:
        try:
            stop_daemon(self.frmps, self.run_dir)
        finally:
            self.running = False
            shutil.rmtree(self.run_dir, ignore_errors=True)


def stop_daemon(frmps: str, run_dir: str) -> None:
    """Stop the daemon started under run_dir (frmps serve's own after a kill, which
    left it behind; a baseline's); nothing to do when none answers there."""
    if os.path.exists(os.path.join(run_dir, "mps", "pipe", "control")):
        _frmps_mps(frmps, "stop", run_dir)


def outside_mps_env(frmps: str, run_dir: str) -> dict[str, str]:
    """An environment in which CUDA finds no daemon (a private, empty pipe directory
    under run_dir/mps-outside) and runs outside MPS, a system-wide daemon included."""
    os.makedirs(run_dir, exist_ok=True)
    return _frmps_mps(frmps, "outside-env", run_dir)
