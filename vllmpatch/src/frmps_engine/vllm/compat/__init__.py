"""What differs between the supported vLLM versions, one module per version.

Everything else in the adapter is written once against what both versions
share (checked by the same tests in tests/vllm, run against each version).
A version module provides:

- ``VERSION``;
- ``engine_args(sleep_backend)``: EngineArgs keywords this version needs for
  the frmps sleep-mode backend, and ``finish_config(vllm_config,
  sleep_backend)`` for what EngineArgs cannot carry;
- ``kv_cache_allocations(num_layers, layer_bytes)``: the device allocations
  this version's model runner makes for a full-attention model's KV cache
  (what the kv_cache pool must hold);
- ``WORKER_PLACES_KV``: whether the worker's ``kv_cache`` memory-pool tag
  covers exactly the KV allocation (then it is the placement point), or wider
  runner state (then it only arms the allocation-level patches);
- ``PATCHES``: the version's patch registry (patches.Patch);
- ``kv_cache_planner()``: vLLM's ``get_kv_cache_configs`` (tests compare the
  pool size with vLLM's own plan).
- ``ready_response(vllm_config, engine_index)`` and ``error_output(request_id,
  message)``: the engine-core protocol's ready message and a request-scoped
  error output (frontend/engine_server.py).
- ``api_server()``: the pieces of ``vllm serve`` the frontend process runs
  (argument parser, validation, CLI set-up, ``setup_server``,
  ``run_server_worker``; frontend/server.py).

Importing this package never imports vLLM.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..version import SUPPORTED_VLLM_VERSIONS, check_vllm_version

_MODULES = {"0.26.0": "v0_26", "0.33.0": "v0_33"}
assert set(_MODULES) == set(SUPPORTED_VLLM_VERSIONS), "every supported version has a compat module"


def for_version(version: str) -> ModuleType:
    """The compat module of a supported public version (``0.26.0``)."""
    check_vllm_version(version)
    return importlib.import_module(f"{__name__}.{_MODULES[version.split('+', 1)[0]]}")


def current() -> ModuleType:
    """The compat module of the installed vLLM (refusing unsupported versions)."""
    return for_version(check_vllm_version())
