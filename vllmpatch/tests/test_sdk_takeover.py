"""Standby takeover paths, in process: a Runner (standby) driven over a real control
socket, with the "active" played by a fake core in this process writing the shared
pools (TEST DOUBLES: fake engine, fake ring, the supervisor side of this test)."""

import os
import re
import socket
import threading
import time

import grpc
import pytest

from e2e import require
from frmps_engine._proto.frmps.v1 import control_pb2 as c, generation_pb2 as g, generation_pb2_grpc
from bench import loglines
from frmps_engine.sdk.adapters import EngineOptions
from frmps_engine.sdk.control import ControlConn
from frmps_engine.sdk.memory import get_backend
from frmps_engine.sdk.runner import Runner, RunnerConfig

pytestmark = pytest.mark.torch
torch = require("torch")
from frmps_engine.sdk.testing.fake_engine import FakeAdapter, FakeParams, FakeTokenizer  # noqa: E402
from test_sdk_genapi import reference  # noqa: E402

TOK = FakeTokenizer()


class Harness:
    def __init__(self, d):
        self.d = d
        self.ring = os.path.join(d, "ring.jsonl")
        open(self.ring, "w").close()
        # The active: a fake core on freshly allocated pools.
        self.adapter = FakeAdapter(EngineOptions("fake-tiny"))
        self.mem = get_backend("host-shm")
        self.pools = self.mem.allocate(self.adapter.pool_layout())
        self.active = self.adapter.create_core({p.spec.key: p.tensor for p in self.pools}, load_weights=True)
        self.pb = [c.Pool(tag=p.spec.tag, index=p.spec.index, size=p.spec.size, backend="host-shm") for p in self.pools]
        # The standby runner.
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(os.path.join(d, "ctl"))
        self.srv.listen(1)
        self.srv.settimeout(30)
        self.exits = []
        self.runner = Runner(
            RunnerConfig(role="standby", control_socket=os.path.join(d, "ctl"), generation_socket=os.path.join(d, "gen"),
                         ring_module="frmps_engine.sdk.testing.fake_ring", heartbeat_s=30),
            FakeAdapter(EngineOptions("fake-tiny")), get_backend("host-shm"), exit_fn=self.exits.append,
        )
        self.code = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        s, _ = self.srv.accept()
        self.conn = ControlConn(s)
        env, _ = self.conn.recv()
        assert env.hello.role == c.ROLE_STANDBY
        self.conn.send(c.Envelope(welcome=c.Welcome(accepted=True, protocol_version=c.PROTOCOL_VERSION_1)))
        self.channel = grpc.insecure_channel("unix://" + os.path.join(d, "gen"))
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def _run(self):
        self.code = self.runner.run()

    def cmd(self, env, fds=()):
        self.conn.send(env, fds)
        while True:
            got, _ = self.conn.recv()
            if got.WhichOneof("msg") == "reply":
                assert got.id == env.id
                return got.reply

    def sleep(self):
        return self.cmd(c.Envelope(id=1, sleep=c.Sleep(pools=self.pb)), [p.fd for p in self.pools])

    def close(self):
        if self.code is None:
            self.cmd(c.Envelope(id=99, shutdown=c.Shutdown(grace_ms=500)))
        self.thread.join(30)
        assert self.code == 0
        self.channel.close()
        self.conn.close()
        self.srv.close()
        self.runner.memory.close()
        del self.active, self.pools
        self.mem.close()


@pytest.fixture
def h(sockdir):
    x = Harness(sockdir)
    yield x
    x.close()


@pytest.fixture
def h_ro(sockdir, monkeypatch):
    """A standby with FRMPS_STANDBY_KV=readonly: asleep, its KV cache is read-only and
    the takeover flips it (beside the adoption, behind the device gate)."""
    monkeypatch.setenv("FRMPS_STANDBY_KV", "readonly")
    x = Harness(sockdir)
    yield x
    x.close()


