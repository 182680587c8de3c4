"""FrmpsAsyncMPClient (frmps_engine.vllm.frontend.client): vLLM's own asyncio
engine-core client, real ZMQ sockets and vLLM's own msgpack structs, re-pointed
from a dead engine to a promoted one mid-stream.

The engines here are TEST DOUBLES (``FakeEngine``): a thread that speaks vLLM's
engine-core socket protocol (DEALER with the engine's identity + PUSH, a ready
message, ADD/ABORT in, EngineCoreOutputs out) with vLLM's own encoder and
decoder, and emits token ``f(seed, index)`` per step — the stateless
(seed, position) sampling a standby relies on. The promoted double adopts the
client's resume entries and continues each request after the tokens the
frontend received, as the real engine must."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from vhelpers import make_vllm_config, write_tiny_model

MAX_TOKENS = 12
KILL_AFTER = 5  # tokens of every request before the first engine "dies"


def token(seed: int, index: int) -> int:
    return (seed * 31 + index * 7) % 500 + 3


class FakeEngine(threading.Thread):
    """TEST DOUBLE of an engine process on vLLM's engine-core sockets."""

    def __init__(self, input_addr: str, output_addr: str, *, adopt=(), stop_after: int | None = None,
                 hang: bool = False, expect: int = 0, fence: bool = False):
        super().__init__(daemon=True)
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        self.T = EngineCoreRequestType
        self.Out, self.Outs = EngineCoreOutput, EngineCoreOutputs
        self.enc, self.dec_req, self.dec_any = MsgpackEncoder(), MsgpackDecoder(EngineCoreRequest), MsgpackDecoder()
        self.input_addr, self.output_addr = input_addr, output_addr
        # Stop working once `expect` requests arrived and each has emitted stop_after
        # tokens (not after a number of batches: on a loaded machine the client's
        # requests arrive some batches apart).
        self.stop_after, self.expect = stop_after, expect
        self.hang = hang  # after stop_after: stop working but keep the sockets open (a wedged engine)
        self.fence = fence  # after stop_after: a planned handover's fence after the last outputs, then close
        self.stopped_working = threading.Event()
        # engine id -> [seed, next index, max_tokens]
        self.running: dict[str, list[int]] = {}
        for e in adopt:
            sp = e.request.sampling_params
            self.running[e.engine_id] = [sp.seed, len(e.delivered), sp.max_tokens]
        self.received: list[str] = []
        self.aborted: list[str] = []
        self.stop = threading.Event()
        self.ctx = zmq.Context()

    def run(self):
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, (0).to_bytes(2, "little"))
        dealer.setsockopt(zmq.LINGER, 0)
        push = self.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.input_addr)
        push.connect(self.output_addr)
        dealer.send(b"")  # ready; an empty payload is accepted (no ready response)
        try:
            while not self.stop.is_set():
                while dealer.poll(0):
                    kind, *frames = dealer.recv_multipart(copy=False)
                    kind = bytes(kind.buffer)
                    if kind == self.T.ADD.value:
                        r = self.dec_req.decode(frames)
                        self.received.append(r.request_id)
                        self.running[r.request_id] = [r.sampling_params.seed, 0, r.sampling_params.max_tokens]
                    elif kind == self.T.ABORT.value:
                        for rid in self.dec_any.decode(frames):
                            self.aborted.append(rid)
                            self.running.pop(rid, None)
                outs = []
                for rid, st in list(self.running.items()):
                    seed, i, mx = st
                    done = i + 1 >= mx
                    outs.append(self.Out(request_id=rid, new_token_ids=[token(seed, i)],
                                         finish_reason=self._length() if done else None))
                    st[1] += 1
                    if done:
                        del self.running[rid]
                if outs:
                    push.send_multipart(self.enc.encode(self.Outs(engine_index=0, outputs=outs)), copy=False)
                    if self.stop_after is not None and len(self.received) >= self.expect and all(
                            st[1] >= self.stop_after for st in self.running.values()):
                        self.stopped_working.set()
                        if self.hang:
                            self.stop.wait()
                        if self.fence:
                            from vllm.v1.engine import UtilityOutput, UtilityResult

                            from frmps_engine.vllm.frontend import HANDOVER_FENCE_CALL_ID
                            fence = UtilityOutput(HANDOVER_FENCE_CALL_ID, result=UtilityResult(None))
                            push.send_multipart(self.enc.encode(self.Outs(engine_index=0, utility_output=fence)))
                        # dies: no goodbye; the outputs already sent are delivered first
                        # (a close with linger 0 could drop the last batch still queued in
                        # the socket, and the test counts on the tokens it sent).
                        push.close(2000)
                        return
                time.sleep(0.005)
        finally:
            dealer.close(0)
            push.close(0)
            self.ctx.term()

    def _length(self):
        from vllm.v1.engine import FinishReason

        return FinishReason.LENGTH


