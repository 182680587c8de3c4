"""The shared ``weights`` and ``kv_cache`` pools of a vLLM engine (plain logic).

vLLM's own cumem allocator creates its VMM memory with no exportable handle
type (vllm/cumem_allocator.abi3.so imports cuMemCreate/cuMemMap/... but not
cuMemExportToShareableHandle), so these two pools are allocated by frmps
through the SDK's ``MemoryBackend`` (host-shm on CPU, cuda-vmm on GPU) and
handed to vLLM through the worker's memory-pool context (see patches.py).

``PoolController`` is the one per-process owner of that memory. vLLM builds
its sleep-mode backend with no arguments (gpu_worker.py:252-262), so the
backend finds the controller through ``get_controller()``; with the
in-process executor (TP=1, what frmps runs) the worker lives in the engine
process that installed it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

POOL_TAGS = ("weights", "kv_cache")
ALIGN = 2 << 20  # pools are whole 2 MiB pages: the VMM granularity on NVIDIA GPUs


def round_up(n: int, align: int) -> int:
    return -(-int(n) // align) * align


@dataclass(frozen=True)
class PoolSpec:
    tag: str
    index: int
    size: int


def kv_cache_bytes(*, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype_bytes: int) -> int:
    """Bytes of vLLM's single KV backing allocation for a full-attention model:
    K and V pages of every layer for every block (vllm/v1/worker/utils.py:564-596
    allocates ``KVCacheTensor.size`` bytes in one ``torch.zeros``)."""
    for name, v in (("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size),
                    ("num_kv_heads", num_kv_heads), ("head_size", head_size), ("dtype_bytes", dtype_bytes)):
        if int(v) < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    page = 2 * block_size * num_kv_heads * head_size * dtype_bytes
    return num_layers * num_blocks * page


def pool_layout(weight_bytes: int, kv_bytes: int) -> list[PoolSpec]:
    """The pool layout both engines derive (deterministic from model + block count)."""
    if weight_bytes < 1 or kv_bytes < 1:
        raise ValueError(f"pool sizes must be positive: weights {weight_bytes}, kv_cache {kv_bytes}")
    return [PoolSpec("weights", 0, round_up(weight_bytes, ALIGN)), PoolSpec("kv_cache", 0, round_up(kv_bytes, ALIGN))]


class PoolExhausted(MemoryError):
    pass


class BumpAllocator:
    """Hands out aligned offsets in one pool, in call order.

    Both engines build the same model in the same order, so the same tensor
    lands at the same offset in each; that is what makes the standby's tensors
    views of the active's memory. Nothing is freed individually: weights and
    the KV cache live as long as the engine.
    """

    def __init__(self, tag: str, size: int, align: int = 512):
        if size < 0 or align < 1 or align & (align - 1):
            raise ValueError(f"bad pool {tag}: size {size}, align {align}")
        self.tag, self.size, self.align = tag, int(size), int(align)
        self.used = 0
        self.allocations: list[tuple[int, int]] = []

    def alloc(self, nbytes: int) -> int:
        if nbytes < 0:
            raise ValueError(f"negative allocation {nbytes} in pool {self.tag}")
        off = round_up(self.used, self.align)
        if off + nbytes > self.size:
            raise PoolExhausted(
                f"pool {self.tag}: {nbytes} bytes requested at offset {off}, pool is {self.size} bytes "
                f"({self.size - off if off < self.size else 0} left); the pool layout underestimates this model"
            )
        self.used = off + nbytes
        self.allocations.append((off, nbytes))
        return off


class PoolController:
    """Owns the engine's shared pools and their sleep/wake transitions.

    role "active": ``allocate()`` creates fresh pools; it never sleeps.
    role "standby": ``reserve()`` gives private placeholder memory at fixed
    addresses (vLLM may write it freely while it initialises: ``torch.zeros``
    of the KV cache, dummy weights, warm-up steps on blocks 1..N);
    ``provide_brokered(fds)`` then ``suspend()`` maps the active's memory in
    place, read-only; ``resume(["kv_cache"])`` makes the KV pool writable.
    """

    def __init__(self, backend: Any, specs: Sequence[Any], role: str):
        if role not in ("active", "standby"):
            raise ValueError(f"role must be active or standby, got {role!r}")
        tags = [(s.tag, s.index) for s in specs]
        if sorted(t for t, _ in tags) != sorted(POOL_TAGS) or len(set(tags)) != len(tags):
            raise ValueError(f"vLLM pools must be exactly one weights and one kv_cache pool, got {tags}")
        self.backend, self.specs, self.role = backend, list(specs), role
        self.pools: dict[str, Any] = {}
        self.allocators: dict[str, BumpAllocator] = {}
        self.state = "EMPTY"  # EMPTY -> READY (allocated/reserved) -> SHARED (standby mapped) -> AWAKE
        self._fds: list[int] | None = None
        self._lock = threading.Lock()

    @classmethod
    def external(cls, tensors: dict, role: str) -> "PoolController":
        """Wrap pools the SDK runner already owns ((tag, index) -> uint8 tensor).

        The runner then does the mapping itself (Sleep: map the brokered fds in
        place; Resume: make the KV pool writable), so suspend/resume here only
        record the state.
        """
        specs = [PoolSpec(tag, idx, int(t.numel())) for (tag, idx), t in sorted(tensors.items())]
        c = cls(None, specs, role)
        c._install([_ExternalPool(s, tensors[(s.tag, s.index)]) for s in specs])
        c.state = "EXTERNAL"
        return c

    def _install(self, pools: Sequence[Any]) -> None:
        self.pools = {p.spec.tag: p for p in pools}
        self.allocators = {p.spec.tag: BumpAllocator(p.spec.tag, p.spec.size) for p in pools}

    def setup(self) -> list[Any]:
        """Allocate (active) or reserve (standby) the pools; returns the backend's Pool list."""
        with self._lock:
            if self.state != "EMPTY":
                raise RuntimeError(f"pools already set up (state {self.state})")
            pools = self.backend.allocate(self.specs) if self.role == "active" else self.backend.reserve(self.specs)
            self._install(pools)
            self.state = "READY"
            return pools

    def fds(self) -> list[int]:
        """The active's exportable handles, in layout order (for PoolExport)."""
        if self.role != "active" or self.state == "EMPTY":
            raise RuntimeError("only an active engine with allocated pools exports fds")
        return [self.pools[s.tag].fd for s in self.specs]

    def tensor(self, tag: str) -> Any:
        if tag not in self.pools:
            raise KeyError(f"no pool {tag!r} (state {self.state})")
        return self.pools[tag].tensor

    def provide_brokered(self, fds: Sequence[int]) -> None:
        """The fds the supervisor sent with Sleep (ownership passes to the backend on map)."""
        if self.role != "standby":
            raise RuntimeError("only a standby maps brokered pools")
        if len(fds) != len(self.specs):
            raise ValueError(f"got {len(fds)} fds for {len(self.specs)} pools")
        self._fds = list(fds)

    def suspend(self, level: int = 1) -> None:
        with self._lock:
            if self.state == "EXTERNAL" and self.role == "standby":
                return
            if self.role == "active":
                raise RuntimeError("the active engine's pools are shared with the standby; it never sleeps")
            if self.state == "SHARED":
                return  # vLLM may ask twice; the mapping is already in place
            if self.state != "READY" or self._fds is None:
                raise RuntimeError(f"cannot sleep: pools not reserved or no brokered fds (state {self.state})")
            pools = self.backend.map(self.specs, self._fds, readonly=True)
            self._fds = None
            self._install(pools)
            self.state = "SHARED"

    def resume(self, tags: list[str] | None = None) -> None:
        with self._lock:
            if self.role == "active" or self.state == "EXTERNAL":
                return  # never slept, or the runner flips the mappings
            if self.state == "AWAKE":
                return
            if self.state != "SHARED":
                raise RuntimeError(f"cannot wake: the brokered pools are not mapped (state {self.state})")
            if tags is None or "kv_cache" in tags:
                # Weights stay read-only for the life of the process: a standby
                # that took over still must not write them.
                self.backend.make_writable("kv_cache")
                self.state = "AWAKE"

    def memory_pool_context(self, tag: str) -> Any:
        """The allocation context vLLM's worker enters for ``tag`` (patches.py)."""
        if tag not in self.allocators:
            raise KeyError(f"no pool {tag!r} (state {self.state})")
        if _context_factory is None:
            raise RuntimeError(
                f"no device allocator is wired for the frmps {tag} pool: on CUDA the interceptor's "
                "pluggable allocator must be installed with set_context_factory() before vLLM loads the model"
            )
        return _context_factory(self, tag)


@dataclass
class _ExternalPool:
    spec: PoolSpec
    tensor: Any
    fd: int = -1


_controller: PoolController | None = None
_context_factory: Callable[[PoolController, str], Any] | None = None


def install_controller(controller: PoolController | None) -> None:
    global _controller
    _controller = controller


def get_controller() -> PoolController:
    if _controller is None:
        raise RuntimeError(
            "frmps sleep-mode backend selected but no frmps pool controller is installed in this process; "
            "start vLLM through `python -m frmps_engine.cli serve --engine vllm`"
        )
    return _controller


def set_context_factory(factory: Callable[[PoolController, str], Any] | None) -> None:
    """Install how a pool becomes a torch allocation context on this device
    (CUDA: a ``torch.cuda.MemPool`` over the interceptor's pluggable allocator
    that sub-allocates with ``controller.allocators[tag]``)."""
    global _context_factory
    _context_factory = factory
