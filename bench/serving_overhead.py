#!/usr/bin/env python3
"""The engine side's own cost per step and per token: the SDK's engine loop,
its generation gRPC server (detokenisation, one message per ready chunk) and
the ring publish, over a FAKE core (labelled test doubles):

  --core zero        every step emits one token per running request and computes
                     nothing (ZeroCore below);
  --core vllm-sync   the vLLM adapter's VllmCore over vLLM's real scheduler
  --core vllm-async  (FrmpsScheduler / FrmpsAsyncScheduler) with a fake model
                     runner (frmps_engine.vllm.testing.SchedulerCore): stepped
                     with EngineCore.step, or through the batch queue of async
                     scheduling, where the host's work overlaps the "device".

--step-ms is the device's time per step, a sleep with the GIL free.

Whatever a step costs here is what frmps adds to an engine's own step on the
engine process's CPU (the loop thread shares the GIL with the gRPC threads that
send the output). Clients are separate processes reading the way the Go front
door does: one Stream per client carrying all its requests (--wire stream, one
message per engine step), or one Generate stream per request (--wire
per-request, the fallback for engines without Stream).

    PYTHONPATH=vllmpatch/src .venv/bin/python bench/serving_overhead.py \\
        --batches 1,8,64 --tokens 256 [--tokenizer <hf dir>] [--no-ring] [--profile out.prof]

CPU figures only; prints one JSON line per batch size.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the bench package

from frmps_engine._proto.frmps.v1 import control_pb2, generation_pb2, generation_pb2_grpc  # noqa: E402
from bench.procs import collect  # noqa: E402
from frmps_engine.sdk.genapi import GenerationServer  # noqa: E402
from frmps_engine.sdk.loop import EngineBackend, EngineLoop, RingPublisher  # noqa: E402
from frmps_engine.sdk.testing.fake_engine import FakeTokenizer  # noqa: E402


@dataclass
class _View:
    key: int
    seed: int
    num_prompt: int
    token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    finished: bool = False
    aborted: bool = False


@dataclass
class _Out:
    key: int
    new_token_ids: list[int]
    output_index: int
    finished: bool
    finish_reason: str | None
    stop_reason: object = None


class ZeroCore:
    """TEST DOUBLE: the SDK's Core with no computation. Every step gives each
    running request its next token (a fixed cycle of ordinary word tokens) and
    keeps committed views like a real engine (16-token blocks), so the ring
    publish does its real work."""

    block_size = 16

    def __init__(self, tokenizer, token_cycle: list[int], device_s: float = 0.0):
        self.tokenizer = tokenizer
        self._device_s = device_s
        self.counters: dict[str, int] = {}
        self._cycle = token_cycle
        self._reqs: dict[int, tuple[_View, int]] = {}  # key -> (view, max_tokens)
        self._finished: list[_View] = []
        self._next_block = 0

    def add_request(self, key, prompt_token_ids, params) -> None:
        v = _View(key, key, len(prompt_token_ids), list(prompt_token_ids))
        self._reqs[key] = (v, int(params.max_tokens))

    def adopt_request(self, *a, **k):
        raise NotImplementedError("ZeroCore serves new requests only")

    def abort(self, key) -> bool:
        return self._reqs.pop(key, None) is not None

    def has_work(self) -> bool:
        return bool(self._reqs)

    def request_views(self):
        done, self._finished = self._finished, []
        return [v for v, _ in self._reqs.values()] + done

    def step(self) -> list[_Out]:
        if self._device_s:
            time.sleep(self._device_s)  # the device computing: the GIL is free, as in a CUDA sync
        outs = []
        for key, (v, max_tokens) in list(self._reqs.items()):
            n_out = len(v.token_ids) - v.num_prompt
            tok = self._cycle[n_out % len(self._cycle)]
            v.token_ids.append(tok)
            v.num_computed = len(v.token_ids) - 1
            while len(v.block_ids) * self.block_size < len(v.token_ids):
                v.block_ids.append(self._next_block % 4096)
                self._next_block += 1
            done = n_out + 1 >= max_tokens
            outs.append(_Out(key, [tok], n_out, done, "length" if done else None))
            if done:
                del self._reqs[key]
                v.finished = True
                self._finished.append(v)
        return outs


class ZeroAdapter:
    """TEST DOUBLE: the adapter half the generation server reads."""

    name, version, model, max_model_len = "zero", "0", "zero", 1 << 20

    def __init__(self, tok):
        self._tok = tok

    def tokenizer(self):
        return self._tok

    def sampling_params(self, params, seed):
        return params


class WordTokenizer:
    """TEST DOUBLE tokenizer for any token id: token t is the word " w<t>"."""

    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids) -> str:
        return "".join(f" w{int(t)}" for t in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
        raise NotImplementedError


class VllmAdapterDouble(ZeroAdapter):
    """TEST DOUBLE: the adapter half the generation server reads, with vLLM's sampling params."""

    def sampling_params(self, params, seed):
        from vllm import SamplingParams

        return SamplingParams(max_tokens=int(params.max_tokens), temperature=0.0, ignore_eos=True)


