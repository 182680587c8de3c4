"""What the experiments of `frmps bench` (experiments.py, outage.py) share: the
models and their sizes, the deployments a run reuses and the faults it injects,
the baselines' rigs, and the Experiment base class."""

from __future__ import annotations

import argparse
import random
from typing import Callable

from .baselines import BaselineRig, EngineProc, engine_supports
from .deploy import Deployment, MpsTrigger, SigkillTrigger, Trigger, frmps_trial
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
               num_blocks: int = 0, max_model_len: int = 0, env: dict[str, str] | None = None,
               serve_args: list[str] | None = None) -> ServeOpts:
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
                     engine=a.engine, serve_args=list(getattr(a, "serve_arg", None) or []) + list(serve_args or []))


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
    if ctx.args.mps:  # outside run_point (a sweep's negative controls) ctx.fault is unset: --fault's first kind
        return MpsTrigger(ctx.args.faults_dir, ctx.fault or ctx.fault_for({}), dep.mps_client_env(), ctx.cleanup)
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


def with_sleep_only_standby(ctx: Ctx, rig: BaselineRig, model: str, keys: list[dict],
                            run: Callable[[EngineProc, dict], None]) -> None:
    """The sleep-only baseline's standby for the points `keys`: its start checked against
    the time budget, started (the points fail if it does not start), handed with its
    ready event to `run`, closed after."""
    ctx.budget.check(10 + 0.6 * gb(model) + engine_start(ctx.args), f"starting the sleep-only standby ({model})")
    try:
        sb, ready = rig.start_sleep_standby(model)
    except Exception as e:
        ctx.fail_points(keys, f"sleep-only standby did not start: {e}")
        return
    try:
        run(sb, ready)
    finally:
        sb.close()


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
