"""What Triton compiled in this engine, and why its disk cache did not have it.

An engine that finds every Triton kernel in Triton's disk cache builds in seconds;
one that misses compiles them again (every Triton kernel vLLM's V2 model runner and
sampler use, and inductor's too), seconds more of its start, even under a cache
directory other engines have filled. Triton's cache key is
``triton_key()-src.hash()-backend.hash()-options.hash()-env vars``
(triton/runtime/cache.py, get_cache_key); a miss of every kernel at once means a
part common to all of them changed, or the directory did.

``TritonCompileWatch`` is a ``triton.knobs.compilation.listener`` (Triton >= 3.4
calls it for every ``triton.compile``, hit or miss, with the compile's times). It
counts hits and misses, logs each miss after the engine's start, and sums the
start up in one line (``start_summary``). With FRMPS_DEBUG_TRITON_COMPILES=1 it
logs every compile, hits included, with the key's parts as short hashes and the
directory, so that a miss can be set beside a hit of the same kernel in another
engine. Without Triton (or with an older one) it installs nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from typing import Any

log = logging.getLogger(__name__)

DEBUG_ENV = "FRMPS_DEBUG_TRITON_COMPILES"


def _short(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()[:12]


def _tuples(v: Any) -> Any:
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def key_parts(src: Any, metadata: dict) -> dict:
    """The parts of Triton's cache key for one compile, each as a short hash
    ("?" where this Triton does not give it), and ``same_key``: whether the parts,
    put together as Triton does, give the key the compile was stored under
    (``metadata["hash"]``) — so that the parts explain that key, not a guess."""
    full: dict[str, str | None] = dict.fromkeys(("triton", "src", "backend", "options", "env"))
    try:
        from triton.runtime.cache import triton_key

        full["triton"] = triton_key()
    except Exception:  # noqa: BLE001 - diagnostics only
        pass
    try:
        full["src"] = src.hash()
    except Exception:  # noqa: BLE001
        pass
    backend = None
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend

        target = metadata.get("target")
        if isinstance(target, dict):
            target = GPUTarget(**target)
        elif isinstance(target, (list, tuple)):
            target = GPUTarget(*target)
        backend = make_backend(target)
        full["backend"] = backend.hash()
    except Exception:  # noqa: BLE001
        pass
    try:
        import dataclasses

        fields = {f.name for f in dataclasses.fields(type(backend.parse_options({})))}
        # A hit's metadata comes from the cache's JSON, where Triton's tuples became lists.
        opts = backend.parse_options({k: _tuples(v) for k, v in metadata.items() if k in fields})
        full["options"] = opts.hash()
    except Exception:  # noqa: BLE001
        pass
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars

        full["env"] = str(sorted(get_cache_invalidating_env_vars().items()))
    except Exception:  # noqa: BLE001
        pass
    parts = {k: (_short(v) if v is not None else "?") for k, v in full.items()}
    # What the backend hash is made of (Triton's CUDA backend: `ptxas --version` and the arch), one line.
    parts["backend_text"] = " ".join(full["backend"].split())[-160:] if full["backend"] else "?"
    stored = str(metadata.get("hash", ""))
    parts["key"] = stored[:12] or "?"
    if stored and None not in full.values():
        # triton/runtime/cache.py get_cache_key, hashed as triton.compiler.compiler.compile does
        key = f"{full['triton']}-{full['src']}-{full['backend']}-{full['options']}-{full['env']}"
        parts["same_key"] = "yes" if hashlib.sha256(key.encode()).hexdigest() == stored else "no"
    else:
        parts["same_key"] = "?"
    return parts


def _dir_of(metadata_group: dict | None) -> str:
    for path in (metadata_group or {}).values():
        if isinstance(path, str) and os.sep in path:
            return os.path.dirname(os.path.dirname(path))  # <cache dir>/<key hash>/<file>
    try:
        from triton import knobs

        return str(knobs.cache.dir)
    except Exception:  # noqa: BLE001
        return "?"


class TritonCompileWatch:
    """A Triton compilation listener that counts and explains (module doc).
    Chains to a listener installed before it."""

    def __init__(self, detail: bool = False):
        self.detail = detail
        self.hits = 0
        self.misses = 0
        self.miss_seconds = 0.0
        self.missed: dict[str, int] = {}  # kernel name -> misses
        self.dir = ""
        self.started = False  # after start_summary, each miss is logged
        self._prev = None
        self._lock = threading.Lock()
        self._backends: set[str] = set()  # backend hashes whose text this watch has logged

    def install(self) -> bool:
        try:
            from triton import knobs

            compilation = knobs.compilation
            if not hasattr(compilation, "listener"):
                return False
        except Exception:  # noqa: BLE001 - no Triton, or one without listeners
            return False
        self._prev = compilation.listener
        compilation.listener = self
        return True

    def uninstall(self) -> None:
        try:
            from triton import knobs
        except Exception:  # noqa: BLE001
            return
        if knobs.compilation.listener is self:
            knobs.compilation.listener = self._prev

    def __call__(self, *, src: Any, metadata: dict, metadata_group: dict, times: Any, cache_hit: bool) -> None:
        if self._prev is not None:
            self._prev(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)
        name = getattr(src, "name", "?")
        try:
            seconds = times.total / 1e6
        except Exception:  # noqa: BLE001
            seconds = 0.0
        with self._lock:
            if not self.dir:
                self.dir = _dir_of(metadata_group)
            if cache_hit:
                self.hits += 1
            else:
                self.misses += 1
                self.miss_seconds += seconds
                self.missed[name] = self.missed.get(name, 0) + 1
            started = self.started
        if self.detail or (started and not cache_hit):
            parts = key_parts(src, metadata)
            with self._lock:
                new_backend = parts["backend"] not in self._backends
                self._backends.add(parts["backend"])
            if new_backend:
                log.info("triton backend %s: %s", parts["backend"], parts["backend_text"])
            log.info("triton %s: %s in %.3f s; key %s (triton %s, src %s, backend %s, options %s, env %s; "
                     "parts give the key: %s) in %s", "cache hit" if cache_hit else "compiled (cache miss)", name,
                     seconds, parts["key"], parts["triton"], parts["src"], parts["backend"], parts["options"],
                     parts["env"], parts["same_key"], _dir_of(metadata_group))

    def start_summary(self) -> str:
        """One line for the engine's start; from now on each miss is logged."""
        with self._lock:
            self.started = True
            top = sorted(self.missed.items(), key=lambda kv: -kv[1])[:5]
            line = (f"Triton during the start: {self.hits} kernels from the cache, {self.misses} compiled "
                    f"({self.miss_seconds:.2f} s of compiling) in {self.dir or 'no cache used'}")
            if top:
                line += "; compiled: " + ", ".join(n for n, _ in top) + (" …" if len(self.missed) > len(top) else "")
        return line


# The watch of a process with no engine build of its own to sum up: a tensor-parallel
# worker (tp_worker.py installs it; rank 0 asks for its line, tp.rank_triton_summary).
PROCESS_WATCH: TritonCompileWatch | None = None


def install_process_watch() -> TritonCompileWatch | None:
    global PROCESS_WATCH
    if PROCESS_WATCH is None:
        PROCESS_WATCH = watch_from_env()
    return PROCESS_WATCH


def watch_from_env(env: dict | os._Environ = os.environ) -> TritonCompileWatch | None:
    """A watch installed as Triton's compilation listener, or None without Triton."""
    w = TritonCompileWatch(detail=env.get(DEBUG_ENV, "") not in ("", "0"))
    return w if w.install() else None
