"""Test-side helpers whose vLLM calls differ between the supported versions
(the adapter's own differences live in frmps_engine/vllm/compat/)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable


def version() -> str:
    from frmps_engine.vllm.version import check_vllm_version

    return check_vllm_version()


def plan_kv_cache(vllm_config: Any, specs: list[dict]) -> list[Any]:
    """vLLM's own KV planner (get_kv_cache_configs) for per-worker layer specs."""
    if version() == "0.26.0":
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

        return get_kv_cache_configs(vllm_config, specs, [1 << 40] * len(specs))
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    return get_kv_cache_configs(vllm_config, specs, [1 << 40] * len(specs), get_global_kv_cache_groups(vllm_config, specs))


def allocate_kv_cache(kv_config: Any, device: Any, vllm_config: Any) -> dict:
    """The V2 model runner's own KV allocation function ({layer name: tensor})."""
    if version() == "0.26.0":
        from vllm.v1.worker.gpu import attn_utils

        return attn_utils._allocate_kv_cache(kv_config, {}, device)  # the patched module attribute
    from vllm.v1.worker.utils import allocate_kv_cache as alloc

    return alloc(kv_config, device, vllm_config.cache_config.get_resolved_kv_cache_layout())


@contextlib.contextmanager
def model_factory(loader_cls: type, build: Callable[[], Any]):
    """Make ``loader_cls`` (a BaseModelLoader test double) build ``build()`` as its
    model: 0.33 has a create_model hook; 0.26's load_model calls the module's
    initialize_model directly (model_executor/model_loader/base_loader.py:55)."""
    if version() == "0.26.0":
        from vllm.model_executor.model_loader import base_loader

        saved = base_loader.initialize_model
        base_loader.initialize_model = lambda **_: build()
        try:
            yield
        finally:
            base_loader.initialize_model = saved
    else:
        loader_cls.create_model = lambda self, vllm_config, model_config, prefix="": build()
        yield
