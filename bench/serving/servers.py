"""The servers under test, started and stopped by the driver: `vllm serve`
(alone, as a client of a private MPS daemon, or that under a restart loop as an
operator would run it), and `frmps serve` (through the harness's Deployment).
Each runs in a process group of its own, registered with the run's Cleanup,
so that however the run ends no server and no MPS daemon is left behind.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

from . import plan as P
from . import profile
from .reuse import (Cleanup, Deployment, MpsDaemon, ServeOpts, TrialError, die_with_parent, field, free_port,
                    http_json, stop_group, tail)

CACHE_INFO = re.compile(r'^vllm:cache_config_info\{([^}]*)\}', re.M)
KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
FRMPS_BLOCKS = re.compile(r"KV block count chosen by the active.*?num_blocks=(\d+)")


def http_ok(url: str, timeout: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def http_text(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode(errors="replace")


def vllm_kv_blocks(metrics_text: str, log_text: str) -> dict:
    """vllm serve's KV cache size: num_gpu_blocks from its /metrics
    (vllm:cache_config_info), else the "GPU KV cache size: N tokens" log line
    divided by the block size."""
    m = CACHE_INFO.search(metrics_text or "")
    if m:
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("num_gpu_blocks", "").isdigit():
            return {"num_blocks": int(labels["num_gpu_blocks"]), "block_size": int(labels.get("block_size") or 0) or None,
                    "gpu_memory_utilization": labels.get("gpu_memory_utilization"), "source": "/metrics cache_config_info"}
    m = KV_TOKENS.search(log_text or "")
    if m:
        tokens = int(m.group(1).replace(",", ""))
        return {"num_blocks": tokens // 16, "block_size": 16, "kv_tokens": tokens,
                "source": "log: GPU KV cache size (block size 16 assumed)"}
    return {"num_blocks": None, "source": "not found in /metrics or the log"}


def frmps_kv_blocks(status: dict) -> dict:
    """frmps's KV budget as its admin status reports it (the active's, else any engine's)."""
    best = None
    for e in field(status, "engines", []) or []:
        kb = field(e, "kv_budget")
        if kb and (best is None or str(field(e, "role", "")).lower() == "active"):
            best = kb
    if not best:
        return {"num_blocks": None, "source": "no KV budget in frmps status"}
    return {"num_blocks": int(field(best, "num_blocks", 0) or 0) or None, "block_bytes": field(best, "block_bytes"),
            "kv_bytes": field(best, "kv_bytes"), "budget_bytes": field(best, "budget_bytes"),
            "utilization": field(best, "utilization"), "source": "frmps status: " + str(field(best, "source", ""))}


class Server:
    """What the driver needs of a server under test."""

    system = ""
    base = ""

    def start(self) -> None: ...

    def wait_ready(self, timeout: float) -> None: ...

    def kv_blocks(self) -> dict: ...

    def stop(self) -> None: ...

    def describe(self) -> dict: ...

    def events(self) -> list[dict]:
        return []

    def root_pid(self) -> int | None:
        """The server's own process (the root of its process tree)."""
        return None

    def roles(self) -> dict[int, str]:
        """pid -> role of the processes worth naming in a CPU account."""
        return {}

    def engine_pid(self) -> int | None:
        """The process that runs the engine's step loop."""
        return profile.engine_pid(self.root_pid())

    def compile_state(self) -> str:
        """How the serving engine got its compiled model (profile.compile_state)."""
        return "unknown"


