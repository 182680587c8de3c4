"""cuda-vmm backend on the CPU: the ctypes binding and the whole pool lifecycle
against the interceptor's fake libcuda (a test double: "device" memory is host
memory, handles are memfds, read-only is mprotect). Needs a C compiler to build
the interceptor; skipped otherwise. GPU tests: test_cuda_vmm_gpu.py."""

from __future__ import annotations

import ctypes
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

from e2e import missing, require
from frmps_engine.sdk.memory.base import MemoryError_, PoolSpec, SizeMismatch
from frmps_engine.sdk.memory.cuda_vmm import (
    CudaVmmBackend,
    VmmError,
    VmmLibrary,
    VmmUnavailable,
    parse_device,
)

REPO = pathlib.Path(__file__).resolve().parents[2]
INTERCEPTOR = REPO / "interceptor"
MiB = 1 << 20


def host_view(address: int, size: int, device: int):
    """Tensor factory for the fake driver: a ctypes byte array over the host mapping."""
    return (ctypes.c_ubyte * size).from_address(address)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The interceptor and fake driver, built here; the library is loaded from a
    private copy so that its once-per-process driver choice (the fake) cannot
    leak into other tests of this session."""
    if not shutil.which(os.environ.get("CC", "cc")) or not shutil.which("make"):
        missing("needs a C compiler and make to build the interceptor")
    r = subprocess.run(["make", "-s", "-C", str(INTERCEPTOR), "all", "build/libcuda_fake.so"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    d = tmp_path_factory.mktemp("vmm")
    lib = d / "libfrmps_vmm.so"
    shutil.copy(INTERCEPTOR / "build" / "libfrmps_vmm.so", lib)
    return {"lib": str(lib), "fake": str(INTERCEPTOR / "build" / "libcuda_fake.so"), "dir": d}


@pytest.fixture(scope="module")
def lib_path(built):
    """Path of a library instance bound to the fake driver (bound at its first call)."""
    old = os.environ.get("FRMPS_LIBCUDA")
    os.environ["FRMPS_LIBCUDA"] = built["fake"]
    try:
        assert VmmLibrary(built["lib"]).granularity(0) == 2 * MiB
    finally:
        if old is None:
            del os.environ["FRMPS_LIBCUDA"]
        else:
            os.environ["FRMPS_LIBCUDA"] = old
    return built["lib"]


def backend(lib_path: str) -> CudaVmmBackend:
    return CudaVmmBackend("cuda:0", library=lib_path, tensor_factory=host_view)


def open_fds() -> set[int]:
    return {int(x) for x in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{x}")}


def fd_is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


SPECS = [PoolSpec("weights", 0, 3 * MiB + 5), PoolSpec("kv_cache", 0, 4 * MiB)]


def pattern(n: int, seed: int) -> bytes:
    return bytes((i * 7 + seed) & 0xFF for i in range(n))


# -- loading and arguments ---------------------------------------------------------------

def test_missing_library_is_a_clear_error():
    with pytest.raises(VmmUnavailable, match=r"cannot load /nonexistent/libfrmps_vmm\.so.*make -C interceptor"):
        VmmLibrary("/nonexistent/libfrmps_vmm.so")


def test_library_without_the_api_is_refused():
    with pytest.raises(VmmUnavailable, match="lacks frmps_last_error"):
        VmmLibrary("libc.so.6")


def test_device_names():
    assert parse_device("cuda") == 0
    assert parse_device("cuda:3") == 3
    assert parse_device(1) == 1
    for bad in ("cpu", "cuda:", "cuda:x", -1):
        with pytest.raises(VmmUnavailable):
            parse_device(bad)


def test_missing_driver_is_a_clear_error(built):
    lib = built["dir"] / "nodriver-libfrmps_vmm.so"
    shutil.copy(built["lib"], lib)
    old = os.environ.get("FRMPS_LIBCUDA")
    os.environ["FRMPS_LIBCUDA"] = "/nonexistent/libcuda.so.1"
    try:
        b = CudaVmmBackend("cuda", library=str(lib), tensor_factory=host_view)
        with pytest.raises(VmmUnavailable, match=r"load CUDA driver /nonexistent/libcuda\.so\.1"):
            b.allocate(SPECS)
    finally:
        if old is None:
            del os.environ["FRMPS_LIBCUDA"]
        else:
            os.environ["FRMPS_LIBCUDA"] = old


def test_kill_switch_refuses_the_backend(built):
    lib = built["dir"] / "disabled-libfrmps_vmm.so"
    shutil.copy(built["lib"], lib)
    os.environ["FRMPS_VMM_DISABLE"] = "1"
    try:
        with pytest.raises(VmmUnavailable, match="FRMPS_VMM_DISABLE=1"):
            CudaVmmBackend("cuda", library=str(lib), tensor_factory=host_view)
    finally:
        del os.environ["FRMPS_VMM_DISABLE"]


@pytest.mark.torch
def test_no_gpu_is_a_clear_error():
    torch = require("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(VmmUnavailable, match="needs a CUDA GPU"):
        CudaVmmBackend("cuda")


# -- lifecycle against the fake driver -----------------------------------------------------

def test_active_then_standby_shares_memory_at_reserved_addresses(lib_path):
    before = open_fds()
    active, standby = backend(lib_path), backend(lib_path)
    pools = active.allocate(SPECS)
    assert [p.spec for p in pools] == SPECS
    for i, p in enumerate(pools):
        assert len(p.tensor) == p.spec.size  # exactly the layout's size ...
        assert p.extra["mapped_size"] % (2 * MiB) == 0  # ... over a granularity-rounded mapping
        assert os.get_inheritable(p.fd) is False  # exported fds carry FD_CLOEXEC
        ctypes.memmove(p.address, pattern(p.spec.size, i), p.spec.size)

    reserved = standby.reserve(SPECS)
    addresses = [r.address for r in reserved]
    # The standby initialises on scratch: its writes never reach the active's pools.
    for r in reserved:
        ctypes.memset(r.address, 0xEE, r.spec.size)
    for i, p in enumerate(pools):
        assert ctypes.string_at(p.address, p.spec.size) == pattern(p.spec.size, i)

    mapped = standby.map(SPECS, [os.dup(p.fd) for p in pools], readonly=True)
    assert [m.address for m in mapped] == addresses  # same VAs: built tensors stay valid
    assert all(m.readonly for m in mapped)
    for i, (m, r) in enumerate(zip(mapped, reserved)):
        assert m.tensor is r.tensor
        assert bytes(m.tensor) == pattern(m.spec.size, i)

    standby.make_writable("kv_cache")
    kv = mapped[1]
    assert not kv.readonly and mapped[0].readonly
    kv.tensor[123] = 0x42
    assert ctypes.string_at(pools[1].address + 123, 1) == b"\x42"
    # A handover puts it back to sleep: read-only again, and writable at the next takeover.
    standby.make_readonly("kv_cache")
    standby.make_readonly("weights")
    assert kv.readonly and mapped[0].readonly
    standby.make_writable("kv_cache")
    kv.tensor[124] = 0x43
    assert ctypes.string_at(pools[1].address + 124, 1) == b"\x43"

    standby.close()
    active.close()
    assert open_fds() == before


def test_map_without_reserve_imports_fresh_ranges(lib_path):
    active, other = backend(lib_path), backend(lib_path)
    try:
        pools = active.allocate(SPECS[:1])
        ctypes.memmove(pools[0].address, pattern(SPECS[0].size, 9), SPECS[0].size)
        mapped = other.map(SPECS[:1], [os.dup(pools[0].fd)], readonly=True)
        assert mapped[0].address != pools[0].address
        assert bytes(mapped[0].tensor) == pattern(SPECS[0].size, 9)
    finally:
        other.close()
        active.close()


def test_size_mismatch_refuses_and_closes_the_fds(lib_path):
    active, standby = backend(lib_path), backend(lib_path)
    try:
        pools = active.allocate(SPECS)
        standby.reserve(SPECS)
        wrong = [SPECS[0], PoolSpec("kv_cache", 0, 8 * MiB)]
        fds = [os.dup(p.fd) for p in pools]
        with pytest.raises(SizeMismatch, match=r"kv_cache\[0\]: reserved 4194304 bytes, brokered 8388608"):
            standby.map(wrong, fds, readonly=True)
        assert not any(fd_is_open(fd) for fd in fds)
        fds = [os.dup(pools[0].fd)]
        with pytest.raises(SizeMismatch, match="2 pools but 1 fds"):
            standby.map(SPECS, fds, readonly=True)
        assert not fd_is_open(fds[0])
    finally:
        standby.close()
        active.close()


def test_a_brokered_pool_smaller_than_the_layout_is_refused(lib_path):
    active, standby = backend(lib_path), backend(lib_path)
    try:
        small = active.allocate([PoolSpec("kv_cache", 0, 2 * MiB)])
        standby.reserve([PoolSpec("kv_cache", 0, 4 * MiB)])
        with pytest.raises(MemoryError_, match="smaller than the kv_cache/0 layout"):
            standby.map([PoolSpec("kv_cache", 0, 4 * MiB)], [os.dup(small[0].fd)], readonly=True)
    finally:
        standby.close()
        active.close()


def test_driver_errors_name_the_call(lib_path):
    b = backend(lib_path)
    fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    with pytest.raises(MemoryError_, match="cuMemImportFromShareableHandle failed: CUDA_ERROR_INVALID_VALUE"):
        b.map(SPECS[:1], [fd], readonly=True)
    assert not fd_is_open(fd)
    b.close()


def test_bad_specs_and_states(lib_path):
    b = backend(lib_path)
    try:
        with pytest.raises(MemoryError_, match="size must be > 0"):
            b.allocate([PoolSpec("weights", 0, 0)])
        b.allocate(SPECS[:1])
        with pytest.raises(MemoryError_, match="already exists"):
            b.reserve(SPECS[:1])
        with pytest.raises(MemoryError_, match="no mapped pool has tag 'kv_cache'"):
            b.make_writable("kv_cache")
        with pytest.raises(VmmError, match="tag must be 1..63 bytes"):
            b.library.pool_create("x" * 64, 0, MiB, 0)
    finally:
        b.close()


def test_allocation_region_carves_from_the_tag(lib_path):
    b = backend(lib_path)
    try:
        (kv,) = b.allocate([PoolSpec("kv_cache", 0, 4 * MiB)])
        handle = kv.extra["handle"]
        lib = ctypes.CDLL(lib_path)
        lib.frmps_malloc.restype = ctypes.c_void_p
        lib.frmps_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.frmps_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        with b.allocation_region("kv_cache"):
            p = lib.frmps_malloc(MiB, 0, None)
            assert kv.address <= p < kv.address + kv.spec.size
            assert b.library.pool_used(handle) == MiB
            with pytest.raises(VmmError, match="already open"):
                b.library.alloc_begin("weights")
            lib.frmps_free(p, MiB, 0, None)
        assert b.library.pool_used(handle) == 0
    finally:
        b.close()


def test_standby_write_to_readonly_pool_faults(lib_path):
    """Read-only is real: a standby write before wake kills the writer (here a
    child process), not the shared memory."""
    code = textwrap.dedent(
        f"""
        import ctypes, os
        from frmps_engine.sdk.memory.base import PoolSpec
        from frmps_engine.sdk.memory.cuda_vmm import CudaVmmBackend
        view = lambda a, n, d: (ctypes.c_ubyte * n).from_address(a)
        active = CudaVmmBackend("cuda", library={lib_path!r}, tensor_factory=view)
        standby = CudaVmmBackend("cuda", library={lib_path!r}, tensor_factory=view)
        spec = [PoolSpec("kv_cache", 0, 2 << 20)]
        (pool,) = active.allocate(spec)
        standby.reserve(spec)
        (m,) = standby.map(spec, [os.dup(pool.fd)], readonly=True)
        print("mapped", flush=True)
        m.tensor[0] = 1
        print("wrote", flush=True)
        """
    )
    import frmps_engine

    env = dict(os.environ, FRMPS_LIBCUDA=str(INTERCEPTOR / "build" / "libcuda_fake.so"),
               PYTHONPATH=str(pathlib.Path(frmps_engine.__file__).resolve().parents[1]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert "mapped" in r.stdout, r.stderr
    assert "wrote" not in r.stdout
    assert r.returncode == -11  # SIGSEGV


def test_scratch_chunk_grows_with_the_pool():
    from frmps_engine.sdk.memory.cuda_vmm import MAX_SCRATCH_CHUNK, MIN_SCRATCH_CHUNK, scratch_chunk_for

    assert scratch_chunk_for(1) == MIN_SCRATCH_CHUNK == 2 * MiB
    assert scratch_chunk_for(512 * MiB) == 2 * MiB  # 256 mappings of the granularity
    assert scratch_chunk_for(1024 * MiB) == 4 * MiB
    assert scratch_chunk_for(1024 * MiB + 1) == 6 * MiB  # whole granules, at most 256 mappings
    assert scratch_chunk_for(4831838208) == 18 * MiB  # a 14B model's KV pool here: 4.5 GiB
    assert scratch_chunk_for(29600983040) == MAX_SCRATCH_CHUNK == 64 * MiB  # its weights: 28 GiB


def test_a_large_standby_pool_takes_few_scratch_mappings(built, lib_path):
    """The standby of a large pool maps its scratch a few hundred times, not once
    per 2 MiB (each mapping is ~125 us on the H100: 14,000 of them for a 14B
    model's weights took ~1.9 s of every standby's start); an explicit chunk
    still wins."""
    fake = ctypes.CDLL(built["fake"])
    fake.fake_cuda_calls.restype = ctypes.c_long
    fake.fake_cuda_calls.argtypes = [ctypes.c_char_p]
    for size, chunk, want in ((1024 * MiB, None, 256), (32768 * MiB, None, 512), (1024 * MiB, 2 * MiB, 512)):
        before = fake.fake_cuda_calls(b"cuMemMap")
        b = CudaVmmBackend("cuda:0", library=lib_path, tensor_factory=host_view, scratch_chunk=chunk)
        try:
            (r,) = b.reserve([PoolSpec("weights", 0, size)])
            assert fake.fake_cuda_calls(b"cuMemMap") - before == want
            ctypes.memset(r.address + size - 4096, 0xEE, 4096)  # the whole range is backed
        finally:
            b.close()
