#!/usr/bin/env python3
"""Failover proof through the real supervisor (`frmps serve`), standard library only.

Per fault: start a deployment (active inside MPS, standby outside), stream
requests through the OpenAI endpoint, make a co-located MPS client fault (a
bench/faults trigger run with the active's CUDA_MPS_PIPE_DIRECTORY) while they
stream, wait for the takeover and the re-armed standby, then fault the promoted
active a second time (it runs outside MPS, so this fault is raised inside its
own context through the engine's debug hook, FRMPS_DEBUG_FAULT_SIGNAL=1 +
SIGUSR1) and check the re-armed standby takes over too. Every batch's texts and
token counts are compared with a no-fault run of the same requests.

    python3 bench/gpu/failover_proof.py --frmps bin/frmps --model qwen2.5-0.5b \
        --faults misaligned,illegal_instruction:jump-far --out results.json

--cpu runs the same sequence on the CPU path (--no-mps, host-shm) with SIGKILL
as the fault: a check of this script, not of GPU faults.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

# The engine package and the repository root (the bench package) importable.
sys.path[:0] = [os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "vllmpatch", "src")),
                os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))]

from bench import loglines  # noqa: E402  (standard library only)
from bench.envinfo import nvidia_smi_apps, smi_select  # noqa: E402  (standard library only)
from bench.serve import Serve, ServeOpts  # noqa: E402  (standard library only)
from bench import proofcount  # noqa: E402  (standard library only)
from bench import sse  # noqa: E402  (standard library only)

DEFAULT_FAULTS = [
    "misaligned:load", "illegal_instruction:jump-far", "shared_oob:shared", "shared_oob:local",
    "invalid_address_space:ld-global-shared", "stack_overflow:recursion", "oob_write:write",
    "readonly_write:vmm-read-only",
]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def now() -> float:
    return time.time()


def get(d: dict, *names, default=None):
    """A field by proto name or lowerCamelCase (grpc-gateway's default)."""
    for n in names:
        for k in (n, re.sub(r"_([a-z])", lambda m: m.group(1).upper(), n)):
            if k in d:
                return d[k]
    return default


def failover_seq(st: dict) -> int:
    """The seq of the newest failover record (0: none yet). Status keeps a bounded list
    (32, newest first), so a new failover shows as a higher seq, not a longer list."""
    fos = get(st, "failovers", default=[]) or []
    return int(get(fos[0], "seq", default=0) or 0) if fos else 0


def failover_after(st: dict, seq: int) -> bool:
    """A failover newer than seq is recorded, and its cause is known."""
    fos = get(st, "failovers", default=[]) or []
    return failover_seq(st) > seq and get(fos[0], "cause") != "pending"


def http_json(url: str, body: dict | None = None, timeout: float = 10.0):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def nvidia_smi() -> dict:
    out: dict = {}
    try:
        q = subprocess.run(["nvidia-smi", *smi_select(), "--query-gpu=memory.used,memory.total",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
        used, total = q.stdout.strip().splitlines()[0].split(",")
        out["gpu_used_mib"], out["gpu_total_mib"] = int(used), int(total)
        out["apps"] = nvidia_smi_apps()
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        out["error"] = str(e)
    return out


class Stream(threading.Thread):
    """One streaming /v1/completions request; records every text chunk with its arrival time."""

    def __init__(self, base: str, model: str, key: str, prompt: str, params: dict):
        super().__init__(daemon=True)
        self.base, self.model, self.key, self.prompt, self.params = base, model, key, prompt, params
        self.chunks: list[tuple[float, str]] = []
        self.usage: dict | None = None
        self.finish: str | None = None
        self.error: str | None = None
        self.t_start = self.t_end = 0.0
        self.token_ids: list[int] = []
        self.token_times: list[float] = []

    def run(self) -> None:
        body = sse.stream_body(dict(model=self.model, prompt=self.prompt, **self.params))
        self.t_start = now()
        try:
            with urllib.request.urlopen(sse.request(self.base + "/v1/completions", body), timeout=600) as r:
                for ev in sse.events(r):
                    if ev == sse.DONE:
                        break
                    if "error" in ev:
                        self.error = json.dumps(ev["error"])
                        continue
                    if ev.get("usage"):
                        self.usage = ev["usage"]
                    for ch in ev.get("choices") or []:
                        if ch.get("text"):
                            self.chunks.append((now(), ch["text"]))
                        if ch.get("token_ids"):
                            self.token_ids += ch["token_ids"]
                            self.token_times.append(now())
                        if ch.get("finish_reason"):
                            self.finish = ch["finish_reason"]
        except (urllib.error.URLError, OSError, ValueError) as e:
            self.error = f"{type(e).__name__}: {e}"
        self.t_end = now()

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.chunks)

    def result(self) -> dict:
        return {"text": self.text, "completion_tokens": (self.usage or {}).get("completion_tokens"),
                "prompt_tokens": (self.usage or {}).get("prompt_tokens"), "token_ids": list(self.token_ids),
                "finish_reason": self.finish, "error": self.error, "chunks": len(self.chunks)}


def serve_opts(a) -> ServeOpts:
    """What the proof's `frmps serve` runs, from its arguments."""
    exact = ["--exact"] if getattr(a, "exact", False) else []  # the README's --exact
    if getattr(a, "quick_start", False):
        # The README's GPU quick start: `frmps serve --model M` (with --exact, where asked) and
        # nothing else that changes how it serves; only where it listens and keeps its files.
        return ServeOpts(frmps=a.frmps, python=None, model=a.model, device=None, memory=None, sync_every=None,
                         engine=None, serve_args=exact)
    return ServeOpts(frmps=a.frmps, python=a.python, model=a.model, device=a.device, memory=a.memory,
                     mps=not a.cpu or bool(getattr(a, "mps_control", "")),
                     sync_every=a.sync_every, num_blocks=a.num_blocks, max_model_len=a.max_model_len,
                     engine_args=list(a.engine_arg), engine=getattr(a, "engine", "ref"),
                     serve_args=exact + list(getattr(a, "serve_arg", []) or []) + shared_mps_args(a))


def fresh_dir(path: str, prefix: str) -> str:
    """``path``, made if missing, without the ``<prefix>*.jsonl`` files an earlier run left in
    a reused workdir (not this deployment's)."""
    os.makedirs(path, exist_ok=True)
    for f in os.listdir(path):
        if f.startswith(prefix) and f.endswith(".jsonl"):
            os.unlink(os.path.join(path, f))
    return path


class Deployment(Serve):
    """The proof's `frmps serve`: in a session of its own, with the engines'
    token logs (FRMPS_DEBUG_TOKEN_LOG) and debug fault hooks on."""

    timeout_error = TimeoutError
    status_timeout = 5.0

    def __init__(self, args, name: str, workdir: str):
        log_dir = os.path.join(workdir, f"logs-{name}")
        os.makedirs(log_dir, exist_ok=True)
        super().__init__(serve_opts(args), os.path.join(workdir, f"run-{name}"), os.path.join(log_dir, "frmps.log"),
                         log_dir, port=args.port)
        self.args, self.name = args, name
        self.admin = self.admin_addr  # the admin API's host:port
        self.token_dir = fresh_dir(os.path.join(workdir, f"tokens-{name}"), "tokens-")
        # --kv-digests: the engines' KV digests at every handover and adoption (bench/kv_digests.py)
        self.kv_dir = fresh_dir(os.path.join(workdir, f"kv-{name}"), "kv-") if getattr(args, "kv_digests", False) else ""

    def start(self) -> None:
        a = self.args
        env = {}
        src = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "vllmpatch", "src"))
        env["PYTHONPATH"] = src + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
        env["FRMPS_DEBUG_FAULT_SIGNAL"] = "1"
        env["FRMPS_DEBUG_TOKEN_LOG"] = self.token_dir
        env["FRMPS_DEBUG_POOL_CHECKSUM"] = "1"
        if self.kv_dir:
            env["FRMPS_DEBUG_KV_DIGESTS"] = self.kv_dir
        env.update(getattr(a, "env", None) or {})
        super().start(env, own_session=True)

    def engines(self, st: dict) -> dict:
        out = {}
        for e in get(st, "engines", default=[]) or []:
            out[str(get(e, "role", default="")).lower()] = e
        return out

    def wait(self, pred, timeout: float, what: str, poll: float = 0.02) -> tuple[dict, float]:
        """Until pred(status): that status and when it was seen."""
        return self.poll_status(pred, timeout, what, poll)

    def ready_pair(self, st: dict, fenced_pid: int | None = None) -> bool:
        """An active serving and a standby ready, neither of them fenced_pid (the
        engine a failover replaced), and no failback under way. After a failover
        with failback on, the standby is the same process as before (the promoted
        engine went back to sleep), so "re-armed" cannot mean "a new standby pid"."""
        e = self.engines(st)
        act, sb = e.get("active"), e.get("standby")
        fb = get(st, "failback", default={}) or {}
        return (act is not None and get(act, "state") == "serving" and sb is not None and get(sb, "state") == "ready"
                and fenced_pid not in (get(act, "pid"), get(sb, "pid"))
                and get(fb, "state", default="disabled") in ("idle", "disabled", ""))

    def tokens_since(self, t0: float) -> dict:
        """prompt ids (tuple) -> output ids of the requests that finished after t0 (engine token logs)."""
        out = {}
        for name in sorted(os.listdir(self.token_dir)):
            with open(os.path.join(self.token_dir, name)) as f:
                for line in f:
                    rec = json.loads(line)
                    if rec["t"] >= t0 and rec.get("prompt") is not None:
                        out[tuple(rec["prompt"])] = rec["output"]
        return out

    def mps_dirs(self) -> tuple[str, str]:
        """The pipe and log directories of the MPS daemon the active runs under: the
        operator's (--mps-pipe-dir) or frmps's own in its run dir."""
        if getattr(self.args, "mps_pipe_dir", ""):
            return self.args.mps_pipe_dir, self.args.mps_log_dir
        return os.path.join(self.run_dir, "mps", "pipe"), os.path.join(self.run_dir, "mps", "log")

    def save_mps_logs(self) -> None:
        """frmps's own MPS daemon logs into the run dir, which frmps removes at exit: keep copies."""
        src = self.mps_dirs()[1]
        for name in ("control.log", "server.log"):
            try:
                with open(os.path.join(src, name), "rb") as f, open(os.path.join(self.log_dir, "mps-" + name), "wb") as g:
                    g.write(f.read())
            except OSError:
                pass

    def stop(self) -> None:
        self.save_mps_logs()
        if self.proc is None or self.proc.poll() is not None:
            return
        self.terminate(60)


