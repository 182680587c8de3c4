"""Negative controls of takeover exactness (FRMPS_TEST_TAKEOVER_FAULT,
sdk/takeover_fault.py) on the reference engine, through real failovers: a
`frmps serve` on the CPU whose engines break one adopted request on purpose at
every takeover. The model is the seeded checkpoint of the tiny preset
(`frmps model init tiny --weights seeded`: a peaked, context-sensitive output,
bench/README.md "The test model"), loaded from its safetensors. The comparison with the no-fault output
(bench/exactness.py) must report the request a control hit as inexact, and
with no control (test mode only) every request must stay exact. One deployment
runs them all: its engines read the cases from a file at each takeover
(``FRMPS_TEST_TAKEOVER_FAULT=@PATH``), which the test rewrites before each
failover: the run without a control first, then each case, then the run without
a control again (nothing a case broke outlives its request). A deployment with
the cases in the variable itself is refused without test mode.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import subprocess
import sys
import time

import pytest

from e2e import Deployment, Killer, deployment
from bench import exactness, kv_digests
from frmps_engine.sdk import kv_digest, takeover_fault

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(900)]

ENGINE_ARGS = ["--engine-arg=--max-num-batched-tokens=64", "--max-restarts=1000000", "--served-model-name=tiny"]
PROMPT = "Once upon a time, in a land of shared GPUs, the standby kept watch. " * 4
# Three different prompts of several blocks (block size 16), greedy and seeded; the
# seeded one is what sampler-offset needs.
BODIES = [
    {"model": "tiny", "prompt": PROMPT[0:100], "max_tokens": 64, "ignore_eos": True, "temperature": 0.0},
    {"model": "tiny", "prompt": PROMPT[7:90], "max_tokens": 64, "ignore_eos": True, "temperature": 0.9,
     "top_k": 50, "seed": 4242},
    {"model": "tiny", "prompt": PROMPT[31:140], "max_tokens": 64, "ignore_eos": True, "temperature": 0.0},
]
# No periodic sync within a request (the SDK still publishes after each request's
# first token): at the kill the clients hold ~20 tokens past the snapshot, which
# "position" needs (an off-by-one at num_computed = tokens - 1 is absorbed by the
# engine's recomputation of the last token). With a sync every 8 steps a kill
# right after a sync left no request fitting, now and then.
SYNC_EVERY = 1000
KILL_AFTER = 21


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from frmps_engine import modeldir

    return modeldir.write("tiny", str(tmp_path_factory.mktemp("m") / "seeded-tiny"), weights="seeded", seed=0)


def prompt_tokens(model_dir: str) -> list[int]:
    """Each body's prompt length in the checkpoint's tokens (the control's log line
    names the request by it); distinct, so that it names one."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    n = [len(tok.encode(b["prompt"], add_special_tokens=False).ids) for b in BODIES]
    assert len(set(n)) == len(n) and min(n) > 3 * 16, n
    return n


def run_batch(dep: Deployment, killer: Killer | None = None):
    with cf.ThreadPoolExecutor(len(BODIES)) as pool:
        futs = [pool.submit(dep.stream, "/v1/completions", b, killer.on_token if killer and i == 0 else None)
                for i, b in enumerate(BODIES)]
        return [f.result() for f in futs]


@dataclasses.dataclass
class CaseRun:
    case: str | None
    run: exactness.ControlRun
    t0: float = 0.0  # the case's failover, between these wall-clock times
    t1: float = 0.0


@pytest.fixture(scope="module")
def kv_dir(tmp_path_factory) -> str:
    """Where the deployment's engines write their KV digests (FRMPS_DEBUG_KV_DIGESTS)."""
    return str(tmp_path_factory.mktemp("kv-digests"))


