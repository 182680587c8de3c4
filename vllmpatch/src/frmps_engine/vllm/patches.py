"""Every monkey-patch the adapter still applies to vLLM 0.33.0, in one registry.

Everything else goes through official hooks: ``vllm.general_plugins`` (plugin.py),
``scheduler_cls`` (scheduler.py), ``SleepModeBackendFactory.register_backend``
(sleep_backend.py), ``additional_config`` (settings), ``num_gpu_blocks_override``
(same block count on both engines) and ``load_format="dummy"`` (a standby that
never loads weights).

Each patch is idempotent (marked on the patched function), applied only by
``plugin.register()`` after the version guard, and is tested in
tests/vllm/test_plugin.py (registry and routing) and tests/vllm/test_allocation.py
(placement through vLLM's own code).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from dataclasses import dataclass
from typing import Callable

from . import SLEEP_BACKEND_NAME

_MARK = "__frmps_patch__"
log = logging.getLogger(__name__)


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
        if self.vllm_config.model_config.sleep_mode_backend != SLEEP_BACKEND_NAME:
            return original(self, tag)
        from .pools import get_controller

        if tag == "kv_cache":
            return get_controller().memory_pool_context("kv_cache")
        if tag == "weights":
            # The model itself is placed by the loader patch below; the rest of
            # the runner's load_model (V2: sampler and structured-output state)
            # is mutable and stays private. This only checks the model got there.
            return get_controller().weights_phase()
        return contextlib.nullcontext()  # runtime, workspace: private, nothing offloaded

    _maybe_get_memory_pool_context.__doc__ = original.__doc__
    return _maybe_get_memory_pool_context


def _loader_weights_pool(original: Callable) -> Callable:
    def load_model(self, *args, **kwargs):
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        if vllm_config.model_config.sleep_mode_backend != SLEEP_BACKEND_NAME:
            return original(self, *args, **kwargs)
        from .pools import get_controller

        controller = get_controller()
        with controller.memory_pool_context("weights"):
            model = original(self, *args, **kwargs)
        digest = controller.check_placement(
            "weights", list(model.named_parameters()) + list(model.named_buffers())
        )
        # Equal in the active and the standby when the standby's tensors are
        # views of the active's weights (same model, same allocation order).
        log.info("frmps weights placement digest %s (%s)", digest, type(model).__name__)
        return model

    load_model.__doc__ = original.__doc__
    return load_model


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="worker-pool-context",
        target="vllm.v1.worker.gpu_worker:Worker._maybe_get_memory_pool_context",
        why=(
            "A sleep-mode backend controls only suspend/resume/discard; allocation of the tagged pools "
            "still goes to get_mem_allocator_instance(), i.e. CuMemAllocator (gpu_worker.py:396-417), "
            "whose VMM memory has no exportable handle. The kv_cache pool must come from frmps' "
            "exportable pool instead, and frmps offloads nothing, so no other tag needs CuMemAllocator."
        ),
        how=(
            "When model_config.sleep_mode_backend == 'frmps': 'kv_cache' returns the PoolController's "
            "allocation context (allocation.PoolContexts: the interceptor's region + a MemPool over "
            "frmps_malloc); 'weights' returns PoolController.weights_phase(), which only checks that the "
            "loader patch placed the model; every other tag returns nullcontext() (private memory, and no "
            "CuMemAllocator MemPool around the KV one: nested use_mem_pool contexts routed allocations to "
            "the outer pool in torch releases without the fix for pytorch/pytorch#161193). Every other "
            "backend calls the original."
        ),
        removable_when=(
            "vLLM lets a SleepModeBackend provide the memory-pool context for a tag (the RFC #34303 "
            "backend interface grows an allocation hook), or CuMemAllocator can create exportable handles."
        ),
        make=_pool_context,
    ),
    Patch(
        name="loader-weights-pool",
        target="vllm.model_executor.model_loader.base_loader:BaseModelLoader.load_model",
        why=(
            "vLLM's 'weights' phase is the runner's whole load_model (gpu_worker.py:594-601), and the V2 "
            "runner builds mutable per-request state there after the model (gpu/model_runner.py:435-536: "
            "PenaltiesState.output_bin_counts, StructuredOutputsWorker.grammar_bitmask). In the shared "
            "weights pool that state would be read-only on a standby and shared with the active; only "
            "the model (parameters and buffers) may go there."
        ),
        how=(
            "When vllm_config.model_config.sleep_mode_backend == 'frmps': run the original (model "
            "creation, weight loading, post-processing: base_loader.py:62-116) inside the PoolController's "
            "'weights' allocation context, then check that every parameter and buffer on the pool's "
            "device lies in the weights pool and log a placement digest. Otherwise call the original. "
            "Loaders that override load_model (tensorizer, modelexpress) bypass it, and the worker's "
            "weights phase then refuses to start."
        ),
        removable_when=(
            "vLLM scopes the 'weights' memory-pool tag to the model loader (or gives model state its own "
            "tag), so that the worker-level context places exactly the model."
        ),
        make=_loader_weights_pool,
    ),
)


def apply_all() -> list[str]:
    """Apply every patch (idempotent); returns the names applied by this call."""
    return [p.name for p in PATCHES if p.apply()]
