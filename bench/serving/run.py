"""The sweep: per system, start its server, wait until it serves, read its KV
cache size, warm it up, run `vllm bench serve` for every (trial, rate) of the
plan, stop it; then the JSON, the README table and the plots. Also the checks
that refuse a run whose prerequisites are missing, and the client runner the
fault mode shares.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

from . import plan as P
from . import profile
from . import report, results
from .client import Client, ClientError
from .reuse import MPS_CONTROL, Cleanup, TrialError, kill_group, tail
from .servers import make_server


class Refused(RuntimeError):
    """A prerequisite of the run is missing; nothing was started."""


def _imports(python: str, module: str, env: dict | None = None) -> str:
    """'' when python can import module, else why not (the last line of its error)."""
    if not python:
        return "no interpreter given"
    try:
        r = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, timeout=300,
                           env={**os.environ, **(env or {})})
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    if r.returncode == 0:
        return ""
    lines = (r.stderr or r.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit status {r.returncode}"


def gpu_visible() -> str:
    """'' when nvidia-smi lists a GPU, else why not."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "nvidia-smi not found"
    try:
        r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"nvidia-smi -L: {e}"
    if r.returncode != 0 or "GPU" not in r.stdout:
        return f"nvidia-smi -L lists no GPU: {(r.stderr or r.stdout).strip()[-200:]}"
    return ""


def preflight(plan: P.Plan, systems: list[str], faults_dir: str = "", kinds: list[str] | None = None,
              check_imports: bool = True) -> list[str]:
    """Every missing prerequisite, as a sentence (empty: the run can start)."""
    why: list[str] = []
    if not os.path.isdir(plan.model) or not os.path.isfile(os.path.join(plan.model, "config.json")):
        why.append(f"--model {plan.model}: not a model directory with config.json "
                   f"(write one with `frmps model init <preset> --weights seeded`)")
    if not (os.path.isfile(plan.frmps) and os.access(plan.frmps, os.X_OK)):
        why.append(f"--frmps {plan.frmps}: not an executable frmps binary (make go-build)")
    if plan.device != "cpu":
        g = gpu_visible()
        if g:
            why.append(f"no GPU: {g} (--device cpu runs a check of the harness on the CPU)")
        if any(s in (P.VLLM_MPS, P.VLLM_MPS_RESTART) for s in systems) and shutil.which(MPS_CONTROL) is None:
            why.append(f"{MPS_CONTROL} not found: the systems in MPS need it")
    if faults_dir and plan.device != "cpu":
        missing = sorted({k.partition(":")[0] for k in kinds or []
                          if not os.access(os.path.join(faults_dir, k.partition(":")[0]), os.X_OK)})
        if missing:
            why.append(f"fault triggers missing in {faults_dir}: {', '.join(missing)} (make -C bench/faults)")
    if check_imports:
        err = _imports(plan.bench_python, "vllm.benchmarks.serve")
        if err:
            why.append(f"vllm bench serve cannot run with {plan.bench_python}: {err}")
        if any(s in P.VLLM_SYSTEMS or s == P.VLLM_MPS_RESTART for s in systems):
            err = _imports(plan.python, "vllm.entrypoints.cli.main")
            if err:
                why.append(f"vllm serve cannot run with {plan.python}: {err}")
        if any(s in P.FRMPS_SYSTEMS for s in systems):
            err = _imports(plan.python, "frmps_engine")
            if err:
                why.append(f"frmps's engines cannot run with {plan.python}: {err}")
    return why


# ----------------------------------------------------------------------------- signals and cleanup


class Interrupted(BaseException):
    pass


