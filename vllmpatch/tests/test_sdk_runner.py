"""The engine process end to end: real `python -m frmps_engine.cli serve` processes
driven by a FakeSupervisor (TEST DOUBLE of the Go supervisor's control side), with the
fake engine and the JSON fake ring (TEST DOUBLES from frmps_engine.sdk.testing).

The failover here is real: the active writes weights and KV into /dev/shm pools,
is SIGKILLed mid-generation, and the standby continues from those pools."""

import hashlib
import json
import mmap
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest

from e2e import require
from frmps_engine._proto.frmps.v1 import control_pb2 as c, generation_pb2 as g, generation_pb2_grpc
from bench import loglines
from frmps_engine.sdk.control import ConnectionClosed, ControlConn, ControlError
from frmps_engine.sdk.seeds import derive_seed

pytestmark = pytest.mark.torch
torch = require("torch")
from frmps_engine.sdk.adapters import EngineOptions  # noqa: E402
from frmps_engine.sdk.testing.fake_engine import FakeAdapter, FakeParams, FakeTokenizer  # noqa: E402
from frmps_engine.ring import create_ring  # noqa: E402
from frmps_engine.ring.layout import TYPE_FULL, TYPE_PAD  # noqa: E402
from frmps_engine.ring.reader import RingReader  # noqa: E402


def read_snapshot(path: str) -> dict[int, dict]:
    """What the supervisor holds after consuming every record of the (real) ring,
    read from its start (these tests' rings never wrap)."""
    r = RingReader(path, start=0)
    try:
        r.poll()
        return {k: {"blocks": list(st.blocks), "tokens": list(st.tokens), "num_prompt": st.num_prompt,
                    "num_computed": st.num_computed, "seed": st.seed, "step": st.step}
                for k, st in r.snapshot.items()}
    finally:
        r.close()
from test_sdk_genapi import reference  # noqa: E402

TOK = FakeTokenizer()
FAKE = "frmps_engine.sdk.testing.fake_engine:FakeAdapter"


class Engine:
    def __init__(self, proc, conn_srv, gen_path, log_path):
        self.proc, self.srv, self.gen_path, self.log_path = proc, conn_srv, gen_path, log_path
        self.conn: ControlConn | None = None

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()


class FakeSupervisor:
    """TEST DOUBLE: speaks the control protocol like the Go supervisor would."""

    def __init__(self, d):
        self.dir = d
        self.ring = os.path.join(d, "ring")
        create_ring(self.ring, 1 << 20)
        self.engines: list[Engine] = []
        self.fds: list[int] = []

    def spawn(self, role, name, *extra, env=None, engine=FAKE, model="fake-tiny") -> Engine:
        ctrl, gen, log = (os.path.join(self.dir, f"{name}.{x}") for x in ("ctl", "gen", "log"))
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(ctrl)
        srv.listen(1)
        srv.settimeout(90)
        cmd = [sys.executable, "-m", "frmps_engine.cli", "serve", "--engine", engine, "--role", role,
               "--model", model, "--control-socket", ctrl, "--generation-socket", gen, "--memory", "host-shm",
               *extra]
        with open(log, "w") as lf:
            proc = subprocess.Popen(cmd, stderr=lf, stdout=lf, env={**os.environ, **(env or {})})
        e = Engine(proc, srv, gen, log)
        self.engines.append(e)
        return e

    def accept(self, e: Engine) -> c.Hello:
        s, _ = e.srv.accept()
        e.conn = ControlConn(s)
        env, fds = e.conn.recv()
        assert env.WhichOneof("msg") == "hello" and not fds
        assert env.hello.pid == e.proc.pid
        return env.hello

    @staticmethod
    def welcome(e: Engine, **kw):
        kw.setdefault("accepted", True)
        e.conn.send(c.Envelope(welcome=c.Welcome(protocol_version=c.PROTOCOL_VERSION_1, deployment_id="test", **kw)))

    @staticmethod
    def expect(e: Engine, *kinds, timeout=60):
        """Read messages (skipping heartbeats) until one of each kind arrived."""
        got, want = {}, set(kinds)
        e.conn._sock.settimeout(timeout)
        while want - got.keys():
            env, fds = e.conn.recv()
            kind = env.WhichOneof("msg")
            if kind == "heartbeat":
                continue
            assert kind in want, f"unexpected {kind}: {env}"
            got[kind] = (env, fds)
        e.conn._sock.settimeout(None)
        return got

    def close(self):
        for e in self.engines:
            if e.proc.poll() is None:
                e.proc.kill()
            e.proc.wait(10)
            if e.conn:
                e.conn.close()
            e.srv.close()
        for fd in self.fds:
            os.close(fd)


@pytest.fixture
def sup(sockdir):
    s = FakeSupervisor(sockdir)
    yield s
    s.close()


def digest(fds):
    h = hashlib.sha256()
    for fd in fds:
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as m:
            h.update(m)
    return h.hexdigest()


def start_active(sup, sync_every=4, env=None):
    a = sup.spawn("active", "a", env=env)
    hello = sup.accept(a)
    assert hello.role == c.ROLE_ACTIVE and hello.engine == "fake" and hello.block_size == 4
    assert [(p.tag, p.index, p.backend) for p in hello.pools] == [("weights", 0, "host-shm"), ("kv_cache", 0, "host-shm")]
    sup.welcome(a, ring_path=sup.ring, sync_every=sync_every)
    got = sup.expect(a, "pool_export", "ready")
    export, fds = got["pool_export"]
    assert list(export.pool_export.pools) == list(hello.pools) and len(fds) == 2
    sup.fds += fds
    return a, export.pool_export.pools, fds


