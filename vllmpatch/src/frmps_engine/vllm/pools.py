"""The shared ``weights`` and ``kv_cache`` pools of a vLLM engine (plain logic).

vLLM's own cumem allocator creates its VMM memory with no exportable handle
type (vllm/cumem_allocator.abi3.so imports cuMemCreate/cuMemMap/... but not
cuMemExportToShareableHandle), so these two pools are allocated by frmps
through the SDK's ``MemoryBackend`` (cuda-vmm on GPU) and vLLM's tensors are
placed in them by the allocation contexts of ``allocation.py`` (installed with
``set_context_factory``), entered where patches.py hooks vLLM.

``PoolController`` is the one per-process owner of that memory. vLLM builds
its sleep-mode backend with no arguments (gpu_worker.py:252-262), so the
backend finds the controller through ``get_controller()``; with the
in-process executor (TP=1, what frmps runs) the worker lives in the engine
process that installed it.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

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


# torch's CUDA caching allocator asks its allocator (here: the interceptor's
# frmps_malloc, through a MemPool) for whole segments, not for tensor sizes
# (c10/cuda/CUDACachingAllocator.cpp: kSmallSize, kSmallBuffer, kMinLargeAlloc,
# kLargeBuffer, kRoundLarge): requests up to 1 MiB are packed into 2 MiB
# segments, requests under 10 MiB into 20 MiB segments, larger ones get a
# segment rounded up to 2 MiB. The pools must hold segments, not tensors.
TORCH_SMALL_SIZE = 1 << 20
TORCH_SMALL_SEGMENT = 2 << 20
TORCH_MIN_LARGE_ALLOC = 10 << 20
TORCH_LARGE_SEGMENT = 20 << 20
TORCH_ROUND_LARGE = 2 << 20


def torch_segment_bytes(nbytes: int) -> int:
    """The segment torch's caching allocator requests for a fresh ``nbytes`` allocation."""
    if nbytes < 1:
        raise ValueError(f"allocation size must be >= 1, got {nbytes}")
    if nbytes <= TORCH_SMALL_SIZE:
        return TORCH_SMALL_SEGMENT
    if nbytes < TORCH_MIN_LARGE_ALLOC:
        return TORCH_LARGE_SEGMENT
    return round_up(nbytes, TORCH_ROUND_LARGE)


def torch_segments_bytes(sizes: Iterable[int], max_split: int = TORCH_LARGE_SEGMENT) -> int:
    """Bytes of the segments torch's caching allocator requests for allocations
    of ``sizes``, made in this order and kept (c10/cuda/CUDACachingAllocator.cpp:
    blocks rounded to 512 bytes; best fit among the cached free blocks of the
    small (<= 1 MiB) or large pool, never a block of ``max_split`` or more for a
    smaller request; else a new ``torch_segment_bytes`` segment; a block is split
    when the rest is >= 512 bytes (small pool) or the request is under
    ``max_split`` and the rest over 1 MiB (large pool)). vLLM loads the model
    with max_split_size 20 MiB (gpu_worker.py:594-601)."""
    free: dict[bool, list[int]] = {True: [], False: []}  # small pool?, sorted free block sizes
    total = 0
    for n in sizes:
        n = round_up(max(int(n), 1), 512)
        small = n <= TORCH_SMALL_SIZE
        blocks = free[small]
        block = next((b for b in blocks if b >= n and not (n < max_split <= b)
                      and not (n >= max_split and b >= n + TORCH_LARGE_SEGMENT)), None)
        if block is None:
            block = torch_segment_bytes(n)
            total += block
        else:
            blocks.remove(block)
        rest = block - n
        if (small and rest >= 512) or (not small and n < max_split and rest > TORCH_SMALL_SIZE):
            bisect.insort(blocks, rest)
    return total


def pool_layout(weight_bytes: int, kv_bytes: int | Sequence[int]) -> list[PoolSpec]:
    """The pool layout both engines derive (deterministic from model + block count).

    ``weight_bytes`` is the weights pool's size (the caller's estimate of what
    the model loader allocates, segments included); ``kv_bytes`` is vLLM's KV
    backing allocation (one int), or its allocations in order (vLLM 0.26: one
    per layer; ``compat``), which the pool holds as the segments torch
    requests for them (no max split outside the model loader)."""
    kv_allocs = [int(kv_bytes)] if isinstance(kv_bytes, int) else [int(n) for n in kv_bytes]
    if weight_bytes < 1 or not kv_allocs or min(kv_allocs) < 1:
        raise ValueError(f"pool sizes must be positive: weights {weight_bytes}, kv_cache {kv_bytes}")
    return [
        PoolSpec("weights", 0, round_up(weight_bytes, ALIGN)),
        PoolSpec("kv_cache", 0, round_up(torch_segments_bytes(kv_allocs, max_split=1 << 62), ALIGN)),
    ]


class PoolExhausted(MemoryError):
    """An allocation inside a pool's phase did not fit in the pool."""


