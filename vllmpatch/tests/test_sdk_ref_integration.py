"""The SDK runner with the real reference engine and the real ring: SIGKILL the active mid-generation, take over from the
ring snapshot read by the ring's own reader, and compare with a no-fault run."""

import os
import signal
import threading
import time

import grpc
import pytest

from frmps_engine._proto.frmps.v1 import control_pb2 as c, generation_pb2 as g, generation_pb2_grpc
from frmps_engine.sdk.control import ConnectionClosed
from frmps_engine.sdk.seeds import derive_seed

from e2e import require

pytestmark = pytest.mark.torch
torch = require("torch")

from frmps_engine import refengine, ring  # noqa: E402  (the reference engine imports torch)
from frmps_engine.ring import reader as ring_reader  # noqa: E402
from test_sdk_runner import FakeSupervisor  # noqa: E402

ARGS = ("--num-blocks", "64", "--max-model-len", "256")


def reference_outputs(reqs, tok_prompts):
    cfg = refengine.EngineConfig.from_preset("tiny", device="cpu", num_blocks=64, max_model_len=256, seed=0)
    core = refengine.RefCore(cfg, refengine.RefCore.allocate_pools(cfg), load_weights=True)
    jobs = []
    for k, r in reqs.items():
        p = r.params
        seed = p.seed if p.HasField("seed") else derive_seed(k)
        jobs.append((k, tok_prompts[k], refengine.SamplingParams(
            max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p or 1.0, seed=seed, ignore_eos=p.ignore_eos)))
    return core.generate(jobs), core.tokenizer


@pytest.mark.parametrize("sync_every, kill_after", [(1, 3), (16, 10), (16, 25)])
def test_ref_engine_failover_is_exact(sockdir, sync_every, kill_after):
    sup = FakeSupervisor(sockdir)
    ring_path = f"/dev/shm/frmps-test-ring-{os.getpid()}-{sync_every}-{kill_after}"
    ring.create_ring(ring_path, 1 << 20)
    reader = ring_reader.RingReader(ring_path)
    try:
        a = sup.spawn("active", "a", *ARGS, engine="ref", model="tiny")
        hello = sup.accept(a)
        sup.welcome(a, ring_path=ring_path, sync_every=sync_every)
        got = sup.expect(a, "pool_export", "ready")
        pools, fds = got["pool_export"][0].pool_export.pools, got["pool_export"][1]
        sup.fds += fds
        assert list(pools) == list(hello.pools)
        s = sup.spawn("standby", "s", *ARGS, engine="ref", model="tiny")
        assert list(sup.accept(s).pools) == list(pools)
        sup.welcome(s)
        s.conn.send(c.Envelope(id=1, sleep=c.Sleep(pools=pools)), fds)
        assert sup.expect(s, "ready", "reply")["reply"][0].reply.ok

        P = c.SamplingParams
        reqs = {
            1: g.GenerateRequest(key=1, prompt_token_ids=g.TokenIds(ids=list(range(5, 40))), params=P(max_tokens=60, ignore_eos=True)),
            2: g.GenerateRequest(key=2, prompt="hello world", params=P(max_tokens=50, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)),
            3: g.GenerateRequest(key=3, messages=g.ChatMessages(messages=[c.ChatMessage(role="user", content="hi")]),
                                 params=P(max_tokens=45, temperature=1.0, ignore_eos=True)),
        }
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel("unix://" + a.gen_path))
        delivered = {k: [] for k in reqs}
        texts = {k: "" for k in reqs}
        prompt_tokens = {}

        def run(k):
            try:
                for ch in stub.Generate(reqs[k]):
                    prompt_tokens.setdefault(k, ch.usage.prompt_tokens)
                    delivered[k] += ch.token_ids
                    texts[k] += ch.text
            except grpc.RpcError:
                pass

        threads = [threading.Thread(target=run, args=(k,)) for k in reqs]
        for t in threads:
            t.start()
        stop = threading.Event()

        def poll():  # the supervisor consumes the ring continuously
            while not stop.is_set():
                try:
                    reader.poll()
                except ring.RingError:
                    pass
                time.sleep(0.001)

        poller = threading.Thread(target=poll)
        poller.start()
        deadline = time.monotonic() + 120
        while min(len(v) for v in delivered.values()) < kill_after and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(a.proc.pid, signal.SIGKILL)
        with pytest.raises(ConnectionClosed):
            while True:
                a.conn.recv()
        a.proc.wait(10)
        for t in threads:
            t.join(30)
        stop.set()
        poller.join()
        try:
            reader.poll()
        except ring.RingError:
            pass
        snap = dict(reader.snapshot)

        resume = []
        for k, r in reqs.items():
            x = c.ResumeRequest(key=k, params=r.params, delivered_token_ids=delivered[k])
            which = r.WhichOneof("input")
            if which == "prompt":
                x.prompt = r.prompt
            elif which == "prompt_token_ids":
                x.prompt_token_ids.extend(r.prompt_token_ids.ids)
            else:
                x.messages.extend(r.messages.messages)
            if k in snap:
                e = snap[k]
                x.snapshot.CopyFrom(c.RequestSnapshot(block_ids=e.blocks, token_ids=e.tokens, num_prompt_tokens=e.num_prompt,
                                                      num_computed_tokens=e.num_computed, seed=e.seed, step=e.step))
            resume.append(x)
        s.conn.send(c.Envelope(id=2, resume=c.Resume(requests=resume, ring_path=ring_path, sync_every=sync_every)))
        reply = sup.expect(s, "reply")["reply"][0].reply
        assert reply.ok and not reply.error and all(o.ok for o in reply.resumed), reply
        for o in reply.resumed:
            if o.key in snap:  # everything the last sync covered is reused, never recomputed
                assert o.reused_tokens == snap[o.key].num_computed > 0

        sstub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel("unix://" + s.gen_path))
        full = {}
        for k in reqs:
            chunks = list(sstub.Resume(g.ResumeStreamRequest(key=k, delivered=len(delivered[k]))))
            full[k] = delivered[k] + [t for ch in chunks for t in ch.token_ids]
            texts[k] += "".join(ch.text for ch in chunks)
        tok = refengine.load_tokenizer(None)
        prompts = {1: list(range(5, 40)), 2: tok.encode("hello world"),
                   3: tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)}
        ref, tok = reference_outputs(reqs, prompts)
        for k in reqs:
            assert prompt_tokens[k] == len(prompts[k])
            assert full[k] == ref[k], f"request {k} diverged after takeover"
            assert texts[k] == tok.decode(ref[k])
        s.conn.send(c.Envelope(id=3, shutdown=c.Shutdown(grace_ms=1000)))
        assert sup.expect(s, "reply")["reply"][0].reply.ok
        assert s.proc.wait(30) == 0
    finally:
        sup.close()
        reader.close()
        os.unlink(ring_path)