class Stream(threading.Thread):
    """A front-door client stream: records what it delivered until the engine dies."""

    def __init__(self, stub, req, stop_after=None):
        super().__init__(daemon=True)
        self.stub, self.req, self.tokens, self.text, self.error = stub, req, [], "", None
        self.finished = False

    def run(self):
        try:
            for ch in self.stub.Generate(self.req):
                self.tokens += ch.token_ids
                self.text += ch.text
                self.finished = ch.finish_reason != g.FINISH_REASON_UNSPECIFIED
        except grpc.RpcError as e:
            self.error = e.code()


@pytest.mark.parametrize("standby_kv", ["readonly", "writable"])
def test_failover_end_to_end(sup, standby_kv):
    a, pools, fds = start_active(sup, sync_every=4, env={"FRMPS_FAKE_STEP_DELAY_MS": "30"})
    s = sup.spawn("standby", "s", env={"FRMPS_STANDBY_KV": standby_kv})
    hello = sup.accept(s)
    assert hello.role == c.ROLE_STANDBY and list(hello.pools) == list(pools)
    sup.welcome(s)
    before = digest(fds)
    s.conn.send(c.Envelope(id=11, sleep=c.Sleep(pools=pools)), fds)
    got = sup.expect(s, "ready", "reply")
    assert got["reply"][0].id == 11 and got["reply"][0].reply.ok
    assert got["ready"][0].ready.role == c.ROLE_STANDBY
    assert digest(fds) == before, "a standby must not write the shared pools"
    kv_rw = ", the KV cache read-write" if standby_kv == "writable" else ""
    assert f"brokered pools mapped read-only{kv_rw} (map" in s.log()
    assert loglines.SLEEP.search(s.log()), "the bench reads the sleep's figures from this line"

    s_stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel("unix://" + s.gen_path))
    with pytest.raises(grpc.RpcError) as ei:
        list(s_stub.Generate(g.GenerateRequest(key=99, prompt="x")))
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE  # asleep

    a_stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel("unix://" + a.gen_path))
    P = c.SamplingParams
    reqs = {
        1: g.GenerateRequest(key=1, prompt="hello", params=P(max_tokens=40)),
        2: g.GenerateRequest(key=2, prompt="abc", params=P(max_tokens=30, temperature=1.0, seed=7)),
        3: g.GenerateRequest(key=3, messages=g.ChatMessages(messages=[c.ChatMessage(role="user", content="hi")]),
                             params=P(max_tokens=35, temperature=0.8)),
    }
    streams = {k: Stream(a_stub, r) for k, r in reqs.items()}
    for st in streams.values():
        st.start()
    deadline = time.monotonic() + 60
    # Every stream is past at least one ring sync (sync_every=4) and far from its end.
    while min(len(streams[k].tokens) for k in (1, 2, 3)) < 8 and time.monotonic() < deadline:
        time.sleep(0.005)
    # A late request: killed before (or right at) its first ring sync.
    reqs[4] = g.GenerateRequest(key=4, prompt="late", params=P(max_tokens=12))
    streams[4] = Stream(a_stub, reqs[4])
    streams[4].start()
    time.sleep(0.05)
    os.kill(a.proc.pid, signal.SIGKILL)
    with pytest.raises(ConnectionClosed):  # the supervisor sees the death as EOF
        while True:
            a.conn.recv()
    assert a.proc.wait(10) == -signal.SIGKILL
    for st in streams.values():
        st.join(30)
        assert not st.finished, "kill came too late for this test"
        assert st.error is not None

    snap = read_snapshot(sup.ring)
    assert 1 in snap and 2 in snap and 3 in snap
    resume = []
    for k, r in reqs.items():
        rr = c.ResumeRequest(key=k, params=r.params, delivered_token_ids=streams[k].tokens)
        which = r.WhichOneof("input")
        if k == 2:  # as the front door sends it once the engine reported the prompt's ids
            rr.prompt_token_ids.extend(TOK.encode(r.prompt))
        elif which == "prompt":
            rr.prompt = r.prompt
        else:
            rr.messages.extend(r.messages.messages)
        if k in snap:
            e = snap[k]
            rr.snapshot.CopyFrom(c.RequestSnapshot(block_ids=e["blocks"], token_ids=e["tokens"],
                                                   num_prompt_tokens=e["num_prompt"], num_computed_tokens=e["num_computed"],
                                                   seed=e["seed"], step=e["step"]))
            if k == 2:  # the supervisor leaves that prompt out of the snapshot (supervisor/failover_run.go)
                assert e["tokens"][: e["num_prompt"]] == list(rr.prompt_token_ids)
                del rr.snapshot.token_ids[:]
                rr.snapshot.output_token_ids.extend(e["tokens"][e["num_prompt"]:])
        resume.append(rr)
    s.conn.send(c.Envelope(id=12, resume=c.Resume(requests=resume, ring_path=sup.ring, sync_every=4)))
    reply = sup.expect(s, "reply")["reply"][0]
    assert reply.id == 12 and reply.reply.ok, reply
    outcomes = {o.key: o for o in reply.reply.resumed}
    assert all(o.ok for o in outcomes.values()), outcomes
    for k in (1, 2, 3):
        e = snap[k]
        # KV of everything the last sync covered came from the shared pool (the fake core checked its bytes);
        # only the tokens after it are prefilled.
        assert outcomes[k].reused_tokens == e["num_computed"] >= e["num_prompt"] > 0
        total = e["num_prompt"] + max(len(streams[k].tokens), len(e["tokens"]) - e["num_prompt"])
        assert outcomes[k].prefilled_tokens == total - e["num_computed"]

    tmpl = TOK.apply_chat_template([{"role": "user", "content": "hi"}])
    expected = {
        1: reference(TOK.encode("hello"), 40),
        2: reference(TOK.encode("abc"), 30, 1.0, 7),
        3: reference(tmpl, 35, 0.8, derive_seed(3)),
        4: reference(TOK.encode("late"), 12),
    }
    for k, st in streams.items():
        chunks = list(s_stub.Resume(g.ResumeStreamRequest(key=k, delivered=len(st.tokens))))
        rest = [t for ch in chunks for t in ch.token_ids]
        assert chunks[0].output_index == len(st.tokens)
        assert st.tokens + rest == expected[k], f"request {k} diverged after takeover"
        assert st.text + "".join(ch.text for ch in chunks) == TOK.decode(expected[k])
        assert chunks[-1].finish_reason == g.FINISH_REASON_LENGTH

    # The new active attached to the ring (epoch 2) and published a FULL record first.
    rr = RingReader(sup.ring, start=0)
    rr.poll()
    recs = [x for x in rr.records if x.type != TYPE_PAD]
    rr.close()
    epochs = [x.epoch for x in recs]
    assert sorted(set(epochs)) == [1, 2] and epochs == sorted(epochs)
    assert recs[epochs.index(2)].type == TYPE_FULL

    # New requests are served by the new active.
    new = list(s_stub.Generate(g.GenerateRequest(key=5, prompt="again", params=P(max_tokens=5))))
    assert [t for ch in new for t in ch.token_ids] == reference(TOK.encode("again"), 5)

    s.conn.send(c.Envelope(id=13, shutdown=c.Shutdown(grace_ms=2000)))
    assert sup.expect(s, "reply")["reply"][0].reply.ok
    assert s.proc.wait(30) == 0
    m = re.search(r"engine counters at shutdown: (\{.*\})", s.log())
    counters = json.loads(m.group(1))
    # Tokens covered by the last sync were reused, never recomputed.
    assert counters["adopted_tokens_reused"] == sum(o.reused_tokens for o in outcomes.values())
    prefilled_on_takeover = counters["prefill_tokens_computed"] - len(TOK.encode("again"))
    assert prefilled_on_takeover <= sum(o.prefilled_tokens for o in outcomes.values())