def vllm_core(kind: str, max_batch: int, tokens: int, device_s: float, tok):
    """VllmCore over vLLM's real scheduler and the fake model runner (tiny Qwen2 config)."""
    import pathlib

    from frmps_engine.vllm.core import VllmCore
    from frmps_engine.vllm.engine import scheduler_cls_for
    from frmps_engine.vllm.testing import SchedulerCore, make_scheduler, make_vllm_config, write_tiny_model

    model_dir = write_tiny_model(pathlib.Path(tempfile.mkdtemp(prefix="frmps-so-model-")))
    per_req = -(-(32 + tokens + 16) // 16)
    vc = make_vllm_config(model_dir, num_blocks=max_batch * per_req * 2 + 16, max_num_seqs=max_batch,
                          max_model_len=32 + tokens + 64, max_num_batched_tokens=max(8192, 32 * max_batch),
                          async_scheduling=kind == "vllm-async")
    vc.scheduler_config.scheduler_cls = scheduler_cls_for(vc)
    core = SchedulerCore(make_scheduler(vc), batch_queue_size=2 if kind == "vllm-async" else 1, device_s=device_s)
    return VllmCore(core, tok)


def _tokenizer(path: str, byte_table: bool = True):
    if not path:
        return FakeTokenizer(), [ord(c) for c in " the quick brown fox jumps over a lazy dog,"]
    from frmps_engine.vllm.tokenizer import VllmTokenizer  # HF fast tokenizer, as --engine vllm decodes
    from transformers import AutoTokenizer

    tok = VllmTokenizer(AutoTokenizer.from_pretrained(path))
    if byte_table:
        from frmps_engine.sdk.detok import warm

        warm(tok)  # as an engine does when it starts: streams decode from the byte table
    return tok, tok.encode(" The quick brown fox jumps over the lazy dog, and then it runs away.")


# -- client processes -------------------------------------------------------------
def _client(sock: str, keys: list[int], tokens: int, start, q) -> None:
    import grpc

    ch = grpc.insecure_channel("unix://" + sock)
    stub = generation_pb2_grpc.GenerationStub(ch)
    got = [0] * len(keys)
    msgs = [0] * len(keys)

    def one(i: int, key: int) -> None:
        req = generation_pb2.GenerateRequest(
            key=key, prompt_token_ids=generation_pb2.TokenIds(ids=list(range(100, 132))),
            params=control_pb2.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        for r in stub.Generate(req):
            got[i] += len(r.token_ids)
            msgs[i] += 1

    start.wait()
    ts = [threading.Thread(target=one, args=(i, k)) for i, k in enumerate(keys)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    ch.close()
    q.put((sum(got), sum(msgs)))


def _client_stream(sock: str, keys: list[int], tokens: int, start, q) -> None:
    """The front door's way since the Stream RPC: one stream per connection for all its requests."""
    import queue

    import grpc

    ch = grpc.insecure_channel("unix://" + sock)
    stub = generation_pb2_grpc.GenerationStub(ch)
    ops: queue.Queue = queue.Queue()
    got = msgs = 0
    start.wait()
    for key in keys:
        ops.put(generation_pb2.StreamRequest(generate=generation_pb2.GenerateRequest(
            key=key, prompt_token_ids=generation_pb2.TokenIds(ids=list(range(100, 132))),
            params=control_pb2.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))))
    left = set(keys)
    it = stub.Stream(iter(ops.get, None))
    for resp in it:
        msgs += 1
        for c in resp.chunks:
            got += len(c.response.token_ids)
            if c.status_code or c.response.finish_reason:
                left.discard(c.key)
        if not left:
            break
    ops.put(None)
    it.cancel()
    ch.close()
    q.put((got, msgs + len(keys)))  # + the first chunk per request, as a per-request stream counts it


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """Every live Python thread's CPU seconds so far (its CPU-time clock), by native id."""
    out = {}
    for t in threading.enumerate():
        try:
            out[t.native_id] = (t.name, time.clock_gettime(time.pthread_getcpuclockid(t.ident)))
        except (OSError, TypeError):
            continue  # ended in between
    return out


def _cpu_by_role(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds per role between two _thread_cpu snapshots: the engine loop and
    the generation service (its gRPC server's threads); the rest of the process is
    in neither."""
    roles = {"loop": 0.0, "generation": 0.0}
    for tid, (name, cpu) in after.items():
        used = cpu - before.get(tid, (name, 0.0))[1]
        if name.startswith("frmps-engine-loop"):
            roles["loop"] += used
        elif name.startswith("frmps-gen") or "(_serve)" in name:
            roles["generation"] += used
    return roles


def run_batch(sock: str, loop: EngineLoop, batch: int, tokens: int, procs: int, key0: int, step_s: float,
              wire: str = "stream") -> dict:
    ctx = mp.get_context("spawn")
    start, q = ctx.Event(), ctx.Queue()
    keys = [key0 + i for i in range(batch)]
    per = [keys[i::procs] for i in range(min(procs, batch))]
    target = _client_stream if wire == "stream" else _client
    ps = [ctx.Process(target=target, args=(sock, ks, tokens, start, q)) for ks in per]
    for p in ps:
        p.start()
    time.sleep(1.0)  # clients imported and connected
    steps0, cpu0, threads0 = loop.step_count, time.process_time(), _thread_cpu()
    syncs0, sync_ns0 = loop.counters["ring_syncs"], loop.counters["ring_sync_ns"]
    t0 = time.perf_counter()
    start.set()
    res = collect(q, ps, 600)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    roles = _cpu_by_role(threads0, _thread_cpu())
    steps = loop.step_count - steps0
    syncs = loop.counters["ring_syncs"] - syncs0
    ring_us = round((loop.counters["ring_sync_ns"] - sync_ns0) / 1e3 / syncs, 1) if syncs else None
    for p in ps:
        p.join(30)
    toks, msgs = sum(r[0] for r in res), sum(r[1] for r in res)
    if toks != batch * tokens:
        raise RuntimeError(f"clients got {toks} tokens, expected {batch * tokens}")
    return {"batch": batch, "tokens": toks, "messages": msgs, "steps": steps, "wall_s": round(wall, 3),
            "tok_s": round(toks / wall), "us_per_step_wall": round(1e6 * wall / steps, 1),
            "added_us_per_step": round(1e6 * wall / steps - step_s * 1e6, 1),
            "engine_cpu_us_per_token": round(1e6 * cpu / toks, 1),
            "loop_cpu_us_per_token": round(1e6 * roles["loop"] / toks, 1),
            "generation_cpu_us_per_token": round(1e6 * roles["generation"] / toks, 1),
            "tokens_per_message": round(toks / max(1, msgs - batch), 2),
            "ring_publish_us": ring_us}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--core", choices=["zero", "vllm-sync", "vllm-async"], default="zero")
    ap.add_argument("--step-ms", type=float, default=2.0,
                    help="device time per step (a sleep that frees the GIL; vLLM alone: ~2.1 ms at b=1 on an H100)")
    ap.add_argument("--client-procs", type=int, default=2, help="client processes (streams split between them)")
    ap.add_argument("--wire", choices=["stream", "per-request"], default="stream",
                    help="clients read through one Stream each (what the front door does) or one Generate per request")
    ap.add_argument("--tokenizer", default="", help="HF model directory whose tokenizer detokenises (default: a byte tokenizer)")
    ap.add_argument("--no-ring", action="store_true", help="do not publish to a ring")
    ap.add_argument("--no-byte-table", action="store_true",
                    help="detokenize through the tokenizer's decode, not the byte table an engine builds at start")
    ap.add_argument("--sync-every", type=int, default=1,
                    help="engine steps between ring publishes (frmps serve's default: 1, every step)")
    ap.add_argument("--numpy-crc", action="store_true",
                    help="checksum ring records with the numpy CRC-32C, as a machine without the crc32c package does")
    ap.add_argument("--profile", default="", help="cProfile the engine process (all threads' hot spots) into this file")
    ap.add_argument("--switch-interval-ms", type=float, default=0.0, help="sys.setswitchinterval for the engine process (0: Python's default)")
    args = ap.parse_args()
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    batches = [int(x) for x in args.batches.split(",") if x]
    tok, cycle = _tokenizer(args.tokenizer, not args.no_byte_table)
    if args.core == "zero":
        core, adapter = ZeroCore(tok, cycle, args.step_ms / 1e3), ZeroAdapter(tok)
    else:
        if not args.tokenizer:
            tok = WordTokenizer()  # the fake model's token ids go past a byte tokenizer's
        core, adapter = vllm_core(args.core, max(batches), args.tokens, args.step_ms / 1e3, tok), VllmAdapterDouble(tok)
    loop = EngineLoop(core, sync_every=args.sync_every)
    with tempfile.TemporaryDirectory(prefix="frmps-so-") as d:
        if not args.no_ring:
            from frmps_engine import ring

            rpath = os.path.join(d, "ring")
            ring.create_ring(rpath, 64 << 20)
            pub = RingPublisher(rpath)
            if args.numpy_crc:
                pub._writer._hw = False
            loop.attach_ring(pub)
        backend = EngineBackend(adapter, loop)
        backend.is_serving = True
        sock = os.path.join(d, "gen.sock")
        srv = GenerationServer(backend, sock)
        srv.start()
        loop.start()
        prof = cProfile.Profile() if args.profile else None
        if prof is not None:
            threading.setprofile(lambda *a: None)
            prof.enable()
        try:
            key = 1
            for b in batches:
                run_batch(sock, loop, b, 16, args.client_procs, key, args.step_ms / 1e3, args.wire)  # warm-up
                key += b
                r = run_batch(sock, loop, b, args.tokens, args.client_procs, key, args.step_ms / 1e3, args.wire)
                key += b
                r["tokenizer"] = "hf:" + os.path.basename(args.tokenizer.rstrip("/")) if args.tokenizer else "bytes"
                r["ring"] = not args.no_ring
                r["sync_every"] = args.sync_every
                r["byte_table"] = bool(args.tokenizer) and not args.no_byte_table
                r["step_ms"] = args.step_ms
                r["core"] = args.core
                print(json.dumps(r), flush=True)
        finally:
            if prof is not None:
                prof.disable()
                prof.dump_stats(args.profile)
            loop.stop()
            srv.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
