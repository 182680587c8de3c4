"""bench/gpu/openai_fault_proof.py's judgement: how a result is normalised from
the server's chunks, what counts as the same result, what is not judged."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "bench", "gpu"))
_spec = importlib.util.spec_from_file_location("openai_fault_proof", os.path.join(REPO, "bench", "gpu", "openai_fault_proof.py"))
proof = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(proof)

from bench import proofcount  # noqa: E402
from e2e import require  # noqa: E402  (vllmpatch/tests)


def chat_case(**kw):
    return {"id": "c", "api": "chat", "stream": True, "body": {}, **kw}


def feed(case, chunks):
    c = proof.Call("http://x", "k", "m", case)
    for ch in chunks:
        c.take(ch)
    return c.result()


def chat_chunk(i, content=None, tool=None, lp=None, finish=None):
    delta = {"content": content}
    if tool:
        delta["tool_calls"] = [tool]
    return {"choices": [{"index": i, "delta": delta, "finish_reason": finish,
                         "logprobs": {"content": lp} if lp else None}]}


def test_streamed_chat_chunks_assemble_per_choice_with_tool_call_deltas_and_logprobs():
    tc1 = {"index": 0, "function": {"name": "get_weather", "arguments": '{"city": '}}
    tc2 = {"index": 0, "function": {"arguments": '"Paris"}'}}
    lp = [{"token": "a", "logprob": -1.0, "top_logprobs": [{"token": "a"}, {"token": "b"}]}]
    r = feed(chat_case(parse="tools"), [chat_chunk(0, tool=tc1), chat_chunk(1, "x", lp=lp), chat_chunk(0, tool=tc2, finish="tool_calls"),
                                         chat_chunk(1, "y", finish="length"), {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}])
    assert r["choices"]["0"]["tools"] == {0: {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert r["choices"]["0"]["finish"] == "tool_calls"
    assert r["choices"]["1"]["text"] == "xy" and r["choices"]["1"]["lp_tokens"] == ["a"]
    assert r["choices"]["1"]["top"] == [["a", "b"]]
    assert r["usage"] == {"prompt_tokens": 3, "completion_tokens": 4}
    assert proof.parsed(chat_case(parse="tools"), r) == [{"name": "get_weather", "arguments": {"city": "Paris"}}]


def test_no_tool_call_is_not_a_parsed_result():
    r = feed(chat_case(parse="tools"), [chat_chunk(0, "<tool_call>{ \n", finish="length")])
    assert proof.parsed(chat_case(parse="tools"), r) is None
    v = proof.compare(chat_case(parse="tools"), r, r)
    assert v["exact"] and v["parsed"] is False and v["parsed_equal"] is False


def test_completion_chunks_keep_text_token_ids_and_logprobs():
    case = {"id": "p", "api": "cmpl", "stream": True, "body": {}}
    ch = lambda i, t, ids, fin=None: {"choices": [{"index": i, "text": t, "token_ids": ids, "finish_reason": fin,  # noqa: E731
                                                    "logprobs": {"tokens": [t], "token_logprobs": [-0.5],
                                                                 "top_logprobs": [{t: -0.5, "z": -2}]}}]}
    r = feed(case, [ch(0, "a", [1]), ch(1, "b", [2]), ch(0, "c", [3], "length")])
    assert r["choices"]["0"]["text"] == "ac" and r["choices"]["0"]["token_ids"] == [1, 3]
    assert r["choices"]["0"]["top"] == [["a", "z"], ["c", "z"]]
    assert r["choices"]["1"]["finish"] is None


def test_compare_finds_the_first_difference_and_reports_logprob_drift():
    case = {"id": "p", "api": "cmpl", "stream": True, "body": {}}
    base = {"text": "abc", "token_ids": [1, 2, 3], "finish": "length", "lp_tokens": [], "lp_values": [-1.0], "top": [],
            "tools": {}}
    ref = {"choices": {"0": dict(base)}, "usage": None, "error": None}
    same = {"choices": {"0": dict(base, lp_values=[-1.01])}, "usage": None, "error": None}
    v = proof.compare(case, ref, same)
    assert v["exact"] and v["max_logprob_diff"] == 0.01
    other = {"choices": {"0": dict(base, token_ids=[1, 9, 3])}, "usage": None, "error": None}
    v = proof.compare(case, ref, other)
    assert not v["exact"] and "token_ids: first difference at 1" in v["diffs"][0]
    missing = {"choices": {}, "usage": None, "error": None}
    assert not proof.compare(case, ref, missing)["exact"]
    err = {"choices": {}, "usage": None, "error": "APIError: boom"}
    assert proof.compare(case, ref, err)["diffs"] == ["error: APIError: boom"]


def test_fields_that_differ_without_a_fault_are_reported_not_judged():
    case = chat_case()
    a = {"choices": {"0": {"text": "xy", "lp_tokens": ["x", "", "y"], "finish": "length"}}, "usage": None, "error": None}
    b = {"choices": {"0": {"text": "xy", "lp_tokens": ["x", "y"], "finish": "length"}}, "usage": None, "error": None}
    skip = proof.unstable_fields(a, b)
    assert skip == ["lp_tokens"]
    v = proof.compare(case, a, b, skip)
    assert v["exact"] and v["not_judged"] == ["lp_tokens"]
    c = {"choices": {"0": {"text": "xz", "lp_tokens": ["x", "y"], "finish": "length"}}, "usage": None, "error": None}
    assert not proof.compare(case, a, c, skip)["exact"]  # the text is still judged


def test_unseeded_cases_are_completed_never_exact():
    case = {"id": "u", "api": "cmpl", "stream": True, "unseeded": True, "body": {}}
    ref = {"choices": {"0": {"finish": "length"}, "1": {"finish": "length"}}, "usage": None, "error": None}
    done = proof.compare(case, ref, {"choices": {"0": {"finish": "length"}, "1": {"finish": "length", "text": "other"}},
                                     "usage": None, "error": None})
    assert done["verdict"] == "completed" and not done["exact"]
    # even a run equal to the reference is only completed: there is nothing to compare an unseeded sample with
    assert proof.compare(case, ref, ref)["verdict"] == "completed" and not proof.compare(case, ref, ref)["exact"]
    v = proof.compare(case, ref, {"choices": {"0": {"finish": "length"}, "1": {"finish": None}}, "usage": None, "error": None})
    assert v["verdict"] == "failed" and not v["exact"]
    assert proof.compare(case, ref, {"choices": {}, "usage": None, "error": "APIError: x"})["verdict"] == "failed"
    # counted apart in the headline, and a completed unseeded case does not fail the proof
    rep = {"faults": [{"cases": {"u": dict(done, in_flight_at_fault=True, phase="decoding"),
                                 "s": {"exact": True, "verdict": "exact", "in_flight_at_fault": True, "phase": "decoding"}}}]}
    assert proof.passed(rep)
    t = proofcount.tally([{"in_flight": v["in_flight_at_fault"], **v} for v in rep["faults"][0]["cases"].values()])
    assert proofcount.headline(t).startswith("1/1 streams in flight at a fault or handover exact (0 margin-bounded, "
                                             "0 inexact); 1 completed unseeded; plus 0 not in flight")
    rep["faults"][0]["cases"]["u"]["verdict"] = "failed"
    assert not proof.passed(rep)
    rep["faults"][0]["cases"]["u"]["verdict"] = "completed"
    rep["failed_without_fault"] = {"x": "APIError: Internal server error"}  # left out of the comparison: still a failure
    assert not proof.passed(rep)


def test_every_case_is_long_and_the_cpu_check_leaves_out_what_needs_real_logits():
    cs = proof.cases(600)
    assert len({c["id"] for c in cs}) == len(cs)
    for c in cs:
        b = c["body"]
        assert b.get("max_tokens", b.get("max_completion_tokens", b.get("max_output_tokens"))) == 600, c["id"]
    real = {c["id"] for c in cs if c.get("real_model")}
    assert {"chat-json-schema", "chat-tools-named", "cmpl-n2-logprobs"} <= real
    assert "cmpl-greedy-stream" not in real


def test_table_marks_differences_and_cases_not_in_flight():
    rep = {"cases": [{"id": "a"}, {"id": "b"}],
           "faults": [{"n": 1, "fault": "misaligned:load", "cases": {
               "a": {"exact": True, "in_flight_at_fault": True, "max_logprob_diff": 0.0},
               "b": {"exact": False, "in_flight_at_fault": False, "not_judged": ["top"]}}}]}
    t = proof.table(rep)
    assert "| a | exact |" in t and "**differs** (not in flight)" in t and "not judged: top" in t


def test_stop_is_taken_past_the_middle_at_its_first_occurrence():
    # ids: 7 occurs before the middle, so the first new id past it is 9.
    assert proof.stop_after_middle([1, 7, 2, 3, 7, 9, 9, 4], 1) == 9
    assert proof.stop_after_middle([1, 1, 1, 1], 1) is None  # nothing new past the middle
    assert proof.stop_after_middle([], 1) is None
    # text: 4 characters first seen past the middle, not blank.
    text = "abcdabcd    wxyz"
    got = proof.stop_after_middle(text, 4)
    assert got == "   w" and text.index(got) >= len(text) // 2
    assert proof.stop_after_middle("abababab", 4) is None


def test_a_tie_in_the_top_logprobs_is_reported_not_a_difference():
    case = {"id": "p", "api": "cmpl", "stream": False, "body": {}}
    ch = lambda top: {"choices": [{"index": 0, "text": "a", "token_ids": [1], "finish_reason": "length",  # noqa: E731
                                   "logprobs": {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [top]}}]}
    ref = feed(case, [ch({"a": -0.5, "x": -2.0})])
    assert ref["choices"]["0"]["top"] == [["a", "x"]] and ref["choices"]["0"]["top_values"] == [[-0.5, -2.0]]
    # the second alternative ties with another token at the list's lowest value: which one is listed is not defined
    tie = feed(case, [ch({"a": -0.5, "y": -2.0})])
    v = proof.compare(case, ref, tie)
    assert v["exact"] and v["top_ties"] == ["choice 0 at 0"]
    assert "tie(s) ordered otherwise" in proof.table({"cases": [case], "faults": [
        {"n": 1, "fault": "k", "cases": {"p": dict(v, in_flight_at_fault=True)}}]})
    # negative controls: another value, or a changed alternative above the lowest value, is a difference
    assert not proof.compare(case, ref, feed(case, [ch({"a": -0.5, "y": -2.5})]))["exact"]
    assert not proof.compare(case, ref, feed(case, [ch({"b": -0.5, "x": -2.0})]))["exact"]
    assert not proof.compare(case, ref, feed(case, [ch({"a": -0.7, "y": -2.0})]))["exact"]
    # without the values (an older record) nothing is explained
    old = {"choices": {"0": dict(ref["choices"]["0"], top_values=[])}, "usage": ref["usage"], "error": None}
    assert not proof.compare(case, old, tie)["exact"]


def test_chat_top_logprobs_of_equal_value_in_another_order_are_a_tie():
    lp = lambda *tv: [{"token": "a", "logprob": -1.0, "top_logprobs": [{"token": t, "logprob": v} for t, v in tv]}]  # noqa: E731
    ref = feed(chat_case(), [chat_chunk(0, "a", lp=lp(("a", -1.0), ("b", -3.0), ("c", -3.0)), finish="length")])
    swapped = feed(chat_case(), [chat_chunk(0, "a", lp=lp(("a", -1.0), ("c", -3.0), ("b", -3.0)), finish="length")])
    assert ref["choices"]["0"]["top_values"] == [[-1.0, -3.0, -3.0]]
    v = proof.compare(chat_case(), ref, swapped)
    assert v["exact"] and v["top_ties"] == ["choice 0 at 0"]
    other = feed(chat_case(), [chat_chunk(0, "a", lp=lp(("b", -1.0), ("a", -3.0), ("c", -3.0)), finish="length")])
    assert not proof.compare(chat_case(), ref, other)["exact"]


@pytest.mark.torch
@pytest.mark.timeout(300)
def test_against_runs_the_cases_twice_on_a_server_it_did_not_start(tmp_path):
    """--against: the no-fault runs against any OpenAI server (on a GPU: `vllm serve`
    with a deployment's flags), each case's error reported and the exit status 1
    when one failed (negative control: max_tokens past the server's context)."""
    require("openai")
    from e2e import deployment

    cases = "cmpl-greedy-stream,chat-greedy-stream-usage,cmpl-batch-greedy,responses-stream"

    def run(max_tokens: int) -> tuple[int, dict, str]:
        out = tmp_path / f"against-{max_tokens}.json"
        p = subprocess.run([sys.executable, os.path.join(REPO, "bench", "gpu", "openai_fault_proof.py"), "--against", dep.base,
                            "--model", "tiny", "--served-model-name", "tiny", "--cpu", "--cases", cases,
                            "--max-tokens", str(max_tokens), "--out", str(out)],
                           capture_output=True, text=True, timeout=240, cwd=REPO,
                           env=dict(os.environ, PYTHONPATH=os.path.join(REPO, "vllmpatch", "src") + os.pathsep + REPO))
        return p.returncode, json.loads(out.read_text()), p.stdout + p.stderr

    with deployment(sync_every=4, extra_args=["--max-model-len=256"]) as dep:
        rc, rep, log = run(24)
        assert rc == 0, log
        assert rep["errors"] == {} and len(rep["runs"]) == 2, rep.get("errors")
        assert set(rep["runs"][0]) == set(cases.split(",")) and rep["unstable_without_fault"] == {}, rep
        assert all(v["finish"] == ["length"] or v["finish"] == ["incomplete"] for run_ in rep["runs"] for v in run_.values()), rep["runs"]
        rc, rep, log = run(600)  # past the context: every case refused
        assert rc == 1 and len(rep["errors"]) == 8 and not rep.get("error"), (rc, rep.get("errors"), log[-2000:])