def takeover_line(caplog, timeout: float = 10.0) -> str:
    """The takeover's log line. The engine logs it after its Reply (and, ungated, after
    starting its loop), on its own thread: the Resume can return, and even the first
    tokens stream, before the line is written."""
    deadline = time.monotonic() + timeout
    while True:
        line = next((r.getMessage() for r in caplog.records if "took over" in r.getMessage()), None)
        if line is not None or time.monotonic() > deadline:
            assert line is not None, "no takeover log line within %.0f s" % timeout
            return line
        time.sleep(0.01)


def run_active(core, key, prompt, steps, params):
    """Step the active's fake core; return the request's output tokens and its state after each step."""
    core.add_request(key, prompt, params)
    out, snaps = [], []
    for _ in range(steps):
        for o in core.step():
            if o.key == key:
                out.extend(o.new_token_ids)
        v = next(v for v in core.request_views() if v.key == key)
        snaps.append(c.RequestSnapshot(block_ids=v.block_ids, token_ids=v.token_ids, num_prompt_tokens=v.num_prompt,
                                       num_computed_tokens=v.num_computed, seed=v.seed))
    return out, snaps


def resume_one_new(h):
    """Resume with one request the active never saw (key 3, 6 tokens); the Reply."""
    return h.cmd(c.Envelope(id=2, resume=c.Resume(requests=[c.ResumeRequest(key=3, prompt="new",
                                                                            params=c.SamplingParams(max_tokens=6))],
                                                  ring_path=h.ring)))


def resume_stream(h, key, delivered):
    chunks = list(h.stub.Resume(g.ResumeStreamRequest(key=key, delivered=len(delivered))))
    return delivered + [t for ch in chunks for t in ch.token_ids]


def test_resume_before_sleep_is_refused(h):
    r = h.cmd(c.Envelope(id=5, resume=c.Resume()))
    assert not r.ok and "send Sleep first" in r.error
    assert h.sleep().ok


def test_takeover_paths(h):
    assert h.sleep().ok
    prompt = TOK.encode("hello")
    # Request 1: last sync after 3 steps, the client got 7 tokens: prefill only the 4 after the sync.
    out1, snaps1 = run_active(h.active, 1, prompt, 7, FakeParams(20, 0.0, 11))
    # Request 2: never synced, 5 tokens delivered: full prefill of prompt + delivered.
    out2, _ = run_active(h.active, 2, TOK.encode("abc"), 5, FakeParams(15, 0.0, 12))
    P = c.SamplingParams
    reqs = [
        c.ResumeRequest(key=1, prompt="hello", params=P(max_tokens=20), delivered_token_ids=out1, snapshot=snaps1[2]),
        c.ResumeRequest(key=2, prompt="abc", params=P(max_tokens=15), delivered_token_ids=out2),
        c.ResumeRequest(key=3, prompt="new", params=P(max_tokens=6)),
        c.ResumeRequest(key=4, prompt="other", params=P(max_tokens=6), snapshot=snaps1[2]),  # not its snapshot
        c.ResumeRequest(key=5, prompt="x", params=P(max_tokens=6, temperature=-2)),
        c.ResumeRequest(key=3, prompt="new", params=P(max_tokens=6)),  # duplicate key
        # The prompt left out of the snapshot (output_token_ids), but a prompt length that is not this one's.
        c.ResumeRequest(key=6, prompt_token_ids=prompt[:2], params=P(max_tokens=6),
                        snapshot=c.RequestSnapshot(output_token_ids=out1[:2], num_prompt_tokens=len(prompt),
                                                   num_computed_tokens=len(prompt) + 1)),
    ]
    r = h.cmd(c.Envelope(id=2, resume=c.Resume(requests=reqs, ring_path=h.ring, sync_every=2)))
    assert r.ok, r.error
    assert len(r.resumed) == 7
    dup = r.resumed[5]
    assert dup.key == 3 and not dup.ok and "appears twice" in dup.error
    bad = r.resumed[6]
    assert bad.key == 6 and not bad.ok and "snapshot prompt length differs" in bad.error
    o = {x.key: x for x in r.resumed[:5]}
    assert (o[1].ok, o[1].reused_tokens, o[1].prefilled_tokens) == (True, len(prompt) + 2, 5)
    assert (o[2].ok, o[2].reused_tokens, o[2].prefilled_tokens) == (True, 0, 3 + 5)
    assert (o[3].ok, o[3].reused_tokens, o[3].prefilled_tokens) == (True, 0, 3)
    assert not o[4].ok and "snapshot prompt tokens differ" in o[4].error
    assert not o[5].ok and "temperature must be >= 0" in o[5].error
    assert resume_stream(h, 1, out1) == reference(prompt, 20)
    assert resume_stream(h, 2, out2) == reference(TOK.encode("abc"), 15)
    assert resume_stream(h, 3, []) == reference(TOK.encode("new"), 6)
    with pytest.raises(grpc.RpcError) as ei:
        list(h.stub.Resume(g.ResumeStreamRequest(key=4, delivered=0)))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    counters = h.runner.counters()
    assert counters["adopted_tokens_reused"] == len(prompt) + 2
    assert counters["prefill_tokens_computed"] == 5 + 8 + 3
    assert h.exits == []
    # A second Resume is refused: this engine is active now.
    r = h.cmd(c.Envelope(id=3, resume=c.Resume()))
    assert not r.ok


