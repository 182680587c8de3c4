"""The seven experiments of `frmps bench`. Each plans its points (a key per
measured point), measures the pending ones (results appended as they come, so a
re-run resumes), and leaves the aggregation to report.py.

GPU mode faults with a real SM-fault trigger (bench/faults, default a misaligned
address) run as a client of the victim's MPS server. An MPS client can reach an
active only while it runs inside MPS: frmps serve's failback (on by default) puts
an engine back inside MPS after each failover, so the next faulted trial waits for
that placement and reuses the pair, as a user's deployment lives through fault
after fault (--fresh-deployments: a new pair per faulted trial). CPU mode (--cpu)
SIGKILLs the victim instead and reuses deployments: it checks the harness end to
end, it measures nothing.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import random
import threading
import time
from typing import Callable

from . import loglines, proofcount
from .baselines import (BaselineRig, EngineProc, checkpoint_files, drop_page_cache, engine_supports, ensure_checkpoint,
                        page_cache_fraction)
from .deploy import Deployment, MpsTrigger, SigkillTrigger, Stream, Trigger, completion_body, frmps_trial
from .envinfo import nvidia_smi_apps, private_mib
from .lengths import RequestLengths, UniformLengths, sharegpt
from .lengths import describe as describe_lengths
from .mps import outside_mps_env
from .procs import field, now
from .runctx import Ctx, TrialError, fault_kinds, fmt_s
from .serve import ServeOpts

GPU_MODELS = ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b"]
# Weight bytes (GB, bf16) per preset: only for time estimates (the budget), never for results.
WEIGHTS_GB = {"qwen2.5-0.5b": 1.0, "qwen2.5-1.5b": 3.1, "qwen2.5-3b": 6.2, "qwen2.5-7b": 15.2, "qwen2.5-14b": 29.5}


def gb(model: str) -> float:
    return WEIGHTS_GB.get(model, 0.05)


# Seconds a vLLM engine takes to start beyond the reference engine's (torch.compile, graph
# capture, profiling; 35-61 s on the H100 for 0.5B): only for time estimates (the budget).
VLLM_START_S = 60.0


def engine_start(a) -> float:
    return VLLM_START_S if a.engine == "vllm" else 0.0


def csv_list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def int_list(s: str) -> list[int]:
    return [int(x) for x in csv_list(s)]


def prompt_ids(n: int, seed: int) -> list[int]:
    """A deterministic prompt of n token ids, all below 256: valid for every preset's
    tokenizer (the tiny test model's byte-level one has 259 tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


# ----------------------------------------------------------------------------- deployments and faults


# KV blocks of a vLLM deployment when --num-blocks is not given (vLLM's adapter needs the
# count: both engines must have the same one), as bench/gpu/session.sh runs them.
VLLM_BLOCKS = {"qwen2.5-14b": 1536}
VLLM_BLOCKS_DEFAULT = 2048
VLLM_MAX_MODEL_LEN = 4096


def engine_key(a) -> dict:
    """The engine in a point's key: none for the reference engine (keys as before there
    was a second engine, so earlier result files resume), {"engine": ...} otherwise."""
    return {"engine": a.engine} if a.engine != "ref" else {}


def engine_shape(ctx: Ctx, model: str, num_blocks: int = 0, max_model_len: int = 0) -> tuple[int, int]:
    """(KV blocks, context) of the engines for `model`: what the experiment asks, else
    --num-blocks / --max-model-len, else the engine's default (0 for the reference
    engine, which sizes itself; the vLLM adapter needs both)."""
    a = ctx.args
    nb, mml = num_blocks or a.num_blocks, max_model_len or a.max_model_len
    if a.engine == "vllm":
        nb = nb or VLLM_BLOCKS.get(model, VLLM_BLOCKS_DEFAULT)
        mml = mml or VLLM_MAX_MODEL_LEN
    return nb, mml


def serve_opts(ctx: Ctx, model: str, sync_every: int = 1, engine_args: list[str] | None = None,
               num_blocks: int = 0, max_model_len: int = 0, env: dict[str, str] | None = None) -> ServeOpts:
    a = ctx.args
    env = dict(env or {})
    if ctx.cpu:
        # CPU check: slow each engine step so a kill lands at the chosen token (FRMPS_TEST_STEP_DELAY_MS
        # is the engine's test knob; never set on the GPU).
        env["FRMPS_TEST_STEP_DELAY_MS"] = str(a.cpu_step_delay_ms)
    eargs = list(engine_args or []) + list(getattr(a, "engine_arg", None) or [])
    if a.max_num_seqs:
        eargs.append(f"--max-num-seqs={a.max_num_seqs}")
    nb, mml = engine_shape(ctx, model, num_blocks, max_model_len)
    return ServeOpts(frmps=a.frmps, python=a.python, model=model, device=a.device, memory=a.memory, mps=a.mps,
                     sync_every=sync_every, num_blocks=nb, max_model_len=mml, engine_args=eargs, env=env,
                     engine=a.engine, serve_args=list(getattr(a, "serve_arg", None) or []))


class Deployments:
    """Hands out a ready `frmps serve` pair for the next faulted trial: the same one
    once it is re-armed (with MPS faults: once the failback has put an active back
    inside MPS and the standby back to sleep outside), or a fresh one per faulted
    trial where nothing would restore the placement (a --no-failback serve) or on
    --fresh-deployments."""

    def __init__(self, ctx: Ctx, opts: ServeOpts, name: str):
        self.ctx, self.opts, self.name = ctx, opts, name
        self.reuse = not opts.mps or ("--no-failback" not in opts.serve_args
                                      and not getattr(ctx.args, "fresh_deployments", False))
        self.faults = 0  # faults fired on the current deployment
        self.dep: Deployment | None = None
        self.n = 0
        self.startup_s: float | None = None
        self.failures: list[str] = []
        self.fenced_pid = 0  # the active the last failover replaced: a re-armed pair has neither role on it

    def __enter__(self) -> "Deployments":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def estimate_start(self) -> float:
        extra = 2 * VLLM_START_S if self.opts.engine == "vllm" else 0.0  # two engines, one after the other
        return 4.0 if self.ctx.cpu else 15.0 + 0.3 * gb(self.opts.model) + extra

    def estimate_next(self) -> float:
        """Seconds until the next trial's pair is ready: a reused pair's re-arm (on the GPU
        the failback's new engine from a spare: ~8-12 s at 0.5B with vLLM, ~15 s at 14B),
        else a fresh start."""
        if self.dep is None or not self.reuse:
            return self.estimate_start()
        return 2.0 if self.ctx.cpu else 15.0 + 0.3 * gb(self.opts.model)

    def get(self) -> Deployment:
        if self.dep is not None:
            if self.reuse:
                self.dep.wait_pair(self.ctx.args.start_timeout, fenced_pid=self.fenced_pid, placed=self.opts.mps)
                return self.dep
            self.close()
        if len(self.failures) >= 2:
            raise TrialError(f"the deployment failed to start twice; first error: {self.failures[0]}")
        self.ctx.budget.check(self.estimate_start(), f"starting frmps serve ({self.opts.model})")
        self.n += 1
        dep = Deployment(self.opts, self.ctx.args.workdir, f"{self.name}-{self.n}", self.ctx.cleanup)
        t0 = now()
        dep.start()
        try:
            dep.wait_pair(self.ctx.args.start_timeout)
        except Exception as e:
            dep.stop()
            self.failures.append(str(e)[:2000])
            raise
        self.startup_s = round(now() - t0, 2)
        self.dep = dep
        self.faults = 0
        return dep

    def spent(self, fenced_pid: int = 0) -> None:
        """A failover happened on the current deployment (replacing that active)."""
        self.fenced_pid = fenced_pid
        self.faults += 1
        if not self.reuse:
            self.close()

    def after_trial(self, res: dict | None, fenced_pid: int) -> None:
        """After a trial that fired its fault (res has "inject"): the pair is spent. One that
        failed before firing leaves it as it was; when unsure, start afresh next time."""
        if res is None:
            self.close()
        elif res.get("inject"):
            self.spent(fenced_pid)

    def close(self) -> None:
        if self.dep is not None:
            self.dep.stop()
            self.dep = None


def make_trigger(ctx: Ctx, dep: Deployment):
    if ctx.args.mps:
        return MpsTrigger(ctx.args.faults_dir, ctx.fault, dep.mps_client_env(), ctx.cleanup)
    pid = int(field(dep.engines(dep.status())["active"], "pid"))
    return SigkillTrigger(pid)


def frmps_point(ctx: Ctx, deps: Deployments, measure: Callable[[Deployment, Trigger], dict]) -> dict:
    """One faulted trial on the next ready pair: ``measure(dep, trigger)`` streams, fires
    the trigger and returns what it measured (a TrialError carries what it had). The
    pair is then spent if the fault fired, kept if it did not, dropped if unsure."""
    dep = deps.get()
    fenced = int(field(dep.engines(dep.status()).get("active") or {}, "pid", 0) or 0)
    prior = deps.faults  # faults this pair has been through before this trial (0: a fresh pair)
    res: dict | None = None
    try:
        res = measure(dep, make_trigger(ctx, dep))
    except TrialError as e:
        res = e.partial
        if e.partial is not None:
            e.partial["deployment_startup_s"] = deps.startup_s
        raise
    finally:
        deps.after_trial(res, fenced)
    res["deployment_startup_s"] = deps.startup_s
    res["deployment_prior_faults"] = prior
    res["engine_args"] = deps.opts.engine_args
    return res


def stream_point(ctx: Ctx, deps: Deployments, body: dict, kill_after: int, extra: list[dict] | None = None) -> dict:
    """frmps_point for one stream (plus `extra`), faulted once it has `kill_after` tokens."""
    # No wait for the re-armed standby here: the next deps.get() waits if it reuses the pair.
    return frmps_point(ctx, deps, lambda dep, trig: frmps_trial(dep, trig, body, kill_after, wait_rearm=False,
                                                                extra_streams=extra, timeout=ctx.args.trial_timeout))


def rig_for(ctx: Ctx, model: str, engine_args: list[str]) -> BaselineRig:
    """The baselines' engines get the deployment's sizes (pools, batch). They recover in one
    prefill pass, without the exact mode that frmps's engines run with on the GPU (which
    replays the unsynced tokens by decode steps): the baselines' fastest path."""
    a = ctx.args
    eargs = list(engine_args)
    if a.max_num_seqs:
        eargs += ["--max-num-seqs", str(a.max_num_seqs)]
    if a.baseline_exact:
        eargs += ["--exact", "1"]
    rig = BaselineRig(a.frmps, a.python, a.device, a.mps, a.faults_dir, fault_kinds(a.fault)[0], a.workdir, eargs,
                      ctx.cleanup, ctx.log, engine=a.engine)
    if ctx.cpu:  # the victim decodes at the pace of the CPU check's frmps engines
        rig.victim_env["FRMPS_TEST_STEP_DELAY_MS"] = str(a.cpu_step_delay_ms)
    return rig


def shape_args(num_blocks: int, max_model_len: int) -> list[str]:
    out = []
    if num_blocks:
        out += ["--num-blocks", str(num_blocks)]
    if max_model_len:
        out += ["--max-model-len", str(max_model_len)]
    return out


def outside_env(ctx: Ctx) -> dict[str, str]:
    """Environment for an engine process that must not join any MPS server (a system-wide one included)."""
    return outside_mps_env(ctx.args.frmps, ctx.args.workdir) if ctx.args.mps else {}


def drop_arrivals(r: dict) -> dict:
    """Token arrival times matter for the outage plot only; elsewhere they just bloat the file."""
    r.pop("arrivals", None)
    return r


def no_kv_args(ctx: Ctx) -> list[str] | None:
    """Engine flag for the ablation (the standby ignores the snapshot's KV and prefills the
    prompt and the delivered tokens again), or None if the engine lacks it."""
    return ["--no-kv-reuse"] if engine_supports(ctx.args.python, "--no-kv-reuse") else None


def no_kv_why(ctx: Ctx) -> str:
    return "the engine has no --no-kv-reuse flag (KV sharing cannot be switched off)"


def describe_recovery(d: dict) -> str:
    return (f"recovery {fmt_s(d.get('recovery_s'))}"
            + (f", fault->death {fmt_s(d.get('fault_to_detect_s', d.get('fault_to_death_s')))}")
            + (f", reused {d['reused_tokens']} / recomputed {d['prefilled_tokens']} tokens" if 'reused_tokens' in d else "")
            + (f", first step's forward launched {launch:.2f} ms in" if (launch := ((d.get("takeover_log") or {}).get(
                "first_step") or {}).get("forward_launch_ms")) is not None else ""))


class Experiment:
    name = ""
    number = 0
    title = ""
    faults = True  # injects faults (needs the triggers and MPS on the GPU)
    # The engines' batch size (exact mode, the GPU default, decodes at exactly this many rows:
    # sized to the load, as the H100 exact-mode proof did with 8).
    max_num_seqs = 8

    def default_max_num_seqs(self, a) -> int:
        return self.max_num_seqs
    models_default_gpu: list[str] = []

    def add_args(self, p: argparse.ArgumentParser) -> None:
        pass

    def defaults(self, args) -> None:
        """Fill defaults that depend on --cpu / --quick."""

    def plan(self, args) -> list[dict]:
        raise NotImplementedError

    def run(self, ctx: Ctx) -> None:
        raise NotImplementedError


def _models(args, gpu_default: list[str], quick_gpu: list[str] | None = None) -> list[str]:
    if args.models:
        return csv_list(args.models)
    if args.device == "cpu":
        return ["tiny"]
    return quick_gpu if args.quick and quick_gpu else gpu_default


def _model(args, gpu_default: str) -> str:
    if args.model:
        return args.model
    return "tiny" if args.device == "cpu" else gpu_default


# ----------------------------------------------------------------------------- 1. recovery across model sizes


class Recovery(Experiment):
    name, number = "recovery", 1
    title = "Recovery time across model sizes (killed right after prefill, short prompt)"

    def add_args(self, p):
        p.add_argument("--models", default="", help="comma-separated presets (default: the five Qwen2.5 sizes; --cpu: tiny)")
        p.add_argument("--systems", default="frmps,sleep-only,cold")
        p.add_argument("--trials", type=int, default=0, help="trials of frmps and sleep-only per model (default 3; --quick 1)")
        p.add_argument("--cold-cache", default="dropped,warm",
                       help="cold restarts per model: with the checkpoint dropped from the page cache, and/or warm")
        p.add_argument("--prompt-len", type=int, default=6)
        p.add_argument("--tail-tokens", type=int, default=32, help="tokens streamed after the kill point")
        p.add_argument("--no-cold-warmup", action="store_true",
                       help="cold restart: emit the first token before capturing the decode graphs")

    def defaults(self, a):
        a.trials = a.trials or (1 if a.quick or a.device == "cpu" else 3)

    def plan(self, a):
        keys = []
        systems = csv_list(a.systems)
        for m in _models(a, GPU_MODELS):
            for s in systems:
                if s == "cold":
                    keys += [{"model": m, "system": s, "cache": c, "trial": 0, **engine_key(a)}
                             for c in csv_list(a.cold_cache)]
                else:
                    keys += [{"model": m, "system": s, "trial": t, **engine_key(a)} for t in range(a.trials)]
        return keys

    def run(self, ctx):
        a = ctx.args
        plan = self.plan(a)
        for model in _models(a, GPU_MODELS):
            prompt = prompt_ids(a.prompt_len, 1)
            eargs = shape_args(*engine_shape(ctx, model))
            keys = [k for k in plan if k["model"] == model]
            fk = ctx.results.pending([k for k in keys if k["system"] == "frmps"])
            if fk:
                with Deployments(ctx, serve_opts(ctx, model), f"recovery-{model}") as deps:
                    for key in fk:
                        body = completion_body(model, prompt, 1 + a.tail_tokens)
                        ctx.run_point(key, lambda: stream_point(ctx, deps, body, 1), 10 + deps.estimate_next(),
                                      describe_recovery)
            reqs = [{"key": 1, "prompt": prompt, "max_tokens": 1 + a.tail_tokens + 4096, "temperature": 0.0}]
            sk = ctx.results.pending([k for k in keys if k["system"] == "sleep-only"])
            if sk:
                self._sleep_only(ctx, model, sk, reqs, eargs)
            ck = ctx.results.pending([k for k in keys if k["system"] == "cold"])
            if ck:
                self._cold(ctx, model, ck, reqs, eargs)

    @staticmethod
    def _sleep_only(ctx, model, keys, reqs, eargs):
        rig = rig_for(ctx, model, eargs)
        ctx.budget.check(10 + 0.6 * gb(model) + engine_start(ctx.args), f"starting the sleep-only standby ({model})")
        try:
            sb, ready = rig.start_sleep_standby(model)
        except Exception as e:
            ctx.fail_points(keys, f"sleep-only standby did not start: {e}")
            return
        try:
            for key in keys:
                ctx.run_point(key, lambda: {**drop_arrivals(rig.trial("sleep-only", model, reqs, 1, standby=sb,
                                                                      fault=ctx.fault)),
                                            "standby_init_s": ready.get("init_s")},
                              10 + 0.2 * gb(model) + engine_start(ctx.args), describe_recovery)
        finally:
            sb.close()

    @staticmethod
    def _cold(ctx, model, keys, reqs, eargs):
        a = ctx.args
        rig = rig_for(ctx, model, eargs)
        ctx.budget.check(10 + 2.5 * gb(model), f"the {model} checkpoint")
        try:
            path, meta = ensure_checkpoint(a.python, a.cache_dir, model, 0, a.device, [],
                                           rig.logfile(f"checkpoint-{model}"), ctx.log, ctx.cleanup, rig.outside_env)
        except Exception as e:
            ctx.fail_points(keys, f"checkpoint: {e}")
            return
        for key in keys:
            def point(key=key):
                files = checkpoint_files(path)
                if key["cache"] == "dropped":
                    drop_page_cache(files)
                frac = page_cache_fraction(files)
                r = drop_arrivals(rig.trial("cold", model, reqs, 1, checkpoint=path, cold_warmup=not a.no_cold_warmup,
                                            fault=ctx.fault))
                r["page_cache_fraction_before"] = frac
                r["checkpoint"] = {k: meta.get(k) for k in ("bytes", "files", "write_s", "cached", "evicted")}
                r["checkpoint"]["files"] = len(meta.get("files") or [])
                return r

            ctx.run_point(key, point, 15 + 1.0 * gb(model) + 2 * engine_start(a), describe_recovery)


# ----------------------------------------------------------------------------- 2. prompt length


class PromptLength(Experiment):
    name, number = "prompt-length", 2
    title = "Recovery vs prompt length, with and without KV sharing"

    def add_args(self, p):
        p.add_argument("--model", default="", help="preset (default qwen2.5-14b; --cpu: tiny)")
        p.add_argument("--lengths", default="", help="prompt lengths (default 500,1000,...,4000; --quick 500,2000,4000)")
        p.add_argument("--systems", default="frmps,frmps-no-kv")
        p.add_argument("--trials", type=int, default=1)
        p.add_argument("--sync-every", type=int, default=1, help="frmps serve's --sync-every (its default: 1)")
        p.add_argument("--kill-after", type=int, default=0,
                       help="kill once the client has this many tokens (default: --sync-every, i.e. just after the "
                            "first sync that covers the prompt)")

    def defaults(self, a):
        if not a.lengths:
            a.lengths = ("64,256" if a.device == "cpu" else
                         "500,2000,4000" if a.quick else "500,1000,1500,2000,2500,3000,3500,4000")
        a.kill_after = a.kill_after or a.sync_every

    def plan(self, a):
        return [{"model": _model(a, "qwen2.5-14b"), "system": s, "prompt_len": n, "trial": t, **engine_key(a)}
                for s in csv_list(a.systems) for n in int_list(a.lengths) for t in range(a.trials)]

    def run(self, ctx):
        a = ctx.args
        model = _model(a, "qwen2.5-14b")
        mml = max(int_list(a.lengths)) + a.kill_after + 64
        mml = -(-mml // 256) * 256
        for system in csv_list(a.systems):
            keys = ctx.results.pending([k for k in self.plan(a) if k["system"] == system])
            if not keys:
                continue
            eargs = []
            if system == "frmps-no-kv":
                eargs = no_kv_args(ctx)
                if eargs is None:
                    ctx.unsupported(keys, no_kv_why(ctx))
                    continue
            opts = serve_opts(ctx, model, a.sync_every, eargs, max_model_len=max(mml, a.max_model_len))
            with Deployments(ctx, opts, f"plen-{system}") as deps:
                for key in keys:
                    body = completion_body(model, prompt_ids(key["prompt_len"], 100 + key["trial"]), a.kill_after + 16)
                    ctx.run_point(key, lambda: stream_point(ctx, deps, body, a.kill_after),
                                  10 + deps.estimate_next(), describe_recovery)


# ----------------------------------------------------------------------------- 3. tokens since the last sync


class SinceSync(Experiment):
    name, number = "since-sync", 3
    title = "Recovery vs tokens generated before the kill (K), sync every N = 1 and 16, and without KV sharing"

    def add_args(self, p):
        p.add_argument("--model", default="", help="preset (default qwen2.5-14b; --cpu: tiny)")
        p.add_argument("--ks", default="", help="kill points K (default 1,2,4,...,128; --quick 1,16,128)")
        p.add_argument("--systems", default="frmps-n1,frmps-n16,frmps-no-kv",
                       help="frmps-n<N>: sync every N steps; frmps-no-kv: N=16, standby ignores the snapshot's KV")
        p.add_argument("--trials", type=int, default=1)
        p.add_argument("--prompt-len", type=int, default=6)

    def defaults(self, a):
        if not a.ks:
            a.ks = "1,16" if a.device == "cpu" else "1,16,128" if a.quick else "1,2,4,8,16,32,64,128"

    def plan(self, a):
        return [{"model": _model(a, "qwen2.5-14b"), "system": s, "k": k, "trial": t, **engine_key(a)}
                for s in csv_list(a.systems) for k in int_list(a.ks) for t in range(a.trials)]

    def run(self, ctx):
        a = ctx.args
        model = _model(a, "qwen2.5-14b")
        for system in csv_list(a.systems):
            keys = ctx.results.pending([k for k in self.plan(a) if k["system"] == system])
            if not keys:
                continue
            eargs: list[str] | None = []
            if system == "frmps-no-kv":
                n, eargs = 16, no_kv_args(ctx)
                if eargs is None:
                    ctx.unsupported(keys, no_kv_why(ctx))
                    continue
            elif system.startswith("frmps-n") and system[7:].isdigit():
                n = int(system[7:])
            else:
                ctx.fail_points(keys, f"unknown system {system!r}")
                continue
            with Deployments(ctx, serve_opts(ctx, model, n, eargs), f"since-{system}") as deps:
                for key in keys:
                    body = completion_body(model, prompt_ids(a.prompt_len, 200 + key["trial"]), key["k"] + 16)
                    ctx.run_point(key, lambda: {**stream_point(ctx, deps, body, key["k"]), "sync_every": n},
                                  10 + deps.estimate_next() + 0.05 * key["k"], describe_recovery)


# ----------------------------------------------------------------------------- 4. sync overhead


class SyncOverhead(Experiment):
    name, number = "sync-overhead", 4
    faults = False
    title = "Step time with the engine loop publishing to the ring every N steps, and without, saturating batch"

    def add_args(self, p):
        p.add_argument("--models", default="", help="presets (default: the five sizes; --cpu: tiny)")
        p.add_argument("--engines", default="", help="ref, vllm or both (default: --engine)")
        p.add_argument("--sync-list", default="0,1,2,4,8,16,32,64",
                       help="N values: publish every N steps; 0 = no ring attached (the reference)")
        p.add_argument("--between-steps", default="1",
                       help="N values also measured with the publish between steps where the engine overlaps it "
                            "with the device (its launch hook), in the same run: what the overlap hides ('' for none)")
        p.add_argument("--steps-per-trial", type=int, default=0,
                       help="steps per trial (+ 1; default 128, --quick 64, --cpu 8: at least twice the largest N "
                            "for a steady count of publishes)")
        p.add_argument("--reps", type=int, default=0,
                       help="rounds over all N, alternately forward and backward, each N between two no-publish "
                            "trials (default 2; --quick 1)")
        p.add_argument("--batch", type=int, default=0, help="0: as many sequences as memory allows, up to 256 (CPU: 8)")
        p.add_argument("--prompt-len", type=int, default=128)

    def defaults(self, a):
        a.steps_per_trial = a.steps_per_trial or (8 if a.device == "cpu" else 64 if a.quick else 128)
        a.reps = a.reps or (1 if a.quick else 2)
        a.engines = a.engines or a.engine

    def plan(self, a):
        return [{"model": m, "engine": e} for m in _models(a, GPU_MODELS) for e in csv_list(a.engines)]

    def run(self, ctx):
        a = ctx.args
        for key in ctx.results.pending(self.plan(a)):
            model, engine = key["model"], key["engine"]

            def point(model=model, engine=engine):
                args = ["--model", model, "--device", a.device, "--engine", engine, "--memory", a.memory,
                        "--sync-list", a.sync_list, "--between-steps", a.between_steps,
                        "--steps-per-trial", str(a.steps_per_trial), "--reps", str(a.reps),
                        "--batch", str(a.batch), "--prompt-len", str(a.prompt_len), "--workdir", a.workdir,
                        "--timeout", str(a.trial_timeout)]
                log = os.path.join(a.workdir, f"sync-overhead-{engine}-{model}.log")
                proc = EngineProc("sync-overhead", a.python, args, outside_env(ctx), log, ctx.cleanup)
                try:
                    ev = proc.wait_event(lambda e: e.get("ev") == "result", a.trial_timeout * 3, "the sync-overhead result")
                finally:
                    proc.close()
                return {k: v for k, v in ev.items() if k not in ("ev", "rt")}

            ctx.run_point(key, point, 30 + 3 * gb(model) + (VLLM_START_S if engine == "vllm" and not ctx.cpu else 0),
                          lambda d: f"batch {d.get('batch')}, {len(d.get('trials', []))} trials, publish {d.get('publish')}")


# ----------------------------------------------------------------------------- 5. outage under load


class LoadGen:
    """A steady stream of requests: `concurrency` client threads, each sending one
    streaming request after another until `duration` s have passed; prompt and
    output lengths from `lengths` (client i's sequence depends on the seed and i only)."""

    def __init__(self, base: str, model: str, concurrency: int, duration: float, lengths: RequestLengths):
        self.base, self.model = base, model
        self.concurrency, self.duration = concurrency, duration
        self.lengths = lengths
        self.streams: list[Stream] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.t0 = 0.0

    def start(self) -> None:
        self.t0 = now()
        for i in range(self.concurrency):
            t = threading.Thread(target=self._worker, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)

    def _worker(self, i: int) -> None:
        client = self.lengths.client(i)
        n = 0
        while now() < self.t0 + self.duration:
            n += 1
            plen, olen, pseed = client.next()
            body = completion_body(self.model, prompt_ids(plen, pseed), olen)
            s = Stream(self.base, body, timeout=600, key=i * 100000 + n)
            with self._lock:
                self.streams.append(s)
            s.run()  # in this thread

    def join(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)


def _longest_gap(ts: list[float]) -> tuple[float, float | None]:
    """The longest gap between consecutive times of sorted ``ts`` and where it began
    (0.0 and None with fewer than two)."""
    gap, at = 0.0, None
    for a, b in zip(ts, ts[1:]):
        if b - a > gap:
            gap, at = b - a, a
    return gap, at


def _around(ts: list[float], t: float) -> tuple[float | None, float | None]:
    """The last time of sorted ``ts`` at or before ``t`` and the first after it (None where there is none)."""
    i = bisect.bisect_right(ts, t)
    return (ts[i - 1] if i else None), (ts[i] if i < len(ts) else None)


def outage_metrics(arrivals: list[tuple[float, int]], t_fault: float, t0: float, bin_s: float,
                   window: tuple[float, float] = (-1.0, 30.0), t_detect: float | None = None) -> dict:
    """Client-visible outage: the longest gap between consecutive token arrivals
    (over all streams) within [t_fault + window[0], t_fault + window[1]]; and the
    token throughput in bins of bin_s, relative to t0.

    That window also holds the engine's own stalls after the failover (a step
    carrying a batch of prefills), which can be longer than the failover's pause.
    With t_detect (when the supervisor saw the active die) the failover's own gap
    is given too: the gap between consecutive arrivals that spans t_detect (the
    dead active delivers nothing after it; the next token is a resumed one), and
    the time from the fault to that next token."""
    ts = sorted(t for t, _ in arrivals)
    failover: dict = {}
    if t_detect is not None:
        last, resumed = _around(ts, t_detect)
        if last is not None and resumed is not None:
            failover = {"failover_gap_s": round(resumed - last, 4),
                        "failover_gap_start_rel_fault_s": round(last - t_fault, 4),
                        "fault_to_resumed_token_s": round(resumed - t_fault, 4)}
    lo, hi = t_fault + window[0], t_fault + window[1]
    gap, at = _longest_gap([t for t in ts if lo <= t <= hi])
    bins: dict[int, int] = {}
    for t, n in arrivals:
        i = int((t - t0) // bin_s)
        bins[i] = bins.get(i, 0) + n
    nb = max(bins) + 1 if bins else 0
    tput = [bins.get(i, 0) / bin_s for i in range(nb)]
    before, after = _around(ts, t_fault)
    # Throughput back: the first bin after the outage with >= 90% of the median rate of the 3 s before the fault.
    fb = int((t_fault - t0) // bin_s)
    pre = sorted(tput[max(0, fb - int(3 / bin_s)):fb])
    back = None
    if pre and at is not None:
        ref = pre[len(pre) // 2]
        start = int((at + gap - t0) // bin_s)
        back = next((i for i in range(start, nb) if tput[i] >= 0.9 * ref), None)
    # The same measure without a fault: the longest gap in the second half of the load
    # before the fault (the engine's own stalls, e.g. a step carrying a batch of prefills).
    pre_lo = t0 + (t_fault - t0) / 2
    calm = [t for t in ts if pre_lo <= t < t_fault - 0.05]
    steady = _longest_gap(calm)[0] if len(calm) > 1 else None
    return {"outage_s": round(gap, 4), "outage_start_rel_fault_s": round(at - t_fault, 4) if at is not None else None,
            "steady_gap_s": round(steady, 4) if steady is not None else None,
            "steady_window_s": [round(pre_lo - t_fault, 3), -0.05], **failover,
            "last_token_before_fault_rel_s": round(before - t_fault, 4) if before is not None else None,
            "first_token_after_fault_rel_s": round(after - t_fault, 4) if after is not None else None,
            "throughput_back_rel_fault_s": round(back * bin_s - (t_fault - t0), 3) if back is not None else None,
            "bin_s": bin_s, "tokens_per_s": [round(x, 1) for x in tput],
            "fault_rel_t0_s": round(t_fault - t0, 4), "tokens": sum(n for _, n in arrivals)}


class Outage(Experiment):
    name, number = "outage", 5
    title = "Client-visible outage under a steady stream of requests"

    def add_args(self, p):
        p.add_argument("--model", default="", help="preset (default qwen2.5-14b; --cpu: tiny)")
        p.add_argument("--systems", default="frmps,frmps-n16,frmps-no-kv,sleep-only",
                       help="frmps (the defaults: --sync-every 1), frmps-n16 (--sync-every 16), frmps-no-kv, sleep-only")
        p.add_argument("--trials", type=int, default=1)
        p.add_argument("--concurrency", type=int, default=0, help="client streams (default 32; --cpu 4)")
        p.add_argument("--duration", type=float, default=0, help="seconds of load (default 20; --cpu 4)")
        p.add_argument("--fault-at", type=float, default=0, help="fault this many seconds into the load (default: half)")
        p.add_argument("--lengths", default="sharegpt", choices=["sharegpt", "uniform"],
                       help="prompt and output lengths: a seeded ShareGPT-like distribution (bench/README.md), or "
                            "uniform over --prompt-range / --output-range")
        p.add_argument("--length-scale", type=float, default=0,
                       help="sharegpt: every length times this (default 1; --cpu 0.1)")
        p.add_argument("--prompt-range", default="128,512", help="uniform: prompt lengths lo,hi")
        p.add_argument("--output-range", default="64,256", help="uniform: output lengths lo,hi")
        p.add_argument("--bin-ms", type=float, default=50)

    def default_max_num_seqs(self, a) -> int:
        # vLLM: its own default, what a user of `frmps serve` gets. Setting it to the load's
        # concurrency (32) also caps the CUDA-graph sizes vLLM captures (2 x max_num_seqs,
        # 64 tokens), and every step carrying more prefill than that runs without a graph
        # (~50-85 ms of host work at 14B on an H200: bench/results/2026-11-28-h200x2-vllm-outage/).
        # The reference engine decodes exactly this many rows (exact mode).
        return 0 if a.engine == "vllm" else a.concurrency

    def defaults(self, a):
        cpu = a.device == "cpu"
        a.concurrency = a.concurrency or (4 if cpu else 32)
        a.duration = a.duration or (4.0 if cpu else 12.0 if a.quick else 20.0)
        a.fault_at = a.fault_at or a.duration / 2
        if cpu and a.prompt_range == "128,512":
            a.prompt_range, a.output_range = "8,32", "16,48"
        a.length_scale = a.length_scale or (0.1 if cpu else 1.0)

    @staticmethod
    def length_dists(a):
        """(prompt lengths, output lengths) of the request stream."""
        if a.lengths == "sharegpt":
            return sharegpt(a.length_scale)
        return UniformLengths(*int_list(a.prompt_range)), UniformLengths(*int_list(a.output_range))

    def load_record(self, a) -> dict:
        pd, od = self.length_dists(a)
        return {"lengths": a.lengths, "prompt": describe_lengths(pd), "output": describe_lengths(od)}

    def plan(self, a):
        return [{"model": _model(a, "qwen2.5-14b"), "system": s, "trial": t, **engine_key(a)}
                for s in csv_list(a.systems) for t in range(a.trials)]

    def _blocks(self, a) -> int:
        """KV blocks for the load: the frmps streams (prompt + output) and the sleep-only
        victim's open-ended requests (prompt + ~40 tokens/s until the end); the same pool
        size for every system, so their wake-up costs compare."""
        pd, od = self.length_dists(a)
        hi, ohi = pd.hi, od.hi
        per = max(hi + ohi, -(-(hi + int(min(a.fault_at, 2.0) * 150) + 64) // 256) * 256)
        return a.concurrency * (-(-per // 16)) + 64

    def run(self, ctx):
        a = ctx.args
        model = _model(a, "qwen2.5-14b")
        nb = max(a.num_blocks, self._blocks(a))
        for system in csv_list(a.systems):
            keys = ctx.results.pending([k for k in self.plan(a) if k["system"] == system])
            if not keys:
                continue
            if system == "sleep-only":
                self._sleep_only(ctx, model, keys, nb)
                continue
            eargs: list[str] | None = []
            if system == "frmps-no-kv":
                eargs = no_kv_args(ctx)
                if eargs is None:
                    ctx.unsupported(keys, no_kv_why(ctx))
                    continue
            n = 16 if system == "frmps-n16" else 1
            pd, od = self.length_dists(a)
            mml = max(a.max_model_len, -(-(pd.hi + od.hi + 16) // 256) * 256)
            with Deployments(ctx, serve_opts(ctx, model, n, eargs, num_blocks=nb, max_model_len=mml),
                             f"outage-{system}") as deps:
                for key in keys:
                    ctx.run_point(key, lambda key=key: frmps_point(
                                      ctx, deps, lambda dep, trig: self._measure(ctx, dep, trig, model, key["trial"])),
                                  a.duration + 30 + deps.estimate_next(),
                                  lambda d: f"outage {fmt_s(d.get('outage_s'))}, {d.get('stream_errors')} stream errors")

    def _measure(self, ctx, dep, trig, model, trial) -> dict:
        a = ctx.args
        res: dict = {}
        try:
            n0 = len(dep.failovers(dep.status()))
            trig.prepare()
            load = LoadGen(dep.base, model, a.concurrency, a.duration, RequestLengths(*self.length_dists(a), seed=trial))
            load.start()
            time.sleep(max(0.0, load.t0 + a.fault_at - now()))
            res["inject"] = trig.fire()
            t_fault = res["inject"]["t_fault"]
            done = load.join(a.duration + a.trial_timeout)
            st = dep.wait(lambda s: len(dep.failovers(s)) > n0 and field(dep.failovers(s)[0], "cause") != "pending",
                          60, "the failover record")
            rec = dep.failovers(st)[0]
            res["record"] = {k: field(rec, k) for k in ("cause", "ok", "error", "duration_seconds", "resumed_requests",
                                                        "reused_tokens", "prefilled_tokens", "first_token_seconds")}
            detect = int(field(rec, "unix_nanos", 0) or 0) / 1e9
            res["fault_to_detect_s"] = round(detect - t_fault, 4) if detect else None
            arrivals = [(t, len(ids)) for s in load.streams for t, ids in s.chunks]
            res.update(outage_metrics(arrivals, t_fault, load.t0, a.bin_ms / 1000, t_detect=detect or None))
            res["requests"] = len(load.streams)
            res["stream_errors"] = sum(1 for s in load.streams if s.error)
            res["errors_sample"] = [s.error for s in load.streams if s.error][:3]
            res["unfinished"] = sum(1 for s in load.streams if not s.finish)
            res["load_drained"] = done
            per_stream = [_longest_gap([t for t, _ in s.chunks])[0] for s in load.streams if s.chunks]
            res["max_stream_gap_s"] = round(max(per_stream, default=0.0), 4)
            res["load"] = {"concurrency": a.concurrency, "duration_s": a.duration, "fault_at_s": a.fault_at,
                           **self.load_record(a)}
            if res["stream_errors"]:
                raise TrialError(f"{res['stream_errors']} client streams failed: {res['errors_sample'][0]}", res)
            return res
        except TrialError as e:
            if e.partial is None:
                e.partial = res
            raise
        finally:
            res.update(trig.close() or {})

    def _sleep_only(self, ctx, model, keys, nb):
        """The same recovery work in the sleep-only baseline, measured in process (no front door):
        a victim serving `concurrency` requests is faulted; the standby wakes, re-prefills every
        open request and decodes on. A lower bound of its client-visible outage."""
        a = ctx.args
        # The victim's requests must still be open at the fault: as long as the context
        # allows, the fault a few seconds into steady decoding.
        kill_at = min(a.fault_at, 2.0)
        pd, _ = self.length_dists(a)
        mml = max(a.max_model_len, -(-(pd.hi + int(kill_at * 150) + 64) // 256) * 256)
        eargs = shape_args(*engine_shape(ctx, model, nb, mml))
        rig = rig_for(ctx, model, eargs)
        ctx.budget.check(10 + 0.6 * gb(model) + engine_start(a), "starting the sleep-only standby")
        try:
            sb, ready = rig.start_sleep_standby(model)
        except Exception as e:
            ctx.fail_points(keys, f"sleep-only standby did not start: {e}")
            return
        try:
            for key in keys:
                def point(trial=key["trial"]):
                    # The same prompt lengths as the frmps streams (each client's first request);
                    # the outputs run on to the end of the trial.
                    lengths = RequestLengths(*self.length_dists(a), seed=trial)
                    reqs = []
                    for i in range(a.concurrency):
                        plen, _, pseed = lengths.client(i).next()
                        p = prompt_ids(plen, pseed)
                        reqs.append({"key": i + 1, "prompt": p, "max_tokens": mml - len(p) - 1, "temperature": 0.0})
                    r = rig.trial("sleep-only", model, reqs, 1, standby=sb, kill_at_s=kill_at,
                                  then_steps=int(max(1.0, a.duration - a.fault_at) * 20), victim_args=["--warmup", "1"],
                                  fault=ctx.fault)
                    arrivals = r.pop("arrivals")
                    t0 = min(t for t, _ in arrivals)
                    r.update(outage_metrics(arrivals, r["inject"]["t_fault"], t0, a.bin_ms / 1000))
                    r["load"] = {"concurrency": a.concurrency, "all_requests_at_once": True,
                                 "fault_s_after_first_token": kill_at, **self.load_record(a)}
                    r["standby_init_s"] = ready.get("init_s")
                    return r

                ctx.run_point(key, point, a.duration + 30 + 0.2 * gb(model) + engine_start(a),
                              lambda d: f"outage {fmt_s(d.get('outage_s'))} (sleep-only, in process)")
        finally:
            sb.close()


# ----------------------------------------------------------------------------- 6. standby memory


class StandbyMemory(Experiment):
    name, number = "standby-memory", 6
    faults = False
    title = "Standby GPU memory per model size, against a bare CUDA context"

    def add_args(self, p):
        p.add_argument("--models", default="", help="presets (default: the five sizes; --cpu: tiny)")
        p.add_argument("--no-sleep-only", action="store_true", help="skip the sleep-only standby's memory")
        p.add_argument("--settle-s", type=float, default=2.0)

    def plan(self, a):
        return [{"model": m, **engine_key(a)} for m in _models(a, GPU_MODELS)]

    def _mem(self, ctx, pid: int) -> float | None:
        if ctx.cpu:
            return private_mib(pid)
        return (nvidia_smi_apps().get(pid) or {}).get("used_mib")

    def run(self, ctx):
        a = ctx.args
        for key in ctx.results.pending(self.plan(a)):
            model = key["model"]

            def point(model=model) -> dict:
                res: dict = {"unit": "host private MiB (CPU check)" if ctx.cpu else "GPU MiB (nvidia-smi, per process)"}
                dep = Deployment(serve_opts(ctx, model), a.workdir, f"mem-{model}", ctx.cleanup)
                dep.start()
                try:
                    st = dep.wait_pair(a.start_timeout)
                    time.sleep(a.settle_s)
                    eng = dep.engines(st)
                    sb, act = int(field(eng["standby"], "pid")), int(field(eng["active"], "pid"))
                    res["standby_mib"], res["active_mib"] = self._mem(ctx, sb), self._mem(ctx, act)
                    # Its own account of the memory: torch's pools and the per-thread stack, at sleep.
                    sb_log = field(eng["standby"], "log_path", default=None)
                    res["standby_torch_pools_mib"] = loglines.standby_pools(sb_log)
                    res["standby_stack_bytes"] = loglines.standby_stack_bytes(sb_log)
                    phases = loglines.memory_phases(sb_log)  # with FRMPS_DEBUG_MEMORY_PHASES=1
                    if phases:
                        res["standby_memory_phases"] = phases
                    if not ctx.cpu:
                        res["apps"] = {str(k): v for k, v in nvidia_smi_apps().items()}
                finally:
                    dep.stop()
                rig = rig_for(ctx, model, shape_args(*engine_shape(ctx, model)))
                c = EngineProc("context", a.python, ["--device", a.device], rig.outside_env, rig.logfile("context"),
                               ctx.cleanup)
                try:
                    c.wait_event(lambda e: e.get("ev") == "ready", 300, "the bare context")
                    time.sleep(a.settle_s)
                    res["context_mib"] = self._mem(ctx, c.pid)
                finally:
                    c.close()
                if not a.no_sleep_only:
                    sbp, ready = rig.start_sleep_standby(model)
                    try:
                        time.sleep(a.settle_s)
                        res["sleep_only_standby_mib"] = self._mem(ctx, sbp.pid)
                        res["sleep_only_init_s"] = ready.get("init_s")
                    finally:
                        sbp.close()
                if res.get("standby_mib") is None or res.get("context_mib") is None:
                    raise TrialError("memory of the standby or of the bare context was not found", res)
                res["overhead_mib"] = round(res["standby_mib"] - res["context_mib"], 1)
                return res

            ctx.run_point(key, point, 40 + 1.0 * gb(model) + 3 * engine_start(a),
                          lambda d: f"standby {d.get('standby_mib')} MiB, context {d.get('context_mib')} MiB")


# ----------------------------------------------------------------------------- 7. correctness


class Correctness(Experiment):
    name, number = "correctness", 7
    title = "Outputs after recovery equal the no-fault outputs (greedy and seeded)"

    def add_args(self, p):
        p.add_argument("--model", default="", help="preset (default qwen2.5-0.5b; --cpu: tiny)")
        p.add_argument("--ks", default="", help="kill points K (default 1,2,4,...,1024; --quick 1,32,1024)")
        p.add_argument("--trials", type=int, default=1)
        p.add_argument("--sync-every", type=int, default=1, help="frmps serve's --sync-every (its default: 1)")
        p.add_argument("--prompt-len", type=int, default=16)
        p.add_argument("--tail-tokens", type=int, default=32)
        p.add_argument("--batch-invariant", action="store_true",
                       help="--engine vllm: run the engines with vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1; "
                            "the reference engine's exact mode is its own)")
        p.add_argument("--controls", type=proofcount.controls_arg, default="on",
                       help="negative controls before the sweep: on (every case: "
                            f"{', '.join(proofcount.CONTROL_CASES)}), off (debugging only; recorded), or a comma list. "
                            "Each case: a deployment whose engines run with FRMPS_TEST_MODE=1 "
                            "FRMPS_TEST_TAKEOVER_FAULT=<case>, one trial at the middle K; when one compares equal, "
                            "every point of the sweep fails with 'control <case> passed unnoticed'")

    def defaults(self, a):
        if not a.ks:
            a.ks = "1,16" if a.device == "cpu" else "1,32,1024" if a.quick else "1,2,4,8,16,32,64,128,256,512,1024"

    def plan(self, a):
        extra = engine_key(a)
        if a.batch_invariant:
            extra["batch_invariant"] = True
        return [{"model": _model(a, "qwen2.5-0.5b"), "k": k, "trial": t, **extra} for k in int_list(a.ks)
                for t in range(a.trials)]

    def run(self, ctx):
        a = ctx.args
        model = _model(a, "qwen2.5-0.5b")
        keys = ctx.results.pending(self.plan(a))
        if not keys:
            return
        # Exact mode is the GPU default; name it anyway. On the CPU the float32 engine is
        # batch-invariant by itself.
        exact = a.engine == "ref" and not ctx.cpu and engine_supports(a.python, "--exact")
        eargs = ["--exact"] if exact else []
        env = {"VLLM_BATCH_INVARIANT": "1"} if a.batch_invariant else {}
        mml = max(a.max_model_len, -(-(a.prompt_len + max(int_list(a.ks)) + a.tail_tokens + 16) // 256) * 256)
        err = self._controls(ctx, model, eargs, mml, env, exact)
        if err:
            ctx.fail_points(keys, err)
            return
        with Deployments(ctx, serve_opts(ctx, model, a.sync_every, eargs, max_model_len=mml, env=env), "correct") as deps:
            for key in keys:
                ctx.run_point(key, lambda key=key: frmps_point(
                                  ctx, deps, lambda dep, trig: self._measure(ctx, dep, trig, model, key, exact)),
                              10 + deps.estimate_next() + 0.02 * key["k"],
                              lambda d: f"equal {d.get('equal')}/{d.get('requests')} (exact mode: {d.get('exact_mode')})")

    def _controls(self, ctx, model, eargs, mml, env, exact) -> str | None:
        """--controls: one trial per case on a deployment of its own; their records in
        <out>/correctness-controls.json. Returns the error that fails the sweep (a case
        not detected, or one that could not run), else None."""
        a = ctx.args
        cases = a.controls
        out: dict = {"model": model, "controls_mode": ",".join(cases) if cases else "off", "controls": []}
        path = os.path.join(ctx.out_dir, "correctness-controls.json")
        if not cases:
            ctx.log("controls: OFF (--controls off): the sweep is not backed by negative controls")
        ks = int_list(a.ks)
        k = sorted(ks)[len(ks) // 2]
        for case in cases:
            res, err = None, None
            try:
                with Deployments(ctx, serve_opts(ctx, model, a.sync_every, eargs, max_model_len=mml,
                                                 env={**env, **proofcount.control_env(case)}), f"control-{case}") as deps:
                    res = frmps_point(ctx, deps, lambda dep, trig: self._measure(
                        ctx, dep, trig, model, {"k": k, "trial": 0}, exact))
            except Exception as e:  # noqa: BLE001  (recorded: the sweep then fails)
                err = f"{type(e).__name__}: {e}"[:500]
                res = getattr(e, "partial", None)
            rec = ((res or {}).get("failover") or {}).get("record") or None  # the failover the fault caused
            fired = bool(rec or (res or {}).get("inject"))
            r = proofcount.control_result(case, (res or {}).get("stream_verdicts") or [], rec.get("ok") if rec else None,
                                          err if fired else None)
            r.update(k=k, equal=(res or {}).get("equal"))
            if not fired:
                r["not_run"] = err or "the fault did not fire"
            out["controls"].append(r)
            ctx.log(f"control {case}: detected={r['detected']} ({r['how'] or 'both streams equal'})")
        os.makedirs(ctx.out_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1, default=str)
        not_run = [r for r in out["controls"] if r.get("not_run")]
        if not_run:
            return "; ".join(f"control {r['case']} did not run: {r['not_run']}" for r in not_run)
        try:
            proofcount.check_controls(out["controls"])
        except proofcount.ControlPassedUnnoticed as e:
            return f"ControlPassedUnnoticed: {e}"
        return None

    def _measure(self, ctx, dep, trig, model, key, exact) -> dict:
        a = ctx.args
        k = key["k"]
        n = k + a.tail_tokens
        p1, p2 = prompt_ids(a.prompt_len, 300 + key["trial"]), prompt_ids(a.prompt_len, 400 + key["trial"])
        greedy = completion_body(model, p1, n, temperature=0.0)
        seeded = completion_body(model, p2, n, temperature=0.8, seed=1234 + key["trial"])
        # The reference: the same two requests, concurrently, no fault, on the pair the fault
        # run then uses (still in MPS).
        ref = [Stream(dep.base, greedy), Stream(dep.base, seeded)]
        for s in ref:
            s.start()
        for s in ref:
            s.join(a.trial_timeout)
        if any(s.error or s.n_tokens != n for s in ref):
            raise TrialError(f"no-fault reference run failed: {[(s.n_tokens, s.error) for s in ref]}")
        ref_ids = [s.token_ids() for s in ref]
        r = frmps_trial(dep, trig, greedy, k, wait_rearm=False, extra_streams=[seeded], timeout=a.trial_timeout)
        got = [r.pop("token_ids"), *r.pop("extra_token_ids")]
        # Per stream: in flight at the fault (frmps_trial's classification), its verdict (proofcount).
        sv = [{**c, "verdict": proofcount.verdict(x, y, error=c.get("error"))}
              for c, x, y in zip(r.get("streams") or [], ref_ids, got)]
        t = proofcount.tally(sv)
        out = {"k": k, "tokens_at_fire": r.get("tokens_at_fire"), "requests": 2,
               "stream_verdicts": sv, "stream_count": t, "headline": proofcount.headline(t),
               "controls_mode": ",".join(a.controls) if a.controls else "off",
               "equal": sum(1 for v in sv if v["verdict"] == "exact"),
               "greedy_equal": ref_ids[0] == got[0], "seeded_equal": ref_ids[1] == got[1],
               "first_diff": [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                              if x != y else None for x, y in zip(ref_ids, got)],
               "lengths": [len(g) for g in got],
               "exact_mode": ("on" if exact else "off (CPU float32, batch-invariant)" if ctx.cpu else
                              f"vLLM, VLLM_BATCH_INVARIANT={'1' if a.batch_invariant else '0'}" if a.engine == "vllm"
                              else "unsupported by the engine"),
               "failover": {kk: r.get(kk) for kk in ("recovery_s", "reused_tokens", "prefilled_tokens", "record")}}
        return out


EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in (Recovery(), PromptLength(), SinceSync(), SyncOverhead(),
                                                           Outage(), StandbyMemory(), Correctness())}


def by_name_or_number(s: str) -> Experiment | None:
    if s in EXPERIMENTS:
        return EXPERIMENTS[s]
    for e in EXPERIMENTS.values():
        if s == str(e.number):
            return e
    return None