def requests_for(args) -> list[tuple[str, str, dict]]:
    out = []
    for i in range(args.requests):
        prompt = f"Request {i}: " + " ".join(f"word{(i * 7 + j) % 50}" for j in range(40 + 13 * i))
        params = dict(max_tokens=args.max_tokens, ignore_eos=True)
        if i % 2:
            params.update(temperature=0.8, seed=1000 + i)
        else:
            params.update(temperature=0.0)
        out.append((f"r{i}", prompt, params))
    return out


def run_batch(dep: Deployment, args, inject=None, prepare=None) -> tuple[list[Stream], dict, dict]:
    """Returns the streams, what inject() reported, and the engines' token ids per prompt."""
    streams = [Stream(dep.base, args.model, k, p, prm) for k, p, prm in requests_for(args)]
    if prepare is not None:
        prepare()
    t0 = now()
    for s in streams:
        s.start()
    info: dict = {}
    if inject is not None:
        # Dummy weights decode mostly to empty text, and the front door sends no empty
        # chunks: fault a fixed time after the requests went out (or once every stream
        # has --inject-after text chunks, whichever comes first).
        deadline = t0 + args.inject_delay
        while now() < deadline and not all(len(s.chunks) >= args.inject_after or not s.is_alive() for s in streams):
            time.sleep(0.002)
        info = inject()
        info["streams_alive_at_inject"] = sum(s.is_alive() for s in streams)
    for s in streams:
        s.join(600)
    time.sleep(0.05)
    return streams, info, dep.tokens_since(t0)


