#!/usr/bin/env python3
"""Fault after fault through `frmps serve` at its defaults: failover, then failback.

One deployment (active in MPS, standby outside). A load of --streams concurrent
streaming completions runs for the whole proof, each stream repeating its own
request (half greedy, half seeded) and comparing every finished output, token
ids included (vLLM's return_token_ids, which frmps supports), with that
request's no-fault output taken first on the same deployment. Then --faults
times: wait until the placement is restored (status: the active in MPS, the
standby outside, failback idle), check the active is in MPS, make a co-located
MPS client fault (bench/faults triggers, rotating), and wait for the failover
and the failback that follows it. Standard library only.

Per fault it records: fault -> death detected, death -> first resumed token
(the promoted engine's log), the longest client-visible gap measured from the
fault, the topology restored (failback done) after the failover, the handover's
duration and its longest stream gap, against the decode step seen by clients.

    python3 bench/gpu/failback_proof.py --frmps bin/frmps --model qwen2.5-7b --faults 20 --out fb.json

--cpu runs the same sequence on the CPU (the MPS control daemon's test double,
SIGKILL as the fault): a check of this script, not of GPU faults.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from failover_proof import (  # noqa: E402  (same folder, standard library only)
    LOG_FIRST, LOG_SLEEP, Deployment, failover_after, failover_seq, get, grep_log, http_json, loglines, mps_trigger,
    Terminated, nvidia_smi, stop_on_sigterm)

from bench import exactness, kv_digests, proofcount, token_logs  # noqa: E402
from bench.runctx import FAULT_KINDS as FAULTS  # noqa: E402  (the seven kinds, in the soaks' order)
from proof_load import (  # noqa: E402  (same folder, standard library only)
    Load, bodies, burst_bodies, gaps_after, max_gap_in, no_fault_run, now, wait_endpoint)

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FAKE_MPS = os.path.join(REPO, "supervisor", "mps", "testdata", "nvidia-cuda-mps-control")


def engines(st: dict) -> dict:
    return {str(get(e, "role", default="")).lower(): e for e in get(st, "engines", default=[]) or []}


def started(dep: Deployment, st: dict) -> bool:
    """The pair is up; raises at the first engine death while starting (no point
    waiting through the crash-loop breaker's restarts)."""
    for e in get(st, "engines", default=[]) or []:
        if get(e, "state") == "dead" or get(e, "last_death_cause"):
            raise RuntimeError(f"{get(e, 'role')} engine died while starting: {get(e, 'last_death_cause')} "
                               f"(log {get(e, 'log_path')})")
    if get(st, "state") == "crash_loop":
        raise RuntimeError(f"crash loop: {get(st, 'state_cause')}")
    return dep.ready_pair(st)


def restored(st: dict, n_failbacks: int) -> bool:
    e, fb = engines(st), get(st, "failback", default={}) or {}
    a, s = e.get("active") or {}, e.get("standby") or {}
    return (get(st, "state") == "serving_ready" and get(a, "state") == "serving" and get(s, "state") == "ready"
            and bool(get(a, "in_mps")) and not get(s, "in_mps") and get(fb, "state") == "idle"
            and int(get(fb, "succeeded", default=0) or 0) >= n_failbacks)


RING_NAME = re.compile(r"frmps-[0-9a-zA-Z_-]+\.ring")


def own_rings(pid: int) -> set[str]:
    """The ring files in /dev/shm that the supervisor pid has mapped."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            # "address perms offset dev inode path": the path is the line's last field.
            return {os.path.basename(line.rsplit(None, 1)[-1]) for line in f if "/dev/shm/frmps" in line}
    except OSError:
        return set()


def resources(dep, cpu: bool) -> dict:
    """What must stay flat fault after fault (a soak): the supervisor's open fds and
    threads, its live child processes, frmps's files in /dev/shm, the GPU's memory."""
    pid = dep.proc.pid
    out: dict = {}
    try:
        out["supervisor_fds"] = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/status") as f:
            out["supervisor_threads"] = int(next(line for line in f if line.startswith("Threads:")).split()[1])
        kids = set()  # a Go process forks from any of its threads
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids.update(f.read().split())
        out["supervisor_children"] = len(kids)
    except (OSError, StopIteration, ValueError) as e:
        out["error"] = str(e)
    try:  # another frmps on this host (a run on another GPU) has a ring of its own: not counted
        mine = own_rings(pid)
        out["shm_files"] = sum(1 for n in os.listdir("/dev/shm")
                               if "frmps" in n and (n in mine or not RING_NAME.fullmatch(n)))
    except OSError:
        pass
    if not cpu:
        smi = nvidia_smi()
        out["gpu_used_mib"] = smi.get("gpu_used_mib")
        out["gpu_apps"] = len(smi.get("apps") or {})
    return out


def spare_state(st: dict) -> str:
    """The spare's state in status ("" from an frmps without spares)."""
    return str(get(get(st, "spare") or {}, "state", default="") or "")


def first_resumed(path: str | None, after: float) -> float | None:
    """The promoted engine's first resumed token of the takeover detected at `after`."""
    return loglines.first_time_after(path, LOG_FIRST, after - 1)


def breakdown(tk: dict | None) -> str:
    """A takeover's breakdown for the summary line ("" when its log lines were not found)."""
    if not tk:
        return ""
    fs = tk.get("first_step") or {}
    return (f" resume={tk.get('resume_ms')}ms flip={tk.get('kv_writable_ms')}ms adopt={tk.get('adoption_ms')}ms"
            f" step1={fs.get('step_ms')}ms cpu1={fs.get('loop_cpu_ms')}ms")


def grep_all(path: str | None, needle: str) -> list[str]:
    if not path or not os.path.exists(path):
        return []
    with open(path, errors="replace") as f:
        return [line.strip() for line in f if needle in line]


TRACE = re.compile(r"took over \d+ requests|step \d+ after start|first resumed token|handed over \d+ requests"
                   # an engine's start-up, as vLLM times it (where a failback's restore time goes)
                   r"|init engine \(profile|Model loading took|Graph capturing finished|torch.compile took"
                   r"|active engine serving on|standby built|standby asleep|start phases")


def takeover_traces(log_dir: str) -> dict[str, list[str]]:
    """Per engine log, the lines that time a takeover (the Resume's own figures, the
    first steps of the loop after it: began/step/dispatch, the first resumed tokens)
    and an engine's start-up."""
    out: dict[str, list[str]] = {}
    for name in sorted(os.listdir(log_dir)):
        if name.endswith(".log") and name != "frmps.log":
            with open(os.path.join(log_dir, name), errors="replace") as f:
                lines = [ln.rstrip() for ln in f if TRACE.search(ln)]
            if lines:
                out[name] = lines[:200]
    return out


def drill(dep, _active):
    """A cycle's trigger that is no GPU fault (mps_trigger's shape: prepare, inject):
    the admin API's failover drill (TriggerFailover: the supervisor SIGKILLs the
    active). What it answers: is the KV flip's wait for the dead context's teardown
    the same without a fault, and for the deployment's first active (the engine
    that created the pools) as for a later one (which imported them)?"""
    def prepare() -> None:
        pass

    def inject() -> dict:
        t = now()
        r = http_json(f"http://{dep.admin}/v1/admin/failover", {"reason": "failback_proof drill"}, timeout=10)
        if not get(r, "accepted"):
            raise RuntimeError(f"drill refused: {r}")
        return {"t_fault": t, "accepted": True}
    return prepare, inject


def cycle(dep, args, load, step: float, rec: dict, n_fb: int, last: list, trigger, lead: float = 0.0) -> None:
    """One failover and the failback after it, measured into ``rec``: wait until the
    placement is restored (``n_fb`` failbacks so far) and a spare is ready, check
    the active is in MPS, trigger (``trigger(dep, active)`` -> prepare, inject), then
    wait for the failover record and the failback. ``last[0]``: the previous
    trigger's time (--min-fault-interval). ``lead``: seconds between the last
    request sent (the burst) and the fault."""
    st, _ = dep.wait(lambda s: restored(s, n_fb), 300, f"placement restored before cycle {n_fb + 1}")
    wait_spare = getattr(args, "wait_spare", 180.0)
    if last[0]:
        time.sleep(max(0.0, last[0] + getattr(args, "min_fault_interval", 0.0) - now()))
    if wait_spare > 0 and spare_state(st) not in ("off", "") and not spare_state(st).startswith("off"):
        st, _ = dep.wait(lambda s: spare_state(s) == "ready" or spare_state(s).startswith("off"),
                         wait_spare, f"a ready spare before cycle {n_fb + 1}")
    spare = get(st, "spare") or {}
    rec["spare_before"] = {"state": spare_state(st), "import_s": get(spare, "last_ready_seconds"),
                           "ready": get(spare, "ready_count", default=0), "size": get(spare, "size", default=0),
                           "rss_mib": int(get(spare, "rss_bytes", default=0) or 0) >> 20}
    e = engines(st)
    act = e["active"]
    rec["active_in_mps_before"] = bool(get(act, "in_mps"))
    rec["active_pid"] = int(get(act, "pid", default=0) or 0)
    n_fo = failover_seq(st)
    prepare, inject = trigger(dep, act)
    prepare()
    load.wait_all_streaming(5)  # the fault lands mid-stream for every stream
    if load.burst():  # and, right before it, requests still queued or in their (chunked) prefill
        time.sleep(getattr(args, "burst_lead", 0.0))
    if lead > 0:
        time.sleep(lead)
    inj = inject()
    t_fault = inj.get("t_fault") or now()
    last[0] = t_fault
    rec["inject"] = {k: v for k, v in inj.items() if k != "t_fault"}
    st, _ = dep.wait(lambda s: failover_after(s, n_fo), 120, "the failover record")
    fo = (get(st, "failovers") or [])[0]
    detect = int(get(fo, "unix_nanos", default=0)) / 1e9
    rec["failover"] = {k: get(fo, k) for k in ("cause", "ok", "duration_seconds", "resumed_requests",
                                               "reused_tokens", "prefilled_tokens", "first_token_seconds")}
    rec["fault_to_detect_s"] = round(detect - t_fault, 4)
    rec["t_fault"], rec["t_detect"] = t_fault, detect  # the event windows of the stream count
    st, _ = dep.wait(lambda s: restored(s, n_fb + 1), 300, f"failback after cycle {n_fb + 1}")
    # The MPS server's side: from "to be torn down" (a fault) to the dead active's exit, which the
    # standby's KV flip waits for; after a drill only the exit (kill_to_exit_ms: from the drill's request).
    td = loglines.mps_client_teardown(os.path.join(dep.mps_dirs()[1], "server.log"), rec["active_pid"], t_fault - 2)
    if td is not None:
        td["kill_to_exit_ms"] = round((td["exited_at"] - t_fault) * 1000, 1)
    rec["mps_teardown"] = td
    fr = first_resumed(get(e["standby"], "log_path"), detect)  # the engine the failover promoted
    rec["detect_to_first_resumed_token_s"] = round(fr - detect, 4) if fr else None
    # Where that time went in the promoted engine: the Resume (KV flip beside the adoption)
    # and the first step after it.
    rec["takeover"] = loglines.takeover_breakdown(get(e["standby"], "log_path"))
    fb = get(st, "failback") or {}
    done = int(get(fb, "last_unix_nanos", default=0)) / 1e9
    dur = float(get(fb, "last_duration_seconds", default=0) or 0)
    new_act = engines(st)["active"]  # the engine launched after the fault, now the active in MPS
    rec["t_handover"] = [done - dur, done]
    rec["failback"] = {"restored_s_after_detect": round(done - detect, 3), "handover_s": round(dur, 4),
                       "handover_first_token_s": get(fb, "last_first_token_seconds"),
                       "active_in_mps_after": True,
                       "new_engine_from_spare": bool(get(new_act, "from_spare")),
                       "new_engine_init_s": get(new_act, "init_seconds"),
                       "takeover": loglines.takeover_breakdown(get(new_act, "log_path")),
                       # the engine the failover promoted yielded: where its part of the handover went
                       "yield": loglines.handoff_breakdown(get(e["standby"], "log_path"))}
    time.sleep(0.5)  # let the streams run past the handover
    times = load.chunk_times()
    rec["client_gap_from_fault_s"] = gaps_after(times, t_fault)
    # The longest silence a client saw around the failover (the chunk that may still come from
    # the dying active right after the fault does not end it).
    rec["client_max_gap_s"] = max_gap_in(times, t_fault, t_fault + 1.0)
    rec["handover_max_gap_s"] = max_gap_in(times, done - dur - 0.05, done + 0.2)
    rec["decode_step_s"] = step
    rec["resources"] = resources(dep, args.cpu)


def events_of(recs: list[dict]) -> list[tuple[str, float, float]]:
    """The event windows of cycles (see proofcount): per cycle its fault, from the
    injection to the detected death, and its handover, from start to end."""
    out = []
    for r in recs:
        label = r.get("label") or (f"drill {r['n']}" if r.get("drill") else f"fault {r['n']}")
        if r.get("t_fault") is not None:
            a, b = r["t_fault"], r.get("t_detect") or r["t_fault"]
            out.append((label, min(a, b), max(a, b)))
        if r.get("t_handover"):
            out.append((f"{label} handover", *r["t_handover"]))
    return sorted(out, key=lambda e: e[1])


def count_streams(done: list[dict], events: list[tuple[str, float, float]], prompt_tokens: list,
                  chunk: int | None) -> tuple[list[dict], dict]:
    """Every finished stream classified (in flight at which event, in which phase)
    and the tally of their verdicts (proofcount)."""
    out = []
    for d in done:
        pt = prompt_tokens[d["i"]] if d["i"] < len(prompt_tokens) else None
        c = proofcount.classify(d["t0"], d["times"], d["t1"], events, failed=bool(d["error"]), prompt_tokens=pt,
                                prefill_chunk=chunk)
        out.append({**d, **c, "prompt_tokens": pt})
    return out, proofcount.tally(out)


def stream_report(report: dict, done: list[dict], events: list, prompt_tokens: list, chunk: int | None) -> str:
    """The stream count into report (the headline, its tally, the streams in flight
    that are not exact, then the first ten others); returns the headline."""
    streams, t = count_streams(done, events, prompt_tokens, chunk)
    report["streams_total"] = len(done)
    report["streams_exact"] = sum(1 for d in done if d["exact"] and not d["error"])
    report["streams_errors"] = [{k: d.get(k) for k in ("i", "burst", "tokens", "finish", "error", "event", "phase")}
                                for d in streams if d["error"]][:10]
    # Every stream in flight that is not exact (the headline's), then the first others;
    # with its start and end (the engines' token logs carry their finish times).
    fields = ("i", "burst", "tokens", "first_diff", "finish", "event", "phase", "t0", "t1")
    inexact = [d for d in streams if not d["exact"] and not d["error"]]
    report["streams_inexact"] = ([{k: d.get(k) for k in fields} for d in inexact if d.get("in_flight")][:100]
                                 + [{k: d.get(k) for k in fields} for d in inexact if not d.get("in_flight")][:10])
    report["stream_count"] = t
    report["events"] = len(events)
    report["headline"] = proofcount.headline(t)
    return report["headline"]


def control_cycles(args, cases: list[str], trigger_spec: str) -> list[dict]:
    """The negative controls in one short deployment whose engines read the
    control's cases from a file at each takeover (FRMPS_TEST_TAKEOVER_FAULT=@PATH,
    sdk/takeover_fault.py): per case, the file names it, a few streams (and the
    burst) run against their no-fault outputs across one real fault (the proof's own
    trigger) and the failback after it, and its record (proofcount.control_result)
    says whether the comparison noticed. Each case sends its own prompts (the
    proof's, behind a tag with the case's number) and takes their no-fault outputs right
    before its fault: a block a case broke stays in the engines' prefix cache (and
    is adopted with it at the next takeover), and a later request with the same
    prompt would read it, so a case's prompts must not come back. The run without a
    control sends the proof's prompts untagged, and when it runs again after the
    cases it compares with the outputs taken before any takeover: whatever a case
    broke must not reach them. A case whose cycle failed ends the deployment: the
    cases after it get "not_run"."""
    cargs = copy.copy(args)
    switch = os.path.join(args.workdir, "controls", "cases")
    os.makedirs(os.path.dirname(switch), exist_ok=True)
    with open(switch, "w"):
        pass
    cargs.env = {**(getattr(args, "env", None) or {}), **proofcount.switch_env(switch)}
    cargs.port = 0
    cargs.sync_every = proofcount.control_sync_every(args.sync_every)  # the proof's engines, synced less often
    if getattr(args, "quick_start", False):
        cargs.quick_start = False  # the same choices, spelled out, so that --sync-every can be given
        cargs.engine_arg, cargs.serve_arg, cargs.num_blocks, cargs.max_model_len = [], [], 0, 0
    model = getattr(args, "served_model_name", "") or args.model
    dep = Deployment(cargs, "controls", os.path.join(args.workdir, "controls"))
    out: list[dict] = []
    stopped: str | None = None
    try:
        dep.start()
        dep.wait(lambda s: started(dep, s), 900, "controls: active serving + standby ready")
        wait_endpoint(dep.base, 300)
        n = args.control_streams
        reqs = bodies(n, args.control_max_tokens) + burst_bodies(args.control_burst, args.control_max_tokens,
                                                                  args.prefill_chunk)
        if getattr(args, "seed_every_request", False):  # engines whose greedy sampling is not deterministic
            for i, body in enumerate(reqs):
                body.setdefault("seed", 3000 + i)
        ref0, fig = no_fault_run(dep, model, reqs)
        if fig["errors"]:
            raise RuntimeError(f"controls: the no-fault run failed: {fig['errors'][:3]}")
        last = [0.0]
        n_fb = [0]  # failbacks so far: one per cycle (a case's attempts each take one)
        seen_before: dict[str, dict] = {}  # per case, what the engines' logs had said of it before its cycle

        def one(k: int, case: str, attempt: int) -> tuple[dict, str | None]:
            creqs, ref, ptoks = reqs, ref0, fig.get("prompt_tokens") or []
            if case != proofcount.POSITIVE:
                tag = f"({k})" if attempt == 1 else f"({k}.{attempt})"  # each attempt its own prompts (prefix cache)
                # position: the looping streams only, no burst (a burst request's first token is a sync; see lead)
                base = reqs[:n] if case == "position" else reqs
                creqs = [{**b, "prompt": f"{tag} {b['prompt']}"} for b in base]  # a short tag: few tokens alike
                ref, cfig = no_fault_run(dep, model, creqs)
                if cfig["errors"]:
                    raise RuntimeError(f"controls: the no-fault run of {case} failed: {cfig['errors'][:3]}")
                ptoks = cfig.get("prompt_tokens") or []
            with open(switch, "w") as f:
                f.write("" if case == proofcount.POSITIVE else case)
            load = Load(dep, model, creqs, ref, n_loop=n)
            rec: dict = {"n": k + 1, "label": f"control {case}"}
            t0, err = now(), None
            step = fig.get("decode_step_s_p50") or 0.0
            # position needs a request two tokens past its last sync at the fault. A request's first
            # token publishes every request's state (sdk/loop.py), and the fault lands right after the
            # last stream's first token: at 0.5B on the H200 it found every request synced (twice).
            # This case sends no burst, and its fault waits half a sync interval more.
            lead = min(2.0, cargs.sync_every // 2 * step) if case == "position" else 0.0
            load.start()
            try:
                cycle(dep, cargs, load, step, rec, n_fb[0], last, mps_trigger(cargs, trigger_spec), lead=lead)
            except Exception as ex:
                err = f"{type(ex).__name__}: {ex}"
            finally:
                load.finish(120)
            n_fb[0] += 1
            streams, _ = count_streams(list(load.done), events_of([rec]), ptoks, args.prefill_chunk)
            fo = rec.get("failover") or {}
            r = proofcount.control_result(case, streams, fo.get("ok") if fo else None, err)
            if case != proofcount.POSITIVE:  # what the engines' logs say of this case since the last one
                seen = exactness.control_lines(exactness.engine_logs(dep.log_dir)).get(case) or {}
                before = seen_before.get(case) or {}
                r.update(applied=seen.get("applied", 0) - before.get("applied", 0),
                         not_applied=(seen.get("not_applied") or [])[len(before.get("not_applied") or []):])
                seen_before[case] = seen
            why = proofcount.control_not_run(case, err, r.get("applied"))
            if why:  # a failed run says nothing of a case the engines never applied
                r.update(detected=False, not_run=why)
            r.update(fault=trigger_spec, seconds=round(now() - t0, 1), fault_to_detect_s=rec.get("fault_to_detect_s"),
                     attempts=attempt)
            return r, err

        # A case that found no adopted request it fits, at the fault and at the failback, runs again across the
        # next fault, up to --control-attempts cycles (proofcount.control_unapplied).
        for k, case in enumerate(cases):
            r, err = one(k, case, 1)
            for attempt in range(2, max(1, args.control_attempts) + 1):
                if not proofcount.control_unapplied(case, err, r.get("applied"), r.get("not_applied")):
                    break
                print(f"control {case}: not applied in attempt {attempt - 1} ({'; '.join(r.get('not_applied') or [])}): "
                      f"again across the next fault", flush=True)
                earlier = [*r.get("earlier_attempts", []), {"not_applied": r.get("not_applied"), "seconds": r["seconds"]}]
                r, err = one(k, case, attempt)
                r["earlier_attempts"] = earlier
            out.append(r)
            if err:
                stopped = f"the controls' deployment stopped after case {case}: {err}"
                break
    except Exception as ex:
        stopped = f"{type(ex).__name__}: {ex}"
    finally:
        dep.stop()
    for case in cases[len(out):]:
        out.append({**proofcount.control_result(case, [], None), "not_run": stopped})
    return out


def run_controls(args, report: dict, save, trigger_spec: str) -> bool:
    """--controls: every case before the real run, in one deployment
    (control_cycles), and when the run without a control came first, that run
    again after the last case (nothing a case broke may outlive its request);
    report["controls"]. False (and report["error"]) when one passed unnoticed or
    could not run."""
    cases = list(args.controls)
    report["controls_mode"] = "off" if not cases else ",".join(cases)
    report["controls"] = []
    if not cases:
        print("controls: OFF (--controls off): the results below are not backed by negative controls", flush=True)
        return True
    if cases[0] == proofcount.POSITIVE and any(c != proofcount.POSITIVE for c in cases):
        cases.append(proofcount.POSITIVE)
    for r in control_cycles(args, cases, trigger_spec):
        report["controls"].append(r)
        applied = "" if r.get("applied") is None else f" applied={r['applied']}{' (' + '; '.join(r['not_applied']) + ')' if r.get('not_applied') else ''}"
        print(f"control {r['case']}: detected={r['detected']}{applied} ({r['how'] or 'every stream exact'}) "
              f"in flight {r['streams_in_flight']}/{r['streams']} affected {r['streams_affected']} "
              f"failover_ok={r['failover_ok']} {r.get('seconds')}s", flush=True)
    # The controls' deployment's KV digests: each case sends prompts of its own, so a block a case
    # broke is seen once and the check cannot call it (its negative controls are the reference
    # engine's, in CI: vllmpatch/tests/test_takeover_controls.py); what differs here is news.
    if getattr(args, "kv_digests", False):
        report["controls_kv_digests"] = kv_report(os.path.join(args.workdir, "controls", "kv-controls"))
        print(f"controls: {report['controls_kv_digests']['line']}", flush=True)
    save()
    not_run = [r for r in report["controls"] if r.get("not_run")]
    if not_run:
        report["error"] = "; ".join(f"control {r['case']} did not run: {r['not_run']}" for r in not_run)
        return False
    try:
        proofcount.check_controls(report["controls"])
    except proofcount.ControlPassedUnnoticed as ex:
        report["error"] = f"ControlPassedUnnoticed: {ex}"
        return False
    return True


def add_count_args(ap: argparse.ArgumentParser) -> None:
    """The flags of the stream count and of the negative controls (shared with
    tp_proof.py and openai_fault_proof.py)."""
    ap.add_argument("--controls", type=proofcount.controls_arg, default="on",
                    help="negative controls before the real run: on (every case: "
                         f"{', '.join(proofcount.CONTROL_CASES)}), off (debugging only; the results say so), or a "
                         "comma list of cases. Each case: a short deployment with FRMPS_TEST_MODE=1 "
                         "FRMPS_TEST_TAKEOVER_FAULT=<case>, one fault; the proof stops if one compares exact")
    ap.add_argument("--control-streams", type=int, default=4, help="streams of each control")
    ap.add_argument("--control-max-tokens", type=int, default=128)
    ap.add_argument("--control-burst", type=int, default=2, help="burst requests of each control")
    ap.add_argument("--control-attempts", type=int, default=3,
                    help="cycles (each across its own fault and failback) a control case may take to find an adopted "
                         "request it fits before it counts as never applied")
    ap.add_argument("--prefill-chunk", type=int, default=512,
                    help="the engines' prefill chunk (--max-num-batched-tokens, passed to them unless an --engine-arg "
                         "sets it): a prompt longer than this is mid-prefill until its first token; 0: the engines' "
                         "default, phase mid-prefill not told apart")
    ap.add_argument("--burst", type=int, default=4,
                    help="per fault, this many requests sent right before it (every other one with a prompt of about "
                         "1.3-3 x --prefill-chunk tokens): streams queued or in their chunked prefill at the fault")
    ap.add_argument("--burst-lead", type=float, default=0.02, help="seconds between the burst and the fault")


def apply_prefill_chunk(args) -> None:
    """--prefill-chunk to the engines, unless an --engine-arg sets the token budget."""
    if args.prefill_chunk and not any(a.startswith("--max-num-batched-tokens") for a in args.engine_arg):
        args.engine_arg.append(f"--max-num-batched-tokens={args.prefill_chunk}")
    for a in args.engine_arg:  # the chunk the engines run with, whoever set it
        if a.startswith("--max-num-batched-tokens="):
            args.prefill_chunk = int(a.split("=", 1)[1])


def summary_line(rec: dict, step: float) -> str:
    return (f"in_mps={rec['active_in_mps_before']} cause={rec['failover']['cause']} "
            f"fault->detect={rec['fault_to_detect_s']} detect->tok={rec['detect_to_first_resumed_token_s']} "
            f"client_gap={rec['client_gap_from_fault_s']} max_gap={rec['client_max_gap_s']} "
            f"restored={rec['failback']['restored_s_after_detect']}s "
            f"(from_spare={rec['failback']['new_engine_from_spare']} spare={rec['spare_before']['state']}) "
            f"handover={rec['failback']['handover_s']}s gap={rec['handover_max_gap_s']} step={step:.4f}"
            f"{breakdown(rec['takeover'])}{teardown(rec.get('mps_teardown'))}")


def teardown(td: dict | None) -> str:
    if not td:
        return ""
    return f" mps_teardown={td.get('teardown_ms')}ms kill->exit={td.get('kill_to_exit_ms')}ms"


def main() -> int:
    stop_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frmps", default="bin/frmps")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--engine", default="ref")
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--memory", default="cuda-vmm")
    ap.add_argument("--sync-every", type=int, default=1, help="frmps serve's default")
    ap.add_argument("--num-blocks", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=0)
    ap.add_argument("--faults", type=int, default=20)
    ap.add_argument("--drills", type=int, default=0,
                    help="before the faults, this many admin failover drills (SIGKILL of the active, no GPU fault), "
                         "each followed by the failback, measured as the faults are (report: drills)")
    ap.add_argument("--fault-kinds", default=",".join(FAULTS))
    ap.add_argument("--faults-dir", default="bench/build/faults")
    ap.add_argument("--min-fault-interval", type=float, default=13.0,
                    help="seconds between faults: frmps serve's crash-loop breaker stops re-arming after more than 5 "
                         "active deaths within 60 s (--max-restarts, --restart-window), so at the defaults faults "
                         "must come at least 12 s apart to keep every one of them protected")
    ap.add_argument("--wait-spare", type=float, default=180.0,
                    help="before each fault, wait up to this long for frmps's spare engine process to finish its "
                         "imports (faults spaced further apart than a spare's start-up; 0: do not wait)")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--workdir", default="/tmp/frmps-failback")
    ap.add_argument("--out", default="failback_proof.json")
    ap.add_argument("--time-budget", type=float, default=0,
                    help="no new fault after this many seconds of faults (start-up and the reference run not counted)")
    ap.add_argument("--engine-arg", action="append", default=[])
    ap.add_argument("--serve-arg", action="append", default=[], help="more frmps serve flags")
    ap.add_argument("--cpu", action="store_true", help="CPU check of this script: MPS control test double, SIGKILL faults")
    ap.add_argument("--quick-start", action="store_true",
                    help="start frmps exactly as the README's GPU quick start does: `frmps serve --model M` with only "
                         "its port, admin address, run and log directories added (no engine, device, memory, sync, "
                         "block or batch flag; --engine-arg, --serve-arg, --num-blocks and --max-model-len refused); "
                         "--prefill-chunk then only names the engines' own chunk for the count (default 8192, "
                         "vllm serve's on a GPU of >= 70 GiB)")
    ap.add_argument("--exact", action="store_true",
                    help="frmps serve --exact (as the README shows it: vLLM's batch-invariant mode), with or without "
                         "--quick-start; the controls' deployment too")
    ap.add_argument("--kv-digests", action="store_true",
                    help="a diagnostic: every engine writes its KV digests at each handover and adoption "
                         "(FRMPS_DEBUG_KV_DIGESTS), checked after the run for blocks of one token prefix that hold "
                         "different KV (report: kv_digests; the controls' deployment's: controls_kv_digests); the "
                         "digests cost time on the takeover's path, so the run's latencies are not the product's")
    add_count_args(ap)
    args = ap.parse_args()
    if args.quick_start:
        if args.engine_arg or args.serve_arg or args.num_blocks or args.max_model_len or args.cpu:
            ap.error("--quick-start takes no --engine-arg, --serve-arg, --num-blocks, --max-model-len or --cpu")
        args.engine, args.device, args.memory = "auto", "auto", "auto"
        if not any(a.startswith("--prefill-chunk") for a in sys.argv[1:]):
            args.prefill_chunk = 8192
    else:
        apply_prefill_chunk(args)
    args.port, args.mps_control, args.env = 0, "", {}
    if args.cpu:
        args.device, args.memory, args.mps_control = "cpu", "host-shm", FAKE_MPS
        args.serve_arg = [*args.serve_arg, "--mps-control", FAKE_MPS]
        args.env = {"FRMPS_TEST_STEP_DELAY_MS": "10"}
    t_begin = now()
    os.makedirs(args.workdir, exist_ok=True)
    report: dict = {"quick_start": args.quick_start, "exact": args.exact, "engine": args.engine, "model": args.model, "device": args.device, "sync_every": args.sync_every,
                    "streams": args.streams, "max_tokens": args.max_tokens, "burst": args.burst,
                    "prefill_chunk": args.prefill_chunk, "faults": []}

    def save() -> None:
        report["elapsed_s"] = round(now() - t_begin, 1)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    kinds = [k for k in args.fault_kinds.split(",") if k]
    if not run_controls(args, report, save, kinds[0]):
        save()
        print(f"error: {report['error']}", flush=True)
        return 1
    dep = Deployment(args, f"{args.engine}-{os.path.basename(os.path.normpath(args.model))}", args.workdir)
    load = None
    terminated = False

    def count_streams_now() -> str:
        """The stream count of the streams finished so far into report; its headline."""
        return stream_report(report, list(load.done), events_of(report.get("drills", []) + report["faults"]),
                             (report.get("reference") or {}).get("prompt_tokens") or [], args.prefill_chunk)
    try:
        t0 = now()
        dep.start()
        st, t_ready = dep.wait(lambda s: started(dep, s), 900, "active serving + standby ready")
        wait_endpoint(dep.base, 300)  # --frontend vllm: vLLM's API server listens once the engine is up
        e = engines(st)
        report["startup_s"] = round(t_ready - t0, 2)
        act_log, sb_log = get(e["active"], "log_path"), get(e["standby"], "log_path")
        sl = grep_log(sb_log, LOG_SLEEP)
        smi = nvidia_smi() if not args.cpu else {}
        report["resources_at_start"] = resources(dep, args.cpu)
        report["standby"] = {"map_ms": float(sl[0]) if sl else None, "ready_ms_after_start": int(sl[1]) if sl else None,
                             "used_mib": (smi.get("apps", {}).get(int(get(e["standby"], "pid", default=0))) or {}).get("used_mib"),
                             "gpu_used_mib": smi.get("gpu_used_mib"),
                             "torch_pools_mib": loglines.standby_pools(sb_log)}
        report["placement_digests"] = {"active": grep_all(act_log, "placement digest"), "standby": grep_all(sb_log, "placement digest")}
        # The standby started and slept while the active stayed idle: its pools' sums must not change.
        # The engine that allocated the pools sums them at ready: the active, unless a handover at
        # start swapped the pair (then that engine is the standby by now).
        owner, owner_log = "active", act_log
        if not grep_all(act_log, "pool checksums at ready") and grep_all(sb_log, "pool checksums at ready"):
            owner, owner_log = "standby", sb_log
        os.kill(int(get(e[owner], "pid")), signal.SIGRTMIN + 1)
        time.sleep(2.0)
        at_ready = [line.split(": ", 2)[-1] for line in grep_all(owner_log, "pool checksums at ready")][-1:]
        later = [line.split(": ", 2)[-1] for line in grep_all(owner_log, "pool checksums on request")][-1:]
        report["pool_checksums"] = {"summed_by": owner, "at_ready": at_ready, "after_standby_slept": later,
                                    "unchanged_by_standby": bool(at_ready and later and at_ready == later)}
        save()

        reqs = bodies(args.streams, args.max_tokens) + burst_bodies(args.burst, args.max_tokens, args.prefill_chunk)
        ref, report["reference"] = no_fault_run(dep, args.model, reqs)
        step = report["reference"]["decode_step_s_p50"] or 0.0
        save()
        if report["reference"]["errors"]:
            raise RuntimeError(f"the no-fault run failed: {report['reference']['errors'][:3]}")
        cc = reference_cross_check(os.path.join(args.workdir, "controls", "tokens-controls"), dep.token_dir)
        if cc is not None:
            report["reference_cross_check"] = cc
            save()
            print(f"reference cross-check: {cc['summary']}", flush=True)
            if cc["differ"]:
                raise RuntimeError(f"reference cross-check: {cc['summary']}")
        load = Load(dep, args.model, reqs, ref, n_loop=args.streams)
        load.start()
        n_fb = 0  # failbacks so far: each cycle waits for the placement its predecessor restored
        last = [0.0]
        for d in range(1, args.drills + 1):
            rec = {"n": d, "drill": "admin failover (SIGKILL of the active, no GPU fault)"}
            report.setdefault("drills", []).append(rec)
            cycle(dep, args, load, step, rec, n_fb, last, drill)
            n_fb += 1
            print(f"drill {d}: {summary_line(rec, step)}", flush=True)
            save()
        t_faults = now()
        for n in range(1, args.faults + 1):
            if args.time_budget and now() - t_faults > args.time_budget:
                report["stopped"] = f"time budget after {n - 1} faults"
                break
            spec = kinds[(n - 1) % len(kinds)]
            rec = {"n": n, "fault": spec}
            report["faults"].append(rec)
            cycle(dep, args, load, step, rec, n_fb, last, mps_trigger(args, spec))
            n_fb += 1
            print(f"fault {n} {spec}: {summary_line(rec, step)}", flush=True)
            # The streams finished so far, counted now: a run cut short (a killed
            # session) keeps the count up to its last completed stream.
            count_streams_now()
            report["streams_interim"] = f"streams finished by the end of fault {n}"
            save()
    except Exception as ex:  # keep what was measured
        report["error"] = f"{type(ex).__name__}: {ex}"
        terminated = isinstance(ex, Terminated)
    finally:
        if load is not None:  # the streams that completed are checked whatever happened
            load.finish(60 if terminated else 120)  # after a SIGTERM the caller kills us 90 s later (bounded.sh)
            h = count_streams_now()
            report.pop("streams_interim", None)
            print(h + ("" if args.controls else " [controls OFF]"), flush=True)
        dep.stop()
        report["takeover_traces"] = takeover_traces(dep.log_dir)
        report["token_logs"] = engines_token_logs(dep.token_dir)
        if dep.kv_dir:
            report["kv_digests"] = kv_report(dep.kv_dir)
        save()
    if report.get("kv_digests"):
        print(report["kv_digests"]["line"], flush=True)
    print(json.dumps({k: report.get(k) for k in ("startup_s", "streams_total", "streams_exact", "headline", "controls_mode",
                                                   "error", "elapsed_s", "pool_checksums", "token_logs")}, default=str), flush=True)
    return proof_status(report)


def reference_cross_check(controls_dir: str, run_dir: str) -> dict | None:
    """The no-fault run against the controls deployment's no-fault outputs of the same prompts
    (the controls reuse the run's first prompts and seeds, with fewer tokens), from the engines'
    token logs: each prompt's first completion in each deployment, compared over the shorter
    length. Two engine processes of the same command must agree; where they do not, no takeover
    between them can be exact, and the faults would measure nothing (bench/results/
    2026-11-30-h200x2-vllm-exact-14b/: caught this way it costs one no-fault round, not the
    run). None when either side has no log (controls off)."""
    try:
        ctl, run = token_logs.read([controls_dir]), token_logs.read([run_dir])
    except OSError:
        return None
    if not ctl or not run:
        return None
    first_ctl = token_logs.firsts(ctl)
    diffs, compared = [], 0
    for prompt, r in token_logs.firsts(run).items():
        c = first_ctl.get(prompt)
        if c is None:
            continue
        compared += 1
        n = min(len(c.output), len(r.output))
        d = token_logs.first_diff(c.output[:n], r.output[:n])
        if d is not None:
            diffs.append({"prompt_tokens": len(prompt), "first_diff": d, "compared_tokens": n,
                          "controls_engine": c.pid, "run_engine": r.pid})
    summary = (f"{compared} prompt(s) of the no-fault run also ran in the controls' deployment; "
               f"{len(diffs)} differ" + (f" (first at token {min(x['first_diff'] for x in diffs)}; engines "
                                         f"{sorted({x['run_engine'] for x in diffs})} against "
                                         f"{sorted({x['controls_engine'] for x in diffs})}): two engine processes "
                                         "of the same command computed different outputs, takeover or not" if diffs else ""))
    return {"prompts_compared": compared, "differ": len(diffs), "diffs": diffs, "summary": summary}


def kv_report(kv_dir: str) -> dict:
    """bench.kv_digests' check of one deployment's KV digests (--kv-digests), its first
    violations only."""
    records, torn = kv_digests.load([kv_dir])
    rep = kv_digests.check(records, torn).as_dict()
    rep["violations"] = rep["violations"][:20]
    return rep


def engines_token_logs(token_dir: str) -> dict | None:
    """The engines' own token logs (bench.token_logs) per engine, against each prompt's
    first and its most frequent output: where the clients' streams differ from the
    no-fault run, this tells an engine whose outputs all differ (it computes differently,
    takeover or not) from a takeover that went wrong. Only the engines that finished a
    request appear."""
    try:
        comps = token_logs.read([token_dir])
    except OSError:
        return None
    if not comps:
        return None
    out = {}
    for ref in ("first", "majority"):
        rows = token_logs.compare(comps, ref)
        out[ref] = {"prompts_with_several_outputs": sum(len(r["variants"]) > 1 for r in rows),
                    "engines": {str(pid): {"completions": e["completions"], "differ": e["differ"]}
                                for pid, e in token_logs.engine_summary(comps, ref).items()}}
    out["completions"], out["prompts"] = len(comps), len({c.prompt for c in comps})
    return out


def proof_status(report: dict) -> int:
    """1 when the proof failed: an error, a stream in flight at a fault that is
    inexact or failed, or a stream not in flight that is not exact (a no-fault
    stream that differs is a broken comparison or a broken engine)."""
    if report.get("error"):
        return 1
    t = report.get("stream_count") or {}
    f = t.get("in_flight") or {}
    if f.get("inexact") or f.get("failed") or t.get("not_in_flight_not_exact"):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
