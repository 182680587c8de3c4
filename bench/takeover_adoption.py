"""What a vLLM standby's adoption of a takeover's requests costs on the host, by phase.

Builds the adapter's VllmCore over vLLM's real scheduler with the stand-in model of
frmps_engine.vllm.testing (no GPU: the scheduler, the KV-cache manager and the block
pool are vLLM's own; prefix caching on with vLLM's own block hasher, as EngineCore
builds it). An "active" runs N requests of P prompt tokens to O output tokens; their
committed views become the Resume's snapshots, as the supervisor builds them from the
ring. A standby (warmed with its throwaway takeover, as a real standby is) then adopts
them through the runner's own per-request path (Runner._adopt: prompt ids check,
parameter normalisation, vLLM SamplingParams, VllmCore.adopt_request, the stream's
registration), the code the "adoption CPU" figure of the takeover log line measures.

Prints the median thread CPU time of the whole adoption over --reps takeovers by one
standby (reset between them, as a handover resets it) and of the first takeover of
--fresh new standbys, then the same per phase (each phase timed by wrapping the function
it calls), and with --profile N a cProfile by function. Results of 2026-11-26:
bench/results/cpu-adoption-2026-11-26.md.

    PYTHONPATH=vllmpatch/src python bench/takeover_adoption.py [--requests 8] [--prompt 300] [--output 100] [--v1]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import random
import statistics
import tempfile
import time
import types
from pathlib import Path


def build(model_dir: str, tiny_dir: str, *, num_blocks: int, max_model_len: int, max_num_seqs: int,
          prefix_caching: bool, tokenizer):
    from frmps_engine.vllm import SCHEDULER_CLS
    from frmps_engine.vllm.core import VllmCore
    from frmps_engine.vllm.testing import SchedulerCore, make_scheduler, make_vllm_config
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    cfg = make_vllm_config(tiny_dir, num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                           max_num_batched_tokens=max(max_model_len, 2048), scheduler_cls=SCHEDULER_CLS,
                           enable_prefix_caching=prefix_caching)
    hasher = None
    if prefix_caching:  # as EngineCore builds it (v1/engine/core.py), vLLM's default algorithm
        init_none_hash(sha256)
        hasher = get_request_block_hasher(cfg.cache_config.block_size, sha256)
    return VllmCore(SchedulerCore(make_scheduler(cfg), request_block_hasher=hasher), tokenizer)


def run_active(core, adapter, n: int, prompt_len: int, out_len: int, temperature: float, whole: bool = False):
    """N requests to out_len outputs; returns (resume requests, their outputs after)."""
    from frmps_engine._proto.frmps.v1 import control_pb2 as c
    from frmps_engine.sdk.params import normalize

    rng = random.Random(7)
    prompts = {1000 + i: [rng.randrange(3, 150_000) for _ in range(prompt_len + 3 * i)] for i in range(n)}
    wire = {}
    for k, ids in prompts.items():
        wire[k] = c.SamplingParams(max_tokens=out_len + 64, temperature=temperature, top_p=0.9 if temperature else 0.0,
                                   ignore_eos=True)
        p = normalize(wire[k], k, len(ids), adapter.max_model_len)
        core.add_request(k, ids, adapter.sampling_params(p, p.seed))
    delivered: dict[int, list[int]] = {k: [] for k in prompts}
    while min(map(len, delivered.values())) < out_len:
        for o in core.step():
            delivered[o.key].extend(o.new_token_ids)
    views = {v.key: v for v in core.request_views()}
    reqs = []
    for k, ids in prompts.items():
        v = views[k]
        snap = c.RequestSnapshot(block_ids=list(v.block_ids), token_ids=list(v.token_ids), num_prompt_tokens=v.num_prompt,
                                 num_computed_tokens=v.num_computed, seed=v.seed)
        if not whole and list(v.token_ids[: v.num_prompt]) == ids:  # as the supervisor sends it (failover_run.go)
            del snap.token_ids[:]
            snap.output_token_ids.extend(v.token_ids[v.num_prompt:])
        reqs.append(c.ResumeRequest(key=k, prompt_token_ids=ids, params=wire[k], delivered_token_ids=delivered[k],
                                    snapshot=snap))
    return reqs


def adopt_all(runner, reqs):
    """The runner's adoption of every request, as Runner._take_over runs it; thread CPU ns."""
    from frmps_engine.sdk.loop import EngineLoop

    runner.loop = EngineLoop(runner.core, sync_every=1)
    gc.disable()
    try:
        t = time.thread_time_ns()
        outcomes = [runner._adopt(r) for r in reqs]
        t = time.thread_time_ns() - t
    finally:
        gc.enable()
    bad = [o for o in outcomes if not o.ok]
    if bad:
        raise SystemExit(f"adoption failed: {bad[0].error}")
    return t


