"""The frontend process (frmps_engine.vllm.frontend.server): vLLM's own OpenAI API
server (``vllm serve``'s code) run by ``python -m frmps_engine.cli frontend`` with
FrmpsAsyncMPClient, and the Frontend gRPC service the supervisor calls.

The engines are the real EngineCoreServer over vLLM's real scheduler, in this
test process, with the TEST DOUBLES of test_engine_server.py (``SeededFakeModel``
for the model runner: token = f(seed, position); ``SchedulerCore`` for vLLM's
EngineCore). The frontend runs as a subprocess of the CLI and is driven over
HTTP with the official ``openai`` client and over gRPC as the supervisor will.

TEST DOUBLE of the platform: vLLM's pinned wheels are CUDA builds, which find no
platform on a machine without a GPU (``DeviceConfig`` cannot infer a device, so
``vllm serve`` cannot build its config here). The frontend subprocess is started
through ``CPU_PLATFORM_PRELUDE``, which sets vLLM's current platform to its CPU
platform before running the CLI; nothing else differs from a real start."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from test_engine_server import MAX_TOKENS, STEP_S, Collector, expected, make_client, make_request, make_server

SRC = str(Path(__file__).resolve().parents[2] / "src")
CPU_PLATFORM_PRELUDE = """
import sys
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform
platforms._current_platform = CpuPlatform()  # TEST DOUBLE: see the module docstring
from frmps_engine.cli import main
main(sys.argv[1:])
"""
API_KEY = "test-key"
MODEL_NAME = "tiny"
KILL_AFTER = 5


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("VLLM_SERVER_DEV_MODE", None)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stub(path):
    from frmps_engine._proto.frmps.v1 import frontend_pb2_grpc

    return frontend_pb2_grpc.FrontendStub(grpc.insecure_channel(f"unix:{path}"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from frmps_engine import modeldir

    # The Qwen2.5 preset's directory: config and a tokenizer (vLLM's API server detokenizes).
    return modeldir.write("qwen2.5-0.5b", str(tmp_path_factory.mktemp("qwen") / "m"))


class Frontend:
    def __init__(self, run_dir: Path, model_dir: str, engine):
        self.run_dir = run_dir
        self.addrs = (f"ipc://{run_dir / 'in.sock'}", f"ipc://{run_dir / 'out.sock'}")
        self.control = str(run_dir / "frontend.sock")
        self.port = _free_port()
        self.engine = engine
        self.log = open(run_dir / "frontend.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CPU_PLATFORM_PRELUDE, "frontend", "--engine-input", self.addrs[0],
             "--engine-output", self.addrs[1], "--control-socket", self.control, model_dir,
             "--host", "127.0.0.1", "--port", str(self.port), "--api-key", API_KEY,
             "--served-model-name", MODEL_NAME, "--max-model-len", "512", "--disable-uvicorn-access-log"],
            env=_env(), stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout=180.0):
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"frontend exited {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"frontend not ready:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-6000:]

    def openai(self):
        import openai

        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=API_KEY, max_retries=0, timeout=60)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def frontend(model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    os.chmod(run_dir, 0o700)
    addrs = (f"ipc://{run_dir / 'in.sock'}", f"ipc://{run_dir / 'out.sock'}")
    from frmps_engine.ring import create_ring

    ring_path = str(run_dir / "ring")
    create_ring(ring_path, 1 << 20)
    from frmps_engine.ring.reader import RingReader

    reader = RingReader(ring_path)  # before the engine publishes: it follows the ring from its start
    engine = make_server(model_dir, addrs, ring_path=ring_path)
    engine.start()
    fe = Frontend(run_dir, model_dir, engine)
    fe.ring_path, fe.reader = ring_path, reader
    try:
        fe.wait_ready()
        yield fe
    finally:
        fe.stop()
        fe.engine.close()
        reader.close()


class Stream(threading.Thread):
    """One streamed /v1/completions through the official openai client, with the
    token ids of each chunk (vLLM's ``return_token_ids`` extension)."""

    def __init__(self, fe, prompt, **kw):
        super().__init__(daemon=True)
        self.fe, self.prompt, self.kw = fe, prompt, kw
        self.ids: dict[int, list[int]] = {}
        self.text: dict[int, str] = {}
        self.finish: dict[int, str] = {}
        self.error: BaseException | None = None

    def run(self):
        try:
            stream = self.fe.openai().completions.create(
                model=MODEL_NAME, prompt=self.prompt, max_tokens=MAX_TOKENS, stream=True,
                extra_body={"return_token_ids": True}, **self.kw)
            for chunk in stream:
                for c in chunk.choices:
                    self.ids.setdefault(c.index, []).extend((c.model_extra or {}).get("token_ids") or [])
                    self.text[c.index] = self.text.get(c.index, "") + (c.text or "")
                    if c.finish_reason is not None:
                        self.finish[c.index] = c.finish_reason
        except BaseException as e:  # reported by the test
            self.error = e

    def tokens(self, i=0) -> int:
        return len(self.ids.get(i, []))


PROMPT = list(range(10, 30))


def test_streamed_completion_through_vllms_api_server(frontend, model_dir):
    """(a) vLLM's own API server, with frmps's client, against an engine server:
    a streamed /v1/completions with prompt token ids ends with the test model's
    tokens for the request's seed, as text and as token ids; the API key is
    enforced; the Frontend service reports the engine connected and nothing open."""
    from frmps_engine._proto.frmps.v1 import frontend_pb2 as pb
    from tokenizers import Tokenizer

    import openai

    s = Stream(frontend, PROMPT, seed=11)
    s.run()
    assert s.error is None, f"{s.error!r}\n{frontend.output()}"
    assert s.ids[0] == expected(11, prompt=PROMPT)
    assert s.finish[0] == "length"
    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    assert s.text[0] == tok.decode(expected(11, prompt=PROMPT))
    bad = openai.OpenAI(base_url=f"http://127.0.0.1:{frontend.port}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    h = stub(frontend.control).FrontendHealth(pb.FrontendHealthRequest(), timeout=10)
    assert h.engine_connected and h.open_requests == 0
    # frmps's probes on vLLM's app (its --middleware), without the API key; vLLM's routes unchanged.
    import httpx

    base = f"http://127.0.0.1:{frontend.port}"
    assert httpx.get(f"{base}/livez").status_code == 200
    r = httpx.get(f"{base}/readyz")
    assert r.status_code == 200 and r.json()["status"] == "ready", r.text
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/v1/models").status_code == 401  # the key still guards the API
    assert h.vllm_version.split("+")[0] == os.environ.get("FRMPS_EXPECT_VLLM", h.vllm_version.split("+")[0])


def test_failover_mid_stream_through_the_frontend_service(frontend, model_dir):
    """(b) Two streams (seeded; unseeded n=2) on engine A; A is stopped abruptly
    after every choice has KILL_AFTER tokens; at once, as the supervisor will:
    gRPC EngineLost (which drains what A had pushed) -> the resume set; engine B
    decodes each engine_request with vLLM's MsgpackDecoder, adopts with A's ring
    snapshot, connects; gRPC EngineBack. Every stream completes with no client
    error and each choice's tokens exactly once: equal to the no-fault run (the
    stand-in's tokens for the request's seed; the ledger's seeds of the unseeded
    children come back in the resume set)."""
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.serial_utils import MsgpackDecoder

    from frmps_engine._proto.frmps.v1 import frontend_pb2 as pb
    from frmps_engine.sdk.seeds import to_int64
    from frmps_engine.vllm.frontend.ledger import Entry

    a = frontend.engine
    streams = [Stream(frontend, PROMPT, seed=11), Stream(frontend, [5, 6, 7, 8, 9], n=2)]
    for s in streams:
        s.start()
    deadline = time.monotonic() + 30
    while not all(s.tokens(0) >= KILL_AFTER for s in streams) or streams[1].tokens(1) < KILL_AFTER:
        assert time.monotonic() < deadline, frontend.output()
        assert all(s.error is None for s in streams), [s.error for s in streams]
        time.sleep(0.005)
    a.halt(close_sockets=True)
    assert not any(s.finish for s in streams), "A was stopped mid-stream"

    control = stub(frontend.control)
    rs = control.EngineLost(pb.EngineLostRequest(drain_timeout_ms=2000), timeout=10)
    assert len(rs.entries) == 3 and rs.held_requests == 0
    dec = MsgpackDecoder(EngineCoreRequest)
    entries = []
    for pe in rs.entries:
        req = dec.decode(pe.engine_request)
        assert req.request_id == f"frmps-{pe.key}" and to_int64(pe.seed) == req.sampling_params.seed
        entries.append(Entry(key=pe.key, frontend_id="", request=req, prompt_token_ids=list(req.prompt_token_ids),
                             seed=pe.seed, delivered=list(pe.delivered_token_ids)))
    assert control.FrontendHealth(pb.FrontendHealthRequest(), timeout=5).engine_connected is False
    frontend.reader.poll()
    snapshots = {k: v for k, v in frontend.reader.snapshot.items() if k in {e.key for e in entries}}
    assert set(snapshots) == {e.key for e in entries}

    b = make_server(model_dir, frontend.addrs, ring_path=frontend.ring_path)
    frontend.engine = b  # closed by the fixture
    outcomes = b.adopt(entries, snapshots)
    assert all(o.ok for o in outcomes), outcomes
    b.start()
    back = control.EngineBack(pb.EngineBackRequest(timeout_ms=10000), timeout=20)
    assert back.sent_held == 0
    for s in streams:
        s.join(30)
        assert not s.is_alive() and s.error is None, f"{s.error!r}\n{frontend.output()}"
    seeds = {tuple(e.request.prompt_token_ids): [] for e in entries}
    for e in entries:
        seeds[tuple(e.request.prompt_token_ids)].append(e.request.sampling_params.seed)
    assert seeds[tuple(PROMPT)] == [11]
    assert streams[0].ids[0] == expected(11, prompt=PROMPT) and streams[0].finish == {0: "length"}
    children = sorted(tuple(streams[1].ids[i]) for i in (0, 1))
    assert children == sorted(tuple(expected(sd, prompt=[5, 6, 7, 8, 9])) for sd in seeds[(5, 6, 7, 8, 9)])
    assert streams[1].finish == {0: "length", 1: "length"}
    assert b.core.counters["requests_adopted"] == 3 and b.refused == [] and a.refused == []
    h = control.FrontendHealth(pb.FrontendHealthRequest(), timeout=5)
    assert h.engine_connected and h.open_requests == 0
    # The failover on vLLM's own /metrics, beside vLLM's metrics.
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{frontend.port}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
         if line.startswith("frmps_frontend_") and " " in line}
    assert m["frmps_frontend_engine_lost_total"] == 1 and m["frmps_frontend_resumed_requests_total"] == 3
    assert m["frmps_frontend_engine_back_total"] == 1 and m["frmps_frontend_engine_connected"] == 1
    assert m["frmps_frontend_engine_wait_seconds_count"] == 1 and 0 < m["frmps_frontend_engine_wait_seconds_sum"] < 30
    assert any(line.startswith("vllm:") for line in text.splitlines()), "vLLM's own metrics on the same page"


def test_control_socket_is_private_and_bad_calls_get_clear_errors(frontend):
    """(c) The Frontend socket is 0600 in a 0700 directory; EngineBack while the
    engine is connected is FAILED_PRECONDITION with the reason; a request that is
    not an EngineLostRequest is rejected by gRPC and changes nothing."""
    from frmps_engine._proto.frmps.v1 import frontend_pb2 as pb

    st = os.stat(frontend.control)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(os.stat(frontend.run_dir).st_mode) == 0o700
    control = stub(frontend.control)
    with pytest.raises(grpc.RpcError) as e:
        control.EngineBack(pb.EngineBackRequest(timeout_ms=100), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "EngineBack without EngineLost" in e.value.details()
    raw = grpc.insecure_channel(f"unix:{frontend.control}").unary_unary("/frmps.v1.Frontend/EngineLost")
    with pytest.raises(grpc.RpcError) as e:
        raw(b"\x07\xff", timeout=10)  # field 0, wire type 7: not a protobuf message
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert control.FrontendHealth(pb.FrontendHealthRequest(), timeout=5).engine_connected


def _cli(args, env=None):
    return subprocess.run([sys.executable, "-m", "frmps_engine.cli", "frontend", *args], env=env or _env(),
                          capture_output=True, text=True, timeout=60)


def test_frontend_refuses_dev_mode_and_an_open_control_directory(tmp_path):
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    os.chmod(d, 0o700)
    base = ["--engine-input", f"ipc://{d}/in", "--engine-output", f"ipc://{d}/out", "--control-socket", f"{d}/c.sock",
            "some-model"]
    env = _env()
    env["VLLM_SERVER_DEV_MODE"] = "1"
    r = _cli(base, env)
    assert r.returncode == 2 and "VLLM_SERVER_DEV_MODE is set" in r.stderr
    os.chmod(d, 0o755)
    r = _cli(base)
    assert r.returncode == 2 and "has mode 0755, must be 0700" in r.stderr
    os.chmod(d, 0o700)
    r = _cli(["--engine-input", "tcp://127.0.0.1:5555", *base[2:]])
    assert r.returncode == 2 and "must be ipc://" in r.stderr


def test_engine_lost_drains_what_the_dead_engine_pushed(model_dir, tmp_path):
    """EngineLost's drain, in process: engine A pushes outputs while vLLM's event
    loop is busy (blocked here), then stops. When the resume set is asked for,
    the client has not yet recorded what A pushed (checked: the scenario is
    real); the service drains first, so each entry's delivered tokens are
    everything A sent — a resume set read without the drain would make a
    standby emit those tokens a second time."""
    from vllm.sampling_params import SamplingParams

    from frmps_engine.vllm.frontend.server import FrontendService

    addrs = (f"ipc://{tmp_path / 'in.sock'}", f"ipc://{tmp_path / 'out.sock'}")

    async def main():
        a = make_server(model_dir, addrs, device_s=STEP_S)
        a.start()
        client = make_client(model_dir, addrs)
        svc = FrontendService()
        svc.attach(client, asyncio.get_running_loop())
        try:
            await client.add_request_async(make_request("cmpl-d", SamplingParams(max_tokens=MAX_TOKENS, seed=7)))
            col = Collector(client)
            await col.drain(lambda: len(col.got.get("cmpl-d", [])) >= 3)
            time.sleep(10 * STEP_S)  # the loop is busy; A keeps pushing
            a.halt(close_sockets=True)
            sent = a.sent_batches
            assert len(client.ledger.open_entries()[0].delivered) < sent, "outputs were pending when A stopped"
            rs = await svc._engine_lost(2.0)
            assert not isinstance(rs, str), rs
            (e,) = rs.entries
            assert list(e.delivered_token_ids) == expected(7)[:sent]
        finally:
            client.shutdown()
            a.close()

    asyncio.run(main())


class _Aborted(Exception):
    pass


class _Context:
    """Stands in for grpc's servicer context: abort raises, as grpc's does."""

    def abort(self, code, details):
        raise _Aborted(code, details)


def test_engine_lost_does_not_wait_behind_engine_back(model_dir, tmp_path):
    """A second failover while the frontend still waits for the first promoted
    engine to connect (it died first): EngineLost answers at once instead of
    waiting behind the EngineBack in flight, and EngineBack still ends with
    DEADLINE_EXCEEDED when no engine comes."""
    from vllm.sampling_params import SamplingParams

    from frmps_engine._proto.frmps.v1 import frontend_pb2 as pb
    from frmps_engine.vllm.frontend.server import FrontendService

    addrs = (f"ipc://{tmp_path / 'in.sock'}", f"ipc://{tmp_path / 'out.sock'}")

    async def main():
        a = make_server(model_dir, addrs, device_s=STEP_S)
        a.start()
        client = make_client(model_dir, addrs)
        svc = FrontendService(call_timeout_slack=1.0)
        svc.attach(client, asyncio.get_running_loop())
        ctx = _Context()
        try:
            await client.add_request_async(make_request("cmpl-l", SamplingParams(max_tokens=MAX_TOKENS, seed=3)))
            col = Collector(client)
            await col.drain(lambda: len(col.got.get("cmpl-l", [])) >= 2)
            a.halt(close_sockets=True)
            first = await asyncio.to_thread(svc.EngineLost, pb.EngineLostRequest(drain_timeout_ms=1000), ctx)
            back = asyncio.ensure_future(asyncio.to_thread(svc.EngineBack, pb.EngineBackRequest(timeout_ms=3000), ctx))
            await asyncio.sleep(0.3)
            assert not back.done()
            t0 = time.monotonic()
            second = await asyncio.to_thread(svc.EngineLost, pb.EngineLostRequest(drain_timeout_ms=1000), ctx)
            assert time.monotonic() - t0 < 2.0, "EngineLost waited behind EngineBack"
            assert [e.key for e in second.entries] == [e.key for e in first.entries] and len(first.entries) == 1
            with pytest.raises(_Aborted) as e:
                await back
            assert e.value.args[0] == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            client.shutdown()
            a.close()

    asyncio.run(main())


def test_readiness_follows_the_engine_and_a_failover_window():
    from types import SimpleNamespace

    from frmps_engine.vllm.frontend import server

    assert server.readiness(None) == (False, "no engine has connected yet")
    svc = SimpleNamespace(client=None, _lost_at=None, _down_seen=None)
    assert not server.readiness(svc)[0]
    svc.client = SimpleNamespace(engine_connected=True)
    assert server.readiness(svc)[0]
    # The engine is gone: ready through the failover window, counted from EngineLost...
    svc.client.engine_connected, svc._lost_at = False, 100.0
    ok, why = server.readiness(svc, now=100.0 + server.READY_GRACE_S - 1)
    assert ok and "failover" in why
    ok, why = server.readiness(svc, now=100.0 + server.READY_GRACE_S + 1)
    assert not ok and "no engine connected for" in why
    # ...or, before the supervisor's EngineLost, from the first probe that saw it gone.
    svc.client.engine_connected = True
    assert server.readiness(svc, now=300.0)[0] and svc._down_seen is None
    svc.client.engine_connected, svc._lost_at = False, None
    assert server.readiness(svc, now=400.0)[0] and svc._down_seen == 400.0
    assert server.readiness(svc, now=400.0 + server.READY_GRACE_S - 1)[0]
    assert not server.readiness(svc, now=400.0 + server.READY_GRACE_S + 1)[0]


def test_probes_middleware_passes_every_other_request_through_unwrapped():
    """The probes middleware answers /livez and /readyz itself and hands every
    other request (a streamed completion included) to vLLM's app with the very
    ``receive`` and ``send`` it got: nothing sits between the app and each chunk.
    Negative control: the same probes as a function middleware (what vLLM makes
    of one, Starlette's BaseHTTPMiddleware) hands the app a send of its own."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.base import BaseHTTPMiddleware

    from frmps_engine.vllm.frontend import server

    seen: list = []

    async def app(scope, receive, send):
        seen.append((scope["path"], receive, send))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(3):
            await send({"type": "http.response.body", "body": b"data: %d\n\n" % i, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def scope(path, method="POST"):
        return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
                "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": [],
                "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1)}

    async def call(mw, path, method="POST"):
        msgs: list = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(m):
            msgs.append(m)

        await mw(scope(path, method), receive, send)
        return receive, send, msgs

    async def main():
        mw = server.Probes(app)
        receive, send, msgs = await call(mw, "/v1/completions")
        assert seen[-1] == ("/v1/completions", receive, send)  # the same callables: unwrapped
        assert [m.get("body") for m in msgs[1:]] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
        n = len(seen)
        _, _, msgs = await call(mw, "/livez", "GET")
        assert len(seen) == n and msgs[0]["status"] == 200 and b'"alive"' in msgs[1]["body"]
        server._probe_service = None
        _, _, msgs = await call(mw, "/readyz", "GET")
        assert len(seen) == n and msgs[0]["status"] == 503 and (b"retry-after", b"5") in msgs[0]["headers"]
        _, _, msgs = await call(mw, "/livez", "POST")  # only GET and HEAD are probes
        assert len(seen) == n + 1

        async def as_function(request, call_next):  # the negative control
            return await call_next(request)

        wrapped = Starlette(middleware=[Middleware(BaseHTTPMiddleware, dispatch=as_function)])
        wrapped.router.mount("/", app)
        n = len(seen)
        receive, send, msgs = await call(wrapped, "/v1/completions")
        assert len(seen) == n + 1 and seen[-1][0].endswith("/v1/completions") and msgs[-1].get("more_body") is False
        assert seen[-1][2] is not send  # the app streams into the middleware's own send

    asyncio.run(main())
