"""bench/gpu/autotune_probe.py's verdict on synthetic process records (its processes need a GPU)."""

from __future__ import annotations

from test_proofcount import _load  # bench/gpu's scripts, loaded by path

ap = _load("autotune_probe")
TIMED = [{"kernel": "triton_red_fused_add_mean_0", "candidates": 4, "chosen": 1, "config": "XBLOCK: 1"}]


def rec(force, det, hashes, timed=()):
    return {"force": force, "deterministic": det, "hashes": hashes, "timed": list(timed)}


def test_deterministic_processes_agreeing_and_timed_ones_differing():
    runs = [rec(0, False, {"5120x1": "a"}, TIMED), rec(1, False, {"5120x1": "b"}, TIMED), rec(-1, False, {"5120x1": "a"}, TIMED),
            rec(0, True, {"5120x1": "c"}), rec(1, True, {"5120x1": "c"}), rec(-1, True, {"5120x1": "c"})]
    s = ap.summarise(runs)
    assert s["timed_forced_distinct_outputs"] == 2 and s["timed_distinct_outputs"] == 2
    assert s["deterministic_distinct_outputs"] == 1 and s["timed_kernels_in_timed_processes"] == 1
    assert s["timed_kernels_in_deterministic_processes"] == 0 and s["failed"] == 0


def test_a_deterministic_process_that_differs_is_counted():
    # the negative control of the check: one deterministic process's one output differs
    runs = [rec(0, True, {"5120x1": "c", "896x7": "d"}), rec(1, True, {"5120x1": "c", "896x7": "e"})]
    assert ap.summarise(runs)["deterministic_distinct_outputs"] == 2


def test_failed_processes_are_counted_not_compared():
    runs = [rec(0, True, {"5120x1": "c"}), {"force": 1, "deterministic": True, "error": "no GPU"}]
    s = ap.summarise(runs)
    assert s["failed"] == 1 and s["deterministic_processes"] == 1 and s["deterministic_distinct_outputs"] == 1
