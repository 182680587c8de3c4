"""Engine loop: ring publishing cadence (committed state only), fatal errors, commands."""

import json
import threading
import time

import pytest

from e2e import require
from frmps_engine._proto.frmps.v1 import control_pb2
from frmps_engine.sdk.adapters import EngineOptions
from frmps_engine.sdk.loop import EngineLoop, RingPublisher, device_error_cause, is_device_error
from frmps_engine.sdk.memory import get_backend

pytestmark = pytest.mark.torch
torch = require("torch")
from frmps_engine.sdk.testing.fake_engine import FakeAdapter, FakeParams  # noqa: E402
from frmps_engine.sdk.testing.fake_ring import read_snapshot  # noqa: E402


@pytest.fixture
def core(monkeypatch):
    made = []

    def make(**env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        adapter = FakeAdapter(EngineOptions("fake-tiny"))
        mem = get_backend("host-shm")
        pools = mem.allocate(adapter.pool_layout())
        made.append(mem)
        return adapter.create_core({p.spec.key: p.tensor for p in pools}, load_weights=True)

    yield make
    for m in made:
        m.close()


class _CountingPublisher(RingPublisher):
    """Records, per published step, the core's own step count at that moment."""

    def __init__(self, path, c):
        super().__init__(path, "frmps_engine.sdk.testing.fake_ring")
        self.core, self.at = c, {}

    def sync(self, step, views):
        self.at[step] = self.core.counters["steps"]
        super().sync(step, views)


def _finish(loop: EngineLoop, s, ring: str, last_step: int) -> list[dict]:
    """Waits for stream s to finish and the ring's record of last_step, stops the loop,
    and returns the ring's records (the fake ring: one JSON line each)."""
    with s.cond:
        assert s.cond.wait_for(lambda: s.finished, 30)
    for _ in range(200):
        recs = [json.loads(x) for x in open(ring)]
        if recs[-1].get("step") == last_step:
            break
        threading.Event().wait(0.01)
    loop.stop()
    return recs


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "between-steps"])
def test_ring_cadence_and_final_state(core, tmp_path, overlap):
    ring = str(tmp_path / "ring")
    open(ring, "w").close()
    c = core()
    c.launch_hook = overlap
    loop = EngineLoop(c, sync_every=3)
    pub = _CountingPublisher(ring, c)
    loop.attach_ring(pub)
    loop.start()
    s = loop.submit(1, [104, 105], control_pb2.SamplingParams(max_tokens=10), FakeParams(10, 0.0, 1))
    # The idle sync after the last step publishes the finish.
    recs = _finish(loop, s, ring, 10)
    assert recs[0] == {"attach": 1}
    assert recs[1]["full"] and recs[1]["entries"] == []
    # A sync right after the prefill (the first token), and every 3 steps.
    assert [r["step"] for r in recs[2:]] == [1, 3, 6, 9, 10]
    first = recs[2]["entries"][0]
    assert (len(first["tokens"]), first["num_computed"], first["num_prompt"]) == (3, 2, 2)
    mid = recs[4]["entries"][0]
    # Committed state after step 6: 6 outputs sampled, the KV of all but the newest computed.
    assert (len(mid["tokens"]), mid["num_computed"], mid["num_prompt"]) == (8, 7, 2)
    assert recs[-1]["entries"][0]["finished"]
    assert read_snapshot(ring) == {}
    assert len(s.output) == 10 and s.finish_reason == "length"
    # Overlapped: the record of step k goes out inside step k+1, once its pass is
    # enqueued (the fake core counts a step on entry); the last one when going idle.
    lag = 1 if overlap else 0
    assert pub.at == {1: 1 + lag, 3: 3 + lag, 6: 6 + lag, 9: 9 + lag, 10: 10}


@pytest.mark.parametrize("mode", ["overlapped", "pipelined", "between-steps"])
def test_takeover_ring_full_record_goes_out_with_the_first_step(core, tmp_path, mode):
    """A takeover attaches the ring before the loop starts with full_now=False: where the
    publish overlaps the device, its FULL record (the state the core was resumed with)
    goes out with the first step once the pass is enqueued (inside it with a launch hook,
    right after it for a pipelined core, whose step returns with the pass in flight), not
    before the first step; otherwise at once as before."""
    ring = str(tmp_path / "ring")
    open(ring, "w").close()
    c = core()
    c.launch_hook = mode == "overlapped"
    if mode == "pipelined":
        c.finish_in_flight = lambda: []  # engine_api.Pipelined; nothing is ever in flight here
    overlap = mode != "between-steps"
    loop = EngineLoop(c, sync_every=1)
    # In the core before the attach, as an adopted request is (the takeover's path).
    c.add_request(1, [104, 105], FakeParams(4, 0.0, 1))
    s = loop.register_adopted(1, 2, control_pb2.SamplingParams(max_tokens=4), [])
    pub = _CountingPublisher(ring, c)
    loop.attach_ring(pub, full_now=False)
    recs = [json.loads(x) for x in open(ring)]
    assert recs[0] == {"attach": 1}
    if overlap:
        assert len(recs) == 1 and pub.at == {}  # nothing yet: the reader keeps the Resume's snapshot
    else:
        assert recs[1]["full"] and recs[1]["step"] == 0  # at the attach, before any step
    loop.start()
    recs = _finish(loop, s, ring, 4)
    full = recs[1]
    assert full["full"] and full["step"] == 0
    assert [(e["key"], len(e["tokens"]), e["num_computed"]) for e in full["entries"]] == [(1, 2, 0)]
    if overlap:  # published with the first step (the fake core counts a step on entry)
        assert pub.at[0] == 1
    assert not any(r.get("full") for r in recs[2:]) and recs[-1]["entries"][0]["finished"]