def test_a_chat_with_tools_is_adopted_with_its_tools(h):
    """A resume set's chat request (no prompt ids from the engine) is tokenized
    with its tools and its messages' tool fields, as Generate tokenized it."""
    import json

    from test_sdk_genapi import TOOLS_JSON, tool_chat

    assert h.sleep().ok
    msgs, want = tool_chat()
    prompt = TOK.apply_chat_template(want, add_generation_prompt=True, tools=json.loads(TOOLS_JSON))
    out, _ = run_active(h.active, 7, prompt, 3, FakeParams(9, 0.0, 13))
    req = c.ResumeRequest(key=7, messages=msgs, tools_json=TOOLS_JSON, params=c.SamplingParams(max_tokens=9),
                          delivered_token_ids=out)
    r = h.cmd(c.Envelope(id=2, resume=c.Resume(requests=[req], ring_path=h.ring)))
    assert r.ok and r.resumed[0].ok, (r.error, r.resumed)
    assert r.resumed[0].prefilled_tokens == len(prompt) + 3
    assert resume_stream(h, 7, out) == reference(prompt, 9)


def test_a_resume_set_of_vllms_api_server_is_refused_by_the_generation_api_engine(h):
    """A Resume whose requests carry engine_request (vLLM's EngineCoreRequest, from
    vLLM's API server as frontend) is refused whole by an engine serving frmps's
    generation API, naming the mismatch; nothing is adopted and the engine is still
    a sleeping standby that takes a proper Resume afterwards."""
    assert h.sleep().ok
    P = c.SamplingParams
    reqs = [c.ResumeRequest(key=1, prompt="hi", params=P(max_tokens=3)),
            c.ResumeRequest(key=2, engine_request=b"\x9f", delivered_token_ids=[5])]
    r = h.cmd(c.Envelope(id=2, resume=c.Resume(requests=reqs, ring_path=h.ring)))
    assert not r.ok and not r.resumed
    assert "1 of 2 requests carry engine_request (keys 2)" in r.error and "not core mode" in r.error, r.error
    assert "Nothing adopted" in r.error
    assert not h.runner.core.has_work() and h.runner.loop is None
    r = h.cmd(c.Envelope(id=3, resume=c.Resume(requests=reqs[:1], ring_path=h.ring)))
    assert r.ok and r.resumed[0].ok
    assert resume_stream(h, 1, []) == reference(TOK.encode("hi"), 3)


