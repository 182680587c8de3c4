"""Benchmarks (print figures, assert nothing about speed): control round trip and
generation-API streaming overhead with the fake core (TEST DOUBLE).
Run: pytest -q -s -m slow vllmpatch/tests/test_sdk_bench.py"""

import os
import socket
import statistics
import time

import pytest

from frmps_engine._proto.frmps.v1 import control_pb2
from frmps_engine.sdk import control

pytestmark = pytest.mark.slow


class _Nop:
    def on_sleep(self, *a):
        return control_pb2.Reply(ok=True)

    on_resume = on_shutdown = on_sleep

    def on_disconnect(self, err):
        pass


def test_bench_control_round_trip():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sup, eng = control.ControlConn(a), control.ControlClient(control.ControlConn(b))
    eng.start(_Nop())
    samples = []
    for i in range(2000):
        t = time.perf_counter_ns()
        sup.send(control_pb2.Envelope(id=i + 1, ping=control_pb2.Ping()))
        sup.recv()
        samples.append(time.perf_counter_ns() - t)
    sup.close()
    eng.close()
    samples.sort()
    print(f"\ncontrol Ping->Reply round trip: p50 {samples[1000] / 1e3:.1f} us, p99 {samples[1980] / 1e3:.1f} us")


@pytest.mark.torch
def test_bench_generation_stream(sockdir):
    pytest.importorskip("torch")
    import grpc
    from frmps_engine._proto.frmps.v1 import generation_pb2 as g, generation_pb2_grpc
    from test_sdk_genapi import Env

    e = Env(os.path.join(sockdir, "gen.sock"))
    try:
        req = g.GenerateRequest(key=1, prompt="hi", params=control_pb2.SamplingParams(max_tokens=100, ignore_eos=True))
        list(e.stub.Generate(req))  # warm up
        firsts, gaps, n = [], [], 0
        t_all = time.perf_counter()
        for k in range(2, 12):
            t = time.perf_counter_ns()
            last = None
            for i, ch in enumerate(e.stub.Generate(g.GenerateRequest(key=k, prompt="hi", params=req.params))):
                now = time.perf_counter_ns()
                if i == 0:
                    firsts.append(now - t)
                elif last is not None:
                    gaps.append(now - last)
                last = now
                n += len(ch.token_ids)
        dt = time.perf_counter() - t_all
        print(f"\ngeneration API: first chunk (usage) after {statistics.median(firsts) / 1e3:.0f} us (median); "
              f"{n / dt:.0f} tokens/s through one stream at a time; median gap between chunks {statistics.median(gaps) / 1e3:.0f} us "
              f"(fake core step included)")
        assert n == 1000
    finally:
        e.close()