def test_device_error_reaches_on_fatal_and_leaves_streams_open(core):
    # The process exits in on_fatal; its streams must end by the connection dropping
    # (the front door then resumes them on the standby), not with an error.
    got = []
    done = threading.Event()
    loop = EngineLoop(core(FRMPS_FAKE_FAULT_AT_STEP="2"), on_fatal=lambda e: (got.append(e), done.set()))
    loop.start()
    s = loop.submit(1, [104], control_pb2.SamplingParams(max_tokens=10), FakeParams(10, 0.0, 1))
    assert done.wait(30)
    assert is_device_error(got[0]) and device_error_cause(got[0]) == "misaligned address"
    assert not s.finished and s.error is None
    assert loop.dead is got[0]


def test_device_error_without_on_fatal_fails_streams(core):
    loop = EngineLoop(core(FRMPS_FAKE_FAULT_AT_STEP="2"))
    loop.start()
    s = loop.submit(1, [104], control_pb2.SamplingParams(max_tokens=10), FakeParams(10, 0.0, 1))
    deadline = time.monotonic() + 30
    while loop.dead is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.finished and "misaligned address" in s.error


def _failing_at_step(c, n: int, exc: BaseException):
    """The fake core, but its n-th step raises exc (an error that is not a device error)."""
    step = c.step

    def failing(on_launch=None):
        if c.counters["steps"] + 1 >= n:
            raise exc
        return step(on_launch=on_launch)

    c.step = failing
    return c


def _wait_dead(loop, timeout=30.0):
    deadline = time.monotonic() + timeout
    while loop.dead is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.dead is not None, "the loop did not die"


def test_step_error_runs_on_error_before_streams_fail(core):
    # on_error may end the process instead (a tensor-parallel peer died): it must run
    # while the requests are still open, then (if it returns) they fail with the error.
    seen, fatal = [], threading.Event()

    def on_error(e):
        st = loop.get(1)
        seen.append((e, st.finished, st.error))

    loop = EngineLoop(_failing_at_step(core(), 3, RuntimeError("gloo: connection closed by peer")),
                      on_error=on_error, on_fatal=lambda e: fatal.set())
    loop.start()
    s = loop.submit(1, [104], control_pb2.SamplingParams(max_tokens=10), FakeParams(10, 0.0, 1))
    assert fatal.wait(30)
    assert len(seen) == 1 and str(seen[0][0]) == "gloo: connection closed by peer"
    assert seen[0][1:] == (False, None), "on_error ran after the streams had failed"
    assert s.finished and s.error == "engine failed: gloo: connection closed by peer"


def test_device_error_does_not_run_on_error(core):
    seen, fatal = [], threading.Event()
    loop = EngineLoop(core(FRMPS_FAKE_FAULT_AT_STEP="2"), on_error=seen.append, on_fatal=lambda e: fatal.set())
    loop.start()
    s = loop.submit(1, [104], control_pb2.SamplingParams(max_tokens=10), FakeParams(10, 0.0, 1))
    assert fatal.wait(30)
    assert seen == [] and not s.finished


def test_on_error_that_raises_still_fails_the_streams(core):
    def broken(e):
        raise ValueError("on_error bug")

    loop = EngineLoop(_failing_at_step(core(), 2, RuntimeError("boom")), on_error=broken)
    loop.start()
    s = loop.submit(1, [104], control_pb2.SamplingParams(max_tokens=10), FakeParams(10, 0.0, 1))
    _wait_dead(loop)
    with s.cond:
        assert s.cond.wait_for(lambda: s.finished, 10)
    assert s.error == "engine failed: boom"


def test_commands_and_abort(core):
    loop = EngineLoop(core())
    assert loop.call(lambda: 41 + 1) == 42  # inline before start
    loop.start()
    assert loop.call(lambda: threading.current_thread().name) == "frmps-engine-loop"
    with pytest.raises(ZeroDivisionError):
        loop.call(lambda: 1 / 0)
    assert not loop.abort(5)
    s = loop.submit(5, [104], control_pb2.SamplingParams(max_tokens=100000), FakeParams(100, 0.0, 1))
    assert loop.abort(5) and s.finish_reason == "abort"
    assert loop.call(lambda: loop.core.has_work()) is False
    bad = loop.submit(6, [1] * 200, control_pb2.SamplingParams(), FakeParams(1, 0.0, 1))
    with bad.cond:
        bad.cond.wait_for(lambda: bad.finished, 10)
    assert bad.error_invalid and "prompt too long" in bad.error
    loop.stop()
    assert not loop.running


