"""Placing vLLM's weights and KV cache in frmps' shared pools: the allocation
contexts installed with ``pools.set_context_factory``.

Route (CUDA, the only one vLLM 0.33.0 can run frmps on): one
``torch.cuda.MemPool`` per pool tag whose allocator is the interceptor's
``frmps_malloc``/``frmps_free`` (a ``CUDAPluggableAllocator`` over the same
``libfrmps_vmm.so`` instance that created the pools for the SDK's cuda-vmm
backend: the active's exportable pools, or the standby's scratch-backed
reservations). Entering the context for tag T

1. opens the interceptor's allocation region T (``frmps_alloc_begin``), so
   ``frmps_malloc`` carves from the pool tagged T, first fit in call order:
   an engine that builds the same model in the same order gets the same
   offsets, which is what makes a standby's tensors views of the active's
   memory once the brokered handles are mapped at its reserved addresses;
2. routes this thread's torch allocations to T's MemPool (``use_mem_pool``).

A segment that does not fit makes ``frmps_malloc`` return NULL (and say why on
stderr); torch raises ``OutOfMemoryError``, which the context turns into
``PoolFull`` naming the pool. Outside the contexts no region is open and the
MemPools are not in use: torch's default allocator serves everything.

On leaving, the context checks that the MemPool's segments all lie inside the
pool and that the phase left tensors in it (an empty phase means the
allocations went elsewhere), and records those bytes on the controller.

``TorchPools`` is the seam to torch's allocator: ``CudaMemPools`` is the real
one; the CPU tests use a labelled test double (tests/vllm/test_allocation.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from typing import Any, ContextManager, Iterator, Protocol

from ..sdk.memory.base import MemoryError_
from .pools import PlacementError, PoolController, PoolExhausted

log = logging.getLogger(__name__)


class PoolFull(PoolExhausted, MemoryError_):
    """torch could not allocate inside a pool's phase: the pool is full (the
    layout underestimates the model). A MemoryError_, so the SDK runner refuses
    to start with this message."""


class TorchPools(Protocol):
    """What the contexts need from torch's allocator (one MemPool per tag)."""

    oom_errors: tuple[type[BaseException], ...]

    def check(self) -> None:
        """Raise if torch's allocator configuration cannot route into a MemPool."""

    def new_pool(self, library_path: str) -> Any:
        """A pool whose segments come from frmps_malloc/frmps_free of ``library_path``."""

    def use(self, pool: Any) -> ContextManager[None]:
        """Route this thread's allocations to ``pool``."""

    def segments(self, pool: Any) -> list[tuple[int, int]]:
        """(address, bytes) of every segment ``pool`` holds."""

    def allocated(self, pool: Any) -> int:
        """Bytes of ``pool``'s blocks that tensors hold now."""

    def release(self, pool: Any) -> None:
        """Drop ``pool`` (its tensors must be gone)."""


class CudaMemPools:
    """torch's CUDA route: CUDAPluggableAllocator(frmps_malloc, frmps_free) + MemPool."""

    def __init__(self, device: Any):
        import torch

        self._torch = torch
        self.device = torch.device(device)
        self.oom_errors = (torch.OutOfMemoryError,)

    def check(self) -> None:
        # A MemPool with a pluggable allocator does not work with expandable
        # segments (pytorch/pytorch#147851; vLLM's CuMemAllocator switches them
        # off around its pools for the same reason). Read as torch does: the
        # first variable set wins.
        for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
            conf = os.environ.get(name)
            if conf:
                for field in conf.split(","):
                    key, _, value = field.partition(":")
                    if key.strip() == "expandable_segments" and value.strip().lower() in ("true", "1"):
                        raise ValueError(
                            f"{name}={conf}: expandable segments cannot serve the frmps pools' MemPools "
                            "(pytorch/pytorch#147851); unset expandable_segments for --engine vllm"
                        )
                return

    def new_pool(self, library_path: str) -> Any:
        torch = self._torch
        allocator = torch.cuda.memory.CUDAPluggableAllocator(library_path, "frmps_malloc", "frmps_free")
        # The MemPool holds a non-owning pointer to the allocator: keep both for
        # the life of the process (the pools' tensors live that long; the SDK
        # runner ends with os._exit, so no interpreter teardown runs them down).
        return [torch.cuda.MemPool(allocator.allocator()), allocator]

    def use(self, pool: Any) -> ContextManager[None]:
        return self._torch.cuda.use_mem_pool(pool[0], self.device)

    def segments(self, pool: Any) -> list[tuple[int, int]]:
        return [(int(s["address"]), int(s["total_size"])) for s in pool[0].snapshot(include_traces=False)]

    def allocated(self, pool: Any) -> int:
        return sum(int(s["allocated_size"]) for s in pool[0].snapshot(include_traces=False))

    def release(self, pool: Any) -> None:
        # The MemPool first, while its allocator is alive (its teardown calls
        # into the allocator: pytorch/pytorch#145168), then the allocator.
        import gc

        pool[0] = None
        gc.collect()
        pool[1] = None


