"""How the fault proofs count streams (bench.proofcount), and
bench/gpu/failover_proof.py's pass/fail: synthetic timelines, no deployment."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

import pytest

from bench import proofcount as pc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "bench", "gpu"))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "bench", "gpu", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FAULT = ("fault 1", 10.0, 10.2)  # injected at 10.0, death detected at 10.2
HANDOVER = ("fault 1 handover", 20.0, 20.5)


def cl(t0, times, t1, **kw):
    return pc.classify(t0, times, t1, [FAULT, HANDOVER], **kw)


def test_a_stream_that_ended_before_the_fault_is_not_in_flight():
    c = cl(1.0, [2.0, 5.0, 9.9], 9.95)
    assert c == {"in_flight": False, "event": None, "events": [], "phase": None}


def test_a_stream_sent_after_the_fault_is_not_in_flight():
    assert not cl(10.3, [11.0, 12.0], 12.1)["in_flight"]
    # sent during the fault's window (before the death was detected): in flight
    assert cl(10.1, [11.0, 12.0], 12.1)["in_flight"]


def test_a_stream_spanning_the_fault_is_in_flight_while_decoding():
    c = cl(9.0, [9.1, 9.5, 10.4, 11.0], 11.0)
    assert c["in_flight"] and c["event"] == "fault 1" and c["phase"] == "decoding" and c["events"] == ["fault 1"]


def test_a_stream_whose_last_token_came_before_the_fault_is_not_in_flight_even_if_its_end_came_later():
    # the final token at 9.9, the HTTP end (usage chunk, [DONE]) at 10.05: nothing was left to resume
    assert not cl(9.0, [9.1, 9.9], 10.05)["in_flight"]
    # but a stream that failed after the fault's start was in flight: its end counts
    assert cl(9.0, [9.1, 9.9], 10.05, failed=True)["in_flight"]


def test_phases_without_a_token_at_the_fault():
    long = cl(9.9, [10.6, 11.0], 11.0, prompt_tokens=1300, prefill_chunk=512)
    short = cl(9.9, [10.6, 11.0], 11.0, prompt_tokens=100, prefill_chunk=512)
    unknown = cl(9.9, [10.6, 11.0], 11.0)
    assert (long["phase"], short["phase"], unknown["phase"]) == ("mid-prefill", "waiting", "waiting/prefill")
    assert cl(9.9, [], 10.5, failed=True, prompt_tokens=2000, prefill_chunk=512)["phase"] == "mid-prefill"
    assert cl(9.0, [], 11.0, streamed=False)["phase"] == "unknown"
    # the prompt equal to the chunk fits one pass
    assert pc.phase_at([], 10.0, 512, 512) == "waiting"


def test_the_first_event_decides_the_phase_and_every_event_is_listed():
    c = cl(9.9, [10.5, 15.0, 21.0], 21.0, prompt_tokens=10, prefill_chunk=512)
    assert c["events"] == ["fault 1", "fault 1 handover"] and c["event"] == "fault 1" and c["phase"] == "waiting"
    h = cl(19.0, [19.5, 20.6], 20.7)
    assert h["event"] == "fault 1 handover" and h["phase"] == "decoding"


def test_verdicts():
    assert pc.verdict([1, 2, 3], [1, 2, 3]) == "exact"
    assert pc.verdict([1, 2, 3], [1, 2, 4]) == "inexact"
    assert pc.verdict([1, 2, 3], [1, 2]) == "inexact"
    assert pc.verdict([1, 2, 3], [1, 2, 3], error="boom") == "inexact"
    assert pc.verdict(None, [1]) == "inexact"
    assert pc.verdict([1], [1], unseeded=True) == "completed"
    assert pc.verdict(None, [9], unseeded=True) == "completed"
    assert pc.verdict(None, [9], unseeded=True, finished=False) == "failed"
    assert pc.verdict(None, [9], unseeded=True, error="x") == "failed"


def test_tally_and_headline():
    streams = [
        {"in_flight": True, "phase": "decoding", "verdict": "exact", "max_abs_dlogprob": 0.01},
        {"in_flight": True, "phase": "decoding", "verdict": "inexact", "max_abs_dlogprob": 0.3},
        {"in_flight": True, "phase": "mid-prefill", "verdict": "exact"},
        {"in_flight": True, "phase": "waiting", "verdict": "margin-bounded"},
        {"in_flight": True, "phase": "decoding", "verdict": "completed"},
        {"in_flight": False, "phase": None, "verdict": "exact"},
        {"in_flight": False, "phase": None, "verdict": "exact"},
    ]
    t = pc.tally(streams)
    assert t["in_flight"] == {"streams": 4, "exact": 2, "margin-bounded": 1, "inexact": 1, "completed": 1, "failed": 0}
    assert t["not_in_flight"] == 2 and t["by_phase"]["decoding"]["streams"] == 2
    assert t["max_abs_dlogprob"] == 0.3
    assert pc.headline(t) == (
        "2/4 streams in flight at a fault or handover exact (1 margin-bounded, 1 inexact); 1 completed unseeded; "
        "plus 2 not in flight | by phase: decoding 1/2 exact +1 unseeded completed, mid-prefill 1/1 exact, "
        "waiting 0/1 exact | max |Δlogprob| 0.3")
    assert pc.headline(pc.tally([])) == ("0/0 streams in flight at a fault or handover exact (0 margin-bounded, "
                                         "0 inexact); 0 completed unseeded; plus 0 not in flight")
    bad = pc.tally([{"in_flight": False, "verdict": "inexact"}, {"in_flight": True, "phase": "waiting", "verdict": "failed"}])
    assert "(1 unseeded failed)" in pc.headline(bad) and "(1 of them not exact)" in pc.headline(bad)


def test_max_abs_dlogprob():
    assert pc.max_abs_dlogprob([-1.0, -2.0, None], [-1.5, -2.0, -3.0]) == 0.5
    assert pc.max_abs_dlogprob(None, [-1.0]) is None


def test_controls_stop_when_one_passes_unnoticed():
    exact = [{"in_flight": True, "phase": "decoding", "verdict": "exact"}]
    seen = [{"in_flight": True, "phase": "decoding", "verdict": "inexact"}, {"in_flight": False, "verdict": "exact"}]
    a = pc.control_result("zero-block", seen, True)
    assert a["detected"] and a["streams_affected"] == 1 and a["streams_in_flight"] == 1
    b = pc.control_result("position", exact, True)
    assert not b["detected"] and b["streams_affected"] == 0
    # an inexact stream that was not in flight does not count as detection
    assert not pc.control_result("position", [{"in_flight": False, "verdict": "inexact"}] + exact, True)["detected"]
    assert pc.control_result("shift-table", exact, False)["detected"]  # the failover itself failed
    pc.check_controls([a])
    with pytest.raises(pc.ControlPassedUnnoticed, match="control position passed unnoticed"):
        pc.check_controls([a, b])


def test_controls_arg_and_env():
    assert pc.controls_arg("on") == [pc.POSITIVE, *pc.CONTROL_CASES] and pc.controls_arg("off") == []
    assert pc.control_env(pc.POSITIVE) == {}
    assert pc.controls_arg("zero-block,position") == ["zero-block", "position"]
    with pytest.raises(ValueError):
        pc.controls_arg("zero-blok")
    assert pc.control_env("sampler-offset") == {"FRMPS_TEST_MODE": "1", "FRMPS_TEST_TAKEOVER_FAULT": "sampler-offset"}
    assert set(pc.CONTROL_CASES) == {"zero-block", "swap-block", "shift-table", "position", "sampler-offset"}


# ----------------------------------------------------------------------------- failover_proof.py's exit status


def _phase(text_equal=4, ids_equal=4, errors=0, ok=True, inexact=0):
    return {"record": {"ok": ok}, "exact": {"requests": 4, "text_equal": text_equal, "errors": errors},
            "exact_ids": {"requests": 4, "ids_equal": ids_equal, "missing": 0},
            "stream_count": {"in_flight": {"inexact": inexact}, "not_in_flight_not_exact": 0}}


def test_failover_proof_fails_when_its_comparison_fails():
    fo = _load("failover_proof")
    good = {"fault": "x", "first": _phase(), "second": _phase()}
    assert fo.entry_ok(good)
    # each of these passed the old entry_ok (and the old main exited 0 whatever it compared)
    bad = [{"fault": "x", "first": _phase(), "second": p} for p in (_phase(text_equal=3), _phase(ids_equal=2),
                                                                    _phase(inexact=1))]
    assert [fo.entry_ok(e) for e in bad] == [False, False, False]
    assert fo.exit_code({"faults": [good]}) == 0
    for e in bad:
        assert fo.exit_code({"faults": [good, e]}) == 1
    assert not fo.entry_ok({"fault": "x", "first": _phase(errors=1)})
    assert not fo.entry_ok({"fault": "x", "first": _phase(ok=False)})
    assert not fo.entry_ok({"fault": "x", "first": {"record": {"ok": True}}})  # nothing compared
    assert not fo.entry_ok({"fault": "x", "error": "boom"})
    assert not fo.entry_ok({"fault": "x", "first": _phase(), "nofault_exact_ids": {"requests": 4, "ids_equal": 3}})
    assert fo.exit_code({"faults": [{"fault": "x", "skipped": "time budget"}]}) == 1  # no fault ran
    assert fo.exit_code({"faults": [good, {"fault": "y", "skipped": "time budget"}]}) == 0


def test_proof_table_shows_the_in_flight_count_and_the_controls(tmp_path, capsys):
    pt = _load("proof_table")
    t = pc.tally([{"in_flight": True, "phase": "decoding", "verdict": "exact"},
                  {"in_flight": True, "phase": "waiting", "verdict": "inexact"},
                  {"in_flight": False, "verdict": "exact"}])
    assert pt.in_flight(t) == "1/2, 1 not in flight"
    fo = {"model": "m", "faults": [{"fault": "misaligned:load", "first": {**_phase(), "stream_count": t}}],
          "headline": pc.headline(t)}
    fb = {"model": "m", "faults": [], "headline": "h", "controls_mode": "zero-block,position",
          "controls": [pc.control_result("zero-block", [{"in_flight": True, "verdict": "inexact"}], True),
                       pc.control_result("position", [{"in_flight": True, "verdict": "exact"}], True)]}
    off = {"model": "m", "faults": [], "headline": "h2", "controls_mode": "off", "controls": []}
    paths = []
    for name, d in (("fo", fo), ("fb", fb), ("off", off)):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(d))
        paths.append(str(p))
    pt.main(paths)
    out = capsys.readouterr().out
    assert "| 1/2, 1 not in flight |" in out
    assert "zero-block detected (1/1 in flight affected), position **NOT detected** (0/1 in flight affected)" in out
    assert "h2; controls: **OFF**" in out


def test_chaos_soak_counts_only_the_requests_in_flight_at_a_kill():
    from bench import chaos

    reqs = chaos.workload(4, streaming="all")
    ref = {i: chaos.Outcome(i, 0.0, ok=True, token_ids=[1, 2, 3], text="abc", finish="length") for i in range(4)}

    def out(i, t0, t1, ids=(1, 2, 3), ok=True, text="abc"):
        return chaos.Outcome(i, t0, t1, ok=ok, token_ids=list(ids), text=text, finish="length", token_times=[t0 + 0.1, t1])

    kills = [(10.0, 10.3)]
    t = chaos.count([out(0, 1.0, 2.0), out(1, 9.0, 12.0), out(2, 9.0, 12.0, ids=(1, 2, 4)), out(3, 11.0, 12.0)],
                    reqs, ref, kills)
    assert t["in_flight"]["streams"] == 2 and t["in_flight"]["exact"] == 1 and t["in_flight"]["inexact"] == 1
    assert t["not_in_flight"] == 2 and t["by_phase"]["decoding"]["streams"] == 2
    # equal token ids with another text is not exact
    t = chaos.count([out(1, 9.0, 12.0, text="abd")], reqs, ref, kills)
    assert t["in_flight"]["inexact"] == 1


def test_failback_proof_fails_when_a_stream_in_flight_is_not_exact():
    fb = _load("failback_proof")
    ok = {"stream_count": pc.tally([{"in_flight": True, "phase": "decoding", "verdict": "exact"},
                                    {"in_flight": False, "verdict": "exact"}])}
    assert fb.proof_status(ok) == 0
    for bad in ({"in_flight": True, "phase": "decoding", "verdict": "inexact"},
                {"in_flight": True, "phase": "decoding", "verdict": "failed"},
                {"in_flight": False, "verdict": "inexact"}):
        assert fb.proof_status({"stream_count": pc.tally([{"in_flight": True, "verdict": "exact"}, bad])}) == 1
    assert fb.proof_status({**ok, "error": "boom"}) == 1
    # margin-bounded streams are reported, not failed (bench/README.md: what exact means)
    mb = {"stream_count": pc.tally([{"in_flight": True, "phase": "decoding", "verdict": "margin-bounded"}])}
    assert fb.proof_status(mb) == 0


def test_controls_are_void_when_the_positive_run_is_not_exact():
    """What the H200 showed with vLLM on a context-sensitive checkpoint: every control
    'detected', because the run without a control differed from its reference too."""
    def rec(case, verdicts_in, verdicts_out=()):
        streams = ([{"in_flight": True, "phase": "decoding", "verdict": v} for v in verdicts_in]
                   + [{"in_flight": False, "verdict": v} for v in verdicts_out])
        return pc.control_result(case, streams, True)

    detected = [rec(c, ["inexact", "exact"]) for c in pc.CONTROL_CASES]
    pc.check_controls([rec(pc.POSITIVE, ["exact", "exact"], ["exact"]), *detected])  # clean: passes
    for bad in (rec(pc.POSITIVE, ["inexact", "exact"]), rec(pc.POSITIVE, ["exact"], ["inexact"])):
        with pytest.raises(pc.ControlPassedUnnoticed, match="positive run"):
            pc.check_controls([bad, *detected])
    with pytest.raises(pc.ControlPassedUnnoticed, match="control position passed unnoticed"):
        pc.check_controls([rec(pc.POSITIVE, ["exact"]), *detected[:3], rec("position", ["exact"]), detected[4]])


def test_the_proofs_start_frmps_serve_as_the_readme_shows_it():
    """--quick-start is `frmps serve --model M` and nothing else that changes how it
    serves; --exact adds the README's --exact, with or without it."""
    import types

    fo = _load("failover_proof")
    base = dict(frmps="bin/frmps", python="python3", model="M", device="cuda", memory="cuda-vmm", cpu=False,
                sync_every=1, num_blocks=0, max_model_len=0, engine_arg=["--max-num-batched-tokens=512"],
                engine="vllm", serve_arg=[])
    qs = fo.serve_opts(types.SimpleNamespace(**base, quick_start=True)).command(8000, "127.0.0.1:1", "/r", "/l")
    assert qs[:4] == ["bin/frmps", "serve", "--model", "M"]
    tuned = {"--engine", "--device", "--memory", "--sync-every", "--num-blocks", "--python", "--exact"}
    assert not tuned & set(qs) and not any(a.startswith("--engine-arg") for a in qs)
    qx = fo.serve_opts(types.SimpleNamespace(**base, quick_start=True, exact=True)).command(8000, "a:1", "/r")
    assert qx.count("--exact") == 1 and not tuned - {"--exact"} & set(qx)
    full = fo.serve_opts(types.SimpleNamespace(**base, exact=True)).command(8000, "a:1", "/r")
    assert full.count("--exact") == 1 and "--engine-arg=--max-num-batched-tokens=512" in full
    assert "--exact" not in fo.serve_opts(types.SimpleNamespace(**base)).command(8000, "a:1", "/r")


