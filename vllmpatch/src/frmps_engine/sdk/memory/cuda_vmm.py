"""cuda-vmm: pools as CUDA VMM allocations with POSIX-fd handles, through the
interceptor library ``libfrmps_vmm.so`` (``interceptor/`` in the repository).

Lifecycle (see ``base.MemoryBackend``):

- active: ``allocate(specs)`` creates one VMM pool per spec (read-write) and
  exports its handle as an fd (``Pool.fd``, owned by the backend) for the
  supervisor;
- standby: ``reserve(specs)`` reserves the same sizes and backs each range with
  ONE small private scratch allocation mapped repeatedly, so the engine can be
  built, warmed up and graph-captured without touching the active's memory;
  ``map(specs, fds, readonly=True)`` at sleep unmaps the scratch and maps the
  brokered handles at the SAME addresses (tensors and captured graphs stay
  valid); ``make_writable("kv_cache")`` at wake only flips access (~ms).

Tensors are built over the pools' device addresses through
``__cuda_array_interface__`` (no copy, no allocator involved). Engines that
allocate through torch instead can use ``pluggable_allocator()`` with
``torch.cuda.MemPool`` inside ``allocation_region(tag)``.

Library lookup: ``library=`` argument, else ``$FRMPS_VMM_LIBRARY``, else the
repository's ``interceptor/build/libfrmps_vmm.so``, else ``libfrmps_vmm.so`` on
the loader path. The driver it loads is ``$FRMPS_LIBCUDA`` or ``libcuda.so.1``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pathlib
from typing import Any, Callable, Iterator, Sequence

from .base import MemoryBackend, MemoryError_, Pool, PoolSpec, as_spec, checked_map_args

BACKEND_NAME = "cuda-vmm"
LIBRARY_ENV = "FRMPS_VMM_LIBRARY"
# A standby's pool is backed by one scratch chunk mapped over and over, and every
# mapping is a driver call: 2 MiB chunks over a large model's weights would add
# seconds to every standby's and every restored engine's start, and more again to
# unmap at sleep. The chunk grows with the pool, up to about SCRATCH_MAPPINGS mappings,
# at most MAX_SCRATCH_CHUNK of GPU memory per pool, held only until the sleep.
MIN_SCRATCH_CHUNK = 2 << 20
MAX_SCRATCH_CHUNK = 64 << 20
SCRATCH_MAPPINGS = 256


def scratch_chunk_for(size: int) -> int:
    """The scratch chunk for a pool of size bytes: size / SCRATCH_MAPPINGS rounded
    up to 2 MiB (the driver's granularity on the GPUs frmps knows; the library
    rounds to the device's own), between MIN_ and MAX_SCRATCH_CHUNK."""
    per = -(-max(size, 1) // SCRATCH_MAPPINGS)
    per = -(-per // MIN_SCRATCH_CHUNK) * MIN_SCRATCH_CHUNK
    return max(MIN_SCRATCH_CHUNK, min(MAX_SCRATCH_CHUNK, per))

# frmps_status values (interceptor/include/frmps_vmm.h).
FRMPS_OK = 0
_STATUS_NAMES = {1: "invalid argument", 2: "driver error", 3: "out of memory", 4: "disabled",
                 5: "driver library unavailable", 6: "wrong pool state"}
FRMPS_E_DISABLED = 4
FRMPS_E_NOLIB = 5


class VmmUnavailable(MemoryError_):
    """The backend cannot work here: no interceptor library, no driver, no GPU, or disabled."""


class VmmError(MemoryError_):
    """A libfrmps_vmm call failed; ``status`` is its frmps_status, the message says why."""

    def __init__(self, call: str, status: int, message: str):
        self.call, self.status = call, status
        super().__init__(f"{call}: {message or _STATUS_NAMES.get(status, 'error')} ({_STATUS_NAMES.get(status, status)})")


def default_library_path() -> str:
    env = os.environ.get(LIBRARY_ENV)
    if env:
        return env
    # <repo>/vllmpatch/src/frmps_engine/sdk/memory/cuda_vmm.py -> <repo>/interceptor/build/
    here = pathlib.Path(__file__).resolve()
    if len(here.parents) > 5:
        built = here.parents[5] / "interceptor" / "build" / "libfrmps_vmm.so"
        if built.exists():
            return str(built)
    return "libfrmps_vmm.so"


_p = ctypes.c_void_p
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "frmps_last_error": (ctypes.c_char_p, []),
    "frmps_disabled": (ctypes.c_int, []),
    "frmps_pool_create": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_uint, ctypes.c_size_t, ctypes.c_int, ctypes.POINTER(_p)]),
    "frmps_pool_export_fd": (ctypes.c_int, [_p, ctypes.POINTER(ctypes.c_int)]),
    "frmps_pool_import": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_uint, ctypes.c_int, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.POINTER(_p)]),
    "frmps_pool_reserve_scratch": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_uint, ctypes.c_size_t, ctypes.c_int, ctypes.c_size_t, ctypes.POINTER(_p)]),
    "frmps_pool_swap_to_import": (ctypes.c_int, [_p, ctypes.c_int, ctypes.c_int]),
    "frmps_pool_set_access": (ctypes.c_int, [_p, ctypes.c_int]),
    "frmps_pool_ptr": (ctypes.c_ulonglong, [_p]),
    "frmps_pool_size": (ctypes.c_size_t, [_p]),
    "frmps_pool_used": (ctypes.c_size_t, [_p]),
    "frmps_pool_destroy": (ctypes.c_int, [_p]),
    "frmps_granularity": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)]),
    "frmps_alloc_begin": (ctypes.c_int, [ctypes.c_char_p]),
    "frmps_alloc_end": (None, []),
}


