"""python -m bench.serving {sweep,faults,report} ...: see README.md here.

  sweep   every system at every rate, --trials times (vllm bench serve)
  faults  the stream at one rate for --window-s while an MPS client faults every --spacing-s
  report  rebuild results.json, README.md and the plots of a results directory

--dry-run prints the exact command lines and an estimate, and starts nothing.
Exit status: 0 done, 1 a system or trial failed (recorded in the results),
2 refused (a prerequisite is missing) or bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import plan as P


def _repo() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _default_python() -> str:
    return os.environ.get("FRMPS_PYTHON") or sys.executable


def add_common(ap: argparse.ArgumentParser, systems_default: str, allowed: list[str]) -> None:
    ap.add_argument("--model", required=True, help="model directory every system loads (frmps model init <preset> --weights seeded)")
    ap.add_argument("--frmps", default=os.path.join(_repo(), "bin", "frmps"), help="the frmps binary")
    ap.add_argument("--python", default=_default_python(),
                    help="interpreter of `vllm serve` and of frmps's engines (default: $FRMPS_PYTHON, else this one)")
    ap.add_argument("--bench-python", default="", help="interpreter of `vllm bench serve` (default: --python)")
    ap.add_argument("--out", required=True, help="results directory (runs append to it; report rebuilds it)")
    ap.add_argument("--systems", default=systems_default, help=f"comma-separated subset of {', '.join(allowed)}")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a check of the harness with the reference engine (frmps only), not a measurement")
    ap.add_argument("--served-model-name", default="")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.5, help="lengths drawn in [len*(1-r), len*(1+r)]")
    ap.add_argument("--seed", type=int, default=0, help="trial i uses seed + i")
    at_default = "(0, the default: each system's default, which is vllm serve's for both: no flag to either)"
    ap.add_argument("--max-num-seqs", type=int, default=0, help=f"every system's bound {at_default}")
    ap.add_argument("--max-num-batched-tokens", type=int, default=0, help=f"every system's bound {at_default}")
    ap.add_argument("--max-model-len", type=int, default=0, help=f"every system's context {at_default}")
    ap.add_argument("--kv-blocks", type=int, default=0, help="KV blocks for every system (0: each at its default memory fraction)")
    ap.add_argument("--slo-ttft-ms", type=float, default=P.DEFAULT_SLO_TTFT_MS)
    ap.add_argument("--slo-tpot-ms", type=float, default=P.DEFAULT_SLO_TPOT_MS)
    ap.add_argument("--warmup-prompts", type=int, default=0, help=f"untimed requests per system before its trials (0: max-num-seqs, {P.DEFAULT_WARMUP_PROMPTS} at the default)")
    ap.add_argument("--ready-timeout-s", type=float, default=900.0)
    ap.add_argument("--vllm-arg", action="append", default=[], help="one more `vllm serve` flag (repeatable; say it in the report)")
    ap.add_argument("--frmps-arg", action="append", default=[], help="one more `frmps serve` flag (repeatable)")
    ap.add_argument("--dry-run", action="store_true", help="print the command lines and an estimate; start nothing")
    ap.add_argument("--skip-import-checks", action="store_true", help=argparse.SUPPRESS)


def make_plan(a, systems: list[str], rates: list[float], trials: int, trial_s: float, inf_prompts: int = 0,
              inf_concurrency: int = 0) -> P.Plan:
    plan = P.Plan(model=os.path.abspath(a.model) if os.path.isdir(a.model) else a.model,
                  frmps=os.path.abspath(a.frmps), python=a.python, bench_python=a.bench_python or a.python,
                  systems=systems, rates=rates, trials=trials,
                  stream=P.Stream(input_len=a.input_len, output_len=a.output_len, range_ratio=a.range_ratio,
                                  seed=a.seed, trial_s=trial_s, inf_prompts=inf_prompts,
                                  inf_concurrency=inf_concurrency),
                  alike=P.Alike(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                                max_model_len=a.max_model_len, kv_blocks=a.kv_blocks),
                  slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms, device=a.device,
                  served_model_name=a.served_model_name, vllm_args=a.vllm_arg, frmps_args=a.frmps_arg,
                  warmup_prompts=a.warmup_prompts, ready_timeout_s=a.ready_timeout_s)
    plan.check()
    return plan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="frmps bench serving", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sw = sub.add_parser("sweep", help="every system at every rate, --trials times")
    add_common(sw, ",".join(P.SYSTEMS), P.SYSTEMS)
    sw.add_argument("--rates", default="2,8,32,inf", help="requests per second, comma-separated; inf: all at once")
    sw.add_argument("--trials", type=int, default=3)
    sw.add_argument("--trial-s", type=float, default=20.0, help="a finite rate sends rate x trial-s requests")
    sw.add_argument("--py-spy", default="", help="py-spy executable: after each system's trials, one more saturation run "
                    "(not counted) with the engine process's threads sampled (raw/profile-<system>.stacks)")
    sw.add_argument("--py-spy-views", default="idle",
                    help="with --py-spy: comma list of cpu (on the CPU only), gil (holding the GIL), idle (everything, "
                    "waits included); one run each")
    sw.add_argument("--py-spy-rate", default="inf", help="with --py-spy: the profile runs' request rate (inf: saturation)")
    sw.add_argument("--after-failover", action="store_true",
                    help="frmps systems: after their trials, a failover drill (admin API) and its failback, then the "
                    "trials again as <system>+failover (the engine serving then is one started after the first)")
    sw.add_argument("--inf-prompts", type=int, default=0, help=f"requests of an inf trial (0: 4 x max-num-seqs, {P.DEFAULT_INF_PROMPTS} at the default)")
    sw.add_argument("--inf-concurrency", type=int, default=0,
                    help="an inf trial keeps at most this many requests in flight (vllm bench serve --max-concurrency): "
                         "a steady state at saturation; 0: every request at once (one burst)")
    fa = sub.add_parser("faults", help="the stream at one rate while an MPS client faults at a fixed spacing")
    add_common(fa, ",".join(P.FAULT_SYSTEMS), P.FAULT_SYSTEMS)
    fa.add_argument("--rate", type=float, default=4.0)
    fa.add_argument("--window-s", type=float, default=300.0)
    fa.add_argument("--spacing-s", default="60,15",
                    help="seconds between faults, comma-separated: one window per spacing and system "
                         "(include one shorter than frmps's restore)")
    fa.add_argument("--fault-kinds", default="all", help="<program>:<variant>,... or all (rotated)")
    fa.add_argument("--faults-dir", default=os.path.join(_repo(), "bench", "build", "faults"))
    rp = sub.add_parser("report", help="rebuild results.json, README.md and the plots of a results directory")
    rp.add_argument("dir")
    a = ap.parse_args(argv)

    from . import report

    if a.cmd == "report":
        from .results import ResultError

        try:
            report.build(a.dir)
        except ResultError as e:
            print(f"report: {e}", file=sys.stderr)
            return 2
        print(os.path.join(a.dir, "README.md"))
        return 0

    from .reuse import Cleanup, fault_kinds
    from .run import Interrupted, Refused, install_cleanup, preflight, print_plan, run_sweep

    try:
        if a.cmd == "sweep":
            systems = P.parse_systems(a.systems, P.SYSTEMS)
            plan = make_plan(a, systems, P.parse_rates(a.rates), a.trials, a.trial_s, a.inf_prompts, a.inf_concurrency)
            plan.after_failover = a.after_failover
            if a.py_spy:
                if not (os.path.isfile(a.py_spy) and os.access(a.py_spy, os.X_OK)):
                    raise ValueError(f"--py-spy {a.py_spy!r}: not an executable file")
                plan.py_spy = os.path.abspath(a.py_spy)
            from .profile import VIEWS
            views = [v.strip() for v in a.py_spy_views.split(",") if v.strip()]
            if not views or [v for v in views if v not in VIEWS] or len(set(views)) != len(views):
                raise ValueError(f"--py-spy-views {a.py_spy_views!r}: a comma list of {', '.join(VIEWS)}, each once")
            plan.py_spy_views = views
            try:
                spy_rate = P.parse_rates(a.py_spy_rate)
            except ValueError:
                spy_rate = []
            if len(spy_rate) != 1:
                raise ValueError(f"--py-spy-rate {a.py_spy_rate!r}: one request rate (a number or inf)")
            plan.py_spy_rate = spy_rate[0]
            kinds, spacings = [], []
        else:
            systems = P.parse_systems(a.systems, P.FAULT_SYSTEMS)
            if a.device == "cpu" and set(systems) - {P.FRMPS}:
                raise ValueError(f"--device cpu runs only {P.FRMPS}")
            if not a.rate > 0 or a.rate == P.INF:
                raise ValueError("--rate: a finite positive rate (the fault run is a steady stream)")
            spacings = [float(x) for x in a.spacing_s.split(",") if x.strip()]
            if not spacings or any(s <= 0 for s in spacings):
                raise ValueError(f"--spacing-s {a.spacing_s!r}: positive seconds, comma-separated")
            kinds = fault_kinds(a.fault_kinds)
            cpu_ok_systems = [P.FRMPS] if a.device == "cpu" else systems
            plan = make_plan(a, cpu_ok_systems, [a.rate], 1, a.window_s)
    except ValueError as e:
        print(f"frmps bench serving: {e}", file=sys.stderr)
        return 2

    if a.dry_run:
        if a.cmd == "sweep":
            print_plan(plan)
        else:
            from .faults import fault_times

            print("# fault mode plan (nothing is started)")
            for sp in spacings:
                print(f"# spacing {sp:g} s: faults at {fault_times(a.window_s, sp)} s of the client's run, kinds rotated: "
                      f"{', '.join(kinds) if a.device != 'cpu' else 'SIGKILL of the active (CPU)'}")
            for system in plan.systems:
                print(f"\n## {system} ({P.SYSTEM_LABELS[system]})")
                if system == P.VLLM_MPS_RESTART:
                    print(P.shell([plan.frmps, "bench", "mps", "start", "--run-dir", "<mps run dir>"]))
                    print("# restart loop: the command below again whenever it exits or /health fails for 5 s")
                    print(P.shell(plan.vllm_serve_cmd(8000)).replace("8000", "<port>"))
                else:
                    print(P.shell(plan.frmps_serve_cmd(system, 8000, "<admin>", "<run dir>", "<log dir>")).replace("8000", "<port>"))
                n = max(1, int(round(a.rate * a.window_s)))
                print(P.shell(plan.bench_cmd("http://127.0.0.1:<port>", a.rate, 0, "<dir>", f"fault-{system}-s<spacing>.json",
                                             num_prompts=n)))
            est = sum(len(spacings) * (a.window_s + 180) for _ in plan.systems)
            print(f"\n# estimate: about {est:.0f} s ({len(spacings)} windows of {a.window_s:g} s per system + starts)")
        return 0

    why = preflight(plan, plan.systems, a.faults_dir if a.cmd == "faults" else "", kinds,
                    check_imports=not a.skip_import_checks)
    if why:
        print("frmps bench serving: refused, nothing was started:\n  - " + "\n  - ".join(why), file=sys.stderr)
        return 2

    cleanup = Cleanup()
    install_cleanup(cleanup)
    try:
        if a.cmd == "sweep":
            doc = run_sweep(plan, a.out, cleanup)
            bad = [t for t in doc["trials"] if t.get("error")] + [s for s in doc["servers"] if s.get("error")]
        else:
            from .faults import run_faults

            doc = run_faults(plan, a.out, a.rate, a.window_s, spacings, kinds, a.faults_dir, cleanup)
            bad = [r for r in doc["fault_runs"] if r.get("error")]
    except Interrupted as e:
        print(f"frmps bench serving: stopped ({e}); servers and MPS daemons stopped", file=sys.stderr)
        return 130
    finally:
        cleanup.run()
    print(json.dumps({"results": os.path.join(a.out, "README.md"), "failed": len(bad)}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