def compare(ref: list[dict], got: list[dict]) -> dict:
    out = {"requests": len(ref), "text_equal": 0, "tokens_equal": 0, "errors": 0, "first_diff": []}
    for r, g in zip(ref, got):
        if g["error"]:
            out["errors"] += 1
        if r["text"] == g["text"]:
            out["text_equal"] += 1
        else:
            n = next((i for i, (a, b) in enumerate(zip(r["text"], g["text"])) if a != b), min(len(r["text"]), len(g["text"])))
            out["first_diff"].append({"char": n, "ref_len": len(r["text"]), "got_len": len(g["text"])})
        if r["completion_tokens"] == g["completion_tokens"]:
            out["tokens_equal"] += 1
    return out


def compare_ids(ref: dict, got: dict) -> dict:
    """Token ids per prompt against the no-fault run: equal requests, and for the others the first differing index."""
    out = {"requests": len(ref), "ids_equal": 0, "missing": 0, "first_diff_index": []}
    for prompt, r in ref.items():
        g = got.get(prompt)
        if g is None:
            out["missing"] += 1
        elif g == r:
            out["ids_equal"] += 1
        else:
            out["first_diff_index"].append(next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), min(len(r), len(g))))
    return out


def _exit_on_term(signum, _frame):
    # A bounded stage ends a check with SIGTERM: unwind, so that every
    # Deployment.stop() in a finally block stops its frmps (which runs in a
    # session of its own and would otherwise outlive the check with its MPS
    # daemon and engines).
    raise SystemExit(128 + signum)


