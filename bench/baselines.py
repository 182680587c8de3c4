"""The baselines, driven from the bench driver (standard library only):

- sleep-only: a standby process that holds the weights in pinned host memory and
  no GPU weight or KV memory; on the victim's death it is told to wake: it
  re-creates its pools at the same addresses, copies the weights back, re-prefills
  (prompt + tokens the client already has) and emits the next token. Like vLLM's
  sleep mode level 1.
- cold restart: on the victim's death a new engine process starts, creates its
  CUDA context, allocates its pools, loads the weights from a safetensors
  checkpoint on local disk, captures its decode graphs (as a serving engine does
  before it takes requests), re-prefills and emits the next token.

Both use the reference engine with the same model, seeded weights and pool sizes
as `frmps serve`. The victim is an engine process serving the same request; on the
GPU it runs inside a private MPS server and a co-located MPS client faults it.
Recovery is timed from the moment the driver's waitpid() returns for the victim
to the moment the driver reads the recovered engine's first token.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import threading
import time
from typing import Callable

from .procs import Cleanup, die_with_parent, kill_group, now, tail, with_bench_path
from .runctx import TrialError
from .deploy import MpsTrigger, SigkillTrigger
from .mps import MpsDaemon, outside_mps_env


class EngineProc:
    """A baseline_engine child: JSON-line events on stdout (each stamped with the
    driver's receipt time "rt"), commands on stdin, and a watcher that notes the
    moment the process is reaped and runs the on_exit callbacks right then."""

    def __init__(self, role: str, python: str, args: list[str], env: dict[str, str], log_path: str,
                 cleanup: Cleanup | None = None, on_exit: Callable[["EngineProc"], None] | None = None):
        self.role = role
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.events: list[dict] = []
        self._cond = threading.Condition()
        self.t_exit: float | None = None
        self.rc: int | None = None
        self._on_exit = on_exit
        self.t_spawn = now()
        self.p = subprocess.Popen([python, "-m", "bench.baseline_engine", role, *args],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                  env=with_bench_path({**os.environ, **env}), start_new_session=True,
                                  preexec_fn=die_with_parent())
        if cleanup is not None:
            cleanup.add_proc(self.p)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        threading.Thread(target=self._watch, daemon=True).start()

    @property
    def pid(self) -> int:
        return self.p.pid

    def _read(self) -> None:
        for raw in self.p.stdout:
            rt = now()
            try:
                ev = json.loads(raw)
            except ValueError:
                continue
            ev["rt"] = rt
            with self._cond:
                self.events.append(ev)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _watch(self) -> None:
        rc = self.p.wait()
        t = now()
        with self._cond:
            self.t_exit, self.rc = t, rc
            self._cond.notify_all()
        if self._on_exit is not None:
            self._on_exit(self)

    def drain(self, timeout: float = 1.0) -> None:
        """After exit: wait until every line it wrote has been read."""
        self._reader.join(timeout)

    def send(self, cmd: dict) -> None:
        self.p.stdin.write((json.dumps(cmd) + "\n").encode())
        self.p.stdin.flush()

    def wait_event(self, pred: Callable[[dict], bool], timeout: float, what: str, start: int = 0) -> dict:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for ev in self.events[start:]:
                    if ev.get("ev") == "error":
                        raise TrialError(f"{self.role}: {ev.get('error')}\n{ev.get('trace', '')[-1500:]}")
                    if pred(ev):
                        return ev
                if self.t_exit is not None and not self._reader.is_alive():
                    raise TrialError(f"{self.role} exited ({self.rc}) while waiting for {what}; stderr tail:\n"
                                     f"{tail(self.log_path, 20)}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TrialError(f"{self.role}: timed out after {timeout:.0f} s waiting for {what}; stderr tail:\n"
                                     f"{tail(self.log_path, 20)}")
                self._cond.wait(min(left, 0.1))

    def tokens(self, key: int) -> list[int]:
        out: list[int] = []
        with self._cond:
            for ev in self.events:
                if ev.get("ev") in ("tok", "first_token") and ev.get("key") == key:
                    i = int(ev["i"])
                    ids = list(ev["ids"])
                    if i == len(out):
                        out.extend(ids)
                    elif i < len(out):  # a recovered engine re-emits from the index it resumed at
                        out[i:] = ids
        return out

    def token_events(self) -> list[dict]:
        with self._cond:
            return [ev for ev in self.events if ev.get("ev") in ("tok", "first_token")]

    def close(self, timeout: float = 20.0) -> None:
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        kill_group(self.p)
        self._log.close()


# ----------------------------------------------------------------------------- checkpoints and page cache


# baseline_engine.CHECKPOINT_FORMAT (not imported: that module times its own imports).
CHECKPOINT_FORMAT = 2


def checkpoint_dir(cache_dir: str, model: str, seed: int, device: str) -> str:
    kind = "cpu" if device == "cpu" else "cuda"  # dummy weights come from the device's own generator
    return os.path.join(cache_dir, f"{model}-seed{seed}-{kind}")


def checkpoint_meta(path: str) -> dict | None:
    try:
        with open(os.path.join(path, "frmps-checkpoint.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def ensure_checkpoint(python: str, cache_dir: str, model: str, seed: int, device: str, engine_args: list[str],
                      log_path: str, log: Callable[[str], None], cleanup: Cleanup | None = None,
                      env: dict[str, str] | None = None) -> tuple[str, dict]:
    """The model's dummy weights as a safetensors checkpoint, written once and cached."""
    path = checkpoint_dir(cache_dir, model, seed, device)
    meta = checkpoint_meta(path)
    if meta and meta.get("model") == model and meta.get("seed") == seed and meta.get("format") == CHECKPOINT_FORMAT:
        return path, {**meta, "cached": True}
    os.makedirs(cache_dir, exist_ok=True)
    log(f"writing the {model} checkpoint to {path} (once; cached for later runs)")
    proc = EngineProc("write-checkpoint", python, ["--model", model, "--device", device, "--seed", str(seed),
                                                   "--out", path, *engine_args], env or {}, log_path, cleanup)
    try:
        ev = proc.wait_event(lambda e: e.get("ev") == "done", 1800, "the checkpoint")
    finally:
        proc.close()
    ev.pop("rt", None)
    return path, {**ev, "cached": False}


def checkpoint_files(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))


