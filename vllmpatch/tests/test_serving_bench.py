"""bench/serving (`frmps bench serving`): the plan (command lines, the settings
every system gets alike, the rate sweep), reading `vllm bench serve` results
(a real vLLM 0.26.0 result file: serving_fixtures/vllm026-bench-serve-rate4.json,
written by its client against `frmps serve` on the CPU; and variants of it
with a failed and a truncated request), the aggregation and its "beyond the
spread" rule, the report writers, the fault mode's analysis, the refusals, and
the lifecycle of servers and MPS daemons (vllm serve replaced by a labelled
test double; the MPS control daemon by the supervisor's test double)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.serving import faults as F  # noqa: E402
from bench.serving import plan as P  # noqa: E402
from bench.serving import report as RP  # noqa: E402
from bench.serving import results as R  # noqa: E402
from bench.serving import servers as S  # noqa: E402
from bench.serving.__main__ import main as cli  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serving_fixtures", "vllm026-bench-serve-rate4.json")
VLLM026_PY = os.path.join(REPO, ".venv-vllm026", "bin", "python")
FAKE_MPS_DIR = os.path.join(REPO, "supervisor", "mps", "testdata")


def mkplan(**kw) -> P.Plan:
    base = dict(model="/models/m", frmps="/bin/frmps", python="/py/python", bench_python="/py/bench",
                systems=list(P.SYSTEMS), rates=[2.0, 8.0, P.INF], trials=3)
    base.update(kw)
    p = P.Plan(**base)
    p.check()
    return p


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


# ----------------------------------------------------------------------------- plan


def test_rates_sorted_with_inf_last_and_bad_rates_refused():
    assert P.parse_rates("inf, 8,2") == [2.0, 8.0, P.INF]
    assert [P.rate_label(r) for r in P.parse_rates("0.5,inf")] == ["0.5", "inf"]
    for bad in ("", "0", "-1", "x", "2,2", "nan"):
        with pytest.raises(ValueError, match="--rates"):
            P.parse_rates(bad)


def test_systems_subset_in_run_order():
    assert P.parse_systems("frmps,vllm-serve", P.SYSTEMS) == [P.VLLM, P.FRMPS]
    for bad in ("", "vllm", "frmps,frmps"):
        with pytest.raises(ValueError, match="--systems"):
            P.parse_systems(bad, P.SYSTEMS)


def test_servers_get_the_same_batch_bounds_and_context():
    p = mkplan(alike=P.Alike(max_num_seqs=48, max_num_batched_tokens=4096, max_model_len=2048))
    v = p.vllm_serve_cmd(8100)
    assert v[:5] == ["/py/python", "-m", "vllm.entrypoints.cli.main", "serve", "/models/m"]
    assert (flag(v, "--max-num-seqs"), flag(v, "--max-num-batched-tokens"), flag(v, "--max-model-len")) == ("48", "4096", "2048")
    assert flag(v, "--port") == "8100" and flag(v, "--host") == "127.0.0.1"
    assert "--num-gpu-blocks-override" not in v and "--gpu-memory-utilization" not in v  # its own default fraction
    f = p.frmps_serve_cmd(P.FRMPS, 8000, "127.0.0.1:8001", "/run", "/logs")
    assert f[:4] == ["/bin/frmps", "serve", "--model", "/models/m"]
    assert "--engine-arg=--max-num-seqs=48" in f and "--engine-arg=--max-num-batched-tokens=4096" in f
    assert flag(f, "--max-model-len") == "2048"
    # frmps at its defaults: no engine, device, memory, frontend or KV flags of its own
    for absent in ("--engine", "--device", "--memory", "--frontend", "--num-blocks", "--no-mps", "--gpu-memory-utilization"):
        assert absent not in f
    fe = p.frmps_serve_cmd(P.FRMPS_VLLM_FE, 8000, "a", "r", "l")
    assert fe[fe.index("--frontend") + 1] == "vllm" and fe[:-2] == f[:4] + fe[4:-2]


def test_bounds_left_at_zero_are_every_systems_default_with_no_flag():
    """The harness's default: each system as a user starts it, at vLLM serve's batch
    bounds and the model's context (frmps serve takes them for its engines)."""
    p = mkplan(alike=P.Alike(max_num_seqs=0, max_num_batched_tokens=0, max_model_len=0))
    v = p.vllm_serve_cmd(8100)
    f = p.frmps_serve_cmd(P.FRMPS, 8000, "a", "r", "l")
    for absent in ("--max-num-seqs", "--max-num-batched-tokens", "--max-model-len"):
        assert absent not in v and absent not in f
    assert not [a for a in f if a.startswith("--engine-arg")]
    assert p.num_prompts(P.INF) == P.DEFAULT_INF_PROMPTS and p.warmup_n() == P.DEFAULT_WARMUP_PROMPTS
    assert "at `vllm serve`'s defaults" in p.alike.describe()
    mixed = P.Alike(max_num_seqs=32, max_num_batched_tokens=0, max_model_len=0)
    assert mixed.vllm_flags() == ["--max-num-seqs", "32"] and mixed.describe().startswith("max_num_seqs 32, ")
    with pytest.raises(ValueError, match="or 0 for the systems' default"):
        mkplan(alike=P.Alike(max_num_seqs=-1))
    # the CLI's default
    args = ["sweep", "--model", "/m", "--out", "/o", "--python", "/py", "--dry-run"]
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        cli(args)
    out = buf.getvalue()
    assert "--max-num-seqs" not in out and "--engine-arg" not in out and "--max-model-len" not in out


def test_equal_kv_blocks_reach_every_system():
    p = mkplan(alike=P.Alike(kv_blocks=5000))
    assert flag(p.vllm_serve_cmd(1), "--num-gpu-blocks-override") == "5000"
    for s in (P.FRMPS, P.FRMPS_VLLM_FE):
        assert flag(p.frmps_serve_cmd(s, 1, "a", "r", "l"), "--num-blocks") == "5000"
    assert p.alike.kv_mode == "equal-kv-5000" and mkplan().alike.kv_mode == "default-kv"