def test_core_mode_needs_an_engine_that_speaks_vllms_engine_core_protocol(sockdir, caplog):
    """--core-input/--core-output with an engine without engine_api.EngineCoreProtocol
    (the fake engine, the reference engine) is refused at start, by name."""
    from frmps_engine import cli
    from frmps_engine.sdk.runner import EXIT_REFUSED, StartupError

    def runner(**kw):
        cfg = dict(role="active", control_socket=os.path.join(sockdir, "ctl"), generation_socket="")
        return Runner(RunnerConfig(**{**cfg, **kw}), FakeAdapter(EngineOptions("fake-tiny")), get_backend("host-shm"))

    with pytest.raises(StartupError, match="engine fake does not speak vLLM's engine-core protocol"):
        runner(core_input="ipc:///x/in", core_output="ipc:///x/out")
    with pytest.raises(StartupError, match="needs both engine-core sockets"):
        runner(core_input="ipc:///x/in")
    with pytest.raises(StartupError, match="not both"):
        runner(core_input="ipc:///x/in", core_output="ipc:///x/out", generation_socket=os.path.join(sockdir, "gen"))
    with pytest.raises(StartupError, match="no generation socket"):
        runner()
    base = ["serve", "--role", "active", "--model", "tiny", "--control-socket", os.path.join(sockdir, "ctl")]
    assert cli.serve(cli.build_parser().parse_args(
        base + ["--engine", "ref", "--core-input", "ipc:///x/in", "--core-output", "ipc:///x/out"])) == EXIT_REFUSED
    assert "which the reference engine does not speak (use --engine vllm" in caplog.text
    caplog.clear()
    assert cli.serve(cli.build_parser().parse_args(base)) == EXIT_REFUSED
    assert "give --generation-socket, or --core-input and --core-output" in caplog.text


def test_corrupted_shared_kv_is_detected(h):
    """The standby really reads the active's KV: corrupt it and adoption fails for that request."""
    assert h.sleep().ok
    out, snaps = run_active(h.active, 1, TOK.encode("hello"), 4, FakeParams(20, 0.0, 1))
    kv = h.pools[1].tensor.view(torch.int32)
    kv[snaps[-1].block_ids[0] * 4] += 1
    r = h.cmd(c.Envelope(id=2, resume=c.Resume(requests=[
        c.ResumeRequest(key=1, prompt="hello", params=c.SamplingParams(max_tokens=20), delivered_token_ids=out,
                        snapshot=snaps[-1])])))
    assert r.ok and not r.resumed[0].ok and "KV of token 0" in r.resumed[0].error


def test_bad_ring_path_still_serves(h):
    assert h.sleep().ok
    r = h.cmd(c.Envelope(id=2, resume=c.Resume(
        requests=[c.ResumeRequest(key=1, prompt="hi", params=c.SamplingParams(max_tokens=3))],
        ring_path=os.path.join(h.d, "no", "such", "ring"))))
    assert r.ok and "serving without the ring" in r.error and r.resumed[0].ok
    assert resume_stream(h, 1, []) == reference(TOK.encode("hi"), 3)



def test_a_takeover_that_fails_after_the_core_adopted_aborts_it_there(h, monkeypatch):
    """If anything fails after the core took a request (here: a result that does not
    follow the engine contract), the core must not keep running it with no stream to
    follow: the outcome is an error and the request is aborted in the core."""
    assert h.sleep().ok
    prompt = TOK.encode("hello")
    out, snaps = run_active(h.active, 1, prompt, 4, FakeParams(20, 0.0, 11))
    core = h.runner.core
    real = core.adopt_request

    class Partial:  # TEST DOUBLE of a wrong result: no prefill_tokens
        reused_tokens = 0

    def adopt(*a, **kw):
        real(*a, **kw)
        return Partial()

    monkeypatch.setattr(core, "adopt_request", adopt)
    req = c.ResumeRequest(key=1, prompt="hello", params=c.SamplingParams(max_tokens=20), delivered_token_ids=out,
                          snapshot=snaps[-1])
    r = h.cmd(c.Envelope(id=2, resume=c.Resume(requests=[req], ring_path=h.ring, sync_every=2)))
    assert r.ok and not r.resumed[0].ok and "prefill_tokens" in r.resumed[0].error
    assert not core.has_work(), "the adopted request was left running in the core"


