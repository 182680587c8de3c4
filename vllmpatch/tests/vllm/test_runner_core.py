"""The engine runner's core mode (sdk/runner.py, ``--core-input/--core-output``):
the SDK's Runner, in process, serving vLLM's engine-core protocol to vLLM's own
FrmpsAsyncMPClient over real ipc sockets, driven over its real control socket.

TEST DOUBLES: ``Supervisor`` below plays the Go supervisor's control side (and,
with the client's ``engine_lost``/``resume_entries``/``wait_engine_back``, the
frontend calls it will make); ``testing.cpu_adapter`` is the vLLM adapter with
vLLM's real scheduler over ``SchedulerCore`` and the seeded stand-in model of
test_engine_server (token = f(seed, position)), so the no-fault stream of every
request is known from its seed (``expected``) and a lost, repeated or reseeded
token changes it. The pools are host-shm pools nothing writes; the ring is real.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading

import pytest

from frmps_engine._proto.frmps.v1 import control_pb2 as c
from test_engine_server import (KILL_AFTER, MAX_TOKENS, STEP_S, Collector, SeededFakeModel, expected, late_request,
                                make_client, requests)
from vhelpers import write_tiny_model

FIDS = ("cmpl-a", "0_cmpl-b", "1_cmpl-b", "cmpl-c")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


class Engine:
    """One Runner in this process, and the supervisor's end of its control socket."""

    def __init__(self, runner, conn, thread, exits):
        self.runner, self.conn, self.thread, self.exits = runner, conn, thread, exits
        self.code = None
        self.fds: list[int] = []

    def recv(self, *kinds, timeout=30):
        """The next message of one of ``kinds`` (heartbeats skipped)."""
        self.conn._sock.settimeout(timeout)
        while True:
            env, fds = self.conn.recv()
            kind = env.WhichOneof("msg")
            if kind == "heartbeat":
                continue
            assert kind in kinds, f"unexpected {kind}: {env}"
            return env, fds

    def cmd(self, env, fds=()):
        self.conn.send(env, list(fds))
        while True:
            got, _ = self.recv("reply", "ready")
            if got.WhichOneof("msg") == "reply":
                assert got.id == env.id
                return got.reply


class Supervisor:
    """TEST DOUBLE of the supervisor's control side."""

    def __init__(self, d, model_dir, addrs):
        from frmps_engine.ring import create_ring

        self.d, self.model_dir, self.addrs = d, model_dir, addrs
        self.ring = os.path.join(d, "ring")
        create_ring(self.ring, 1 << 20)
        self.engines: list[Engine] = []
        self.pools: list[c.Pool] = []
        self.fds: list[int] = []

    def spawn(self, name, role, *, core_mode=True, adapter=None, mode="sync") -> Engine:
        from frmps_engine.sdk.control import ControlConn
        from frmps_engine.sdk.memory import get_backend
        from frmps_engine.sdk.runner import Runner, RunnerConfig
        from frmps_engine.vllm.testing import cpu_adapter

        ctl = os.path.join(self.d, f"{name}.ctl")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(ctl)
        srv.listen(1)
        srv.settimeout(30)
        exits: list[int] = []
        core = dict(core_input=self.addrs[0], core_output=self.addrs[1]) if core_mode else {}
        runner = Runner(
            RunnerConfig(role=role, control_socket=ctl, generation_socket="" if core_mode else os.path.join(self.d, f"{name}.gen"),
                         heartbeat_s=30, **core),
            adapter or cpu_adapter(self.model_dir, model_factory=SeededFakeModel, device_s=STEP_S,
                                   async_scheduling=mode == "async"),
            get_backend("host-shm"), exit_fn=exits.append,
        )
        e = Engine(runner, None, None, exits)

        def run():
            e.code = runner.run()

        e.thread = threading.Thread(target=run, daemon=True)
        e.thread.start()
        s, _ = srv.accept()
        srv.close()
        e.conn = ControlConn(s)
        self.engines.append(e)
        env, _ = e.recv("hello")
        assert env.hello.role == (c.ROLE_ACTIVE if role == "active" else c.ROLE_STANDBY)
        assert env.hello.engine == "vllm"
        if core_mode:
            assert env.hello.generation_endpoint == "", "core mode serves no generation API"
        e.conn.send(c.Envelope(welcome=c.Welcome(accepted=True, protocol_version=c.PROTOCOL_VERSION_1,
                                                 ring_path=self.ring if role == "active" else "", sync_every=1,
                                                 deployment_id="test")))
        if role == "active":
            env, fds = e.recv("pool_export")
            self.pools, self.fds = list(env.pool_export.pools), fds
            e.recv("ready")
        return e

    def sleep(self, e: Engine):
        r = e.cmd(c.Envelope(id=1, sleep=c.Sleep(pools=self.pools)), self.fds)
        assert r.ok, r.error

    def close(self):
        for e in self.engines:
            if e.code is None and e.thread.is_alive():
                try:
                    e.cmd(c.Envelope(id=99, shutdown=c.Shutdown(grace_ms=50)))
                except Exception:
                    pass
            e.thread.join(30)
            e.conn.close()
            e.runner.memory.close()
        for fd in self.fds:
            os.close(fd)