class Interceptor:
    """The allocation region and allocator entry points of one libfrmps_vmm.so
    instance (loading the same path again gives the same instance: the one
    whose pool table holds the SDK backend's pools)."""

    def __init__(self, path: str | None = None):
        from ..sdk.memory.cuda_vmm import VmmLibrary

        self.vmm = VmmLibrary(path)
        self.path = self.vmm.path
        lib = ctypes.CDLL(self.path)
        lib.frmps_malloc.restype = ctypes.c_void_p
        lib.frmps_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.frmps_free.restype = None
        lib.frmps_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.frmps_last_error.restype = ctypes.c_char_p
        lib.frmps_last_error.argtypes = []
        self._lib = lib

    def begin(self, tag: str) -> None:
        self.vmm.alloc_begin(tag)

    def end(self) -> None:
        self.vmm.alloc_end()

    def probe(self, tag: str, base: int, size: int) -> None:
        """Check that this library instance carves region ``tag`` from
        [base, base+size): allocate one carve-out and give it back at once."""
        self.begin(tag)
        try:
            ptr = self._lib.frmps_malloc(1, 0, None)
            if ptr:
                self._lib.frmps_free(ptr, 1, 0, None)
            else:
                # frmps_last_error is per thread: read it here, on the failing thread.
                why = (self._lib.frmps_last_error() or b"").decode(errors="replace")
        finally:
            self.end()
        if not ptr:
            raise PlacementError(f"{self.path} cannot allocate in its {tag} region: {why or 'frmps_malloc returned NULL'}")
        if not base <= ptr < base + size:
            raise PlacementError(
                f"{self.path} carves its {tag} region at {ptr:#x}, outside the frmps {tag} pool "
                f"[{base:#x}, +{size}): the memory backend created its pools in another copy of the library "
                "(set FRMPS_VMM_LIBRARY to one path for both)"
            )


class PoolContexts:
    """The context factory: ``contexts(controller, tag)`` is the allocation
    context of pool ``tag`` (a fresh, single-use context manager each call;
    one MemPool per tag, kept for the life of the process)."""

    def __init__(self, interceptor: Any, torch_pools: TorchPools):
        self.interceptor = interceptor
        self.torch = torch_pools
        self._pools: dict[str, Any] = {}
        self._active: str | None = None

    def attach(self, controller: PoolController) -> "PoolContexts":
        """Check the route before vLLM starts: torch's configuration, and that
        the interceptor carves each tag inside the controller's pool."""
        self.torch.check()
        for tag in controller.pools:
            self.interceptor.probe(tag, *controller.pool_range(tag))
        return self

    def __call__(self, controller: PoolController, tag: str) -> ContextManager[None]:
        return self._phase(controller, tag)

    def close(self) -> None:
        """Drop the MemPools (tests; every tensor placed through them must be gone)."""
        for pool in self._pools.values():
            self.torch.release(pool)
        self._pools.clear()

    def _pool(self, tag: str) -> Any:
        if tag not in self._pools:
            self._pools[tag] = self.torch.new_pool(self.interceptor.path)
        return self._pools[tag]

    @contextlib.contextmanager
    def _phase(self, controller: PoolController, tag: str) -> Iterator[None]:
        base, size = controller.pool_range(tag)
        if self._active is not None:
            raise PlacementError(f"frmps {tag} phase entered inside the {self._active} phase (regions do not nest)")
        pool = self._pool(tag)
        before = self.torch.allocated(pool)
        self.interceptor.begin(tag)
        self._active = tag
        try:
            with self.torch.use(pool):
                yield
        except self.torch.oom_errors as e:
            held = self.torch.segments(pool)
            raise PoolFull(
                f"frmps {tag} pool is full: torch could not allocate inside it (pool {size} bytes at {base:#x}, "
                f"{sum(n for _, n in held)} bytes in {len(held)} segments taken); the pool layout underestimates "
                f"this model. torch: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            ) from e
        finally:
            self._active = None
            self.interceptor.end()
        held = self.torch.segments(pool)
        outside = [(a, n) for a, n in held if not (base <= a and a + n <= base + size)]
        if outside:
            a, n = outside[0]
            raise PlacementError(
                f"frmps {tag} phase: {len(outside)} segment(s) outside the pool [{base:#x}, +{size}), "
                f"e.g. {n} bytes at {a:#x}: the allocator is not carving from this pool"
            )
        placed = self.torch.allocated(pool) - before
        if placed <= 0:
            raise PlacementError(
                f"frmps {tag} phase placed nothing in the pool: this thread's allocations went to another "
                "allocator (an outer MemPool, or another thread)"
            )
        controller.record_placed(tag, placed)
        taken = sum(n for _, n in held)
        log.info("frmps %s pool: %d bytes placed; %d bytes in %d segments of %d (%.1f%%)",
                 tag, placed, taken, len(held), size, 100.0 * taken / size)


def cuda_contexts(controller: PoolController, library: str | None = None) -> PoolContexts:
    """The contexts for a controller whose pools are CUDA tensors of the SDK's
    cuda-vmm backend (``library``: that backend's libfrmps_vmm.so, default the
    same lookup as the backend's)."""
    devices = {str(controller.pool_device(tag)) for tag in controller.pools}
    if any(not d.startswith("cuda") for d in devices) or len(devices) != 1:
        raise ValueError(
            f"--engine vllm needs its pools on one CUDA device (--device cuda --memory cuda-vmm), got {sorted(devices)}: "
            "vLLM's weights and KV cache are placed in them through torch.cuda.MemPool, which exists only for CUDA, "
            "and vLLM 0.33.0 refuses sleep mode on CPU (config/model.py: is_sleep_mode_available)"
        )
    return PoolContexts(Interceptor(library), CudaMemPools(devices.pop())).attach(controller)
