"""Experiment 5 of `frmps bench`: the outage a client sees under load, frmps
against the baselines (experiments.py lists it)."""

from __future__ import annotations

import bisect
import threading
import time

from .deploy import Stream, completion_body
from .lengths import RequestLengths, UniformLengths, sharegpt
from .lengths import describe as describe_lengths
from .procs import field, now
from .runctx import TrialError, fmt_s
from .experiment_base import (Deployments, Experiment, _model, csv_list, engine_key, engine_shape, engine_start,
    frmps_point, gb, int_list, no_kv_args, no_kv_why, prompt_ids, rig_for, serve_opts, shape_args, with_sleep_only_standby)


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

        def run(sb, ready):
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

        with_sleep_only_standby(ctx, rig, model, keys, run)