def test_a_control_never_applied_is_told_from_one_that_passed_unnoticed():
    from bench import exactness
    from frmps_engine.sdk import takeover_fault as tf

    log = "\n".join([
        "x " + tf.applied_line("zero-block", 3, 40, "KV block 7 (its first) zeroed"),
        "y " + tf.applied_line("zero-block", 5, 41, "KV block 9 (its first) zeroed"),
        "z " + tf.not_applied_line("sampler-offset", "no adopted sampled (temperature > 0) request with KV blocks"),
    ])
    seen = exactness.control_lines(log)
    assert seen["zero-block"] == {"applied": 2, "not_applied": []}
    assert seen["sampler-offset"] == {"applied": 0, "not_applied": [
        "no adopted sampled (temperature > 0) request with KV blocks"]}
    assert "position" not in seen
    base = {"case": "sampler-offset", "detected": False, "how": None}
    with pytest.raises(pc.ControlPassedUnnoticed, match=r"sampler-offset was never applied \(no adopted sampled"):
        pc.check_controls([{**base, "applied": 0, "not_applied": seen["sampler-offset"]["not_applied"]}])
    with pytest.raises(pc.ControlPassedUnnoticed, match=r"passed unnoticed \(applied 1 time"):
        pc.check_controls([{**base, "applied": 1, "not_applied": []}])
    with pytest.raises(pc.ControlPassedUnnoticed, match=r"sampler-offset passed unnoticed$"):
        pc.check_controls([base])  # no log read
    pc.check_controls([{**base, "detected": True, "applied": 1}])