def test_standby_refuses_a_different_pool_layout(sup):
    from frmps_engine.sdk.memory import PoolSpec, get_backend
    mem = get_backend("host-shm")
    pools = mem.allocate([PoolSpec("weights", 0, 4096), PoolSpec("kv_cache", 0, 64 * 16)])
    try:
        s = sup.spawn("standby", "s", "--num-blocks", "32")
        hello = sup.accept(s)
        assert hello.pools[1].size == 32 * 16
        sup.welcome(s)
        pb = [c.Pool(tag=p.spec.tag, index=p.spec.index, size=p.spec.size, backend="host-shm") for p in pools]
        s.conn.send(c.Envelope(id=3, sleep=c.Sleep(pools=pb)), [p.fd for p in pools])
        r = sup.expect(s, "reply")["reply"][0].reply
        assert not r.ok and "pool 1: engine expects kv_cache[0] 512 bytes, got kv_cache[0] 1024 bytes" in r.error
        assert s.proc.wait(30) == 2
        assert "engine refuses to start: pool layout mismatch" in s.log()
    finally:
        del pools
        mem.close()


def test_welcome_refused_exits_nonzero_with_reason(sup):
    a = sup.spawn("active", "a")
    sup.accept(a)
    sup.welcome(a, accepted=False, reason="model differs from the deployment's")
    assert a.proc.wait(30) == 2
    assert "supervisor refused this engine: model differs from the deployment's" in a.log()