def test_the_kv_flip_runs_beside_the_adoption_and_before_any_step(h_ro, monkeypatch, caplog):
    h = h_ro  # FRMPS_STANDBY_KV=readonly: the KV cache flips at the takeover
    """After a fault the KV pool's flip to read-write waits on the MPS server, so it
    runs on a thread beside the adoption (host work only). The flip here finishes
    only once adoption has started: done one after the other, the flip would run
    first, see no adoption and time out, and the test fails. And the loop must not
    step before the flip is over: the first step checks the pool is writable."""
    caplog.set_level("INFO", logger="frmps_engine.sdk.runner")
    caplog.set_level("INFO", logger="frmps_engine.sdk.loop")
    assert h.sleep().ok
    out, snaps = run_active(h.active, 1, TOK.encode("hello"), 4, FakeParams(20, 0.0, 11))
    core, mem = h.runner.core, h.runner.memory
    adopting, flipped = threading.Event(), threading.Event()
    seen = {}
    real_flip, real_adopt, real_step = mem.make_writable, core.adopt_request, core.step

    def flip(tag):  # TEST DOUBLE of a slow flip (the dying MPS server)
        seen["overlapped"] = adopting.wait(10)
        real_flip(tag)
        flipped.set()

    def adopt(*a, **kw):
        adopting.set()
        return real_adopt(*a, **kw)

    def step(*a, **kw):
        seen.setdefault("first_step_after_flip", flipped.is_set())
        return real_step(*a, **kw)

    monkeypatch.setattr(mem, "make_writable", flip)
    monkeypatch.setattr(core, "adopt_request", adopt)
    monkeypatch.setattr(core, "step", step)
    req = c.ResumeRequest(key=1, prompt="hello", params=c.SamplingParams(max_tokens=20), delivered_token_ids=out,
                          snapshot=snaps[-1])
    r = h.cmd(c.Envelope(id=2, resume=c.Resume(requests=[req], ring_path=h.ring, sync_every=2)))
    assert r.ok and r.resumed[0].ok, r
    assert seen["overlapped"], "the KV flip did not run beside the adoption"
    assert resume_stream(h, 1, out) == reference(TOK.encode("hello"), 20, 0.0, 11)
    assert seen["first_step_after_flip"]
    # The harnesses read the takeover's figures from this log line (bench/loglines.py).
    line = takeover_line(caplog)
    got = loglines.takeover_fields(list(loglines.TAKEOVER.search(line).groups()))
    assert got["requests"] == 1 and got["adoption_cpu_ms"] >= 0 and got["kv_writable_ms"] >= 0, got
    step = next(r.getMessage() for r in caplog.records if "step 1 after start" in r.getMessage())
    first = loglines.first_step_fields(list(loglines.FIRST_STEP.search(step).groups()))
    assert first["step_ms"] > 0 and first["loop_cpu_ms"] > 0, first


def test_memory_phase_lines_when_asked(h, monkeypatch, caplog):
    """FRMPS_DEBUG_MEMORY_PHASES=1: the standby logs its memory at the phases of its
    start, the last when it goes to sleep (here, without a GPU or NVML, saying so),
    and carries on."""
    caplog.set_level("INFO", logger="frmps_engine.sdk.memphase")
    monkeypatch.setenv("FRMPS_DEBUG_MEMORY_PHASES", "1")
    monkeypatch.setenv("FRMPS_LIBNVML", "/nonexistent/libnvidia-ml.so.1")
    monkeypatch.setattr("frmps_engine.sdk.memphase._reader", None)
    monkeypatch.setattr("frmps_engine.sdk.memphase._reader_error", "")
    assert h.sleep().ok
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory at ")]
    phases = [x.split(":", 1)[0] for x in lines]
    assert phases[-1] == "memory at asleep (brokered pools mapped)", phases
    assert all("NVML: unavailable (" in x for x in lines), lines
    assert resume_one_new(h).ok


