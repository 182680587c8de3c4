"""Benchmarks (print figures, assert nothing about speed): control round trip and
generation-API streaming overhead with the fake core (TEST DOUBLE). Each also
checks that what it timed was correct: every Ping answered once, in order, and
the engine's receive loop ending when the supervisor hangs up; every stream
complete, its chunks contiguous and equal to the no-fault output.
Run: pytest -q -s -m slow vllmpatch/tests/test_sdk_bench.py"""

import os
import socket
import statistics
import threading
import time

import pytest

from e2e import require
from frmps_engine._proto.frmps.v1 import control_pb2
from frmps_engine.sdk import control

pytestmark = pytest.mark.slow


class _Nop:
    def __init__(self):
        self.disconnected = threading.Event()

    def on_sleep(self, *a):
        return control_pb2.Reply(ok=True)

    on_resume = on_shutdown = on_sleep

    def on_disconnect(self, err):
        self.disconnected.set()


def test_bench_control_round_trip():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sup, eng = control.ControlConn(a), control.ControlClient(control.ControlConn(b))
    handler = _Nop()
    loop = eng.start(handler)
    samples = []
    try:
        for i in range(2000):
            t = time.perf_counter_ns()
            sup.send(control_pb2.Envelope(id=i + 1, ping=control_pb2.Ping()))
            env, fds = sup.recv()
            samples.append(time.perf_counter_ns() - t)
            assert env.WhichOneof("msg") == "reply" and env.id == i + 1, env
            assert env.reply.ok and env.reply.took_ns > 0 and not fds
    finally:
        sup.close()
    assert handler.disconnected.wait(5), "the engine did not notice the supervisor hanging up"
    loop.join(5)
    assert not loop.is_alive()
    eng.close()
    samples.sort()
    print(f"\ncontrol Ping->Reply round trip: p50 {samples[1000] / 1e3:.1f} us, p99 {samples[1980] / 1e3:.1f} us")


@pytest.mark.torch
def test_bench_generation_stream(sockdir):
    require("torch")
    import grpc
    from frmps_engine._proto.frmps.v1 import generation_pb2 as g, generation_pb2_grpc
    from test_sdk_genapi import Env

    e = Env(os.path.join(sockdir, "gen.sock"))
    try:
        req = g.GenerateRequest(key=1, prompt="hi", params=control_pb2.SamplingParams(max_tokens=100, ignore_eos=True))
        want = [t for ch in e.stub.Generate(req) for t in ch.token_ids]  # warm up; the no-fault output
        assert len(want) == 100
        firsts, gaps, n = [], [], 0
        t_all = time.perf_counter()
        for k in range(2, 12):
            t = time.perf_counter_ns()
            last = None
            chunks = []
            for i, ch in enumerate(e.stub.Generate(g.GenerateRequest(key=k, prompt="hi", params=req.params))):
                now = time.perf_counter_ns()
                if i == 0:
                    firsts.append(now - t)
                elif last is not None:
                    gaps.append(now - last)
                last = now
                n += len(ch.token_ids)
                chunks.append(ch)
            # Greedy: every stream is the warm-up's output, its chunks contiguous, then finished by length.
            assert [c.output_index for c in chunks] == [sum(len(c.token_ids) for c in chunks[:j]) for j in range(len(chunks))]
            assert [t for c in chunks for t in c.token_ids] == want
            assert chunks[-1].finish_reason == g.FINISH_REASON_LENGTH and chunks[-1].usage.completion_tokens == 100
        dt = time.perf_counter() - t_all
        print(f"\ngeneration API: first chunk (usage) after {statistics.median(firsts) / 1e3:.0f} us (median); "
              f"{n / dt:.0f} tokens/s through one stream at a time; median gap between chunks {statistics.median(gaps) / 1e3:.0f} us "
              f"(fake core step included)")
        assert n == 1000
    finally:
        e.close()
