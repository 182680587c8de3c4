"""A spare: an engine process started ahead of need, its imports done, its GPU untouched.

Most of a vLLM engine's start-up after a fault is Python, not GPU work: the
interpreter, torch, torch._dynamo, vLLM's modules. None of it depends on the role the engine will
have or on whether it runs inside MPS, which is decided when the CUDA driver
initialises. So the supervisor keeps one spare::

    python -m frmps_engine.cli spare --engine vllm [--modules FILE]

It imports the engine's adapter, runs the factory's ``preload`` hook (if the
factory has one) and the modules a served engine had loaded (FILE, written by
the first active engine when it became ready, see ``write_modules``), checks
that the CUDA driver is still uninitialised, prints ``READY_MARK`` and blocks
on stdin. The supervisor activates it with one JSON line::

    {"argv": ["serve", "--engine", "vllm", "--role", "standby", ...],
     "env": {...the complete environment of an engine of that role...}}

The spare replaces its environment (only ``ACTIVATION_VARS`` may differ from
the one it started with: variables read when CUDA initialises, such as the
MPS pipe directory that places it inside or outside MPS) and runs ``serve``
with that command line, as a freshly started engine would. End of input
without a line: exit 0 (the supervisor no longer needs it).
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import inspect
import json
import logging
import os
import sys
import time
from typing import Any, Iterable, Mapping

log = logging.getLogger(__name__)

READY_MARK = "frmps-spare: ready"

# The spare's exit codes (before activation; after it, serve's own).
EXIT_BAD_ACTIVATION = 2  # the activation line is malformed or asks for what a spare cannot do
EXIT_DRIVER_INITIALISED = 5  # the engine's preload hook initialised the CUDA driver: spares cannot work
EXIT_SKIP_LEARNED = 6  # a listed module initialised the CUDA driver: it is skipped from now on, start another

# The only variables an activation may change: read by the CUDA driver when it
# initialises (which the spare has not done), never at import time. The Go
# supervisor applies the same rule before it picks a spare (supervisor/engine).
ACTIVATION_VARS = frozenset({"CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"})

_LIBCUDA = "libcuda.so.1"
CUDA_ERROR_NOT_INITIALIZED = 3


class ActivationError(ValueError):
    pass


def _mapped(lib: str) -> str | None:
    """Path of the first mapping of a shared object whose file name starts with lib, or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(None, 5)
                path = parts[5].strip() if len(parts) == 6 else ""
                if os.path.basename(path).startswith(lib):
                    return path
    except OSError:
        return None
    return None