def make_request(rid: str, sp):
    from vllm.v1.engine import EngineCoreRequest

    return EngineCoreRequest(rid, [1, 2, 3], None, sp, None, time.time(), None, None, None)


@pytest.mark.parametrize("first_fate", ["dies", "wedged"])
def test_stream_continues_on_a_promoted_engine_exactly_once(tmp_path, addrs, first_fate):
    """``dies``: the first engine's sockets close (a killed process). ``wedged``:
    they stay open while the promoted engine connects under the same identity,
    which only the ROUTER's handover lets it take."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.executor import Executor

    from frmps_engine.vllm.frontend.client import FrmpsAsyncMPClient

    cfg = make_vllm_config(write_tiny_model(tmp_path / "m"))
    in_addr, out_addr = addrs

    async def main():
        first = FakeEngine(in_addr, out_addr, stop_after=KILL_AFTER, hang=first_fate == "wedged", expect=3)
        first.start()
        client = FrmpsAsyncMPClient(cfg, Executor, False, client_addresses={
            "input_address": in_addr, "output_address": out_addr})
        try:
            seeded = SamplingParams(max_tokens=MAX_TOKENS, seed=11)
            # Two children of one unseeded n=2 request share a SamplingParams object in vLLM.
            shared = SamplingParams(max_tokens=MAX_TOKENS)
            reqs = [make_request("cmpl-a", seeded), make_request("0_cmpl-b", shared), make_request("1_cmpl-b", shared)]
            for r in reqs:
                await client.add_request_async(r)
            seeds = {r.request_id: r.sampling_params.seed for r in reqs}  # engine ids now
            assert len(set(seeds.values())) == 3 and seeds["frmps-1"] == 11

            got: dict[str, list[int]] = {}
            finished: set[str] = set()

            async def drain(until):
                while not until():
                    outs = await asyncio.wait_for(client.get_output_async(), 10)
                    for o in outs.outputs:
                        got.setdefault(o.request_id, []).extend(o.new_token_ids)
                        if o.finish_reason is not None:
                            finished.add(o.request_id)

            await drain(lambda: all(len(got.get(f, [])) >= KILL_AFTER for f in ("cmpl-a", "0_cmpl-b", "1_cmpl-b")))
            assert first.stopped_working.wait(5)
            if first_fate == "dies":
                first.join(5)
                assert not first.is_alive()

            # The supervisor's part, done here by hand: the engine is gone.
            client.engine_lost()
            late = make_request("cmpl-late", SamplingParams(max_tokens=4, seed=3))
            await client.add_request_async(late)  # held: no engine to send it to
            await client.abort_requests_async(["1_cmpl-b"])  # held too
            entries = client.resume_entries()
            assert [e.frontend_id for e in entries] == ["cmpl-a", "0_cmpl-b"]
            assert all(e.delivered == got[e.frontend_id] for e in entries)

            second = FakeEngine(in_addr, out_addr, adopt=entries)
            second.start()
            await client.wait_engine_back(timeout=10)
            await drain(lambda: {"cmpl-a", "0_cmpl-b", "cmpl-late"} <= finished)
            for eng in (first, second):
                eng.stop.set()
                eng.join(5)

            want = {"cmpl-a": [token(11, i) for i in range(MAX_TOKENS)],
                    "0_cmpl-b": [token(seeds["frmps-2"], i) for i in range(MAX_TOKENS)],
                    "cmpl-late": [token(3, i) for i in range(4)]}
            for fid, toks in want.items():
                assert got[fid] == toks, fid  # every token once, in order, under the frontend's id
            assert second.received == ["frmps-4"], "only the held request is sent afresh"
            assert second.aborted == ["frmps-3"]
            assert len(client.ledger) == 0
        finally:
            client.shutdown()

    asyncio.run(main())


def test_wait_engine_back_times_out_and_needs_engine_lost(tmp_path, addrs):
    from vllm.v1.executor import Executor

    from frmps_engine.vllm.frontend.client import FrmpsAsyncMPClient

    cfg = make_vllm_config(write_tiny_model(tmp_path / "m"))
    in_addr, out_addr = addrs

    async def main():
        eng = FakeEngine(in_addr, out_addr, stop_after=0)
        eng.start()
        client = FrmpsAsyncMPClient(cfg, Executor, False, client_addresses={
            "input_address": in_addr, "output_address": out_addr})
        try:
            with pytest.raises(RuntimeError, match="without engine_lost"):
                await client.wait_engine_back(timeout=0.1)
            client.engine_lost()
            with pytest.raises(asyncio.TimeoutError):
                await client.wait_engine_back(timeout=0.2)
        finally:
            client.shutdown()
            eng.stop.set()
            eng.join(5)

    asyncio.run(main())


def test_a_handovers_fence_ends_the_drain_at_once_and_is_rearmed(tmp_path, addrs):
    """A planned handover: the engine sends its fence after its last outputs. The
    drain before the resume set ends when the fence has come through vLLM's output
    task (every output before it recorded), not after a quiet period (60 s here,
    so a drain that waited for it would not finish); the fence is not among the
    utility calls engine_lost() fails, and the promoted engine gets a fresh one."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.executor import Executor

    from frmps_engine.vllm.frontend import HANDOVER_FENCE_CALL_ID
    from frmps_engine.vllm.frontend.client import FrmpsAsyncMPClient

    cfg = make_vllm_config(write_tiny_model(tmp_path / "m"))
    in_addr, out_addr = addrs

    async def main():
        first = FakeEngine(in_addr, out_addr, stop_after=KILL_AFTER, expect=1, fence=True)
        first.start()
        client = FrmpsAsyncMPClient(cfg, Executor, False, client_addresses={
            "input_address": in_addr, "output_address": out_addr})
        try:
            await client.add_request_async(make_request("cmpl-h", SamplingParams(max_tokens=MAX_TOKENS, seed=5)))
            assert first.stopped_working.wait(10)
            first.join(5)
            sent = first.running["frmps-1"][1]  # tokens the engine sent before its fence
            client.engine_lost()
            assert HANDOVER_FENCE_CALL_ID in client.utility_results or client._fence.done()
            assert await asyncio.wait_for(client.drain_outputs(timeout=60, settle=60), 20)
            (entry,) = client.resume_entries()
            assert entry.delivered == [token(5, i) for i in range(sent)]  # every output before the fence
            second = FakeEngine(in_addr, out_addr, adopt=[entry])
            second.start()
            await client.wait_engine_back(timeout=10)
            assert client.utility_results.get(HANDOVER_FENCE_CALL_ID) is client._fence and not client._fence.done()
            second.stop.set()
            second.join(5)
        finally:
            client.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("fate", ["dies", "wedged"])