class PlacementError(RuntimeError):
    """vLLM put a tensor that must live in a shared pool somewhere else (or nothing in the pool)."""


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
        self.placed: dict[str, int] = {}  # bytes of torch segments placed in each pool so far
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

    # -- placement --------------------------------------------------------------
    def pool_range(self, tag: str) -> tuple[int, int]:
        """(address, size) of pool ``tag`` in this process."""
        pool = self.pools.get(tag)
        if pool is None:
            raise KeyError(f"no pool {tag!r} (state {self.state})")
        address = int(getattr(pool, "address", 0) or pool.tensor.data_ptr())
        return address, int(pool.spec.size)

    def pool_device(self, tag: str) -> Any:
        return self.pools[tag].tensor.device

    def record_placed(self, tag: str, nbytes: int) -> None:
        """Called by the allocation context when a phase of ``tag`` ended with ``nbytes`` in the pool."""
        with self._lock:
            self.placed[tag] = self.placed.get(tag, 0) + int(nbytes)

    def memory_pool_context(self, tag: str) -> Any:
        """The allocation context for ``tag``: inside it, this thread's device
        allocations land in the pool (entered where patches.py hooks vLLM)."""
        if tag not in self.pools:
            raise KeyError(f"no pool {tag!r} (state {self.state})")
        if _context_factory is None:
            raise RuntimeError(
                f"no allocation context is installed for the frmps {tag} pool: frmps_engine.vllm.engine's "
                "create_core installs one (allocation.PoolContexts) before vLLM loads the model"
            )
        return _context_factory(self, tag)

    @contextlib.contextmanager
    def weights_phase(self) -> Iterator[None]:
        """The worker's ``weights`` phase (vLLM's whole ``load_model``).

        Only the model loader's part of it goes to the weights pool (patches.py:
        the V2 model runner also builds mutable sampler state in this phase,
        which must stay private); this phase only checks that the loader did
        place the model there."""
        before = self.placed.get("weights", 0)
        yield
        if self.placed.get("weights", 0) == before:
            raise PlacementError(
                "vLLM's weights phase ended without placing anything in the frmps weights pool: the model was "
                "not built through BaseModelLoader.load_model (patches.py, loader-weights-pool), so its weights "
                "would not be shared; use load_format auto or dummy"
            )

    @contextlib.contextmanager
    def kv_phase(self) -> Iterator[None]:
        """The worker's ``kv_cache`` phase where it covers more than the KV
        allocation (vLLM 0.26: the runner's whole ``initialize_kv_cache``, block
        tables and attention metadata included, which are mutable and stay
        private). It arms the allocation-level patches (``armed_kv_controller``),
        which place only the KV tensors in the pool, and checks that they did."""
        global _armed_kv
        before = self.placed.get("kv_cache", 0)
        if _armed_kv is not None:
            raise PlacementError("frmps kv_cache phase entered twice")
        _armed_kv = self
        try:
            yield
        finally:
            _armed_kv = None
        if self.placed.get("kv_cache", 0) == before:
            raise PlacementError(
                "vLLM's kv_cache phase ended without placing the KV cache in the frmps kv_cache pool: the model "
                "runner did not allocate it through the patched allocation function (patches.py, kv_allocation)"
            )

    def check_placement(self, tag: str, named_tensors: Iterable[tuple[str, Any]]) -> str:
        """Every tensor on the pool's device must lie inside pool ``tag``;
        returns a digest of (name, offset, bytes), equal in two engines that
        placed the same model at the same offsets. Raises PlacementError naming
        the tensors outside."""
        base, size = self.pool_range(tag)
        device = self.pool_device(tag)
        placed: list[str] = []
        outside: list[str] = []
        for name, t in named_tensors:
            if t.device != device or t.numel() == 0:
                continue  # host-side buffers and meta placeholders stay private
            st = t.untyped_storage()
            ptr, n = int(st.data_ptr()), int(st.nbytes())
            if base <= ptr and ptr + n <= base + size:
                placed.append(f"{name}:{int(t.data_ptr()) - base}:{n}")
            else:
                outside.append(f"{name} ({n} bytes at {ptr:#x})")
        if outside:
            more = f" and {len(outside) - 5} more" if len(outside) > 5 else ""
            raise PlacementError(
                f"{len(outside)} tensor(s) outside the frmps {tag} pool [{base:#x}, +{size}): "
                f"{', '.join(outside[:5])}{more}"
            )
        if not placed:
            raise PlacementError(f"no tensor of the frmps {tag} pool's device {device} to check")
        return hashlib.sha256("\n".join(sorted(placed)).encode()).hexdigest()[:16]


@dataclass
class _ExternalPool:
    spec: PoolSpec
    tensor: Any
    fd: int = -1


_controller: PoolController | None = None
_armed_kv: PoolController | None = None
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


def armed_kv_controller() -> PoolController | None:
    """The controller whose kv_cache phase is open (``PoolController.kv_phase``), else None."""
    return _armed_kv


def set_context_factory(factory: Callable[[PoolController, str], Any] | None) -> None:
    """Install how a pool becomes a torch allocation context: ``factory(controller,
    tag)`` returns a context manager (allocation.PoolContexts: a torch.cuda.MemPool
    over the interceptor's frmps_malloc, carving from the pool tagged ``tag``)."""
    global _context_factory
    _context_factory = factory