@pytest.fixture(scope="module")
def case_runs(model_dir, kv_dir, tmp_path_factory) -> list[CaseRun]:
    """One deployment, one failover per case: None (no control), every case, None again.
    The engines also write their KV digests at every takeover (sdk/kv_digest.py)."""
    switch = str(tmp_path_factory.mktemp("switch") / "cases")
    env = {"FRMPS_TEST_STEP_DELAY_MS": "10", **exactness.control_env(None), takeover_fault.ENV: "@" + switch,
           kv_digest.ENV: kv_dir}
    out: list[CaseRun] = []
    with deployment(sync_every=SYNC_EVERY, env=env, extra_args=ENGINE_ARGS, model=model_dir) as dep:
        dep.wait_state("serving_ready")
        ref = run_batch(dep)
        for r in ref:
            assert r.done and r.error is None and len(r.token_ids) == 64, r
        for n, case in enumerate([None, *takeover_fault.CASES, None]):
            with open(switch, "w") as f:
                f.write(case or "")
            with open(dep.log_path, errors="replace") as f:
                seen = len(f.read())
            t0 = time.time()
            killer = Killer(dep, after=KILL_AFTER)
            got = run_batch(dep, killer)
            assert killer.fired.is_set()
            st = dep.wait_state("serving_ready")
            assert len(st["failovers"]) == n + 1 and st["failovers"][0]["ok"], st["failovers"]
            with open(dep.log_path, errors="replace") as f:
                log_text = f.read()[seen:]  # this failover's lines
            out.append(CaseRun(case, exactness.ControlRun(
                reference={i: r.token_ids for i, r in enumerate(ref)},
                observed={i: (g.token_ids if g.error is None and g.done else []) for i, g in enumerate(got)},
                log_text=log_text), t0, time.time()))
    return out


def _verdicts(run: exactness.ControlRun) -> dict[int, exactness.Verdict]:
    return {i: exactness.compare(run.reference[i], run.observed[i]) for i in run.reference}


def test_no_control_is_exact(case_runs):
    """The positive case: test mode on, no control: every request resumes exactly,
    before the first case and after the last."""
    positive = [c.run for c in case_runs if c.case is None]
    assert len(positive) == 2
    for run in positive:
        assert not exactness.applied_controls(run.log_text)
        assert "this takeover's cases from" in run.log_text and ": none" in run.log_text, run.log_text[-3000:]
        verdicts = _verdicts(run)
        assert all(v.kind == exactness.EXACT for v in verdicts.values()), verdicts


@pytest.mark.parametrize("case", takeover_fault.CASES)
def test_control_is_detected(case: str, case_runs, model_dir):
    """Each control, applied to one adopted request at the failover, makes the
    comparison with the no-fault output fail for that request (found by its prompt
    length: the log line names the engine's key, which a client does not see)."""
    (run,) = [c.run for c in case_runs if c.case == case]
    applied = exactness.applied_prompt_lengths(run.log_text)
    assert [c for c, _ in applied] == [case], f"the control's log line: {applied}\n{run.log_text[-4000:]}"
    (hit,) = [i for i, n in enumerate(prompt_tokens(model_dir)) if n == applied[0][1]]
    verdicts = _verdicts(run)
    assert verdicts[hit].kind == exactness.INEXACT, (
        f"control {case} applied to request {hit} passed unnoticed: its resumed output equals the no-fault one; "
        f"all: {verdicts}")


# The cases that change what the KV cache holds (shift-table: the request's new tokens land
# in blocks of its own earlier tokens).
KV_WRITING = ("zero-block", "swap-block", "position", "shift-table")


def _kv_records(case_runs, kv_dir, keep: str | None) -> tuple[list[dict], tuple[float, float]]:
    """The KV digest records outside every KV-writing case's failover, plus those of case
    ``keep``'s; and keep's time window."""
    recs, torn = kv_digests.load([kv_dir])
    assert torn == 0
    windows = {c.case: (c.t0, c.t1) for c in case_runs if c.case in KV_WRITING}
    kept = [r for r in recs if not any(a <= r["t"] <= b for c, (a, b) in windows.items() if c != keep)]
    return kept, windows.get(keep, (0.0, 0.0))