class VmmLibrary:
    """Typed ctypes binding of libfrmps_vmm.so. Pools are opaque handles (ints)."""

    def __init__(self, path: str | None = None):
        self.path = path or default_library_path()
        try:
            lib = ctypes.CDLL(self.path)
        except OSError as e:
            raise VmmUnavailable(
                f"cuda-vmm backend needs the interceptor library: cannot load {self.path}: {e} "
                f"(build it with `make -C interceptor`, or set {LIBRARY_ENV})"
            ) from e
        missing = [name for name in _SIGNATURES if not hasattr(lib, name)]
        if missing:
            raise VmmUnavailable(f"cuda-vmm backend: {self.path} lacks {', '.join(missing)} (stale build?)")
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        self._lib = lib

    def _check(self, call: str, status: int) -> None:
        if status == FRMPS_OK:
            return
        # frmps_last_error is per thread: read it right here, on the failing thread.
        msg = (self._lib.frmps_last_error() or b"").decode(errors="replace")
        if status in (FRMPS_E_DISABLED, FRMPS_E_NOLIB):
            raise VmmUnavailable(f"{call}: {msg}")
        raise VmmError(call, status, msg)

    @property
    def disabled(self) -> bool:
        return bool(self._lib.frmps_disabled())

    def granularity(self, device: int) -> int:
        out = ctypes.c_size_t()
        self._check("frmps_granularity", self._lib.frmps_granularity(device, ctypes.byref(out)))
        return out.value

    def pool_create(self, tag: str, index: int, size: int, device: int) -> int:
        out = _p()
        self._check("frmps_pool_create", self._lib.frmps_pool_create(tag.encode(), index, size, device, ctypes.byref(out)))
        return int(out.value)

    def pool_export_fd(self, pool: int) -> int:
        fd = ctypes.c_int(-1)
        self._check("frmps_pool_export_fd", self._lib.frmps_pool_export_fd(pool, ctypes.byref(fd)))
        return fd.value

    def pool_import(self, tag: str, index: int, fd: int, size: int, device: int, readonly: bool) -> int:
        out = _p()
        self._check("frmps_pool_import", self._lib.frmps_pool_import(tag.encode(), index, fd, size, device, int(readonly), ctypes.byref(out)))
        return int(out.value)

    def pool_reserve_scratch(self, tag: str, index: int, size: int, device: int, scratch_chunk: int) -> int:
        out = _p()
        self._check(
            "frmps_pool_reserve_scratch",
            self._lib.frmps_pool_reserve_scratch(tag.encode(), index, size, device, scratch_chunk, ctypes.byref(out)),
        )
        return int(out.value)

    def pool_swap_to_import(self, pool: int, fd: int, readonly: bool) -> None:
        self._check("frmps_pool_swap_to_import", self._lib.frmps_pool_swap_to_import(pool, fd, int(readonly)))

    def pool_set_access(self, pool: int, readonly: bool) -> None:
        self._check("frmps_pool_set_access", self._lib.frmps_pool_set_access(pool, int(readonly)))

    def pool_ptr(self, pool: int) -> int:
        return int(self._lib.frmps_pool_ptr(pool))

    def pool_size(self, pool: int) -> int:
        return int(self._lib.frmps_pool_size(pool))

    def pool_used(self, pool: int) -> int:
        return int(self._lib.frmps_pool_used(pool))

    def pool_destroy(self, pool: int) -> None:
        self._check("frmps_pool_destroy", self._lib.frmps_pool_destroy(pool))

    def alloc_begin(self, tag: str) -> None:
        self._check("frmps_alloc_begin", self._lib.frmps_alloc_begin(tag.encode()))

    def alloc_end(self) -> None:
        self._lib.frmps_alloc_end()


