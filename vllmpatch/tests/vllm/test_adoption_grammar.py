"""Adoption of a structured-output request on the real vLLM Scheduler with the
real StructuredOutputManager (xgrammar, the Qwen2.5-vocabulary tokenizer that
`frmps model init` writes): the standby's grammar continues from the tokens the
client received, exactly once, and the request is scheduled, not left waiting
for a grammar."""

from __future__ import annotations

import json

import pytest

from frmps_engine import modeldir
from frmps_engine.vllm.adoption import AdoptionError, AdoptPlan, adopt
from vhelpers import make_scheduler, make_vllm_config

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
          "additionalProperties": False}
RECEIVED = '{"city": "Pa'  # the client has this much when the active dies
REST = 'ris"}'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return modeldir.write("qwen2.5-0.5b", str(tmp_path_factory.mktemp("qwen") / "m"))


@pytest.fixture(scope="module")
def tok(model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(f"{model_dir}/tokenizer.json")


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


def modeldir_eos() -> int:
    return modeldir.QWEN_REGULAR_TOKENS + 2  # <|im_end|>, the tokenizer's EOS


def params():
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=json.dumps(SCHEMA))
    so._backend = "xgrammar"  # set by vLLM's input processor in the frontend, carried in the request
    return SamplingParams(max_tokens=32, seed=1, structured_outputs=so)


def scheduler(model_dir, **so_config):
    from vllm.config import StructuredOutputsConfig

    cfg = make_vllm_config(model_dir, tokenizer=True, structured_outputs_config=StructuredOutputsConfig(**so_config))
    return make_scheduler(cfg)


def plan(key, out_ids):
    return AdoptPlan(key=key, seed=1, prompt_token_ids=[10, 11, 12], output_token_ids=list(out_ids),
                     num_computed=0, block_ids=[])


def test_grammar_continues_after_the_received_tokens(model_dir, tok):
    sched = scheduler(model_dir, backend="xgrammar")
    request, _ = adopt(sched, plan(5, ids(tok, RECEIVED)), params(), fold_outputs=False)
    grammar = request.structured_output_request.grammar
    # Fed exactly the received tokens: the rest of the object completes it. A
    # grammar fed nothing would refuse 'ris"}' (an object starts with '{'); one
    # fed twice would have refused adoption ('{"city": "Pa{"city"…' is not JSON).
    assert grammar.accept_tokens(request.request_id, ids(tok, REST) + [modeldir_eos()])
    assert grammar.is_terminated()
    out = sched.schedule()
    assert request.request_id in out.num_scheduled_tokens, "adopted request left waiting for its grammar"
    # The same request adopted with nothing received starts at the object's beginning.
    fresh, _ = adopt(sched, plan(8, []), params(), fold_outputs=False)
    assert not fresh.structured_output_request.grammar.accept_tokens(fresh.request_id, ids(tok, REST))


def test_received_tokens_outside_the_grammar_are_refused(model_dir, tok):
    sched = scheduler(model_dir, backend="xgrammar")
    free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    with pytest.raises(AdoptionError, match="do not fit the request's grammar"):
        adopt(sched, plan(6, ids(tok, "hello")), params(), fold_outputs=False)
    assert not sched.requests and sched.kv_cache_manager.block_pool.get_num_free_blocks() == free


def test_reasoning_parser_is_not_yet_supported(model_dir, tok):
    sched = scheduler(model_dir, backend="xgrammar", reasoning_parser="deepseek_r1")
    with pytest.raises(AdoptionError, match="not yet"):
        adopt(sched, plan(7, ids(tok, RECEIVED)), params(), fold_outputs=False)


def _standby_core(model_dir, **so_config):
    from vllm.config import StructuredOutputsConfig

    from frmps_engine.vllm.core import VllmCore
    from frmps_engine.vllm.engine import scheduler_cls_for
    from vhelpers import SchedulerCore

    vc = make_vllm_config(model_dir, tokenizer=True, structured_outputs_config=StructuredOutputsConfig(**so_config))
    vc.scheduler_config.scheduler_cls = scheduler_cls_for(vc)
    return VllmCore(SchedulerCore(make_scheduler(vc)), None)


@pytest.mark.parametrize("configured", ["auto", "xgrammar"])
def test_warm_takeover_builds_the_structured_output_backend(model_dir, tok, configured):
    """A standby's warm-up builds vLLM's structured-output backend with a throwaway
    grammar request (a first takeover with grammars in flight otherwise pays for the
    backend: 609 ms of adoption CPU on the H100), leaves nothing behind, and the
    adopted request then compiles on that backend and continues as without it."""
    eng = _standby_core(model_dir, backend=configured)
    manager = eng.scheduler.structured_output_manager
    assert manager.backend is None
    before = eng.counters
    eng.warm_takeover()
    warmed = manager.backend
    assert type(warmed).__name__ == "XgrammarBackend"  # "auto": vLLM's first choice
    pool = eng.scheduler.kv_cache_manager.block_pool
    assert not eng.has_work() and list(eng.request_views()) == []
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1 and eng.counters == before
    request, _ = adopt(eng.scheduler, plan(5, ids(tok, RECEIVED)), params(), fold_outputs=False)
    assert manager.backend is warmed  # the request resolved to xgrammar too: kept
    assert request.structured_output_request.grammar.accept_tokens(request.request_id, ids(tok, REST) + [modeldir_eos()])


