"""The engine loop: one thread owns the core (engine_api.Core), steps it, hands
outputs to request streams and publishes committed forward state to the ring.

Other threads never touch the core; they post commands (``call`` / ``post``).
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import logging
import os
import secrets
import tempfile
import threading
import time
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

from .engine_api import Core, DeviceCheck, LoadReport, Pipelined, RequestView, StepSize, has_launch_hook
from .steptime import StepTimer
from .stream import DuplicateRequest, RequestStream

__all__ = ["DuplicateRequest", "EngineBackend", "EngineLoop", "RequestStream", "RingPublisher"]

log = logging.getLogger(__name__)

@runtime_checkable
class RingModule(Protocol):
    """A ring module as RingPublisher uses it: frmps_engine.ring (the ring of
    ringbuf/FORMAT.md), or a test double with the same API
    (sdk/testing/fake_ring.py). RingWriter.attach(path) returns a writer with
    close(); DeltaTracker(writer) has request_full() and sync(step, views)."""

    RingWriter: Any
    DeltaTracker: Any


@runtime_checkable
class CreatesRings(Protocol):
    """A ring module that can create a ring file (create_ring(path, capacity)):
    preload warms it up on a scratch ring. Without it there is nothing to warm."""

    def create_ring(self, path: str, capacity: int) -> None: ...


class RingPublisher:
    """Ring glue: the ring module's RingWriter + DeltaTracker (frmps_engine.ring)."""

    @staticmethod
    def preload(module: str = "frmps_engine.ring") -> None:
        """Import the ring module and run one publish on a scratch ring, so that the
        takeover does not pay for imports and lazy initialisation."""
        mod = importlib.import_module(module)
        if not isinstance(mod, CreatesRings):
            return
        d = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(d, f"frmps-warmup-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            mod.create_ring(path, 1 << 16)
            w = mod.RingWriter.attach(path)
            try:
                w.publish(0, [mod.RequestDelta(key=1, seed=1, num_computed=1, num_prompt=1, reset=True, blocks=[0], tokens=[0])], full=True)
            finally:
                w.close()
            crc = importlib.import_module(module + "._crc32c") if module == "frmps_engine.ring" else None
            if crc is not None and not crc.HAVE_HW:
                # The numpy CRC builds its tables per record size on first use (seconds):
                # build them now for records up to 256 KiB, not in a takeover's FULL record.
                log.warning("the crc32c package is not installed: ring records are checksummed with numpy "
                            "(slower; install the pinned crc32c)")
                crc.crc32c(bytes(256 << 10))
        finally:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def __init__(self, path: str, module: str = "frmps_engine.ring"):
        self._mod = importlib.import_module(module)
        if not isinstance(self._mod, RingModule):
            raise TypeError(f"{module} is not a ring module (it lacks RingWriter or DeltaTracker)")
        self._writer = self._mod.RingWriter.attach(path)  # bumps the epoch
        self._tracker = self._mod.DeltaTracker(self._writer)
        self.path = path

    def publish_full(self, step: int, views: Iterable[RequestView]) -> None:
        """After attaching, the writer owes the reader a FULL record of everything it knows.
        The tracker makes its first record after attach FULL; ask explicitly anyway."""
        self._tracker.request_full()
        self._tracker.sync(step, views)

    def sync(self, step: int, views: Iterable[RequestView]) -> None:
        self._tracker.sync(step, views)

    def close(self) -> None:
        self._writer.close()


@dataclasses.dataclass(frozen=True)
class HandoverTimes:
    """Where a planned handover's time went on the yielding engine's loop
    (``EngineLoop.hand_over``), in ms. The client-visible pause starts once the
    step in flight has delivered its tokens: what comes after it (publish, move,
    reset, stop) is on that pause's path, the wait and the step are not."""

    requests: int  # requests the core held (unfinished entries of the FULL record)
    moved: int  # streams moved to the next engine
    wait_ms: float  # the call waiting for the loop (the step it was running)
    in_flight_ms: float  # finishing the step in flight (pipelined cores) and dispatching its tokens
    publish_ms: float  # the FULL record
    move_ms: float  # moving the streams
    reset_ms: float  # the core forgetting every request
    stop_ms: float  # the loop thread ending

    def line(self) -> str:
        return (f"waited {self.wait_ms:.2f} ms for the loop, in-flight step {self.in_flight_ms:.2f} ms, "
                f"publish {self.publish_ms:.2f} ms, move {self.move_ms:.2f} ms, reset {self.reset_ms:.2f} ms, "
                f"loop stop {self.stop_ms:.2f} ms")


class EngineLoop:
    def __init__(
        self,
        core: Core,
        *,
        sync_every: int = 1,
        on_fatal: Callable[[BaseException], None] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
        retain_finished_s: float = 120.0,
        step_delay_s: float = 0.0,
    ):
        self.core = core
        self.sync_every = max(1, int(sync_every))
        self._publisher: RingPublisher | None = None
        self._on_fatal = on_fatal
        # Runs on the loop thread when the loop dies of an error that is not a device
        # error, before its requests fail: it may end the process instead, leaving
        # them open (the runner: a tensor-parallel peer died, the standby resumes them).
        self._on_error = on_error
        self._retain = retain_finished_s
        self._cmds: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._streams: dict[int, RequestStream] = {}
        self._streams_lock = threading.Lock()
        self.step_count = 0
        self._since_sync = 0
        # The core's optional capabilities (engine_api), probed once.
        # Publish overlapped with the next step's device work where the core allows it
        # (LaunchHook); else right after the step, between steps.
        self._overlap = has_launch_hook(core)
        self._step_size = isinstance(core, StepSize)
        self._load_report = isinstance(core, LoadReport)
        self._device_check = isinstance(core, DeviceCheck)
        self._pipelined = isinstance(core, Pipelined)
        # Diagnostics: a core may time its own calls inside a step (the vLLM core with
        # FRMPS_DEBUG_STEP_PHASES: vllm/phases.py); armed for the traced steps.
        self._phases = getattr(core, "step_phases", None)
        # Set for a takeover: the first step's outputs go out as soon as its device
        # work is done. A pipelined core would otherwise hand them over only once the
        # second step is scheduled and launched, putting that step's host work on the
        # path to the first resumed token; the device idles for that host work once.
        self.deliver_first_step = False
        self._sync_pending = False
        self.last_handover: HandoverTimes | None = None  # hand_over()'s breakdown
        self.counters = collections.Counter()
        self.dead: BaseException | None = None
        # Test knob only (FRMPS_TEST_STEP_DELAY_MS): slows every step so that
        # end-to-end tests can kill an engine at a chosen point of a request.
        self._step_delay = max(0.0, float(step_delay_s))
        # Hang reporting: every step and idle device check is timed; the heartbeat
        # thread reads the timer, step_count and these counts without a lock.
        self.timer = StepTimer()
        self.running_count = 0
        self.waiting_count = 0
        self._in_step: Callable[[], Any] | None = None  # test hook: runs inside the next step
        # Steps to log with their timings once the loop starts (set for a takeover:
        # where the time between the Resume and the first resumed token goes).
        self.trace_steps = 0
        # Called once, for the end of the first traced step's line (the runner's note on
        # where a takeover's first step waited).
        self.first_step_note: Callable[[], str] | None = None
        # FRMPS_DEBUG_KV_DIGESTS (sdk/kv_digest.py): called with a planned handover's last
        # views, after their publish and before the core's reset.
        self.on_handover_views: Callable[[list], None] | None = None
        # FRMPS_DEBUG_KV_DIGESTS: called after every step (the prompts' KV digests).
        self.after_step: Callable[[], None] | None = None
        self.started_ns = 0

    # -- threading ------------------------------------------------------------
    def start(self) -> None:
        self.started_ns = time.perf_counter_ns()
        self._thread = threading.Thread(target=self._run, name="frmps-engine-loop", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def post(self, fn: Callable[[], Any]) -> None:
        """Run fn on the loop thread soon (queued until the loop starts)."""
        self._cmds.append(fn)
        self._wake.set()

    def call(self, fn: Callable[[], Any], timeout: float | None = 60.0) -> Any:
        """Run fn on the loop thread and return its result (inline when not running)."""
        if not self.running or threading.current_thread() is self._thread:
            return fn()
        done = threading.Event()
        box: list = [None, None]

        def wrapped():
            try:
                box[0] = fn()
            except BaseException as e:  # handed back to the caller
                box[1] = e
            finally:
                done.set()

        self._cmds.append(wrapped)
        self._wake.set()
        if not done.wait(timeout):
            raise TimeoutError("engine loop did not run the command in time")
        if box[1] is not None:
            raise box[1]
        return box[0]

    # -- requests ---------------------------------------------------------------
    def get(self, key: int) -> RequestStream | None:
        with self._streams_lock:
            return self._streams.get(key)

    def _register(self, stream: RequestStream) -> None:
        with self._streams_lock:
            old = self._streams.get(stream.key)
            if old is not None and not old.finished:
                raise DuplicateRequest(f"request key {stream.key} is already running")
            self._streams[stream.key] = stream

    def submit(self, key: int, prompt_ids: list[int], wire_params: Any, engine_params: Any) -> RequestStream:
        stream = RequestStream(key, len(prompt_ids), wire_params)
        if _TOKEN_LOG:
            stream.debug_prompt = list(prompt_ids)
        self._register(stream)

        def add():
            try:
                self.core.add_request(key, prompt_ids, engine_params)
            except ValueError as e:
                stream.fail(f"engine refused the request: {e}", invalid=True)
            except Exception as e:
                if self._is_fatal(e):
                    raise
                stream.fail(f"engine refused the request: {e}")

        self.post(add)
        self.counters["requests_submitted"] += 1
        return stream

    def register_adopted(self, key: int, prompt_len: int, wire_params: Any, delivered: list[int],
                         prompt_ids: list[int] | None = None) -> RequestStream:
        stream = RequestStream(key, prompt_len, wire_params, output=delivered)
        stream.await_first_resumed = True
        if _TOKEN_LOG and prompt_ids is not None:
            stream.debug_prompt = list(prompt_ids)
        self._register(stream)
        return stream

    def abort(self, key: int) -> bool:
        stream = self.get(key)
        if stream is None:
            return False
        if stream.finish("abort"):
            self.post(lambda: self.core.abort(key))
        return True

    def stop_at(self, stream: RequestStream, n_tokens: int, stop: str) -> None:
        """A stop string matched after n_tokens outputs: end the request there."""
        if stream.finish("stop", stop, truncate_to=n_tokens):
            self.post(lambda: self.core.abort(stream.key))

    def run_in_step(self, fn: Callable[[], Any]) -> None:
        """Test hook (debug_hang): run fn on the loop thread as part of the next step,
        or, while idle, timed like an idle device check."""
        self._in_step = fn
        self._wake.set()

    def scheduled_tokens(self) -> int | None:
        """Tokens of the step in progress (or the last one), when the core says."""
        n = self.core.scheduled_tokens if self._step_size else None
        return n if isinstance(n, int) else None

    def heartbeat(self) -> tuple[int, int, int, int, int, int]:
        """(step, running, waiting, step age ns, step expected ns, step tokens) for the
        heartbeat thread: attribute reads only, no lock and nothing that waits on the
        device or on this loop, so a hung step cannot hold a heartbeat back."""
        tokens = self.scheduled_tokens()
        age, expected = self.timer.progress(tokens)
        return (self.step_count, self.running_count, self.waiting_count + len(self._cmds), age, expected,
                (tokens or 0) if age else 0)

    def load(self) -> tuple[int, int]:
        """(running, waiting): the core's own counts when it has them."""
        if self._load_report:
            try:
                return int(self.core.num_running()), int(self.core.num_waiting()) + len(self._cmds)
            except Exception:  # read from another thread; a racing count is not worth failing for
                pass
        with self._streams_lock:
            running = sum(1 for s in self._streams.values() if not s.finished)
        return running, len(self._cmds)

    # -- ring -------------------------------------------------------------------
    def attach_ring(self, publisher: RingPublisher | None, full_now: bool = True) -> None:
        """Publish to a ring from now on (FULL record first). Runs on the loop thread.

        ``full_now=False`` (a takeover, before the loop starts: the core holds exactly the
        state the Resume's snapshot gave it, which the reader already has): where the
        publish overlaps the device, the FULL record goes out with the first step once its
        pass is enqueued instead of on the path to the first token (the tracker's first
        record after attach is FULL): inside it with a LaunchHook, right after it for a
        Pipelined core (vLLM's async scheduling: step() returns with the pass in flight).
        Until then the reader keeps that snapshot, so a failover in between resumes from
        the same state."""

        def attach():
            old, self._publisher = self._publisher, publisher
            if old is not None:
                old.close()
            if publisher is not None:
                self._since_sync = 0
                if not full_now and (self._overlap or self._pipelined):
                    self._sync_pending = True
                    return
                publisher.publish_full(self.step_count, self.core.request_views())
                self._sync_pending = False

        self.call(attach)

    @property
    def overlap_publish(self) -> bool:
        """Whether a due publish runs inside the next step, once its pass is launched
        (the core's launch hook), rather than right after the step."""
        return self._overlap

    @overlap_publish.setter
    def overlap_publish(self, on: bool) -> None:
        """Set on the loop thread (between steps). Stays off for a core without a
        launch hook; the sync-overhead benchmark turns it off to measure the same
        publish between steps in the same run."""
        self._overlap = bool(on) and has_launch_hook(self.core)

    # -- planned handover ---------------------------------------------------------
    def hand_over(self, timeout: float = 30.0) -> int:
        """On the loop thread, between steps: publish every request's state (a FULL
        record) and detach from the ring, move every open stream to the next engine
        and forget the requests (the core's reset); then stop the loop. Returns how
        many streams were moved. The core is empty afterwards.

        The caller has stopped new submissions first (EngineBackend.is_serving).
        Submissions already queued reach the core first and are moved like the rest:
        the next engine starts them afresh."""
        if self.dead is not None:
            raise RuntimeError(f"engine loop died: {self.dead}")
        t = [time.perf_counter_ns()]  # the call, then the end of each phase (HandoverTimes)

        def yield_requests() -> tuple[int, int]:
            t.append(time.perf_counter_ns())
            if self._pipelined:
                # The step in flight finishes here: its tokens reach the streams and
                # the FULL record, and the device is idle before the pools go.
                self._dispatch(self.core.finish_in_flight())
            t.append(time.perf_counter_ns())
            views = list(self.core.request_views())
            if self._publisher is not None:
                self._publisher.publish_full(self.step_count, views)
                self.counters["ring_syncs"] += 1
                self._publisher.close()
                self._publisher = None
            if self.on_handover_views is not None:
                self.on_handover_views(views)
            t.append(time.perf_counter_ns())
            with self._streams_lock:
                streams = list(self._streams.values())
            moved = sum(1 for s in streams if s.move())
            t.append(time.perf_counter_ns())
            self.core.reset()
            t.append(time.perf_counter_ns())
            self._stop.set()
            return moved, sum(1 for v in views if not v.finished)

        moved, held = self.call(yield_requests, timeout)
        self.stop(timeout)
        if self.running:
            raise TimeoutError(f"engine loop did not stop within {timeout:.0f}s")
        t.append(time.perf_counter_ns())
        self.last_handover = HandoverTimes(held, moved, *((b - a) / 1e6 for a, b in zip(t, t[1:])))
        return moved

    # -- the loop ---------------------------------------------------------------
    @staticmethod
    def _is_fatal(e: BaseException) -> bool:
        return is_device_error(e)

    def _publish(self) -> None:
        """Publish the committed state now (also the core's on_launch hook)."""
        self._sync_pending = False
        if self._publisher is not None:
            t0 = time.perf_counter_ns()
            self._publisher.sync(self.step_count, self.core.request_views())
            self.counters["ring_syncs"] += 1
            self.counters["ring_sync_ns"] += time.perf_counter_ns() - t0

    def _sync(self) -> None:
        self._publish()
        self._since_sync = 0

    def _run_hook(self) -> None:
        fn, self._in_step = self._in_step, None
        if fn is not None:
            fn()

    def _step(self):
        self.timer.begin()
        self._run_hook()
        if not self._sync_pending:
            outs = self.core.step()
        else:
            outs = self.core.step(on_launch=self._publish)
            if self._sync_pending:  # nothing was launched: publish now
                self._publish()
        self.timer.end(self.scheduled_tokens())
        if self.after_step is not None:
            self.after_step()
        return outs

    def _count_load(self) -> None:
        """Refresh the counts heartbeats report (on this thread, between steps)."""
        if self._load_report:
            self.running_count, self.waiting_count = int(self.core.num_running()), int(self.core.num_waiting())
            return
        with self._streams_lock:
            self.running_count = sum(1 for s in self._streams.values() if not s.finished)
        self.waiting_count = 0

    def _run(self) -> None:
        last_prune = time.monotonic()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now - last_prune > 5.0:
                    self._prune(now)
                    last_prune = now
                while self._cmds:
                    fn = self._cmds.popleft()
                    try:
                        fn()
                    except Exception as e:
                        if self._is_fatal(e):
                            raise
                        log.exception("engine loop command failed")
                if self.core.has_work():
                    prof = _step_profiler() if self.trace_steps else None
                    t_step = time.perf_counter_ns() if self.trace_steps else 0
                    c_step = time.thread_time_ns() if self.trace_steps else 0
                    phased = self._phases is not None and (self.trace_steps or self._phases.due(self.step_count + 1))
                    if phased:
                        self._phases.arm()
                    outs = self._step() if prof is None else prof.runcall(self._step)
                    if self.deliver_first_step:
                        self.deliver_first_step = False
                        if self._pipelined and not outs:
                            outs = self.core.finish_in_flight()
                    phases = self._phases.report() if phased else ""
                    if self._step_delay:
                        time.sleep(self._step_delay)
                    self.step_count += 1
                    self._since_sync += 1
                    self._count_load()
                    t_disp = time.perf_counter_ns() if self.trace_steps else 0
                    self._dispatch(outs)
                    if self.trace_steps:
                        self._trace(t_step, c_step, t_disp, outs, phases)
                    elif phased:
                        log.info("step %d vLLM calls (ms from the step's start): %s", self.step_count, phases)
                    if prof is not None:
                        _log_profile(prof, self.step_count)
                    # Also publish as soon as a request has its first token: its prompt's
                    # KV is the costliest part to recompute, so a fault right after a
                    # prefill should not have to.
                    # (That extra sync keeps the every-N cadence: it does not restart the count.)
                    due = self._since_sync >= self.sync_every
                    if due or any(o.output_index == 0 and o.new_token_ids for o in outs):
                        if due:
                            self._since_sync = 0
                        if self._overlap:
                            # Published by the next step once its pass is enqueued (or
                            # below, when the loop goes idle first).
                            self._sync_pending = True
                        else:
                            self._publish()
                    continue
                if self._since_sync or self._sync_pending:
                    # Going idle: publish what finished so the supervisor's snapshot is current.
                    self._sync()
                self._count_load()
                if self._in_step is not None:
                    # Idle: the hook runs where an idle device check would, timed alike.
                    self.timer.begin()
                    self._run_hook()
                    self.timer.end(None)
                    continue
                if not self._wake.wait(0.5):
                    self._probe_device()
                self._wake.clear()
        except BaseException as e:
            self.dead = e
            if self._on_error is not None and not self._is_fatal(e):
                try:
                    self._on_error(e)
                except Exception:
                    log.exception("engine loop: on_error failed")
            if not (self._is_fatal(e) and self._on_fatal is not None):
                for s in list(self._streams.values()):
                    s.fail(f"engine failed: {e}")
            # A device error: leave the streams open. on_fatal reports the fault and
            # exits the process, so clients see the connection drop (UNAVAILABLE) and
            # the front door resumes them on the standby; failing them here would end
            # them with an error instead and take them out of the resume set.
            if self._on_fatal is not None:
                self._on_fatal(e)
            else:
                log.exception("engine loop died")

    def _trace(self, t_step: int, c_step: int, t_disp: int, outs, phases: str = "") -> None:
        # The loop thread's own CPU time beside the wall time: a step much longer than
        # its CPU time waited (on the device, or for the GIL held by another thread).
        c_end, t_end = time.thread_time_ns(), time.perf_counter_ns()
        self.trace_steps -= 1
        note, self.first_step_note = self.first_step_note, None
        try:
            extra = note() if note is not None else ""
        except Exception as e:  # noqa: BLE001 - a log note
            extra = f"note failed: {e}"
        log.info("step %d after start: began %.2f ms after the loop started, step %.2f ms, dispatch %.2f ms "
                 "(loop thread CPU %.2f ms of the %.2f), %d outputs, %s tokens scheduled%s", self.step_count,
                 (t_step - self.started_ns) / 1e6, (t_disp - t_step) / 1e6, (t_end - t_disp) / 1e6,
                 (c_end - c_step) / 1e6, (t_end - t_step) / 1e6, len(outs), self.scheduled_tokens(),
                 f"; {extra}" if extra else "")
        if phases:
            log.info("step %d after start, vLLM calls (ms from the step's start): %s", self.step_count, phases)

    def _probe_device(self) -> None:
        """Idle: ask the device for a sticky error. Under MPS another client's fault
        kills this context too, and an idle engine would otherwise learn of it only
        at its next request, leaving the supervisor without a standby takeover until then."""
        if self._device_check:
            # Timed like a step: a device that never answers holds this thread here.
            self.timer.begin()
            self.core.check_device()
            self.timer.end(None)

    def _dispatch(self, outs) -> None:
        n = 0
        wake: set[Callable[[], None]] = set()
        for o in outs:
            s = self._streams.get(o.key)
            if s is None:
                continue
            s._append(o.output_index, o.new_token_ids, o.finished, o.finish_reason, o.stop_reason, wake,
                      getattr(o, "logprobs", None))
            n += len(o.new_token_ids)
            if s.await_first_resumed and o.new_token_ids:
                # Once per adopted request: the takeover's client-visible latency ends here.
                s.await_first_resumed = False
                log.info("first resumed token: key=%d index=%d at %.6f", o.key, o.output_index, time.time())
            if o.finished and _TOKEN_LOG:
                _log_tokens(s)
        # After the whole step: a Stream following many of these requests wakes once
        # (its flag is set after every output is in place, so none is missed).
        for w in wake:
            w()
        self.counters["tokens_streamed"] += n

    def _prune(self, now: float) -> None:
        with self._streams_lock:
            old = [k for k, s in self._streams.items() if s.finished and now - s.finished_at > self._retain]
            for k in old:
                del self._streams[k]


# Test hook (bench/gpu/failover_proof.py): with FRMPS_DEBUG_TOKEN_LOG=<dir>, every
# finished request's prompt and output token ids are appended, one JSON line per
# request, to <dir>/tokens-<pid>.jsonl, so a harness can compare token ids across
# a failover (the OpenAI stream carries text only).
_TOKEN_LOG = os.environ.get("FRMPS_DEBUG_TOKEN_LOG", "")


def _step_profiler():
    """Diagnostics (FRMPS_DEBUG_TAKEOVER_PROFILE=1): profile the traced steps after
    a takeover (where the first resumed token's time goes on the host)."""
    if os.environ.get("FRMPS_DEBUG_TAKEOVER_PROFILE", "") not in ("", "0"):
        import cProfile

        return cProfile.Profile()
    return None


def _log_profile(prof, step: int) -> None:
    import io
    import pstats

    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("cumulative").print_stats(80)
    stats.sort_stats("tottime").print_stats(40)  # where the time is spent, not only through
    log.info("step %d after start, profile:\n%s", step, out.getvalue())


def _log_tokens(s: RequestStream) -> None:
    import json

    rec = {"t": time.time(), "key": s.key, "prompt": s.debug_prompt, "output": list(s.output),
           "finish_reason": s.finish_reason, "pid": os.getpid()}
    try:
        with open(os.path.join(_TOKEN_LOG, f"tokens-{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
    except OSError as e:
        log.warning("token log: %s", e)


_DEVICE_ERROR_TEXT = ("CUDA error", "CUDA_ERROR", "cudaError", "CUDA unknown error",
                      "Unexpected error from cudaGetDeviceCount")


def is_device_error(e: BaseException | None) -> bool:
    """A CUDA error leaves the context unusable (sticky): the process must exit.
    Follows explicit causes (`raise ... from e`: an adapter wraps what CUDA raised)."""
    seen = 0
    while e is not None and seen < 8:
        name = type(e).__name__
        if name in ("AcceleratorError", "CudaError", "OutOfMemoryError") or type(e).__module__.startswith(("torch.cuda", "cuda.")):
            return True
        msg = str(e)
        if any(t in msg for t in _DEVICE_ERROR_TEXT):
            return True
        e, seen = e.__cause__, seen + 1
    return False


def device_error_cause(e: BaseException) -> str:
    """A short cause for Fault.cause, e.g. "misaligned address" from "CUDA error: misaligned address"."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    for marker in ("CUDA error: ", "CUDA error:"):
        if marker in msg:
            return msg.split(marker, 1)[1].strip()
    return msg[:200]


class EngineBackend:
    """GenerationBackend over an adapter and its EngineLoop (what genapi serves).

    ``loop`` may be set later (a standby gets one on takeover); until ``serving``
    is set, Generate answers UNAVAILABLE.
    """

    def __init__(self, adapter, loop: EngineLoop | None = None):
        self.adapter = adapter
        self.loop = loop
        self.is_serving = False

    @property
    def model(self) -> str:
        return self.adapter.model

    @property
    def max_model_len(self) -> int:
        return self.adapter.max_model_len

    def tokenizer(self):
        return self.adapter.tokenizer()

    def serving(self) -> bool:
        return self.is_serving and self.loop is not None and self.loop.dead is None

    def submit(self, key, prompt_ids, params):
        return self.loop.submit(key, prompt_ids, params, self.adapter.sampling_params(params, params.seed))

    def get(self, key):
        return self.loop.get(key) if self.loop is not None else None

    def abort(self, key) -> bool:
        return self.loop.abort(key) if self.loop is not None else False

    def stop_at(self, stream, n_tokens, stop):
        self.loop.stop_at(stream, n_tokens, stop)

    def load(self):
        return self.loop.load() if self.loop is not None else (0, 0)

