"""`frmps bench`: every experiment's CPU mode end to end through the real
supervisor (tiny model, SIGKILL, host-shm; a check of the harness, not a
measurement), the result files' shape, resumability, and the report and plot
helpers on synthetic records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from e2e import frmps_bin, require
from bench import report
from bench.results import ResultFile, key_id, latest_ok, load_records
from bench.experiments import EXPERIMENTS
from bench.outage import outage_metrics

# Reduced CPU plans: every experiment and every system once, a few seconds each.
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SRC = os.path.join(REPO, "vllmpatch", "src")
# The engine package's source dir and the repository root (the bench package) only: the
# test's own sys.path may hold directories whose modules would shadow the standard library
# in the engines.
BENCH_PATH = SRC + os.pathsep + REPO
# recovery runs the GPU mode's fault path: MPS on, a co-located "MPS client" faults the
# victim, the pair reused once its failback has put an active back inside MPS, a private
# MPS daemon for the baselines' victims; against TEST DOUBLES of nvidia-cuda-mps-control
# and of the fault triggers.
CPU_RUNS = {
    "recovery": ["--cold-cache", "warm", "--tail-tokens", "8", "--cpu-with-mps-doubles", "--faults-dir",
                 os.path.join(HERE, "bench_doubles"), "--trials", "2", "--fault", "misaligned:load,misaligned:store"],
    "prompt-length": ["--lengths", "48"],  # frmps and the no-KV ablation
    "since-sync": ["--ks", "4", "--systems", "frmps-n1"],
    "sync-overhead": [],
    "outage": ["--duration", "2.5", "--fault-at", "1.2", "--systems", "frmps,sleep-only"],
    "standby-memory": ["--settle-s", "0.2"],
    # --controls off: the negative controls need the engines' FRMPS_TEST_TAKEOVER_FAULT switch
    "correctness": ["--ks", "4", "--tail-tokens", "12", "--controls", "off"],
}


def bench(out: str, workdir: str, exp: str, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess:
    fake_bin = os.path.join(workdir, "fake-bin")
    os.makedirs(fake_bin, exist_ok=True)
    link = os.path.join(fake_bin, "nvidia-cuda-mps-control")
    if not os.path.lexists(link):
        os.symlink(os.path.join(REPO, "supervisor", "mps", "testdata", "nvidia-cuda-mps-control"), link)
    env = {**os.environ, "PYTHONPATH": BENCH_PATH, "PATH": fake_bin + os.pathsep + os.environ.get("PATH", "")}
    cmd = [sys.executable, "-m", "bench", exp, "--cpu", "--out", out, "--workdir", workdir,
           "--frmps", os.environ["FRMPS_BIN"], "--cache-dir", os.path.join(workdir, "ckpt"), "--no-plots", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def cpu_results(tmp_path_factory):
    require("torch")
    frmps_bin()
    out = str(tmp_path_factory.mktemp("bench-out"))
    work = str(tmp_path_factory.mktemp("bench-work"))
    runs = {}
    for exp, extra in CPU_RUNS.items():
        t0 = time.monotonic()
        p = bench(out, work, exp, *extra)
        runs[exp] = (p, time.monotonic() - t0)
    return out, work, runs


def records(out: str, exp: str) -> list[dict]:
    return load_records(os.path.join(out, f"{exp}.jsonl"))


@pytest.mark.torch
@pytest.mark.parametrize("exp", list(CPU_RUNS))
def test_cpu_mode_end_to_end(cpu_results, exp):
    out, _, runs = cpu_results
    p, _ = runs[exp]
    # 0: every point ok; the ablation needs an engine flag that may not exist yet (recorded "unsupported").
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stderr[-4000:]}"
    recs = records(out, exp)
    assert recs, p.stderr[-2000:]
    ok = [r for r in recs if r["ok"]]
    assert ok, [r["error"] for r in recs]
    for r in recs:
        assert set(r) >= {"schema", "experiment", "key", "ok", "error", "run_id", "t", "data"}
        assert r["experiment"] == exp
        assert r["ok"] or r.get("unsupported"), r["error"]
    summary = json.load(open(os.path.join(out, f"{exp}.json")))
    assert summary["experiment"] == exp and summary["summary"] and summary["runs"]
    assert all(run["cpu_check"] for run in summary["runs"])
    assert "[" + exp in p.stderr  # progress lines
    readme = open(os.path.join(out, "README.md")).read()
    assert report.TITLES[exp] in readme and "CPU check of the harness" in readme


@pytest.mark.torch
def test_cpu_recovery_measures_every_system(cpu_results):
    out, _, _ = cpu_results
    by = {r["key"]["system"]: r["data"] for r in records(out, "recovery") if r["ok"]}
    assert set(by) == {"frmps", "sleep-only", "cold"}
    for d in by.values():
        assert 0 < d["recovery_s"] < 60
    f = by["frmps"]
    assert f["record"]["ok"] and f["record"]["resumed_requests"] == 1
    assert f["tokens_before_fault"] >= 1 and len(f["token_ids"]) == 1 + 8
    assert f["fault_to_detect_s"] is not None and f["fault_to_detect_s"] >= 0
    # The fault came from the (double of the) co-located MPS client, not from a signal of ours,
    # with the trigger the trial's turn gave it (recorded as "fault").
    for d in by.values():
        assert d["fault"] in ("misaligned:load", "misaligned:store")
        assert d["inject"]["how"] == "MPS client " + d["fault"], d["inject"]
        assert d["trigger_rc"] == 0 and "observed misaligned" in d["trigger_out"]
    # The baselines recovered the request the victim was serving: prompt + delivered re-prefilled.
    for name in ("sleep-only", "cold"):
        d = by[name]
        assert d["delivered"][0] >= 1 and d["victim_rc"] == -9  # the double's SIGKILL: the victim was an MPS client
        assert d["first_token_ids"]["1"]
    assert by["sleep-only"]["wake"]["copy_weights_s"] >= 0
    assert by["cold"]["cold"]["load_weights_s"] > 0 and by["cold"]["page_cache_fraction_before"] is not None
    s = json.load(open(os.path.join(out, "recovery.json")))["summary"]["models"]["tiny"]
    assert s["speedup_vs_sleep_only"] and s["speedup_vs_cold"]
    # Two --fault kinds, two trials: each kind once per system, and the report's table per kind.
    assert set(s["by_fault"]) == {"misaligned:load", "misaligned:store"}
    for v in s["by_fault"].values():
        assert v["frmps"]["n"] == 1 and v["sleep-only"]["n"] == 1 and v["frmps"]["recovery_s"] > 0
    assert "| tiny | `misaligned:store` |" in open(os.path.join(out, "README.md")).read()


@pytest.mark.torch
def test_cpu_recovery_reuses_the_pair_the_failback_restored(cpu_results):
    """With MPS faults the second trial runs on the same deployment, after its failback put
    an active back inside MPS (an MPS client can reach only that), taken over by the same
    standby: what a user's deployment goes through fault after fault."""
    out, _, _ = cpu_results
    fr = sorted((r["data"] for r in records(out, "recovery") if r["ok"] and r["key"]["system"] == "frmps"),
                key=lambda d: d["deployment_prior_faults"])
    assert [d["deployment_prior_faults"] for d in fr] == [0, 1]
    assert fr[0]["standby_pid"] == fr[1]["standby_pid"] and fr[0]["deployment_startup_s"] == fr[1]["deployment_startup_s"]
    assert [d["inject"]["how"] for d in fr] == ["MPS client misaligned:load", "MPS client misaligned:store"]
    assert all(d["record"]["ok"] for d in fr)