@pytest.fixture
def sup(sockdir, model_dir, addrs):
    s = Supervisor(sockdir, model_dir, addrs)
    yield s
    s.close()


def resume_set(entries, snapshots) -> list[c.ResumeRequest]:
    """The control Resume's requests from the frontend's resume entries (the
    EngineCoreRequest in vLLM's msgpack, as the frontend process will send it)
    and the ring's snapshot."""
    from vllm.v1.serial_utils import MsgpackEncoder

    enc = MsgpackEncoder()
    out = []
    for e in entries:
        frames = enc.encode(e.request)
        assert len(frames) == 1, "a text request encodes as one msgpack buffer"
        r = c.ResumeRequest(key=e.key, engine_request=bytes(frames[0]), delivered_token_ids=e.delivered)
        st = snapshots.get(e.key)
        if st is not None:
            r.snapshot.CopyFrom(c.RequestSnapshot(block_ids=list(st.blocks), token_ids=list(st.tokens),
                                                  num_prompt_tokens=st.num_prompt, num_computed_tokens=st.num_computed,
                                                  seed=st.seed, step=st.step))
        out.append(r)
    return out


async def logged(caplog, text, timeout=10.0):
    """The first captured log message containing text, waiting up to timeout for it."""
    import asyncio

    for _ in range(int(timeout / 0.01)):
        line = next((x.getMessage() for x in caplog.records if text in x.getMessage()), None)
        if line is not None:
            return line
        await asyncio.sleep(0.01)
    raise AssertionError(f"no log message with {text!r} within {timeout} s")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_core_mode_serves_hands_over_and_takes_over_exactly_once(sup, model_dir, addrs, mode, caplog):
    """(a) Runner A, an active in core mode, serves four requests from vLLM's
    client. (c) After KILL_AFTER tokens a Handoff moves them to standby B (a
    planned handover): A publishes every request, disconnects without ending
    any, sleeps; the ring's record of each request holds exactly the tokens the
    frontend received. (d) B first gets a Resume without engine_request: refused
    by name, nothing adopted. (b) B adopts the Resume built from the client's
    resume entries and A's ring record, connects under the engine's identity;
    the streams go on. B then dies without a word (its sockets close); A, a
    standby since its handover, adopts B's requests from B's ring records and
    the tokens the frontend received, and every stream ends with each token
    exactly once, equal to the no-fault run. An abort and a new request issued
    during the first gap are honoured. ``mode``: vLLM's synchronous step, or async
    scheduling (a batch in flight: the handover finishes it first)."""
    from vllm.v1.engine import FinishReason

    from bench import loglines
    from frmps_engine.ring.reader import RingReader

    caplog.set_level("INFO", logger="frmps_engine.sdk.runner")

    async def main():
        a = sup.spawn("a", "active", mode=mode)
        b = sup.spawn("b", "standby", mode=mode)
        sup.sleep(b)
        client = make_client(model_dir, addrs)
        reader = RingReader(sup.ring)
        try:
            # (a) serving
            reqs = requests()
            for r in reqs:
                await client.add_request_async(r)
            seeds = {r.request_id: r.sampling_params.seed for r in reqs}
            col = Collector(client)
            await col.drain(lambda: all(len(col.got.get(f, [])) >= KILL_AFTER for f in FIDS))

            # (c) planned handover A -> B
            srv_a = a.runner.server
            r = a.cmd(c.Envelope(id=2, handoff=c.Handoff()))
            assert r.ok, r.error
            assert a.runner.server is None and a.runner.role == c.ROLE_STANDBY
            assert not srv_a.loop.running and not a.runner.core.has_work()
            await col.quiet(srv_a.sent_batches)  # everything A sent reaches the frontend
            assert not col.finish, "the handover ended no request"
            client.engine_lost()
            await client.add_request_async(late_request())  # held: no engine
            await client.abort_requests_async(["cmpl-c"])  # held too
            entries = client.resume_entries()
            assert [e.frontend_id for e in entries] == ["cmpl-a", "0_cmpl-b", "1_cmpl-b"]
            reader.poll()
            snaps = dict(reader.snapshot)
            for e in entries:
                st = snaps[e.key]
                assert list(st.tokens)[st.num_prompt:] == e.delivered == col.got[e.frontend_id], \
                    "the handover published what the frontend received, no more, no less"
                assert st.num_computed == len(st.tokens) - 1

            # (d) a resume set without engine_request is refused whole
            plain = [c.ResumeRequest(key=e.key, prompt_token_ids=e.prompt_token_ids,
                                     params=c.SamplingParams(max_tokens=MAX_TOKENS), delivered_token_ids=e.delivered)
                     for e in entries]
            plain[0].engine_request = resume_set(entries[:1], {})[0].engine_request  # one of three has it
            r = b.cmd(c.Envelope(id=3, resume=c.Resume(requests=plain, ring_path=sup.ring, sync_every=1)))
            assert not r.ok and "2 of 3 requests carry no engine_request (keys 2, 3)" in r.error, r.error
            assert "core mode" in r.error and "Nothing adopted" in r.error and not r.resumed
            assert b.runner.server is None and not b.runner.core.has_work() and not b.runner._resumed

            r = b.cmd(c.Envelope(id=4, resume=c.Resume(requests=resume_set(entries, snaps), ring_path=sup.ring,
                                                       sync_every=1)))
            assert r.ok, r.error
            assert [(o.key, o.ok) for o in r.resumed] == [(e.key, True) for e in entries], r.resumed
            assert all(o.reused_tokens >= 16 for o in r.resumed), "the prompt's full block is reused from the ring"
            # The device gate (the stand-in's runner has V2's pre_forward): the connection to the frontend and
            # the first step's host work came before the reply; the harnesses read it from the log line.
            line = await logged(caplog, "took over")  # logged after the reply
            got = loglines.takeover_fields(list(loglines.TAKEOVER.search(line).groups()))
            assert got["device_gate"] and got["requests"] == len(entries), (got, line)
            assert "connected to the frontend in" in line and "before the reply" in line, line
            for e in entries:  # adopted with the request's own seed
                assert b.runner.core.scheduler.requests[e.engine_id].sampling_params.seed == seeds[e.engine_id]
            await client.wait_engine_back(timeout=10)
            await col.drain(lambda: all(len(col.got.get(f, [])) >= 3 * KILL_AFTER for f in FIDS[:3]))

            # (b) B dies: no goodbye, sockets closed
            srv_b = b.runner.server
            srv_b.halt(close_sockets=True)
            await col.quiet(srv_b.sent_batches)
            assert not {"cmpl-a", "0_cmpl-b", "1_cmpl-b"} & set(col.finish), "B was stopped mid-stream"
            client.engine_lost()
            entries = client.resume_entries()
            assert {e.frontend_id for e in entries} >= {"cmpl-a", "0_cmpl-b", "1_cmpl-b"}
            reader.poll()
            snaps = dict(reader.snapshot)
            r = a.cmd(c.Envelope(id=5, resume=c.Resume(requests=resume_set(entries, snaps), ring_path=sup.ring,
                                                       sync_every=1)))
            assert r.ok, r.error
            assert all(o.ok for o in r.resumed) and len(r.resumed) == len(entries), r.resumed
            await client.wait_engine_back(timeout=10)
            await col.drain(lambda: {"cmpl-a", "0_cmpl-b", "1_cmpl-b", "cmpl-late"} <= set(col.finish))

            # the no-fault run: the stand-in's tokens from each request's seed
            for fid, eid in (("cmpl-a", "frmps-1"), ("0_cmpl-b", "frmps-2"), ("1_cmpl-b", "frmps-3")):
                assert col.got[fid] == expected(seeds[eid]), fid  # each token once, in order
                assert col.finish[fid] == FinishReason.LENGTH
            assert col.got["cmpl-late"] == expected(3, 6, [7, 8, 9])
            assert "cmpl-c" not in col.finish and len(col.got["cmpl-c"]) < MAX_TOKENS
            assert len(client.ledger) == 0
            assert a.runner.core.counters["requests_adopted"] >= 3 and b.runner.core.counters["requests_adopted"] == 3
            assert a.exits == [] and b.exits == []
            await asyncio.sleep(0.1)
            reader.poll()
            assert reader.snapshot == {}, "A published its own state: nothing open"
        finally:
            client.shutdown()
            reader.close()

    asyncio.run(main())
