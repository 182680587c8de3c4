"""Fault mode: the request stream at one moderate rate for a window of several
minutes while a co-located MPS client faults every `spacing` seconds, rotating
the SM-fault kinds (bench/faults triggers, through the harness's MpsTrigger).
Per system: the baseline `vllm serve` in MPS under a restart loop (every fault
a cold restart), frmps at its defaults, frmps with --frontend vllm. On the CPU
(a check of the harness) the fault is SIGKILL of frmps's active engine.

The timeline is read from vllm bench serve's per-request detail: a request's
chunks arrive at start + ttft + the running sum of its itls (the client's
time.perf_counter(), the clock the faults are stamped with here).
"""

from __future__ import annotations

import json
import os
import threading
import time

from . import plan as P
from . import report, results
from .client import Client
from .reuse import Cleanup, MpsTrigger, SigkillTrigger, TrialError, tail
from .run import bench_client, client_timeout, run_client
from .servers import FrmpsServer, VllmServer, make_server


def fault_times(window_s: float, spacing_s: float, first_s: float | None = None) -> list[float]:
    """Fault offsets from the client's start: every spacing_s from first_s
    (default: one spacing), none in the last spacing/2 of the window, so each
    fault's effect lands inside it."""
    if spacing_s <= 0 or window_s <= 0:
        raise ValueError("the window and the spacing must be positive")
    t = spacing_s if first_s is None else first_s
    out = []
    while t <= window_s - spacing_s / 2:
        out.append(round(t, 3))
        t += spacing_s
    return out


def timeline(rows: list[dict], t0: float, window_s: float, bin_s: float = 1.0) -> dict:
    """Output tokens per second in bin_s bins from t0 (a request's tokens spread
    evenly over its chunks: a chunk may carry several), and the start of every
    failed request, relative to t0."""
    n = max(1, int(window_s / bin_s) + 1)
    tokens = [0.0] * n
    failed = []
    for r in rows:
        if not r["success"]:
            failed.append(round(r["start"] - t0, 3))
            continue
        times = [r["start"] + r["ttft"]]
        for g in r["itls"]:
            times.append(times[-1] + g)
        per = r["output_len"] / len(times) if times else 0.0
        for t in times:
            i = int((t - t0) / bin_s)
            if 0 <= i < n:
                tokens[i] += per
    return {"t": [round(i * bin_s, 3) for i in range(n)], "tokens_per_s": [round(x / bin_s, 2) for x in tokens],
            "failed_starts": failed}


def summarize(raw: dict, slo_ttft_ms: float, slo_tpot_ms: float, min_output_len: int) -> dict:
    rec = results.trial_record(raw, slo_ttft_ms, slo_tpot_ms, min_output_len)
    dur = rec.get("duration") or 0
    return {"sent": rec["sent"], "completed": rec.get("completed"), "failed": rec.get("failed"),
            "truncated": rec.get("truncated"), "good": rec.get("good"),
            "goodput_rps": (rec["good"] / dur) if dur and rec.get("good") is not None else None,
            "slo_attainment": rec.get("slo_attainment"), "p99_ttft_ms": rec.get("p99_ttft_ms"),
            "p99_tpot_ms": rec.get("p99_tpot_ms"), "p50_tpot_ms": rec.get("p50_tpot_ms"),
            "longest_gap_ms": rec.get("longest_gap_ms"), "output_throughput": rec.get("output_throughput"),
            "duration": dur}


def slo_phases(rows: list[dict], t0: float, first_fault_rel: float, slo_ttft_ms: float,
               slo_tpot_ms: float) -> dict:
    """The same run's no-fault reference: the requests that ended before the first
    fault (``before``) against every other one (``from_fault``: in flight at it or
    sent after it; a failed request counts by its start, as in flight). Each: sent,
    good (both SLOs met), failed and slo_attainment."""
    cut = t0 + first_fault_rel
    parts = {"before": [], "from_fault": []}
    for r in rows:
        end = r["start"] + r["ttft"] + sum(r["itls"])
        parts["before" if r["success"] and end < cut else "from_fault"].append(r)
    out = {}
    for name, rs in parts.items():
        n_good = sum(results.good(r, slo_ttft_ms, slo_tpot_ms) for r in rs)
        out[name] = {"sent": len(rs), "good": n_good, "failed": sum(1 for r in rs if not r["success"]),
                     "slo_attainment": n_good / len(rs) if rs else None}
    return out


