"""The SDK's declared engine capabilities (sdk/engine_api.py): what the reference
engine has, what a core without any of them gets instead. The vLLM adapter's core
is checked against the same protocols in tests/vllm/test_engine.py."""

from __future__ import annotations

import pytest

from e2e import require

torch = require("torch")
pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]

from frmps_engine._proto.frmps.v1 import control_pb2  # noqa: E402
from frmps_engine.refengine import EngineConfig, RefCore, SamplingParams  # noqa: E402
from frmps_engine.sdk.engine_api import (  # noqa: E402
    Core,
    DeviceCheck,
    DeviceGate,
    LaunchHook,
    LoadReport,
    Pipelined,
    Resettable,
    StepSize,
    TakeoverWarmup,
    VocabSize,
    has_launch_hook,
    vocab_size,
)
from frmps_engine.sdk.genapi import input_to_ids  # noqa: E402
from frmps_engine.sdk.loop import CreatesRings, EngineLoop, RingModule, RingPublisher  # noqa: E402
from frmps_engine.sdk.params import InvalidRequest  # noqa: E402

OPTIONAL = (LaunchHook, StepSize, LoadReport, DeviceCheck, Resettable, TakeoverWarmup, DeviceGate)


class ByteTok:
    """TEST DOUBLE tokenizer without a vocabulary size (no VocabSize)."""

    eos_token_id = None

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode(errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return self.encode("".join(m["content"] for m in messages))


class Out:
    def __init__(self, key, tok, index, finished):
        self.key, self.new_token_ids, self.output_index = key, [tok], index
        self.finished, self.finish_reason, self.stop_reason = finished, "length" if finished else None, None


class BareCore:
    """TEST DOUBLE: a core with the required members only (engine_api.Core) and none
    of the optional capabilities. Each request emits `max_tokens` tokens, one a step."""

    def __init__(self):
        self.tokenizer = ByteTok()
        self.counters = {"steps": 0}
        self._reqs: dict[int, list] = {}

    def add_request(self, key, prompt_token_ids, params):
        self._reqs[key] = [params, 0]

    def adopt_request(self, key, params, token_ids, num_prompt, num_computed, block_ids, seed, delivered_token_ids):
        raise NotImplementedError

    def abort(self, key):
        return self._reqs.pop(key, None) is not None

    def step(self):
        self.counters["steps"] += 1
        outs = []
        for key, st in list(self._reqs.items()):
            st[1] += 1
            done = st[1] >= st[0]
            outs.append(Out(key, 65, st[1] - 1, done))
            if done:
                del self._reqs[key]
        return outs

    def has_work(self):
        return bool(self._reqs)

    def request_views(self):
        return []


def ref_core() -> RefCore:
    cfg = EngineConfig.from_preset("tiny", num_blocks=32)
    return RefCore(cfg, RefCore.allocate_pools(cfg), True)


def test_the_reference_engine_declares_every_capability():
    core = ref_core()
    assert isinstance(core, Core)
    for cap in OPTIONAL:
        assert isinstance(core, cap), cap.__name__
    assert has_launch_hook(core)
    # Its publish overlaps the device through LaunchHook; nothing stays in flight between steps.
    assert not isinstance(core, Pipelined)
    assert isinstance(core.tokenizer, VocabSize) and vocab_size(core.tokenizer) == core.tokenizer.vocab_size


def test_a_core_without_capabilities_gets_the_fallbacks():
    core = BareCore()
    assert isinstance(core, Core)
    for cap in OPTIONAL + (Pipelined,):
        assert not isinstance(core, cap), cap.__name__
    assert not has_launch_hook(core) and vocab_size(core.tokenizer) is None
    loop = EngineLoop(core, sync_every=1)
    loop.start()
    try:
        s = loop.submit(1, [1, 2], control_pb2.SamplingParams(max_tokens=3), 3)
        with s.cond:
            assert s.cond.wait_for(lambda: s.finished, 10)
        assert s.output == [65, 65, 65] and s.finish_reason == "length"
        # No StepSize: no token count, so no hang estimate for its steps.
        assert loop.scheduled_tokens() is None
        step, running, waiting, age, expected, tokens = loop.heartbeat()
        assert step == 3 and (expected, tokens) == (0, 0)
        # No LoadReport: the loop counts the streams it has open (none now).
        assert loop.load() == (0, 0)
    finally:
        loop.stop()


def test_launch_hook_off_on_an_instance():
    core = ref_core()
    core.launch_hook = False
    assert isinstance(core, LaunchHook) and not has_launch_hook(core)


def test_the_reference_engines_capabilities_feed_the_loop():
    core = ref_core()
    loop = EngineLoop(core, sync_every=1)
    core.add_request(7, [5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0))
    assert loop.load() == (0, 1)  # LoadReport: the core's own waiting request
    core.step()
    assert loop.scheduled_tokens() == 4  # StepSize: the prompt's tokens


def test_vocab_size_bounds_prompt_token_ids_only_when_declared():
    ref_tok = ref_core().tokenizer
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        input_to_ids(ref_tok, prompt_token_ids=[1, ref_tok.vocab_size])
    assert input_to_ids(ByteTok(), prompt_token_ids=[1, 10**6]) == [1, 10**6]


def test_vocab_size_reads_the_attribute():
    """vocab_size() is an attribute read (a runtime protocol check cost ~10 us, twice
    per adopted request); it agrees with VocabSize where the attribute is plain."""

    class Sized(ByteTok):
        vocab_size = 300

    assert vocab_size(Sized()) == 300 and isinstance(Sized(), VocabSize)
    assert vocab_size(ByteTok()) is None and not isinstance(ByteTok(), VocabSize)


def test_prompt_token_ids_from_a_message_field_are_taken_as_ints(monkeypatch):
    """A message's repeated field holds ints: input_to_ids copies it without an int()
    per token (a takeover's path; the resume set carries every prompt as ids), and
    still checks the ids against the vocabulary. Any other sequence is converted."""
    import numpy as np

    from frmps_engine.sdk import genapi

    ref_tok = ref_core().tokenizer
    field = control_pb2.ResumeRequest(prompt_token_ids=[5, 6, 7, 8]).prompt_token_ids
    assert genapi.pb_ints(field) == [5, 6, 7, 8] and type(genapi.pb_ints(field)) is list
    converted = []

    def counting_int(x):
        converted.append(x)
        return int(x)

    monkeypatch.setattr(genapi, "int", counting_int, raising=False)
    ids = input_to_ids(ref_tok, prompt_token_ids=field)
    assert ids == [5, 6, 7, 8] and type(ids) is list and not converted
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        input_to_ids(ref_tok, prompt_token_ids=control_pb2.ResumeRequest(prompt_token_ids=[1, ref_tok.vocab_size])
                     .prompt_token_ids)
    ids = input_to_ids(ref_tok, prompt_token_ids=np.array([5, 6], dtype=np.int64))
    assert ids == [5, 6] and all(type(t) is int for t in ids) and len(converted) == 2


def test_ring_modules():
    import frmps_engine.ring as real
    import frmps_engine.sdk.testing.fake_ring as fake

    assert isinstance(real, RingModule) and isinstance(real, CreatesRings)
    assert isinstance(fake, RingModule) and not isinstance(fake, CreatesRings)
    RingPublisher.preload("frmps_engine.sdk.testing.fake_ring")  # nothing to warm: returns
    with pytest.raises(TypeError, match="is not a ring module"):
        RingPublisher("/nonexistent", "frmps_engine.sdk.engine_api")


def test_view_parts():
    """The reference engine's and the vLLM adapter's views hand the tracker their
    live lists (ViewParts); the tracker publishes views with and without parts
    alike (test_ring_tracker.py: the reader follows the engine either way)."""
    from frmps_engine.refengine import RequestView
    from frmps_engine.ring import ViewParts
    from frmps_engine.vllm.state import CommittedView

    assert isinstance(RequestView(1, 2, [3], [4, 5], 1, 1), ViewParts)
    live = [4, 5]
    v = CommittedView(1, 2, [3], live, 1, 1)
    assert isinstance(v, ViewParts)
    live.append(6)  # the engine appends after the view was taken: the view keeps its length
    assert v.token_ids == [4, 5] and v.parts() == ([3], 1, live, 2)


def test_the_reference_engines_device_gate_waits_after_the_plan_and_before_the_pass():
    """engine_api.DeviceGate: the next pass calls the gate's wait once its host work
    (the schedule and the plan) is done and before any tensor reaches the device;
    once only, and the outputs are those of an ungated engine."""
    core, plain = ref_core(), ref_core()
    events = []
    real_plan, real_run = core._plan, core._run_plan
    core._plan = lambda batch: events.append("plan") or real_plan(batch)
    core._run_plan = lambda plan: events.append("pass") or real_run(plan)
    for c in (core, plain):
        c.add_request(7, [5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0))
    assert core.gate_device(lambda: events.append("gate")) is True
    got = [o.new_token_ids for _ in range(3) for o in core.step()]
    want = [o.new_token_ids for _ in range(3) for o in plain.step()]
    assert got == want
    assert events == ["plan", "gate", "pass", "plan", "pass", "plan", "pass"], events