def test_a_failed_kv_flip_fails_the_resume(h_ro, monkeypatch):
    h = h_ro  # FRMPS_STANDBY_KV=readonly: the KV cache flips at the takeover
    assert h.sleep().ok

    def flip(tag):  # TEST DOUBLE of the driver refusing the access change
        raise RuntimeError("cuMemSetAccess: CUDA_ERROR_INVALID_VALUE")

    monkeypatch.setattr(h.runner.memory, "make_writable", flip)
    r = resume_one_new(h)
    assert not r.ok and "cuMemSetAccess" in r.error
    assert h.runner.loop is None or not h.runner.loop.running


def gate_on(core, monkeypatch):
    """TEST DOUBLE of engine_api.DeviceGate on the fake core: its step calls the
    gate's wait (once) before stepping, and records whether the KV flip was over
    by then in ``seen``. Returns (at_gate, seen): at_gate is set when the first
    step reaches the gate."""
    waits, seen, at_gate = [], {}, threading.Event()
    real_step = core.step

    def gate_device(wait):
        waits.append(wait)
        return True

    def step(*a, **kw):
        if waits:
            wait = waits.pop()
            seen["host_work_before_gate"] = True  # a core's scheduling and input buffers go here
            at_gate.set()
            wait()
            seen["passes_after_gate"] = 0
        seen["passes_after_gate"] = seen.get("passes_after_gate", -1) + 1
        return real_step(*a, **kw)

    monkeypatch.setattr(core, "gate_device", gate_device, raising=False)
    monkeypatch.setattr(core, "step", step)
    return at_gate, seen


def test_with_a_device_gate_the_first_steps_host_work_runs_beside_the_kv_flip(h_ro, monkeypatch, caplog):
    h = h_ro  # FRMPS_STANDBY_KV=readonly: the KV cache flips at the takeover
    """engine_api.DeviceGate: the loop starts as soon as the requests are adopted
    and the ring attached, the first step's host work runs while the KV flip waits
    for the MPS server, and its device work waits at the gate. The flip here ends
    only once the first step has reached the gate: with the loop started after
    the flip (as without a gate) the flip would wait its 10 s out, and the test
    fails. The first pass itself must come after the flip."""
    caplog.set_level("INFO", logger="frmps_engine.sdk.runner")
    assert h.sleep().ok
    out, snaps = run_active(h.active, 1, TOK.encode("hello"), 4, FakeParams(20, 0.0, 11))
    core, mem = h.runner.core, h.runner.memory
    at_gate, seen = gate_on(core, monkeypatch)
    flipped = threading.Event()
    real_flip = mem.make_writable

    def flip(tag):  # TEST DOUBLE of a slow flip (the dying MPS server)
        seen["gate_reached_during_flip"] = at_gate.wait(10)
        real_flip(tag)
        flipped.set()

    monkeypatch.setattr(mem, "make_writable", flip)
    real_pass = core.step

    def step(*a, **kw):  # the pass proper, behind the gate
        res = real_pass(*a, **kw)
        seen.setdefault("first_pass_after_flip", flipped.is_set())
        return res

    monkeypatch.setattr(core, "step", step)
    req = c.ResumeRequest(key=1, prompt="hello", params=c.SamplingParams(max_tokens=20), delivered_token_ids=out,
                          snapshot=snaps[-1])
    r = h.cmd(c.Envelope(id=2, resume=c.Resume(requests=[req], ring_path=h.ring, sync_every=2)))
    assert r.ok and r.resumed[0].ok, r
    assert resume_stream(h, 1, out) == reference(TOK.encode("hello"), 20, 0.0, 11)
    assert seen["gate_reached_during_flip"], "the first step did not start before the KV flip ended"
    assert seen["host_work_before_gate"] and seen["first_pass_after_flip"], seen
    assert seen["passes_after_gate"] > 1, "the gate is once: later steps must not wait again"
    line = takeover_line(caplog)
    got = loglines.takeover_fields(list(loglines.TAKEOVER.search(line).groups()))
    assert got["device_gate"] and got["gate_wait_ms"] >= 0 and got["gate_at_ms"] > 0, (got, line)