def test_the_first_real_request_still_decides_the_backend():
    """After the warm-up built a backend, the first real structured-output request
    that resolved to another one gets its own (vLLM builds the backend the first
    request asks for); a request without structured outputs changes nothing, and
    the check runs once. A labelled stand-in for vLLM's StructuredOutputManager."""
    from types import SimpleNamespace

    from frmps_engine.vllm.core import _first_request_decides

    class Manager:  # test double: grammar_init builds the backend the request asks for when there is none
        backend, backend_name = "xgrammar-backend", "xgrammar"

        def grammar_init(self, request):
            if request.structured_output_request is None:
                return
            if self.backend is None:
                self.backend_name = request.sampling_params.structured_outputs._backend
                self.backend = self.backend_name + "-backend"

    def req(backend):
        so = None if backend is None else SimpleNamespace(_backend=backend)
        return SimpleNamespace(structured_output_request=None if so is None else object(),
                               sampling_params=SimpleNamespace(structured_outputs=so))

    m = Manager()
    _first_request_decides(m, "xgrammar")
    m.grammar_init(req(None))
    assert m.backend == "xgrammar-backend" and "grammar_init" in vars(m)  # still armed
    m.grammar_init(req("guidance"))
    assert (m.backend, m.backend_name) == ("guidance-backend", "guidance") and "grammar_init" not in vars(m)
    m.grammar_init(req("xgrammar"))  # once only: vLLM's own rule from here on
    assert m.backend == "guidance-backend"
    same = Manager()
    _first_request_decides(same, "xgrammar")
    same.grammar_init(req("xgrammar"))
    assert same.backend == "xgrammar-backend" and "grammar_init" not in vars(same)


def _wire(**so):
    """A request's constraint as the front door sends it, through the engine's own mapping."""
    from frmps_engine._proto.frmps.v1 import control_pb2
    from frmps_engine.vllm.engine import _structured_outputs

    return _structured_outputs(control_pb2.SamplingParams(max_tokens=32, structured_outputs=control_pb2.StructuredOutputs(**so)))


def wait_grammar(request):
    import time

    for _ in range(5000):
        g = request.structured_output_request.grammar
        if g is not None:
            return g
        time.sleep(0.001)
    raise AssertionError("grammar not compiled")


@pytest.mark.parametrize("configured", ["auto", "xgrammar"])
def test_a_front_door_constraint_gets_vllms_backend_and_its_grammar(model_dir, tok, configured):
    """A constraint from the Go front door (no vLLM input processor in front of the
    engine) gets its backend where vLLM's input processor would give it, and its
    grammar is the constraint's: added, and adopted after the received tokens."""
    from vllm.sampling_params import SamplingParams

    from frmps_engine.vllm.core import request_id_for_key

    eng = _standby_core(model_dir, backend=configured)
    eng.add_request(1, [10, 11, 12], SamplingParams(max_tokens=32, seed=1, structured_outputs=_wire(json_schema=json.dumps(SCHEMA))))
    req = eng.scheduler.requests[request_id_for_key(1)]
    assert req.sampling_params.structured_outputs._backend == "xgrammar"
    g = wait_grammar(req)
    assert not g.accept_tokens(req.request_id, ids(tok, "hello"))
    assert g.accept_tokens(req.request_id, ids(tok, '{"city": "Oslo"}') + [modeldir_eos()]) and g.is_terminated()
    for key, (so, good, bad) in enumerate(((dict(regex="[a-c]{3}-[0-9]{2}"), "abc-12", "xyz"),
                                            (dict(choice={"values": ["yes", "no"]}), "no", "maybe"),
                                            (dict(json_object=True), '{"a": 1}', "[1]")), start=20):
        sp = SamplingParams(max_tokens=32, seed=1, structured_outputs=_wire(**so))
        eng.adopt_request(key, sp, [10, 11, 12], 3, 0, [], 1, [])
        req = eng.scheduler.requests[request_id_for_key(key)]
        g = wait_grammar(req)
        assert not g.accept_tokens(req.request_id, ids(tok, bad)), so
        assert g.accept_tokens(req.request_id, ids(tok, good) + [modeldir_eos()]) and g.is_terminated(), so
