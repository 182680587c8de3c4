"""Driving the real thing: a `frmps serve` deployment, streaming clients of its
OpenAI endpoint, fault injection (a co-located MPS client running a bench/faults
trigger, or SIGKILL on the CPU path), and one failover trial with everything it
measures. Standard library only.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from . import loglines, proofcount, sse
from .mps import stop_daemon
from .procs import Cleanup, field, kill_group, now, stop_group
from .runctx import TrialError
from .serve import Serve, ServeOpts
from .stats import gaps, med

# ----------------------------------------------------------------------------- streaming client


class Stream(threading.Thread):
    """One streaming /v1/completions request. Records every chunk's arrival time
    and token ids (vLLM's return_token_ids extension), so token counts and gaps
    are exact even when the text is empty (dummy weights)."""

    def __init__(self, base: str, body: dict, timeout: float = 600.0, key: int = 0):
        super().__init__(daemon=True)
        self.base, self.timeout, self.key = base, timeout, key
        self.body = sse.stream_body(body)
        self.chunks: list[tuple[float, list[int]]] = []
        self.usage: dict | None = None
        self.finish: str | None = None
        self.error: str | None = None
        self.t_start = 0.0
        self.t_end = 0.0
        self._n = 0
        self._cond = threading.Condition()

    def run(self) -> None:
        self.t_start = now()
        try:
            with urllib.request.urlopen(sse.request(self.base + "/v1/completions", self.body), timeout=self.timeout) as r:
                for ev in sse.events(r):
                    if ev == sse.DONE:
                        break
                    t = now()
                    if "error" in ev:
                        self.error = json.dumps(ev["error"])[:500]
                        continue
                    if ev.get("usage"):
                        self.usage = ev["usage"]
                    for ch in ev.get("choices") or []:
                        ids = list(ch.get("token_ids") or [])
                        if ids:
                            with self._cond:
                                self.chunks.append((t, ids))
                                self._n += len(ids)
                                self._cond.notify_all()
                        if ch.get("finish_reason"):
                            self.finish = ch["finish_reason"]
        except urllib.error.HTTPError as e:
            self.error = f"HTTP {e.code}: {e.read()[:300]!r}"
        except (urllib.error.URLError, OSError, ValueError) as e:
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.t_end = now()
            with self._cond:
                self._cond.notify_all()

    @property
    def n_tokens(self) -> int:
        return self._n

    def wait_tokens(self, n: int, timeout: float) -> bool:
        """Until the stream has n tokens (True), ends, or timeout passes (False)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._n < n:
                if not self.is_alive() and self.t_end:
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def token_ids(self) -> list[int]:
        return [t for _, ids in self.chunks for t in ids]

    def arrivals(self) -> list[tuple[float, int]]:
        """(arrival time, token count) per chunk."""
        return [(t, len(ids)) for t, ids in self.chunks]


def completion_body(model: str, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0,
                    seed: int | None = None) -> dict:
    body = {"model": model, "prompt": list(prompt_ids), "max_tokens": int(max_tokens), "temperature": temperature,
            "ignore_eos": True}
    if seed is not None:
        body["seed"] = int(seed)
    return body


# ----------------------------------------------------------------------------- deployment


LOG_TAKEOVER, LOG_FIRST, LOG_SLEEP = loglines.TAKEOVER, loglines.FIRST, loglines.SLEEP
grep_first = loglines.grep_first


class Deployment(Serve):
    """One `frmps serve` (supervisor + active + standby) in a private run dir."""

    error = TrialError
    status_timeout = 5.0

    def __init__(self, opts: ServeOpts, workdir: str, name: str, cleanup: Cleanup | None = None):
        # Unix socket paths must stay short (108 bytes): a short private run dir under /tmp.
        run_dir = tempfile.mkdtemp(prefix="frmps-b-", dir="/tmp")
        os.rmdir(run_dir)  # frmps creates it 0700 and removes it at exit
        log_dir = os.path.join(workdir, f"logs-{name}")
        os.makedirs(log_dir, exist_ok=True)
        super().__init__(opts, run_dir, os.path.join(log_dir, "frmps.log"), log_dir)
        self.name = name
        self.cleanup = cleanup
        self.admin = self.admin_addr  # the admin API's host:port

    def start(self) -> None:
        # A session of its own (the stop ends its group), and gone with the driver.
        super().start(own_session=True, parent_death=True)
        if self.cleanup is not None:
            self.cleanup.add(self.stop)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        rc = stop_group(self.proc, grace_s=30)
        if self.opts.mps:
            # frmps quits its MPS daemon on a clean exit; after a kill the daemon would stay.
            try:
                stop_daemon(self.opts.frmps, self.run_dir)
            except TrialError as e:  # best effort, like the rest of a stop
                print(f"deployment {self.name}: {e}", file=sys.stderr)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self.cleanup is not None:
            self.cleanup.remove(self.stop)
        self.proc = None
        return rc

    # -- admin API --------------------------------------------------------------
    @staticmethod
    def engines(st: dict) -> dict[str, dict]:
        return {str(field(e, "role", "")).lower(): e for e in field(st, "engines", []) or []}

    @staticmethod
    def failovers(st: dict) -> list[dict]:
        return list(field(st, "failovers", []) or [])

    def wait(self, pred, timeout: float, what: str, poll: float = 0.02) -> dict:
        return self.poll_status(pred, timeout, what, poll)[0]

    def ready_pair(self, st: dict, fenced_pid: int | None = None, placed: bool = False) -> bool:
        """An active serving and a standby ready, neither of them fenced_pid (the
        engine a failover replaced), and no failback under way. With failback on
        (the default) the standby after a failover is the same process as before
        it, back asleep: "re-armed" cannot mean "a new standby pid". placed: also
        the active inside MPS and the standby outside (the placement a failback
        restores: only then can an MPS client's fault reach the active)."""
        e = self.engines(st)
        act, sb = e.get("active"), e.get("standby")
        fb = field(st, "failback", {}) or {}
        return (act is not None and field(act, "state") == "serving" and sb is not None and field(sb, "state") == "ready"
                and (fenced_pid is None or fenced_pid not in (int(field(act, "pid", 0) or 0), int(field(sb, "pid", 0) or 0)))
                and (field(fb, "state", "disabled") or "disabled") in ("idle", "disabled")
                and (not placed or (bool(field(act, "in_mps", False)) and not field(sb, "in_mps", False))))

    def wait_pair(self, timeout: float = 600, fenced_pid: int | None = None, placed: bool = False) -> dict:
        what = "an active serving inside MPS and a standby ready outside" if placed else "an active serving and a standby ready"
        return self.wait(lambda s: self.ready_pair(s, fenced_pid, placed), timeout, what)

    def mps_client_env(self) -> dict[str, str]:
        """The environment that makes a CUDA process a client of this deployment's MPS server."""
        return {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(self.run_dir, "mps", "pipe"),
                "CUDA_MPS_LOG_DIRECTORY": os.path.join(self.run_dir, "mps", "log")}


# ----------------------------------------------------------------------------- faults


class Trigger:
    """Injects one fault. prepare() before the requests (an MPS client joins then),
    fire() at the kill point; returns what it observed, with t_fault."""

    how = ""

    def prepare(self) -> None:
        pass

    def fire(self) -> dict:
        raise NotImplementedError

    def close(self) -> None:
        pass


class SigkillTrigger(Trigger):
    """CPU path (no MPS): SIGKILL the victim. A check of the harness, not a GPU fault."""

    how = "SIGKILL"

    def __init__(self, pid: int):
        self.pid = pid

    def fire(self) -> dict:
        t = now()
        os.kill(self.pid, signal.SIGKILL)
        return {"how": self.how, "t_fault": t}


class MpsTrigger(Trigger):
    """A bench/faults program run as a client of the victim's MPS server: it joins
    MPS, says "ready", and faults when a byte arrives on stdin. An SM fault in any
    client tears down every client of that server."""

    def __init__(self, faults_dir: str, spec: str, mps_env: dict[str, str], cleanup: Cleanup | None = None):
        prog, _, variant = spec.partition(":")
        if not prog:
            raise ValueError(f"MpsTrigger: no fault program in {spec!r} (give <program>[:<variant>])")
        self.path = os.path.join(faults_dir, prog)
        self.variant = variant
        self.spec = spec
        self.env = {**os.environ, **mps_env}
        self.cleanup = cleanup
        self.how = f"MPS client {spec}"
        self.p: subprocess.Popen | None = None
        self.err: list[str] = []
        self.join_s: float | None = None
        self.fired = False
        self._reader: threading.Thread | None = None

    def prepare(self) -> None:
        if not (os.path.isfile(self.path) and os.access(self.path, os.X_OK)):
            raise TrialError(f"fault trigger {self.path} is missing: build it with `make -C bench/faults`")
        t0 = time.monotonic()
        self.p = subprocess.Popen([self.path, self.variant, "-1"], env=self.env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        if self.cleanup is not None:
            self.cleanup.add_proc(self.p)
        ready = threading.Event()

        def read():  # the only reader of its stderr, to the end
            for line in self.p.stderr:
                self.err.append(line.strip())
                if "ready" in line:
                    ready.set()
            ready.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        if not ready.wait(30) or self.p.poll() is not None:
            raise TrialError(f"fault trigger {self.spec} did not join MPS: {self.err[-3:]}")
        self.join_s = round(time.monotonic() - t0, 3)

    def fire(self) -> dict:
        self.fired = True
        t_gate = now()
        self.p.stdin.write("x")
        self.p.stdin.flush()
        # The program prints "triggering" right before its faulting launch.
        deadline = time.monotonic() + 10
        t_fault = None
        while time.monotonic() < deadline:
            line = next((e for e in self.err if "triggering" in e), None)
            if line is not None:
                # The trigger's own time: reading the line comes later than the fault (on the
                # CPU double, later than the supervisor's detection).
                t_fault = loglines.trigger_time(line) or now()
                break
            time.sleep(0.0005)
        return {"how": self.how, "t_gate": t_gate, "t_fault": t_fault or t_gate, "join_s": self.join_s}

    def close(self) -> dict:
        out = ""
        if self.p is not None:
            if not self.fired:
                kill_group(self.p)  # EOF on its stdin would make it fault: not fired means never fault
            try:
                self.p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                kill_group(self.p)
            try:
                out = self.p.stdout.read()
            except (OSError, ValueError):
                pass
            if self._reader is not None:
                self._reader.join(5)
        return {"trigger_rc": self.p.returncode if self.p else None, "trigger_out": (out or "").strip()[-300:],
                "trigger_err": self.err[-3:]}


# ----------------------------------------------------------------------------- one failover trial


def frmps_trial(dep: Deployment, trigger: Trigger, body: dict, kill_after: int, *, timeout: float = 300.0,
                wait_rearm: bool = True, extra_streams: list[dict] | None = None) -> dict:
    """Stream `body` (plus `extra_streams`), fault the active once the first stream
    has `kill_after` tokens, and measure the failover:

    - recovery_s: the supervisor's first_token_seconds: death detected (control
      socket EOF) -> first resumed token handed to a client by the front door;
    - fault_to_detect_s: trigger's faulting launch -> death detected;
    - ack_s: death detected -> the standby acknowledged Resume;
    - engine_first_token_s: from the promoted engine's own log line;
    - reused/prefilled tokens, client-side gaps and decode step times, token ids.
    """
    st0 = dep.status()
    n0 = len(dep.failovers(st0))
    eng = dep.engines(st0)
    old_standby = eng.get("standby") or {}
    old_active = eng.get("active") or {}
    res: dict = {"kill_after": kill_after, "standby_pid": int(field(old_standby, "pid", 0) or 0)}
    trigger.prepare()
    streams = [Stream(dep.base, body, timeout=timeout)]
    streams += [Stream(dep.base, b, timeout=timeout, key=i + 1) for i, b in enumerate(extra_streams or [])]
    for s in streams:
        s.start()
    main = streams[0]
    try:
        if not main.wait_tokens(kill_after, timeout):
            raise TrialError(f"stream ended or stalled at {main.n_tokens} tokens before the kill point {kill_after} "
                             f"(finish={main.finish}, error={main.error})", res)
        res["tokens_at_fire"] = main.n_tokens
        res["inject"] = trigger.fire()
        t_fault = res["inject"]["t_fault"]

        def recorded(st):
            recs = dep.failovers(st)
            return len(recs) > n0 and field(recs[0], "cause") != "pending"

        st = dep.wait(recorded, 120, "the failover record", poll=0.01)
        rec = dep.failovers(st)[0]
        seq = field(rec, "seq")
        detect = int(field(rec, "unix_nanos", 0) or 0) / 1e9

        def first_token(st):
            # The supervisor notes the first resumed token only if it has recorded the failover by
            # then; if it has not, the client's own first token after detection is the fallback.
            r = next((r for r in dep.failovers(st) if field(r, "seq") == seq), {})
            if float(field(r, "first_token_seconds", 0) or 0) > 0 or all(not s.is_alive() for s in streams):
                return True
            seen = [t for t, _ in main.chunks if t > detect]
            return bool(seen) and now() > seen[0] + 2.0

        st = dep.wait(first_token, 60, "the first resumed token", poll=0.01)
        rec = next(r for r in dep.failovers(st) if field(r, "seq") == seq)
        for s in streams:
            s.join(timeout)
        res["record"] = {k: field(rec, k) for k in ("seq", "cause", "detail", "ok", "error", "duration_seconds",
                                                    "resumed_requests", "reused_tokens", "prefilled_tokens",
                                                    "first_token_seconds")}
        res["detect_unix"] = detect
        res["ok"] = bool(field(rec, "ok", False))
        res["recovery_s"] = float(field(rec, "first_token_seconds", 0) or 0) or None
        res["recovery_source"] = "supervisor first_token_seconds"
        res["ack_s"] = float(field(rec, "duration_seconds", 0) or 0)
        res["reused_tokens"] = int(field(rec, "reused_tokens", 0) or 0)
        res["prefilled_tokens"] = int(field(rec, "prefilled_tokens", 0) or 0)
        res["fault_to_detect_s"] = round(detect - t_fault, 4) if detect else None
        times = [t for t, _ in main.chunks]
        before = [t for t in times if t <= t_fault]
        after = [t for t in times if t > detect]
        res["tokens_before_fault"] = sum(len(ids) for t, ids in main.chunks if t <= t_fault)
        res["client_first_after_detect_s"] = round(after[0] - detect, 4) if after else None
        if res["recovery_s"] is None and res["client_first_after_detect_s"] is not None:
            res["recovery_s"] = res["client_first_after_detect_s"]
            res["recovery_source"] = "client (the supervisor recorded no first resumed token)"
        res["client_gap_s"] = round(after[0] - before[-1], 4) if after and before else None
        # Decode step as the client sees it (batch of these streams), before and after the takeover.
        res["step_before_s"] = med(gaps(before[1:]))
        res["step_after_s"] = med(gaps(after[1:]))
        # Each stream at the fault (proofcount: in flight from the injection to the detected death, its phase).
        ev = [("fault", min(t_fault, detect), max(t_fault, detect))] if detect else []
        res["streams"] = [{"tokens": s.n_tokens, "finish": s.finish, "error": s.error,
                           **proofcount.classify(s.t_start, [t for t, _ in s.chunks], s.t_end, ev, failed=bool(s.error))}
                          for s in streams]
        res["token_ids"] = main.token_ids()
        res["extra_token_ids"] = [s.token_ids() for s in streams[1:]]
        log = field(old_standby, "log_path")
        tk = loglines.grep_last(log, LOG_TAKEOVER)  # a reused pair's promoted engine may have taken over before
        if tk:
            res["takeover_log"] = loglines.takeover_fields(tk)
        fl = loglines.first_time_after(log, LOG_FIRST, detect) if detect else None
        if fl is not None:
            res["engine_first_token_s"] = round(fl - detect, 4)
        if wait_rearm:
            t0 = now()
            dep.wait_pair(300, fenced_pid=int(field(old_active, "pid", 0) or 0))
            res["rearm_s"] = round(now() - detect, 2) if detect else round(now() - t0, 2)
        errs = [s.error for s in streams if s.error]
        if errs:
            raise TrialError(f"client stream error after the failover: {errs[0]}", res)
        if not res["ok"]:
            raise TrialError(f"failover failed: {res['record'].get('error')}", res)
        if res["recovery_s"] is None:
            raise TrialError("no first resumed token was recorded", res)
        return res
    finally:
        res.update(trigger.close() or {})
        for s in streams:
            if s.is_alive():
                s.join(1)