def test_a_first_step_that_reaches_the_gate_after_the_flip_says_when_in_its_own_line(h_ro, monkeypatch, caplog):
    h = h_ro  # FRMPS_STANDBY_KV=readonly: the KV cache flips at the takeover
    """A fast flip (e.g. after an out-of-range shared access) ends before the first
    step's host work reaches the gate. The takeover's line, written at the reply,
    cannot say when the gate was reached; the first step's line, written after that
    step, does (how long the host work held the first token back)."""
    caplog.set_level("INFO", logger="frmps_engine.sdk.runner")
    caplog.set_level("INFO", logger="frmps_engine.sdk.loop")
    assert h.sleep().ok
    core, mem = h.runner.core, h.runner.memory
    at_gate, seen = gate_on(core, monkeypatch)
    flipped = threading.Event()
    real_flip, gated_step = mem.make_writable, core.step

    def flip(tag):
        real_flip(tag)
        flipped.set()

    def step(*a, **kw):  # TEST DOUBLE of host work that outlasts the flip
        flipped.wait(10)
        time.sleep(0.005)
        return gated_step(*a, **kw)

    monkeypatch.setattr(mem, "make_writable", flip)
    monkeypatch.setattr(core, "step", step)
    r = resume_one_new(h)
    assert r.ok and r.resumed[0].ok, r
    assert len(resume_stream(h, 3, [])) == 6
    line = takeover_line(caplog)
    assert "had not reached the device gate when the flip ended (" in line, line
    step1 = next(r.getMessage() for r in caplog.records if "step 1 after start" in r.getMessage())
    m = re.search(r"reached the device gate ([\d.]+) ms into the takeover, \+([\d.]+) ms from the flip's end", step1)
    assert m and float(m.group(2)) >= 4.0 and float(m.group(1)) > float(m.group(2)), step1
    first = loglines.first_step_fields(list(loglines.FIRST_STEP.search(step1).groups()))
    assert first["step_ms"] > 0, first


def test_a_core_that_declines_the_device_gate_starts_its_loop_after_the_flip(h_ro, caplog, monkeypatch):
    h = h_ro  # FRMPS_STANDBY_KV=readonly: the KV cache flips at the takeover
    """A core whose gate_device returns False (vLLM's V1 runner, a runner in other
    processes): the loop starts after the flip, and the takeover's log line says so."""
    caplog.set_level("INFO", logger="frmps_engine.sdk.runner")
    assert h.sleep().ok
    _, seen = gate_on(h.runner.core, monkeypatch)
    monkeypatch.setattr(h.runner.core, "gate_device", lambda wait: False, raising=False)
    r = resume_one_new(h)
    assert r.ok and r.resumed[0].ok, r
    assert len(resume_stream(h, 3, [])) == 6
    assert "host_work_before_gate" not in seen
    line = takeover_line(caplog)
    got = loglines.takeover_fields(list(loglines.TAKEOVER.search(line).groups()))
    assert got["device_gate"] is False and "gate_wait_ms" not in got, (got, line)


def test_a_failed_kv_flip_behind_a_device_gate_fails_the_resume_and_runs_no_pass(h_ro, monkeypatch):
    h = h_ro  # FRMPS_STANDBY_KV=readonly: the KV cache flips at the takeover
    """The gate raises the flip's error on the loop's thread: the first pass never
    runs (the KV cache may still be read-only, or a dead client's kernels may still
    be writing it), the engine reports the device error and exits, and the Resume
    fails with the error."""
    assert h.sleep().ok
    at_gate, seen = gate_on(h.runner.core, monkeypatch)

    def flip(tag):  # TEST DOUBLE of the driver refusing the access change
        at_gate.wait(10)
        raise RuntimeError("cuMemSetAccess: CUDA_ERROR_INVALID_VALUE")

    monkeypatch.setattr(h.runner.memory, "make_writable", flip)
    r = resume_one_new(h)
    assert not r.ok and "cuMemSetAccess" in r.error
    h.runner.loop._thread.join(10)
    assert not h.runner.loop.running
    assert "passes_after_gate" not in seen, "a pass ran after the flip failed"
    assert h.exits == [3], h.exits  # EXIT_DEVICE, through the loop's fatal path