def drop_page_cache(paths: list[str]) -> None:
    """Ask the kernel to drop these (clean, fsynced) files from the page cache; no root needed."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def page_cache_fraction(paths: list[str]) -> float | None:
    """Fraction of these files' pages resident in the page cache (mincore)."""
    try:
        from frmps_engine.sdk.memory import _libc
    except ImportError:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for p in paths:
        size = os.path.getsize(p)
        if size == 0:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = _libc.mmap(0, size, _libc.PROT_READ, _libc.MAP_SHARED, fd)
        finally:
            os.close(fd)
        try:
            n = (size + page - 1) // page
            vec = (ctypes.c_ubyte * n)()
            if libc.mincore(addr, size, vec) != 0:
                return None
            bs = bytes(vec)
            resident += len(bs) - bs.count(0)  # only the low bit is defined; the others are reserved (0)
            total += n
        finally:
            _libc.munmap(addr, size)
    return round(resident / total, 4) if total else None


# ----------------------------------------------------------------------------- one baseline trial


class BaselineRig:
    """What one baseline trial needs: how to start engines, where the victim runs,
    how it is faulted."""

    def __init__(self, frmps: str, python: str, device: str, mps: bool, faults_dir: str, fault: str, workdir: str,
                 engine_args: list[str], cleanup: Cleanup | None, log: Callable[[str], None], engine: str = "ref"):
        self.frmps = frmps
        self.engine = engine
        self.python, self.device, self.mps = python, device, mps
        self.faults_dir, self.fault = faults_dir, fault
        self.workdir = workdir
        self.engine_args = engine_args
        self.cleanup = cleanup
        self.log = log
        self.outside_env = outside_mps_env(frmps, workdir) if mps else {}
        self.victim_env: dict[str, str] = {}
        self._n = 0

    def logfile(self, what: str) -> str:
        self._n += 1
        d = os.path.join(self.workdir, "baseline-logs")
        os.makedirs(d, exist_ok=True)
        return os.path.join(d, f"{self._n:03d}-{what}.log")

    def start_sleep_standby(self, model: str, timeout: float = 900) -> tuple[EngineProc, dict]:
        sb = EngineProc("sleep", self.python, ["--engine", self.engine, "--model", model, "--device", self.device,
                                               *self.engine_args],
                        self.outside_env, self.logfile(f"sleep-{model}"), self.cleanup)
        ev = sb.wait_event(lambda e: e.get("ev") == "ready", timeout, "the sleep-only standby to be ready")
        return sb, ev

    def trial(self, system: str, model: str, requests: list[dict], kill_after: int, *, standby: EngineProc | None = None,
              checkpoint: str | None = None, cold_warmup: bool = True, then_steps: int = 0,
              victim_args: list[str] | None = None, kill_at_s: float | None = None, timeout: float = 600,
              fault: str = "") -> dict:
        """Start a victim (inside a private MPS server on the GPU), send it `requests`,
        fault it once request 0 has `kill_after` tokens (or `kill_at_s` after the
        first token) with the trigger `fault` (default: the rig's), and recover with
        `system` ("sleep-only" or "cold")."""
        res: dict = {"system": system, "kill_after": kill_after}
        daemon = None
        if self.mps:
            daemon = MpsDaemon(self.frmps, os.path.join(self.workdir, f"mps-{os.getpid()}-{self._n}"))
            daemon.start()
        victim: EngineProc | None = None
        trig = None
        box: dict = {}
        recovering = threading.Event()
        armed = threading.Event()  # only a death we caused starts a recovery
        try:
            def on_death(v: EngineProc) -> None:
                if not armed.is_set():
                    return
                box["t_death"] = v.t_exit
                v.drain(1.0)
                reqs = [{**r, "delivered": v.tokens(int(r["key"]))} for r in requests]
                box["delivered"] = [len(r["delivered"]) for r in reqs]
                try:
                    if system == "sleep-only":
                        box["wake_sent"] = True
                        standby.send({"cmd": "wake", "requests": reqs, "then_steps": then_steps})
                    else:
                        rq = os.path.join(self.workdir, f"requests-{os.getpid()}-{self._n}.json")
                        with open(rq, "w") as f:
                            json.dump(reqs, f)
                        box["requests_file"] = rq
                        box["cold"] = EngineProc("cold", self.python, [
                            "--engine", self.engine, "--model", model, "--device", self.device, "--checkpoint", checkpoint,
                            "--requests", "@" + rq, "--warmup", "1" if cold_warmup else "0",
                            "--then-steps", str(then_steps), *self.engine_args,
                        ], self.outside_env, self.logfile(f"cold-{model}"), self.cleanup)
                    box["t_recover_started"] = now()
                except Exception as e:  # reported by the waiting thread
                    box["error"] = f"{type(e).__name__}: {e}"
                recovering.set()

            venv = {**(daemon.env if daemon else {}), **self.victim_env}
            victim = EngineProc("victim", self.python,
                                ["--engine", self.engine, "--model", model, "--device", self.device, "--warmup", "0",
                                 *self.engine_args,
                                 *(victim_args or [])],
                                venv, self.logfile(f"victim-{model}"), self.cleanup, on_exit=on_death)
            ready = victim.wait_event(lambda e: e.get("ev") == "ready", 600, "the victim to be ready")
            res["victim_init_s"] = ready.get("init_s")
            trig = (MpsTrigger(self.faults_dir, fault or self.fault, daemon.env, self.cleanup) if daemon
                    else SigkillTrigger(victim.pid))
            trig.prepare()
            n_ev = len(sleep_events(standby))
            victim.send({"cmd": "generate", "requests": requests})
            k0 = int(requests[0]["key"])
            first = victim.wait_event(lambda e: e.get("ev") == "tok" and e.get("key") == k0, 600, "the victim's first token")
            if kill_at_s:
                time.sleep(max(0.0, first["rt"] + kill_at_s - now()))
            else:
                deadline = time.monotonic() + 600
                while len(victim.tokens(k0)) < kill_after:
                    if victim.t_exit is not None or time.monotonic() > deadline:
                        raise TrialError(f"victim stopped before {kill_after} tokens", res)
                    time.sleep(0.0005)
            res["tokens_at_fire"] = len(victim.tokens(k0))
            armed.set()
            res["inject"] = trig.fire()
            if not recovering.wait(120):
                raise TrialError("the victim did not die within 120 s of the fault", res)
            if "error" in box:
                raise TrialError(f"starting the recovery failed: {box['error']}", res)
            t_death = box["t_death"]
            res["fault_to_death_s"] = round(t_death - res["inject"]["t_fault"], 4)
            res["death_to_recovery_started_s"] = round(box["t_recover_started"] - t_death, 6)
            res["delivered"] = box["delivered"]
            res["victim_rc"] = victim.rc
            res["victim_fault"] = next((e.get("error") for e in victim.events if e.get("ev") == "fault"), None)
            keys = {int(r["key"]) for r in requests}
            if system == "sleep-only":
                proc, start = standby, n_ev
                done = proc.wait_event(lambda e: e.get("ev") == "woke", timeout, "the wake", start=start)
                res["wake"] = {k: v for k, v in done.items() if k not in ("ev", "t", "rt")}
            else:
                proc, start = box["cold"], 0
                done = proc.wait_event(lambda e: e.get("ev") == "recovered", timeout, "the cold engine's recovery")
                res["cold"] = {k: v for k, v in done.items() if k not in ("ev", "t", "rt")}
            firsts = [e for e in proc.events[start:] if e.get("ev") == "first_token" and e.get("key") in keys]
            if len(firsts) != len(keys):
                raise TrialError(f"{len(firsts)} of {len(keys)} requests recovered", res)
            res["recovery_s"] = round(min(e["rt"] for e in firsts) - t_death, 6)
            res["recovery_all_s"] = round(max(e["rt"] for e in firsts) - t_death, 6)
            res["engine_first_token_s"] = round(min(e["t"] for e in firsts) - t_death, 6)
            # Token streams around the fault (exp. 5 plots throughput from them).
            res["victim_last_token_unix"] = max((e["rt"] for e in victim.token_events()), default=None)
            res["first_token_ids"] = {str(e["key"]): e["ids"] for e in firsts}
            res["t_death_unix"] = t_death
            if then_steps:
                proc.wait_event(lambda e: e.get("ev") == "decoded", timeout, "decoding after recovery", start=start)
            res["arrivals"] = [(e["rt"], len(e["ids"])) for e in victim.token_events()] + \
                [(e["rt"], len(e["ids"])) for e in proc.events[start:] if e.get("ev") in ("tok", "first_token")]
            if system == "sleep-only":
                n = len(standby.events)
                standby.send({"cmd": "sleep"})
                standby.wait_event(lambda e: e.get("ev") == "slept", 120, "the standby to sleep again", start=n)
                box["slept_again"] = True
            return res
        finally:
            armed.clear()  # closing a victim that outlived the trial must not start a recovery
            if box.get("wake_sent") and not box.get("slept_again") and standby.p.poll() is None:
                try:  # a failed trial must not leave the next one a standby that is awake
                    n = len(standby.events)
                    standby.send({"cmd": "sleep"})
                    standby.wait_event(lambda e: e.get("ev") in ("slept", "error"), 120, "the standby to sleep", start=n)
                except (TrialError, OSError):
                    pass
            if trig is not None:
                res.update(trig.close() or {})
            if victim is not None:
                victim.close(timeout=5)
            if "cold" in box:
                box["cold"].close(timeout=10)
            if box.get("requests_file"):
                try:
                    os.unlink(box["requests_file"])
                except FileNotFoundError:
                    pass
            if daemon is not None:
                daemon.stop()


def sleep_events(standby: EngineProc | None) -> list[dict]:
    return list(standby.events) if standby is not None else []


def python_has_module(python: str, module: str) -> bool:
    r = subprocess.run([python, "-c", f"import {module}"], capture_output=True, timeout=120)
    return r.returncode == 0


def engine_supports(python: str, flag: str, _cache: dict = {}) -> bool:  # noqa: B006 (a deliberate cache)
    """Does `python -m frmps_engine.cli serve` accept `flag` (e.g. --no-kv-reuse, --exact)?"""
    if python not in _cache:
        r = subprocess.run([python, "-m", "frmps_engine.cli", "serve", "--help"], capture_output=True, text=True,
                           timeout=120)
        _cache[python] = r.stdout + r.stderr
    return flag in _cache[python]


