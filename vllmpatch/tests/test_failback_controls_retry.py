"""bench/gpu/failback_proof.py control_cycles: a control case that found no adopted
request it fits runs again across the next fault, up to --control-attempts, and
stops once applied. The deployment, its load and its faults are test doubles
(labelled below); the real sequence runs on the GPU and in `failback_proof.py --cpu`."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from test_proofcount import _load  # bench/gpu's scripts, loaded by path

fp = _load("failback_proof")


def run(tmp_path, monkeypatch, applied_per_cycle: dict[str, list[int]], attempts: int, fail: tuple[str, ...] = ()):
    """control_cycles over test doubles: the engines' logs say each case applied
    applied_per_cycle[case][i] times in its i-th cycle; every stream exact; the
    cycle of a case in fail raises after that (its run failed)."""
    cycles: list[tuple[str, int]] = []  # (case written to the switch file, failbacks so far) per cycle
    leads: list[float] = []  # the seconds each cycle's fault waited after the last request sent
    loads: list[tuple[str, int, int]] = []  # (case, requests, looping streams) per cycle
    seen: dict[str, dict] = {}
    switch = tmp_path / "controls" / "cases"

    class FakeDeployment:  # test double: no frmps serve
        def __init__(self, args, name, workdir):
            self.base, self.log_dir = "http://127.0.0.1:0", str(tmp_path)

        def start(self):
            pass

        def wait(self, *a, **kw):
            return {}, None

        def stop(self):
            pass

    class FakeLoad:  # test double: no HTTP streams
        def __init__(self, dep, model, reqs, ref, n_loop):
            self.done = []
            loads.append((switch.read_text(), len(reqs), n_loop))

        def start(self):
            pass

        def finish(self, timeout):
            pass

    def fake_cycle(dep, cargs, load, step, rec, n_fb, last, trigger, lead=0.0):  # test double: no fault
        case = switch.read_text()
        cycles.append((case, n_fb))
        leads.append(lead)
        counts = applied_per_cycle.get(case) or []
        k = sum(1 for c, _ in cycles if c == case) - 1
        s = seen.setdefault(case, {"applied": 0, "not_applied": []})
        if k < len(counts) and counts[k]:
            s["applied"] += counts[k]
        else:
            s["not_applied"] = [*s["not_applied"], "no adopted request fits"]
        rec["failover"] = {"ok": True}
        if case in fail:
            raise RuntimeError("the deployment stopped answering")

    monkeypatch.setattr(fp, "Deployment", FakeDeployment)
    monkeypatch.setattr(fp, "Load", FakeLoad)
    monkeypatch.setattr(fp, "cycle", fake_cycle)
    monkeypatch.setattr(fp, "started", lambda dep, s: True)
    monkeypatch.setattr(fp, "wait_endpoint", lambda base, t: None)
    monkeypatch.setattr(fp, "no_fault_run",
                        lambda dep, model, reqs: ({}, {"errors": [], "prompt_tokens": [], "decode_step_s_p50": 0.004}))
    monkeypatch.setattr(fp, "mps_trigger", lambda cargs, spec: None)
    monkeypatch.setattr(fp, "count_streams", lambda *a, **kw: ([], None))
    monkeypatch.setattr(fp, "exactness", SimpleNamespace(engine_logs=lambda d: "",
                                                         control_lines=lambda text: {c: dict(v) for c, v in seen.items()}))
    ap = argparse.ArgumentParser()
    fp.add_count_args(ap)
    args = ap.parse_args(["--control-attempts", str(attempts)])
    args.workdir, args.model, args.sync_every, args.env = str(tmp_path), "m", 1, {}
    out = fp.control_cycles(args, ["positive", "position", "zero-block"], "misaligned")
    run.leads, run.loads = leads, loads
    return out, cycles


def test_a_case_never_applied_runs_again_until_applied(tmp_path, monkeypatch):
    out, cycles = run(tmp_path, monkeypatch, {"position": [0, 0, 1], "zero-block": [2]}, attempts=3)
    assert [c for c, _ in cycles] == ["", "position", "position", "position", "zero-block"]
    assert [n for _, n in cycles] == [0, 1, 2, 3, 4]  # one failback per cycle
    pos = next(r for r in out if r["case"] == "position")
    assert pos["applied"] == 1 and pos["attempts"] == 3 and len(pos["earlier_attempts"]) == 2
    assert [r["case"] for r in out] == ["positive", "position", "zero-block"]
    # the position case's fault waits half a sync interval (16 steps in the controls' deployment) after the
    # last request sent; the other cases' faults do not wait
    assert run.leads == [0.0, 8 * 0.004, 8 * 0.004, 8 * 0.004, 0.0]
    # and sends no burst: its requests are the looping streams alone
    assert run.loads == [("", 6, 4)] + [("position", 4, 4)] * 3 + [("zero-block", 6, 4)]


def test_a_case_never_applied_after_every_attempt_stays_never_applied(tmp_path, monkeypatch):
    out, cycles = run(tmp_path, monkeypatch, {"zero-block": [1]}, attempts=2)
    assert [c for c, _ in cycles] == ["", "position", "position", "zero-block"]
    pos = next(r for r in out if r["case"] == "position")
    assert pos["applied"] == 0 and pos["attempts"] == 2 and pos["not_applied"] == ["no adopted request fits"]
    with pytest.raises(fp.proofcount.ControlPassedUnnoticed, match="position was never applied"):
        fp.proofcount.check_controls(out)


def test_one_attempt_is_the_old_behaviour(tmp_path, monkeypatch):
    out, cycles = run(tmp_path, monkeypatch, {"zero-block": [1]}, attempts=1)
    assert [c for c, _ in cycles] == ["", "position", "zero-block"]


def test_a_run_that_failed_before_the_case_was_applied_is_not_a_detection(tmp_path, monkeypatch):
    out, cycles = run(tmp_path, monkeypatch, {}, attempts=3, fail=("position",))
    assert [c for c, _ in cycles] == ["", "position"]  # a failed run is not tried again; the deployment stops
    pos = next(r for r in out if r["case"] == "position")
    assert not pos["detected"] and "applied" in pos["not_run"] and "stopped answering" in pos["not_run"]
    zb = next(r for r in out if r["case"] == "zero-block")
    assert zb["not_run"] and not zb["detected"]


def test_a_run_that_failed_after_the_case_was_applied_is_a_detection(tmp_path, monkeypatch):
    out, cycles = run(tmp_path, monkeypatch, {"position": [1]}, attempts=3, fail=("position",))
    pos = next(r for r in out if r["case"] == "position")
    assert pos["detected"] and not pos.get("not_run") and pos["applied"] == 1