def install_cleanup(cleanup: Cleanup) -> None:
    """Stop every server and daemon however the run ends: SIGTERM and SIGINT
    unwind the driver (its finally blocks run), and atexit runs what is left."""

    def on_signal(signum, _frame):
        raise Interrupted(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    atexit.register(cleanup.run)


# ----------------------------------------------------------------------------- the client


def bench_client(plan: P.Plan, cleanup: Cleanup) -> Client:
    """The run's `vllm bench serve` (bench/serving/client.py: one process, vLLM's own
    client and parser, imported once), stopped by cleanup however the run ends."""
    c = Client(plan.bench_python, cleanup.add_proc, kill_group)
    cleanup.add(c.close)
    return c


def run_client(client: Client, cmd: list[str], log_path: str, timeout_s: float, on_start=None) -> int:
    """Run one `vllm bench serve` command line in client; its output to log_path.
    on_start(t) is called with time.perf_counter() when the client prints that its
    main run starts. Returns its exit status (TrialError past timeout_s, after
    killing the client, or when it died)."""
    try:
        return client.run(cmd, log_path, timeout_s, on_start)
    except ClientError as e:
        raise TrialError(f"vllm bench serve: {e}; log tail:\n{tail(log_path, 15)}") from None


def client_timeout(plan: P.Plan, rate: float, n: int | None = None) -> float:
    n = plan.num_prompts(rate) if n is None else n
    arrivals = 0.0 if rate == P.INF else n / rate
    return 300.0 + 3 * arrivals + n * plan.stream.max_output_len() * 0.05


# ----------------------------------------------------------------------------- the sweep


def print_plan(plan: P.Plan, out=None) -> None:
    """The exact command lines, ports and directories as placeholders."""
    out = out or sys.stdout
    print("# serving comparison plan (nothing is started)", file=out)
    print(f"# systems: {', '.join(plan.systems)}; kv: {plan.alike.kv_mode}; trials: {plan.trials}; "
          f"rates: {', '.join(P.rate_label(r) for r in plan.rates)}", file=out)
    for system in plan.systems:
        print(f"\n## {system} ({P.SYSTEM_LABELS[system]})", file=out)
        if system in P.VLLM_SYSTEMS:
            if system == P.VLLM_MPS:
                print(P.shell([plan.frmps, "bench", "mps", "start", "--run-dir", "<mps run dir>"]), file=out)
                print("# vllm serve runs with the CUDA_MPS_* environment that command prints", file=out)
            print(P.shell(plan.vllm_serve_cmd(8000)).replace("8000", "<port>"), file=out)
            if system == P.VLLM_MPS:
                print(P.shell([plan.frmps, "bench", "mps", "stop", "--run-dir", "<mps run dir>"]), file=out)
        else:
            print(P.shell(plan.frmps_serve_cmd(system, 8000, "<admin>", "<run dir>", "<log dir>")).replace("8000", "<port>"),
                  file=out)
        print(P.shell(plan.warmup_cmd("http://127.0.0.1:<port>", "<dir>")), file=out)
        for trial, rate in plan.schedule():
            print(P.shell(plan.bench_cmd("http://127.0.0.1:<port>", rate, trial, "<dir>",
                                         trial_name(system, plan.alike.kv_mode, rate, trial))), file=out)
        if plan.py_spy:
            for view in plan.py_spy_views:
                print(f"# one more run at rate {P.rate_label(plan.py_spy_rate)}, not counted, with {plan.py_spy} record "
                      f"--pid <engine pid> ({view} view)", file=out)
        if plan.after_failover and system in P.FRMPS_SYSTEMS:
            print("# POST /v1/admin/failover on the admin address, the failback, a ready spare; then the warm-up and "
                  f"the trials again as {system}{P.AFTER_FAILOVER}", file=out)
    est = plan.estimate_s()
    print(f"\n# estimate: {', '.join(f'{k} {v} s' for k, v in est.items())}; total {sum(est.values())} s", file=out)


def trial_name(system: str, kv_mode: str, rate: float, trial: int) -> str:
    return f"{system}-{kv_mode}-r{P.rate_label(rate)}-t{trial}.json"


def profile_run(plan: P.Plan, client: Client, srv, raw_dir: str, wlog: str, log=print) -> list[dict]:
    """After a system's trials, one more run per py-spy view (plan.py_spy_views)
    at plan.py_spy_rate (default saturation), not counted among the trials, while py-spy samples the
    engine process's threads (bench/serving/profile.py). The stacks go to
    raw/profile-<system>[-<view>].stacks; returns each view's summary."""
    pid = srv.engine_pid()
    if not pid:
        return [{"error": "no engine process found"}]
    out = []
    for view in plan.py_spy_views:
        name = f"profile-{srv.system}" + ("" if view == "cpu" else f"-{view}")
        cmd = plan.bench_cmd(srv.base, plan.py_spy_rate, 0, raw_dir, name + ".json", label=srv.system)
        stacks = os.path.join(raw_dir, name + ".stacks")
        timeout = client_timeout(plan, plan.py_spy_rate)
        rec: dict = {"view": view, "pid": pid, "rate": P.rate_label(plan.py_spy_rate), "stacks": f"raw/{name}.stacks",
                     "result": f"raw/{name}.json"}
        meter = profile.CpuMeter(srv.root_pid(), srv.roles())

        def run() -> None:  # called by py_spy within this iteration
            meter.start()
            rec["client_rc"] = run_client(client, cmd, wlog, timeout)

        rec["threads"] = profile.py_spy(plan.py_spy, pid, timeout, stacks, run, view)
        rec["cpu"] = meter.stop()
        busiest = next(iter(rec["threads"].items()), None) if "error" not in rec["threads"] else None
        log(f"[{srv.system}] py-spy ({view}) of pid {pid} during one more run at rate {P.rate_label(plan.py_spy_rate)}: "
            + (f"busiest thread {busiest[0]} ({busiest[1]['samples']} samples)" if busiest else str(rec["threads"])[:200]))
        out.append(rec)
    return out


def run_trials(plan: P.Plan, client: Client, srv, label: str, raw_dir: str, wlog: str, jsonl: str, log=print) -> None:
    """The warm-up run, then every trial of the plan against srv, each appended to
    jsonl under the system name `label` as it ends."""
    kv = plan.alike.kv_mode
    rc = run_client(client, plan.warmup_cmd(srv.base, raw_dir), wlog, client_timeout(plan, P.INF, plan.warmup_n()))
    if rc != 0:
        log(f"[{label}] warm-up: vllm bench serve exited {rc}")
    for trial, rate in plan.schedule():
        name = trial_name(label, kv, rate, trial)
        cmd = plan.bench_cmd(srv.base, rate, trial, raw_dir, name, label=label)
        rec = {"system": label, "kv_mode": kv, "rate": P.rate_label(rate), "trial": trial,
               "seed": plan.trial_seed(trial), "num_prompts": plan.num_prompts(rate), "file": f"raw/{name}"}
        t1 = time.monotonic()
        meter = profile.CpuMeter(srv.root_pid(), srv.roles())
        meter.start()
        try:
            rc = run_client(client, cmd, wlog, client_timeout(plan, rate))
            if rc != 0:
                raise TrialError(f"vllm bench serve exited {rc}; log tail:\n{tail(wlog, 15)}")
            raw = results.load_bench_json(os.path.join(raw_dir, name))
            rec.update(results.trial_record(raw, plan.slo_ttft_ms, plan.slo_tpot_ms, plan.stream.min_output_len()))
        except (TrialError, results.ResultError) as e:
            rec["error"] = str(e)[-2000:]
        rec["cpu"] = meter.stop(rec.get("total_output_tokens"))
        rec["wall_s"] = round(time.monotonic() - t1, 1)
        with open(jsonl, "a") as f:
            f.write(json.dumps(rec) + "\n")
        log(f"[{label}] rate {rec['rate']} trial {trial}: " + (
            f"ERROR {rec['error'][:200]}" if rec.get("error") else
            f"{rec['output_throughput']:.1f} out tok/s, p99 TPOT {rec.get('p99_tpot_ms') or 0:.1f} ms, "
            f"failed {rec.get('failed')}, {rec['wall_s']} s"))


def run_sweep(plan: P.Plan, out_dir: str, cleanup: Cleanup | None = None, log=print) -> dict:
    """Run the plan; every trial is appended to out_dir/trials.jsonl as it ends,
    and results.json, README.md and the plots are rewritten at the end. With
    plan.after_failover, each frmps system is measured again after a failover
    drill and its failback, as system `<name>+failover`."""
    cleanup = cleanup or Cleanup()
    os.makedirs(out_dir, exist_ok=True)
    raw_dir = os.path.join(out_dir, "raw")
    work = os.path.join(out_dir, "work")
    os.makedirs(raw_dir, exist_ok=True)
    os.makedirs(work, exist_ok=True)
    kv = plan.alike.kv_mode
    jsonl = os.path.join(out_dir, "trials.jsonl")
    with open(os.path.join(out_dir, "plans.jsonl"), "a") as f:
        f.write(json.dumps({"kind": "sweep", **plan.to_json()}) + "\n")
    client = bench_client(plan, cleanup)
    try:
        for system in plan.systems:
            srv = make_server(plan, system, work, cleanup)
            info = {"system": system, "kv_mode": kv}
            try:
                t0 = time.monotonic()
                log(f"[{system}] start: {P.shell(srv.command())}")
                srv.start()
                srv.wait_ready(plan.ready_timeout_s)
                info["start_s"] = round(time.monotonic() - t0, 1)
                info["kv"] = srv.kv_blocks()
                info["compile"] = srv.compile_state()
                log(f"[{system}] serving after {info['start_s']} s; KV blocks {info['kv'].get('num_blocks')} "
                    f"({info['kv'].get('source')}); compiled model {info['compile']}")
                wlog = os.path.join(work, f"client-{system}-{kv}.log")
                run_trials(plan, client, srv, system, raw_dir, wlog, jsonl, log)
                if plan.py_spy:
                    info["py_spy"] = profile_run(plan, client, srv, raw_dir, wlog, log)
                if plan.after_failover and system in P.FRMPS_SYSTEMS:
                    label = system + P.AFTER_FAILOVER
                    info["failover_drill"] = srv.failover_drill(plan.ready_timeout_s)
                    info["compile_after_failover"] = srv.compile_state()
                    log(f"[{system}] failover drill and failback in {info['failover_drill']['drill_s']} s; "
                        f"compiled model {info['compile_after_failover']}; the trials again as {label}")
                    run_trials(plan, client, srv, label, raw_dir, wlog, jsonl, log)
            except TrialError as e:
                info["error"] = str(e)[-3000:]
                log(f"[{system}] ERROR: {info['error'][:500]}")
            finally:
                info.update(srv.describe())
                srv.stop()
                with open(os.path.join(out_dir, "servers.jsonl"), "a") as f:
                    f.write(json.dumps(info) + "\n")
    finally:
        cleanup.run()
    return report.build(out_dir)
