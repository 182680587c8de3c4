"""Sync overhead through the code that serves: the SDK's engine loop
(sdk/loop.py's EngineLoop) stepping an engine's core built by its adapter as the
runner of `frmps serve` builds it (pools from the memory backend, the adapter's
warm-up, the ring module preloaded, the heap frozen), publishing to a real
/dev/shm ring through RingPublisher, the loop's own publisher.

The loop decodes a saturating batch. For every N (publish every N steps; 0: no
ring attached, the reference) it runs trials of S steps, each between two
no-publish trials, in forward then backward rounds, so the step time's drift
as the contexts grow weighs on every N alike. Trials are switched and timed on
the loop's own thread: a command the loop runs between two steps ends one trial
and starts the next (attaching the ring, which publishes a FULL record first, or
detaching it, and setting N), and records the time, the step count and the
loop's publish counters there. The driver thread sleeps meanwhile. Each trial
checks that every request decoded exactly one token per step.

Engines: ``ref`` (the reference engine) and ``vllm`` (the vLLM adapter's
VllmCore over vLLM's in-process EngineCore; on the CPU, where vLLM builds
no engine, over vLLM's real scheduler with a TEST DOUBLE in place of the model
runner, frmps_engine.vllm.testing: that figure is the scheduler's and the
publish's time with no model computation, a check of the path, not a
measurement of vLLM).

Run by the bench driver as ``python -m bench.baseline_engine
sync-overhead ...``; emits one "result" event.
"""

from __future__ import annotations

import gc
import math
import os
import secrets
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

# Publish every NEVER steps = never: the loop's cadence for the no-ring trials.
NEVER = 1 << 62


def parse_sync_list(s: str) -> list[int]:
    """"0,1,2,16" -> [0, 1, 2, 16]; N = 0 is the no-publish reference."""
    out = []
    for x in s.split(","):
        x = x.strip()
        if not x:
            continue
        try:
            n = int(x)
        except ValueError:
            raise SystemExit(f"--sync-list: {x!r} is not a number of steps") from None
        if n < 0:
            raise SystemExit(f"--sync-list: {n} is negative")
        out.append(n)
    return out


def trial_order(sync_list: list[int], reps: int) -> list[tuple[int, int]]:
    """(rep, N) in run order: every N between two no-publish trials, rounds
    alternately forward and backward, consecutive rounds sharing their boundary
    no-publish trial: 0, a, 0, b, 0 | a... reversed."""
    ns = [n for n in sync_list if n]
    out: list[tuple[int, int]] = [(0, 0)]
    for rep in range(reps):
        for n in (ns if rep % 2 == 0 else ns[::-1]):
            out += [(rep, n), (rep, 0)]
    return out


@dataclass
class Served:
    """An engine's core as the runner builds it, and how to make its requests."""

    engine: str
    core: Any
    # (key, prompt length, max_tokens) -> (wire params, the engine's own params)
    params: Callable[[int, int, int], tuple[Any, Any]]
    vocab: int
    info: dict = field(default_factory=dict)
    close: Callable[[], None] = lambda: None


def _wire(key: int, prompt_len: int, max_tokens: int, max_model_len: int):
    from frmps_engine._proto.frmps.v1 import control_pb2
    from frmps_engine.sdk.params import normalize

    p = control_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return normalize(p, key, prompt_len, max_model_len)


def _through_runner_steps(adapter, engine: str, memory_name: str, device: str) -> Served:
    """Pools from the memory backend and the core from the adapter, as the runner's active does."""
    from frmps_engine.sdk import memory
    from frmps_engine.sdk.memory.base import as_spec

    mem = memory.get_backend(memory_name, device)
    pools = mem.allocate([as_spec(s) for s in adapter.pool_layout()])
    core = adapter.create_core({p.spec.key: p.tensor for p in pools}, load_weights=True)

    def params(key: int, prompt_len: int, max_tokens: int):
        wire = _wire(key, prompt_len, max_tokens, adapter.max_model_len)
        return wire, adapter.sampling_params(wire, wire.seed)

    vocab = getattr(adapter.tokenizer(), "vocab_size", None) or 32000
    return Served(engine, core, params, vocab, {"memory": memory_name, "adapter_version": adapter.version},
                  close=mem.close)