signal.signal(signal.SIGTERM, _exit_on_term)

LOG_TAKEOVER, LOG_FIRST, LOG_SLEEP, LOG_INIT, LOG_ALLOC = (loglines.TAKEOVER, loglines.FIRST, loglines.SLEEP,
                                                           loglines.INIT, loglines.ALLOC)
grep_log = loglines.grep_first


def count_phase(streams: list[Stream], sref: list[dict] | None, t_event: float | None, detect: float | None,
                label: str) -> tuple[list[dict], dict]:
    """Each stream of a fault's batch: in flight at the fault (from the injection
    to the detected death) or not, its phase then, its verdict against this
    deployment's no-fault run of the same request (token ids); and their tally."""
    events = [(label, min(t_event, detect), max(t_event, detect))] if t_event and detect else []
    out = []
    for i, s in enumerate(streams):
        r = sref[i] if sref and i < len(sref) else {}
        c = proofcount.classify(s.t_start, s.token_times, s.t_end, events, failed=bool(s.error),
                                prompt_tokens=r.get("prompt_tokens"), prefill_chunk=None)
        out.append({"key": s.key, **c, "verdict": proofcount.verdict(r.get("token_ids") if r else None, s.token_ids,
                                                                      error=s.error, finished=bool(s.finish))})
    return out, proofcount.tally(out)