def test_a_dead_engines_closed_connection_ends_the_drain(tmp_path, addrs, fate):
    """After a failover no fence comes. ``dies``: the engine's connection closes
    after its last outputs; the output socket's monitor sees it, so the drain
    ends once the socket is empty (not after the quiet period, 60 s here) with
    every token the engine sent recorded. ``wedged``: the connection stays open,
    so the drain waits for the quiet period (0.3 s); its connection closing after
    the promoted engine's opened does not end the promoted engine's drain early."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.executor import Executor

    from frmps_engine.vllm.frontend.client import FrmpsAsyncMPClient

    cfg = make_vllm_config(write_tiny_model(tmp_path / "m"))
    in_addr, out_addr = addrs

    async def main():
        first = FakeEngine(in_addr, out_addr, stop_after=KILL_AFTER, expect=1, hang=fate == "wedged")
        first.start()
        client = FrmpsAsyncMPClient(cfg, Executor, False, client_addresses={
            "input_address": in_addr, "output_address": out_addr})
        try:
            assert client._monitor is not None
            await client.add_request_async(make_request("cmpl-x", SamplingParams(max_tokens=MAX_TOKENS, seed=9)))
            assert first.stopped_working.wait(10)
            if fate == "dies":
                first.join(5)
            sent = first.running["frmps-1"][1]
            client.engine_lost()
            t0 = time.monotonic()
            settle = 60 if fate == "dies" else 0.3
            assert await asyncio.wait_for(client.drain_outputs(timeout=90, settle=settle), 20)
            took = time.monotonic() - t0
            if fate == "wedged":
                assert took >= 0.3, took
            (entry,) = client.resume_entries()
            assert entry.delivered == [token(9, i) for i in range(sent)]  # every output it sent
            # The promoted engine connects (it stops after two tokens and closes when told).
            second = FakeEngine(in_addr, out_addr, adopt=[entry], stop_after=sent + 2, expect=0, hang=True)
            second.start()
            await client.wait_engine_back(timeout=10)
            if fate == "wedged":
                # The wedged engine's connection closes only now, after the promoted one's
                # opened: that must not count as the connection of the engine now serving.
                first.stop.set()
                first.join(5)
                await asyncio.sleep(0.3)
                assert not client._read_monitor()
            assert second.stopped_working.wait(10)
            second.stop.set()
            second.join(5)  # dies: its connection closes
            client.engine_lost()
            assert await asyncio.wait_for(client.drain_outputs(timeout=90, settle=60), 20)
            (entry,) = client.resume_entries()
            assert entry.delivered == [token(9, i) for i in range(second.running["frmps-1"][1])]
            first.stop.set()
            first.join(5)
        finally:
            client.shutdown()

    asyncio.run(main())


def test_connections_pair_a_late_accepted_with_the_connection_it_opened():
    """The output socket's connections as its monitor reports them (client.Connections).
    libzmq reports a connection's ACCEPTED from its listener after handing the
    connection to another I/O thread, so a connection that closes quickly can be
    reported DISCONNECTED first (seen once in ~160 loaded runs of the drain test
    above, which then waited out its 60 s quiet period): that late ACCEPTED must not
    leave the closed connection counted open."""
    from frmps_engine.vllm.frontend.client import Connections

    c = Connections()
    c.closed(12)  # reported before its ACCEPTED
    assert not c.open
    c.opened(12)  # the same connection's ACCEPTED, late
    assert not c.open, "a closed connection's late ACCEPTED counted it open"
    c.opened(12)  # a new connection on the fd, reported in order
    assert c.open == {12}
    c.closed(12)
    assert not c.open

    # One accepted before the monitor started is only seen closing; a connection
    # on another fd stays open through it (the engine that handed over or was
    # wedged closes after the new one opened).
    c = Connections()
    c.opened(13)
    c.closed(11)
    assert c.open == {13}
    c.closed(13)
    assert not c.open