class VllmServer(Server):
    """`vllm serve` with the plan's alike settings. mps: as a client of a private
    MPS daemon (started through `frmps bench mps start`, its pipe and log
    directories under a private run directory). restart: an operator's
    supervisor loop around it: when the server exits, or stops answering /health
    for health_grace_s, its process group is killed and it is started again;
    every exit and every return to service is an event with its time
    (time.perf_counter, the clock of vllm bench serve's start_times)."""

    def __init__(self, plan: P.Plan, workdir: str, cleanup: Cleanup, *, mps: bool = False, restart: bool = False,
                 health_grace_s: float = 5.0):
        self.plan = plan
        self.system = P.VLLM_MPS_RESTART if restart else (P.VLLM_MPS if mps else P.VLLM)
        self.cleanup = cleanup
        self.mps, self.restart = mps, restart
        self.health_grace_s = health_grace_s
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_dir = os.path.join(workdir, f"logs-{self.system}")
        os.makedirs(self.log_dir, exist_ok=True)
        self.log_path = os.path.join(self.log_dir, "vllm-serve.log")
        self.daemon: MpsDaemon | None = None
        self.mps_run_dir = ""
        self.env: dict[str, str] = {}
        self.proc: subprocess.Popen | None = None
        self._log = None
        self._events: list[dict] = []
        self._stop = threading.Event()
        self._loop: threading.Thread | None = None
        self._lock = threading.Lock()
        self.starts = 0

    def command(self) -> list[str]:
        return self.plan.vllm_serve_cmd(self.port)

    def mps_client_env(self) -> dict[str, str]:
        return dict(self.daemon.env) if self.daemon else {}

    def root_pid(self) -> int | None:
        p = self.proc
        return p.pid if p is not None and p.poll() is None else None

    def roles(self) -> dict[int, str]:
        root = self.root_pid()
        eng = self.engine_pid()
        out = {root: "api server"} if root else {}
        if eng and eng != root:
            out[eng] = "engine core"
        return out

    def start(self) -> None:
        if self.mps:
            # Unix socket paths must stay short: a private run dir under /tmp.
            self.mps_run_dir = tempfile.mkdtemp(prefix="frmps-sv-", dir="/tmp")
            self.daemon = MpsDaemon(self.plan.frmps, self.mps_run_dir)
            self.cleanup.add(self._stop_daemon)
            self.daemon.start()
            self.env = dict(self.daemon.env)
        self._log = open(self.log_path, "ab")
        self.cleanup.add(self.stop)
        self._spawn(main_thread=True)
        if self.restart:
            self._loop = threading.Thread(target=self._supervise, name="vllm-restart-loop", daemon=True)

    def _spawn(self, main_thread: bool = False) -> None:
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        self._log.write(f"\n=== start {self.starts + 1}: {P.shell(self.command())}\n".encode())
        self._log.flush()
        p = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True, preexec_fn=die_with_parent() if main_thread else None)
        self.cleanup.add_proc(p)
        with self._lock:
            self.proc = p
            self.starts += 1

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise TrialError(f"{self.system}: vllm serve exited ({self.proc.returncode if self.proc else '-'}) "
                                 f"before it answered; log tail:\n{tail(self.log_path, 25)}")
            if http_ok(self.base + "/v1/models"):
                self._events.append({"t": time.perf_counter(), "event": "ready", "start": self.starts})
                if self._loop is not None and not self._loop.is_alive():
                    self._loop.start()
                return
            time.sleep(0.5)
        raise TrialError(f"{self.system}: vllm serve did not answer within {timeout:.0f} s; log tail:\n"
                         f"{tail(self.log_path, 25)}")

    def _supervise(self) -> None:
        """The restart loop (an operator's): exit or /health down -> kill the group, start again."""
        bad_since = None
        while not self._stop.is_set():
            p = self.proc
            rc = p.poll() if p is not None else None
            healthy = rc is None and http_ok(self.base + "/health", timeout=1.0)
            if healthy:
                bad_since = None
            elif rc is None and bad_since is None:
                bad_since = time.monotonic()
            if rc is not None or (bad_since is not None and time.monotonic() - bad_since > self.health_grace_s):
                if self._stop.is_set():
                    return
                self._events.append({"t": time.perf_counter(), "event": "exit" if rc is not None else "unhealthy",
                                     "rc": rc, "start": self.starts})
                stop_group(p, grace_s=5)
                bad_since = None
                if self._stop.is_set():
                    return
                self._spawn()
                deadline = time.monotonic() + self.plan.ready_timeout_s
                while not self._stop.is_set() and time.monotonic() < deadline:
                    if self.proc.poll() is not None:
                        break  # died while starting: the outer loop restarts it
                    if http_ok(self.base + "/v1/models"):
                        self._events.append({"t": time.perf_counter(), "event": "ready", "start": self.starts})
                        break
                    time.sleep(0.25)
                continue
            self._stop.wait(0.25)

    def kv_blocks(self) -> dict:
        try:
            metrics = http_text(self.base + "/metrics")
        except (urllib.error.URLError, OSError):
            metrics = ""
        try:
            with open(self.log_path, errors="replace") as f:
                log = f.read()
        except OSError:
            log = ""
        return vllm_kv_blocks(metrics, log)

    def _stop_daemon(self) -> None:
        if self.daemon is not None:
            d, self.daemon = self.daemon, None
            d.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._loop is not None and self._loop.is_alive():
            self._loop.join(30)
        with self._lock:
            p, self.proc = self.proc, None
        if p is not None:
            stop_group(p, grace_s=30)
        try:
            self._stop_daemon()
        finally:
            self.cleanup.remove(self._stop_daemon)
            self.cleanup.remove(self.stop)
            if self._log is not None:
                self._log.close()
                self._log = None

    def events(self) -> list[dict]:
        return list(self._events)

    def compile_state(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                text = f.read()
        except OSError:
            return "unknown"
        return profile.compile_state(text[text.rfind("=== start"):])

    def describe(self) -> dict:
        return {"system": self.system, "command": self.command(), "mps": self.mps, "restart_loop": self.restart,
                "env": {k: v for k, v in self.env.items() if k.startswith("CUDA_MPS_")}, "log": self.log_path,
                "starts": self.starts}


class FrmpsDeployment(Deployment):
    """The harness's Deployment with the plan's command line: `frmps serve --model M`
    at its defaults plus the alike settings (and --frontend vllm)."""

    def __init__(self, plan: P.Plan, system: str, workdir: str, cleanup: Cleanup):
        opts = ServeOpts(frmps=plan.frmps, python=plan.python, model=plan.model, mps=plan.device != "cpu")
        super().__init__(opts, workdir, system, cleanup)
        self.plan = plan
        self.system = system

    def command(self) -> list[str]:
        return self.plan.frmps_serve_cmd(self.system, self.port, self.admin, self.run_dir, self.log_dir)


class FrmpsServer(Server):
    def __init__(self, plan: P.Plan, system: str, workdir: str, cleanup: Cleanup):
        self.plan = plan
        self.system = system
        self.dep = FrmpsDeployment(plan, system, workdir, cleanup)
        self.base = self.dep.base
        self.log_path = self.dep.log_path

    def command(self) -> list[str]:
        return self.dep.command()

    def start(self) -> None:
        self.dep.start()

    def wait_ready(self, timeout: float) -> None:
        t0 = time.monotonic()
        placed = self.plan.device != "cpu"
        self.dep.wait_pair(timeout=timeout, placed=placed)
        # The spare starts once the pair is ready: its start (imports, a CUDA
        # context) is not left to overlap the first trials.
        self.dep.wait(lambda s: spare_settled(s), max(30.0, timeout - (time.monotonic() - t0)), "the spare ready")
        while not http_ok(self.base + "/v1/models"):
            if time.monotonic() - t0 > timeout:
                raise TrialError(f"{self.system}: the OpenAI endpoint did not answer within {timeout:.0f} s; "
                                 f"log tail:\n{tail(self.log_path, 25)}")
            if self.dep.proc is None or self.dep.proc.poll() is not None:
                raise TrialError(f"{self.system}: frmps serve exited; log tail:\n{tail(self.log_path, 25)}")
            time.sleep(0.5)

    def status(self) -> dict:
        return self.dep.status()

    def await_standby(self, timeout: float) -> float:
        """Until an active serves with a standby ready behind it (the state a
        fault of the active is a failover from); the seconds it took."""
        t0 = time.monotonic()
        self.dep.wait_pair(timeout=timeout)
        return time.monotonic() - t0

    def active_pid(self) -> int | None:
        act = self.dep.engines(self.status()).get("active")
        return int(field(act, "pid", 0) or 0) or None if act else None

    def root_pid(self) -> int | None:
        p = self.dep.proc
        return p.pid if p is not None and p.poll() is None else None

    def roles(self) -> dict[int, str]:
        out: dict[int, str] = {}
        root = self.root_pid()
        if root:
            out[root] = "frmps supervisor"
        try:
            for role, e in self.dep.engines(self.status()).items():
                pid = int(field(e, "pid", 0) or 0)
                if pid:
                    out[pid] = f"{role} engine"
        except (urllib.error.URLError, OSError, ValueError):
            pass
        return out

    def engine_pid(self) -> int | None:
        try:
            return self.active_pid()
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def mps_client_env(self) -> dict[str, str]:
        return self.dep.mps_client_env()

    def kv_blocks(self) -> dict:
        try:
            kv = frmps_kv_blocks(self.status())
        except (urllib.error.URLError, OSError, ValueError) as e:
            kv = {"num_blocks": None, "source": f"frmps status failed: {e}"}
        if kv.get("num_blocks") is None:
            # An engine that reports no budget (the reference engine): the supervisor's log line.
            try:
                with open(self.log_path, errors="replace") as f:
                    m = FRMPS_BLOCKS.search(f.read())
            except OSError:
                m = None
            if m:
                kv = {"num_blocks": int(m.group(1)), "source": "frmps log: KV block count chosen by the active"}
        return kv

    def stop(self) -> None:
        self.dep.stop()

    def failovers(self) -> list[dict]:
        try:
            return self.dep.failovers(self.status())
        except (urllib.error.URLError, OSError, ValueError):
            return []

    def compile_state(self) -> str:
        try:
            act = self.dep.engines(self.status()).get("active") or {}
            with open(str(field(act, "log_path", "") or ""), errors="replace") as f:
                return profile.compile_state(f.read())
        except (urllib.error.URLError, OSError, ValueError):
            return "unknown"

    def failover_drill(self, timeout: float) -> dict:
        """The admin API's failover drill (the supervisor SIGKILLs the active; the
        standby takes over), then the failback that restores the placement, and a
        ready spare: afterwards the active is an engine started after the first
        (a restored one, its compiled model loaded from the cache), as after any
        fault."""
        t0 = time.monotonic()
        placed = self.plan.device != "cpu"
        # A failover needs a ready standby: the engine that starts beside the active may
        # still be starting when the first trials are done (a loaded machine, a cold cache).
        st = self.dep.wait_pair(timeout, placed=placed)
        before = int(field(field(st, "failback", {}) or {}, "succeeded", 0) or 0)
        n_failovers = len(self.dep.failovers(st))
        old_pid = int(field(self.dep.engines(st).get("active") or {}, "pid", 0) or 0)
        r = http_json(f"http://{self.dep.admin}/v1/admin/failover", {"reason": "frmps bench serving"}, timeout=10)
        if not field(r, "accepted", False):
            raise TrialError(f"{self.system}: the failover drill was refused: {r}")

        def back(s: dict) -> bool:
            # The drill's failover recorded and its active gone from the pair; with
            # placement (MPS), the failback after it done as well.
            new = int(field(self.dep.engines(s).get("active") or {}, "pid", 0) or 0)
            if len(self.dep.failovers(s)) <= n_failovers or new in (0, old_pid):
                return False
            fb = field(s, "failback", {}) or {}
            done = int(field(fb, "succeeded", 0) or 0) > before or not placed
            return done and self.dep.ready_pair(s, fenced_pid=old_pid, placed=placed) and spare_settled(s)

        st = self.dep.wait(back, timeout, "the failover drill's takeover, failback and a ready spare")
        new = self.dep.engines(st).get("active") or {}
        return {"drill_s": round(time.monotonic() - t0, 1), "active_pid_before": old_pid,
                "active_pid_after": field(new, "pid"), "active_from_spare": field(new, "from_spare"),
                "failbacks": int(field(field(st, "failback", {}) or {}, "succeeded", 0) or 0)}

    def describe(self) -> dict:
        return {"system": self.system, "command": self.command(), "log": self.log_path, "run_dir": self.dep.run_dir}


def spare_settled(st: dict) -> bool:
    """No spare about to start or starting: spares off (the CPU's default), or
    the spare ready, off or in backoff ("none" with spares on: not started yet)."""
    sp = field(st, "spare", {}) or {}
    if not field(sp, "enabled", False):
        return True
    state = str(field(sp, "state", "") or "")
    return state in ("ready", "backoff") or state.startswith("off")


def make_server(plan: P.Plan, system: str, workdir: str, cleanup: Cleanup) -> Server:
    if system == P.VLLM:
        return VllmServer(plan, workdir, cleanup)
    if system == P.VLLM_MPS:
        return VllmServer(plan, workdir, cleanup, mps=True)
    if system == P.VLLM_MPS_RESTART:
        return VllmServer(plan, workdir, cleanup, mps=True, restart=True)
    if system in P.FRMPS_SYSTEMS:
        return FrmpsServer(plan, system, workdir, cleanup)
    raise ValueError(f"unknown system {system!r}")

