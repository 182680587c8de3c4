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

import json
import os
import time

from . import exactness, loglines, proofcount
from .baselines import (EngineProc, checkpoint_files, drop_page_cache, engine_supports, ensure_checkpoint,
    page_cache_fraction)
from .deploy import Deployment, Stream, completion_body, frmps_trial
from .envinfo import nvidia_smi_apps, private_mib
from .procs import field
from .runctx import TrialError
from .experiment_base import (Deployments, Experiment, GPU_MODELS, VLLM_START_S, _model, _models, csv_list,
    describe_recovery, drop_arrivals, engine_key, engine_shape, engine_start, frmps_point, gb, int_list, no_kv_args,
    no_kv_why, outside_env, prompt_ids, rig_for, serve_opts, shape_args, stream_point, with_sleep_only_standby)
from .outage import Outage
from .report import TARGET_KS


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

        def run(sb, ready):
            for key in keys:
                ctx.run_point(key, lambda: {**drop_arrivals(rig.trial("sleep-only", model, reqs, 1, standby=sb,
                                                                      fault=ctx.fault)),
                                            "standby_init_s": ready.get("init_s")},
                              10 + 0.2 * gb(model) + engine_start(ctx.args), describe_recovery)

        with_sleep_only_standby(ctx, rig, model, keys, run)

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


def exact_serve_args(a) -> list[str]:
    """correctness --exact with vLLM: `frmps serve --exact` itself, so the sweep runs the
    kernels a user's --exact gets (batch-invariant with Triton attention), not an
    environment variable of its own."""
    return ["--exact"] if a.batch_invariant and a.engine == "vllm" else []


class Correctness(Experiment):
    name, number = "correctness", 7
    title = "Outputs after recovery equal the no-fault outputs (greedy and seeded)"

    def add_args(self, p):
        p.add_argument("--model", default="", help="preset (default qwen2.5-0.5b; --cpu: tiny)")
        p.add_argument("--ks", default="", help="kill points K (default 1,2,4,...,1024; --quick 1,32,1024)")
        p.add_argument("--control-attempts", type=int, default=3,
                       help="trials a control case may take to find an adopted request it fits (each on its own "
                            "deployment) before it counts as never applied")
        p.add_argument("--trials", type=int, default=1)
        p.add_argument("--sync-every", type=int, default=1, help="frmps serve's --sync-every (its default: 1)")
        p.add_argument("--prompt-len", type=int, default=16)
        p.add_argument("--tail-tokens", type=int, default=32)
        p.add_argument("--exact", "--batch-invariant", dest="batch_invariant", action="store_true",
                       help="--engine vllm: `frmps serve --exact`, as the README shows it (vLLM's batch-invariant kernels "
                            "with Triton attention); the reference engine's exact mode is its GPU default")
        p.add_argument("--controls", type=proofcount.controls_arg, default="on",
                       help="negative controls before the sweep: on (every case: "
                            f"{', '.join(proofcount.CONTROL_CASES)}), off (debugging only; recorded), or a comma list. "
                            "Each case: a deployment whose engines run with FRMPS_TEST_MODE=1 "
                            "FRMPS_TEST_TAKEOVER_FAULT=<case>, one trial at the middle K; when one compares equal, "
                            "every point of the sweep fails with 'control <case> passed unnoticed'")

    def defaults(self, a):
        if not a.ks:
            a.ks = "1,16" if a.device == "cpu" else "1,32,1024" if a.quick else ",".join(map(str, TARGET_KS))

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
        sargs = exact_serve_args(a)
        mml = max(a.max_model_len, -(-(a.prompt_len + max(int_list(a.ks)) + a.tail_tokens + 16) // 256) * 256)
        err = self._controls(ctx, model, eargs, mml, sargs, exact)
        if err:
            ctx.fail_points(keys, err)
            return
        with Deployments(ctx, serve_opts(ctx, model, a.sync_every, eargs, max_model_len=mml, serve_args=sargs),
                         "correct") as deps:
            for key in keys:
                ctx.run_point(key, lambda key=key: frmps_point(
                                  ctx, deps, lambda dep, trig: self._measure(ctx, dep, trig, model, key, exact)),
                              10 + deps.estimate_next() + 0.02 * key["k"],
                              lambda d: f"equal {d.get('equal')}/{d.get('requests')} (exact mode: {d.get('exact_mode')})")

    def _controls(self, ctx, model, eargs, mml, sargs, exact) -> str | None:
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
        # The controls' deployments sync less often than the sweep may (proofcount.control_sync_every); a case
        # that found no request it fits runs again on the next trial's prompts, up to --control-attempts trials
        # (proofcount.control_unapplied; the engines' logs say whether it was applied).
        sync = proofcount.control_sync_every(a.sync_every)
        for case in cases:
            res, err, seen = None, None, {}
            for attempt in range(max(1, a.control_attempts)):
                res, err = None, None
                ctx.fault = ctx.fault_for({"trial": attempt})  # the trigger, as run_point sets it for a point
                try:
                    with Deployments(ctx, serve_opts(ctx, model, sync, eargs, max_model_len=mml,
                                                     env=proofcount.control_env(case), serve_args=sargs),
                                     f"control-{case}" + (f"-try{attempt + 1}" if attempt else "")) as deps:
                        try:
                            res = frmps_point(ctx, deps, lambda dep, trig: self._measure(
                                ctx, dep, trig, model, {"k": k, "trial": attempt}, exact))
                        finally:  # a failed run too: whether the engines applied the case decides its record
                            if deps.dep is not None and case != proofcount.POSITIVE:
                                seen = exactness.control_lines(exactness.engine_logs(deps.dep.log_dir)).get(case) or {}
                except Exception as e:  # noqa: BLE001  (recorded: the sweep then fails)
                    err = f"{type(e).__name__}: {e}"[:500]
                    res = getattr(e, "partial", None)
                if not proofcount.control_unapplied(case, err, seen.get("applied"), seen.get("not_applied")):
                    break
                ctx.log(f"control {case}: not applied in trial {attempt + 1} ({'; '.join(seen['not_applied'])})")
            rec = ((res or {}).get("failover") or {}).get("record") or None  # the failover the fault caused
            fired = bool(rec or (res or {}).get("inject"))
            r = proofcount.control_result(case, (res or {}).get("stream_verdicts") or [], rec.get("ok") if rec else None,
                                          err if fired else None)
            r.update(k=k, equal=(res or {}).get("equal"), attempts=attempt + 1)
            if seen:
                r.update(applied=seen.get("applied", 0), not_applied=seen.get("not_applied") or [])
            why = proofcount.control_not_run(case, err, seen.get("applied")) if fired else None
            if not fired or why:  # a failed run says nothing of a case the engines never applied
                r.update(detected=False, not_run=why or err or "the fault did not fire")
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
                              ("vLLM, frmps serve --exact" if a.batch_invariant else "vLLM's default kernels")
                              if a.engine == "vllm"
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
