"""bench/serving end to end on the CPU: `python -m bench.serving` against a real
`frmps serve` (Go supervisor and front door, reference engine, the seeded tiny
checkpoint) with vLLM 0.26.0's own `vllm bench serve` client (the checkout's
.venv-vllm026): a sweep and a fault run (SIGKILL of the active: the CPU's fault),
then the results directory; and a run stopped by SIGTERM, which must leave no
server behind. A check of the harness, not a measurement."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from e2e import frmps_bin, missing

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_PY = os.path.join(REPO, ".venv-vllm026", "bin", "python")
SMALL = ["--device", "cpu", "--systems", "frmps", "--input-len", "16", "--output-len", "8", "--range-ratio", "0.5",
         "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--max-model-len", "128", "--warmup-prompts", "2",
         "--ready-timeout-s", "180"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    frmps = frmps_bin()
    if not os.access(BENCH_PY, os.X_OK):
        missing("no .venv-vllm026 (make venv-vllm026): vllm bench serve 0.26.0 runs from it")
    d = str(tmp_path_factory.mktemp("serving") / "tiny-seeded")
    r = subprocess.run([frmps, "model", "init", "tiny", "--weights", "seeded", "--out", d, "--python", sys.executable],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": env_pythonpath()})
    assert r.returncode == 0, r.stderr[-2000:]
    return d


def env_pythonpath() -> str:
    return os.pathsep.join([os.path.join(REPO, "vllmpatch", "src"), REPO, os.environ.get("PYTHONPATH", "")])


def harness(args: list[str], **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": env_pythonpath(), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "bench.serving", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw)


def procs_with(needle: str) -> list[int]:
    """Live processes whose command line contains needle."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmd and state != "Z":
            out.append(int(name))
    return out