def test_kv_digests_agree_at_every_takeover_without_a_kv_control(case_runs, kv_dir):
    """FRMPS_DEBUG_KV_DIGESTS: every takeover's adopted blocks hold, token for token, the KV
    that the same prefix has at the other takeovers and in every prompt served (the exact
    engine computes a token's KV from the tokens up to it alone)."""
    recs, _ = _kv_records(case_runs, kv_dir, None)
    rep = kv_digests.check(recs)
    assert {r["event"] for r in recs} == {"adopt", "prompt"}
    assert rep.compared >= 3 * 4, rep.line()  # each body's prompt blocks, at every takeover
    assert rep.ok, (rep.line(), rep.violations[:3])


@pytest.mark.parametrize("case", ["zero-block", "swap-block"])
def test_kv_digests_see_a_kv_control(case, case_runs, kv_dir):
    """The KV check's negative controls: the block a control zeroed or swapped differs from
    the KV the same prefix has at the other takeovers, and only that takeover's lines say so."""
    recs, (t0, t1) = _kv_records(case_runs, kv_dir, case)
    rep = kv_digests.check(recs)
    assert not rep.ok, f"{case}: the KV digests saw nothing: {rep.line()}"
    assert all(t0 <= d["t"] <= t1 for v in rep.violations for d in v["differing"]), rep.violations[:3]


def test_switch_refused_without_test_mode(tmp_path):
    """Without FRMPS_TEST_MODE=1 the engine refuses to start, with one clear line."""
    env = {k: v for k, v in os.environ.items() if k != "FRMPS_TEST_MODE"}
    env["FRMPS_TEST_TAKEOVER_FAULT"] = "zero-block"
    p = subprocess.run([sys.executable, "-m", "frmps_engine.cli", "serve", "--engine", "ref", "--model", "tiny",
                        "--device", "cpu", "--role", "standby", "--control-socket", str(tmp_path / "c.sock"),
                        "--generation-socket", str(tmp_path / "g.sock")],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "FRMPS_TEST_TAKEOVER_FAULT='zero-block'" in p.stderr and "FRMPS_TEST_MODE=1" in p.stderr, p.stderr[-2000:]


def test_parse():
    assert takeover_fault.parse({}) == ()
    assert takeover_fault.parse({"FRMPS_TEST_TAKEOVER_FAULT": "position, zero-block", "FRMPS_TEST_MODE": "1"}) == \
        ("position", "zero-block")
    with pytest.raises(takeover_fault.ControlError, match="FRMPS_TEST_MODE=1"):
        takeover_fault.parse({"FRMPS_TEST_TAKEOVER_FAULT": "position"})
    with pytest.raises(takeover_fault.ControlError, match="unknown case bogus"):
        takeover_fault.parse({"FRMPS_TEST_TAKEOVER_FAULT": "bogus", "FRMPS_TEST_MODE": "1"})
    assert takeover_fault.parse({"FRMPS_TEST_TAKEOVER_FAULT": "@/x", "FRMPS_TEST_MODE": "1"}) == takeover_fault.CASES
    with pytest.raises(takeover_fault.ControlError, match="FRMPS_TEST_MODE=1"):
        takeover_fault.parse({"FRMPS_TEST_TAKEOVER_FAULT": "@/x"})
    with pytest.raises(takeover_fault.ControlError, match="wants a file"):
        takeover_fault.parse({"FRMPS_TEST_TAKEOVER_FAULT": "@", "FRMPS_TEST_MODE": "1"})


def test_file_cases(tmp_path):
    """@PATH: the file's cases at each takeover; missing or empty: none; an unknown
    case applies none (logged), it does not stop the engine mid-takeover."""
    path = tmp_path / "cases"
    faults = takeover_fault.from_env(16, {"FRMPS_TEST_TAKEOVER_FAULT": f"@{path}", "FRMPS_TEST_MODE": "1"})
    assert faults is not None and faults.path == str(path) and faults.cases == takeover_fault.CASES
    assert faults.arm(object()).pending == set()
    path.write_text("")
    assert faults.arm(object()).pending == set()
    path.write_text("zero-block, position\n")
    assert faults.arm(object()).pending == {"zero-block", "position"}
    path.write_text("bogus")
    assert faults.arm(object()).pending == set()
    assert takeover_fault.from_env(16, {}) is None
