"""The frontend process of ``--engine vllm`` (``OPENAI.md``, design (a)): vLLM's
own OpenAI API server (the code of ``vllm serve``, the same flags) with frmps's
``FrmpsAsyncMPClient`` against engines that frmps manages, plus the
``Frontend`` gRPC service (proto/frmps/v1/frontend.proto) the supervisor calls
on a failover.

``python -m frmps_engine.cli frontend --engine-input ipc://… --engine-output
ipc://… --control-socket PATH [vllm serve arguments: MODEL --host --port
--api-key --served-model-name …]``

- vLLM's serve path runs unchanged: its argument parser, ``setup_server`` and
  ``run_server_worker`` with ``client_config`` = the two engine-core
  addresses, i.e. the path of vLLM's ``--api-server-count > 1`` workers
  (externally managed engines: the client starts no engine and no monitor).
  The per-version entry points are in ``compat/v0_26.py`` / ``v0_33.py``
  (``api_server()``).
- The one hook: vLLM's ``AsyncLLM.__init__`` gets its client from
  ``EngineCoreClient.make_async_mp_client`` (v1/engine/async_llm.py:193;
  0.26: :146), a name looked up in ``vllm.v1.engine.async_llm``. This process
  rebinds that name to a subclass whose ``make_async_mp_client`` builds a
  ``FrmpsAsyncMPClient`` with the same arguments (both versions), refusing data
  parallelism. Nothing else of vLLM is replaced.
- The engine's sizes (``num_gpu_blocks``, an auto-fitted ``max_model_len``)
  come from its ready message, which vLLM's client applies
  (``_apply_ready_response``, v1/engine/core_client.py:775, 851; 0.26: :633,
  714): the frontend's own VllmConfig is built
  from the serve arguments before an engine has connected, as ``vllm serve``
  does, and the client waits for the engine's ready message in its
  constructor (``VLLM_ENGINE_READY_TIMEOUT_S``).
- Never with ``VLLM_SERVER_DEV_MODE`` (it adds ``/sleep``, ``/collective_rpc``
  … to the public app): refused at start when it is in the environment.
- The gRPC service runs on a grpc sync server's threads beside uvicorn; every
  call is marshalled onto vLLM's event loop, where the client lives. The
  socket's directory must be 0700 and owned by this user; the socket is 0600.
- This process initialises no CUDA context (vLLM's API server does not; the
  engines do, in their own processes).
- frmps's probes, ``GET /livez`` and ``GET /readyz`` (deploy/README.md), are
  added through vLLM's own ``--middleware`` option (``Probes`` below, a plain
  ASGI middleware), beside
  vLLM's ``/health``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import stat
import threading
import time
from concurrent import futures
from typing import Any

import grpc

from ..._proto.frmps.v1 import frontend_pb2 as pb
from ..._proto.frmps.v1 import frontend_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
DEFAULT_DRAIN_MS = 2000
DEFAULT_BACK_MS = 30000
EXIT_REFUSED = 2


class StartupRefused(RuntimeError):
    """The frontend refuses to start (the message says why)."""


def check_environment(env: dict[str, str] | None = None) -> None:
    env = os.environ if env is None else env
    if DEV_MODE_ENV in env:
        raise StartupRefused(f"{DEV_MODE_ENV} is set: vLLM's dev-mode routers (/sleep, /wake_up, /collective_rpc, …) "
                             "must not be served by a frmps frontend; unset it")


def check_control_socket(path: str) -> None:
    """The control socket's directory must be a directory owned by this user with
    mode 0700; a stale socket file at ``path`` is removed, anything else there
    is refused."""
    d = os.path.dirname(os.path.abspath(path))
    try:
        st = os.stat(d)
    except OSError as e:
        raise StartupRefused(f"control socket directory {d}: {e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise StartupRefused(f"control socket directory {d} is not a directory")
    if st.st_uid != os.getuid():
        raise StartupRefused(f"control socket directory {d} is owned by uid {st.st_uid}, not {os.getuid()}")
    if stat.S_IMODE(st.st_mode) != 0o700:
        raise StartupRefused(f"control socket directory {d} has mode {stat.S_IMODE(st.st_mode):04o}, must be 0700")
    try:
        lst = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(lst.st_mode):
        raise StartupRefused(f"control socket path {path} exists and is not a socket")
    os.unlink(path)


def check_engine_address(addr: str, what: str) -> None:
    if not addr.startswith("ipc://"):
        raise StartupRefused(f"{what} {addr!r}: the engine-core sockets must be ipc:// paths in the run directory "
                             "(a peer that connects can submit requests and send outputs)")


# ---------------------------------------------------------------- metrics

_METRICS: dict[str, Any] = {}
_METRICS_LOCK = threading.Lock()


def metrics() -> dict[str, Any]:
    """frmps's metrics of the frontend, in prometheus_client's default registry:
    the one vLLM's API server serves on its /metrics (vllm/v1/metrics/prometheus.py,
    ``get_prometheus_registry``; with PROMETHEUS_MULTIPROC_DIR set, through its
    multiprocess collector). Created once per process."""
    with _METRICS_LOCK:
        if not _METRICS:
            from prometheus_client import Counter, Gauge, Histogram

            _METRICS.update(
                lost=Counter("frmps_frontend_engine_lost", "Engine losses reported to the frontend (failovers and "
                             "planned handovers: EngineLost calls that returned a resume set)"),
                resumed=Counter("frmps_frontend_resumed_requests", "Requests handed to a promoted engine to resume "
                                "(entries of the resume sets)"),
                back=Counter("frmps_frontend_engine_back", "Engines that connected in a lost engine's place"),
                wait=Histogram("frmps_frontend_engine_wait_seconds", "From the engine's loss reported to the next "
                               "engine connected: the pause the frontend's open streams saw",
                               buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)),
                connected=Gauge("frmps_frontend_engine_connected", "1 while an engine is connected to the frontend",
                                multiprocess_mode="livemax"),
            )
            _METRICS["connected"].set(0)
    return _METRICS


# ---------------------------------------------------------------- the gRPC service


class FrontendService(pb_grpc.FrontendServicer):
    """The ``Frontend`` service over a ``FrmpsAsyncMPClient`` living on ``loop``.
    ``attach`` is called once the client exists (until then every call but
    FrontendHealth answers UNAVAILABLE)."""

    def __init__(self, call_timeout_slack: float = 5.0):
        self.client: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._slack = call_timeout_slack
        self._encoder: Any = None
        # One EngineLost at a time, and one EngineBack at a time; not one lock for
        # both: EngineBack waits (up to its timeout) for an engine to connect, and
        # a second failover's EngineLost (the promoted engine died before it
        # connected) must not wait behind it.
        self._lost_lock = threading.Lock()
        self._back_lock = threading.Lock()
        self._metrics = metrics()
        self._lost_at: float | None = None  # monotonic time of the first EngineLost of this loss
        self._down_seen: float | None = None  # readiness: when a probe first saw no engine connected

    def attach(self, client: Any, loop: asyncio.AbstractEventLoop) -> None:
        from vllm.v1.serial_utils import MsgpackEncoder

        self._encoder = MsgpackEncoder()
        self.client, self.loop = client, loop
        self._metrics["connected"].set(1)

    def _run(self, context: grpc.ServicerContext, coro_fn, timeout: float):
        if self.client is None or self.loop is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the frontend's engine client is not up yet")
        fut = asyncio.run_coroutine_threadsafe(coro_fn(), self.loop)
        try:
            return fut.result(timeout + self._slack)
        except futures.TimeoutError:
            fut.cancel()
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the frontend's event loop did not answer in time")

    # -- EngineLost
    def EngineLost(self, request: pb.EngineLostRequest, context: grpc.ServicerContext) -> pb.ResumeSet:
        drain_s = (request.drain_timeout_ms or DEFAULT_DRAIN_MS) / 1000.0
        with self._lost_lock:
            result = self._run(context, lambda: self._engine_lost(drain_s), drain_s)
        if isinstance(result, str):
            context.abort(grpc.StatusCode.ABORTED, result)
        return result

    async def _engine_lost(self, drain_s: float):  # on vLLM's loop
        c = self.client
        c.engine_lost()
        t0 = time.perf_counter()
        if not await c.drain_outputs(drain_s):
            return (f"outputs kept arriving for {int(drain_s * 1000)} ms after the engine was reported lost: "
                    "it is not silent (fence it first); no resume set")
        entries = []
        for e in c.resume_entries():
            frames = self._encoder.encode(e.request)
            if len(frames) != 1:
                return f"request {e.frontend_id}: its EngineCoreRequest does not encode as one msgpack frame"
            entries.append(pb.ResumeEntry(key=e.key, engine_request=bytes(frames[0]),
                                          delivered_token_ids=e.delivered, seed=e.seed))
        log.info("engine lost: resume set of %d requests (%d held) after a %.1f ms drain", len(entries),
                 c.held_requests(), (time.perf_counter() - t0) * 1e3)
        m = self._metrics
        if self._lost_at is None:
            self._lost_at = time.monotonic()
            m["lost"].inc()
        m["resumed"].inc(len(entries))
        m["connected"].set(0)
        return pb.ResumeSet(entries=entries, held_requests=c.held_requests())

    # -- EngineBack
    def EngineBack(self, request: pb.EngineBackRequest, context: grpc.ServicerContext) -> pb.EngineBackResponse:
        timeout = (request.timeout_ms or DEFAULT_BACK_MS) / 1000.0
        with self._back_lock:
            result = self._run(context, lambda: self._engine_back(timeout), timeout)
        if isinstance(result, tuple):
            context.abort(*result)
        return result

    async def _engine_back(self, timeout: float):  # on vLLM's loop
        c = self.client
        if c.engine_connected:
            return (grpc.StatusCode.FAILED_PRECONDITION, "EngineBack without EngineLost: the engine is connected")
        held = len(c._held)
        try:
            await c.wait_engine_back(timeout)
        except (asyncio.TimeoutError, TimeoutError):
            return (grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no engine connected within {int(timeout * 1000)} ms; still holding {held} messages")
        log.info("engine back: %d held messages sent", held)
        m = self._metrics
        m["back"].inc()
        m["connected"].set(1)
        if self._lost_at is not None:
            m["wait"].observe(time.monotonic() - self._lost_at)
            self._lost_at = None
        return pb.EngineBackResponse(sent_held=held)

    # -- FrontendHealth
    def FrontendHealth(self, request: pb.FrontendHealthRequest, context: grpc.ServicerContext):
        from importlib import metadata

        version = metadata.version("vllm")
        c = self.client
        if c is None:
            return pb.FrontendHealthResponse(engine_connected=False, open_requests=0, vllm_version=version)
        return pb.FrontendHealthResponse(engine_connected=c.engine_connected, open_requests=len(c.ledger),
                                         vllm_version=version)


def start_control_server(path: str, service: FrontendService) -> grpc.Server:
    """The Frontend service on unix socket ``path`` (mode 0600; its directory
    is checked by ``check_control_socket``)."""
    check_control_socket(path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="frmps-frontend-grpc"))
    pb_grpc.add_FrontendServicer_to_server(service, server)
    old = os.umask(0o177)  # the socket is created 0600 (no window with a wider mode)
    try:
        server.add_insecure_port(f"unix:{path}")
        server.start()
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    return server


# ---------------------------------------------------------------- probes

# A loss shorter than this keeps /readyz ready: the failover's promoted engine
# connects within milliseconds and the requests sent meanwhile are held, not
# refused. Longer (both engines gone: a cold start, or a crash loop), it is not.
READY_GRACE_S = 30.0
_probe_service: FrontendService | None = None


def readiness(service: FrontendService | None, now: float | None = None) -> tuple[bool, str]:
    """(ready, why) for /readyz: an engine is connected, or it has been gone less
    than READY_GRACE_S (a failover under way), counted from the supervisor's
    EngineLost or, before that comes, from the first probe that saw it gone."""
    c = service.client if service is not None else None
    if c is None:
        return False, "no engine has connected yet"
    now = time.monotonic() if now is None else now
    if c.engine_connected:
        service._down_seen = None
        return True, "an engine is connected"
    if service._down_seen is None:
        service._down_seen = now
    gone = service._lost_at if service._lost_at is not None else service._down_seen
    since = now - gone
    if since < READY_GRACE_S:
        return True, f"engine gone {since:.1f} s: a failover is under way, requests are held"
    return False, f"no engine connected for {since:.0f} s"


class Probes:
    """vLLM ``--middleware``: answers GET/HEAD ``/livez`` (200 while this
    process's event loop answers) and ``/readyz`` (200 or 503 with Retry-After,
    ``readiness``) before vLLM's own middleware (API key included: probes carry
    none); everything else goes to vLLM's app untouched.

    A plain ASGI middleware (a class: vLLM adds it with ``app.add_middleware``),
    not a function: vLLM wraps a function in Starlette's ``BaseHTTPMiddleware``,
    which copies every chunk of every streamed response through a memory stream
    and a task of its own. With one SSE chunk per token that was paid on every
    token of every request (``bench/serving``: ``--frontend vllm`` behind
    ``vllm serve`` at saturation; ``test_frontend_server.py`` measures the two)."""

    PATHS = ("/livez", "/readyz")

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (scope.get("type") != "http" or scope.get("path") not in self.PATHS
                or scope.get("method") not in ("GET", "HEAD")):
            await self.app(scope, receive, send)
            return
        from starlette.responses import JSONResponse

        if scope["path"] == "/livez":
            resp = JSONResponse({"status": "alive"})
        else:
            ok, why = readiness(_probe_service)
            resp = (JSONResponse({"status": "ready", "detail": why}) if ok else
                    JSONResponse({"status": "not ready", "detail": why}, status_code=503, headers={"Retry-After": "5"}))
        await resp(scope, receive, send)


# ---------------------------------------------------------------- vLLM's API server


def install_client_hook(service: FrontendService) -> None:
    """Make vLLM's AsyncLLM build a FrmpsAsyncMPClient (module docstring) and
    attach it to ``service``."""
    import vllm.v1.engine.async_llm as async_llm
    from vllm.v1.engine.core_client import EngineCoreClient

    from .client import FrmpsAsyncMPClient

    class FrmpsEngineCoreClient(EngineCoreClient):  # never instantiated
        @staticmethod
        def make_async_mp_client(vllm_config: Any, *args: Any, **kwargs: Any) -> FrmpsAsyncMPClient:
            if vllm_config.parallel_config.data_parallel_size > 1:
                raise StartupRefused("a frmps frontend serves one engine (no data parallelism)")
            client = FrmpsAsyncMPClient(vllm_config, *args, **kwargs)
            service.attach(client, asyncio.get_running_loop())
            log.info("frmps engine-core client: the engine is connected")
            return client

    async_llm.EngineCoreClient = FrmpsEngineCoreClient


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="frmps-engine frontend", add_help=False,
                                description="vLLM's OpenAI API server as frmps's frontend (the rest of the "
                                            "arguments are vllm serve's)")
    p.add_argument("--engine-input", required=True, help="ipc:// address of the engine-core input socket (bound here)")
    p.add_argument("--engine-output", required=True, help="ipc:// address of the engine-core output socket (bound here)")
    p.add_argument("--control-socket", required=True, help="unix socket of the Frontend gRPC service (directory 0700)")
    return p


def parse_serve_args(api: Any, rest: list[str]) -> argparse.Namespace:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if rest and not rest[0].startswith("-"):  # vllm serve MODEL …
        rest = ["--model", rest[0], *rest[1:]]
    args = api.make_arg_parser(FlexibleArgumentParser(prog="frmps-engine frontend")).parse_args(rest)
    api.validate_parsed_serve_args(args)
    if getattr(args, "headless", False) or (getattr(args, "api_server_count", None) or 1) > 1:
        raise StartupRefused("--headless and --api-server-count > 1 are not served by a frmps frontend")
    if (getattr(args, "data_parallel_size", None) or 1) > 1:
        raise StartupRefused("a frmps frontend serves one engine (no --data-parallel-size)")
    return args


async def serve(args: argparse.Namespace, opts: argparse.Namespace, api: Any) -> None:
    global _probe_service
    service = FrontendService()
    _probe_service = service
    args.middleware = [*(getattr(args, "middleware", None) or []), f"{__name__}.Probes"]
    control = start_control_server(opts.control_socket, service)
    try:
        install_client_hook(service)
        listen_address, sock = api.setup_server(args, reuse_port=False)
        await api.run_server_worker(listen_address, sock, args,
                                    client_config={"input_address": opts.engine_input,
                                                   "output_address": opts.engine_output})
    finally:
        control.stop(1.0)


CPU_PLATFORM_TEST_ENV = "FRMPS_TEST_VLLM_CPU_PLATFORM"


def _test_cpu_platform() -> None:
    """TEST HOOK (FRMPS_TEST_VLLM_CPU_PLATFORM=1): vLLM's pinned wheels are CUDA
    builds, which on a machine without a GPU find no platform, so vLLM cannot build
    the serve config there. The end-to-end tests of ``frmps serve --frontend vllm``
    on the CPU (with a stand-in engine) set this to give vLLM its CPU platform.
    Never set in a deployment."""
    if os.environ.get(CPU_PLATFORM_TEST_ENV) != "1":
        return
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    log.warning("%s=1: vLLM's platform forced to CPU (a test hook; not for serving)", CPU_PLATFORM_TEST_ENV)
    platforms._current_platform = CpuPlatform()


def main(argv: list[str]) -> int:
    try:
        check_environment()
        _test_cpu_platform()
        opts, rest = build_parser().parse_known_args(argv)
        check_engine_address(opts.engine_input, "--engine-input")
        check_engine_address(opts.engine_output, "--engine-output")
        check_control_socket(opts.control_socket)
        from ..compat import current

        api = current().api_server()
        api.cli_env_setup()
        args = parse_serve_args(api, rest)
    except StartupRefused as e:
        log.error("frontend cannot start: %s", e)
        return EXIT_REFUSED
    import uvloop  # vllm serve's loop (a vLLM dependency)

    try:
        uvloop.run(serve(args, opts, api))
    except StartupRefused as e:
        log.error("frontend cannot start: %s", e)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        pass
    return 0