def test_cpu_check_runs_only_frmps_on_the_reference_engine():
    p = mkplan(systems=[P.FRMPS], device="cpu")
    f = p.frmps_serve_cmd(P.FRMPS, 1, "a", "r", "l")
    assert f[-7:] == ["--engine", "ref", "--device", "cpu", "--memory", "host-shm", "--no-mps"]
    with pytest.raises(ValueError, match="--device cpu"):
        mkplan(systems=[P.FRMPS, P.VLLM], device="cpu")


def test_plan_refuses_requests_longer_than_the_context_and_bad_values():
    with pytest.raises(ValueError, match="exceeds --max-model-len"):
        mkplan(stream=P.Stream(input_len=1024, output_len=256, range_ratio=0.5), alike=P.Alike(max_model_len=1500))
    with pytest.raises(ValueError, match="range-ratio"):
        mkplan(stream=P.Stream(range_ratio=1.0))
    with pytest.raises(ValueError, match="--trials"):
        mkplan(trials=0)
    with pytest.raises(ValueError, match="--model is required"):
        mkplan(model="")


def test_client_command_is_vllm_bench_serve_with_the_stated_stream():
    p = mkplan(stream=P.Stream(input_len=256, output_len=64, range_ratio=0.25, seed=7, trial_s=10))
    c = p.bench_cmd("http://127.0.0.1:9", 8.0, 2, "/res", "x.json")
    assert c[:5] == ["/py/bench", "-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    assert flag(c, "--dataset-name") == "random" and flag(c, "--random-input-len") == "256"
    assert flag(c, "--random-output-len") == "64" and flag(c, "--random-range-ratio") == "0.25"
    assert flag(c, "--request-rate") == "8" and flag(c, "--burstiness") == "1.0"
    assert flag(c, "--num-prompts") == "80"  # rate x trial_s
    assert flag(c, "--seed") == "9"  # seed + trial
    assert c[c.index("--goodput") + 1:c.index("--goodput") + 3] == ["ttft:1000", "tpot:50"]
    assert flag(c, "--metric-percentiles") == "50,99" and flag(c, "--percentile-metrics") == "ttft,tpot,itl,e2el"
    for f in ("--save-result", "--save-detailed", "--ignore-eos"):
        assert f in c
    assert flag(c, "--model") == "/models/m" and flag(c, "--tokenizer") == "/models/m"
    ci = p.bench_cmd("http://h", P.INF, 0, "/res", "y.json")
    assert flag(ci, "--request-rate") == "inf" and flag(ci, "--num-prompts") == str(4 * p.alike.max_num_seqs)
    assert flag(mkplan(stream=P.Stream(inf_prompts=50)).bench_cmd("h", P.INF, 0, "r", "f"), "--num-prompts") == "50"
    assert flag(mkplan(served_model_name="qwen").bench_cmd("h", 1.0, 0, "r", "f"), "--model") == "qwen"


def test_client_command_parses_with_vllm_bench_serve():
    """The command line as vLLM's own parser of `vllm bench serve` reads it: vLLM
    0.26.0's (the checkout's .venv-vllm026, the version on the GPU machine), else
    this interpreter's; in a subprocess (its import is slow)."""
    p = mkplan(stream=P.Stream(input_len=32, output_len=8, trial_s=2))
    argv = p.bench_cmd("http://127.0.0.1:9", 4.0, 1, "/res", "x.json")[5:]
    code = ("import json,sys; from vllm.benchmarks.serve import add_cli_args; "
            "from vllm.utils.argparse_utils import FlexibleArgumentParser; ap = FlexibleArgumentParser(); add_cli_args(ap); "
            "a = ap.parse_args(json.loads(sys.argv[1])); "
            "print(json.dumps([a.request_rate, a.num_prompts, a.seed, a.goodput, a.save_detailed, a.random_range_ratio]))")
    try:
        r = subprocess.run([VLLM026_PY if os.access(VLLM026_PY, os.X_OK) else sys.executable, "-c", code, json.dumps(argv)],
                           capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("vLLM's parser did not answer within 240 s")
    if r.returncode != 0 and "No module named 'vllm" in r.stderr:
        pytest.skip("vLLM is not installed in this interpreter")
    assert r.returncode == 0, r.stderr[-2000:]
    rate, n, seed, goodput, detailed, rr = json.loads(r.stdout.strip().splitlines()[-1])
    assert (rate, n, seed, goodput, detailed, float(rr)) == (4.0, 8, 1, ["ttft:1000", "tpot:50"], True, 0.5)


def test_schedule_runs_every_rate_in_each_trial_and_estimates():
    p = mkplan(rates=[2.0, P.INF], trials=2, stream=P.Stream(trial_s=10))
    assert p.schedule() == [(0, 2.0), (0, P.INF), (1, 2.0), (1, P.INF)]
    est = p.estimate_s(start_s={s: 60.0 for s in P.SYSTEMS}, drain_s=5, client_s=0, import_s=0)
    assert est[P.VLLM] == 60 + 10 + 4 * (10 + 5)
    assert p.estimate_s(start_s={s: 60.0 for s in P.SYSTEMS}, drain_s=5, client_s=10, import_s=0)[P.VLLM] == est[P.VLLM] + 5 * 10
    once = p.estimate_s(start_s={s: 60.0 for s in P.SYSTEMS}, drain_s=5, client_s=0, import_s=30)
    assert once[p.systems[0]] == est[p.systems[0]] + 30 and once[p.systems[1]] == est[p.systems[1]]


def test_dry_run_prints_every_command_and_starts_nothing(capsys, tmp_path):
    out = tmp_path / "out"
    rc = cli(["sweep", "--model", str(tmp_path), "--out", str(out), "--frmps", "/bin/true", "--rates", "1,inf",
              "--trials", "2", "--dry-run"])
    text = capsys.readouterr().out
    assert rc == 0 and not out.exists()
    assert text.count(" bench serve ") == 4 * (2 * 2 + 1)  # every system: its warm-up and 2 trials x 2 rates
    assert text.count(" serve " + str(tmp_path)) == 2  # vllm serve, alone and in MPS
    assert "bench mps start" in text and "bench mps stop" in text and "--frontend vllm" in text
    assert "# estimate:" in text
    rc = cli(["faults", "--model", str(tmp_path), "--out", str(out), "--frmps", "/bin/true", "--window-s", "120",
              "--spacing-s", "60,15", "--dry-run"])
    text = capsys.readouterr().out
    assert rc == 0 and "faults at [60.0] s" in text and "faults at [15.0, 30.0, 45.0, 60.0, 75.0, 90.0, 105.0] s" in text
    assert "restart loop" in text and not out.exists()
    # A steady saturation: the inf trials (not the warm-up) keep at most N requests in flight.
    rc = cli(["sweep", "--model", str(tmp_path), "--out", str(out), "--frmps", "/bin/true", "--rates", "4,inf",
              "--systems", "frmps", "--inf-prompts", "1024", "--inf-concurrency", "256", "--dry-run"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if " bench serve " in ln]
    assert rc == 0 and len(lines) == 1 + 2 * 3
    inf = [ln for ln in lines if "--request-rate inf" in ln and "warmup" not in ln]
    assert len(inf) == 3 and all("--max-concurrency 256" in ln and "--num-prompts 1024" in ln for ln in inf)
    assert not [ln for ln in lines if "--max-concurrency" in ln and ("warmup" in ln or "--request-rate 4" in ln)]
    rc = cli(["sweep", "--model", str(tmp_path), "--out", str(out), "--frmps", "/bin/true", "--inf-concurrency", "-1",
              "--dry-run"])
    assert rc == 2 and "--inf-concurrency -1" in capsys.readouterr().err
    # The profile run at a chosen rate (the low rates' per-token cost), and one rate only.
    spy = tmp_path / "py-spy"
    spy.write_text("#!/bin/sh\n")
    spy.chmod(0o755)
    rc = cli(["sweep", "--model", str(tmp_path), "--out", str(out), "--frmps", "/bin/true", "--rates", "16",
              "--systems", "frmps", "--py-spy", str(spy), "--py-spy-rate", "16", "--dry-run"])
    text = capsys.readouterr().out
    assert rc == 0 and "# one more run at rate 16, not counted" in text
    rc = cli(["sweep", "--model", str(tmp_path), "--out", str(out), "--frmps", "/bin/true", "--rates", "16",
              "--systems", "frmps", "--py-spy", str(spy), "--py-spy-rate", "4,16", "--dry-run"])
    assert rc == 2 and "--py-spy-rate '4,16': one request rate" in capsys.readouterr().err
    rc = cli(["sweep", "--model", str(tmp_path), "--out", str(out), "--frmps", "/bin/true", "--rates", "16",
              "--systems", "frmps", "--py-spy", str(spy), "--py-spy-rate", "fast", "--dry-run"])
    assert rc == 2 and "--py-spy-rate 'fast': one request rate" in capsys.readouterr().err


# ----------------------------------------------------------------------------- refusals


def test_refuses_clearly_when_prerequisites_are_missing(tmp_path, capsys):
    rc = cli(["sweep", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "o"), "--frmps", str(tmp_path / "nofrmps"),
              "--bench-python", str(tmp_path / "nopython"), "--systems", "vllm-serve,frmps"])
    err = capsys.readouterr().err
    assert rc == 2 and "refused, nothing was started" in err
    assert "not a model directory" in err and "not an executable frmps binary" in err
    assert "vllm bench serve cannot run" in err
    if not os.path.exists("/dev/nvidia0"):
        assert "no GPU" in err
    assert not (tmp_path / "o").exists()


def test_preflight_names_the_missing_module_and_fault_triggers(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    p = mkplan(model=str(tmp_path), frmps="/bin/true", python=sys.executable, bench_python=sys.executable)
    code = "import sys; sys.exit(0)"
    assert code  # the checks below run real imports in sys.executable
    from bench.serving.run import _imports, preflight

    assert _imports(sys.executable, "json") == ""
    assert "No module named" in _imports(sys.executable, "no_such_module_here")
    why = preflight(p, [P.FRMPS_VLLM_FE], faults_dir=str(tmp_path), kinds=["misaligned:load", "oob_write:write"],
                    check_imports=False)
    if not os.path.exists("/dev/nvidia0"):
        assert any(w.startswith("no GPU") for w in why)
    assert any("fault triggers missing" in w and "misaligned, oob_write" in w for w in why)


# ----------------------------------------------------------------------------- results


def load_fixture() -> dict:
    with open(FIXTURE) as f:
        return json.load(f)


def test_real_result_file_reads_and_goodput_matches_vllms():
    raw = R.load_bench_json(FIXTURE)
    rec = R.trial_record(raw, 1000, 50, min_output_len=4)
    assert rec["sent"] == raw["num_prompts"] == 12 and rec["completed"] == 12 and rec["failed"] == 0
    assert rec["output_throughput"] == raw["output_throughput"] and rec["p99_tpot_ms"] == raw["p99_tpot_ms"]
    # Our per-request SLO check is vLLM's: the same good count as its request_goodput.
    assert rec["good"] == round(raw["request_goodput"] * raw["duration"])
    assert rec["slo_attainment"] == rec["good"] / 12
    assert rec["truncated"] == 0
    rows = R.request_rows(raw)
    gap = max(max([r["ttft"]] + r["itls"]) for r in rows)
    assert rec["longest_gap_ms"] == round(gap * 1e3, 3)


def test_failed_and_truncated_requests_are_counted():
    raw = load_fixture()
    bad = copy.deepcopy(raw)
    bad["errors"][0] = "aiohttp.client_exceptions.ClientConnectorError: connection refused"
    bad["ttfts"][0], bad["itls"][0], bad["output_lens"][0] = 0.0, [], 0
    bad["output_lens"][1] = 2  # completed but cut short (an error event ended the stream)
    bad["failed"], bad["completed"] = 1, 11
    rec = R.trial_record(bad, 1000, 50, min_output_len=4)
    assert rec["failed"] == 1 and rec["truncated"] == 1 and rec["sent"] == 12
    assert rec["good"] <= 11 and rec["slo_attainment"] == rec["good"] / 12
    # A failed request with an empty reason (vLLM's response.reason can be None) is still failed.
    bad["errors"][0] = ""
    assert R.request_rows(bad)[0]["success"] is False
    # Without --save-detailed: goodput from vLLM's request_goodput.
    brief = {k: v for k, v in raw.items() if k not in ("start_times", "ttfts", "itls", "errors", "output_lens", "input_lens")}
    rec2 = R.trial_record(brief, 1000, 50)
    assert rec2["good"] == round(raw["request_goodput"] * raw["duration"]) and "truncated" not in rec2


def test_tight_slo_misses_and_tpot_is_vllms_definition():
    row = {"success": True, "ttft": 0.2, "itls": [0.01, 0.03, 0.02], "output_len": 4, "start": 0.0}
    assert R.tpot_s(row) == pytest.approx(0.02)
    assert R.good(row, 1000, 50) and not R.good(row, 100, 50) and not R.good(row, 1000, 10)
    assert R.tpot_s({**row, "output_len": 1}) == 0.0
    assert R.longest_gap_s(row) == 0.2


def test_not_a_result_file_is_refused(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"date": "x"}))
    with pytest.raises(R.ResultError, match="not a `vllm bench serve"):
        R.load_bench_json(str(p))
    p.write_text("{")
    with pytest.raises(R.ResultError):
        R.load_bench_json(str(p))


def trial(system, rate, thr, tpot, kv="default-kv", **kw):
    return {"system": system, "kv_mode": kv, "rate": rate, "output_throughput": thr, "p99_tpot_ms": tpot, **kw}


def test_median_min_max_and_the_beyond_the_spread_rule():
    s = R.spread([3, 1, None, 2])
    assert (s.median, s.lo, s.hi, s.n) == (2, 1, 3, 3)
    a, b = R.Spread(10, 9, 11, 3), R.Spread(20, 19, 21, 3)
    assert R.compare(b, a, True) == "better" and R.compare(a, b, True) == "worse"
    assert R.compare(b, a, False) == "worse"  # e.g. latency: higher is worse
    assert R.compare(R.Spread(10, 9, 19, 3), b, True) == "within spread"  # ranges touch: no claim
    assert R.compare(R.Spread(10, 9, 11, 2), b, True) == "too few trials"


def test_aggregate_and_claims_against_the_baseline():
    ts = [trial(P.VLLM, "8", x, 20 + i) for i, x in enumerate((100, 102, 101))]
    ts += [trial(P.FRMPS, "8", x, 21 + i) for i, x in enumerate((90, 92, 91))]
    ts += [trial(P.FRMPS_VLLM_FE, "8", x, 22) for x in (99, 105, 100)]
    ts += [trial(P.FRMPS, "8", 1, 1, error="boom")]  # a failed trial is not aggregated
    agg = R.aggregate(ts)
    c = agg["default-kv"][P.FRMPS]["8"]
    assert c["trials"] == 3 and c["output_throughput"] == {"median": 91, "min": 90, "max": 92, "n": 3}
    cl = R.claims(agg, P.VLLM)
    assert [(x["system"], x["metric"], x["verdict"]) for x in cl] == [(P.FRMPS, "output_throughput", "worse")]


# ----------------------------------------------------------------------------- report


def write_run(d, trials, servers, plan=None, faultruns=()):
    os.makedirs(d, exist_ok=True)
    plan = plan or mkplan()
    with open(os.path.join(d, "plans.jsonl"), "w") as f:
        f.write(json.dumps({"kind": "sweep", **plan.to_json()}) + "\n")
    for name, rows in (("trials", trials), ("servers", servers), ("faultruns", faultruns)):
        with open(os.path.join(d, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def test_paired_differences_trial_by_trial(tmp_path):
    """Trial i of every system has the same requests: the per-trial ratio to the
    baseline is judged, not the two systems' own spreads. The trials' request sets
    move both systems alike here (throughput 100/200/300), so the plain rule sees
    overlapping ranges while every pair is 2 % slower."""
    ts = []
    for i, base in enumerate((100.0, 200.0, 300.0)):
        ts.append(trial(P.VLLM_MPS, "16", base, 5.0, trial=i, seed=i, p50_tpot_ms=base / 10))
        ts.append(trial(P.FRMPS, "16", base * 0.98, 5.0, trial=i, seed=i, p50_tpot_ms=base / 10 * 1.02))
        # the negative control: differences of both signs, no claim
        ts.append(trial(P.FRMPS_VLLM_FE, "16", base * (1.01 if i else 0.99), 5.0, trial=i, seed=i, p50_tpot_ms=base / 10))
    (fr, fe) = sorted(R.paired(ts, P.VLLM_MPS), key=lambda r: r["system"])
    assert fr["system"] == P.FRMPS and fe["system"] == P.FRMPS_VLLM_FE
    thr = fr["metrics"]["output_throughput"]
    assert thr["n"] == 3 and thr["sign"] == "−" and abs(thr["median"] + 0.02) < 1e-9
    assert fr["metrics"]["p50_tpot_ms"]["sign"] == "+"
    assert fe["metrics"]["output_throughput"]["sign"] == "" and fe["metrics"]["p50_tpot_ms"]["sign"] == ""
    agg = R.aggregate(ts)
    assert R.compare(R.as_spread(agg["default-kv"][P.FRMPS]["16"]["output_throughput"]),
                     R.as_spread(agg["default-kv"][P.VLLM_MPS]["16"]["output_throughput"]), True) == "within spread"
    # Trials whose seeds differ are not paired; with fewer than 3 pairs nothing is claimed.
    ts[3]["seed"] = 99
    fr = [r for r in R.paired(ts, P.VLLM_MPS) if r["system"] == P.FRMPS][0]
    assert fr["metrics"]["output_throughput"]["n"] == 2 and fr["metrics"]["output_throughput"]["sign"] == ""
    # --after-failover: a system's trials after its drill, paired with its own trials before it.
    d = str(tmp_path / "af")
    af = [trial(P.FRMPS, "16", 100.0 + i, 5.0, trial=i, seed=i) for i in range(3)]
    af += [trial(P.FRMPS + P.AFTER_FAILOVER, "16", (100.0 + i) * 1.05, 5.0, trial=i, seed=i) for i in range(3)]
    write_run(d, af, [])
    doc = RP.build(d)
    (row,) = doc["paired_after_failover"]
    assert row["system"] == P.FRMPS + P.AFTER_FAILOVER and row["metrics"]["output_throughput"]["sign"] == "+"
    assert "## After a failover against before it, trial by trial" in open(os.path.join(d, "README.md")).read()
    md = RP.paired_table(R.paired(ts[:3], P.VLLM_MPS))
    assert "| default-kv | 16 | frmps serve (Go front door) | 1 | -2.0 % |" in md


def test_report_writes_table_json_and_plots(tmp_path):
    d = str(tmp_path / "res")
    ts = []
    for system, base in ((P.VLLM, 100), (P.FRMPS, 50)):
        for rate in ("2", "inf"):
            for i in range(3):
                ts.append(trial(system, rate, base + i, 10 + i, p50_ttft_ms=5.0, failed=0, slo_attainment=1.0))
    servers = [{"system": P.VLLM, "kv_mode": "default-kv", "kv": {"num_blocks": 1234, "source": "/metrics"},
                "start_s": 50.0, "command": ["vllm", "serve", "m"]},
               {"system": P.FRMPS, "kv_mode": "default-kv", "error": "frmps exited\nmore", "command": ["frmps"]}]
    write_run(d, ts, servers)
    doc = RP.build(d)
    md = open(os.path.join(d, "README.md")).read()
    assert "| 2 | vllm serve | 3 | 101 (100–102) |" in md
    assert "| inf | frmps serve (Go front door) | 3 | 51 (50–52) |" in md
    assert "| default-kv | vllm serve | 1,234 | /metrics | 50.0 |" in md and "frmps exited |" in md
    assert "**worse** than vllm serve on output_throughput" in md
    assert "## Paired against vllm serve, trial by trial" not in md  # these trials carry no trial index
    assert os.path.getsize(os.path.join(d, "sweep-default-kv.png")) > 5000 and doc["plots"] == ["sweep-default-kv.png"]
    with open(os.path.join(d, "results.json")) as f:
        js = json.load(f)
    assert js["aggregate"]["default-kv"][P.VLLM]["inf"]["output_throughput"]["median"] == 101
    assert js["cpu_check"] is False and "CPU check" not in md


def test_report_refuses_a_directory_without_a_run(tmp_path, capsys):
    assert cli(["report", str(tmp_path)]) == 2 and "no plans.jsonl" in capsys.readouterr().err


# ----------------------------------------------------------------------------- fault mode


def test_fault_times_leave_the_end_of_the_window_quiet():
    assert F.fault_times(300, 60) == [60, 120, 180, 240]
    assert F.fault_times(60, 15) == [15, 30, 45]
    assert F.fault_times(100, 30, first_s=10) == [10, 40, 70]
    with pytest.raises(ValueError):
        F.fault_times(10, 0)


def test_timeline_bins_tokens_and_marks_failed_starts():
    rows = [{"success": True, "start": 100.0, "ttft": 0.5, "itls": [0.25, 0.25, 1.0], "output_len": 8},
            {"success": False, "start": 102.5, "ttft": 0.0, "itls": [], "output_len": 0}]
    tl = F.timeline(rows, t0=100.0, window_s=3)
    # chunks at 0.5, 0.75, 1.0, 2.0 s: 2 tokens each
    assert tl["tokens_per_s"] == [4.0, 2.0, 2.0, 0.0] and tl["failed_starts"] == [2.5]


def test_down_spans_from_restart_events():
    ev = [{"t": 10.0, "event": "ready"}, {"t": 70.0, "event": "exit"}, {"t": 71.0, "event": "unhealthy"},
          {"t": 130.0, "event": "ready"}, {"t": 200.0, "event": "exit"}]
    assert F.down_spans(ev, t0=0.0) == [[70.0, 130.0], [200.0, None]]


def test_slo_phases_split_at_the_first_fault():
    """The requests that ended before the first fault are the run's no-fault
    reference; one in flight at it, one sent after it and a failed one are not."""
    def row(start, ttft, itls, ok=True):
        return {"start": start, "ttft": ttft, "itls": itls, "output_len": len(itls) + 1, "input_len": 8,
                "success": ok, "error": ""}

    rows = [row(100.0, 0.05, [0.01] * 9),    # ends at 100.14: before a fault at +10 s
            row(101.0, 2.0, [0.01] * 9),     # ends before it too, but misses the 1 s TTFT SLO
            row(109.9, 0.05, [0.01] * 9),    # in flight at the fault (110.0)
            row(111.0, 0.05, [0.2] * 9),     # after it, misses the 50 ms TPOT SLO
            row(105.0, 0.0, [], ok=False)]   # failed: counted by its start, as in flight
    ph = F.slo_phases(rows, t0=100.0, first_fault_rel=10.0, slo_ttft_ms=1000, slo_tpot_ms=50)
    assert ph["before"] == {"sent": 2, "good": 1, "failed": 0, "slo_attainment": 0.5}
    assert ph["from_fault"] == {"sent": 3, "good": 1, "failed": 1, "slo_attainment": 1 / 3}


def test_fault_report_table_and_timeline(tmp_path):
    d = str(tmp_path / "f")
    fr = {"system": P.VLLM_MPS_RESTART, "rate": 4.0, "window_s": 60, "spacing_s": 30.0, "kinds": ["misaligned:load"],
          "faults": [{"t_rel": 30.0, "kind": "misaligned:load"}],
          "summary": {"sent": 240, "failed": 12, "truncated": 3, "goodput_rps": 3.1, "slo_attainment": 0.8,
                      "p99_ttft_ms": 900.0, "p99_tpot_ms": 40.0, "longest_gap_ms": 1500.0, "restarts": 1,
                      "phases": {"before": {"sent": 100, "good": 100, "failed": 0, "slo_attainment": 1.0},
                                 "from_fault": {"sent": 140, "good": 92, "failed": 12, "slo_attainment": 92 / 140}}},
          "timeline": {"t": [0, 1, 2], "tokens_per_s": [10, 0, 10], "failed_starts": [1.5],
                       # the second restart not back when the run ended (the GPU run's case)
                       "down": [[30.0, 40.0], [50.0, None]]},
          "command": ["vllm", "serve"]}
    err = {"system": P.FRMPS, "spacing_s": 30.0, "error": "frmps exited\nlog", "command": ["frmps"]}
    write_run(d, [], [], faultruns=[fr, err])
    doc = RP.build(d)
    md = open(os.path.join(d, "README.md")).read()
    assert ("| 30 | vllm serve in MPS + restart loop | 1 | 240 | 12 | 3 | 3.10 | 80.0 | 100.0 (100) / 65.7 (140) | "
            "900.0 | 40.00 | 1,500 | 1 |") in md
    assert "ERROR: frmps exited" in md
    assert "timeline-vllm-serve-mps-restart-30s.png" in doc["plots"]
    assert os.path.getsize(os.path.join(d, "timeline-vllm-serve-mps-restart-30s.png")) > 5000


# ----------------------------------------------------------------------------- KV sizes


def test_kv_blocks_from_vllm_metrics_log_and_frmps_status():
    metrics = ('# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n'
               'vllm:cache_config_info{block_size="16",cache_dtype="auto",gpu_memory_utilization="0.9",'
               'num_gpu_blocks="53456",num_cpu_blocks="None"} 1.0\n')
    kv = S.vllm_kv_blocks(metrics, "")
    assert kv["num_blocks"] == 53456 and kv["block_size"] == 16 and kv["source"].startswith("/metrics")
    kv = S.vllm_kv_blocks("", "INFO ... [kv_cache_utils.py:1234] GPU KV cache size: 855,296 tokens\n")
    assert kv["num_blocks"] == 53456 and kv["source"].startswith("log")
    assert S.vllm_kv_blocks("", "")["num_blocks"] is None
    st = {"engines": [{"role": "standby", "kvBudget": {"numBlocks": 1, "source": "--num-blocks"}},
                      {"role": "active", "kvBudget": {"numBlocks": "117194", "blockBytes": "917504", "source": "estimated"}}]}
    kv = S.frmps_kv_blocks(st)
    assert kv["num_blocks"] == 117194 and kv["source"] == "frmps status: estimated"
    assert S.frmps_kv_blocks({"engines": [{"role": "active"}]})["num_blocks"] is None


# ----------------------------------------------------------------------------- lifecycle


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class DoubleVllm(S.VllmServer):
    """TEST DOUBLE of `vllm serve`: a small HTTP server answering /v1/models and
    /health that exits by itself after `life` seconds (standing in for a server
    torn down by an MPS fault), so that the restart loop has something to restart."""

    life = 2.0

    def command(self) -> list[str]:
        code = ("import http.server,sys,threading,os\n"
                "class H(http.server.BaseHTTPRequestHandler):\n"
                "  def do_GET(self):\n"
                "    self.send_response(200); self.end_headers(); self.wfile.write(b'{}')\n"
                "  def log_message(self,*a): pass\n"
                f"threading.Timer({self.life}, lambda: os._exit(3)).start()\n"
                f"http.server.HTTPServer(('127.0.0.1', {self.port}), H).serve_forever()\n")
        return [sys.executable, "-c", code]


def test_restart_loop_restarts_and_stop_leaves_no_server_and_no_mps_daemon(monkeypatch, tmp_path):
    from bench.serving.reuse import Cleanup

    frmps = os.environ.get("FRMPS_BIN", "")
    if not frmps or not os.access(frmps, os.X_OK):
        pytest.skip("FRMPS_BIN is not set to a built frmps binary (make py-test sets it)")
    # The MPS control daemon's TEST DOUBLE (supervisor/mps/testdata) found as nvidia-cuda-mps-control.
    monkeypatch.setenv("PATH", FAKE_MPS_DIR + os.pathsep + os.environ["PATH"])
    plan = mkplan(frmps=frmps, python=sys.executable)
    cleanup = Cleanup()
    srv = DoubleVllm(plan, str(tmp_path), cleanup, mps=True, restart=True, health_grace_s=1.0)
    try:
        srv.start()
        run_dir = srv.mps_run_dir
        pid_file = os.path.join(run_dir, "mps", "pipe", "nvidia-cuda-mps-control.pid")
        assert srv.env.get("CUDA_MPS_PIPE_DIRECTORY") == os.path.join(run_dir, "mps", "pipe")
        daemon_pid = int(open(pid_file).read())
        assert _alive(daemon_pid)
        srv.wait_ready(30)
        deadline = time.monotonic() + 30
        while srv.starts < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert srv.starts >= 3, srv.events()
        kinds = [e["event"] for e in srv.events()]
        assert kinds[0] == "ready" and "exit" in kinds and kinds.count("ready") >= 2
        last = srv.proc.pid
    finally:
        srv.stop()
    assert not _alive(last) and srv.proc is None
    deadline = time.monotonic() + 10
    while _alive(daemon_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(daemon_pid), "the MPS daemon outlived the server's stop"
    assert not os.path.exists(run_dir)
    cleanup.run()  # nothing left to do, and nothing raises


# ----------------------------------------------------------------------------- the long-lived client

def _fake_python(tmp_path, body: str) -> str:
    """A stand-in for `python -m bench.serving.client` (labelled test double): a
    shell script speaking the client's line protocol."""
    from bench.serving import client as C

    p = tmp_path / "fake-python"
    p.write_text(f"#!/bin/sh\necho '{C.READY}'\n{body}\n")
    p.chmod(0o755)
    return str(p)


def _client(python):
    from bench.procs import Cleanup, kill_group
    from bench.serving import client as C

    cleanup = Cleanup()
    return C.Client(python, cleanup.add_proc, kill_group, start_timeout_s=20), cleanup


def test_client_sends_the_arguments_after_bench_serve_and_reads_the_status(tmp_path):
    from bench.serving import client as C

    cmd = mkplan().bench_cmd("http://127.0.0.1:9", 8.0, 0, "/res", "x.json")
    argv = C.bench_argv(cmd)
    assert argv[:2] == ["--backend", "openai"] and argv == cmd[5:]
    with pytest.raises(ValueError, match="not a `vllm bench serve`"):
        C.bench_argv(["python", "-m", "vllm.entrypoints.cli.main", "serve", "m"])
    # The double echoes what it was sent, the main-run line, and a status of 3.
    py = _fake_python(tmp_path, f"while read -r line; do echo \"got $line\"; echo '{C.MAIN_RUN}...'; "
                                f"echo '{C.DONE} 3'; done")
    client, cleanup = _client(py)
    started = []
    try:
        log = tmp_path / "client.log"
        assert client.run(cmd, str(log), 20, on_start=started.append) == 3
        assert client.run(cmd, str(log), 20) == 3  # the same process, a second run
        text = log.read_text()
        assert text.count("got " + json.dumps(argv)) == 2 and len(started) == 1
    finally:
        client.close()
        cleanup.run()


def test_client_that_overstays_or_dies_is_killed_and_the_next_run_starts_a_fresh_one(tmp_path):
    from bench.serving import client as C
    from bench.serving import reuse
    from bench.serving import run as RUN

    cmd = mkplan().bench_cmd("http://127.0.0.1:9", 8.0, 0, "/res", "x.json")
    py = _fake_python(tmp_path, "read -r line; exec sleep 600")  # never answers
    client, cleanup = _client(py)
    try:
        t0 = time.monotonic()
        with pytest.raises(reuse.TrialError, match="timed out"):
            RUN.run_client(client, cmd, str(tmp_path / "a.log"), 1.0)
        assert time.monotonic() - t0 < 15 and client.p is None, "killed, not waited for"
        client.python = _fake_python(tmp_path, "read -r line; exit 7")  # dies in its run
        with pytest.raises(C.ClientError, match="exited"):
            client.run(cmd, str(tmp_path / "b.log"), 5)
    finally:
        client.close()
        cleanup.run()


# ----------------------------------------------------------------------------- host CPU and py-spy (profile.py)

from bench.serving import profile as PR  # noqa: E402

BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\ntime.sleep(60)\n"


def _spawn(code: str, argv0: str = "") -> subprocess.Popen:
    """A child (through bash's exec -a when argv0 names it, as setproctitle would)."""
    if argv0:
        return subprocess.Popen(["bash", "-c", f'exec -a "{argv0}" "{sys.executable}" -c "$0"', code])
    return subprocess.Popen([sys.executable, "-c", code])


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL proc's descendants and proc, then reap it."""
    for p in PR.tree(proc.pid)[::-1]:
        try:
            os.kill(p, 9)
        except OSError:
            pass
    proc.wait()


def test_cpu_meter_counts_each_process_of_the_tree():
    # A parent that starts a busy child (0.6 s of CPU) and an idle one: the meter,
    # rooted at the parent, sees the busy grandchild's CPU and names its role.
    parent = _spawn("import subprocess, sys, time\n"
                    f"b = subprocess.Popen([sys.executable, '-c', {BUSY.format(s=0.6)!r}])\n"
                    "i = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                    "print(b.pid, flush=True); time.sleep(60)\n")
    try:
        time.sleep(0.3)
        kids = [p for p in PR.tree(parent.pid) if p != parent.pid]
        deadline = time.monotonic() + 10
        while len(kids) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            kids = [p for p in PR.tree(parent.pid) if p != parent.pid]
        assert len(kids) == 2, kids
        m = PR.CpuMeter(parent.pid, {k: f"child {i}" for i, k in enumerate(sorted(kids))})
        m.start()
        time.sleep(1.5)
        rep = m.stop(output_tokens=100)
        busy = [p for p in rep["processes"] if p["cpu_s"] >= 0.3]
        assert len(busy) == 1 and busy[0]["role"].startswith("child"), rep
        assert busy[0]["cpu_ms_per_token"] == pytest.approx(busy[0]["cpu_s"] * 10, rel=0.01)
        assert 0 < busy[0]["cores"] <= 1.2 and rep["wall_s"] >= 1.5
        assert rep["cpu_s"] >= busy[0]["cpu_s"]
    finally:
        _kill_tree(parent)
    none = PR.CpuMeter(None)
    none.start()
    r = none.stop()
    assert r["processes"] == [] and r["cpu_s"] == 0


def test_engine_pid_finds_vllms_engine_core_else_the_root():
    root = _spawn("import subprocess, sys, time\n"
                  "subprocess.Popen(['bash', '-c', 'exec -a VLLM::EngineCore sleep 60'])\n"
                  "time.sleep(60)\n")
    try:
        deadline = time.monotonic() + 10
        core = None
        while core in (None, root.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
            core = PR.engine_pid(root.pid)
        assert core != root.pid and "EngineCore" in PR._label(core)
        assert PR.engine_pid(root.pid, active=4242) == 4242  # frmps: the active engine, from its status
        assert PR.engine_pid(None) is None
    finally:
        _kill_tree(root)
    lone = _spawn("import time; time.sleep(60)")
    try:
        time.sleep(0.2)
        assert PR.engine_pid(lone.pid) == lone.pid  # an in-process engine
    finally:
        lone.kill()
        lone.wait()


# A labelled stand-in for py-spy: `record ... --output F` writes a raw profile
# when SIGINT arrives (as py-spy does on Ctrl-C), or exits 1 without one.
FAKE_PY_SPY = """#!{py}
import signal, sys, time
args = sys.argv[1:]
out = args[args.index("--output") + 1]
if "--pid" not in args or args[args.index("--pid") + 1] == "1":
    sys.stderr.write("Permission denied\\n"); sys.exit(1)
def stop(*_):
    with open(out, "w") as f:
        f.write("thread (0x1): \\"MainThread\\";loop (engine.py:10);step (engine.py:20) 30\\n")
        f.write("thread (0x1): \\"MainThread\\";loop (engine.py:10);publish (ring.py:5) 10\\n")
        f.write("thread (0x2): \\"grpc%s\\";serve (server.py:3) 5\\n" % ("-idle" if "--idle" in args else ""))
    sys.exit(0)
signal.signal(signal.SIGINT, stop)
time.sleep(120)
"""


def test_py_spy_is_stopped_when_the_run_ends_and_summarized(tmp_path):
    fake = tmp_path / "py-spy"
    fake.write_text(FAKE_PY_SPY.format(py=sys.executable))
    fake.chmod(0o755)
    out = str(tmp_path / "p.stacks")
    ran = []
    t0 = time.monotonic()
    rep = PR.py_spy(str(fake), 4242, 300, out, lambda: ran.append(1))
    assert ran == [1] and time.monotonic() - t0 < 30, "py-spy was not stopped when the run ended"
    main = rep['thread (0x1): "MainThread"']
    assert main["samples"] == 40 and main["leaf"][0] == ("step (engine.py:20)", 30)
    assert dict(main["inclusive"])["loop (engine.py:10)"] == 40
    assert list(rep)[0].endswith('"MainThread"')  # busiest first
    assert 'thread (0x2): "grpc"' in rep
    idle = PR.py_spy(str(fake), 4242, 300, str(tmp_path / "i.stacks"), lambda: None, view="idle")
    assert 'thread (0x2): "grpc-idle"' in idle, "the idle view's flag did not reach py-spy"
    bad = PR.py_spy(str(fake), 1, 300, str(tmp_path / "none.stacks"), lambda: None)
    assert "Permission denied" in bad["error"]


def test_report_shows_host_cpu_per_process_at_the_highest_rate():
    def trial(system, rate, cores):
        return {"system": system, "rate": rate, "cpu": {"processes": [
            {"name": "python3 -m frmps_engine", "role": "active engine", "cores": cores, "cpu_ms_per_token": cores / 10},
            {"name": "frmps serve", "role": "frmps supervisor", "cores": 0.2, "cpu_ms_per_token": 0.02},
            {"name": "idle", "cores": 0.001}]}}
    trials = [trial("frmps", "inf", c) for c in (0.9, 1.0, 0.95)] + [trial("frmps", "16", 0.3)]
    servers = [{"system": "frmps", "py_spy": {"pid": 7, "stacks": "raw/profile-frmps.stacks", "threads": {
        "MainThread": {"samples": 40, "leaf": [["step", 30]], "inclusive": []}}}}]
    md = RP.cpu_table(trials, servers)
    assert "| frmps serve (Go front door) | inf | active engine | 0.95 | 0.095 |" in md, md
    assert "frmps supervisor" in md and "idle" not in md and "| 16 |" not in md
    assert "MainThread: 40 samples; hottest frames: step 30" in md
    assert RP.cpu_table([], []) == ""
    # --py-spy-views: a list of runs, one per view
    servers[0]["py_spy"] = [dict(servers[0]["py_spy"], view="idle"), {"view": "gil", "error": "no engine process found"}]
    md = RP.cpu_table(trials, servers)
    assert "py-spy (idle view) of pid 7" in md and "py-spy failed: no engine process found" in md


def test_py_spy_views_are_checked(tmp_path, capsys):
    fake = tmp_path / "py-spy"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    argv = ["sweep", "--model", str(tmp_path), "--out", str(tmp_path / "o"), "--dry-run", "--py-spy", str(fake)]
    assert cli(argv + ["--py-spy-views", "idle,bogus"]) == 2
    assert "--py-spy-views" in capsys.readouterr().err
    assert cli(argv + ["--py-spy-views", "idle,gil"]) == 0
    out = capsys.readouterr().out
    assert "(idle view)" in out and "(gil view)" in out


def test_compile_state_reads_vllms_lines_for_the_last_start():
    # vLLM 0.26.0's lines, as an H200 run logged them.
    compiled = ("INFO 11-29 11:21:04 [backends.py:1094] Using cache directory: /root/.cache/vllm/torch_compile_cache/x\n"
                "INFO 11-29 11:21:19 [decorators.py:708] saved AOT compiled function to /root/.cache/vllm/y/model\n")
    loaded = "INFO 11-29 11:24:00 [decorators.py:311] Directly load AOT compilation from path /root/.cache/vllm/y/model\n"
    assert PR.compile_state(compiled) == "compiled"
    assert PR.compile_state(loaded) == "loaded"
    assert PR.compile_state(compiled + "=== start 2\n" + loaded) == "loaded"  # the last start decides
    assert PR.compile_state(loaded + compiled) == "compiled"
    assert PR.compile_state("model config ... enforce_eager=True ...") == "eager"
    assert PR.compile_state("") == "unknown"


def test_spare_settled_waits_for_a_spare_that_is_on():
    assert S.spare_settled({})  # no spare section: spares off (the CPU)
    assert S.spare_settled({"spare": {"enabled": False, "state": "none"}})
    for state, ok in (("none", False), ("importing", False), ("ready", True), ("backoff", True),
                      ("off: --spares 0", True)):
        assert S.spare_settled({"spare": {"enabled": True, "state": state}}) is ok, state


def test_after_failover_adds_the_drill_and_the_trials_again_to_the_plan(capsys):
    plan = mkplan(systems=[P.VLLM_MPS, P.FRMPS], rates=[16.0, P.INF], trials=3)
    base = plan.estimate_s()
    plan.after_failover = True
    est = plan.estimate_s()
    assert est[P.VLLM_MPS] == base[P.VLLM_MPS]  # vllm serve has no failover
    assert est[P.FRMPS] > 2 * base[P.FRMPS] - 130
    from bench.serving.run import print_plan
    print_plan(plan)
    out = capsys.readouterr().out
    assert out.count("/v1/admin/failover") == 1 and "frmps+failover" in out
    assert P.SYSTEM_LABELS[P.FRMPS + P.AFTER_FAILOVER].endswith("after a failover")