def parse_device(device: str | int) -> int:
    """"cuda" -> 0, "cuda:3" -> 3, 2 -> 2; anything else is a clear error."""
    if isinstance(device, int):
        if device < 0:
            raise VmmUnavailable(f"cuda-vmm backend: device ordinal {device} is negative")
        return device
    if device == "cuda":
        return 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    raise VmmUnavailable(f"cuda-vmm backend needs a GPU device (cuda or cuda:N), got --device {device}")


class _CudaArray:
    """Just enough of __cuda_array_interface__ (v3) for torch.as_tensor to wrap
    device memory it does not own. Writability is enforced by the driver's
    access flags, not here."""

    def __init__(self, address: int, size: int):
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


def cuda_tensor(address: int, size: int, device: int):
    """A uint8 CUDA tensor over [address, address+size) on `device` (no copy)."""
    import torch

    return torch.as_tensor(_CudaArray(address, size), device=f"cuda:{device}")


TensorFactory = Callable[[int, int, int], Any]


class CudaVmmBackend(MemoryBackend):
    """Memory backend over libfrmps_vmm. ``tensor_factory(address, size, device)``
    builds the tensor for a pool; the default wraps the device memory as a CUDA
    tensor (tests inject a host-memory factory to run against the fake driver)."""

    name = BACKEND_NAME

    def __init__(
        self,
        device: str | int = "cuda",
        library: str | None = None,
        scratch_chunk: int | None = None,
        tensor_factory: TensorFactory | None = None,
    ):
        self._device = parse_device(device)
        if tensor_factory is None:
            tensor_factory = cuda_tensor
            _require_gpu(self._device)
        self._lib = VmmLibrary(library)
        if self._lib.disabled:
            raise VmmUnavailable("cuda-vmm backend: the interceptor is disabled (FRMPS_VMM_DISABLE=1); use --memory host-shm")
        self._tensor = tensor_factory
        self._scratch_chunk = scratch_chunk
        self._pools: dict[tuple[str, int], Pool] = {}
        self._reserved: dict[tuple[str, int], Pool] = {}

    @property
    def library(self) -> VmmLibrary:
        return self._lib

    @staticmethod
    def _check_spec(spec: PoolSpec) -> None:
        if spec.size <= 0:
            raise MemoryError_(f"pool {spec.tag}[{spec.index}]: size must be > 0, got {spec.size}")
        if spec.index < 0:
            raise MemoryError_(f"pool {spec.tag}[{spec.index}]: index must be >= 0")

    def _pool(self, spec: PoolSpec, handle: int, fd: int, readonly: bool) -> Pool:
        address = self._lib.pool_ptr(handle)
        tensor = self._tensor(address, spec.size, self._device)
        return Pool(spec, tensor, fd=fd, address=address, readonly=readonly,
                    extra={"handle": handle, "mapped_size": self._lib.pool_size(handle)})

    # -- active -------------------------------------------------------------
    def allocate(self, specs: Sequence[PoolSpec]) -> list[Pool]:
        out: list[Pool] = []
        try:
            for s in map(as_spec, specs):
                self._check_spec(s)
                if s.key in self._pools or s.key in self._reserved:
                    raise MemoryError_(f"allocate: pool {s.tag}[{s.index}] already exists")
                handle = self._lib.pool_create(s.tag, s.index, s.size, self._device)
                fd = -1
                try:
                    fd = self._lib.pool_export_fd(handle)
                    pool = self._pool(s, handle, fd, readonly=False)
                except BaseException:
                    if fd >= 0:
                        os.close(fd)
                    self._lib.pool_destroy(handle)
                    raise
                self._pools[s.key] = pool
                out.append(pool)
        except BaseException:
            self.close()
            raise
        return out

    # -- standby ------------------------------------------------------------
    def reserve(self, specs: Sequence[PoolSpec]) -> list[Pool]:
        out: list[Pool] = []
        for s in map(as_spec, specs):
            self._check_spec(s)
            if s.key in self._pools or s.key in self._reserved:
                raise MemoryError_(f"reserve: pool {s.tag}[{s.index}] already exists")
            chunk = self._scratch_chunk if self._scratch_chunk is not None else scratch_chunk_for(s.size)
            handle = self._lib.pool_reserve_scratch(s.tag, s.index, s.size, self._device, chunk)
            try:
                pool = self._pool(s, handle, -1, readonly=False)
            except BaseException:
                self._lib.pool_destroy(handle)
                raise
            self._reserved[s.key] = pool
            out.append(pool)
        return out

    def map(self, specs: Sequence[PoolSpec], fds: Sequence[int], readonly: bool) -> list[Pool]:
        specs, fds = checked_map_args(specs, fds, reserved=self._reserved, mapped=self._pools,
                                      check_spec=self._check_spec)
        out = []
        for i, (s, fd) in enumerate(zip(specs, fds)):
            r = self._reserved.get(s.key)
            try:
                if r is not None:
                    # Same address: the engine's tensors and captured graphs now see the shared pool.
                    self._lib.pool_swap_to_import(r.extra["handle"], fd, readonly)
                    del self._reserved[s.key]
                    pool = Pool(s, r.tensor, fd=fd, address=r.address, readonly=readonly, extra=r.extra)
                else:
                    handle = self._lib.pool_import(s.tag, s.index, fd, s.size, self._device, readonly)
                    try:
                        pool = self._pool(s, handle, fd, readonly)
                    except BaseException:
                        self._lib.pool_destroy(handle)
                        raise
            except BaseException as e:
                for f in fds[i:]:
                    os.close(f)
                if isinstance(e, VmmError):
                    raise MemoryError_(f"map pool {s.tag}[{s.index}]: {e}") from e
                raise
            self._pools[s.key] = pool
            out.append(pool)
        return out

    def _set_access(self, pool: Pool, readonly: bool) -> None:
        self._lib.pool_set_access(pool.extra["handle"], readonly)

    def pools(self) -> list[Pool]:
        return list(self._pools.values())

    # -- torch allocator route ----------------------------------------------
    @contextlib.contextmanager
    def allocation_region(self, tag: str) -> Iterator[None]:
        """Inside: frmps_malloc (and cudaMalloc, when the library is preloaded)
        carve from the pools tagged `tag`."""
        self._lib.alloc_begin(tag)
        try:
            yield
        finally:
            self._lib.alloc_end()

    def pluggable_allocator(self):
        """A torch CUDAPluggableAllocator over frmps_malloc/frmps_free, for torch.cuda.MemPool."""
        import torch

        return torch.cuda.memory.CUDAPluggableAllocator(self._lib.path, "frmps_malloc", "frmps_free")

    def close(self) -> None:
        errors = []
        for pool in list(self._pools.values()) + list(self._reserved.values()):
            try:
                self._lib.pool_destroy(pool.extra["handle"])
            except MemoryError_ as e:
                errors.append(str(e))
            if pool.fd >= 0:
                os.close(pool.fd)
                pool.fd = -1
        self._pools.clear()
        self._reserved.clear()
        if errors:
            raise MemoryError_("close: " + "; ".join(errors))


def _require_gpu(device: int) -> None:
    try:
        import torch
    except ImportError as e:
        raise VmmUnavailable("cuda-vmm backend needs PyTorch with CUDA") from e
    if not torch.cuda.is_available():
        raise VmmUnavailable("cuda-vmm backend needs a CUDA GPU, and torch sees none; use --memory host-shm")
    if device >= torch.cuda.device_count():
        raise VmmUnavailable(f"cuda-vmm backend: no GPU cuda:{device} (torch sees {torch.cuda.device_count()})")
    # Initialise torch's CUDA state first, so the interceptor finds the device's
    # primary context current instead of making it current itself.
    torch.cuda.init()
    torch.cuda.set_device(device)
