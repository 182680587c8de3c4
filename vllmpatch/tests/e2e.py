"""Helpers for end-to-end tests: a real `frmps serve` (Go supervisor, real
engine processes, real shared memory and ring) on the CPU with the tiny model,
started and streamed from through the bench's harness (bench/serve.py,
bench/sse.py)."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import pytest

from bench import sse
from bench.serve import Serve, ServeOpts


# The run's -m expression (conftest.py sets it): a prerequisite of tests the run
# deselects by their marker never fails the run.
MARK_EXPR = ""


def missing(reason: str, mark: str = "") -> None:
    """A prerequisite of the test is missing: skip, or fail in CI (CI set to a true
    value, as CI services and .ci/run do), where a test that never ran must not pass.
    Called at a module's top too: the whole module then skips or fails. ``mark``:
    the marker of the tests that need it; a run that deselects it (``-m "not
    torch"``) skips them even in CI."""
    deselected = bool(mark) and f"not {mark}" in MARK_EXPR
    if os.environ.get("CI", "").strip().lower() in ("1", "t", "true") and not deselected:
        pytest.fail(f"{reason} (CI is set: a test that cannot run fails)")
    pytest.skip(reason, allow_module_level=True)


def require(module: str, mark: str = "torch") -> Any:
    """``import module`` for a test's prerequisite (a third-party package), or
    ``missing`` when it cannot be imported (skip; fail in CI). Only for what the
    tree does not ship: the tree's own modules are imported plainly, so that an
    import error in them fails instead of skipping. ``mark``: the torch-free run
    (``make test-notorch``: ``-m "not torch"``, requirements-notorch.txt) lacks
    these packages by design and skips."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing(f"needs {module} ({type(e).__name__}: {e})", mark)


def frmps_bin() -> str:
    path = os.environ.get("FRMPS_BIN", "")
    if not path or not os.access(path, os.X_OK):
        missing("FRMPS_BIN is not set to a built frmps binary (make py-test sets it)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(method: str, url: str, body: dict | None = None, headers: dict | None = None,
              timeout: float = 30.0) -> tuple[int, dict, dict]:
    data = json.dumps(body).encode() if body is not None else None
    hdrs = {"content-type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            parsed = json.loads(raw or b"{}")
        except json.JSONDecodeError:
            parsed = {"raw": raw.decode(errors="replace")}
        return e.code, dict(e.headers), parsed


@dataclass
class StreamResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    completion_tokens: int = -1
    finish_reason: str | None = None
    ids: set[str] = field(default_factory=set)
    error: dict | None = None
    done: bool = False


class Deployment(Serve):
    """A test's `frmps serve`; admin is the admin API's URL."""

    error = AssertionError
    status_timeout = 30.0

    def __init__(self, opts: ServeOpts, work_dir: str):
        super().__init__(opts, os.path.join(work_dir, "run"), os.path.join(work_dir, "serve.log"))
        self.work_dir = work_dir  # the run dir, the state dir, the rings and the log
        self.admin = self.admin_url

    def active_pid(self) -> int:
        for e in self.status().get("engines", []):
            if e.get("role") == "active" and e.get("pid"):
                return int(e["pid"])
        raise AssertionError(f"no active engine: {self.status()}")

    def wait_state(self, want: str, timeout: float = 120.0, poll: float = 0.1) -> dict:
        return super().wait_state(want, timeout, poll)

    def stream(self, path: str, body: dict, on_token=None, timeout: float = 300.0) -> StreamResult:
        """Streams a request; on_token(count_so_far) is called after every chunk with tokens."""
        out = StreamResult()
        pieces = []
        with urllib.request.urlopen(sse.request(f"{self.base}{path}", sse.stream_body(body)), timeout=timeout) as resp:
            for ev in sse.events(resp):
                if ev == sse.DONE:
                    out.done = True
                    break
                if "error" in ev:
                    out.error = ev["error"]
                    continue
                out.ids.add(ev["id"])
                for ch in ev.get("choices", []):
                    pieces.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
                    out.token_ids.extend(ch.get("token_ids") or [])
                    if ch.get("finish_reason"):
                        out.finish_reason = ch["finish_reason"]
                    if on_token and ch.get("token_ids"):
                        on_token(len(out.token_ids))
                if ev.get("usage"):
                    out.completion_tokens = ev["usage"]["completion_tokens"]
        out.text = "".join(pieces)
        return out


# TEST DOUBLE of nvidia-cuda-mps-control (supervisor/mps/testdata): a CPU
# deployment "with MPS" places engines exactly as on a GPU (the active gets the
# daemon's pipe directory, the standby one with no daemon); the engines, on the
# CPU, never use it.
FAKE_MPS_CONTROL = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "supervisor", "mps", "testdata",
                                                "nvidia-cuda-mps-control"))


@contextlib.contextmanager
def deployment(sync_every: int = 16, extra_args: list[str] | None = None, env: dict | None = None,
               model: str = "tiny", fake_mps: bool = False, engine: str = "ref", hang_defaults: bool = False):
    """`frmps serve` on the CPU for one test module. Unless hang_defaults, hang
    detection is given 10 s bounds: these tests kill engines on purpose, and on a
    loaded CI machine a CPU engine's step can stall past the 1 s defaults (a false
    "hung" verdict, then a cold start that loses the streams under test). Hang
    detection at its defaults is test_e2e_hang.py's."""
    bin_path = frmps_bin()
    hang = [] if hang_defaults else ["--heartbeat-timeout=10s", "--step-timeout-min=10s"]
    run_dir = tempfile.mkdtemp(prefix="frmps-e2e-")
    mps = ["--mps-control", FAKE_MPS_CONTROL] if fake_mps else []
    opts = ServeOpts(frmps=bin_path, python=sys.executable, model=model, engine=engine, device="cpu", memory=None,
                     mps=fake_mps, sync_every=sync_every, env=dict(env or {}),
                     serve_args=[*mps, "--state-dir", os.path.join(run_dir, "state"), "--ring-dir", run_dir, *hang,
                                 *(extra_args or [])])
    dep = Deployment(opts, run_dir)
    dep.start()
    passed = False
    try:
        dep.wait_state("serving_ready")
        yield dep
        passed = True
    finally:
        rc = dep.terminate(60)
        if rc is None:
            raise AssertionError(f"frmps did not stop on SIGTERM; log:\n{dep.log_tail()}")
        assert rc == 0, f"frmps exited with {rc}; log:\n{dep.log_tail()}"
        leftover = os.path.join(run_dir, "run")
        assert not os.path.exists(leftover) or not os.listdir(leftover), \
            f"run dir not cleaned: {os.listdir(leftover)}"
        rings = [n for n in os.listdir(run_dir) if n.endswith(".ring")]
        assert not rings, f"ring left after a clean stop: {rings}"
        records = os.path.join(run_dir, "state")
        assert not os.path.exists(records) or not os.listdir(records), \
            f"launch record left after a clean stop: {os.listdir(records)}"
        if passed:  # a failed test keeps its deployment's logs for a look
            shutil.rmtree(run_dir, ignore_errors=True)


class Killer:
    """Kills the active engine once a stream has received `after` tokens."""

    def __init__(self, dep: Deployment, after: int):
        self.dep, self.after = dep, after
        self.pid = dep.active_pid()
        self.fired = threading.Event()
        self._lock = threading.Lock()

    def on_token(self, n: int) -> None:
        with self._lock:
            if n >= self.after and not self.fired.is_set():
                self.fired.set()
                os.kill(self.pid, signal.SIGKILL)

    def fire(self) -> None:
        self.on_token(self.after)
