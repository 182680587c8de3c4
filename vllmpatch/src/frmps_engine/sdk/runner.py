"""The engine process: control handshake, pools, engine loop, generation API.

Active:  Hello -> Welcome -> allocate pools -> build core (load weights) ->
         PoolExport(fds) -> ring attach -> serve -> Ready -> heartbeats.
Standby: Hello -> Welcome -> reserve pool address ranges -> build core (no
         weights, pools untouched) -> [Sleep(fds)] map read-only in place ->
         Ready -> [Resume] KV writable, adopt requests, ring attach, serve,
         Reply(per-request outcomes).
Active:  [Handoff] (a planned handover, failback) stop after the step in flight,
         publish every request to the ring, move the open streams to the next
         engine, forget the requests, pools read-only: a standby again, asleep,
         and a later Resume is answered like any standby's.
Shutdown -> exit 0. A device error -> Fault (best effort) and exit 3 at once.

Core mode (``--core-input``/``--core-output``; vllmpatch/OPENAI.md, design (a)):
the engine serves vLLM's engine-core protocol to vLLM's own API server instead
of frmps's generation API (an adapter with engine_api.EngineCoreProtocol:
``--engine vllm``). The serving engine connects to the frontend's sockets and
sends its ready message: an active at its start, a standby once it has adopted
a Resume, whose requests then carry ``engine_request`` (the EngineCoreRequest
as the frontend sent it) instead of a prompt and params. Handoff disconnects
without ending the frontend's requests. Everything else is the same.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from frmps_engine._proto.frmps.v1 import control_pb2

from . import control, debug_hang, kv_digest, memphase, spare, takeover_fault
from .engine_api import (EngineAdapter, EngineCoreProtocol, ProcessGroup, Resettable, TakeoverWarmup,
                         vocab_size)
from ..ring.layout import ring_capacity_needed
from .detok import warm as detok_warm
from .diagnostics import (device_memory_note, log_start_phases, standby_memory_note, startup_profile, startup_stacks,
                          threads_note)
from .genapi import GenerationServer, input_to_ids
from .loop import EngineBackend, EngineLoop, RingPublisher, device_error_cause, is_device_error
from .memory import MemoryBackend, MemoryError_, SizeMismatch, check_specs_match
from .memory.base import as_spec
from .params import normalize
from .stack import StandbyStack
from .takeover import Takeovers

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ERROR = 1  # engine failure other than a device error, or the supervisor went away
EXIT_REFUSED = 2  # refused at start: Welcome refused, bad configuration, pool mismatch
EXIT_DEVICE = 3  # sticky device error (e.g. a CUDA fault)
EXIT_PEER_DIED = 4  # another rank of this engine's tensor-parallel group died

# How long a step's failure in a tensor-parallel engine waits for a dying rank to be
# seen (its exit reaped) before the failure counts as the engine's own error.
PEER_DEATH_WAIT_S = 2.0


@dataclass
class _WarmMessage:
    role: str
    content: str


STANDBY_KV_ENV = "FRMPS_STANDBY_KV"


def _standby_kv_writable() -> bool:
    """FRMPS_STANDBY_KV: how a sleeping standby maps the KV cache.

    ``writable`` (default): read-write from the moment it goes to sleep, so a
    takeover never waits for an access change (after a fault the flip's driver call
    waits on the MPS server tearing the dead context down). The standby still writes nothing
    before it is resumed: it runs no device work while asleep, an active that hands
    over synchronises its device before it replies, and the supervisor resumes a
    standby only once the active is dead and fenced. ``readonly``: read-only while
    asleep, flipped to read-write beside the takeover's first step, so the driver
    itself faults any write a standby makes while asleep (a hardened mode; the flip
    is then on the takeover's path). Weights stay
    read-only in both. Anything else is a configuration error."""
    raw = os.environ.get(STANDBY_KV_ENV, "") or "writable"
    if raw not in ("readonly", "writable"):
        raise StartupError(f"{STANDBY_KV_ENV}={raw!r}: expected writable (the default) or readonly")
    return raw == "writable"


def _synchronize(device: str) -> None:
    """Wait for this process's queued device work on ``device`` (a CUDA device; nothing
    on the CPU): an engine that hands over must have finished writing the shared KV
    cache before the next engine is resumed on it."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def _test_step_delay() -> float:
    """FRMPS_TEST_STEP_DELAY_MS: a test knob that slows every engine step, so
    end-to-end tests can reach kill points such as "mid-prefill". Never set in
    production."""
    raw = os.environ.get("FRMPS_TEST_STEP_DELAY_MS", "")
    try:
        return max(0.0, float(raw) / 1000.0) if raw else 0.0
    except ValueError:
        log.warning("ignoring FRMPS_TEST_STEP_DELAY_MS=%r: not a number", raw)
        return 0.0