def failover_phase(dep: Deployment, args, ref: list[dict], ref_ids: dict, how: str, trig, res: dict,
                   sref: list[dict] | None = None) -> dict:
    """Stream a batch, fault while it streams, wait for takeover + re-armed standby.
    Fills res as it goes, so a failure still shows what happened. sref: this
    deployment's no-fault results of the same requests (the per-stream verdicts)."""
    st0 = dep.status()
    n0 = len(get(st0, "failovers", default=[]) or [])
    e0 = dep.engines(st0)
    old_active, old_standby = e0["active"], e0["standby"]
    prepare, inject = trig(dep, old_active)
    streams, inj, ids = run_batch(dep, args, inject=inject, prepare=prepare)
    res.update({"fault": how, "inject": inj})
    res["outputs"] = [s.result() for s in streams]
    res["exact"] = compare(ref, res["outputs"]) if ref else None
    res["exact_ids"] = compare_ids(ref_ids, ids) if ref_ids else None
    dep.save_mps_logs()

    def done(st):
        recs = get(st, "failovers", default=[]) or []
        return len(recs) > n0 and get(recs[0], "cause") != "pending"

    st, _ = dep.wait(done, 120, "the failover record")
    rec = (get(st, "failovers") or [])[0]
    detect = int(get(rec, "unix_nanos", default=0)) / 1e9
    res["record"] = {k: get(rec, k) for k in ("cause", "detail", "ok", "error", "duration_seconds", "resumed_requests",
                                              "reused_tokens", "prefilled_tokens", "first_token_seconds")}
    counted, res["stream_count"] = count_phase(streams, sref, inj.get("t_fault") or inj.get("t_signal"), detect, how)
    res["streams"] = [{k: c[k] for k in ("key", "in_flight", "phase", "verdict")} for c in counted]
    res["headline"] = proofcount.headline(res["stream_count"])
    # Re-armed: the replaced engine gone from both roles, a standby ready.
    st, t_rearmed = dep.wait(lambda s: dep.ready_pair(s, fenced_pid=get(old_active, "pid")), 300,
                             "the re-armed standby")
    e1 = dep.engines(st)
    new_standby = e1["standby"]
    res["rearm_s_from_detect"] = round(t_rearmed - detect, 4) if detect else None
    t_first = min((t for s in streams for t, _ in s.chunks if t > detect), default=None) if detect else None
    res["detect_to_first_token_s"] = round(t_first - detect, 4) if t_first else None
    if inj.get("t_fault"):
        res["fault_to_detect_s"] = round(detect - inj["t_fault"], 4) if detect else None
        res["fault_to_first_token_s"] = round(t_first - inj["t_fault"], 4) if t_first else None
    gaps = []
    for s in streams:
        ts = [t for t, _ in s.chunks]
        gaps.append(max((b - a for a, b in zip(ts, ts[1:])), default=0.0))
    res["max_stream_gap_s"] = round(max(gaps, default=0.0), 4)
    firsts = []
    path = get(old_standby, "log_path")
    if path and os.path.exists(path):
        with open(path, errors="replace") as f:
            firsts = [float(m.group(1)) for m in map(LOG_FIRST.search, f) if m]
    # This takeover's lines only: with failback the same process takes over fault after fault.
    firsts = [t for t in firsts if detect and detect <= t <= detect + 60]
    if firsts and detect:
        # Engine side: when the promoted engine handed each adopted request its first new token.
        res["detect_to_first_resumed_token_s"] = round(min(firsts) - detect, 4)
        res["detect_to_all_resumed_s"] = round(max(firsts) - detect, 4)
    tk = loglines.grep_last(get(old_standby, "log_path"), LOG_TAKEOVER)
    if tk:
        res["takeover_log"] = loglines.takeover_fields(tk)
    sl = grep_log(get(new_standby, "log_path"), LOG_SLEEP)
    init = grep_log(get(new_standby, "log_path"), LOG_INIT)
    if sl:
        res["rearmed_standby"] = {"map_ms": float(sl[0]), "ready_ms_after_start": int(sl[1]),
                                  "init_ms": int(init[0]) if init else None}
    res["old_active_death"] = get(e1.get("active") or {}, "last_death_cause")
    if not args.cpu:
        smi = nvidia_smi()
        pid = int(get(new_standby, "pid", default=0) or 0)
        res["gpu_after_rearm"] = {"gpu_used_mib": smi.get("gpu_used_mib"),
                                  "standby_used_mib": (smi.get("apps", {}).get(pid) or {}).get("used_mib"),
                                  "apps": smi.get("apps")}
    return res


def shared_mps_args(a) -> list[str]:
    """frmps serve flags that join the operator's MPS daemon, when one is given."""
    if not getattr(a, "mps_pipe_dir", ""):
        return []
    return ["--mps-pipe-dir", a.mps_pipe_dir] + (["--mps-log-dir", a.mps_log_dir] if a.mps_log_dir else [])


