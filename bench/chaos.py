"""Chaos on the CPU: a real `frmps serve` (Go supervisor, reference engines on
the CPU, tiny model, host-shm pools) under concurrent OpenAI clients, streaming
and not, while faults are injected: SIGKILL of the active, a double fault (the
promoted engine killed before a fresh standby is ready), a SIGSTOP hang of the
active, SIGKILL of the supervisor followed by a restart. Every completed output
is checked against its no-fault output, every stream for tokens lost or
repeated, every failure for being a clean 503 with Retry-After (or an in-stream
error) inside a window where no engine could serve; the supervisor's
descriptors, goroutines, threads, children, RSS and shared-memory files are
sampled.

Used by vllmpatch/tests/test_chaos.py (bounded, in `make test`) and by
`make soak`:

    python -m bench.chaos --kills 1000 --streams 16 --out DIR

Standard library only.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field

from . import proofcount, sse
from .envinfo import git_commit, repo_root
from .procs import children_of, tail
from .serve import Serve as _Serve, ServeOpts

# ----------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Request:
    index: int
    path: str  # /v1/completions or /v1/chat/completions
    stream: bool
    body: dict


def workload(n: int, streaming: str = "mixed") -> list[Request]:
    """n requests: completions and chat, greedy and seeded, of different lengths;
    streaming "mixed" (every other one), "all" or "none"."""
    out = []
    for i in range(n):
        prompt = f"chaos {i}: " + "the standby takes over " * (1 + i % 4)
        body: dict = {"model": "tiny", "max_tokens": 24 + 8 * (i % 5), "ignore_eos": True, "return_token_ids": True}
        if i % 2:
            body.update(temperature=0.9, top_p=0.95, seed=100 + i)
        else:
            body.update(temperature=0.0)
        chat = i % 3 == 1
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        stream = {"all": True, "none": False}.get(streaming, i % 2 == 0)
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        out.append(Request(i, "/v1/chat/completions" if chat else "/v1/completions", stream, body))
    return out


@dataclass
class Outcome:
    index: int
    t_start: float
    t_end: float = 0.0
    ok: bool = False
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: str | None = None
    completion_tokens: int = -1
    ids: set[str] = field(default_factory=set)
    done: bool = False  # a stream's [DONE]
    status: int | None = None  # HTTP status of a refused request
    retry_after: str | None = None
    error_code: str | None = None
    error: str | None = None  # refused, in-stream error, or transport error
    transport: bool = False  # the connection failed (no HTTP answer)
    token_times: list[float] = field(default_factory=list)  # a stream's first and latest token (monotonic)


def send(base: str, req: Request, timeout: float = 120.0) -> Outcome:
    """Runs one request to its end."""
    o = Outcome(req.index, time.monotonic())
    try:
        with urllib.request.urlopen(sse.request(base + req.path, req.body), timeout=timeout) as resp:
            if req.stream:
                _read_stream(resp, o)
            else:
                _read_whole(json.loads(resp.read()), o)
    except urllib.error.HTTPError as e:
        o.status, o.retry_after = e.code, e.headers.get("Retry-After")
        raw = e.read()
        try:
            err = json.loads(raw)["error"]
            o.error_code, o.error = err.get("code"), err.get("message")
        except (ValueError, KeyError, TypeError):
            o.error = f"HTTP {e.code}: {raw[:200]!r}"
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as e:
        o.transport, o.error = True, f"{type(e).__name__}: {e}"
    o.t_end = time.monotonic()
    o.ok = o.error is None and o.status is None and (o.done or not req.stream)
    return o


def _choice_text(ch: dict) -> str:
    if "text" in ch:
        return ch.get("text") or ""
    return ((ch.get("delta") or ch.get("message") or {}).get("content")) or ""


def _read_stream(resp, o: Outcome) -> None:
    _read_events(resp, o)
    if not o.done and o.error is None:  # the connection ended mid-stream
        o.transport, o.error = True, "stream ended without [DONE] or an error event"


def _read_events(resp, o: Outcome) -> None:
    for ev in sse.events(resp):
        if ev == sse.DONE:
            o.done = True
            return
        if "error" in ev:
            o.error, o.error_code = ev["error"].get("message", "stream error"), ev["error"].get("code")
            continue
        o.ids.add(ev["id"])
        for ch in ev.get("choices") or []:
            o.text += _choice_text(ch)
            o.token_ids += ch.get("token_ids") or []
            if ch.get("token_ids"):
                t = time.monotonic()
                o.token_times = [o.token_times[0] if o.token_times else t, t]
            o.finish = ch.get("finish_reason") or o.finish
        if ev.get("usage"):
            o.completion_tokens = ev["usage"]["completion_tokens"]


def _read_whole(doc: dict, o: Outcome) -> None:
    o.ids.add(doc["id"])
    ch = doc["choices"][0]
    o.text, o.token_ids, o.finish = _choice_text(ch), list(ch.get("token_ids") or []), ch.get("finish_reason")
    o.completion_tokens = doc["usage"]["completion_tokens"]


# ----------------------------------------------------------------------------- the deployment


class ChaosError(AssertionError):
    pass


class Serve(_Serve):
    """`frmps serve --no-mps` on the CPU with fixed ports, run dir, state dir and a
    private ring dir under /dev/shm, so that a restart takes over all of them."""

    error = ChaosError

    def __init__(self, frmps: str, python: str, workdir: str, sync_every: int = 4, step_delay_ms: int = 5,
                 extra_args: list[str] | None = None, spare: bool = False):
        self.workdir = workdir
        self.spare = spare  # --spare on: one more child, an engine process started ahead of need
        # Unix socket paths are limited to 108 bytes: a short run dir.
        run_dir = os.path.join(tempfile.mkdtemp(prefix="frmps-chaos-", dir="/tmp"), "run")
        self.state_dir = os.path.join(workdir, "state")
        self.ring_dir = tempfile.mkdtemp(prefix="frmps-chaos-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        opts = ServeOpts(frmps=frmps, python=python, model="tiny", device="cpu", memory=None, mps=False,
                         sync_every=sync_every, env={"FRMPS_TEST_STEP_DELAY_MS": str(step_delay_ms)},
                         serve_args=["--state-dir", self.state_dir, "--ring-dir", self.ring_dir,
                                     "--max-restarts", "1000000", f"--spare={'on' if spare else 'off'}",
                                     *(extra_args or [])])
        super().__init__(opts, run_dir, os.path.join(workdir, "serve.log"))
        self.admin = self.admin_url
        self.starts = 0

    def start(self, timeout: float = 180.0) -> None:
        super().start(header=f"---- start {self.starts} ----\n")
        self.starts += 1
        self.wait_state("serving_ready", timeout)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def expected_children(self) -> int:
        """The two engines, and the spare while one runs (status names its pid)."""
        if not self.spare:
            return 2
        return 2 + (1 if int((self.status().get("spare") or {}).get("pid") or 0) > 0 else 0)

    def wait_spare(self, timeout: float = 60.0) -> None:
        """With spares on: until a spare is ready (its imports done)."""
        deadline = time.monotonic() + timeout
        while self.spare and (self.status().get("spare") or {}).get("state") != "ready":
            if time.monotonic() > deadline:
                raise ChaosError(f"no ready spare in {timeout:.0f}s: {self.status().get('spare')}")
            time.sleep(0.05)

    def engine_pid(self, role: str, st: dict | None = None) -> int:
        for e in (st or self.status()).get("engines", []):
            if e.get("role") == role and e.get("pid"):
                return int(e["pid"])
        raise ChaosError(f"no {role} engine in {st}")

    def failovers(self, st: dict | None = None) -> list[dict]:
        return (st or self.status()).get("failovers") or []

    def goroutines(self) -> int:
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=10) as r:
            m = re.search(rb"^go_goroutines (\d+)", r.read(), re.M)
        return int(m.group(1)) if m else -1

    def records(self) -> list[dict]:
        """The launch records in the state dir."""
        out = []
        for name in sorted(os.listdir(self.state_dir)) if os.path.isdir(self.state_dir) else []:
            if name.endswith(".json") and not name.startswith("."):
                with open(os.path.join(self.state_dir, name)) as f:
                    out.append(json.load(f))
        return out

    def stop(self) -> int | None:
        """SIGTERM and wait: the clean shutdown."""
        if self.proc is None:
            return None
        rc = self.terminate(60)
        if rc is None:
            raise ChaosError(f"frmps did not stop on SIGTERM:\n{tail(self.log_path)}")
        self.proc = None
        return rc

    def kill(self) -> None:
        super().kill()
        self.proc = None

    def remove_dirs(self) -> None:
        shutil.rmtree(os.path.dirname(self.run_dir), ignore_errors=True)
        shutil.rmtree(self.ring_dir, ignore_errors=True)


# ----------------------------------------------------------------------------- resources


@dataclass
class Sample:
    t: float
    pid: int
    fds: int
    threads: int
    goroutines: int
    children: int
    zombies: int
    rss_kib: int
    shm_files: int
    sockets: int  # socket files in the run dir: the live engines' control and generation sockets
    kills: int = 0
    idle: bool = True  # no client running (else under the soak's streams)


def _proc_status(pid: int) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out


def sample(serve: Serve, kills: int = 0) -> Sample:
    pid = serve.pid
    st = _proc_status(pid)
    kids = children_of(pid)
    return Sample(t=time.monotonic(), pid=pid, fds=len(os.listdir(f"/proc/{pid}/fd")), threads=int(st["Threads"]),
                  goroutines=serve.goroutines(), children=sum(1 for _, s in kids if s != "Z"),
                  zombies=sum(1 for _, s in kids if s == "Z"), rss_kib=int(st["VmRSS"].split()[0]),
                  shm_files=len(os.listdir(serve.ring_dir)), sockets=_sockets(serve.run_dir), kills=kills)


def _sockets(d: str) -> int:
    import stat

    n = 0
    for name in os.listdir(d):
        try:
            n += stat.S_ISSOCK(os.lstat(os.path.join(d, name)).st_mode)
        except OSError:
            pass
    return n


def goroutine_dump(serve: Serve, timeout: float = 10.0) -> str:
    """The supervisor's goroutines, for a failed baseline check: SIGQUIT makes the Go
    runtime print every goroutine's stack to stderr (the serve log) and exit. Ends the
    supervisor: only for a run that has already failed."""
    if serve.proc is None or serve.proc.poll() is not None:
        return ""
    with open(serve.log_path, "rb") as f:
        f.seek(0, os.SEEK_END)
        start = f.tell()
    serve.proc.send_signal(signal.SIGQUIT)
    try:
        serve.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
    with open(serve.log_path, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    # Only the goroutine stacks, the frmps frames first.
    blocks = [b for b in text.split("\n\n") if b.startswith("goroutine ")]
    blocks.sort(key=lambda b: "frmps/frmps" not in b)
    return "\n\n".join(blocks)


def baseline(serve: Serve, quiet: float = 1.0, timeout: float = 10.0) -> Sample:
    """The supervisor's resting state to compare against: sampled until its
    descriptors and goroutines have not changed for ``quiet`` seconds (or timeout).
    One sample can catch a connection of the run before it (a client's request,
    the admin query) still open, and the check afterwards would then read one
    descriptor fewer as a difference (test_chaos once saw "fds 27 -> 26")."""
    s = sample(serve)
    since, deadline = time.monotonic(), time.monotonic() + timeout
    while time.monotonic() - since < quiet and time.monotonic() < deadline:
        time.sleep(0.2)
        n = sample(serve)
        if (n.fds, n.goroutines) != (s.fds, s.goroutines):
            since = time.monotonic()
        s = n
    return s


def settle(serve: Serve, base: Sample, timeout: float = 15.0) -> tuple[Sample, list[str]]:
    """Samples until descriptors and goroutines are back at the baseline (closing
    connections and ending goroutines are asynchronous), or timeout; returns the
    last sample and what still differs."""
    deadline = time.monotonic() + timeout
    while True:
        s = sample(serve)
        diff = [f"{k} {getattr(base, k)} -> {getattr(s, k)}" for k in ("fds", "goroutines")
                if getattr(s, k) != getattr(base, k)]
        want = serve.expected_children()
        diff += [f"children {s.children} (want {want})"] if s.children != want else []
        diff += [f"zombies {s.zombies}"] if s.zombies else []
        diff += [f"shm files {s.shm_files} (want the one ring)"] if s.shm_files != 1 else []
        diff += [f"socket files {s.sockets} (want the two engines' four)"] if s.sockets != 4 else []
        if not diff or time.monotonic() > deadline:
            return s, diff
        time.sleep(0.2)


# ----------------------------------------------------------------------------- clients and faults


@dataclass
class Window:
    """A span in which no engine could serve: failures are allowed inside."""
    label: str
    t0: float
    t1: float = float("inf")
    transport: bool = False  # the front door itself was down (supervisor killed)


class Clients:
    """n threads that send requests from the workload in turn until stopped."""

    def __init__(self, base_fn, requests: list[Request], n: int):
        self.base_fn, self.requests, self.n = base_fn, requests, n
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def _run(self, i: int) -> None:
        j = i
        while not self._stop.is_set():
            o = send(self.base_fn(), self.requests[j % len(self.requests)])
            with self._lock:
                self.outcomes.append(o)
            j += self.n
            if o.transport:
                time.sleep(0.05)  # the front door is down: do not spin

    def __enter__(self) -> Clients:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=180)

    def completed(self) -> int:
        with self._lock:
            return sum(1 for o in self.outcomes if o.ok)


def reference_outputs(serve: Serve, requests: list[Request], concurrency: int = 4) -> dict[int, Outcome]:
    """No-fault outputs, run with some concurrency (outputs do not depend on batching)."""
    out: dict[int, Outcome] = {}
    lock = threading.Lock()

    def worker(k: int) -> None:
        for r in requests[k::concurrency]:
            o = send(serve.base, r)
            if not o.ok or o.completion_tokens != len(o.token_ids) or not o.token_ids:
                raise ChaosError(f"no-fault request {r.index} failed: {o}")
            with lock:
                out[r.index] = o

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if len(out) != len(requests):
        raise ChaosError(f"only {len(out)} of {len(requests)} no-fault outputs")
    return out


def wait_for(cond, what: str, timeout: float = 120.0, serve: Serve | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.01)
    raise ChaosError(f"timed out waiting for {what}" + (f":\n{tail(serve.log_path)}" if serve else ""))


def _newest_seq(st: dict) -> int:
    fos = st.get("failovers") or []  # newest first, and only the last few are kept
    return int(fos[0]["seq"]) if fos else 0


def kill_active(serve: Serve) -> tuple[float, float]:
    """SIGKILL the active with a standby ready; returns once a fresh standby is ready.
    Returns the fault's window (monotonic): the kill, the failover record's first sight."""
    st = serve.wait_state("serving_ready")
    seq, pid = _newest_seq(st), serve.engine_pid("active", st)
    marks: dict = {}
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    _await_failover(serve, seq, pid, "SIGKILL", marks)
    return t_kill, marks.get("seen", time.monotonic())


def hang_active(serve: Serve) -> str:
    """SIGSTOP the active: it must be fenced and failed over once its heartbeats stop."""
    st = serve.wait_state("serving_ready")
    seq, pid = _newest_seq(st), serve.engine_pid("active", st)
    os.kill(pid, signal.SIGSTOP)
    try:
        rec = _await_failover(serve, seq, pid, "SIGSTOP")
    finally:
        try:
            os.kill(pid, signal.SIGCONT)  # if it was not fenced, do not leave it stopped
        except ProcessLookupError:
            pass
    return rec.get("cause", "")


def _await_failover(serve: Serve, seq: int, pid: int, what: str, marks: dict | None = None) -> dict:
    """Waits for the failover record after seq, then for a fresh standby and the
    dead engine reaped. marks["seen"]: when the record was first seen (monotonic)."""
    def done():
        # The record appears at detection with the cause "pending"; the cause is
        # classified later (the engine reaped, its stderr read).
        st = serve.status()
        if _newest_seq(st) <= seq:
            return None
        if marks is not None:
            marks.setdefault("seen", time.monotonic())
        rec = serve.failovers(st)[0]
        return rec if rec.get("cause") != "pending" else None

    rec = wait_for(done, f"the failover after {what} of {pid}", serve=serve)
    if not rec.get("ok"):
        raise ChaosError(f"failover after {what} failed: {rec}")
    serve.wait_state("serving_ready")
    # Reaped by the supervisor: a zombie would still be in /proc.
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), f"the {what} engine {pid} to be reaped", timeout=30, serve=serve)
    return rec


def double_fault(serve: Serve) -> Window:
    """SIGKILL the active, then the promoted standby before a fresh standby is
    ready: nothing can resume; a cold start brings the pair back."""
    st = serve.wait_state("serving_ready")
    first = serve.engine_pid("active", st)
    w = Window("double fault", time.monotonic())
    os.kill(first, signal.SIGKILL)

    def promoted():
        s = serve.status()
        try:
            pid = serve.engine_pid("active", s)
        except ChaosError:
            return None
        return pid if pid != first and s.get("state") == "rearming" else None

    second = wait_for(promoted, "the standby's promotion", serve=serve)
    os.kill(second, signal.SIGKILL)
    serve.wait_state("serving_ready")
    w.t1 = time.monotonic()
    return w


def kill_supervisor(serve: Serve) -> tuple[Window, list[str]]:
    """SIGKILL `frmps serve` itself and start it again on the same dirs and ports.
    Returns the window and what the killed one left that the new one did not remove."""
    st = serve.wait_state("serving_ready")
    engines = [int(e["pid"]) for e in st.get("engines", []) if e.get("pid")]
    before = serve.records()
    if len(before) != 1:
        raise ChaosError(f"launch records before the kill: {before}")
    w = Window("supervisor SIGKILL", time.monotonic(), transport=True)
    serve.kill()
    for pid in engines:  # they die with their supervisor (parent-death signal)
        wait_for(lambda: not os.path.exists(f"/proc/{pid}"), f"engine {pid} to die with its supervisor", timeout=15)
    left = [p for p in (before[0].get("ring"), before[0].get("run_dir")) if p and os.path.exists(p)]
    if not left:
        raise ChaosError("the killed supervisor left nothing behind: nothing to clean up")
    serve.start()  # it creates the same --run-dir exclusively: it removed the old one first
    w.t1 = time.monotonic()
    stale = [p for p in (before[0].get("ring"),) if p and os.path.exists(p)]
    records = serve.records()
    if len(records) != 1 or records[0]["owner"]["pid"] != serve.pid:
        stale.append(f"launch records {records}")
    return w, stale


# ----------------------------------------------------------------------------- checks


def check(outcomes: list[Outcome], requests: list[Request], reference: dict[int, Outcome],
          windows: list[Window]) -> list[str]:
    """Every problem with the outcomes, as lines."""
    problems = []
    for o in outcomes:
        req, ref = requests[o.index], reference[o.index]
        where = f"request {o.index} ({'stream' if req.stream else 'whole'} {req.path})"
        if o.ok:
            if o.token_ids != ref.token_ids or o.text != ref.text:
                problems.append(f"{where}: output differs from the no-fault output")
            if o.finish != ref.finish or o.completion_tokens != ref.completion_tokens:
                problems.append(f"{where}: finish {o.finish}/{o.completion_tokens}, want {ref.finish}/{ref.completion_tokens}")
            if len(o.ids) != 1:
                problems.append(f"{where}: {len(o.ids)} completion ids")
            continue
        # A failure: only inside a window where no engine could serve.
        inside = [w for w in windows if o.t_start <= w.t1 and w.t0 <= o.t_end]
        if not inside:
            problems.append(f"{where}: failed while an engine could serve: {o.status} {o.error}")
            continue
        if o.transport and not any(w.transport for w in inside):
            problems.append(f"{where}: connection failed during {inside[0].label}: {o.error}")
        # 503 engine_unavailable: no engine; stream_resume_failed: the request was
        # open on an engine that died with no standby to resume it.
        if o.status is not None and (o.status != 503 or not o.retry_after
                                     or o.error_code not in ("engine_unavailable", "stream_resume_failed")):
            problems.append(f"{where}: refused with {o.status} Retry-After={o.retry_after} code={o.error_code}: {o.error}")
        # What a broken stream delivered is still exact: no token lost or repeated.
        if o.token_ids != ref.token_ids[: len(o.token_ids)]:
            problems.append(f"{where}: the tokens before the failure are not a prefix of the no-fault output")
    return problems


def count(outcomes: list[Outcome], requests: list[Request], reference: dict[int, Outcome],
          kills: list[tuple[float, float]]) -> dict:
    """The proofs' stream count (proofcount) over the outcomes: in flight at a kill
    (from the SIGKILL to the failover record's first sight) or not, the phase where
    the request streamed (else "unknown"), the verdict against its no-fault output."""
    events = [(f"kill {n}", a, b) for n, (a, b) in enumerate(kills, 1)]
    streams = []
    for o in outcomes:
        c = proofcount.classify(o.t_start, o.token_times, o.t_end, events, failed=not o.ok,
                                streamed=requests[o.index].stream)
        v = proofcount.verdict(reference[o.index].token_ids, o.token_ids, error=None if o.ok else (o.error or "failed"))
        if v == "exact" and (o.text != reference[o.index].text or o.finish != reference[o.index].finish):
            v = "inexact"
        streams.append({**c, "verdict": v})
    return proofcount.tally(streams)


def summarize(outcomes: list[Outcome]) -> dict:
    return {"requests": len(outcomes), "completed": sum(o.ok for o in outcomes),
            "streams_completed": sum(o.ok and o.done for o in outcomes),
            "refused_503": sum(o.status == 503 for o in outcomes),
            "stream_errors": sum(o.status is None and not o.transport and not o.ok for o in outcomes),
            "transport_errors": sum(o.transport for o in outcomes),
            "tokens": sum(len(o.token_ids) for o in outcomes if o.ok)}


# ----------------------------------------------------------------------------- soak


def soak(args: argparse.Namespace) -> int:
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="frmps-soak-")
    serve = Serve(args.frmps, args.python, work, sync_every=args.sync_every, step_delay_ms=args.step_delay_ms,
                  extra_args=args.serve_arg)
    requests = workload(max(32, args.streams * 2), streaming="all")
    samples: list[Sample] = []
    t_begin = time.monotonic()
    rc = 0
    try:
        serve.start()
        reference = reference_outputs(serve, requests)
        # Warm-up kills: the runtime's own pools and the first engine generations settle.
        for _ in range(args.warmup):
            kill_active(serve)
        base = baseline(serve)
        samples.append(base)
        print(f"baseline: {base}", flush=True)
        kills: list[tuple[float, float]] = []
        with Clients(lambda: serve.base, requests, args.streams) as clients:
            for k in range(1, args.kills + 1):
                kills.append(kill_active(serve))
                if k % args.sample_every == 0 or k == args.kills:
                    s = sample(serve, kills=k)
                    s.idle = False
                    samples.append(s)
                    print(f"{k}/{args.kills} kills, {clients.completed()} streams completed, "
                          f"{time.monotonic() - t_begin:.0f}s: fds {s.fds} goroutines {s.goroutines} threads {s.threads} "
                          f"children {s.children} rss {s.rss_kib} KiB shm {s.shm_files} sockets {s.sockets}", flush=True)
        final, diff = settle(serve, base)
        final.kills = args.kills
        samples.append(final)
        problems = check(clients.outcomes, requests, reference, [])
        summary = summarize(clients.outcomes)
        counted = count(clients.outcomes, requests, reference, kills)
        fos = serve.failovers()
        rc = serve.stop()
        leftovers = [p for p in (serve.run_dir,) if os.path.exists(p) and os.listdir(p)]
        leftovers += [f"shm {n}" for n in os.listdir(serve.ring_dir)]
        leftovers += [f"record {r}" for r in serve.records()]
        result = {"kills": args.kills, "streams": args.streams, "sync_every": args.sync_every,
                  "step_delay_ms": args.step_delay_ms, "wall_seconds": round(time.monotonic() - t_begin, 1),
                  "outcomes": summary, "stream_count": counted, "headline": proofcount.headline(counted),
                  "problems": problems[:50], "problem_count": len(problems),
                  "not_back_to_baseline": diff, "leftovers_after_stop": leftovers, "exit_code": rc,
                  "last_failover": fos[0] if fos else None, "env": _env(args)}
        _write_soak(out, result, samples)
        ok = not problems and not diff and not leftovers and rc == 0 and summary["completed"] == summary["requests"]
        print(json.dumps({k: result[k] for k in ("wall_seconds", "outcomes", "headline", "problem_count",
                                                  "not_back_to_baseline", "leftovers_after_stop", "exit_code")}, indent=1))
        return 0 if ok else 1
    finally:
        if serve.proc is not None:
            serve.kill()
        serve.remove_dirs()
        shutil.rmtree(work, ignore_errors=True)


def _env(args) -> dict:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.+)", f.read())
            cpu = m.group(1).strip() if m else ""
    except OSError:
        pass
    return {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": platform.machine(), "cpu": cpu, "cpu_count": os.cpu_count(),
            "loadavg_at_end": os.getloadavg(), "python": sys.version.split()[0], "commit": git_commit()}


def _write_soak(out: str, result: dict, samples: list[Sample]) -> None:
    with open(os.path.join(out, "soak.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "samples.jsonl"), "w") as f:
        for s in samples:
            f.write(json.dumps({k: v for k, v in asdict(s).items() if k != "t"}) + "\n")
    keys = ("fds", "goroutines", "threads", "children", "zombies", "rss_kib", "shm_files", "sockets")
    body = [f"| after kills | clients | {' | '.join(keys)} |", "| --- | --- |" + " --- |" * len(keys)]
    for s in samples:
        body.append(f"| {s.kills} | {'none' if s.idle else 'streaming'} | " + " | ".join(str(getattr(s, k)) for k in keys) + " |")
    loaded = [s for s in samples if not s.idle] or samples
    span = {k: (min(getattr(s, k) for s in loaded), max(getattr(s, k) for s in loaded)) for k in keys}
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write("\n".join(body) + "\n\nmin–max over the samples under load: "
                + ", ".join(f"{k} {lo}–{hi}" for k, (lo, hi) in span.items()) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=1000, help="SIGKILLs of the active (each with a standby ready)")
    p.add_argument("--streams", type=int, default=16, help="concurrent streaming clients")
    p.add_argument("--warmup", type=int, default=3, help="kills before the baseline sample")
    p.add_argument("--sample-every", type=int, default=25, help="sample resources every this many kills")
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--step-delay-ms", type=int, default=5, help="FRMPS_TEST_STEP_DELAY_MS: slows engine steps so streams overlap kills")
    p.add_argument("--serve-arg", action="append", default=[], help="extra frmps serve argument (repeatable)")
    p.add_argument("--frmps", default=os.environ.get("FRMPS_BIN") or os.path.join(repo_root(), "bin", "frmps"))
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--out", required=True, help="results directory (soak.json, samples.jsonl, table.md)")
    return soak(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