@pytest.mark.slow
def test_sweep_and_fault_run_against_frmps_on_the_cpu(tiny_model, tmp_path):
    out = str(tmp_path / "res")
    common = ["--model", tiny_model, "--out", out, "--frmps", frmps_bin(), "--python", sys.executable,
              "--bench-python", BENCH_PY, *SMALL]
    p = harness(["sweep", *common, "--rates", "4,inf", "--trials", "2", "--trial-s", "2", "--inf-prompts", "8",
                 "--after-failover"])
    text, _ = p.communicate(timeout=600)
    assert p.returncode == 0, text[-4000:]
    with open(os.path.join(out, "results.json")) as f:
        doc = json.load(f)
    # --after-failover: the same trials again after a failover drill, served by the engine that took over.
    again = [t for t in doc["trials"] if t["system"] == "frmps+failover"]
    assert len(again) == 4 and not [t for t in again if t.get("error")], again
    assert all(t["failed"] == 0 and t["completed"] == t["sent"] for t in again)
    drill = doc["servers"][0]["failover_drill"]
    assert drill["active_pid_after"] != drill["active_pid_before"], drill
    assert doc["aggregate"]["default-kv"]["frmps+failover"]["inf"]["trials"] == 2
    trials = [t for t in doc["trials"] if t["system"] == "frmps"]
    assert len(trials) == 4 and not [t for t in trials if t.get("error")], trials
    for t in trials:
        assert t["failed"] == 0 and t["completed"] == t["sent"] == t["num_prompts"]
        assert t["output_throughput"] > 0 and t["p99_tpot_ms"] is not None and t["truncated"] == 0
        # --ignore-eos: every request got at least the dataset's shortest output
        assert t["total_output_tokens"] >= 4 * t["sent"]
    assert {t["seed"] for t in trials if t["rate"] == "4"} == {0, 1}
    # The host CPU of each trial, per process of the server: the active engine ran the steps.
    for t in trials:
        roles = {p.get("role"): p for p in t["cpu"]["processes"]}
        assert roles["active engine"]["cpu_s"] > 0 and roles["active engine"]["cpu_ms_per_token"] > 0, t["cpu"]
        assert "frmps supervisor" in roles, t["cpu"]
    (srv,) = doc["servers"]
    assert srv["kv"]["num_blocks"] and srv["start_s"] > 0 and not srv.get("error")
    cell = doc["aggregate"]["default-kv"]["frmps"]["inf"]
    assert cell["trials"] == 2 and cell["output_throughput"]["n"] == 2
    md = open(os.path.join(out, "README.md")).read()
    assert "CPU check of the harness" in md and "| inf | frmps serve (Go front door) | 2 |" in md
    assert "## Host CPU at the highest rate" in md and "| active engine |" in md
    assert os.path.getsize(os.path.join(out, "sweep-default-kv.png")) > 5000
    # The server is gone, its run directory removed.
    assert not procs_with(srv["run_dir"]) and not os.path.exists(srv["run_dir"])
    assert not procs_with("bench.serving.client"), "the long-lived benchmark client was left running"

    # Fault mode on the CPU: SIGKILL of the active every 6 s; frmps's standby takes over.
    p = harness(["faults", *common, "--rate", "3", "--window-s", "16", "--spacing-s", "6", "--range-ratio", "0",
                 "--output-len", "16"])
    text, _ = p.communicate(timeout=600)
    assert p.returncode == 0, text[-4000:]
    with open(os.path.join(out, "results.json")) as f:
        doc = json.load(f)
    (fr,) = doc["fault_runs"]
    assert not fr.get("error"), fr.get("error")
    assert [f["kind"] for f in fr["faults"]] == ["SIGKILL", "SIGKILL"] and not [f for f in fr["faults"] if f.get("error")]
    s = fr["summary"]
    # Each CPU fault found a standby to fail over to (it waits for one: the run says how long).
    assert all(f["waited_for_standby_s"] >= 0 for f in fr["faults"]), fr["faults"]
    assert s["sent"] == 48 and s["failovers"] == 2, fr["faults"]
    assert s["failed"] == 0 and s["truncated"] == 0, "a stream was lost across a failover"
    assert s["longest_gap_ms"] > 0 and len(fr["timeline"]["t"]) >= 16
    # The run's own no-fault reference: the requests that ended before the first fault, and the rest.
    ph = s["phases"]
    assert ph["before"]["sent"] > 0 and ph["before"]["sent"] + ph["from_fault"]["sent"] == 48, ph
    assert ph["before"]["failed"] == 0 and ph["from_fault"]["failed"] == 0, ph
    assert os.path.getsize(os.path.join(out, "timeline-frmps-6s.png")) > 5000
    # The sweep's rows are still in the rebuilt report.
    assert len(doc["trials"]) == 8
    assert not procs_with("bench.serving.client")


def test_sigterm_stops_the_run_and_leaves_no_server(tiny_model, tmp_path):
    out = str(tmp_path / "res")
    p = harness(["sweep", "--model", tiny_model, "--out", out, "--frmps", frmps_bin(), "--python", sys.executable,
                 "--bench-python", BENCH_PY, *SMALL, "--rates", "1", "--trials", "3", "--trial-s", "60"])
    logs = os.path.join(out, "work", "logs-frmps")
    deadline = time.monotonic() + 180
    server: list[int] = []
    while time.monotonic() < deadline and p.poll() is None:
        server = procs_with(f"--engine-log-dir {logs}")
        raw = os.path.join(out, "raw")
        if server and os.path.isdir(raw) and os.listdir(raw):  # serving, and the client has run
            break
        time.sleep(0.5)
    assert p.poll() is None and server, f"the run did not get to its trials: {p.stdout.read()[-3000:] if p.poll() is not None else ''}"
    os.kill(p.pid, signal.SIGTERM)
    text, _ = p.communicate(timeout=120)
    assert p.returncode == 130, text[-3000:]
    assert "servers and MPS daemons stopped" in text
    deadline = time.monotonic() + 30
    while procs_with(f"--engine-log-dir {logs}") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not procs_with(f"--engine-log-dir {logs}"), "frmps serve outlived the harness"
    assert not procs_with(os.path.join(out, "raw")), "vllm bench serve outlived the harness"
    assert not procs_with(f"--model {tiny_model} --control-socket"), "an engine outlived the harness"