def build(engine: str, args, batch: int, max_model_len: int, num_blocks: int, workdir: str) -> Served:
    from frmps_engine.sdk import adapters

    opts = adapters.EngineOptions(model=args.model, device=args.device, num_blocks=num_blocks,
                                  max_model_len=max_model_len, seed=args.seed, max_num_seqs=batch,
                                  max_num_batched_tokens=args.max_num_batched_tokens or None)
    if engine == "ref":
        return _through_runner_steps(adapters.load_adapter("ref", opts), "ref", args.memory, args.device)
    if engine != "vllm":
        raise SystemExit(f"--engine {engine!r}: ref or vllm")
    if args.device != "cpu":
        from frmps_engine import modeldir

        opts.model = modeldir.write(args.model, modeldir.default_dir(args.model))
        return _through_runner_steps(adapters.load_adapter("vllm", opts), "vllm", args.memory, args.device)
    # CPU: vLLM builds no engine here; its real scheduler with the stand-in model (a TEST DOUBLE).
    from vllm import SamplingParams

    from frmps_engine.vllm import testing

    model_dir = testing.write_tiny_model(Path(workdir) / "vllm-tiny-qwen2",
                                         max_position_embeddings=max(max_model_len, 1024))
    core = testing.cpu_engine_core(model_dir, num_blocks=num_blocks, max_num_seqs=batch, max_model_len=max_model_len,
                                   max_num_batched_tokens=args.max_num_batched_tokens)

    def params(key: int, prompt_len: int, max_tokens: int):
        wire = _wire(key, prompt_len, max_tokens, max_model_len)
        return wire, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=None)

    return Served("vllm", core, params, testing.TINY_QWEN2["vocab_size"] - 16,
                  {"model_runner": "TEST DOUBLE (frmps_engine.vllm.testing.FakeModel): vLLM's scheduler and the "
                                   "adapter's core only, no model computation"})