def mps_trigger(args, spec: str, gpu: int | None = None):
    """A fault trigger as a co-located MPS client (bench/faults); gpu: the one GPU
    of the daemon's it runs on (CUDA_VISIBLE_DEVICES), else the default device."""
    prog, _, variant = spec.partition(":")

    def make(dep: Deployment, active: dict):
        st: dict = {"err": []}

        def prepare() -> None:
            """Start the trigger as an MPS client before the requests: it joins MPS, says
            "ready" and waits on stdin, so the fault lands mid-stream."""
            if args.cpu:
                return
            env = dict(os.environ)
            env["CUDA_MPS_PIPE_DIRECTORY"], env["CUDA_MPS_LOG_DIRECTORY"] = dep.mps_dirs()
            if gpu is not None:  # the gpu-th of the devices the deployment sees
                seen = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
                env["CUDA_VISIBLE_DEVICES"] = seen[gpu] if gpu < len(seen) else str(gpu)
            p = subprocess.Popen([os.path.join(args.faults_dir, prog), variant or "", "-1"], env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            st["p"] = p
            t0 = now()
            for line in p.stderr:
                st["err"].append(line.strip())
                if "ready" in line:
                    break
            st["join_s"] = round(now() - t0, 3)

        def inject() -> dict:
            if args.cpu:
                t = now()
                os.kill(int(get(active, "pid")), signal.SIGKILL)
                return {"how": "SIGKILL (cpu check)", "t_fault": t}
            p = st["p"]
            t_gate = now()
            p.stdin.write("x")
            p.stdin.flush()
            t_fault = None
            for line in p.stderr:
                st["err"].append(line.strip())
                if "triggering" in line:
                    t_fault = loglines.trigger_time(line) or now()  # the trigger's own time, else when read
                    break
            out, rest = p.communicate(timeout=60)
            st["err"] += rest.strip().splitlines()
            return {"how": f"MPS client {spec}", "t_fault": t_fault or t_gate, "trigger_join_s": st.get("join_s"),
                    "trigger_rc": p.returncode, "trigger_out": out.strip(), "trigger_err": st["err"][-3:]}

        return prepare, inject

    return make


def second_fault(args):
    def make(dep: Deployment, active: dict):
        def inject() -> dict:
            pid = int(get(active, "pid"))
            t = now()
            if args.cpu:
                os.kill(pid, signal.SIGKILL)
                return {"how": "SIGKILL (cpu check)", "t_fault": t}
            os.kill(pid, signal.SIGUSR1)
            return {"how": "illegal address in the promoted active's own context (debug hook, SIGUSR1)",
                    "t_signal": t}

        return None, inject

    return make


class Terminated(Exception):
    """SIGTERM (a session's time bound): the proof stops as on an error, and what was
    measured is still counted and written."""


def stop_on_sigterm() -> None:
    def on_term(signum, frame):
        raise Terminated("stopped by SIGTERM (the caller's time bound)")
    signal.signal(signal.SIGTERM, on_term)


def main() -> int:
    stop_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frmps", default="bin/frmps")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--memory", default="cuda-vmm")
    ap.add_argument("--sync-every", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=0)
    ap.add_argument("--faults", default=",".join(DEFAULT_FAULTS))
    ap.add_argument("--faults-dir", default="bench/build/faults")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--inject-after", type=int, default=48, help="fault once every stream has this many chunks")
    ap.add_argument("--inject-delay", type=float, default=0.5, help="fault this many seconds after the requests went out")
    ap.add_argument("--no-second", action="store_true", help="skip the second fault per deployment")
    ap.add_argument("--port", type=int, default=0, help="OpenAI port (0: a free one)")
    ap.add_argument("--workdir", default="/tmp/frmps-proof")
    ap.add_argument("--out", default="failover_proof.json")
    ap.add_argument("--cpu", action="store_true", help="CPU check of this script: --no-mps, SIGKILL as the fault")
    ap.add_argument("--stop-on-error", action="store_true", help="stop after the first fault whose failover failed")
    ap.add_argument("--time-budget", type=float, default=0, help="skip remaining faults after this many seconds")
    ap.add_argument("--engine-arg", action="append", default=[],
                    help="passed to frmps serve --engine-arg (repeatable), e.g. --engine-arg=--max-num-seqs=8")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="another frmps serve flag (repeatable), e.g. --serve-arg=--max-restarts=100")
    ap.add_argument("--mps-pipe-dir", default="", help="join the operator's MPS daemon there (frmps serve --mps-pipe-dir); "
                    "the co-tenant fault trigger joins it too")
    ap.add_argument("--mps-log-dir", default="", help="that daemon's log directory (with --mps-pipe-dir)")
    args = ap.parse_args()
    if args.cpu:
        args.device, args.memory = "cpu", "host-shm"
    os.makedirs(args.workdir, exist_ok=True)
    t_begin = now()
    report: dict = {"model": args.model, "device": args.device, "memory": args.memory, "sync_every": args.sync_every,
                    "engine_args": args.engine_arg,
                    "requests": args.requests, "max_tokens": args.max_tokens, "mode": "cpu-check" if args.cpu else "gpu",
                    "faults": []}
    ref: list[dict] | None = None
    ref_ids: dict = {}

    def save():
        report["elapsed_s"] = round(now() - t_begin, 1)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    for i, spec in enumerate([f for f in args.faults.split(",") if f]):
        if args.time_budget and now() - t_begin > args.time_budget:
            report["faults"].append({"fault": spec, "skipped": "time budget"})
            continue
        dep = Deployment(args, f"{args.model}-{i}-{spec.replace(':', '-')}", args.workdir)
        entry: dict = {"fault": spec}
        report["faults"].append(entry)
        try:
            t0 = now()
            dep.start()
            st, t_ready = dep.wait(lambda s: dep.ready_pair(s), 600, "active serving + standby ready")
            entry["startup_s"] = round(t_ready - t0, 2)
            e = dep.engines(st)
            sl = grep_log(get(e["standby"], "log_path"), LOG_SLEEP)
            init = grep_log(get(e["standby"], "log_path"), LOG_INIT)
            alloc = grep_log(get(e["standby"], "log_path"), LOG_ALLOC)
            entry["first_standby"] = {"map_ms": float(sl[0]) if sl else None,
                                      "torch_reserved_mib": float(alloc[0]) if alloc else None,
                                      "ready_ms_after_start": int(sl[1]) if sl else None,
                                      "init_ms": int(init[0]) if init else None}
            if not args.cpu:
                smi = nvidia_smi()
                pid = int(get(e["standby"], "pid", default=0) or 0)
                entry["gpu_at_ready"] = {"gpu_used_mib": smi.get("gpu_used_mib"),
                                         "standby_used_mib": (smi.get("apps", {}).get(pid) or {}).get("used_mib"),
                                         "apps": smi.get("apps")}
            if ref is None:
                s1, _, ids1 = run_batch(dep, args)
                s2, _, ids2 = run_batch(dep, args)
                ref, ref_ids = [s.result() for s in s1], ids1
                report["baseline"] = {"outputs": ref, "repeat_exact": compare(ref, [s.result() for s in s2]),
                                      "repeat_exact_ids": compare_ids(ids1, ids2),
                                      "token_ids": [[list(k[:8]), v[:16]] for k, v in ids1.items()]}
                dep_ref, sref = ids1, ref
            else:
                # Same requests on a fresh deployment, no fault: run-to-run determinism.
                s0, _, ids0 = run_batch(dep, args)
                entry["nofault_exact_ids"] = compare_ids(ref_ids, ids0)
                dep_ref, sref = ids0, [s.result() for s in s0]
            entry["first"] = {}
            # Fault runs are compared with this deployment's own no-fault run of the same requests.
            failover_phase(dep, args, ref, dep_ref, spec, mps_trigger(args, spec), entry["first"], sref)
            if not args.no_second:
                entry["second"] = {}
                failover_phase(dep, args, ref, dep_ref, "second", second_fault(args), entry["second"], sref)
        except Exception as ex:  # keep going: one broken fault must not hide the others
            entry["error"] = f"{type(ex).__name__}: {ex}"
            if isinstance(ex, Terminated):  # but not past the caller's time bound
                report["stopped"] = str(ex)
        finally:
            dep.stop()
            save()
        print(summary_line(entry), flush=True)
        if report.get("stopped"):
            break
        if args.stop_on_error and not entry_ok(entry):
            report["stopped"] = f"stopped after {spec} failed (--stop-on-error)"
            break
    report["stream_count"] = proofcount.tally(
        [s for e in report["faults"] for p in (e.get("first"), e.get("second")) if p for s in p.get("streams") or []])
    report["headline"] = proofcount.headline(report["stream_count"])
    rc = exit_code(report)
    report["ok"] = rc == 0
    save()
    print(report["headline"], flush=True)
    return rc