@pytest.mark.torch
def test_cpu_kv_sharing_is_visible(cpu_results):
    """With N=1 the standby recomputes one token; the snapshot covers the rest."""
    out, _, _ = cpu_results
    pts = {r["key"]["system"]: r["data"] for r in records(out, "since-sync") if r["ok"]}
    n1 = pts["frmps-n1"]
    assert n1["prefilled_tokens"] == 1 and n1["reused_tokens"] >= 6
    pl = {r["key"]["system"]: r["data"] for r in records(out, "prompt-length") if r["ok"]}
    assert pl["frmps"]["reused_tokens"] >= 48 and pl["frmps"]["prefilled_tokens"] <= 2
    if "frmps-no-kv" in pl:  # engines with --no-kv-reuse: the standby recomputes prompt and output
        nokv = pl["frmps-no-kv"]
        assert nokv["reused_tokens"] == 0 and nokv["prefilled_tokens"] >= 48 + nokv["tokens_at_fire"] >= 48 + 1


@pytest.mark.torch
def test_cpu_correctness_is_exact(cpu_results):
    out, _, _ = cpu_results
    d = next(r["data"] for r in records(out, "correctness") if r["ok"])
    assert d["equal"] == 2 and d["greedy_equal"] and d["seeded_equal"], d


@pytest.mark.torch
def test_cpu_outage_and_memory(cpu_results):
    out, _, _ = cpu_results
    o = {r["key"]["system"]: r["data"] for r in records(out, "outage") if r["ok"]}
    assert o["frmps"]["stream_errors"] == 0 and o["frmps"]["requests"] >= 4 and o["frmps"]["outage_s"] > 0
    assert sum(o["frmps"]["tokens_per_s"]) > 0
    assert o["sleep-only"]["recovery_all_s"] >= o["sleep-only"]["recovery_s"] > 0
    m = next(r["data"] for r in records(out, "standby-memory") if r["ok"])
    assert m["standby_mib"] > 0 and m["context_mib"] > 0 and m["sleep_only_standby_mib"] > 0
    s = next(r["data"] for r in records(out, "sync-overhead") if r["ok"])
    # Through the engine loop: the reference engine's core publishes inside the next step.
    assert s["engine"] == "ref" and s["publish"].startswith("overlapped")
    assert {t["sync_every"] for t in s["trials"]} == {0, 1, 2, 4, 8, 16, 32, 64}
    assert all(t["steps"] == 8 + 1 and t["tokens"] == 9 * s["batch"] for t in s["trials"])
    assert all(t["syncs"] == 0 for t in s["trials"] if t["sync_every"] == 0)
    # S = 8 steps (+ 1), overlapped: the publish due after the last step is made in the
    # extra step, so N publishes S / N times a trial; N = 1 is also measured between steps
    # in the same run (after every one of the 9).
    assert {t["sync_every"] for t in s["trials"] if t["inline"]} == {1}
    assert all(t["syncs"] == (9 if t["inline"] else 8) // t["sync_every"] for t in s["trials"] if t["sync_every"])
    assert all(t["sync_s"] > 0 for t in s["trials"] if t["sync_every"] == 1)
    per_n = json.load(open(os.path.join(out, "sync-overhead.json")))["summary"]["models"]["tiny"]["per_n"]
    assert "1i" in per_n and per_n["1i"]["syncs_per_step"] == 1


@pytest.mark.torch
def test_rerun_skips_done_points(cpu_results):
    out, work, runs = cpu_results
    before = {exp: len(records(out, exp)) for exp in CPU_RUNS}
    for exp, extra in CPU_RUNS.items():
        t0 = time.monotonic()
        p = bench(out, work, exp, *extra)
        assert p.returncode == 0, p.stderr[-2000:]
        after = records(out, exp)
        new = after[before[exp]:]
        # Only the unsupported points are looked at again (a cheap capability check).
        assert all(r.get("unsupported") for r in new), new
        if not new:
            assert time.monotonic() - t0 < 15, f"{exp}: a re-run with nothing to do took {time.monotonic() - t0:.1f} s"


# ----------------------------------------------------------------------------- without the GPU or the engine


def test_result_file_resume_and_attempts(tmp_path):
    rf = ResultFile(str(tmp_path), "x", "run1", max_attempts=2)
    a, b, c = {"m": "a", "t": 0}, {"m": "b", "t": 0}, {"m": "c", "t": 0}
    assert rf.pending([a, b, c]) == [a, b, c]
    rf.add(a, {"v": 1}, None, 0.1)
    rf.add(b, None, "boom", 0.1)
    rf.add(c, None, "unsupported: no flag", 0.0, unsupported=True)
    assert rf.status(a) == "done" and rf.status(b) == "pending" and rf.status(c) == "unsupported"
    assert rf.pending([a, b, c]) == [b, c]
    rf.add(b, None, "boom again", 0.1)
    assert rf.status(b) == "failed" and rf.pending([a, b]) == []
    for _ in range(3):  # unsupported records never use up attempts
        rf.add(c, None, "unsupported: no flag", 0.0, unsupported=True)
    assert rf.status(c) == "unsupported" and rf.attempts(c) == 0
    rf.add(c, {"v": 3}, None, 0.1)
    assert rf.status(c) == "done"
    # A torn last line (killed mid-write) is skipped; every attempt stays in the file.
    with open(rf.path, "a") as f:
        f.write('{"key": {"m": "d"')
    recs = load_records(rf.path)
    assert len(recs) == 8
    latest = {key_id(r["key"]): r for r in latest_ok(recs)}
    assert latest[key_id(b)]["error"] == "boom again" and latest[key_id(c)]["ok"]


def test_outage_metrics():
    t0, tf = 100.0, 105.0
    arr = [(t0 + i * 0.01, 1) for i in range(500)]  # 100 tok/s until the fault
    arr += [(tf + 0.25 + i * 0.01, 2) for i in range(300)]  # back 250 ms later, twice as many tokens per chunk
    m = outage_metrics(arr, tf, t0, 0.5)
    assert abs(m["outage_s"] - 0.26) < 1e-6
    assert m["tokens"] == 500 + 600
    assert m["tokens_per_s"][0] == 100.0 and m["tokens_per_s"][10] == 0.0 + 2 * 25 / 0.5
    assert abs(m["last_token_before_fault_rel_s"] + 0.01) < 1e-6
    assert abs(m["first_token_after_fault_rel_s"] - 0.25) < 1e-6
    assert m["throughput_back_rel_fault_s"] == 0.0  # the bin of the fault already holds the first tokens back
    assert m["steady_gap_s"] == pytest.approx(0.01)  # no stall before the fault
    m = outage_metrics(arr, tf, t0, 0.05)
    assert m["throughput_back_rel_fault_s"] == pytest.approx(0.25)
    # A stall of the engine's own before the fault (a prefill batch): reported beside the outage, not in it.
    stalled = [(t, n) for t, n in arr if not 103.0 < t < 103.08] + [(103.5, 1)]
    m = outage_metrics(stalled, tf, t0, 0.05)
    assert m["steady_gap_s"] == pytest.approx(0.08) and m["outage_s"] == pytest.approx(0.26)
    assert m["steady_window_s"] == [-2.5, -0.05]
    assert "failover_gap_s" not in m  # no detection given
    # The failover's own gap spans the detection; a longer stall of the engine's later is the window's outage.
    t_det = tf + 0.03
    later = [(t, n) for t, n in arr if not 107.0 < t < 107.4]
    m = outage_metrics(later, tf, t0, 0.05, t_detect=t_det)
    assert m["outage_s"] == pytest.approx(0.4, abs=0.011) and m["failover_gap_s"] == pytest.approx(0.26)
    assert m["failover_gap_start_rel_fault_s"] == pytest.approx(-0.01)
    assert m["fault_to_resumed_token_s"] == pytest.approx(0.25)
    # A stall before the window's start (the load's first half: its ramp-up) is not counted.
    m = outage_metrics([(t, n) for t, n in arr if not 101.0 < t < 101.5], tf, t0, 0.05)
    assert m["steady_gap_s"] == pytest.approx(0.01)


def _rec(exp, key, data, ok=True, err=None, **kw):
    return {"schema": 1, "experiment": exp, "key": key, "ok": ok, "error": err, "run_id": "r", "t": 0, "data": data, **kw}


def synthetic(out: str) -> None:
    """Result files like a GPU run's, with known figures."""
    def write(exp, recs, cpu=False):
        with open(os.path.join(out, f"{exp}.jsonl"), "w") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
        with open(os.path.join(out, "runs.jsonl"), "a") as f:
            f.write(json.dumps({"experiment": exp, "cpu_check": cpu, "fault": "misaligned:load",
                                "env": {"nvidia_smi": {"name": "NVIDIA H100 80GB HBM3", "driver": "580.1"},
                                        "engine": {"torch": "2.11", "torch_cuda": "13.0"}, "commit": "abc"}}) + "\n")

    rec = []
    for m, f, sl, cold, step in (("qwen2.5-0.5b", 0.010, 0.080, 30.0, 0.006), ("qwen2.5-14b", 0.020, 1.0, 60.0, 0.018)):
        for t, jitter in enumerate((0.0, 0.001, -0.001)):
            rec.append(_rec("recovery", {"model": m, "system": "frmps", "trial": t},
                            {"recovery_s": f + jitter, "step_after_s": step, "fault_to_detect_s": 0.1}))
            rec.append(_rec("recovery", {"model": m, "system": "sleep-only", "trial": t},
                            {"recovery_s": sl, "wake": {"copy_weights_s": sl / 2}}))
        rec.append(_rec("recovery", {"model": m, "system": "cold", "cache": "dropped", "trial": 0},
                        {"recovery_s": cold, "cold": {"load_weights_s": cold / 2}, "page_cache_fraction_before": 0.0}))
    rec.append(_rec("recovery", {"model": "qwen2.5-7b", "system": "frmps", "trial": 0}, {}, ok=False, err="TrialError: x"))
    write("recovery", rec)
    trials = []
    for rep in range(3):
        # Round 1 runs at half speed throughout (noise between rounds): paired against its
        # own no-sync trial it changes nothing; summed over rounds it would.
        slow = 2.0 if rep == 1 else 1.0
        for n, inline in ((0, False), (1, False), (16, False), (1, True)):
            extra = 0.004 if (n, inline) == (1, False) else 0.1 if inline else 0.0
            trials.append({"sync_every": n, "inline": inline, "rep": rep, "seconds": slow * (1.0 + extra),
                           "tokens": 1000, "sync_s": 0.003 if n == 1 else 0.0,
                           "syncs": 64 if n == 1 else 4 * (n == 16)})
    write("sync-overhead", [_rec("sync-overhead", {"model": "qwen2.5-14b"}, {"batch": 128, "trials": trials})])
    write("standby-memory", [_rec("standby-memory", {"model": "qwen2.5-14b"},
                                  {"standby_mib": 600, "context_mib": 520, "overhead_mib": 80, "unit": "GPU MiB",
                                   "standby_torch_pools_mib": {"default": {"reserved": 42.0, "allocated": 40.0}},
                                   "standby_stack_bytes": 1024})])
    write("outage", [_rec("outage", {"model": "qwen2.5-14b", "system": "frmps", "trial": 0},
                          {"outage_s": 0.05, "stream_errors": 0, "requests": 40, "bin_s": 0.05,
                           "tokens_per_s": [100, 100, 0, 100], "fault_rel_t0_s": 0.1}),
                     _rec("outage", {"model": "qwen2.5-14b", "system": "frmps-no-kv", "trial": 0}, {}, ok=False,
                          err="unsupported: no flag", unsupported=True)])
    write("correctness", [_rec("correctness", {"model": "qwen2.5-0.5b", "k": k, "trial": 0},
                               {"greedy_equal": True, "seeded_equal": k != 8, "first_diff": [None, 3] if k == 8 else [None, None],
                                "exact_mode": "on"}) for k in (1, 8)])
    write("since-sync", [_rec("since-sync", {"model": "qwen2.5-14b", "system": "frmps-n1", "k": k, "trial": 0},
                              {"recovery_s": 0.02, "prefilled_tokens": 1, "reused_tokens": 6 + k}) for k in (1, 128)])


def test_k_sweep_target_is_met_only_by_the_whole_sweep():
    """A sweep the budget stopped at K = 128, every point equal: "–" (not yet), with the K not
    measured named; the whole sweep equal: met."""
    def row(ks):
        c = {"ks": {str(k): {} for k in ks}, "equal": 2 * len(ks), "requests": 2 * len(ks)}
        return report.targets({"correctness": {"engines": {"vllm, batch-invariant": c}}})[-1]
    part = row([1, 2, 4, 8, 16, 32, 64, 128])
    assert part["met"] is None and part["reached"].endswith("(not measured: 256, 512, 1024)")
    whole = row(report.TARGET_KS)
    assert whole["met"] is True and whole["reached"] == "22/22"


def test_report_targets_and_tables(tmp_path):
    out = str(tmp_path)
    synthetic(out)
    written = report.write_all(out, plots=False)
    assert os.path.join(out, "README.md") in written
    summ = {n: json.load(open(os.path.join(out, f"{n}.json")))["summary"] for n in
            ("recovery", "sync-overhead", "standby-memory", "outage", "correctness", "since-sync")}
    r = summ["recovery"]["models"]
    assert r["qwen2.5-0.5b"]["frmps"]["recovery_s"] == pytest.approx(0.010)
    assert r["qwen2.5-0.5b"]["speedup_vs_sleep_only"] == pytest.approx(8.0)
    assert r["qwen2.5-14b"]["speedup_vs_sleep_only"] == pytest.approx(50.0)
    assert r["qwen2.5-14b"]["speedup_vs_cold"] == pytest.approx(3000.0)
    per_n = summ["sync-overhead"]["models"]["qwen2.5-14b"]["per_n"]
    assert per_n["1"]["overhead_pct"] == pytest.approx(100 * (1 - 1 / 1.004))
    assert per_n["1"]["overhead_range_pct"] == pytest.approx([100 * (1 - 1 / 1.004)] * 2)
    assert per_n["1i"]["overhead_pct"] == pytest.approx(100 * (1 - 1 / 1.1))
    assert per_n["16"]["overhead_pct"] == pytest.approx(0.0)
    t = {row["target"]: row for row in report.targets(summ)}
    assert t["≥ 5× faster than sleep-only at 0.5B"]["met"] is True
    assert t["≥ 40× faster than sleep-only at 14B"]["met"] is True
    assert t["≥ 2000× faster than cold restart"]["met"] is True  # 0.5B: 3000×, 14B: 3000×
    assert t["takeover flat across model sizes (spread ≤ 5 ms)"]["met"] is False  # 10 ms vs 20 ms
    assert t["takeover ≤ one decode step + 5 ms"]["met"] is True  # 20 ms <= 18 + 5 ms
    assert t["sync overhead ≤ 0.5% at N = 1"]["met"] is True
    assert t["standby ≤ CUDA context + 64 MiB"]["met"] is False  # +80 MiB
    assert t["outage ≤ 60 ms (qwen2.5-14b)"]["met"] is True
    # K = 1 and 8 of the sweep's eleven: the rest named as not measured; one stream differs, so not met
    kt = t["outputs after recovery = no-fault outputs, K = 1…1024"]
    assert kt["reached"] == "3/4 at K = 1, 8 (not measured: 2, 4, 16, 32, 64, 128, 256, 512, 1024)"
    assert kt["met"] is False
    readme = open(os.path.join(out, "README.md")).read()
    # The standby's own account of its memory beside the figure: torch's pool and its stack.
    assert "| 80 MiB | 42 MiB | 1024 B |" in readme
    assert "NVIDIA H100 80GB HBM3" in readme and "| qwen2.5-14b | 20.0 ms | 1,000.0 ms |" in readme
    assert "TrialError: x" in readme and "Not measured (1 points): unsupported: no flag" in readme
    assert "| N=1 | N=16 | N=1 between steps |" in readme and "+9.09% (+9.1…+9.1) / " in readme
    # Regenerating keeps text written outside the generated block.
    with open(os.path.join(out, "README.md"), "a") as f:
        f.write("\nNotes by hand.\n")
    with open(os.path.join(out, "README.md")) as f:
        text = f.read().replace("# frmps bench results", "# Results\n\nIntro by hand.\n\n# frmps bench results")
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(text)
    report.write_all(out, plots=False)
    again = open(os.path.join(out, "README.md")).read()
    assert "Intro by hand." in again and "Notes by hand." in again and again.count(report.BEGIN) == 1


def test_plots_from_json(tmp_path):
    require("matplotlib")
    from bench import plots

    out = str(tmp_path)
    synthetic(out)
    assert plots.main([out]) == 0
    for name in ("recovery", "sync-overhead", "standby-memory", "outage", "correctness", "since-sync"):
        path = os.path.join(out, f"{name}.png")
        assert os.path.getsize(path) > 5000, name
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "![recovery](recovery.png)" in open(os.path.join(out, "README.md")).read()


def test_every_experiment_plans_points_in_both_modes():
    from bench.__main__ import build_parser, normalise

    for name, exp in EXPERIMENTS.items():
        for mode in (["--cpu"], ["--device", "cuda", "--quick"], ["--device", "cuda"]):
            args = build_parser().parse_args([name, *mode, "--out", "/tmp/unused", "--frmps", "/bin/true"])
            normalise(args)
            exp.defaults(args)
            keys = exp.plan(args)
            assert keys and len({key_id(k) for k in keys}) == len(keys), name
            if "--cpu" in mode:
                assert all(k.get("model", "tiny") == "tiny" for k in keys)
            else:
                assert all(k.get("model") != "tiny" for k in keys)
    full = build_parser().parse_args(["recovery", "--device", "cuda", "--frmps", "/bin/true"])
    normalise(full)
    EXPERIMENTS["recovery"].defaults(full)
    assert {k["model"] for k in EXPERIMENTS["recovery"].plan(full)} == {
        "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b"}


def test_engine_arg_reaches_every_frmps_serve_the_bench_starts():
    """--engine-arg=ARG (repeatable; with "=", as ARG starts with "-") is appended to the engines' own arguments, after the
    experiment's, as `frmps serve --engine-arg` flags (e.g. a vLLM flag for an A/B run); --serve-arg=ARG is one more
    `frmps serve` flag."""
    import types

    from bench.__main__ import build_parser, normalise
    from bench.experiments import serve_opts

    args = build_parser().parse_args(["standby-memory", "--device", "cuda", "--engine", "vllm", "--frmps", "/bin/true",
                                      "--engine-arg=--vllm-arg=--enforce-eager", "--engine-arg=--x=1",
                                      "--serve-arg=--standby-kv=readonly"])
    normalise(args)
    opts = serve_opts(types.SimpleNamespace(args=args, cpu=False), "qwen2.5-0.5b", engine_args=["--own"])
    cmd = opts.command(1, "127.0.0.1:2", "/run", "/logs")
    assert cmd[-4:] == ["--standby-kv=readonly", "--engine-arg=--own", "--engine-arg=--vllm-arg=--enforce-eager",
                        "--engine-arg=--x=1"], cmd
    plain = build_parser().parse_args(["standby-memory", "--device", "cuda", "--frmps", "/bin/true"])
    normalise(plain)
    assert plain.engine_arg == [] and plain.serve_arg == []
    assert "--standby-kv=readonly" not in serve_opts(types.SimpleNamespace(args=plain, cpu=False),
                                                     "qwen2.5-0.5b").command(1, "127.0.0.1:2", "/run", "/logs")


@pytest.mark.torch
def test_budget_stops_before_work_that_does_not_fit(tmp_path):
    require("torch")
    frmps_bin()
    out, work = str(tmp_path / "out"), str(tmp_path / "work")
    p = bench(out, work, "sync-overhead", "--budget", "2")
    assert p.returncode == 3, p.stderr[-2000:]
    assert "time budget" in p.stderr and "re-run the same command to continue" in p.stderr
    assert records(out, "sync-overhead") == []
    runs = report.load_runs(out)
    assert runs and runs[-1]["stopped"] and runs[-1]["new_points"] == 0


def test_sync_overhead_against_neighbouring_no_sync_trials():
    # The step time drifts (contexts grow): every trial is compared with the no-sync
    # trials right before and after it, so a linear drift cancels.
    trials, seq = [], 0
    for rep in range(2):
        for n in ((0, 1, 0, 16, 0) if rep == 0 else (1, 0, 16, 0)):
            secs = 1.0 + 0.1 * seq  # drift: every trial 10% slower than the one before
            if n == 1:
                secs *= 1.02  # N = 1 costs 2% on top
            trials.append({"sync_every": n, "inline": False, "rep": rep, "seq": seq, "seconds": secs, "tokens": 1000,
                           "sync_s": 0.0, "syncs": 0})
            seq += 1
    s = report.summarize_sync([_rec("sync-overhead", {"model": "qwen2.5-0.5b"}, {"batch": 8, "trials": trials})])
    per_n = s["models"]["qwen2.5-0.5b"]["per_n"]
    assert per_n["1"]["overhead_pct"] == pytest.approx(100 * (1 - 1 / 1.02))
    assert per_n["16"]["overhead_pct"] == pytest.approx(0.0, abs=1e-9)


def test_sync_overhead_trial_order():
    from bench.sync_overhead import trial_order

    assert trial_order([0, 1, 16], 1) == [(0, 0), (0, 1), (0, 0), (0, 16), (0, 0)]
    # Rounds alternate direction and share their boundary no-publish trial.
    assert trial_order([0, 1, 16], 2) == [(0, 0), (0, 1), (0, 0), (0, 16), (0, 0), (1, 16), (1, 0), (1, 1), (1, 0)]


@pytest.mark.torch
def test_sync_overhead_through_the_vllm_adapter_core(tmp_path):
    """The vllm engine of sync-overhead on the CPU: the adapter's VllmCore over
    vLLM's real scheduler (the model runner a labelled test double), driven by the
    SDK's engine loop. vLLM's synchronous step has a launch hook, so N = 1 is measured
    twice in the one run: published once the step's batch is launched, and between steps."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 (any import failure)
        if os.environ.get("FRMPS_EXPECT_VLLM"):
            raise
        pytest.skip(f"vLLM is not importable: {e}")
    frmps_bin()
    out, work = str(tmp_path / "out"), str(tmp_path / "work")
    p = bench(out, work, "sync-overhead", "--engines", "vllm", "--sync-list", "0,1,4", "--reps", "1")
    assert p.returncode == 0, p.stderr[-3000:]
    (rec,) = records(out, "sync-overhead")
    assert rec["key"] == {"model": "tiny", "engine": "vllm"} and rec["ok"], rec["error"]
    d = rec["data"]
    assert d["publish"].startswith("overlapped") and "launch hook" in d["publish"]
    assert "TEST DOUBLE" in d["engine_info"]["model_runner"]
    assert [(t["sync_every"], t["inline"]) for t in d["trials"]] == [
        (0, False), (1, False), (0, False), (4, False), (0, False), (1, True), (0, False)]
    # S = 8 steps (+ 1): between steps a publish follows every N-th of the 9 (TrialClock);
    # through the hook one is due after each N-th step and made during the next, S / N.
    for t in d["trials"]:
        if t["sync_every"]:
            assert t["syncs"] == (9 if t["inline"] else 8) // t["sync_every"], t
    s = json.load(open(os.path.join(out, "sync-overhead.json")))["summary"]["models"]["tiny (vllm)"]
    assert s["per_n"]["1"]["syncs_per_step"] == pytest.approx(8 / 9) and s["per_n"]["0"]["syncs_per_step"] == 0
    assert s["per_n"]["1i"]["syncs_per_step"] == 1


def test_sharegpt_like_lengths_are_seeded_and_match_their_documented_moments():
    import random
    import statistics

    from bench import lengths as L

    def run(seed, client, n=200):
        c = L.RequestLengths(L.SHAREGPT_PROMPT, L.SHAREGPT_OUTPUT, seed=seed).client(client)
        return [c.next() for _ in range(n)]

    assert run(3, 0) == run(3, 0) and run(3, 5) == run(3, 5)  # the same per (seed, client), every time
    assert run(3, 0) != run(4, 0) and run(3, 0) != run(3, 1)
    for d in (L.SHAREGPT_PROMPT, L.SHAREGPT_OUTPUT, L.SHAREGPT_PROMPT.scaled(0.1)):
        rng = random.Random(11)
        xs = [d.sample(rng) for _ in range(60_000)]
        assert d.lo <= min(xs) and max(xs) <= d.hi
        mean, std = d.moments()
        assert statistics.fmean(xs) == pytest.approx(mean, rel=0.02)
        assert statistics.pstdev(xs) == pytest.approx(std, rel=0.04)
    # The documented figures: ShareGPT's means (vLLM paper) before clipping, and the moments after.
    assert (L.SHAREGPT_PROMPT.mean, L.SHAREGPT_OUTPUT.mean) == (161.0, 338.0)
    assert L.SHAREGPT_PROMPT.moments() == pytest.approx((156.4, 174.0), abs=0.05)
    assert L.SHAREGPT_OUTPUT.moments() == pytest.approx((321.2, 245.0), abs=0.05)
    readme = open(os.path.join(REPO, "bench", "README.md")).read()
    for row in L.table_rows():
        assert row in readme, f"bench/README.md lacks the row {row!r}"


def test_report_keeps_the_engines_apart(tmp_path):
    """Points of `--engine vllm` (keys naming the engine) get their own rows and vLLM's
    targets, beside the reference engine's rows of the same models."""
    out = str(tmp_path)
    rec = []
    for engine, f, sl, cold in (("ref", 0.010, 0.080, 30.0), ("vllm", 0.012, 0.300, 45.0)):
        ek = {} if engine == "ref" else {"engine": engine}
        rec.append(_rec("recovery", {"model": "qwen2.5-0.5b", "system": "frmps", "trial": 0, **ek},
                        {"recovery_s": f, "step_after_s": 0.006}))
        rec.append(_rec("recovery", {"model": "qwen2.5-0.5b", "system": "sleep-only", "trial": 0, **ek},
                        {"recovery_s": sl, "wake": {"wake_up_s": sl / 2} if engine == "vllm" else {"copy_weights_s": sl / 2}}))
        rec.append(_rec("recovery", {"model": "qwen2.5-0.5b", "system": "cold", "cache": "warm", "trial": 0, **ek},
                        {"recovery_s": cold, "cold": {"engine_init_s": cold / 2} if engine == "vllm" else {}}))
    with open(os.path.join(out, "recovery.jsonl"), "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rec)
    cor = [_rec("correctness", {"model": "qwen2.5-0.5b", "k": 1, "trial": 0, **({} if e == "ref" else {"engine": e})},
                {"greedy_equal": True, "seeded_equal": e == "ref", "exact_mode": "x"}) for e in ("ref", "vllm")]
    with open(os.path.join(out, "correctness.jsonl"), "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in cor)
    report.write_all(out, plots=False)
    r = json.load(open(os.path.join(out, "recovery.json")))["summary"]["models"]
    assert r["qwen2.5-0.5b"]["speedup_vs_sleep_only"] == pytest.approx(8.0)
    assert r["qwen2.5-0.5b (vllm)"]["speedup_vs_sleep_only"] == pytest.approx(25.0)
    t = {row["target"]: row for row in report.targets({"recovery": {"models": r}})}
    assert t["≥ 5× faster than sleep-only at 0.5B"]["met"] is True
    assert t["vllm: ≥ 10× faster than vLLM sleep-only at 0.5B"]["met"] is True
    assert t["vllm: ≥ 3000× faster than vLLM cold restart"]["met"] is True  # 45 s / 12 ms = 3,750×
    assert t["≥ 2000× faster than cold restart"]["met"] is True
    c = json.load(open(os.path.join(out, "correctness.json")))["summary"]
    assert (c["equal"], c["requests"]) == (2, 2) and (c["engines"]["vllm"]["equal"], c["engines"]["vllm"]["requests"]) == (1, 2)
    readme = open(os.path.join(out, "README.md")).read()
    assert "| qwen2.5-0.5b (vllm) | 12.0 ms | 300.0 ms |" in readme and "wake_up() 150.0 ms" in readme
    assert "Engine vllm. Model: qwen2.5-0.5b" in readme and "| vllm: outputs after recovery = no-fault outputs" in readme


@pytest.mark.torch
def test_checkpoint_is_a_model_directory_both_engines_load(tmp_path):
    """The cold restart's checkpoint (written once per model): Hugging Face's sharded
    layout (shards + index + config.json), which loaders that read Hugging Face
    directories (vLLM's, transformers') load without a missing or unexpected tensor,
    holding the reference engine's seeded weights: transformers' greedy output from it
    equals the reference engine's from the same files."""
    torch = require("torch")
    transformers = require("transformers")
    out = str(tmp_path / "tiny")
    env = {**os.environ, "PYTHONPATH": BENCH_PATH}
    p = subprocess.run([sys.executable, "-m", "bench.baseline_engine", "write-checkpoint", "--model", "tiny",
                        "--device", "cpu", "--out", out, "--shard-bytes", str(100 << 10)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    meta = json.load(open(os.path.join(out, "frmps-checkpoint.json")))
    assert meta["format"] == 2 and len(meta["files"]) > 1  # sharded
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert sorted(set(index["weight_map"].values())) == meta["files"]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info

    from frmps_engine.refengine import EngineConfig, RefCore, SamplingParams

    cfg = EngineConfig.from_preset("tiny", device="cpu", weights=out)
    core = RefCore(cfg, RefCore.allocate_pools(cfg), load_weights=True)
    prompts = {1: [5, 17, 99, 200, 3, 42, 7, 8], 2: [250, 11, 12, 13], 3: list(range(30, 60))}
    for k, pr in prompts.items():
        core.add_request(k, pr, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    ours: dict[int, list[int]] = {k: [] for k in prompts}
    while core.has_work():
        for o in core.step():
            ours[o.key] += list(o.new_token_ids)
    theirs = {k: model.generate(torch.tensor([pr]), max_new_tokens=10, min_new_tokens=10,
                                do_sample=False)[0, len(pr):].tolist() for k, pr in prompts.items()}
    assert ours == theirs
    assert len({tuple(v) for v in ours.values()}) > 1  # the prompts lead to different outputs


def test_nvidia_smi_is_asked_about_the_engines_gpu():
    """On a host with several GPUs the bench (and the GPU proofs) report the GPU the
    engines run on: CUDA_VISIBLE_DEVICES's first entry, an index or a UUID."""
    from bench.envinfo import smi_select

    assert smi_select({"CUDA_VISIBLE_DEVICES": "GPU-96daeac9, GPU-f03ab92b"}) == ["-i", "GPU-96daeac9"]
    assert smi_select({"CUDA_VISIBLE_DEVICES": " 2"}) == ["-i", "2"]
    assert smi_select({"CUDA_VISIBLE_DEVICES": ""}) == [] == smi_select({})


def test_the_fault_time_is_the_triggers_own():
    """A trigger prints when it faults, by its own clock (bench/faults/fault_common.h and
    the test double): the harness takes that time, not the time it read the line, which
    on the CPU double came after the supervisor's detection (fault -> detection < 0)."""
    from bench import loglines

    assert loglines.trigger_time("pid 7 triggering misaligned (load) at 1795779325.451397610") == 1795779325.45139761
    assert loglines.trigger_time("pid 7 triggering misaligned (load)") is None  # older triggers: the read time
    assert loglines.trigger_time("pid 7 ready") is None


def test_the_mps_servers_teardown_of_a_client(tmp_path):
    """The MPS server's log, as the H100 run of 2026-11-27 wrote it (first fault of a
    deployment: 287 ms from "to be torn down" to the active's exit)."""
    import datetime

    from bench import loglines

    log = tmp_path / "server.log"
    log.write_text(
        "[2026-11-27 13:09:16.123 Server  1137] Server has started\n"
        "[2026-11-27 13:11:17.402 Server  1137] Server is handling a fatal GPU error.\n"
        "[2026-11-27 13:11:17.402 Server  1137] Client {PID: 1070, Context ID: 1} on device 0 to be torn down\n"
        "[2026-11-27 13:11:17.402 Server  1137] Client {PID: 1976, Context ID: 1} on device 0 to be torn down\n"
        "[2026-11-27 13:11:17.689 Server  1137] Server failed to recevie command with status 806, assuming client "
        "{PID: 1070, Context ID: 1} exit\n"
        "[2026-11-27 13:11:17.690 Server  1137] Client {PID: 1070, Context ID: 1} exiting. Number of active client "
        "contexts is 1.\n"
        "[2026-11-27 13:11:43.341 Server  2173] Client {PID: 2391, Context ID: 1} exiting. Number of active client "
        "contexts is 1.\n")
    td = loglines.mps_client_teardown(str(log), 1070)
    assert td["teardown_ms"] == 288.0
    assert td["exited_at"] == datetime.datetime(2026, 11, 27, 13, 11, 17, 690000).timestamp()
    killed = loglines.mps_client_teardown(str(log), 2391)  # an exit without a fault (a drill's SIGKILL)
    assert killed["torn_down_at"] is None and killed["teardown_ms"] is None
    assert loglines.mps_client_teardown(str(log), 1070, after=killed["exited_at"]) is None
    assert loglines.mps_client_teardown(str(log), 4242) is None
    assert loglines.mps_client_teardown(str(tmp_path / "missing.log"), 1070) is None


def test_fault_kinds_in_turn(tmp_path):
    """--fault takes one trigger, several or 'all'; trial t of every experiment gets the
    (t mod n)-th, and a point records the trigger it was faulted with."""
    from types import SimpleNamespace

    from bench.__main__ import _fault_arg
    from bench.runctx import FAULT_KINDS, Budget, Ctx, fault_kinds

    assert fault_kinds("misaligned:load") == ["misaligned:load"]
    assert fault_kinds(" a:x, b:y ,") == ["a:x", "b:y"]
    # a program alone is its default variant, named as 'all' names it (no ':' in session stages)
    assert fault_kinds("misaligned,shared_oob,oob_write:read") == ["misaligned:load", "shared_oob:shared",
                                                                  "oob_write:read"]
    assert fault_kinds("all") == FAULT_KINDS and len(FAULT_KINDS) == 7
    for bad in ("", ",", "all,misaligned:load"):
        with pytest.raises(ValueError):
            fault_kinds(bad)
    import argparse
    with pytest.raises(argparse.ArgumentTypeError):
        _fault_arg("all,x:y")
    assert _fault_arg("all").split(",") == FAULT_KINDS

    ctx = Ctx(args=SimpleNamespace(fault="a:x,b:y,c:z", mps=True), out_dir=str(tmp_path), run_id="r",
              budget=Budget(0), results=ResultFile(str(tmp_path), "recovery", "r"))
    assert [ctx.fault_for({"trial": t}) for t in range(5)] == ["a:x", "b:y", "c:z", "a:x", "b:y"]
    assert ctx.fault_for({"cache": "warm"}) == "a:x"  # a point without trials takes the first
    rec = ctx.run_point({"model": "m", "system": "frmps", "trial": 1}, lambda: {"inject": {"t_fault": 1.0}})
    assert rec["data"]["fault"] == "b:y" and ctx.fault == "b:y"
    rec = ctx.run_point({"model": "m", "system": "frmps", "trial": 2}, lambda: {"recovery_s": 0.1})
    assert "fault" not in rec["data"]  # nothing was fired: no trigger to record


def test_report_per_fault_kind():
    """Trials of several fault kinds: the summary and README give each kind's medians beside
    the overall ones; one kind gives no per-kind table."""
    recs = []
    for t, (kind, f, so) in enumerate([("misaligned:load", 0.060, 0.50), ("shared_oob:shared", 0.020, 0.45),
                                       ("misaligned:load", 0.070, 0.55)]):
        # frmps: fault -> its detection; a baseline: fault -> the victim's waitpid
        recs.append(_rec("recovery", {"model": "qwen2.5-14b", "system": "frmps", "trial": t},
                         {"fault": kind, "fault_to_detect_s": 0.008, "recovery_s": f}))
        recs.append(_rec("recovery", {"model": "qwen2.5-14b", "system": "sleep-only", "trial": t},
                         {"fault": kind, "fault_to_death_s": 0.07, "recovery_s": so}))
    s = report.summarize_recovery(recs)["models"]["qwen2.5-14b"]
    bf = s["by_fault"]
    assert bf["misaligned:load"]["frmps"] == {"n": 2, "recovery_s": pytest.approx(0.065),
                                              "fault_to_death_s": pytest.approx(0.008),
                                              "from_fault_s": pytest.approx(0.073)}
    assert bf["shared_oob:shared"]["sleep-only"]["from_fault_s"] == pytest.approx(0.52)
    md = report.md_recovery(report.summarize_recovery(recs))
    assert "| qwen2.5-14b | `shared_oob:shared` | 1, 20.0 ms, 28.0 ms | 1, 450.0 ms, 520.0 ms | 19× |" in md
    one = [r for r in recs if r["data"]["fault"] == "misaligned:load"]
    assert "by_fault" not in report.summarize_recovery(one)["models"]["qwen2.5-14b"]


def test_teardown_by_fault_groups_soaks_by_kind(tmp_path):
    """bench/teardown_by_fault.py: per kind of fault, a soak's first fault left out, and the
    paired column compares a kind with the same soak's shared_oob faults."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("teardown_by_fault", os.path.join(REPO, "bench", "teardown_by_fault.py"))
    tbf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tbf)

    def fault(n, kind, flip, first_ms, td=None):
        c = {"n": n, "fault": kind, "takeover": {"kv_writable_ms": flip},
             "detect_to_first_resumed_token_s": first_ms / 1000}
        if td is not None:
            c["mps_teardown"] = {"teardown_ms": td}
        return c

    for name, base in (("2026-01-01-h100-a", 20.0), ("2026-01-02-h200-b", 40.0)):
        os.makedirs(tmp_path / name)
        soak = {"faults": [fault(1, "misaligned:load", 300.0, 330.0),  # a GPU's first fault: left out
                           fault(2, "misaligned:load", 30.0, base + 25), fault(3, "shared_oob:shared", 4.0, base),
                           fault(4, "shared_oob:local", 6.0, base + 2, td=9.0)]}
        (tmp_path / name / "soak.json").write_text(json.dumps(soak))
    (tmp_path / "2026-01-02-h200-b" / "other.json").write_text(json.dumps({"summary": {}}))  # not a soak
    by, firsts, files = tbf.collect(str(tmp_path), [])
    assert firsts == 2 and sorted(files) == ["2026-01-01-h100-a/soak.json", "2026-01-02-h200-b/soak.json"]
    s = tbf.summarize(by)
    assert list(s) == ["misaligned", "shared_oob"]  # the longest flips first
    assert s["misaligned"]["flip_ms"]["median"] == 30.0 and s["misaligned"]["first_token_ms"]["n"] == 2
    assert s["misaligned"]["paired_ms"] == {"n": 2, "median": 24.0, "p10": 24.0, "p90": 24.0, "over_20ms": 1.0}
    assert s["shared_oob"]["teardown_ms"]["n"] == 2 and "paired_ms" not in s["shared_oob"]
    assert "| `misaligned` | 30.0 (30.0–30.0), n 2 |" in tbf.table(s)
    only, _, _ = tbf.collect(str(tmp_path), ["*-h100-*"])
    assert tbf.summarize(only)["misaligned"]["first_token_ms"]["median"] == 45.0


@pytest.mark.torch
def test_flip_contention_probe_runs_on_the_cpu(tmp_path):
    """bench/gpu/flip_contention.py's own smoke check (host-shm, CPU tensors): the probe
    runs end to end and writes its figures; what it measures needs a GPU."""
    require("torch")
    out = tmp_path / "flip.json"
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "gpu", "flip_contention.py"), "--device", "cpu",
                        "--memory", "host-shm", "--gib", "0.01", "--rounds", "2", "--launches", "5", "--out", str(out)],
                       env={**os.environ, "PYTHONPATH": os.path.join(REPO, "vllmpatch", "src")}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.load(open(out))["sizes"][0]
    assert got["flip_alone"]["n"] == 2 and got["5_launches_during_flips"]["n"] == 2 and got["flip_beside_launches"]["n"] >= 1


def test_takeover_breakdown_reads_the_first_steps_vllm_calls(tmp_path):
    """With FRMPS_DEBUG_STEP_PHASES the first step's vLLM calls follow its line: the
    bench reads when the forward pass was launched and how long add_requests took
    (lines as a 14B takeover on an H200 wrote them, through the supervisor's log)."""
    from bench import loglines

    sup = "2026-11-28T12:02:35.917Z [INFO]  frmps.supervisor.engine.standby: 2026-11-28 12:02:35,917 INFO "
    log = tmp_path / "standby.log"
    log.write_text(
        sup + "frmps_engine.sdk.runner: took over 1 requests in 1.05 ms (6 reused tokens, 1 to prefill; KV writable in "
        "0.000 ms; adoption 0.29 ms, ring attach 0.15 ms; adoption CPU 0.29 ms, the KV flip beside it); loop started "
        "beside the KV flip, 0.58 ms into the takeover; its first step's host work had not reached the device gate when "
        "the flip ended (0.12 ms into the takeover): pid=2932\n"
        + sup + "frmps_engine.sdk.loop: step 1 after start: began 0.20 ms after the loop started, step 12.01 ms, dispatch "
        "0.16 ms (loop thread CPU 4.74 ms of the 12.17), 1 outputs, 1 tokens scheduled; reached the device gate 3.77 ms "
        "into the takeover, +3.65 ms from the flip's end: pid=2932\n"
        + sup + "frmps_engine.sdk.loop: step 1 after start, vLLM calls (ms from the step's start): schedule 0.02+0.14, "
        "execute_model 0.24+2.48, >finish_requests 0.25+0.00, >add_requests 0.26+1.36, >>req_states.add_request "
        "0.27+0.40, >prepare_inputs 1.70+0.60, >kv_connector.pre_forward 3.09+0.00, >cudagraph_manager.run_fullgraph "
        "3.10+0.06, sample_tokens 3.30+1.20, update_from_output 11.80+0.10: pid=2932\n")
    got = loglines.takeover_breakdown(str(log))
    assert got["first_step"] == {"step_ms": 12.01, "dispatch_ms": 0.16, "loop_cpu_ms": 4.74,
                                 "forward_launch_ms": 3.09, "add_requests_ms": 1.36}, got
    from bench.experiments import describe_recovery

    line = describe_recovery({"recovery_s": 0.0148, "takeover_log": got})
    assert line.endswith("first step's forward launched 3.09 ms in"), line


def test_outage_leaves_vllm_batch_size_to_vllm():
    """The outage load with vLLM runs at vLLM's own max_num_seqs (a user's default; the
    load's concurrency would cap vLLM's CUDA-graph sizes at 64 tokens); the reference
    engine decodes exactly the load's concurrency."""
    import argparse

    exp = EXPERIMENTS["outage"]
    assert exp.default_max_num_seqs(argparse.Namespace(engine="vllm", concurrency=32)) == 0
    assert exp.default_max_num_seqs(argparse.Namespace(engine="ref", concurrency=32)) == 32


@pytest.mark.torch
def test_the_cpu_runs_version_probe_reports_what_importing_torch_does():
    """A CPU run records torch's and Triton's versions without importing torch: the same
    record as the probe that imports it (which a GPU run needs for the GPU's fields)."""
    require("torch")
    from bench import envinfo

    def probe(src):
        p = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    full = probe(envinfo._TORCH_PROBE)
    assert "gpu" not in full  # no GPU here: the records have the same fields
    assert probe(envinfo._VERSIONS_PROBE) == full and full["torch"] and "torch_error" not in full
    assert envinfo.capture_env(sys.executable, None, "cpu")["engine"] == full