@dataclass
class RunnerConfig:
    role: str  # "active" | "standby"
    control_socket: str
    generation_socket: str  # "" in core mode
    ring_module: str = "frmps_engine.ring"
    # Heartbeat period when the supervisor's Welcome names none.
    heartbeat_s: float = 0.125
    default_grace_s: float = 5.0
    # Core mode: the frontend's engine-core sockets (vLLM's API server binds them;
    # ipc:// in the run directory), and this engine's index (its DEALER identity).
    core_input: str = ""
    core_output: str = ""
    core_engine_index: int = 0

    @property
    def core_mode(self) -> bool:
        return bool(self.core_input or self.core_output)


class StartupError(Exception):
    """The engine cannot start; exits with EXIT_REFUSED after saying why."""


class Runner(Takeovers):
    def __init__(
        self,
        cfg: RunnerConfig,
        adapter: EngineAdapter,
        memory: MemoryBackend,
        exit_fn: Callable[[int], Any] = os._exit,
    ):
        if cfg.role not in ("active", "standby"):
            raise StartupError(f"role must be active or standby, got {cfg.role!r}")
        if cfg.core_mode:
            if not (cfg.core_input and cfg.core_output):
                raise StartupError("core mode needs both engine-core sockets (--core-input and --core-output)")
            if cfg.generation_socket:
                raise StartupError("core mode serves vLLM's engine-core protocol, not the generation API: "
                                   "give --core-input/--core-output or --generation-socket, not both")
            if not isinstance(adapter, EngineCoreProtocol):
                raise StartupError(f"engine {adapter.name} does not speak vLLM's engine-core protocol "
                                   "(--core-input/--core-output need --engine vllm)")
            adapter.serve_engine_core()
        elif not cfg.generation_socket:
            raise StartupError("no generation socket (--generation-socket), and no engine-core sockets "
                               "(--core-input/--core-output)")
        # Negative controls (tests and benches only): parsed first, so a bad setting
        # stops the engine before anything is built.
        try:
            self._faults = takeover_fault.from_env(int(adapter.block_size))
        except takeover_fault.ControlError as e:
            raise StartupError(str(e)) from None
        self._kv_digests = kv_digest.from_env(int(adapter.block_size))  # a diagnostic, off by default
        self.cfg = cfg
        self.adapter = adapter
        # A tensor-parallel engine: the pools of every rank go through this process.
        self.memory = adapter.group_memory(memory) if isinstance(adapter, ProcessGroup) else memory
        self._exit = exit_fn
        self._peer_report = threading.Lock()  # held by the one report of a peer's death
        self._peer_reported = threading.Event()  # that report returned (only a test's exit_fn returns)
        self.role = control_pb2.ROLE_ACTIVE if cfg.role == "active" else control_pb2.ROLE_STANDBY
        self.specs = [as_spec(s) for s in adapter.pool_layout()]
        self.client: control.ControlClient | None = None
        self.welcome: control_pb2.Welcome | None = None
        self.core = None
        self.loop: EngineLoop | None = None
        self.backend = EngineBackend(adapter)
        self.gen: GenerationServer | None = None
        self.server = None  # core mode: the engine-core server while serving (EngineCoreProtocol)
        self._slept = False
        self._resumed = False
        self._stack: StandbyStack | None = None
        self._kv_writable = _standby_kv_writable()
        self._done = threading.Event()
        self._exit_code = EXIT_OK
        self._shutting_down = threading.Lock()
        self._t0 = time.perf_counter_ns()

    # -- lifecycle ---------------------------------------------------------------
    def _pb_pools(self) -> list[control_pb2.Pool]:
        return [control_pb2.Pool(tag=s.tag, index=s.index, size=s.size, backend=self.memory.name) for s in self.specs]

    def run(self) -> int:
        """Run until shutdown; returns the exit code (the caller exits with it)."""
        startup_stacks(True)
        startup_profile(True, self.role)
        try:
            self._start()
        except control.WelcomeRefused as e:
            log.error("%s", e)
            return EXIT_REFUSED
        except (StartupError, control.ControlError, MemoryError_, ValueError, OSError) as e:
            # Configuration, memory or protocol problems (refengine's errors are ValueErrors).
            if is_device_error(e):
                log.error("engine cannot start: device error: %s", e)
                return EXIT_DEVICE
            log.error("engine cannot start: %s", e)
            return EXIT_REFUSED
        except Exception as e:
            if is_device_error(e):
                log.error("engine cannot start: device error: %s", e)
                return EXIT_DEVICE
            log.exception("engine cannot start")
            return EXIT_ERROR
        finally:
            startup_profile(False)  # a start that failed: its profile up to the failure
        self._done.wait()
        return self._exit_code

    def _start(self) -> None:
        if isinstance(self.adapter, ProcessGroup):
            self.adapter.on_peer_death(self._peer_died)
        if not self.cfg.core_mode:
            self.gen = GenerationServer(self.backend, self.cfg.generation_socket)
            self.gen.start()
        self.client = control.ControlClient.connect(self.cfg.control_socket)
        self.welcome = self.client.handshake(
            control.HelloInfo(
                role=self.role, model=self.adapter.model, engine=self.adapter.name,
                engine_version=self.adapter.version, pools=self._pb_pools(),
                # Core mode: no generation API (the frontend is vLLM's API server).
                generation_endpoint=self.gen.endpoint if self.gen is not None else "", device=self.adapter.device,
                block_size=self.adapter.block_size, num_blocks=self.adapter.num_blocks,
                kv_budget=kv_budget_pb(getattr(self.adapter, "kv_budget", None)),
                ring_record_bytes=int(getattr(self.adapter, "ring_record_bytes", 0) or 0),
                weights=self._weights(),
            )
        )
        log.info("welcome: deployment %s, sync every %d steps", self.welcome.deployment_id, self.welcome.sync_every)
        if self.role == control_pb2.ROLE_ACTIVE:
            self._start_active()
        else:
            self._start_standby()
        threading.Thread(target=self._heartbeats, name="frmps-heartbeat", daemon=True).start()

    def _check_faults(self) -> None:
        """FRMPS_TEST_TAKEOVER_FAULT: refuse to start when the core cannot apply a case."""
        if self._faults is None:
            return
        try:
            self._faults.check_core(self.core)
        except takeover_fault.ControlError as e:
            raise StartupError(str(e)) from None
        log.warning("%s: %s set (test mode): every takeover of this engine breaks one adopted request on purpose",
                    takeover_fault.APPLIED, self._faults.describe())

    def _weights(self) -> str:
        """Hello.weights from the adapter's optional ``weights`` attribute, logged
        once at start with what this engine does with it."""
        weights = str(getattr(self.adapter, "weights", "") or "")
        if weights.startswith("loaded:"):
            how = ("this engine loads them into the shared weights pool" if self.role == control_pb2.ROLE_ACTIVE
                   else "this engine loads none: it maps the active's weights pool")
            log.info("weights: %s (%s)", weights, how)
        elif weights:
            log.info("weights: %s (random; the model directory holds no checkpoint, or --weights dummy)", weights)
        else:
            log.info("weights: the %s adapter does not say where its weights come from", self.adapter.name)
        return weights

    def _preload_ring(self) -> None:
        try:
            RingPublisher.preload(self.cfg.ring_module)
        except Exception as e:  # only a warm-up: attaching will report a real ring problem
            log.warning("ring warm-up failed: %s", e)

    def _start_active(self) -> None:
        t = time.perf_counter_ns()
        self._preload_ring()
        t_ring = time.perf_counter_ns()
        pools = self.memory.allocate(self.specs)
        t_pools = time.perf_counter_ns()
        memphase.note("engine start (pools allocated)")
        self.core = self.adapter.create_core({p.spec.key: p.tensor for p in pools}, load_weights=True)
        memphase.note("engine built")
        self._check_faults()
        log_start_phases(t, t_ring, t_pools)
        if not self.cfg.core_mode:  # core mode: requests arrive tokenized, with the engine's own params
            self._warm_request_path()
        self._prepare_debug_fault()
        _freeze_heap()
        self.client.export_pools(self._pb_pools(), [p.fd for p in pools])
        if self.cfg.core_mode:
            self.server = self._engine_core_server(self.welcome.sync_every or 1)
            self.loop = self.server.loop
        else:
            self.loop = self._engine_loop(self.welcome.sync_every or 1)
        if self.welcome.ring_path:
            publisher = RingPublisher(self.welcome.ring_path, self.cfg.ring_module)
            ring_room_note(getattr(self.adapter, "ring_record_bytes", 0), publisher)
            self.loop.attach_ring(publisher)
        if self.server is not None:
            self.server.start()  # connects, sends the ready message, starts the loop
        else:
            self.loop.start()
        self.backend.loop = self.loop
        self.backend.is_serving = True
        self.client.start(self)
        self._log_checksums("at ready")
        self.client.ready(self.role, time.perf_counter_ns() - self._t0)
        log.info("active engine serving on %s (init %.0f ms)", self._serving_on(), (time.perf_counter_ns() - self._t0) / 1e6)
        startup_stacks(False)
        startup_profile(False)
        _write_modules()

    def _start_standby(self) -> None:
        t = time.perf_counter_ns()
        self._preload_ring()
        t_ring = time.perf_counter_ns()
        reserved = self.memory.reserve(self.specs)
        t_pools = time.perf_counter_ns()
        memphase.note("engine start (pools reserved)")
        self.core = self.adapter.create_core({p.spec.key: p.tensor for p in reserved}, load_weights=False)
        memphase.note("engine built")
        self._check_faults()
        log_start_phases(t, t_ring, t_pools)
        t_warm = time.perf_counter_ns()
        if not self.cfg.core_mode:  # core mode: requests arrive tokenized, with the engine's own params
            self._warm_request_path()
        throwaway = isinstance(self.core, TakeoverWarmup)
        if throwaway:
            # On the reserved (private) memory, before Sleep maps the brokered pools.
            self.core.warm_takeover()
        memphase.note("takeover warmed")
        log.info("takeover path warmed in %.1f ms (request conversions%s)", (time.perf_counter_ns() - t_warm) / 1e6,
                 "; throwaway requests adopted, stepped, reset" if throwaway else "")
        self._prepare_debug_fault()
        _freeze_heap()
        self.client.start(self)
        log.info("standby built (init %.0f ms), waiting for Sleep%s", (time.perf_counter_ns() - self._t0) / 1e6,
                 device_memory_note(self.adapter.device))
        startup_stacks(False)
        startup_profile(False)

    def _engine_loop(self, sync_every: int) -> EngineLoop:
        """The engine loop over the core (the runner's: fatal errors end the process)."""
        return self._watch_handover(EngineLoop(self.core, sync_every=sync_every, on_fatal=self._fatal,
                                               on_error=self._step_failed, step_delay_s=_test_step_delay()))

    def _engine_core_server(self, sync_every: int):
        """Core mode: the engine-core server over the core, with its own engine loop
        (the runner's: fatal errors end the process), not connected yet."""
        server = self.adapter.engine_core_server(
            self.core, self.cfg.core_input, self.cfg.core_output, engine_index=self.cfg.core_engine_index,
            sync_every=sync_every, on_fatal=self._fatal, on_error=self._step_failed, step_delay_s=_test_step_delay())
        if isinstance(getattr(server, "loop", None), EngineLoop):
            self._watch_handover(server.loop)
        return server

    def _watch_handover(self, loop: EngineLoop) -> EngineLoop:
        """FRMPS_DEBUG_KV_DIGESTS: a planned handover's last views get their KV digests
        (sdk/kv_digest.py), after the publish and before the core's reset; so does
        every request's prompt, after the step that commits it."""
        rec, core = self._kv_digests, self.core
        if rec is not None:
            loop.on_handover_views = lambda views: rec.write(
                core, "handover-out", [(v.key, v.token_ids, v.num_computed, v.block_ids) for v in views if not v.finished])
            loop.after_step = rec.prompts(core)
        return loop

    def _serving_on(self) -> str:
        if self.gen is not None:
            return self.gen.endpoint
        return f"vLLM engine-core sockets {self.cfg.core_input} (in), {self.cfg.core_output} (out)"

    def _warm_request_path(self) -> None:
        """Run once what turning a request into the engine's input costs the first
        time: the chat template (compiled on its first use), prompt encoding, the
        parameter checks, the engine's sampling parameters. A fresh engine's first
        adoption otherwise pays for it in the takeover (the chat template's
        compilation most of all). Also for the active: its first request's latency.
        Never fatal."""
        try:
            tok = self.adapter.tokenizer()
            ids = input_to_ids(tok, messages=[_WarmMessage("user", "warm-up")])
            input_to_ids(tok, prompt="warm-up")
            params = normalize(control_pb2.SamplingParams(max_tokens=1), 1, len(ids), self.adapter.max_model_len,
                               vocab_size(tok))
            self.adapter.sampling_params(params, 1)
        except Exception as e:  # e.g. a tokenizer without a chat template: the first request says so
            log.info("request path warm-up: %s", e)
        try:
            t0 = time.perf_counter()
            detok_warm(self.adapter.tokenizer())
            log.info("detokenizer warmed in %.0f ms", (time.perf_counter() - t0) * 1e3)
        except Exception as e:  # never fatal: streams decode through the tokenizer's decode
            log.info("detokenizer warm-up: %s", e)

    # -- control commands (receive thread) ---------------------------------------------
    def on_sleep(self, env_id: int, msg: control_pb2.Sleep, fds: list[int]):
        if self.role != control_pb2.ROLE_STANDBY or self._slept:
            for fd in fds:
                os.close(fd)
            return control_pb2.Reply(ok=False, error="Sleep is for a standby that has not slept yet")
        try:
            bad_backend = [f"{p.tag}[{p.index}]: {p.backend}" for p in msg.pools if p.backend and p.backend != self.memory.name]
            if bad_backend:
                raise SizeMismatch(f"brokered pools use another memory backend than {self.memory.name}: {', '.join(bad_backend)}")
            check_specs_match(self.specs, msg.pools)
        except SizeMismatch as e:
            for fd in fds:
                os.close(fd)
            return self._refuse(env_id, str(e))
        t_map = time.perf_counter_ns()
        try:
            self.memory.map(self.specs, fds, readonly=True)
        except SizeMismatch as e:
            return self._refuse(env_id, str(e))
        how = "read-only"
        if self._kv_writable:  # FRMPS_STANDBY_KV=writable: no flip left for the takeover
            self.memory.make_writable("kv_cache")
            how = "read-only, the KV cache read-write"
        t_map = time.perf_counter_ns() - t_map
        self._slept = True
        stack = self._standby_stack().shrink()
        memphase.note("asleep (brokered pools mapped)")
        self.client.ready(self.role, time.perf_counter_ns() - self._t0)
        log.info("standby asleep with %d brokered pools mapped %s (map %.2f ms, ready %.0f ms after start)%s%s%s",
                 len(fds), how, t_map / 1e6, (time.perf_counter_ns() - self._t0) / 1e6,
                 standby_memory_note(self.adapter.device), stack, threads_note())
        return control_pb2.Reply(ok=True)

    def _standby_stack(self) -> StandbyStack:
        """The per-thread stack policy of this engine's device (sdk/stack.py), made on
        first use (CUDA is initialised by then)."""
        if self._stack is None:
            self._stack = StandbyStack.for_device(self.adapter.device)
        return self._stack

    def _refuse(self, env_id: int, why: str):
        """The brokered pools do not fit this engine: say why and refuse to start."""
        log.error("engine refuses to start: %s", why)
        try:
            self.client.reply(env_id, control_pb2.Reply(ok=False, error=why))
        except control.ControlError:
            pass
        self._finish(EXIT_REFUSED)
        return None

    def on_handoff(self, env_id: int, msg: control_pb2.Handoff):
        """A planned handover (failback): hand every request to the standby the
        supervisor resumes next, and go to sleep as the standby. Any failure once
        the loop is stopping is fatal (Fault + exit): the supervisor then fails
        over to the standby as after any death."""
        loop = self.loop
        if self.role != control_pb2.ROLE_ACTIVE or loop is None or not self.backend.is_serving:
            return control_pb2.Reply(ok=False, error="Handoff is for a serving active")
        if not isinstance(self.core, Resettable):
            return control_pb2.Reply(ok=False, error=f"engine {self.adapter.name} cannot hand over: its core has no reset()")
        t0 = time.perf_counter_ns()
        self.backend.is_serving = False  # new requests: UNAVAILABLE, the front door waits for the next engine
        try:
            # Core mode: the server stops reading the frontend's sockets, sends what the
            # last step made and disconnects; the frontend keeps the requests open.
            moved = loop.hand_over() if self.server is None else self.server.hand_over()
            _synchronize(self.adapter.device)  # none of its device work may outlive the reply
            t_loop = time.perf_counter_ns()
            if not self._kv_writable:
                self.memory.make_readonly("kv_cache")
            self.memory.make_readonly("weights")
        except Exception as e:  # the engine is half way to sleep: it must not serve on
            self._fatal(e)
            raise  # not reached: _fatal exits
        self.loop = None
        self.server = None
        self.role = control_pb2.ROLE_STANDBY
        self._slept, self._resumed = True, False
        t_end = time.perf_counter_ns()
        took, t_flip = t_end - t0, t_end - t_loop
        log.info("handed over %d requests in %.2f ms (loop stopped, state published and requests moved in %.2f ms; "
                 "%s; pools read-only %.2f ms); asleep as the standby", moved, took / 1e6, (t_loop - t0) / 1e6,
                 loop.last_handover.line(), t_flip / 1e6)
        # Off the Reply's path: the supervisor resumes the next engine on it.
        self._standby_stack().shrink_later(lambda note: note and log.info("standby asleep again%s", note),
                                           lambda: self.role == control_pb2.ROLE_STANDBY and not self._resumed)
        self.log_counters("after handover")
        return control_pb2.Reply(ok=True, took_ns=took)

    def _prepare_debug_fault(self) -> None:
        from . import debug_fault

        # Not in a process without pool memory of its own (rank 0 of a group whose ranks are
        # other processes): it would only open a CUDA context there for the test hook.
        if os.environ.get(debug_fault.ENV) == "1" and self.memory.pools():
            debug_fault.prepare(self.adapter.device)

    def _log_checksums(self, when: str) -> None:
        from . import debug_fault

        if os.environ.get(debug_fault.CHECKSUM_ENV) == "1":
            log.info("pool checksums %s: %s", when, debug_fault.pool_checksums(self.memory.pools()))
            out_dir = os.environ.get(debug_fault.PARAM_CHECKSUM_ENV, "")
            params = getattr(self.core, "param_checksums", None)
            if out_dir and callable(params):
                role = "active" if self.role == control_pb2.ROLE_ACTIVE else "standby"
                path = debug_fault.write_param_checksums(out_dir, dict(
                    role=role, pid=os.getpid(), when=when, weights=str(getattr(self.adapter, "weights", "")),
                    # A standby's parameters are the active's once it mapped the brokered pools.
                    mapped=role == "active" or bool(getattr(self, "_slept", False)), params=params()))
                log.info("parameter checksums %s: %s", when, path)

    def checksum_pools(self) -> None:
        """Test hook (debug_fault.CHECKSUM_ENV): log the pools' checksums, on the
        engine loop's thread when it runs."""
        loop = self.loop
        if loop is not None and loop.running:
            loop.post(lambda: self._log_checksums("on request"))
        else:
            threading.Thread(target=self._log_checksums, args=("on request",), daemon=True).start()
    def inject_hang(self) -> None:
        """Test hook (debug_hang): make this engine's next step never finish."""
        loop = self.loop
        if loop is None:
            log.warning("debug hang requested but the engine is not serving")
            return
        device = self.adapter.device
        log.warning("debug hang requested: the next step on %s never finishes", device)
        loop.run_in_step(lambda: debug_hang.hang(device))

    def inject_fault(self) -> None:
        """Test hook (debug_fault): fault this engine's GPU context from its loop thread."""
        loop = self.loop
        if loop is None:
            log.warning("debug fault requested but the engine is not serving")
            return
        from .debug_fault import illegal_address

        log.warning("debug fault requested: faulting this engine's GPU context")
        loop.post(lambda: illegal_address(self.adapter.device))

    def on_shutdown(self, env_id: int, msg: control_pb2.Shutdown):
        grace = msg.grace_ms / 1000 if msg.grace_ms else self.cfg.default_grace_s
        self.shutdown(grace)
        try:
            self.client.reply(env_id, control_pb2.Reply(ok=True))
        except control.ControlError:
            pass
        self._finish(EXIT_OK)
        return None

    def on_disconnect(self, err: Exception) -> None:
        if self._done.is_set():
            return
        log.error("control connection lost (%s): the supervisor is gone, exiting", err)
        self.shutdown(0)
        self._finish(EXIT_ERROR)

    def request_shutdown(self, grace_s: float | None = None) -> None:
        """SIGTERM: drain and exit 0 (off the signal handler's thread)."""

        def go():
            self.shutdown(self.cfg.default_grace_s if grace_s is None else grace_s)
            self._finish(EXIT_OK)

        threading.Thread(target=go, name="frmps-shutdown", daemon=True).start()

    def shutdown(self, grace_s: float) -> None:
        """Stop taking requests, let running streams finish within grace_s, stop the loop."""
        if not self._shutting_down.acquire(blocking=False):
            return
        self.backend.is_serving = False
        server = self.server
        if server is not None:
            server.stop_input()  # core mode: no new requests from the frontend
        deadline = time.monotonic() + grace_s
        while self.loop is not None and self.loop.load()[0] and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.gen is not None:
            self.gen.stop(max(0.0, deadline - time.monotonic()))
        if server is not None:
            server.close()  # stops the loop; sends nothing more (never ENGINE_CORE_DEAD)
        if self.loop is not None:
            self.loop.stop()
        self.log_counters("at shutdown")

    def _finish(self, code: int) -> None:
        if not self._done.is_set():
            self._exit_code = code
            self._done.set()

    def _fatal(self, e: BaseException) -> None:
        """Called on the loop thread when stepping the core failed. Never returns."""
        if is_device_error(e):
            cause, code = device_error_cause(e), EXIT_DEVICE
        else:
            cause, code = f"engine error: {type(e).__name__}: {e}", EXIT_ERROR
        detail = "".join(traceback.format_exception(e))
        try:
            log.critical("fatal: %s", cause)
            if self.client is not None:
                self.client.fault(cause, detail)
        except Exception:
            pass
        finally:
            # No Python teardown: after a sticky device error it can hang in the driver.
            self._exit(code)

    def _peer_died(self, cause: str) -> None:
        """Another rank of the group died: this engine is dead as a whole. Say so and
        exit at once, without waiting on the loop (a collective may be stuck on the
        dead peer) or on anything else. Never returns.

        Two threads may report the same death (the group's watcher, and the loop
        whose step failed on the dead peer): one reports, the other waits for the
        process to end rather than going on (a loop that went on would fail its
        requests)."""
        if not self._peer_report.acquire(blocking=False):
            self._peer_reported.wait()
            return
        try:
            log.critical("fatal: %s", cause)
            if self.client is not None:
                self.client.fault(cause, "")
        except Exception:
            pass
        finally:
            try:
                self._exit(EXIT_PEER_DIED)
            finally:
                self._peer_reported.set()

    def _step_failed(self, e: BaseException) -> None:
        """The engine loop's on_error: a step failed with an error that is not a
        device error. In a tensor-parallel engine that may be a collective or an
        RPC on a rank that is dying: if one is (or is seen dead within
        PEER_DEATH_WAIT_S), report its death (never returns), so the requests stay
        open for the standby instead of failing with the symptom."""
        if not isinstance(self.adapter, ProcessGroup):
            return
        cause = self.adapter.dead_peer(PEER_DEATH_WAIT_S)
        if cause:
            log.error("step failed with %s: %s: a tensor-parallel rank died", type(e).__name__, e)
            self._peer_died(cause)

    def _heartbeats(self) -> None:
        """The liveness signal: its own thread, which never waits on the device, on the
        engine loop or on a lock the loop holds (EngineLoop.heartbeat reads attributes),
        so it stops only when the whole process does; a step that hangs shows as a
        growing step age instead."""
        ms = self.welcome.heartbeat_interval_ms if self.welcome is not None else 0
        interval = ms / 1000 if ms else self.cfg.heartbeat_s
        interval_ms = max(1, round(interval * 1000))
        while not self._done.wait(interval):
            loop = self.loop
            step, running, waiting, age, expected, tokens = loop.heartbeat() if loop is not None else (0, 0, 0, 0, 0, 0)
            try:
                self.client.heartbeat(step, running, waiting, interval_ms=interval_ms, step_age_ns=age,
                                      step_expected_ns=expected, step_tokens=tokens)
            except control.ControlError:
                return

    def counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        if self.core is not None:
            out.update({str(k): int(v) for k, v in self.core.counters.items()})
        if self.loop is not None:
            out.update({f"loop_{k}": int(v) for k, v in self.loop.counters.items()})
            out["loop_steps"] = self.loop.step_count
        return out

    def log_counters(self, when: str) -> None:
        log.info("engine counters %s: %s", when, json.dumps(self.counters(), sort_keys=True))