class Phases:
    """Per-phase wall time of the adoptions, by wrapping the functions each phase calls
    (the serving code itself runs unchanged)."""

    def __init__(self):
        self.ns: dict[str, int] = {}
        self._undo: list = []

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)
        ns = self.ns
        ns.setdefault(name, 0)

        def timed(*args, **kwargs):
            t = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                ns[name] += time.perf_counter_ns() - t

        had = attr in vars(owner)
        self._undo.append((owner, attr, fn, had))
        setattr(owner, attr, timed)

    def undo(self) -> None:
        for owner, attr, fn, had in reversed(self._undo):
            if had:
                setattr(owner, attr, fn)
            else:
                delattr(owner, attr)
        self._undo.clear()


def phase_profile(runners, reqs) -> dict[str, float]:
    """ms per takeover of each phase, median over the takeovers of ``runners`` (an
    iterable of (runner, done) pairs: a takeover by each runner, then done(runner))."""
    import copy as copy_mod

    import vllm.v1.request as vreq
    from vllm.v1.core.sched.scheduler import Scheduler

    from frmps_engine.sdk import loop as loop_mod
    from frmps_engine.sdk import takeover as takeover_mod
    from frmps_engine.vllm import adoption as adoption_mod
    from frmps_engine.vllm import core as core_mod

    runs, totals = [], []
    for runner, done in runners:
        kv = runner.core.scheduler.kv_cache_manager
        ph = Phases()
        ph.wrap(takeover_mod, "input_to_ids", "prompt ids check")
        ph.wrap(takeover_mod, "normalize", "wire params normalised")
        ph.wrap(runner.adapter, "sampling_params", "vLLM SamplingParams built")
        ph.wrap(core_mod, "plan_adoption", "plan_adoption")
        real_copy = adoption_mod.copy
        if hasattr(adoption_mod, "copy_params"):
            ph.wrap(adoption_mod, "copy_params", "SamplingParams copy")
        else:  # before copy_params: a deepcopy
            copy_proxy = types.SimpleNamespace(deepcopy=copy_mod.deepcopy, copy=copy_mod.copy)
            ph.wrap(copy_proxy, "deepcopy", "SamplingParams copy")
            adoption_mod.copy = copy_proxy
        ph.wrap(vreq.Request, "append_output_token_ids", "outputs appended (their block hashes)")
        ph.wrap(vreq, "Request", "Request() (prompt block hashes)")
        ph.wrap(kv.block_pool, "touch", "blocks pinned (touch)")
        ph.wrap(Scheduler, "add_request", "scheduler add_request")
        ph.wrap(kv, "cache_blocks", "cache_blocks (hashes into the prefix cache)")
        ph.wrap(loop_mod.EngineLoop, "register_adopted", "stream registered")
        try:
            t = time.perf_counter_ns()
            adopt_all(runner, reqs)
            totals.append(time.perf_counter_ns() - t)
            runs.append(dict(ph.ns))
        finally:
            ph.undo()
            adoption_mod.copy = real_copy
        done(runner)
    out = {k: statistics.median(r[k] for r in runs) / 1e6 for k in runs[0]}
    out["total (wrapped)"] = statistics.median(totals) / 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=200, help="prompt tokens per request (request i: + 3i)")
    ap.add_argument("--output", type=int, default=100, help="output tokens each request has when the active dies")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--whole-snapshots", action="store_true",
                    help="snapshots carry the prompt too (before the supervisor left it out: output_token_ids)")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--v1", action="store_true",
                    help="the V1 model runner's adoption (outputs folded into the prompt); default V2, as vLLM picks on the GPU")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--fresh", type=int, default=8, help="fresh standbys whose first takeover is timed")
    ap.add_argument("--profile", type=int, default=0, help="functions to list from a cProfile (0: none)")
    ap.add_argument("--no-phases", action="store_true", help="no per-phase breakdown")
    a = ap.parse_args()

    import vllm

    from frmps_engine import modeldir
    from frmps_engine.sdk.runner import Runner
    from frmps_engine.vllm.engine import VllmAdapter, VllmEngineConfig
    from frmps_engine.vllm.testing import write_tiny_model

    with tempfile.TemporaryDirectory() as d:
        model = modeldir.write("qwen2.5-0.5b", str(Path(d) / "qwen"), force=True)
        tiny = write_tiny_model(Path(d) / "tiny", max_position_embeddings=8192)
        max_len = a.prompt + 3 * a.requests + a.output + 128
        blocks = a.requests * (max_len // 16 + 2) * 2 + 8
        adapter = VllmAdapter(VllmEngineConfig(model=model, device="cpu", num_blocks=blocks, max_model_len=max_len))
        tok = adapter.tokenizer()
        kw = dict(num_blocks=blocks, max_model_len=max_len, max_num_seqs=max(8, a.requests),
                  prefix_caching=not a.no_prefix_caching, tokenizer=tok)
        active = build(model, tiny, **kw)
        reqs = run_active(active, adapter, a.requests, a.prompt, a.output, a.temperature, a.whole_snapshots)

        def standby_runner():
            standby = build(model, tiny, **kw)
            standby.scheduler.use_v2_model_runner = not a.v1  # what adopt() reads (V2 without Triton: set by hand)
            standby.warm_takeover()  # as a standby does before it sleeps (runner._start_standby)
            runner = types.SimpleNamespace(core=standby, adapter=adapter, loop=None, _fatal=lambda e: None)
            runner._adopt = types.MethodType(Runner._adopt, runner)
            return runner

        runner = standby_runner()
        times = []
        for _ in range(a.reps):
            times.append(adopt_all(runner, reqs))
            runner.core.reset()
        firsts = []
        for _ in range(a.fresh):  # a standby takes over once: its first takeover is what the GPU host logs
            r = standby_runner()
            firsts.append(adopt_all(r, reqs))
        toks = sum(len(r.snapshot.token_ids) or r.snapshot.num_prompt_tokens + len(r.snapshot.output_token_ids) for r in reqs)
        print(f"vLLM {vllm.__version__}, {a.requests} requests x {a.prompt}+{a.output} tokens ({toks} in all), "
              f"prefix caching {'off' if a.no_prefix_caching else 'on'}, {'V1 (folded)' if a.v1 else 'V2'} runner: "
              f"adoption CPU median {statistics.median(times) / 1e6:.3f} ms over {a.reps} takeovers by one standby "
              f"(min {min(times) / 1e6:.3f}); a fresh standby's first takeover median "
              f"{statistics.median(firsts) / 1e6:.3f} ms (of {a.fresh})")
        if not a.no_phases:
            print("per phase, ms per takeover (median of the same, the wrappers add ~1 us per call): "
                  "repeated | first")
            rep = phase_profile(((runner, lambda r: r.core.reset()) for _ in range(a.reps)), reqs)
            first = phase_profile(((standby_runner(), lambda r: None) for _ in range(a.fresh)), reqs)
            for name, ms in rep.items():
                print(f"  {name:48s} {ms:7.3f} | {first[name]:7.3f}")
        if a.profile:
            prof = cProfile.Profile()
            for _ in range(10):
                prof.enable()
                adopt_all(runner, reqs)
                prof.disable()
                runner.core.reset()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(a.profile)
            print("profile of 10 takeovers (cumulative):")
            print(s.getvalue())
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.profile)
            print("profile of 10 takeovers (own time):")
            print(s.getvalue())


if __name__ == "__main__":
    main()