def _batch(args, ctx_len: int) -> tuple[int, int]:
    """(batch, blocks per sequence): as many sequences as memory allows on a GPU (up to
    --max-batch), 8 on the CPU; block sizes from the reference engine's config of the
    model, which has the same shapes as the preset vLLM runs."""
    from frmps_engine.refengine import weights_bytes
    from frmps_engine.refengine.config import EngineConfig

    probe = EngineConfig.from_preset(args.model, device=args.device, max_model_len=max(ctx_len, 256), num_blocks=2)
    per_seq = math.ceil(ctx_len / probe.block_size)
    if args.batch:
        return args.batch, per_seq
    if args.device == "cpu":
        return 8, per_seq
    import torch

    free, _total = torch.cuda.mem_get_info()
    budget = free - weights_bytes(probe) - int(args.reserve_gib * (1 << 30))
    batch = max(1, min(args.max_batch, budget // (per_seq * probe.kv_block_bytes)))
    return (batch // 8 * 8 or batch), per_seq


def publish_mode(core: Any) -> str:
    """Where the loop's publish falls against the device's work: inside the step
    (the core's launch hook), between steps while the next batch computes (vLLM's
    async scheduling: a batch queue), or between steps with the device idle."""
    from frmps_engine.sdk.engine_api import has_launch_hook

    if has_launch_hook(core):
        return "overlapped with the step's device work (the core's launch hook)"
    if getattr(getattr(core, "core", None), "batch_queue", None) is not None:
        return "overlapped: between steps with the next batch in flight (async scheduling)"
    return "between steps"


class TrialClock:
    """Runs the measurement on the loop's own thread, at the start of every step
    (EngineLoop.run_in_step, re-armed each time), before the core's work: it waits
    until every request has its first token (the prefill), lets `warmup` steps pass,
    then switches and times the trials exactly every S + 1 steps. Where a trial ends
    it records the time, the step count, the loop's publish counters and every
    request's output length, switches the ring and N for the next trial and records
    the same again. The + 1: a publish due after a trial's last step, which the loop
    makes during the next step when it overlaps publishing with the device's work,
    still falls inside the trial (N publishes S / N times a trial when overlapped,
    (S + 1) // N times between steps). Every step carries the same call, so it
    cancels in the comparison; the driver thread only waits for ``done``, so nothing
    competes with the loop for the interpreter."""

    def __init__(self, loop, order: list[tuple[int, int]], steps: int, warmup: int, switch: Callable[[int], None],
                 streams: list):
        self.loop, self.order, self.switch, self.streams = loop, order, switch, streams
        self.steps, self.warmup = steps + 1, warmup
        self.phase = "prefill"
        self.i = -1
        self.next_at = 0
        self.t0 = time.perf_counter()
        self.prefill_s: float | None = None
        self.marks: list[tuple[tuple, tuple]] = []  # (start, end) per trial
        self._start: tuple | None = None
        self.done = threading.Event()
        self.error: BaseException | None = None

    def _mark(self) -> tuple:
        c = self.loop.counters
        return (time.perf_counter(), self.loop.step_count, c["ring_syncs"], c["ring_sync_ns"],
                [len(s.output) for s in self.streams])

    def _tick(self) -> bool:
        """One call; False when the measurement is over."""
        loop = self.loop
        if any(s.finished for s in self.streams):
            raise RuntimeError(f"a request ended before the trials did ({self.phase}, trial {self.i}): "
                               f"{[s.error or s.finish_reason for s in self.streams if s.finished][:1]}")
        if self.phase == "prefill":
            if min(len(s.output) for s in self.streams) >= 1:
                self.prefill_s = time.perf_counter() - self.t0
                self.phase, self.next_at = "warmup", loop.step_count + self.warmup
            return True
        if loop.step_count < self.next_at:
            return True
        if self.phase == "trials":
            self.marks.append((self._start, self._mark()))
        self.phase = "trials"
        self.i += 1
        if self.i == len(self.order):
            return False
        self.switch(self.order[self.i][1])
        self._start = self._mark()
        self.next_at = loop.step_count + self.steps
        return True

    def __call__(self) -> None:
        try:
            if self._tick():
                self.loop.run_in_step(self)
                return
        except BaseException as e:  # reported by the driver thread
            self.error = e
        self.done.set()


def measure(served: Served, args, batch: int, total_steps: int, ring_path: str) -> dict:
    """Decode `batch` requests through the engine loop and time the trials."""
    import torch

    from frmps_engine.sdk.loop import EngineLoop, RingPublisher

    RingPublisher.preload()
    loop = EngineLoop(served.core, sync_every=NEVER)
    # As the runner does before serving: the heap built so far out of the collector's
    # reach (a full collection would land at random in a timed step).
    gc.collect()
    gc.freeze()
    loop.start()
    try:
        g = torch.Generator().manual_seed(args.seed)
        reqs = []
        for k in range(batch):
            prompt = torch.randint(3, served.vocab, (args.prompt_len,), generator=g).tolist()
            reqs.append((k + 1, prompt, *served.params(k + 1, len(prompt), total_steps + 8)))

        hook = loop.overlap_publish

        def switch(n: int) -> None:  # on the loop thread, right before a step; n < 0: every -n steps, between steps
            if n:
                loop.attach_ring(RingPublisher(ring_path))  # a FULL record first: the trial starts right after a sync
                loop.sync_every = abs(n)
            else:
                loop.attach_ring(None)
                loop.sync_every = NEVER
            loop.overlap_publish = hook and n >= 0

        ns = parse_sync_list(args.sync_list)
        if hook:  # the same publish between steps, in the same run: what the launch hook hides
            ns += [-n for n in parse_sync_list(args.between_steps) if n]
        order = trial_order(ns, args.reps)

        def begin() -> TrialClock:
            # On the loop thread: the requests and the clock arrive before any step runs,
            # so the clock counts every step (the tokens budgeted per request suffice).
            streams = [loop.submit(k, prompt, wire, eparams) for k, prompt, wire, eparams in reqs]
            clock = TrialClock(loop, order, args.steps_per_trial, args.warmup_steps, switch, streams)
            loop.run_in_step(clock)
            return clock

        clock = loop.call(begin)
        deadline = time.monotonic() + args.timeout * (len(order) + 1)
        while not clock.done.wait(1.0):
            if loop.dead is not None:
                raise RuntimeError(f"engine loop died: {loop.dead!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the trials did not finish in time ({clock.phase}, {len(clock.marks)} of "
                                   f"{len(order)} trials)")
        if clock.error is not None:
            raise clock.error
        trials = []
        for i, ((rep, n), (start, end)) in enumerate(zip(order, clock.marks)):
            steps = end[1] - start[1]
            decoded = {b - a for a, b in zip(start[4], end[4])}
            if decoded != {steps}:
                raise RuntimeError(f"trial {i}: the requests decoded {sorted(decoded)} tokens in {steps} steps; "
                                   "the whole batch must decode every step")
            seconds = end[0] - start[0]
            trials.append({"sync_every": abs(n), "inline": n < 0, "rep": rep, "seq": i, "seconds": seconds,
                           "steps": steps, "tokens": steps * batch, "step_s": seconds / steps,
                           "syncs": end[2] - start[2], "sync_s": (end[3] - start[3]) / 1e9})
            print(f"sync-overhead {served.engine} {args.model} rep {rep} N={abs(n) or 'none'}"
                  f"{' between steps' if n < 0 else ''}: "
                  f"{1e3 * seconds / steps:.3f} ms/step, {end[2] - start[2]} publishes "
                  f"{(end[3] - start[3]) / 1e6:.2f} ms", file=sys.stderr, flush=True)
        return {"trials": trials, "prefill_s": round(clock.prefill_s or 0.0, 3),
                "publish": publish_mode(served.core),
                "loop_counters": dict(loop.counters)}
    finally:
        loop.stop()
        loop.attach_ring(None)  # closes the last publisher (inline: the loop has stopped)


def run(args) -> int:
    from .engine_io import emit, sync

    # Tokens for every trial, the between-steps ones included (measure() runs them only
    # where the engine overlaps its publish; the engine is not built yet).
    sync_list = parse_sync_list(args.sync_list) + [-n for n in parse_sync_list(args.between_steps) if n]
    n_trials = len(trial_order(sync_list, args.reps))
    total_steps = n_trials * (args.steps_per_trial + 1) + args.warmup_steps + 8
    # (The reference engine's exact mode prefills one request per step, alternating with
    # decode steps of those already in: leave room for the first ones' extra tokens.)
    total_steps += 2 * (args.batch or (8 if args.device == "cpu" else args.max_batch))
    ctx_len = args.prompt_len + total_steps + 16
    batch, per_seq = _batch(args, ctx_len)
    workdir = args.workdir or tempfile.gettempdir()
    t0 = time.perf_counter()
    served = build(args.engine, args, batch, max(ctx_len, 256), batch * per_seq + 1, workdir)
    init_s = time.perf_counter() - t0
    ring_dir = args.ring_dir if os.path.isdir(args.ring_dir) else tempfile.gettempdir()
    ring_path = os.path.join(ring_dir, f"frmps-bench-ring-{os.getpid()}-{secrets.token_hex(4)}")
    from frmps_engine.ring import create_ring

    create_ring(ring_path, args.ring_capacity)
    try:
        res = measure(served, args, batch, total_steps, ring_path)
        sync(args.device)
    finally:
        try:
            os.unlink(ring_path)
        except FileNotFoundError:
            pass
    emit("result", engine=served.engine, model=args.model, batch=batch, prompt_len=args.prompt_len,
         steps_per_trial=args.steps_per_trial, reps=args.reps, max_context=ctx_len, init_s=round(init_s, 2),
         ring_capacity=args.ring_capacity, engine_info=served.info, **res)
    served.close()
    return 0
