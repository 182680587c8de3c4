"""The resume ledger of the vLLM frontend (frmps_engine.vllm.frontend.ledger),
over plain stand-ins for vLLM's request and output structs (the ledger reads
attributes only; the real structs are used in tests/vllm/test_frontend_client.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from frmps_engine.sdk.seeds import derive_seed, to_uint64
from frmps_engine.vllm.frontend.ledger import EXTRA_ARGS_KEY, LedgerError, ResumeLedger


def req(rid: str, seed=None, sp=None, prompt=(1, 2, 3)):
    sp = sp if sp is not None else SimpleNamespace(seed=seed, extra_args=None, n=1)
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(prompt), sampling_params=sp)


def out(rid: str, toks, finish=None):
    return SimpleNamespace(request_id=rid, new_token_ids=list(toks), finish_reason=finish)


def test_admit_names_keys_and_seeds():
    led = ResumeLedger()
    a, b = req("cmpl-a", seed=None), req("cmpl-b", seed=-5)
    ea, eb = led.admit(a), led.admit(b)
    assert (ea.key, eb.key) == (1, 2)
    assert (a.request_id, b.request_id) == ("frmps-1", "frmps-2")
    # No seed: derived from the key (int64 on the vLLM side, uint64 on the wire); a client's seed is kept.
    assert to_uint64(a.sampling_params.seed) == derive_seed(1) == ea.seed
    assert b.sampling_params.seed == -5 and eb.seed == to_uint64(-5)
    assert a.sampling_params.extra_args == {EXTRA_ARGS_KEY: 1}


def test_children_sharing_unseeded_params_get_their_own_seeds():
    # vLLM's ParentRequest hands every unseeded child the same SamplingParams object.
    shared = SimpleNamespace(seed=None, extra_args={"user": 1}, n=1)
    kids = [req(f"{i}_cmpl-x", sp=shared) for i in range(3)]
    led = ResumeLedger()
    for k in kids:
        led.admit(k)
    seeds = [k.sampling_params.seed for k in kids]
    assert len(set(seeds)) == 3
    assert [k.sampling_params.extra_args for k in kids] == [{"user": 1, EXTRA_ARGS_KEY: i} for i in (1, 2, 3)]
    assert shared.seed is None and shared.extra_args == {"user": 1}, "the shared object must stay untouched"


def test_record_accumulates_renames_and_forgets_finished():
    led = ResumeLedger()
    led.admit(req("a"))
    led.admit(req("b"))
    o1, o2 = out("frmps-1", [7, 8]), out("frmps-2", [9])
    led.record([o1, o2])
    assert (o1.request_id, o2.request_id) == ("a", "b")
    led.record([out("frmps-1", [10], finish="length")])
    entries = led.open_entries()
    assert [(e.frontend_id, e.delivered) for e in entries] == [("b", [9])]
    assert len(led) == 1
    stray = out("frmps-77", [1])
    led.record([stray, out("warmup-0", [1])])
    assert stray.request_id == "frmps-77" and len(led) == 1


def test_abort_returns_engine_ids_and_forgets():
    led = ResumeLedger()
    for rid in ("a", "b", "c"):
        led.admit(req(rid))
    assert led.abort(["c", "zzz", "a"]) == ["frmps-3", "frmps-1"]
    assert [e.frontend_id for e in led.open_entries()] == ["b"]


def test_open_entries_are_copies():
    led = ResumeLedger()
    led.admit(req("a"))
    led.record([out("frmps-1", [5])])
    snap = led.open_entries()
    led.record([out("frmps-1", [6])])
    assert snap[0].delivered == [5]
    assert led.open_entries()[0].delivered == [5, 6]


def test_bad_requests_are_refused():
    led = ResumeLedger()
    led.admit(req("a"))
    with pytest.raises(LedgerError, match="already open"):
        led.admit(req("a"))
    with pytest.raises(LedgerError, match="generation only"):
        led.admit(SimpleNamespace(request_id="p", prompt_token_ids=[1], sampling_params=None))
    with pytest.raises(LedgerError, match="prompt embeddings"):
        led.admit(SimpleNamespace(request_id="e", prompt_token_ids=None,
                                  sampling_params=SimpleNamespace(seed=1, extra_args=None)))
    assert len(led) == 1
    with pytest.raises(ValueError):
        ResumeLedger(first_key=0)
