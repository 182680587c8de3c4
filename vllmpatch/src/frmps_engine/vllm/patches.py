"""The adapter's monkey-patches: the Patch record and the patch builders.

Each supported vLLM version declares its registry (``compat/v0_26.py``,
``compat/v0_33.py``: which targets, why, how, when removable) from the
builders here. Everything else goes through official hooks:
``vllm.general_plugins`` (plugin.py), ``scheduler_cls`` (scheduler.py),
``SleepModeBackendFactory.register_backend`` (sleep_backend.py),
``additional_config`` (settings), ``num_gpu_blocks_override`` (same block count
on both engines) and ``load_format="dummy"`` (a standby that never loads
weights).

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

from ..sdk import memphase

from . import SLEEP_BACKEND_NAME

_MARK = "__frmps_patch__"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Patch:
    name: str
    target: str  # "module:Class.attribute" or "module:function"
    why: str
    how: str
    removable_when: str
    make: Callable[[Callable], Callable]  # original -> replacement

    def _owner_attr(self):
        module_name, qual = self.target.split(":")
        owner = importlib.import_module(module_name)
        *path, attr = qual.split(".")
        for part in path:
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


def worker_pool_context(places_kv: bool) -> Callable[[Callable], Callable]:
    """Builder of the ``worker-pool-context`` patch. ``places_kv``: the worker's
    ``kv_cache`` tag covers exactly the KV allocation (it then places it in the
    pool); otherwise it only arms the allocation-level patches
    (``kv_allocation``) and checks that they placed the cache."""

    def make(original: Callable) -> Callable:
        def _maybe_get_memory_pool_context(self, tag: str):
            if self.vllm_config.model_config.sleep_mode_backend != SLEEP_BACKEND_NAME:
                return original(self, tag)
            from .pools import get_controller

            if tag == "kv_cache":
                controller = get_controller()
                return controller.memory_pool_context("kv_cache") if places_kv else controller.kv_phase()
            if tag == "weights":
                # The model itself is placed by the loader patch; the rest of the
                # runner's load_model (V2: sampler and structured-output state) is
                # mutable and stays private. This only checks the model got there.
                return get_controller().weights_phase()
            return contextlib.nullcontext()  # runtime, workspace: private, nothing offloaded

        _maybe_get_memory_pool_context.__doc__ = original.__doc__
        return _maybe_get_memory_pool_context

    return make


def kv_allocation(original: Callable) -> Callable:
    """Builder of the allocation-level KV patches: while the worker's kv_cache
    phase is armed (``PoolController.kv_phase``), the wrapped function's device
    allocations go to the kv_cache pool; it returns {layer name: tensor}, whose
    placement is checked and logged as a digest (equal in both engines)."""

    def allocate(*args, **kwargs):
        from .pools import armed_kv_controller

        controller = armed_kv_controller()
        if controller is None:
            return original(*args, **kwargs)
        with controller.memory_pool_context("kv_cache"):
            tensors = original(*args, **kwargs)
        digest = controller.check_placement("kv_cache", sorted(tensors.items()))
        log.info("frmps kv_cache placement digest %s (%d layers)", digest, len(tensors))
        memphase.note("KV cache placed")
        return tensors

    allocate.__doc__ = original.__doc__
    return allocate


def _weights_step(loader) -> Callable | None:
    """The loader's ``load_weights`` as this process runs it, or None to leave it be.

    With FRMPS_DEBUG_MEMORY_PHASES the model's construction and its weights'
    initialisation get a memory line each ("model constructed", "weights
    initialised"), so that memory the phase adds shows on one side of the two."""
    if not memphase.enabled():
        return None
    real = loader.load_weights

    def load_weights(model, model_config):
        memphase.note("model constructed")
        real(model, model_config)
        memphase.note("weights initialised")

    return load_weights


def loader_weights_pool(original: Callable) -> Callable:
    def load_model(self, *args, **kwargs):
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        if vllm_config.model_config.sleep_mode_backend != SLEEP_BACKEND_NAME:
            return original(self, *args, **kwargs)
        from .pools import get_controller

        controller = get_controller()
        step = _weights_step(self)
        if step is not None:
            self.load_weights = step  # this call only: the instance attribute goes below
        try:
            with controller.memory_pool_context("weights"):
                model = original(self, *args, **kwargs)
        finally:
            if step is not None:
                del self.load_weights
        digest = controller.check_placement(
            "weights", list(model.named_parameters()) + list(model.named_buffers())
        )
        # Equal in the active and the standby when the standby's tensors are
        # views of the active's weights (same model, same allocation order).
        log.info("frmps weights placement digest %s (%s)", digest, type(model).__name__)
        memphase.note("weights placed")
        return model

    load_model.__doc__ = original.__doc__
    return load_model


def tp_worker_pools(original: Callable) -> Callable:
    """Builder of the ``tp-worker-pools`` patch (tensor parallelism, tp.py):
    after vLLM's ``Worker.init_device``, a worker of a frmps tensor-parallel engine
    builds its rank's pools; in every other process ``worker_setup`` does nothing."""

    def init_device(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        from .tp import worker_setup

        worker_setup(self)
        return out

    init_device.__doc__ = original.__doc__
    return init_device


_TP_WORKER_POOLS_WHY = (
    "With tensor parallelism vLLM's MultiprocExecutor builds each rank in a worker process of its own, which "
    "loads the rank's shard in WorkerProc.__init__ right after init_device (v1/executor/multiproc_executor.py), "
    "before frmps's rank 0 can reach it: the rank's frmps pools must exist in that process by then."
)
_TP_WORKER_POOLS_HOW = (
    "Call the original, then tp.worker_setup(worker): only where FRMPS_VLLM_TP_POOLS is set (a worker of a frmps "
    "tensor-parallel engine), allocate (active) or reserve (standby) the rank's pools on its GPU and install its "
    "PoolController and allocation contexts, so that the other patches place the rank's shard and KV cache."
)
_TP_WORKER_POOLS_REMOVABLE = "vLLM lets a plugin provide a worker's memory pools before its model load."


# The same in every supported version (Worker.init_device, then WorkerProc's load_model).
TP_WORKER_POOLS = Patch(
    name="tp-worker-pools",
    target="vllm.v1.worker.gpu_worker:Worker.init_device",
    why=_TP_WORKER_POOLS_WHY,
    how=_TP_WORKER_POOLS_HOW,
    removable_when=_TP_WORKER_POOLS_REMOVABLE,
    make=tp_worker_pools,
)


def patches() -> tuple[Patch, ...]:
    """The installed vLLM version's patch registry."""
    from .compat import current

    return current().PATCHES


def apply_all() -> list[str]:
    """Apply every patch of the installed version (idempotent); returns the names applied by this call."""
    return [p.name for p in patches() if p.apply()]