def down_spans(events: list[dict], t0: float) -> list[list[float]]:
    """[exit, ready] spans of a restart loop's server, relative to t0."""
    spans, down = [], None
    for e in sorted(events, key=lambda e: e["t"]):
        if e["event"] in ("exit", "unhealthy") and down is None:
            down = e["t"]
        elif e["event"] == "ready" and down is not None:
            spans.append([round(down - t0, 3), round(e["t"] - t0, 3)])
            down = None
    if down is not None:
        spans.append([round(down - t0, 3), None])
    return spans


# The longest a CPU fault waits for its standby (FrmpsServer.await_standby).
STANDBY_WAIT_S = 120.0


class Injector(threading.Thread):
    """Fires the faults at their offsets from the client's main-run start."""

    def __init__(self, srv, plan: P.Plan, offsets: list[float], kinds: list[str], faults_dir: str, cleanup: Cleanup):
        super().__init__(name="fault-injector", daemon=True)
        self.srv, self.plan, self.offsets, self.kinds = srv, plan, offsets, kinds
        self.faults_dir, self.cleanup = faults_dir, cleanup
        self.t0: float | None = None
        self.started = threading.Event()
        self.stop = threading.Event()
        self.fired: list[dict] = []

    def begin(self, t0: float) -> None:
        self.t0 = t0
        self.started.set()

    def _trigger(self, kind: str):
        if self.plan.device == "cpu":
            pid = self.srv.active_pid() if isinstance(self.srv, FrmpsServer) else None
            if not pid:
                raise TrialError("no active engine to SIGKILL")
            return SigkillTrigger(pid)
        env = self.srv.mps_client_env()
        if not env:
            raise TrialError(f"{self.srv.system}: no MPS daemon to join")
        return MpsTrigger(self.faults_dir, kind, env, self.cleanup)

    def run(self) -> None:
        if not self.started.wait(600) or self.stop.is_set():
            return
        for i, off in enumerate(self.offsets):
            kind = self.kinds[i % len(self.kinds)] if self.plan.device != "cpu" else "SIGKILL"
            # Join MPS a little before the fault (the trigger's CUDA start takes a moment).
            if self.stop.wait(max(0.0, self.t0 + off - 3.0 - time.perf_counter())):
                return
            rec = {"i": i, "kind": kind, "planned_rel": off}
            trig = None
            try:
                if self.plan.device == "cpu" and isinstance(self.srv, FrmpsServer):
                    # The CPU's SIGKILL checks the harness's failover path: it waits
                    # for the standby a failover needs (the one started after the last
                    # fault may take longer than a spacing on a loaded host), and
                    # says how long. The GPU's faults keep their schedule.
                    rec["waited_for_standby_s"] = round(self.srv.await_standby(STANDBY_WAIT_S), 3)
                trig = self._trigger(kind)
                trig.prepare()
                if self.stop.wait(max(0.0, self.t0 + off - time.perf_counter())):
                    return
                wall0, perf0 = time.time(), time.perf_counter()
                got = trig.fire()
                rec["t"] = perf0 + (got.get("t_fault", wall0) - wall0)
                rec["how"] = got.get("how")
            except (TrialError, OSError) as e:
                rec["error"] = str(e)[-500:]
                rec["t"] = time.perf_counter()
            finally:
                if trig is not None:
                    try:
                        closed = trig.close()
                        if isinstance(closed, dict):
                            rec["trigger_rc"] = closed.get("trigger_rc")
                    except (OSError, TrialError) as e:
                        rec.setdefault("error", str(e)[-300:])
            rec["t_rel"] = round(rec["t"] - self.t0, 3)
            self.fired.append(rec)


