"""Helpers for the allocation-context tests on a machine without a GPU.

The pools are the real interceptor library (``libfrmps_vmm.so``) bound to its
fake driver (``interceptor/tests/fake_libcuda.c``, a TEST DOUBLE: "device"
memory is host memory, handles are memfds, read-only is mprotect), created by
the SDK's real ``CudaVmmBackend``; so region tags, first-fit carve-outs,
standby scratch reservations and the in-place swap to the brokered handles
are the production code.

``HostMemPools`` is a TEST DOUBLE for torch's CUDA MemPool route
(``CUDAPluggableAllocator`` + ``torch.cuda.MemPool`` + ``use_mem_pool``), which
needs a GPU: inside ``use(pool)`` a dispatch mode (thread-local, like
``use_mem_pool``) moves every tensor that an op allocates into a segment from
the library's ``frmps_malloc``, looked up by name as CUDAPluggableAllocator
does. Its limits, against torch: one segment per tensor (sized by torch's
segment rule, never packed: more pool use than torch, not less), blocks are
never freed nor reused, segments are freed only by ``release`` (torch keeps a
MemPool's segments cached too), and only what goes through the dispatcher is
seen (op outputs, factories).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[3]
INTERCEPTOR = REPO / "interceptor"
MiB = 1 << 20


def build_interceptor(tmpdir: Path, copies: tuple[str, ...]) -> dict[str, str] | None:
    """Build the library and the fake driver; return one private copy of the
    library per name, each bound to the fake driver (a library instance reads
    FRMPS_LIBCUDA once, at first use; separate files are separate instances,
    i.e. separate processes as far as pools are concerned). None without a C
    toolchain."""
    if not shutil.which(os.environ.get("CC", "cc")) or not shutil.which("make"):
        return None
    r = subprocess.run(["make", "-s", "-C", str(INTERCEPTOR), "all", "build/libcuda_fake.so"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    from frmps_engine.sdk.memory.cuda_vmm import VmmLibrary

    fake = str(INTERCEPTOR / "build" / "libcuda_fake.so")
    out: dict[str, str] = {}
    old = os.environ.get("FRMPS_LIBCUDA")
    os.environ["FRMPS_LIBCUDA"] = fake
    try:
        for name in copies:
            path = tmpdir / f"{name}-libfrmps_vmm.so"
            shutil.copy(INTERCEPTOR / "build" / "libfrmps_vmm.so", path)
            VmmLibrary(str(path)).granularity(0)  # binds this instance to the fake driver
            out[name] = str(path)
    finally:
        if old is None:
            del os.environ["FRMPS_LIBCUDA"]
        else:
            os.environ["FRMPS_LIBCUDA"] = old
    return out


def torch_view(address: int, size: int, device: int):
    """Tensor factory for CudaVmmBackend on the fake driver: a uint8 CPU tensor over the host mapping."""
    import torch

    return torch.frombuffer((ctypes.c_ubyte * size).from_address(address), dtype=torch.uint8)


def vmm_backend(lib: str):
    from frmps_engine.sdk.memory.cuda_vmm import CudaVmmBackend

    return CudaVmmBackend("cuda:0", library=lib, tensor_factory=torch_view)


def storage_range(t) -> tuple[int, int]:
    st = t.untyped_storage()
    return int(st.data_ptr()), int(st.nbytes())


def inside(t, pool_tensor) -> bool:
    base, size = int(pool_tensor.data_ptr()), int(pool_tensor.numel())
    p, n = storage_range(t)
    return base <= p and p + n <= base + size


SMALL_BLOCK = 1 << 20  # torch's CUDA caching allocator: blocks up to 1 MiB ...
SMALL_SEGMENT = 2 << 20  # ... share segments of 2 MiB
# Whether the double packs small blocks as torch does (test_weights_load: vLLM 0.26
# makes scalar tensors per attention layer while it loads weights). Off, every
# tensor takes a segment of its own, which test_allocation's pool-full checks count on.
PACK_SMALL = False


@dataclass
class DoublePool:
    """TEST DOUBLE for a torch.cuda.MemPool over a pluggable allocator."""

    lib: ctypes.CDLL
    segments: list[tuple[int, int]] = field(default_factory=list)
    buffers: list[object] = field(default_factory=list)
    allocated: int = 0  # bytes handed to tensors (blocks are 512-byte multiples, as in torch)

    _small: list | None = None  # [segment address, bytes used] of the small blocks' segment

    def _segment(self, seg: int) -> int:
        import torch

        ptr = self.lib.frmps_malloc(seg, 0, None)
        if not ptr:
            raise torch.OutOfMemoryError(f"TEST DOUBLE: frmps_malloc returned NULL for a {seg}-byte segment")
        self.segments.append((int(ptr), seg))
        return int(ptr)

    def place(self, t):
        import torch

        from frmps_engine.vllm.pools import torch_segment_bytes

        nbytes = int(t.untyped_storage().nbytes())
        if nbytes == 0:
            return t
        rounded = -(-nbytes // 512) * 512
        if PACK_SMALL and rounded <= SMALL_BLOCK:
            # As torch's caching allocator does: blocks of up to 1 MiB share 2 MiB
            # segments (vLLM 0.26 makes a few scalar tensors per attention layer
            # while it loads weights; a segment each would overstate the pool).
            if self._small is None or self._small[1] + rounded > SMALL_SEGMENT:
                self._small = [self._segment(SMALL_SEGMENT), 0]
            ptr = self._small[0] + self._small[1]
            self._small[1] += rounded
        else:
            ptr = self._segment(torch_segment_bytes(nbytes))
        self.allocated += rounded
        buf = (ctypes.c_ubyte * nbytes).from_address(ptr)
        self.buffers.append(buf)
        storage = torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()
        moved = torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.size(), t.stride())
        moved.copy_(t)
        return moved

    def release(self) -> None:
        for ptr, seg in self.segments:
            self.lib.frmps_free(ptr, seg, 0, None)
        self.segments.clear()
        self.buffers.clear()
        self.allocated = 0


class HostMemPools:
    """TEST DOUBLE for allocation.CudaMemPools (see the module docstring)."""

    def __init__(self):
        import torch

        self.oom_errors = (torch.OutOfMemoryError,)
        self.pools: list[DoublePool] = []
        self.checked = 0
        self.released = 0

    def check(self) -> None:
        self.checked += 1

    def new_pool(self, library_path: str) -> DoublePool:
        lib = ctypes.CDLL(library_path)
        lib.frmps_malloc.restype = ctypes.c_void_p
        lib.frmps_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.frmps_free.restype = None
        lib.frmps_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        pool = DoublePool(lib)
        self.pools.append(pool)
        return pool

    @contextlib.contextmanager
    def use(self, pool: DoublePool) -> Iterator[None]:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten, tree_map

        class Route(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                inputs = {
                    int(a.untyped_storage().data_ptr())
                    for a in tree_flatten((args, kwargs))[0]
                    if isinstance(a, torch.Tensor)
                }

                def fresh(t):
                    # Meta tensors (vLLM 0.33 records each layer's parameters as meta
                    # tensors while it builds the model) hold no memory: torch's MemPool
                    # never sees them either.
                    if (isinstance(t, torch.Tensor) and t.device.type != "meta"
                            and int(t.untyped_storage().data_ptr()) not in inputs):
                        return pool.place(t)
                    return t

                return tree_map(fresh, out)

        with Route():
            yield

    def segments(self, pool: DoublePool) -> list[tuple[int, int]]:
        return list(pool.segments)

    def allocated(self, pool: DoublePool) -> int:
        return pool.allocated

    def release(self, pool: DoublePool) -> None:
        pool.release()
        self.released += 1