def test_the_gpu_proofs_turn_sigterm_into_an_error_that_keeps_the_count():
    """A session's time bound sends SIGTERM: a proof must stop as on an error (its
    finally counts the streams and writes the report), not die with nothing counted."""
    import inspect
    import signal

    fo = _load("failover_proof")
    for name in ("failover_proof", "failback_proof", "tp_proof", "openai_fault_proof"):
        main = inspect.getsource(_load(name).main)
        assert "stop_on_sigterm()" in main.split("\n", 2)[1], name  # first thing main does
    old = signal.getsignal(signal.SIGTERM)
    try:
        fo.stop_on_sigterm()
        with pytest.raises(fo.Terminated, match="SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode; this is not reached
    finally:
        signal.signal(signal.SIGTERM, old)


def test_a_control_runs_again_only_where_it_found_no_request():
    why = ["no adopted greedy request with two or more tokens past its computed count"]
    assert pc.control_unapplied("position", None, 0, why)
    assert not pc.control_unapplied("position", None, 1, why)  # applied: its verdict stands
    assert not pc.control_unapplied("position", "RuntimeError: x", 0, why)  # failed: the deployment stops
    assert not pc.control_unapplied(pc.POSITIVE, None, None, why)
    assert not pc.control_unapplied("position", None, 0, [])  # the logs said nothing: another run would not tell
    assert pc.control_sync_every(1) == pc.control_sync_every(None) == 16 and pc.control_sync_every(32) == 32


def test_a_failed_run_detects_a_control_only_where_the_engines_applied_it():
    err = "Terminated: stopped by SIGTERM (the caller's time bound)"
    r = pc.control_result("zero-block", [], None, err)
    assert r["detected"]  # the record alone counts any failed run as a detection (a broken takeover may crash)...
    why = pc.control_not_run("zero-block", err, 0)  # ...which says nothing where the case was applied nowhere
    assert why and err in why
    assert pc.control_not_run("zero-block", err, None)  # the logs not read: not a detection either
    assert pc.control_not_run("zero-block", err, 2) is None  # applied, then the run failed: detected
    assert pc.control_not_run("zero-block", None, 0) is None  # no failure: control_unapplied's concern
    assert pc.control_not_run(pc.POSITIVE, err, None) is None  # the positive run failing stops the proof itself


def test_failback_proof_lists_every_inexact_stream_in_flight_before_the_others():
    """The report's streams_inexact: all the headline's streams (in flight at an event, not
    exact), with their times, ahead of at most ten others, however many of those came first
    (a GPU run's report had shown ten not in flight and hidden five in flight)."""
    fb = _load("failback_proof")
    events = [("fault 1", 100.0, 100.5)]

    def rec(i, t0, t1, exact):
        return {"i": i, "burst": False, "t0": t0, "t1": t1, "times": [t0 + 0.1, t1], "error": None,
                "exact": exact, "verdict": "exact" if exact else "inexact", "tokens": 8, "finish": "length",
                **({} if exact else {"first_diff": 0})}

    done = [rec(0, 10.0 + k, 11.0 + k, False) for k in range(12)] + [rec(1, 99.0, 102.0, False), rec(2, 99.0, 101.0, True)]
    report: dict = {}
    fb.stream_report(report, done, events, [], None)
    listed = report["streams_inexact"]
    assert [(s["i"], s["event"]) for s in listed[:1]] == [(1, "fault 1")] and listed[0]["t0"] == 99.0
    assert len(listed) == 1 + 10 and all(not s["event"] for s in listed[1:])
    assert report["stream_count"]["in_flight"]["inexact"] == 1