@pytest.mark.parametrize("args, msg", [
    (["--model", "nope"], "unknown model preset 'nope'"),
    (["--model", "fake-tiny", "--device", "cuda"], "host-shm pools live in host memory"),
    (["--model", "fake-tiny", "--memory", "cuda-vmm"], "cuda-vmm backend needs a GPU device"),
    (["--model", "fake-tiny", "--engine", "nosuch"], "unknown engine 'nosuch'"),
])
def test_bad_configuration_is_a_clear_error(sockdir, args, msg):
    base = ["--engine", FAKE] if "--engine" not in args else []
    r = subprocess.run([sys.executable, "-m", "frmps_engine.cli", "serve", *base, "--role", "active", *args,
                        "--control-socket", f"{sockdir}/c", "--generation-socket", f"{sockdir}/g"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_a_bad_standby_kv_policy_is_a_clear_error(sockdir):
    r = subprocess.run([sys.executable, "-m", "frmps_engine.cli", "serve", "--engine", FAKE, "--role", "standby",
                        "--model", "fake-tiny", "--control-socket", f"{sockdir}/c", "--generation-socket", f"{sockdir}/g"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "FRMPS_STANDBY_KV": "rw"})
    assert r.returncode == 2 and "FRMPS_STANDBY_KV='rw': expected writable (the default) or readonly" in r.stderr, r.stderr


def test_no_supervisor_socket_is_a_clear_error(sockdir):
    r = subprocess.run([sys.executable, "-m", "frmps_engine.cli", "serve", "--engine", FAKE, "--role", "active",
                        "--model", "fake-tiny", "--control-socket", f"{sockdir}/c", "--generation-socket", f"{sockdir}/g"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"connect control socket {sockdir}/c" in r.stderr, r.stderr


def test_device_error_sends_fault_and_exits_3(sup):
    a, _, _ = start_active(sup, env={"FRMPS_FAKE_FAULT_AT_STEP": "3"})
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel("unix://" + a.gen_path))
    st = Stream(stub, g.GenerateRequest(key=1, prompt="hello", params=c.SamplingParams(max_tokens=20)))
    st.start()
    f = sup.expect(a, "fault")["fault"][0].fault
    assert f.cause == "misaligned address" and "RuntimeError" in f.detail and f.unix_nanos > 0
    assert a.proc.wait(30) == 3
    st.join(10)
    assert st.error is not None and not st.finished


def test_supervisor_gone_engine_exits(sup):
    a, _, _ = start_active(sup)
    a.conn.close()
    a.conn = None
    assert a.proc.wait(30) == 1
    assert "control connection lost" in a.log()


def test_sigterm_drains_and_exits_0(sup):
    a, _, _ = start_active(sup)
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel("unix://" + a.gen_path))
    chunks = list(stub.Generate(g.GenerateRequest(key=1, prompt="hi", params=c.SamplingParams(max_tokens=3))))
    assert chunks[-1].finish_reason == g.FINISH_REASON_LENGTH
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(30) == 0
    assert not os.path.exists(a.gen_path)  # the generation socket is removed on a clean exit


def _resume_set(reqs, delivered, snap):
    out = []
    for k, r in reqs.items():
        rr = c.ResumeRequest(key=k, params=r.params, delivered_token_ids=delivered[k], prompt=r.prompt)
        if k in snap:
            e = snap[k]
            rr.snapshot.CopyFrom(c.RequestSnapshot(block_ids=e["blocks"], token_ids=e["tokens"],
                                                   num_prompt_tokens=e["num_prompt"], num_computed_tokens=e["num_computed"],
                                                   seed=e["seed"], step=e["step"]))
        out.append(rr)
    return out


def test_planned_handover_both_ways_is_exact(sup):
    """Failback's planned handover between two live engines: the active yields
    (state published, streams moved with UNAVAILABLE after their last token,
    requests forgotten, asleep), the standby resumes from the fresh sync without
    replaying, and then the same happens in the other direction."""
    env = {"FRMPS_FAKE_STEP_DELAY_MS": "20"}
    a, pools, fds = start_active(sup, sync_every=4, env=env)
    s = sup.spawn("standby", "s", env=env)
    sup.accept(s)
    sup.welcome(s)
    s.conn.send(c.Envelope(id=1, sleep=c.Sleep(pools=pools)), fds)
    assert sup.expect(s, "ready", "reply")["reply"][0].reply.ok
    s.conn.send(c.Envelope(id=2, handoff=c.Handoff()))
    r = sup.expect(s, "reply")["reply"][0].reply
    assert not r.ok and "serving active" in r.error  # only a serving active hands over

    P = c.SamplingParams
    reqs = {
        1: g.GenerateRequest(key=1, prompt="hello", params=P(max_tokens=60)),
        2: g.GenerateRequest(key=2, prompt="abc", params=P(max_tokens=60, temperature=1.0, seed=7)),
        3: g.GenerateRequest(key=3, prompt="xyz", params=P(max_tokens=60, temperature=0.8)),
    }
    expected = {1: reference(TOK.encode("hello"), 60), 2: reference(TOK.encode("abc"), 60, 1.0, 7),
                3: reference(TOK.encode("xyz"), 60, 0.8, derive_seed(3))}
    engines = [a, s]
    delivered = {k: [] for k in reqs}
    for hop in range(2):
        src, dst = engines[hop % 2], engines[(hop + 1) % 2]
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel("unix://" + src.gen_path))
        if hop == 0:
            streams = {k: Stream(stub, r) for k, r in reqs.items()}
        else:
            streams = {k: ResumeStream(stub, k, len(delivered[k])) for k in reqs}
        for st in streams.values():
            st.start()
        want = 10 * (hop + 1)
        deadline = time.monotonic() + 60
        while min(len(delivered[k]) + len(streams[k].tokens) for k in reqs) < want and time.monotonic() < deadline:
            time.sleep(0.005)
        src.conn.send(c.Envelope(id=10 + hop, handoff=c.Handoff()))
        rep = sup.expect(src, "reply")["reply"][0]
        assert rep.id == 10 + hop and rep.reply.ok, rep
        for k, st in streams.items():
            st.join(30)
            assert st.error == grpc.StatusCode.UNAVAILABLE and not st.finished, (k, st.error)
            delivered[k] += st.tokens
            assert delivered[k] == expected[k][: len(delivered[k])], f"request {k}: a token lost or repeated"
        with pytest.raises(grpc.RpcError) as ei:  # asleep now
            list(stub.Generate(g.GenerateRequest(key=99, prompt="x")))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        ho = loglines.handoff_breakdown(src.log_path)  # the breakdown the GPU proofs record
        assert ho is not None and ho["requests"] == 3, src.log()
        assert all(v >= 0 for v in ho.values()) and ho["handoff_ms"] >= ho["in_flight_ms"] + ho["reset_ms"]
        snap = read_snapshot(sup.ring)
        dst.conn.send(c.Envelope(id=20 + hop, resume=c.Resume(requests=_resume_set(reqs, delivered, snap),
                                                              ring_path=sup.ring, sync_every=4)))
        rep = sup.expect(dst, "reply")["reply"][0].reply
        assert rep.ok, rep
        for o in rep.resumed:
            # The handover published a fresh sync: the standby computes only the token
            # sampled last (its KV was not written yet), never a replay.
            assert o.ok and o.prefilled_tokens <= 1, o
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel("unix://" + a.gen_path))
    for k in reqs:
        rest = [t for ch in stub.Resume(g.ResumeStreamRequest(key=k, delivered=len(delivered[k]))) for t in ch.token_ids]
        assert delivered[k] + rest == expected[k], f"request {k} diverged after two handovers"


