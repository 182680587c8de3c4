"""EngineCoreServer (frmps_engine.vllm.frontend.engine_server): frmps's VllmCore
behind vLLM's engine-core protocol, driven by vLLM's own FrmpsAsyncMPClient over
real ZMQ ipc sockets, with vLLM's real scheduler (FrmpsScheduler) and the ring.

TEST DOUBLES: ``SchedulerCore`` stands in for vLLM's EngineCore and
``SeededFakeModel`` (frmps_engine.vllm.testing) for the model runner: it samples token
``seeded_token(seed, position)`` from the request's own seed, the stateless
(seed, position) sampling a standby relies on, so a standby that lost or changed
a seed, repeated a token or skipped one gives a different stream.

Each fault test first runs the same requests without a fault and compares."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest
import zmq

from frmps_engine.vllm.testing import SeededFakeModel, seeded_token
from vhelpers import SchedulerCore, make_scheduler, make_vllm_config, write_tiny_model

PROMPT = list(range(10, 30))  # 20 tokens: one full block of 16 and a partial one
MAX_TOKENS = 40
KILL_AFTER = 5  # tokens every request has reached when the first engine is stopped
STEP_S = 0.02  # the stand-in device's time per step: the first engine is stopped mid-stream


class BrokenModel(SeededFakeModel):
    """TEST DOUBLE: a model runner that raises at its ``fail_at``-th step (a bug, or
    a device error reaching Python)."""

    def __init__(self, fail_at: int):
        super().__init__()
        self.fail_at = fail_at

    def run(self, scheduler, so):
        if len(self.steps) + 1 >= self.fail_at:
            raise RuntimeError("model runner failed (test double)")
        return super().run(scheduler, so)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


def make_core(model_dir, model=None, device_s=STEP_S):
    from frmps_engine.vllm import SCHEDULER_CLS
    from frmps_engine.vllm.core import VllmCore

    cfg = make_vllm_config(model_dir, num_blocks=64, max_num_seqs=8, scheduler_cls=SCHEDULER_CLS)
    return VllmCore(SchedulerCore(make_scheduler(cfg), model=model or SeededFakeModel(), device_s=device_s), None)


def make_server(model_dir, addrs, **kw):
    from frmps_engine.vllm.frontend.engine_server import EngineCoreServer

    core = make_core(model_dir, kw.pop("model", None), kw.pop("device_s", STEP_S))
    return EngineCoreServer(core, *addrs, **kw)


def make_client(model_dir, addrs):
    from vllm.v1.executor import Executor

    from frmps_engine.vllm.frontend.client import FrmpsAsyncMPClient

    in_addr, out_addr = addrs
    return FrmpsAsyncMPClient(make_vllm_config(model_dir), Executor, False,
                              client_addresses={"input_address": in_addr, "output_address": out_addr})


def make_request(rid: str, sp, prompt=PROMPT):
    from vllm.v1.engine import EngineCoreRequest

    return EngineCoreRequest(rid, list(prompt), None, sp, None, time.time(), None, None, None)


class Collector:
    """Outputs as vLLM's client hands them over, by the frontend's request id."""

    def __init__(self, client):
        self.client = client
        self.got: dict[str, list[int]] = {}
        self.finish: dict[str, int] = {}
        self.batches = 0

    async def drain(self, until, timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        while not until():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"outputs so far: {self.got}, finished: {self.finish}")
            try:
                outs = await asyncio.wait_for(self.client.get_output_async(), min(left, 1.0))
            except asyncio.TimeoutError:
                continue
            self._take(outs)

    async def quiet(self, sent: int, quiet_s: float = 1.0):
        """Take what a stopped engine sent: until ``sent`` batches arrived, or none came for quiet_s."""
        while self.batches < sent:
            try:
                outs = await asyncio.wait_for(self.client.get_output_async(), quiet_s)
            except asyncio.TimeoutError:
                return
            self._take(outs)

    def _take(self, outs):
        if outs.outputs:
            self.batches += 1
        for o in outs.outputs:
            assert o.request_id not in self.finish, f"output after the end of {o.request_id}"
            self.got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.finish[o.request_id] = int(o.finish_reason)


def expected(seed: int, n: int = MAX_TOKENS, prompt=PROMPT) -> list[int]:
    return [seeded_token(seed, len(prompt) + i) for i in range(n)]


def requests():
    """A seeded request, the two children of an unseeded n=2 request (vLLM's
    frontend sends them as two requests sharing one SamplingParams), and a
    seeded one that the fault test aborts during the gap."""
    from vllm.sampling_params import SamplingParams

    shared = SamplingParams(max_tokens=MAX_TOKENS)
    return [make_request("cmpl-a", SamplingParams(max_tokens=MAX_TOKENS, seed=11)),
            make_request("0_cmpl-b", shared), make_request("1_cmpl-b", shared),
            make_request("cmpl-c", SamplingParams(max_tokens=MAX_TOKENS, seed=-5))]


def late_request():
    from vllm.sampling_params import SamplingParams

    return make_request("cmpl-late", SamplingParams(max_tokens=6, seed=3), prompt=[7, 8, 9])


async def no_fault_run(model_dir, addrs) -> tuple[dict[str, list[int]], dict[str, int]]:
    """All requests (and the late one) on one engine, to the end."""
    server = make_server(model_dir, addrs, device_s=0.0)
    server.start()
    client = make_client(model_dir, addrs)
    try:
        reqs = requests() + [late_request()]
        for r in reqs:
            await client.add_request_async(r)
        seeds = {r.request_id: r.sampling_params.seed for r in reqs}  # engine ids now
        col = Collector(client)
        await col.drain(lambda: len(col.finish) == len(reqs))
        return col.got, seeds
    finally:
        client.shutdown()
        server.close()


def test_requests_complete_through_vllms_client(model_dir, addrs):
    """(a) vLLM's client to one engine server: every stream has the tokens the
    stand-in model samples from its seed, ends with LENGTH at max_tokens; the
    ledger is empty afterwards; the API server's own utility calls are answered,
    others refused by name."""
    from vllm.v1.engine import FinishReason

    async def main():
        server = make_server(model_dir, addrs, device_s=0.0)
        server.start()
        client = make_client(model_dir, addrs)
        try:
            assert tuple(await client.get_supported_tasks_async()) == ("generate",)
            await client.reset_mm_cache_async()
            assert await client.is_sleeping_async() is False
            assert await client.reset_prefix_cache_async() is True
            with pytest.raises(Exception, match="sleep method failed: not supported by a frmps engine"):
                await client.call_utility_async("sleep", 1)

            reqs = requests()
            for r in reqs:
                await client.add_request_async(r)
            seeds = {r.request_id: r.sampling_params.seed for r in reqs}
            assert seeds["frmps-1"] == 11 and seeds["frmps-4"] == -5
            assert seeds["frmps-2"] != seeds["frmps-3"], "the ledger gives each unseeded child its own seed"
            col = Collector(client)
            await col.drain(lambda: len(col.finish) == 4)
            for fid, eid in (("cmpl-a", "frmps-1"), ("0_cmpl-b", "frmps-2"), ("1_cmpl-b", "frmps-3"), ("cmpl-c", "frmps-4")):
                assert col.got[fid] == expected(seeds[eid]), fid
                assert col.finish[fid] == FinishReason.LENGTH
            assert len(client.ledger) == 0
            assert server.refused == []
            assert server.core.counters["steps"] > 0
        finally:
            client.shutdown()
            server.close()

    asyncio.run(main())


@pytest.mark.parametrize("first_fate", ["dies", "wedged"])
def test_failover_adopts_ledger_entries_and_streams_continue_exactly_once(model_dir, addrs, tmp_path, first_fate):
    """(b) Engine A serves four requests and publishes the ring; it is stopped
    abruptly after every stream has KILL_AFTER tokens (sockets closed, or left
    open: a wedged process), sending nothing more. The client is told
    engine_lost(); a new request and an abort are issued in the gap; engine B (its
    own scheduler and block pool) adopts client.resume_entries() with A's ring
    snapshot, connects under the same identity, and every stream ends with each
    token exactly once, in order, equal to the no-fault run (seeded, -5, and the
    ledger's derived seeds of the unseeded n=2 children)."""
    from frmps_engine.ring import create_ring
    from frmps_engine.ring.reader import RingReader

    async def main():
        want, want_seeds = await no_fault_run(model_dir, addrs)
        assert want["cmpl-a"] == expected(11) and want["cmpl-late"] == expected(3, 6, [7, 8, 9])

        ring_path = str(tmp_path / "ring")
        create_ring(ring_path, 1 << 20)
        reader = RingReader(ring_path)
        a = make_server(model_dir, addrs, ring_path=ring_path)
        a.start()
        client = make_client(model_dir, addrs)
        b = None
        try:
            reqs = requests()
            # What vLLM's Request keeps of the request as sent travels with the adoption:
            # the cache salt (the prefix cache's tenant isolation), priority, arrival, trace.
            reqs[0].cache_salt, reqs[0].priority, reqs[0].trace_headers = "tenant-a", 2, {"traceparent": "00-ab-cd-01"}
            arrival = reqs[0].arrival_time
            for r in reqs:
                await client.add_request_async(r)
            assert {r.request_id: r.sampling_params.seed for r in reqs} == {
                k: v for k, v in want_seeds.items() if k != "frmps-5"}
            col = Collector(client)
            fids = ("cmpl-a", "0_cmpl-b", "1_cmpl-b", "cmpl-c")
            await col.drain(lambda: all(len(col.got.get(f, [])) >= KILL_AFTER for f in fids))
            a.halt(close_sockets=first_fate == "dies")
            assert not a.loop.running
            await col.quiet(a.sent_batches)  # what A had sent before it stopped reaches the client
            assert not col.finish, "A was stopped mid-stream"
            reader.poll()
            snapshots = dict(reader.snapshot)
            assert set(snapshots) == {1, 2, 3, 4}

            # The supervisor's part, done here by hand.
            client.engine_lost()
            await client.add_request_async(late_request())  # held: no engine
            await client.abort_requests_async(["cmpl-c"])  # held too
            entries = client.resume_entries()
            assert [e.frontend_id for e in entries] == ["cmpl-a", "0_cmpl-b", "1_cmpl-b"]
            for e in entries:
                assert e.delivered == col.got[e.frontend_id] and len(e.delivered) >= KILL_AFTER

            b = make_server(model_dir, addrs, ring_path=ring_path)
            outcomes = b.adopt(entries, snapshots)
            assert [o.ok for o in outcomes] == [True] * 3, outcomes
            assert all(o.reused_tokens >= 16 for o in outcomes), "the prompt's full block is reused from the ring"
            for e in entries:  # adopted with the request's own seed
                assert b.core.scheduler.requests[e.engine_id].sampling_params.seed == want_seeds[e.engine_id]
            first = b.core.scheduler.requests[entries[0].engine_id]
            assert (first.cache_salt, first.priority, first.trace_headers, first.arrival_time) == (
                "tenant-a", 2, {"traceparent": "00-ab-cd-01"}, arrival)
            assert b.core.scheduler.requests[entries[1].engine_id].cache_salt is None
            b.start()
            await client.wait_engine_back(timeout=10)
            await col.drain(lambda: {"cmpl-a", "0_cmpl-b", "1_cmpl-b", "cmpl-late"} <= set(col.finish))
            await asyncio.sleep(0.1)
            assert not b.core.has_work(), "the held abort reached B (it never had the request)"

            for fid in ("cmpl-a", "0_cmpl-b", "1_cmpl-b", "cmpl-late"):
                assert col.got[fid] == want[fid], fid  # every token once, in order, under the frontend's id
            assert len(col.got["cmpl-c"]) < MAX_TOKENS and "cmpl-c" not in col.finish
            assert b.core.counters["requests_adopted"] == 3
            assert len(client.ledger) == 0
            assert a.refused == [] and b.refused == []
            # B published its own state: the ring now shows nothing running.
            reader.poll()
            assert reader.snapshot == {}
        finally:
            client.shutdown()
            a.close()
            if b is not None:
                b.close()
            reader.close()

    asyncio.run(main())


def test_bad_input_is_refused_and_nothing_else_is_lost(model_dir, addrs):
    """(c) An unknown message type, an ADD that is not an EngineCoreRequest (with
    and without a readable id), and a request that bypassed the ledger (no
    frmps_key): each is refused (an ERROR output for the request when its id is
    known, a logged refusal otherwise); a good request in between completes."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequestType, FinishReason
    from vllm.v1.engine.core_client import AsyncMPClient

    async def main():
        server = make_server(model_dir, addrs, device_s=0.005)
        server.start()
        client = make_client(model_dir, addrs)
        try:
            good = make_request("cmpl-ok", SamplingParams(max_tokens=MAX_TOKENS, seed=21))
            await client.add_request_async(good)
            ident, add = client.core_engine, EngineCoreRequestType.ADD.value
            await client.input_socket.send_multipart((ident, b"\x7f", b"junk"))
            await client.input_socket.send_multipart((ident, add, msgspec.msgpack.encode(["cmpl-bad", "no prompt"])))
            await client.input_socket.send_multipart((ident, add, b"\xc1"))
            await AsyncMPClient.add_request_async(client, make_request("cmpl-raw", SamplingParams(max_tokens=4, seed=1)))
            col = Collector(client)
            await col.drain(lambda: {"cmpl-ok", "cmpl-bad", "cmpl-raw"} <= set(col.finish))
            assert col.finish["cmpl-bad"] == FinishReason.ERROR and col.got["cmpl-bad"] == []
            assert col.finish["cmpl-raw"] == FinishReason.ERROR and col.got["cmpl-raw"] == []
            assert col.got["cmpl-ok"] == expected(21) and col.finish["cmpl-ok"] == FinishReason.LENGTH
            why = [w for _, w in server.refused]
            assert len(why) == 4, why
            assert "unknown engine-core message type b'\\x7f'" in why[0]
            assert server.refused[1][0] == "cmpl-bad" and "malformed request" in why[1]
            assert server.refused[2][0] == "" and "malformed request" in why[2]
            assert server.refused[3][0] == "cmpl-raw" and "no ring key in sampling_params.extra_args['frmps_key']" in why[3]
            assert len(client.ledger) == 0
        finally:
            client.shutdown()
            server.close()

    asyncio.run(main())


def test_check_request_refuses_what_a_standby_could_not_resume():
    from vllm.sampling_params import SamplingParams

    from frmps_engine.vllm.frontend.engine_server import RefusedRequest, check_request
    from frmps_engine.vllm.frontend.ledger import ResumeLedger

    ok = make_request("cmpl-x", SamplingParams(max_tokens=4))
    ResumeLedger(first_key=7).admit(ok)
    assert check_request(ok) == 7
    renamed = make_request("frmps-8", ok.sampling_params)
    with pytest.raises(RefusedRequest, match="ring key 7 names frmps-7"):
        check_request(renamed)
    unseeded = make_request("frmps-7", SamplingParams(max_tokens=4, extra_args={"frmps_key": 7}))
    with pytest.raises(RefusedRequest, match="no seed"):
        check_request(unseeded)
    pooling = make_request("frmps-7", None)
    with pytest.raises(RefusedRequest, match="generation only"):
        check_request(pooling)


def test_a_failing_engine_goes_silent_never_engine_core_dead(model_dir, addrs):
    """The engine loop dies (the model raises at its 4th step): on_fatal is called
    once and nothing more is sent — in particular not vLLM's ENGINE_CORE_DEAD,
    which would fail every request in the frontend. Raw sockets stand in for the
    frontend here (a ROUTER and a PULL bound as vLLM's client binds them); the
    ready message decodes as this version's EngineCoreReadyResponse."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreOutputs, EngineCoreReadyResponse, EngineCoreRequestType
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from frmps_engine.vllm.frontend.ledger import ResumeLedger

    in_addr, out_addr = addrs
    ctx = zmq.Context()
    router, pull = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL)
    router.bind(in_addr)
    pull.bind(out_addr)
    fatal: list[BaseException] = []
    died = threading.Event()
    server = make_server(model_dir, addrs, model=BrokenModel(fail_at=4), device_s=STEP_S,
                         on_fatal=lambda e: (fatal.append(e), died.set()))
    try:
        server.start()
        assert router.poll(5000)
        ident, payload = router.recv_multipart()
        assert ident == (0).to_bytes(2, "little")
        ready = msgspec.msgpack.decode(payload, type=EngineCoreReadyResponse)
        assert (ready.max_model_len, ready.num_gpu_blocks, ready.block_size) == (512, 64, 16)
        req = make_request("cmpl-z", SamplingParams(max_tokens=MAX_TOKENS))
        ResumeLedger().admit(req)
        router.send_multipart((ident, EngineCoreRequestType.ADD.value, *MsgpackEncoder().encode(req)))
        assert died.wait(10)
        assert len(fatal) == 1 and "test double" in str(fatal[0])
        dec = MsgpackDecoder(EngineCoreOutputs)
        frames = []
        while pull.poll(1000):
            frames.append(pull.recv_multipart())
        assert frames, "the steps before the failure were sent"
        for f in frames:
            assert f[0] != b"ENGINE_CORE_DEAD"
            assert dec.decode(f).outputs[0].request_id == "frmps-1"
        assert server.dead is fatal[0] and not server.running
    finally:
        server.close()
        router.close(0)
        pull.close(0)
        ctx.term()
