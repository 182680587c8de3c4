"""bench/exactness.py: what "exact" means, as code, and the negative-control driver."""

from __future__ import annotations

import pytest

from bench import exactness as ex


def test_compare_kinds():
    assert ex.compare([1, 2, 3], [1, 2, 3]).kind == ex.EXACT
    v = ex.compare([1, 2, 3], [1, 5, 3], [2.0, 0.01, 1.0], margin_bound=0.05)
    assert (v.kind, v.first_divergence, v.margin) == (ex.MARGIN_BOUNDED, 1, 0.01)
    assert v.ok and "0.01" in v.detail
    v = ex.compare([1, 2, 3], [1, 5, 3], [2.0, 0.5, 1.0], margin_bound=0.05)
    assert (v.kind, v.first_divergence) == (ex.INEXACT, 1) and not v.ok
    assert ex.compare([1, 2, 3], [1, 5, 3]).kind == ex.INEXACT, "no margins known: never excused"
    assert ex.compare([1, 2, 3], [1, 2]).kind == ex.INEXACT, "a lost token"
    assert ex.compare([1, 2], [1, 2, 3], [0.0, 0.0, 0.0], margin_bound=1.0).kind == ex.INEXACT, \
        "an extra token is not a near tie"
    assert ex.compare([1, 2], [9, 9, 9], deterministic=False).kind == ex.COMPLETED
    assert ex.compare([1, 2], [], deterministic=False).kind == ex.INEXACT
    with pytest.raises(ValueError):
        ex.compare([1], [1], margin_bound=-1)


def test_top2_margin():
    assert ex.top2_margin({"a": -0.1, "b": -2.1, "c": -5.0}) == pytest.approx(2.0)
    assert ex.top2_margin([-3.0, -1.0]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="at least two"):
        ex.top2_margin([-1.0])


def test_margin_bound_from_runs():
    alone = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    margins = [[1.0, 0.02, 1.0, 1.0], [1.0, 1.0, 0.003], [1.0, 1.0]]
    batched = [[1, 9, 9, 9], [5, 6, 1], [8, 9]]
    bound, seen = ex.margin_bound_from_runs(alone, margins, batched, safety=2.0)
    assert bound == pytest.approx(0.04)
    assert [(d.index, d.position) for d in seen] == [(0, 1), (1, 2)]
    assert ex.margin_bound_from_runs([[1, 2]], [[1.0, 1.0]], [[1, 2]])[0] == 0.0, "never disagree: excuse nothing"
    with pytest.raises(ValueError, match="no margin"):
        ex.margin_bound_from_runs([[1, 2]], [[1.0]], [[1, 3]])


def _run(observed, log_text):
    return ex.ControlRun(reference={1: [1, 2, 3], 2: [4, 5, 6]}, observed=observed, log_text=log_text)


def _line(case, key):
    return f"WARNING x: takeover fault control {case} applied to request {key} (prompt of 9 tokens): ...\n"


def test_run_controls_passes_when_every_control_is_caught():
    def run_case(case):
        if case is None:
            return _run({1: [1, 2, 3], 2: [4, 5, 6]}, "")
        return _run({1: [1, 2, 9], 2: [4, 5, 6]}, _line(case, 1))

    out = ex.run_controls(run_case, ("zero-block", "position"), say=lambda s: None)
    assert [r.detected for r in out[1:]] == [True, True]
    assert ex.applied_prompt_lengths(_line("zero-block", 3)) == [("zero-block", 9)]


def test_run_controls_raises_when_a_control_passes_unnoticed():
    def run_case(case):
        if case == "swap-block":  # applied, but the request it hit is still exact
            return _run({1: [1, 2, 3], 2: [4, 5, 9]}, _line(case, 1))
        if case == "position":  # never applied
            return _run({1: [1, 2, 3], 2: [4, 5, 6]}, "takeover fault control position NOT applied: ...")
        if case is None:
            return _run({1: [1, 2, 3], 2: [4, 5, 6]}, "")
        return _run({1: [1, 2, 9], 2: [4, 5, 6]}, _line(case, 1))

    with pytest.raises(ex.ControlsError) as e:
        ex.run_controls(run_case, ("zero-block", "swap-block", "position"), say=lambda s: None)
    msg = str(e.value)
    assert "swap-block passed unnoticed" in msg and "position: not applied" in msg and "zero-block" not in msg


def test_run_controls_raises_when_the_positive_run_is_not_exact():
    def run_case(case):
        return _run({1: [1, 2, 9], 2: [4, 5, 6]}, "" if case is None else _line(case, 1))

    with pytest.raises(ex.ControlsError, match="positive run"):
        ex.run_controls(run_case, ("zero-block",), say=lambda s: None)
