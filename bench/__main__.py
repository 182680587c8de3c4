"""`python -m bench <experiment> [options]` (what `frmps bench` runs).

Experiments (name or number):
  1 recovery         recovery time across model sizes: frmps, sleep-only, cold restart
  2 prompt-length    recovery vs prompt length, with and without KV sharing (14B)
  3 since-sync       recovery vs tokens generated before the kill, N = 1 and 16, no-KV ablation (14B)
  4 sync-overhead    decode throughput overhead of syncing every N steps, per model size
  5 outage           client-visible outage under a steady stream of requests (14B)
  6 standby-memory   standby GPU memory per model size against a bare CUDA context
  7 correctness      outputs after recovery equal the no-fault outputs, K = 1..1024
Other commands: list, report (summaries + README tables from the result files; plots
with matplotlib when it is installed, else `make bench-plots` elsewhere).

Results: <out>/<experiment>.jsonl (one line per point, appended as measured; a re-run
of the same command skips what is done), <out>/<experiment>.json (summary),
<out>/runs.jsonl (environment of every run), <out>/README.md (tables).
--cpu runs any experiment on the CPU with the tiny model, SIGKILL instead of MPS
faults and host-shm memory: a check of the harness, not a measurement.
Exit status: 0 all planned points done, 2 some point failed (its error is recorded),
3 stopped by --budget before the end (re-run to continue).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time

from . import report
from .envinfo import capture_env, default_out_dir, new_run_id, repo_root
from .procs import Cleanup
from .results import ResultFile
from .runctx import Budget, BudgetExhausted, Ctx, Progress, fault_kinds
from .experiments import EXPERIMENTS, by_name_or_number


def _default_frmps() -> str:
    env = os.environ.get("FRMPS_BIN")
    if env:
        return env
    built = os.path.join(repo_root(), "bin", "frmps")
    return built if os.access(built, os.X_OK) else (shutil.which("frmps") or "frmps")


def portable_path(v):
    """Paths in a run's record relative to the repository (<repo>/...) or the home
    directory (~/...): result folders are committed and read on other machines."""
    if not isinstance(v, str) or os.path.sep not in v:
        return v
    for base, name in ((repo_root(), "<repo>"), (os.path.expanduser("~"), "~")):
        if base and base != os.path.sep and (v == base or v.startswith(base + os.path.sep)):
            return name + v[len(base):]
    return v


def _fault_arg(spec: str) -> str:
    try:
        return ",".join(fault_kinds(spec))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def common_args(p: argparse.ArgumentParser) -> None:
    root = repo_root()
    g = p.add_argument_group("common options")
    g.add_argument("--out", default="", help="results directory (default bench/results/<date>-<gpu>; --cpu: bench/build/bench-cpu)")
    g.add_argument("--frmps", default=_default_frmps(), help="the frmps binary (frmps bench passes itself)")
    g.add_argument("--python", default=sys.executable, help="Python that runs the engines (with frmps_engine importable)")
    g.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    g.add_argument("--cpu", action="store_true", help="CPU check of the harness: --device cpu, tiny model, no MPS, SIGKILL")
    g.add_argument("--no-mps", action="store_true", help="GPU without MPS: SIGKILL the victim instead of an MPS-client fault")
    g.add_argument("--engine", default="ref", choices=["ref", "vllm"],
                   help="the engine frmps serve and the baselines run (vllm: the vLLM adapter, vLLM's own sleep mode "
                        "and cold start)")
    g.add_argument("--memory", default="", help="frmps serve --memory (default cuda-vmm on the GPU, host-shm on the CPU)")
    g.add_argument("--quick", action="store_true", help="fewer points and trials")
    g.add_argument("--budget", type=float, default=0, help="stop before work that would end later than this many seconds")
    g.add_argument("--fault", default="misaligned:load", type=_fault_arg,
                   help="bench/faults trigger <program>:<variant> run as an MPS client; several, comma-separated, or "
                        "'all' (the seven kinds of the soaks): the faulted trials take them in turn (trial t the "
                        "(t mod n)-th), and the report gives each kind's figures (the MPS server's teardown, which "
                        "every recovery waits for, depends on the kind)")
    g.add_argument("--faults-dir", default=os.path.join(root, "bench", "build", "faults"))
    g.add_argument("--workdir", default=os.path.join("/tmp", "frmps-bench"), help="logs of engines and deployments")
    g.add_argument("--cache-dir", default=os.path.join(root, "bench", "build", "checkpoints"),
                   help="safetensors checkpoints for the cold restart (written once per model, evicted when the disk is full)")
    g.add_argument("--num-blocks", type=int, default=0, help="KV blocks (0: the engine's default)")
    g.add_argument("--max-num-seqs", type=int, default=0,
                   help="engines' batch size; exact mode (the GPU default) decodes at exactly this many rows "
                        "(0: 8, the outage experiment: its concurrency with the reference engine, vLLM's own "
                        "default with vLLM; sync-overhead: the saturating batch)")
    g.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for frmps's engines (`frmps serve --engine-arg`), repeatable, written "
                        "with '=' (it starts with '-'), e.g. --engine-arg=--vllm-arg=--enforce-eager; points are "
                        "keyed without it: give such a run "
                        "its own --out")
    g.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more `frmps serve` flag, repeatable, written with '=' (e.g. --serve-arg=--standby-kv=readonly "
                        "for an A/B run); points are keyed without it: give such a run its own --out")
    g.add_argument("--baseline-exact", action="store_true",
                   help="run the baselines' engines in exact mode too (default: their one-pass re-prefill)")
    g.add_argument("--max-model-len", type=int, default=0)
    g.add_argument("--max-attempts", type=int, default=2, help="attempts per point over re-runs (failures are kept)")
    g.add_argument("--fresh-deployments", action="store_true",
                   help="a new frmps serve pair for every faulted trial (default: reuse the pair once its failback "
                        "has restored the placement, as a deployment lives through fault after fault)")
    g.add_argument("--start-timeout", type=float, default=300)
    g.add_argument("--trial-timeout", type=float, default=300)
    g.add_argument("--cpu-step-delay-ms", type=float, default=10, help="--cpu: slow engine steps so kills land on time")
    g.add_argument("--no-plots", action="store_true", help="do not try to draw PNGs at the end")
    # Tests only: the CPU check with MPS on, run against test doubles of the MPS control program and
    # the fault triggers (vllmpatch/tests), so the GPU mode's fault path runs without a GPU.
    g.add_argument("--cpu-with-mps-doubles", action="store_true", help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="frmps bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    lp = sub.add_parser("list", help="list the experiments")
    lp.add_argument("--frmps", default="", help=argparse.SUPPRESS)
    rp = sub.add_parser("report", help="rewrite summaries and README tables (and plots if matplotlib is there)")
    rp.add_argument("--out", required=True)
    rp.add_argument("--frmps", default="", help=argparse.SUPPRESS)
    rp.add_argument("--no-plots", action="store_true")
    for e in EXPERIMENTS.values():
        sp = sub.add_parser(e.name, aliases=[str(e.number)], help=e.title, description=e.title)
        e.add_args(sp)
        common_args(sp)
    return p


def normalise(args) -> None:
    if args.cpu or args.cpu_with_mps_doubles:
        args.device = "cpu"
    if args.device == "cpu" and not args.cpu_with_mps_doubles:
        args.no_mps = True
    args.mps = not args.no_mps
    args.memory = args.memory or ("host-shm" if args.device == "cpu" else "cuda-vmm")
    args.python = os.path.abspath(args.python) if os.path.sep in args.python else args.python
    args.frmps = os.path.abspath(args.frmps) if os.path.sep in args.frmps else (shutil.which(args.frmps) or args.frmps)
    args.out = os.path.abspath(args.out or default_out_dir(args.device))
    os.makedirs(args.workdir, exist_ok=True)


def preflight(args, faults: bool, experiment: str = "") -> list[str]:
    """What is missing before anything starts (a clear message instead of N failed points)."""
    probs = []
    engines = set(getattr(args, "engines", "") and args.engines.split(",") or [args.engine])
    if "vllm" in engines:
        if args.device == "cpu" and experiment != "sync-overhead":
            probs.append("--engine vllm needs a GPU: vLLM builds no engine on the CPU (the CPU check runs the "
                         "harness with --engine ref; sync-overhead runs vLLM's scheduler on the CPU)")
        else:
            from .baselines import python_has_module

            if not python_has_module(args.python, "vllm"):
                probs.append(f"--engine vllm: {args.python} cannot import vllm (pass --python, or PYTHONPATH)")
    if not (os.access(args.frmps, os.X_OK)):
        probs.append(f"frmps binary not found: {args.frmps} (build it: make go-build, or pass --frmps)")
    if args.mps and shutil.which("nvidia-cuda-mps-control") is None:
        probs.append("nvidia-cuda-mps-control not in PATH (or run with --no-mps)")
    if args.mps and faults:
        for prog in dict.fromkeys(k.partition(":")[0] for k in fault_kinds(args.fault)):
            if not os.access(os.path.join(args.faults_dir, prog), os.X_OK):
                probs.append(f"fault trigger {os.path.join(args.faults_dir, prog)} not built (make -C bench/faults), "
                             "or run with --no-mps")
    return probs


def run_experiment(args) -> int:
    exp = by_name_or_number(args.cmd)
    normalise(args)
    exp.defaults(args)
    if not args.max_num_seqs and exp.name != "sync-overhead":
        args.max_num_seqs = exp.default_max_num_seqs(args)
    probs = preflight(args, exp.faults, exp.name)
    if probs:
        for pr in probs:
            print(f"frmps bench: {pr}", file=sys.stderr)
        return 1
    run_id = new_run_id()
    results = ResultFile(args.out, exp.name, run_id, args.max_attempts)
    plan = exp.plan(args)
    pending = results.pending(plan)
    cleanup = Cleanup()
    ctx = Ctx(args=args, out_dir=args.out, run_id=run_id, budget=Budget(args.budget), results=results,
              progress=Progress(exp.name, len(pending)), cleanup=cleanup)
    mode = "CPU check of the harness (not a measurement)" if args.device == "cpu" else f"{args.device}, MPS {'on' if args.mps else 'off'}"
    ctx.log(f"{exp.title}; {len(plan)} points planned, {len(plan) - len(pending)} already in {results.path}; {mode}")
    run = {"run_id": run_id, "experiment": exp.name, "argv": [portable_path(a) for a in sys.argv[1:]],
           "started_unix": time.time(), "cpu_check": args.device == "cpu", "mps": args.mps,
           "fault": args.fault if args.mps else "SIGKILL",
           "options": {k: portable_path(v) for k, v in vars(args).items()
                       if isinstance(v, (str, int, float, bool)) and k != "cmd"}}
    stopped = None

    def on_term(signum, _frame):
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, on_term) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        if any(results.status(k) == "pending" for k in pending):  # not just unsupported ones to look at again
            ctx.log("recording the environment")
            run["env"] = capture_env(args.python, args.frmps, args.device)
            try:
                exp.run(ctx)
            except BudgetExhausted as e:
                stopped = str(e)
                ctx.log(f"stopping: {e}; re-run the same command to continue")
    finally:
        cleanup.run()
        for s, h in old.items():
            signal.signal(s, h)
        run["ended_unix"] = time.time()
        run["stopped"] = stopped
        run["new_points"] = len(results.new_records)
        run["new_errors"] = sum(1 for r in results.new_records if not r["ok"] and not r.get("unsupported"))
        if pending:
            with open(os.path.join(args.out, "runs.jsonl"), "a") as f:
                f.write(json.dumps(run, sort_keys=True, default=str) + "\n")
        report.write_all(args.out, plots=not args.no_plots)
    st = [results.status(k) for k in plan]
    retry = sum(1 for k, s in zip(plan, st) if s == "pending" and results.attempts(k))
    ctx.log(f"done: {st.count('done')}/{len(plan)} points ok, {st.count('unsupported')} unsupported by the engine, "
            f"{st.count('failed')} failed for good, {retry} failed (a re-run retries them), "
            f"{st.count('pending') - retry} not measured yet; results in {args.out}")
    left = [k for k, s in zip(plan, st) if s == "pending"]
    if run["new_errors"]:
        return 2
    return 3 if stopped or left else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "list":
        for e in EXPERIMENTS.values():
            print(f"{e.number}  {e.name:<16} {e.title}")
        return 0
    if args.cmd == "report":
        written = report.write_all(os.path.abspath(args.out), plots=not args.no_plots)
        for w in written:
            print(w)
        return 0
    return run_experiment(args)


if __name__ == "__main__":
    sys.exit(main())