def _loaded(lib: str, thorough: bool):
    """A handle on lib if this process has loaded it (never loads it): by name
    (RTLD_NOLOAD, microseconds), and when thorough also by any mapped file of that
    name (a copy loaded by path)."""
    try:
        return ctypes.CDLL(lib, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        pass
    if not thorough:
        return None
    path = _mapped(os.path.basename(lib).split(".so")[0] + ".so")
    return ctypes.CDLL(path) if path else None  # already mapped: the same handle


def driver_initialised(lib: str = _LIBCUDA, thorough: bool = True) -> bool:
    """Whether this process has initialised the CUDA driver (cuInit). A library that
    links libcuda maps it without initialising it; then cuCtxGetCurrent answers
    CUDA_ERROR_NOT_INITIALIZED. libcuda not loaded: certainly not initialised."""
    try:
        cuda = _loaded(lib, thorough)
        if cuda is None:
            return False
        ctx = ctypes.c_void_p()
        rc = cuda.cuCtxGetCurrent(ctypes.byref(ctx))
    except (OSError, AttributeError):
        return True  # cannot tell: assume the worst
    return rc != CUDA_ERROR_NOT_INITIALIZED


def importable(mods: Mapping[str, Any], roots: Iterable[str]) -> list[str]:
    """Names of loaded modules a fresh process can import by name: a spec of that name
    whose file lies under one of roots (sys.path entries), in load order. Leaves out
    __main__, namespace packages and modules loaded from files elsewhere (compile caches)."""
    roots = tuple(os.path.join(os.path.realpath(r), "") for r in roots if r)
    out = []
    for name, mod in list(mods.items()):
        if mod is None or name.startswith("__"):
            continue
        spec = getattr(mod, "__spec__", None)
        origin = getattr(spec, "origin", None) if spec is not None else None
        if spec is None or spec.name != name or not origin or origin in ("built-in", "frozen"):
            continue
        if os.path.realpath(origin).startswith(roots):
            out.append(name)
    return out


def write_modules(path: str) -> None:
    """Write the importable modules of this process to path (first writer wins;
    atomic, 0600), so that later spares import what a served engine needed."""
    if not path or os.path.exists(path):
        return
    names = importable(sys.modules, sys.path)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("\n".join(names) + "\n")
    try:
        os.link(tmp, path)  # fails if another engine wrote it first
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


def import_modules(names: Iterable[str], stop_if=None) -> tuple[int, int, str | None]:
    """Import each name (already loaded ones cost nothing): (imported, failed, culprit),
    culprit being the name after whose import stop_if() said to stop (None: all done).
    torch's CUDA availability check is asked to use NVML meanwhile, not the driver."""
    ok = failed = 0
    prev = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        for name in names:
            name = name.strip()
            if not name or name.startswith("#"):
                continue
            try:
                importlib.import_module(name)
                ok += 1
            except BaseException as e:  # noqa: BLE001 - a module's import may raise anything, even SystemExit
                if isinstance(e, KeyboardInterrupt):
                    raise
                failed += 1
                log.debug("spare: skipping module %s: %s: %s", name, type(e).__name__, e)
            if stop_if is not None and stop_if():
                return ok, failed, name
    finally:
        if prev is None:
            os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = prev
    return ok, failed, None


class DriverInitialised(Exception):
    """Preloading initialised the CUDA driver; .module: the listed module that did
    (None: the engine's own preload hook)."""

    def __init__(self, module: str | None):
        super().__init__(module)
        self.module = module


def _read_names(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().split()
    except FileNotFoundError:
        return []


def preload(engine: str, modules_file: str | None, model: str | None = None) -> str:
    """Import what an engine of this kind will need; a summary for the log. The
    factory's ``preload`` hook gets the model when it takes an argument (to read what
    needs no GPU, e.g. the tokenizer). A listed module whose import initialised the
    CUDA driver goes to modules_file + ".skip" (DriverInitialised), so the next spare
    leaves it out."""
    from . import adapters

    _, factory = adapters.resolve(engine)
    hook = getattr(factory, "preload", None)
    if callable(hook):
        if model and inspect.signature(hook).parameters:
            hook(model)
        else:
            hook()
    if driver_initialised():
        raise DriverInitialised(None)
    names: list[str] = []
    if modules_file:
        skip = set(_read_names(modules_file + ".skip"))
        names = [n for n in _read_names(modules_file) if n not in skip]
    ok, failed, culprit = import_modules(names, stop_if=lambda: driver_initialised(thorough=False))
    if culprit is not None:
        with open(modules_file + ".skip", "a", encoding="utf-8") as f:  # type: ignore[operator]
            f.write(culprit + "\n")
        raise DriverInitialised(culprit)
    return f"{len(sys.modules)} modules loaded ({ok} of {len(names)} listed imported, {failed} skipped)"


def freeze_heap() -> int:
    """Collect once, then move everything the preload built (the modules of torch,
    vLLM and the rest) out of the collector's reach (gc.freeze); returns how many
    objects are frozen. An engine's start collects several times (vLLM 0.26's
    DeviceMemoryProfiler around the model load: three full collections, then
    freeze_gc_heap), and each would walk that heap again: frozen, they walk only
    what the engine built since. These objects live as long as the process anyway; vLLM and the runner
    freeze the heap themselves once the engine is built."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def parse_activation(line: bytes, start_env: Mapping[str, str], engine: str) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of an activation line; ActivationError saying why not."""
    try:
        msg = json.loads(line)
    except ValueError as e:
        raise ActivationError(f"activation is not JSON: {e}") from None
    if not isinstance(msg, dict):
        raise ActivationError("activation must be a JSON object")
    argv, env = msg.get("argv"), msg.get("env")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv) or not argv:
        raise ActivationError("activation argv must be a non-empty list of strings")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ActivationError("activation env must map strings to strings")
    if argv[0] != "serve":
        raise ActivationError(f"a spare can only serve, not {argv[0]!r}")
    if "--engine" not in argv or argv.index("--engine") + 1 >= len(argv) or argv[argv.index("--engine") + 1] != engine:
        raise ActivationError(f"this spare preloaded engine {engine!r}; the activation names another")
    changed = sorted(k for k in set(env) | set(start_env) if env.get(k) != start_env.get(k))
    bad = [k for k in changed if k not in ACTIVATION_VARS]
    if bad:
        raise ActivationError(f"activation changes variables a started process has consumed: {', '.join(bad)}")
    return argv, env


def apply_env(env: Mapping[str, str]) -> None:
    """Make env this process's whole environment (putenv: the CUDA driver reads it at cuInit)."""
    os.environ.clear()
    os.environ.update(env)


def run(engine: str, modules_file: str | None, stdin=None, stdout=None,
        model: str | None = None) -> tuple[int, list[str] | None]:
    """Preload, announce, wait for the activation: (exit code, None) to exit,
    or (0, argv) to serve argv in this process."""
    stdin = stdin if stdin is not None else sys.stdin.buffer
    stdout = stdout if stdout is not None else sys.stdout
    start_env = dict(os.environ)
    t0 = time.monotonic()
    from . import adapters

    try:
        summary = preload(engine, modules_file, model)
    except adapters.AdapterError as e:
        log.error("spare cannot preload: %s", e)
        return EXIT_BAD_ACTIVATION, None
    except DriverInitialised as e:
        if e.module is None:
            log.error("spare: engine %r's preload initialised the CUDA driver, so a spare could not be placed "
                      "inside or outside MPS; engines will start cold", engine)
            return EXIT_DRIVER_INITIALISED, None
        log.error("spare: importing %s initialised the CUDA driver; the next spare leaves it out", e.module)
        return EXIT_SKIP_LEARNED, None
    if driver_initialised():
        log.error("spare: preloading engine %r initialised the CUDA driver, so this process can no longer be "
                  "placed inside or outside MPS; engines will start cold", engine)
        return EXIT_DRIVER_INITIALISED, None
    frozen = freeze_heap()
    print(f"{READY_MARK} in {time.monotonic() - t0:.1f} s: {summary}; {frozen} objects frozen", file=stdout, flush=True)
    line = stdin.readline()
    if not line.strip():
        log.info("spare: no activation, exiting")
        return 0, None
    try:
        argv, env = parse_activation(line, start_env, engine)
    except ActivationError as e:
        log.error("spare: %s", e)
        return EXIT_BAD_ACTIVATION, None
    apply_env(env)
    _stdin_to_devnull()
    log.info("spare activated after %.1f s as %s", time.monotonic() - t0, _role(argv))
    return 0, argv


def _role(argv: list[str]) -> str:
    return argv[argv.index("--role") + 1] if "--role" in argv[:-1] else "?"


def _stdin_to_devnull() -> None:
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(fd, 0)
    finally:
        os.close(fd)