def run_fault_window(plan: P.Plan, client: Client, system: str, out_dir: str, rate: float, window_s: float,
                     spacing_s: float, kinds: list[str], faults_dir: str, cleanup: Cleanup, log=print) -> dict:
    """One system, one spacing: start, warm up, the stream with the faults (the
    run's one benchmark client), stop."""
    raw_dir, work = os.path.join(out_dir, "raw"), os.path.join(out_dir, "work")
    os.makedirs(raw_dir, exist_ok=True)
    os.makedirs(work, exist_ok=True)
    n = max(1, int(round(rate * window_s)))
    name = f"fault-{system}-s{spacing_s:g}.json"
    rec: dict = {"system": system, "rate": rate, "window_s": window_s, "spacing_s": spacing_s, "kinds": kinds,
                 "num_prompts": n, "file": f"raw/{name}", "device": plan.device}
    srv = make_server(plan, system, work, cleanup)
    rec["command"] = srv.command()
    inj = None
    try:
        log(f"[fault {system} every {spacing_s:g} s] start: {P.shell(srv.command())}")
        srv.start()
        srv.wait_ready(plan.ready_timeout_s)
        clog = os.path.join(work, f"client-fault-{system}-s{spacing_s:g}.log")
        run_client(client, plan.warmup_cmd(srv.base, raw_dir), clog,
                   client_timeout(plan, P.INF, plan.warmup_n()))
        offsets = fault_times(window_s, spacing_s)
        inj = Injector(srv, plan, offsets, kinds, faults_dir, cleanup)
        inj.start()
        cmd = plan.bench_cmd(srv.base, rate, 0, raw_dir, name, num_prompts=n, label=f"fault-{system}")
        rec["client_command"] = cmd
        rc = run_client(client, cmd, clog, client_timeout(plan, rate, n) + window_s, on_start=inj.begin)
        inj.stop.set()
        inj.join(120)
        if rc != 0:
            raise TrialError(f"vllm bench serve exited {rc}; log tail:\n{tail(clog, 15)}")
        raw = results.load_bench_json(os.path.join(raw_dir, name))
        rows = results.request_rows(raw)
        t0 = inj.t0 if inj.t0 is not None else min((r["start"] for r in rows), default=0.0)
        rec["summary"] = summarize(raw, plan.slo_ttft_ms, plan.slo_tpot_ms, plan.stream.min_output_len())
        rec["timeline"] = timeline(rows, t0, max(window_s, rec["summary"]["duration"] or 0))
        fired = [f["t_rel"] for f in inj.fired if "t_rel" in f and not f.get("error")]
        if fired and inj.t0 is not None:
            rec["summary"]["phases"] = slo_phases(rows, t0, min(fired), plan.slo_ttft_ms, plan.slo_tpot_ms)
        if isinstance(srv, VllmServer):
            rec["events"] = [{**e, "t_rel": round(e["t"] - t0, 3)} for e in srv.events()]
            rec["timeline"]["down"] = down_spans(srv.events(), t0)
            rec["summary"]["restarts"] = srv.starts - 1
        elif isinstance(srv, FrmpsServer):
            rec["summary"]["failovers"] = len(srv.failovers())
    except (TrialError, results.ResultError) as e:
        rec["error"] = str(e)[-3000:]
        log(f"[fault {system}] ERROR: {rec['error'][:500]}")
    finally:
        if inj is not None:
            inj.stop.set()
            inj.started.set()
            inj.join(60)
            rec["faults"] = inj.fired
        srv.stop()
    s = rec.get("summary") or {}
    log(f"[fault {system} every {spacing_s:g} s] faults {len(rec.get('faults') or [])}, failed {s.get('failed')}, "
        f"truncated {s.get('truncated')}, SLO met {s.get('slo_attainment')}, longest gap {s.get('longest_gap_ms')} ms")
    return rec


def run_faults(plan: P.Plan, out_dir: str, rate: float, window_s: float, spacings: list[float], kinds: list[str],
               faults_dir: str, cleanup: Cleanup | None = None, log=print) -> dict:
    cleanup = cleanup or Cleanup()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "plans.jsonl"), "a") as f:
        f.write(json.dumps({"kind": "faults", "fault_rate": rate, "window_s": window_s, "spacings": spacings,
                            "fault_kinds": kinds, **plan.to_json()}) + "\n")
    client = bench_client(plan, cleanup)
    try:
        for spacing in spacings:
            for system in plan.systems:
                rec = run_fault_window(plan, client, system, out_dir, rate, window_s, spacing, kinds, faults_dir,
                                       cleanup, log)
                with open(os.path.join(out_dir, "faultruns.jsonl"), "a") as f:
                    f.write(json.dumps(rec) + "\n")
    finally:
        cleanup.run()
    return report.build(out_dir)