def phase_ok(p: dict | None) -> bool:
    """A fault's batch passed: its failover succeeded and every request equals the
    no-fault run: no error, every text, every token-id list (engine token log) and
    every stream's own token ids."""
    if p is None:
        return True
    ex, xi, t = p.get("exact") or {}, p.get("exact_ids"), p.get("stream_count")
    return bool((p.get("record") or {}).get("ok") and ex.get("requests") and ex.get("errors", 0) == 0
                and ex.get("text_equal") == ex["requests"]
                and (xi is None or (xi.get("ids_equal") == xi.get("requests") and not xi.get("missing")))
                and (t is None or (t["in_flight"]["inexact"] == 0 and t["not_in_flight_not_exact"] == 0)))


def entry_ok(e: dict) -> bool:
    """A fault passed: its deployment ran it without an error, its first fault (and
    the second, when run) passed phase_ok, and a later deployment's no-fault run
    equals the first one's."""
    nf = e.get("nofault_exact_ids")
    return (not e.get("error") and e.get("first") is not None and all(phase_ok(e.get(k)) for k in ("first", "second"))
            and (nf is None or nf.get("ids_equal") == nf.get("requests")))


def exit_code(report: dict) -> int:
    """0 when at least one fault ran and every one that ran passed entry_ok, else 1."""
    ran = [e for e in report.get("faults") or [] if not e.get("skipped")]
    return 0 if ran and all(entry_ok(e) for e in ran) else 1


