"""The one harness that starts `frmps serve`, for the tests, the bench and the
proofs: its command line (ServeOpts), and the process (Serve) with its ports,
run dir and log, the admin API's status, waits on it and the stop. The bench
driver's deployments (deploy.py), chaos.py, the demo, the GPU proofs
(bench/gpu/failover_proof.py and the scripts built on it) and the end-to-end
tests (vllmpatch/tests/e2e.py) are all this. Standard library only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field as dc_field

from .procs import die_with_parent, free_port, now, tail


@dataclass
class ServeOpts:
    """What a `frmps serve` runs. None leaves that flag out (frmps serve's own
    default), as does a zero num_blocks or max_model_len; mps=False is --no-mps."""

    frmps: str
    python: str | None
    model: str
    device: str | None = "cuda"
    memory: str | None = "cuda-vmm"
    mps: bool = True
    sync_every: int | None = 1  # frmps serve's default
    num_blocks: int = 0
    max_model_len: int = 0
    engine_args: list[str] = dc_field(default_factory=list)
    env: dict[str, str] = dc_field(default_factory=dict)
    engine: str | None = "ref"
    serve_args: list[str] = dc_field(default_factory=list)  # more `frmps serve` flags

    def command(self, port: int, admin: str, run_dir: str, log_dir: str | None = None) -> list[str]:
        """The `frmps serve` command line; admin is the admin API's host:port,
        log_dir the engines' log directory (None: frmps serve's default)."""
        cmd = [self.frmps, "serve"]
        for flag, value in (("--engine", self.engine), ("--model", self.model), ("--device", self.device),
                            ("--memory", self.memory), ("--sync-every", self.sync_every)):
            if value is not None:
                cmd += [flag, str(value)]
        cmd += ["--port", str(port), "--admin-addr", admin, "--run-dir", run_dir]
        if log_dir is not None:
            cmd += ["--engine-log-dir", log_dir]
        if self.python is not None:
            cmd += ["--python", self.python]
        if self.num_blocks:
            cmd += ["--num-blocks", str(self.num_blocks)]
        if self.max_model_len:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if not self.mps:
            cmd += ["--no-mps"]
        return cmd + list(self.serve_args) + [f"--engine-arg={a}" for a in self.engine_args]


class Serve:
    """One `frmps serve` process: opts' command line on the given ports (free
    ones when 0), its output appended to log_path, the admin API's status and
    waits on it, and the stop. A harness that needs more (placement, faults,
    resources, its own stop) builds on it."""

    error: type[Exception] = RuntimeError  # what a failed wait raises
    timeout_error: type[Exception] | None = None  # a wait that ran out of time, if not error
    status_timeout = 10.0  # seconds, one status request

    def __init__(self, opts: ServeOpts, run_dir: str, log_path: str, log_dir: str | None = None, port: int = 0,
                 admin_port: int = 0):
        self.opts = opts
        self.run_dir, self.log_path, self.log_dir = run_dir, log_path, log_dir
        self.port = port or free_port()
        self.admin_port = admin_port or free_port()
        self.admin_addr = f"127.0.0.1:{self.admin_port}"
        self.base = f"http://127.0.0.1:{self.port}"
        self.admin_url = f"http://{self.admin_addr}"
        self.proc: subprocess.Popen | None = None
        self.t_start = 0.0

    def command(self) -> list[str]:
        return self.opts.command(self.port, self.admin_addr, self.run_dir, self.log_dir)

    def start(self, env: dict[str, str] | None = None, *, own_session: bool = False, parent_death: bool = False,
              header: str = "") -> subprocess.Popen:
        """Starts frmps serve with os.environ, opts.env and env, its output
        appended to the log (after header, when given). own_session: a session
        and process group of its own (a stop can end the group). parent_death:
        SIGTERM to it when this process dies (procs.die_with_parent)."""
        with open(self.log_path, "ab") as log:
            if header:
                log.write(header.encode())
                log.flush()
            self.t_start = now()
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **self.opts.env, **(env or {})},
                                         start_new_session=own_session,
                                         preexec_fn=die_with_parent() if parent_death else None)
        return self.proc

    def status(self) -> dict:
        with urllib.request.urlopen(f"{self.admin_url}/v1/admin/status", timeout=self.status_timeout) as r:
            return json.loads(r.read())

    def poll_status(self, pred: Callable[[dict], object], timeout: float, what: str,
                    poll: float = 0.02) -> tuple[dict, float]:
        """Polls the status until pred(status) holds: that status and the time
        (time.time()) it was seen. Raises self.error if frmps exits first,
        timeout_error (else error) if timeout seconds pass, with the last
        status and the log's tail."""
        deadline = time.monotonic() + timeout
        last: dict | None = None
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise self.error(f"frmps exited ({self.proc.returncode if self.proc else '-'}) while waiting for "
                                 f"{what}; log tail:\n{tail(self.log_path, 25)}")
            try:
                st = self.status()
                last = st
                if pred(st):
                    return st, now()
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(poll)
        raise (self.timeout_error or self.error)(f"timed out after {timeout:.0f} s waiting for {what}; last status: {json.dumps(last)[:2000]}; "
                         f"log tail:\n{tail(self.log_path, 25)}")

    def wait_state(self, want: str, timeout: float = 180.0, poll: float = 0.02) -> dict:
        """Until the deployment's state is want (e.g. serving_ready)."""
        return self.poll_status(lambda st: st.get("state") == want, timeout, f"state {want!r}", poll)[0]

    def terminate(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, the clean stop: its exit status. Still running after timeout
        seconds: killed (with its process group when it has its own session),
        and None."""
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                if os.getpgid(p.pid) == p.pid:
                    os.killpg(p.pid, signal.SIGKILL)
                else:
                    p.kill()
            except ProcessLookupError:
                pass
            p.wait()
            return None

    def kill(self) -> None:
        """SIGKILL (the OOM killer's way) and reap it."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, n: int = 60) -> str:
        return tail(self.log_path, n)