def ring_room_note(record_bytes: int, publisher: Any) -> str:
    """Warns (and returns the line) when the ring's records (a quarter of it:
    ring/tracker.py) are smaller than the largest FULL record the adapter says
    it can publish; the tracker then leaves requests out of the supervisor's
    snapshot, and a takeover re-prefills them (exact, slower)."""
    writer = getattr(publisher, "_writer", None)
    room = int(getattr(writer, "max_record", 0) or 0) // 2  # max_record: half the ring
    if not record_bytes or not room or record_bytes <= room:
        return ""
    need = ring_capacity_needed(record_bytes)
    line = (f"ring: a FULL record of this engine's largest batch needs up to {record_bytes} bytes and the ring "
            f"takes {room} (a quarter of it); at that batch some requests stay out of the supervisor's snapshot "
            f"and a takeover re-prefills them. frmps serve --ring-capacity {need} holds them all")
    log.warning("%s", line)
    return line


def kv_budget_pb(b: Any) -> control_pb2.KVBudget | None:
    """An adapter's ``kv_budget`` (vllm/sizing.py KVBudget, or anything with its
    fields) as the Hello's KVBudget; None without one."""
    if b is None:
        return None
    return control_pb2.KVBudget(
        gpu_total_bytes=int(b.gpu_total_bytes), utilization=float(b.utilization), budget_bytes=int(b.budget_bytes),
        weights_bytes=int(b.weights_bytes), kv_bytes=int(b.kv_bytes), num_blocks=int(b.num_blocks),
        block_bytes=int(b.block_bytes), reserved_bytes=int(b.reserved_bytes),
        reserved={k: int(v) for k, v in dict(b.reserved).items()}, source=str(b.source))


def _write_modules() -> None:
    """FRMPS_MODULES_FILE (set by the supervisor): the modules this served engine
    loaded, for the spares it starts later (sdk/spare.py)."""
    path = os.environ.get("FRMPS_MODULES_FILE", "")
    if not path:
        return
    try:
        spare.write_modules(path)
    except OSError as e:
        log.warning("cannot write the module list for spares to %s: %s", path, e)


def _freeze_heap() -> None:
    """Move everything built so far (torch, the model, gRPC) out of the collector's
    reach (spare.freeze_heap, which a spare also runs after its preload). A full
    collection walks that whole heap, and would otherwise land at random in a
    decode step or in the middle of a takeover."""
    spare.freeze_heap()