def test_by_default_the_kv_cache_is_writable_asleep_and_the_takeover_flips_nothing(h, monkeypatch):
    """FRMPS_STANDBY_KV=writable (the default): the standby maps the KV cache read-write
    when it goes to sleep (weights read-only), writes nothing while asleep, and its
    takeover changes no access: nothing is left on the takeover's path."""
    mem, flips = h.runner.memory, []
    real = mem._set_access

    def set_access(pool, readonly):
        flips.append((pool.spec.tag, readonly))
        real(pool, readonly)

    monkeypatch.setattr(mem, "_set_access", set_access)
    flip_threads = []
    monkeypatch.setattr("frmps_engine.sdk.takeover.KvFlip._run", lambda self: flip_threads.append(self))
    assert h.sleep().ok
    assert flips == [("kv_cache", False)]
    assert [p.readonly for p in mem.pools() if p.spec.tag == "weights"] == [True]
    out, snaps = run_active(h.active, 1, TOK.encode("hello"), 4, FakeParams(20, 0.0, 11))
    req = c.ResumeRequest(key=1, prompt="hello", params=c.SamplingParams(max_tokens=20), delivered_token_ids=out,
                          snapshot=snaps[-1])
    r = h.cmd(c.Envelope(id=2, resume=c.Resume(requests=[req], ring_path=h.ring, sync_every=2)))
    assert r.ok and r.resumed[0].ok, r
    assert resume_stream(h, 1, out) == reference(TOK.encode("hello"), 20, 0.0, 11)
    assert flips == [("kv_cache", False)], "the takeover changed an access"
    assert flip_threads == [], "a flip thread ran for a KV cache already writable"


def test_the_reply_waits_for_the_first_steps_host_work(h, monkeypatch, caplog):
    """With a device gate, the takeover replies once its first step's host work has
    reached the gate: the reply, the supervisor's promotion and the front door's
    streams attaching then run beside the step's device work, not beside its host
    work (where they competed for the GIL). The line says how long the reply waited."""
    caplog.set_level("INFO", logger="frmps_engine.sdk.runner")
    assert h.sleep().ok
    core = h.runner.core
    at_gate, seen = gate_on(core, monkeypatch)
    gated_step = core.step

    # TEST DOUBLE of 50 ms of host work before the gate, with the reply's bound on its
    # wait (20 ms) raised so that a loaded machine cannot make it run out. The loop
    # starts the step before the reply begins to wait (the flip's join comes between),
    # so the wait is the host work less that gap, which a loaded machine stretches to
    # milliseconds: the bound below leaves it half.
    from frmps_engine.sdk import takeover

    monkeypatch.setattr(takeover, "REPLY_AFTER_HOST_WORK_MAX_S", 5.0)
    def step(*a, **kw):
        if not at_gate.is_set():
            time.sleep(0.05)
        return gated_step(*a, **kw)

    monkeypatch.setattr(core, "step", step)
    r = resume_one_new(h)
    assert at_gate.is_set(), "the reply came before the first step's host work reached the gate"
    assert r.ok and r.resumed[0].ok and r.took_ns >= 50e6, r
    assert len(resume_stream(h, 3, [])) == 6
    line = takeover_line(caplog)
    got = loglines.takeover_fields(list(loglines.TAKEOVER.search(line).groups()))
    assert got["device_gate"] and got["reply_wait_ms"] >= 25.0, (got, line)
