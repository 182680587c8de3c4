"""Every monkey-patch the adapter still applies to vLLM 0.33.0, in one registry.

Everything else goes through official hooks: ``vllm.general_plugins`` (plugin.py),
``scheduler_cls`` (scheduler.py), ``SleepModeBackendFactory.register_backend``
(sleep_backend.py), ``additional_config`` (settings), ``num_gpu_blocks_override``
(same block count on both engines) and ``load_format="dummy"`` (a standby that
never loads weights).

Each patch is idempotent (marked on the patched function), applied only by
``plugin.register()`` after the version guard, and has a test in
tests/vllm/test_patches.py.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from . import SLEEP_BACKEND_NAME
from .pools import POOL_TAGS

_MARK = "__frmps_patch__"


@dataclass(frozen=True)
class Patch:
    name: str
    target: str  # "module:Class.attribute"
    why: str
    how: str
    removable_when: str
    make: Callable[[Callable], Callable]  # original -> replacement

    def _owner_attr(self):
        module_name, qual = self.target.split(":")
        owner_name, attr = qual.rsplit(".", 1)
        owner = importlib.import_module(module_name)
        for part in owner_name.split("."):
            owner = getattr(owner, part)
        return owner, attr

    def is_applied(self) -> bool:
        owner, attr = self._owner_attr()
        return getattr(getattr(owner, attr), _MARK, None) == self.name

    def apply(self) -> bool:
        """Apply once; returns True if this call applied it."""
        owner, attr = self._owner_attr()
        original = getattr(owner, attr)
        if getattr(original, _MARK, None) == self.name:
            return False
        replacement = self.make(original)
        setattr(replacement, _MARK, self.name)
        replacement.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(owner, attr, replacement)
        return True

    def revert(self) -> bool:
        """Undo (tests only)."""
        owner, attr = self._owner_attr()
        current = getattr(owner, attr)
        if getattr(current, _MARK, None) != self.name:
            return False
        setattr(owner, attr, current.__wrapped__)
        return True


def _pool_context(original: Callable) -> Callable:
    def _maybe_get_memory_pool_context(self, tag: str):
        if tag in POOL_TAGS and self.vllm_config.model_config.sleep_mode_backend == SLEEP_BACKEND_NAME:
            from .pools import get_controller

            return get_controller().memory_pool_context(tag)
        return original(self, tag)

    _maybe_get_memory_pool_context.__doc__ = original.__doc__
    return _maybe_get_memory_pool_context


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="worker-pool-context",
        target="vllm.v1.worker.gpu_worker:Worker._maybe_get_memory_pool_context",
        why=(
            "A sleep-mode backend controls only suspend/resume/discard; allocation of the tagged pools "
            "still goes to get_mem_allocator_instance(), i.e. CuMemAllocator (gpu_worker.py:396-417), "
            "whose VMM memory has no exportable handle. The weights and kv_cache pools must come from "
            "frmps' exportable pools instead."
        ),
        how=(
            "When model_config.sleep_mode_backend == 'frmps' and the tag is 'weights' or 'kv_cache', "
            "return the frmps PoolController's allocation context; every other case calls the original."
        ),
        removable_when=(
            "vLLM lets a SleepModeBackend provide the memory-pool context for a tag (the RFC #34303 "
            "backend interface grows an allocation hook), or CuMemAllocator can create exportable handles."
        ),
        make=_pool_context,
    ),
)


def apply_all() -> list[str]:
    """Apply every patch (idempotent); returns the names applied by this call."""
    return [p.name for p in PATCHES if p.apply()]