class ResumeStream(Stream):
    def __init__(self, stub, key, delivered):
        super().__init__(stub, None)
        self.key, self.start_at = key, delivered

    def run(self):
        try:
            for ch in self.stub.Resume(g.ResumeStreamRequest(key=self.key, delivered=self.start_at)):
                self.tokens += ch.token_ids
                self.finished = ch.finish_reason != g.FINISH_REASON_UNSPECIFIED
        except grpc.RpcError as e:
            self.error = e.code()


def _int64_sum(fd) -> str:
    import numpy as np

    with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as m:
        n = len(m) // 8 * 8
        s = int(np.frombuffer(m, dtype=np.int64, count=n // 8).sum(dtype=np.int64)) & 0xFFFFFFFFFFFFFFFF
    return f"{s:016x}"


def test_pool_checksum_hook_shows_the_standby_wrote_nothing(sup):
    """Test hook for the GPU proof (FRMPS_DEBUG_POOL_CHECKSUM): the active logs its
    pools' sums at Ready and again on a signal; a standby that started and slept in
    between must leave them equal (and they are the real sums of the pools' bytes)."""
    from frmps_engine.sdk import debug_fault

    a, pools, fds = start_active(sup, env={debug_fault.CHECKSUM_ENV: "1"})
    want = f"weights[0]={_int64_sum(fds[0])} kv_cache[0]={_int64_sum(fds[1])}"
    deadline = time.monotonic() + 30
    while "pool checksums at ready" not in a.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"pool checksums at ready: {want}" in a.log()
    s = sup.spawn("standby", "s")
    sup.accept(s)
    sup.welcome(s)
    s.conn.send(c.Envelope(id=1, sleep=c.Sleep(pools=pools)), fds)
    assert sup.expect(s, "ready", "reply")["reply"][0].reply.ok
    os.kill(a.proc.pid, debug_fault.checksum_signal())
    while "pool checksums on request" not in a.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"pool checksums on request: {want}" in a.log()
def _heartbeats(e: Engine, seconds: float) -> list[tuple[float, c.Heartbeat]]:
    """The heartbeats an engine sends for a while, with their arrival times."""
    out = []
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        e.conn._sock.settimeout(left)
        try:
            env, _ = e.conn.recv()
        except ControlError as err:
            if isinstance(err.__cause__, TimeoutError):
                break
            raise
        if env.WhichOneof("msg") == "heartbeat":
            out.append((time.monotonic(), env.heartbeat))
    e.conn._sock.settimeout(None)
    return out


def test_heartbeats_report_a_hung_step_and_keep_coming(sup):
    """A step that never finishes (the debug hang hook, SIGUSR2, CPU variant: the loop
    thread blocks inside the step) does not hold the heartbeat thread back: beats keep
    coming at the period Welcome asked for, with the step's age growing and the
    engine's estimate, measured on the steps before, beside it."""
    a = sup.spawn("active", "a", env={"FRMPS_DEBUG_HANG_SIGNAL": "1", "FRMPS_FAKE_STEP_DELAY_MS": "5"})
    sup.accept(a)
    sup.welcome(a, ring_path=sup.ring, sync_every=4, heartbeat_interval_ms=50)
    sup.fds += sup.expect(a, "pool_export", "ready")["pool_export"][1]
    idle = _heartbeats(a, 0.3)
    assert len(idle) >= 3 and all(hb.interval_ms == 50 and hb.step_age_ns == 0 for _, hb in idle), idle
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel("unix://" + a.gen_path))
    st = Stream(stub, g.GenerateRequest(key=1, prompt="hello", params=c.SamplingParams(max_tokens=100)))
    st.start()
    deadline = time.monotonic() + 30
    while len(st.tokens) < 20 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(st.tokens) >= 20, "no generation"
    os.kill(a.proc.pid, signal.SIGUSR2)
    beats = _heartbeats(a, 1.5)
    ages = [hb.step_age_ns for _, hb in beats]
    # Every 50ms (generous slack for a loaded machine), none missing while the step hangs.
    gaps = [b - a_ for (a_, _), (b, _) in zip(beats, beats[1:])]
    assert len(beats) >= 15 and max(gaps) < 0.4, gaps
    hung = [hb for _, hb in beats if hb.step_age_ns > 100_000_000]
    assert hung and all(hb.step == hung[0].step for hb in hung), f"no single step older than 0.1 s: {ages}"
    hung_ages = [hb.step_age_ns for hb in hung]
    assert hung_ages == sorted(set(hung_ages)), f"the hung step's age does not grow: {hung_ages}"
    last = hung[-1]
    assert last.step_age_ns > 1_000_000_000 and last.running == 1
    # The estimate comes from the fake's measured steps (~5 ms each, one token).
    assert 1_000_000 < last.step_expected_ns < 200_000_000, last
    assert last.step_tokens == 1
    assert "debug hang requested" in a.log()
    assert not st.finished


def test_request_path_is_warmed_before_any_request():
    """A fresh engine turns one throwaway chat request into its input before it
    serves or sleeps (the chat template compiles on first use: paid at start, not
    in a takeover's adoption); a tokenizer that fails it does not stop the engine."""
    from frmps_engine.sdk.adapters import EngineOptions
    from frmps_engine.sdk.runner import Runner
    from frmps_engine.sdk.testing.fake_engine import FakeAdapter

    class Counting(FakeAdapter):  # test double: counts the conversions
        calls: list = []

        def tokenizer(self):
            tok = super().tokenizer()
            calls = self.calls

            class Tok(type(tok)):
                def apply_chat_template(self, messages, add_generation_prompt=True):
                    calls.append(("chat", [m["content"] for m in messages]))
                    return super().apply_chat_template(messages, add_generation_prompt)

            tok.__class__ = Tok
            return tok

        def sampling_params(self, p, seed):
            self.calls.append(("params", p.max_tokens))
            return super().sampling_params(p, seed)

    class Tables:  # test double: a tokenizer whose byte table warm-up asks for its backend
        built = 0

        def decode_backend(self):
            Tables.built += 1
            return None

    class WithTable(Counting):
        def tokenizer(self):
            return Tables() if Counting.calls else super().tokenizer()

    runner = object.__new__(Runner)
    runner.adapter = WithTable(EngineOptions("fake-tiny"))
    runner._warm_request_path()
    assert ("chat", ["warm-up"]) in Counting.calls and ("params", 1) in Counting.calls
    assert Tables.built == 1  # the detokenizer's byte table: built here, not in a takeover

    class Broken(FakeAdapter):
        def sampling_params(self, p, seed):
            raise RuntimeError("no sampling here")

    runner.adapter = Broken(EngineOptions("fake-tiny"))
    runner._warm_request_path()  # logged, not raised


# TEST DOUBLE of py-spy: records its arguments, then waits for SIGINT (py-spy's
# "stop and write") and writes one raw stack line to --output.
FAKE_PY_SPY = r"""#!PYTHON
import json, os, signal, sys, time
args = sys.argv[1:]
open(sys.argv[0] + ".args", "w").write(json.dumps(args))
def stop(*_):
    # Written whole, then renamed into place: the test waits for the file to appear
    # and reads it at once (an open-then-write was once read empty).
    out = args[args.index("--output") + 1]
    open(out + ".tmp", "w").write("MainThread;run (frmps_engine/sdk/runner.py:1) 1\n")
    os.replace(out + ".tmp", out)
    sys.exit(0)
signal.signal(signal.SIGINT, stop)
time.sleep(60)
"""


def test_start_profile_samples_the_start_and_stops_at_ready(sup, tmp_path):
    """FRMPS_DEBUG_STARTUP_PROFILE: the engine runs py-spy on itself from its start
    and interrupts it once it is up (the standby: built and waiting for Sleep), so
    the stacks cover exactly the start."""
    fake = tmp_path / "py-spy"
    fake.write_text(FAKE_PY_SPY.replace("PYTHON", sys.executable))
    fake.chmod(0o755)
    out = tmp_path / "profiles"
    s = sup.spawn("standby", "s", env={"FRMPS_DEBUG_STARTUP_PROFILE": str(out), "FRMPS_PY_SPY": str(fake)})
    sup.accept(s)
    sup.welcome(s)
    want = out / f"start-standby-{s.proc.pid}.stacks"
    deadline = time.monotonic() + 30
    while not want.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert want.read_text().startswith("MainThread;run")
    args = json.loads((tmp_path / "py-spy.args").read_text())
    assert args[:3] == ["record", "--pid", str(s.proc.pid)] and "--nonblocking" in args
    assert "waiting for Sleep" in s.log() and "start profile: py-spy" in s.log()


def test_start_profile_without_py_spy_is_a_warning(sup, tmp_path):
    a, _, _ = start_active(sup, env={"FRMPS_DEBUG_STARTUP_PROFILE": str(tmp_path), "FRMPS_PY_SPY": "",
                                     "PATH": "/nonexistent"})
    deadline = time.monotonic() + 30
    while "serving on" not in a.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "no py-spy" in a.log() and "serving on" in a.log()
    assert list(tmp_path.iterdir()) == []


def test_torch_pools_breakdown_sums_segments_by_kind_of_pool():
    """The standby's after-Sleep note: torch's segments (as torch.cuda.memory_snapshot
    lists them; made up here) summed per kind of pool — the default pool, CUDA-graph
    pools (ids (n, 0)) and MemPools (ids (0, n), the frmps pools' contexts)."""
    from frmps_engine.sdk.diagnostics import torch_pools_breakdown

    mib = 2**20
    segs = [
        {"segment_pool_id": (0, 0), "total_size": 20 * mib, "allocated_size": 4 * mib},
        {"segment_pool_id": (0, 0), "total_size": 2 * mib, "allocated_size": 2 * mib},
        {"segment_pool_id": (3, 0), "total_size": 100 * mib, "allocated_size": 60 * mib},
        {"segment_pool_id": (5, 0), "total_size": 60 * mib, "allocated_size": 0},
        {"segment_pool_id": (0, 1), "total_size": 1000 * mib, "allocated_size": 990 * mib},
    ]
    b = torch_pools_breakdown(segs)
    assert b == {"default": {"reserved": 22.0, "allocated": 6.0, "pools": 1},
                 "graphs": {"reserved": 160.0, "allocated": 60.0, "pools": 2},
                 "mempools": {"reserved": 1000.0, "allocated": 990.0, "pools": 1}}
    assert torch_pools_breakdown([]) == {}


def test_the_standby_memory_note_reads_back(tmp_path):
    """What the standby logs after Sleep is what the harnesses parse."""
    from bench import loglines
    from frmps_engine.sdk.diagnostics import pools_note, threads_note, torch_pools_breakdown
    from frmps_engine.sdk.stack import StandbyStack

    mib = 2**20
    b = torch_pools_breakdown([{"segment_pool_id": (0, 0), "total_size": 24 * mib, "allocated_size": 8 * mib},
                               {"segment_pool_id": (2, 0), "total_size": 164 * mib, "allocated_size": 150 * mib}])
    class Stack:  # TEST DOUBLE of sdk.stack.ContextStack: a stack the driver grew to 2 KiB
        size = 2048

        def get(self):
            return self.size

        def set(self, n):
            self.size = n
            return n

        def mib(self, n):
            return n * 270336 / 2**20

    stack = StandbyStack(Stack()).shrink()
    log = tmp_path / "standby.log"
    log.write_text("x INFO frmps_engine.sdk.runner: standby asleep with 2 brokered pools mapped read-only "
                   f"(map 11.20 ms, ready 21281 ms after start){pools_note(b)}{stack}{threads_note()}\n")
    assert loglines.standby_pools(str(log)) == {"default": {"reserved": 24.0, "allocated": 8.0},
                                                "graphs": {"reserved": 164.0, "allocated": 150.0}}
    assert loglines.grep_first(str(log), loglines.SLEEP) == ["11.20", "21281"]
    assert loglines.standby_stack_bytes(str(log)) == 2048  # what it had, before giving 1 KiB back
    assert loglines.standby_pools(str(tmp_path / "none.log")) is None
    assert loglines.standby_stack_bytes(str(tmp_path / "none.log")) is None


def test_threads_note_counts_this_process_threads_by_name(tmp_path):
    import threading

    from frmps_engine.sdk.diagnostics import threads_note

    for tid, name in ((1, "python3"), (2, "python3"), (3, "grpc_global_tim"), (4, "cuda-EvtHandlr"), (5, "python3")):
        (tmp_path / str(tid)).mkdir()
        (tmp_path / str(tid) / "comm").write_text(name + "\n")
    (tmp_path / "6").mkdir()  # a thread that ended between the listing and the read
    assert threads_note(str(tmp_path)) == "; 5 threads (python3 3, cuda-EvtHandlr 1, grpc_global_tim 1)"
    assert threads_note(str(tmp_path), top=1) == "; 5 threads (python3 3, ...)"
    assert threads_note(str(tmp_path / "none")) == ""

    # This process, with one more thread than before.
    stop = threading.Event()
    before = int(threads_note().split()[1])
    t = threading.Thread(target=stop.wait, name="frmps-note-probe")
    t.start()
    try:
        assert int(threads_note().split()[1]) == before + 1
    finally:
        stop.set()
        t.join()


class _GroupAdapter(FakeAdapter):
    """TEST DOUBLE of a tensor-parallel adapter (engine_api.ProcessGroup) over the fake
    engine: ``dead`` is the cause dead_peer reports (None: every rank alive)."""

    def __init__(self, dead):
        super().__init__(EngineOptions("fake-tiny"))
        self.dead, self.asked = dead, []

    def group_memory(self, local):
        return local

    def on_peer_death(self, fn):
        pass

    def dead_peer(self, wait_s):
        self.asked.append(wait_s)
        return self.dead


def _group_runner(tmp_path, dead, exit_fn):
    from frmps_engine.sdk.memory import get_backend
    from frmps_engine.sdk.runner import Runner, RunnerConfig

    cfg = RunnerConfig(role="active", control_socket=str(tmp_path / "c"), generation_socket=str(tmp_path / "g"))
    return Runner(cfg, _GroupAdapter(dead), get_backend("host-shm"), exit_fn=exit_fn)


def test_a_step_failing_on_a_dead_peer_reports_the_peer(tmp_path):
    from frmps_engine.sdk.runner import EXIT_PEER_DIED, PEER_DEATH_WAIT_S

    codes = []
    r = _group_runner(tmp_path, "tensor-parallel rank 1 (pid 7) died: killed by signal 9", codes.append)
    r._step_failed(RuntimeError("gloo: connection closed by peer"))
    assert codes == [EXIT_PEER_DIED]
    assert r.adapter.asked == [PEER_DEATH_WAIT_S]
    # Every rank alive: the error is the engine's own; nothing exits here (the loop fails
    # the requests, then on_fatal exits with EXIT_ERROR).
    codes.clear()
    r = _group_runner(tmp_path, None, codes.append)
    r._step_failed(RuntimeError("a bug"))
    assert codes == []


def test_a_peer_death_is_reported_once_and_the_second_reporter_waits(tmp_path):
    """The group's watcher and the failed step may both report the death: one exits,
    the other must not go on (a loop that went on would fail its requests)."""
    from frmps_engine.sdk.runner import EXIT_PEER_DIED

    codes, release = [], threading.Event()

    def exit_fn(code):  # TEST DOUBLE of os._exit: returns only when released
        codes.append(code)
        release.wait(30)

    r = _group_runner(tmp_path, "x", exit_fn)
    first = threading.Thread(target=r._peer_died, args=("tensor-parallel rank 1 died",))
    second = threading.Thread(target=r._peer_died, args=("tensor-parallel rank 1 died",))
    first.start()
    deadline = time.monotonic() + 10
    while not codes and time.monotonic() < deadline:
        time.sleep(0.01)
    second.start()
    second.join(0.3)
    assert second.is_alive(), "the second report went on while the first was ending the process"
    release.set()
    first.join(10)
    second.join(10)
    assert codes == [EXIT_PEER_DIED]


@pytest.mark.parametrize("standby_kv", ["readonly", "writable"])
def test_handover_resets_the_core_before_the_pools_go_read_only(tmp_path, monkeypatch, standby_kv):
    """A core's reset may run device work (vLLM's runs a step that hands the model
    runner the finished request ids): it must come before the read-only flips and
    the reply, never after, and be finished on the device before the reply (with a
    writable KV cache no flip would catch a late write). Measured on the GPU with
    the reset moved after the reply: the yielded vLLM engine's reset step hit an
    illegal address on its read-only pools."""
    from frmps_engine._proto.frmps.v1 import control_pb2 as cpb
    from frmps_engine.sdk.loop import EngineLoop
    from frmps_engine.sdk.memory import get_backend
    from frmps_engine.sdk.runner import Runner, RunnerConfig

    events = []
    monkeypatch.setenv("FRMPS_FAKE_STEP_DELAY_MS", "5")  # the request is still running at the handover
    monkeypatch.setenv("FRMPS_STANDBY_KV", standby_kv)  # writable: the KV cache stays read-write asleep
    monkeypatch.setattr("frmps_engine.sdk.runner._synchronize", lambda device: events.append("device synchronised"))
    adapter = FakeAdapter(EngineOptions("fake-tiny"))
    mem = get_backend("host-shm")
    pools = mem.allocate(adapter.pool_layout())
    try:
        core = adapter.create_core({p.spec.key: p.tensor for p in pools}, load_weights=True)
        reset = core.reset
        core.reset = lambda: (events.append("reset"), reset())[1]

        class Recording:  # TEST DOUBLE of the memory backend's flips
            def make_readonly(self, tag):
                events.append(f"read-only {tag}")

        cfg = RunnerConfig(role="active", control_socket=str(tmp_path / "c"), generation_socket=str(tmp_path / "g"))
        r = Runner(cfg, adapter, mem, exit_fn=lambda code: events.append(f"exit {code}"))
        r.memory, r.core = Recording(), core
        r.loop = EngineLoop(core)
        r.loop.start()
        r.backend.is_serving = True
        s = r.loop.submit(1, [104, 105], cpb.SamplingParams(max_tokens=1000), FakeParams(1000, 0.0, 1))
        deadline = time.monotonic() + 10
        while len(s.output) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        rep = r.on_handoff(1, cpb.Handoff())
        events.append("reply")
        assert rep is not None and rep.ok, rep
        kv = ["read-only kv_cache"] if standby_kv == "readonly" else []
        assert events == ["reset", "device synchronised", *kv, "read-only weights", "reply"]
        assert s.moved and not core.has_work() and r.role == cpb.ROLE_STANDBY
    finally:
        mem.close()


def test_an_adapter_that_refuses_its_options_exits_refused(sockdir, tmp_path):
    """An engine whose constructor raises ValueError (vLLM's config checks do, e.g.
    before the KV cache is sized) refused its options: the refusal exit code, whose
    meaning the supervisor knows (no restart before anything served), not a
    traceback's 1."""
    (tmp_path / "refusing_adapter.py").write_text(
        "def Refusing(opts):\n    raise ValueError('--num-blocks is required with this engine')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "frmps_engine.cli", "serve", "--engine", "refusing_adapter:Refusing",
                        "--role", "active", "--model", "fake-tiny", "--control-socket", f"{sockdir}/c",
                        "--generation-socket", f"{sockdir}/g"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "engine cannot start: --num-blocks is required with this engine" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_an_unknown_engine_option_exits_refused(sockdir):
    """A command line the engine's parser refuses (a bad --engine-arg) is a refusal."""
    r = subprocess.run([sys.executable, "-m", "frmps_engine.cli", "serve", "--engine", FAKE, "--role", "active",
                        "--model", "fake-tiny", "--control-socket", f"{sockdir}/c", "--generation-socket",
                        f"{sockdir}/g", "--bogus"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unrecognized arguments: --bogus" in r.stderr, r.stderr
