"""The ``vllm.general_plugins`` entry point: ``frmps = frmps_engine.vllm.plugin:register``.

vLLM calls it in every process it starts (API server, EngineCore, each worker),
possibly several times: vllm/plugins/__init__.py:77-85 guards with a per-process
flag, but fork-started processes, tests and a second ``load_general_plugins``
path may call it again, so everything here is idempotent.
"""

from __future__ import annotations

import threading

from . import SLEEP_BACKEND_NAME
from .version import check_vllm_version

_lock = threading.Lock()
_registered = False


def register() -> None:
    """Check the vLLM version (refusing any other loudly), register the frmps
    sleep-mode backend and apply the remaining patches. Safe to call again."""
    global _registered
    with _lock:
        if _registered:
            return
        # Raising here aborts vLLM's start: load_general_plugins calls plugins
        # outside its try block (plugins/__init__.py:88-90). That is intended.
        check_vllm_version()
        from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

        # register_backend raises on a second registration of a name
        # (sleep_mode_backend.py:171-174); the registry dict is the only way to ask.
        if SLEEP_BACKEND_NAME not in SleepModeBackendFactory._registry:
            SleepModeBackendFactory.register_backend(
                SLEEP_BACKEND_NAME, "frmps_engine.vllm.sleep_backend", "FrmpsSleepBackend"
            )
        from .patches import apply_all

        apply_all()
        _registered = True


def is_registered() -> bool:
    return _registered