def summary_line(e: dict) -> str:
    def one(p):
        if not p:
            return "-"
        r = p.get("record") or {}
        ex = p.get("exact") or {}
        xi = p.get("exact_ids") or {}
        tk = p.get("takeover_log") or {}
        ra = p.get("rearmed_standby") or {}
        return (f"alive={(p.get('inject') or {}).get('streams_alive_at_inject')} cause={r.get('cause')} ok={r.get('ok')} resumed={r.get('resumed_requests')} "
                f"detect->ack={r.get('duration_seconds')} detect->tok={p.get('detect_to_first_resumed_token_s')}/{p.get('detect_to_all_resumed_s')} "
                f"sup_first_tok={r.get('first_token_seconds')} reused={r.get('reused_tokens')} prefilled={r.get('prefilled_tokens')} "
                f"fault->detect={p.get('fault_to_detect_s')} kvw={tk.get('kv_writable_ms')}ms resume={tk.get('resume_ms')}ms "
                f"rearm={p.get('rearm_s_from_detect')}s map={ra.get('map_ms')}ms "
                f"text_eq={ex.get('text_equal')}/{ex.get('requests')} ids_eq={xi.get('ids_equal')}/{xi.get('requests')} "
                f"diff_at={xi.get('first_diff_index')} err={ex.get('errors')}")
    if e.get("error") or e.get("skipped"):
        return f"{e['fault']}: {e.get('error') or e.get('skipped')} | first: {one(e.get('first'))}"
    nf = e.get("nofault_exact_ids") or {}
    return (f"{e['fault']}: start={e.get('startup_s')}s nofault_ids_eq={nf.get('ids_equal')}/{nf.get('requests')} | "
            f"1st: {one(e.get('first'))} | 2nd: {one(e.get('second'))}")


if __name__ == "__main__":
    sys.exit(main())