def test_is_device_error():
    assert is_device_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert device_error_cause(RuntimeError("CUDA error: an illegal memory access was encountered\nmore")) == \
        "an illegal memory access was encountered"
    assert not is_device_error(ValueError("bad prompt"))


def test_is_device_error_follows_explicit_causes():
    """What a CUDA init in a recovering MPS server raises, wrapped by an adapter
    (`raise ... from e`), is a device error (the engine exits 3, not 2)."""
    class AdapterError(Exception):
        pass

    for text in ("Unexpected error from cudaGetDeviceCount(). Error 700: an illegal memory access was encountered",
                 "CUDA unknown error - this may be due to an incorrectly set up environment"):
        try:
            try:
                raise RuntimeError(text)
            except RuntimeError as e:
                raise AdapterError("tensor-parallel group of 2: rank 1 failed") from e
        except AdapterError as wrapped:
            assert is_device_error(wrapped), text
    # A configuration message that names the cuda-vmm backend is not one.
    assert not is_device_error(ValueError("cuda-vmm backend needs a GPU device (cuda or cuda:N), got --device cpu"))
    assert not is_device_error(None)


def test_a_step_wakes_a_stream_following_its_requests_once(core):
    """A generation Stream follows many requests through one waker: a step's
    outputs wake it once, after every output of the step is in place (it then
    sends them in one message), while a reader waiting on one request's own
    condition is still woken at its append."""
    from types import SimpleNamespace

    from frmps_engine.sdk.stream import RequestStream

    loop = EngineLoop(core())
    streams = [RequestStream(k, 2, control_pb2.SamplingParams(max_tokens=10)) for k in (1, 2, 3)]
    seen = []

    def wake():  # what it sees when woken: every output of the step
        seen.append([list(s.output) for s in streams])

    other = []
    for s in streams:
        loop._streams[s.key] = s
        s.wakers.append(wake)
    streams[2].wakers.append(lambda: other.append(len(streams[2].output)))
    out = [SimpleNamespace(key=k, output_index=0, new_token_ids=[10 + k], finished=False, finish_reason=None,
                           stop_reason=None) for k in (1, 2, 3)]
    loop._dispatch(out)
    assert seen == [[[11], [12], [13]]], "one wake, after the whole step"
    assert other == [1]
    out = [SimpleNamespace(key=2, output_index=1, new_token_ids=[22], finished=True, finish_reason="length",
                           stop_reason=None)]
    loop._dispatch(out)
    assert len(seen) == 2 and seen[1][1] == [12, 22] and streams[1].finished


def test_step_phases_armed_for_traced_and_every_nth_step(core, caplog):
    """A core's step_phases (vllm/phases.py, FRMPS_DEBUG_STEP_PHASES) is armed for
    the steps the loop traces after a takeover and for every Nth step; each gets a
    line with the core's calls; other steps record nothing."""
    from frmps_engine.vllm.phases import StepPhases, every_from_env

    c = core()
    c.step_phases = StepPhases({"scheduler": c}, every=3, targets=(("scheduler", "step"),))
    assert c.step_phases.wrapped == ["step"]
    loop = EngineLoop(c)
    loop.trace_steps = 1
    caplog.set_level("INFO", logger="frmps_engine.sdk.loop")
    loop.start()
    s = loop.submit(5, [104], control_pb2.SamplingParams(max_tokens=7), FakeParams(7, 0.0, 1))
    with s.cond:
        assert s.cond.wait_for(lambda: s.finished, 30)
    loop.stop()
    lines = [r.getMessage() for r in caplog.records if "vLLM calls" in r.getMessage()]
    assert [ln.split(" vLLM calls")[0] for ln in lines] == ["step 1 after start,", "step 3", "step 6"], lines
    assert all(": step " in ln for ln in lines), lines
    from bench import loglines  # the bench reads the first step's line

    m = loglines.FIRST_STEP_CALLS.search(lines[0])
    assert m and [c[1] for c in loglines.STEP_CALL.findall(m.group(1))] == ["step"], lines[0]
    assert every_from_env({}) is None and every_from_env({"FRMPS_DEBUG_STEP_PHASES": "0"}) is None
    assert every_from_env({"FRMPS_DEBUG_STEP_PHASES": "1"}) == 1
    assert every_from_env({"FRMPS_DEBUG_STEP_PHASES": "200"}) == 200
    with pytest.raises(ValueError, match="FRMPS_DEBUG_STEP_PHASES='x'"):
        every_from_env({"FRMPS_DEBUG_STEP_PHASES": "x"})
