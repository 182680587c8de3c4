"""cuda-vmm backend on a real GPU (skipped without one). The standby side always
runs in another process, as in production; fds travel by fd inheritance or
SCM_RIGHTS. Run by bench/gpu/interceptor_check.sh on the GPU machine."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import textwrap

import pytest

from e2e import require

torch = require("torch")

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from frmps_engine.sdk.memory.base import PoolSpec  # noqa: E402
from frmps_engine.sdk.memory.cuda_vmm import CudaVmmBackend  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
MiB = 1 << 20
SPECS = [PoolSpec("weights", 0, 6 * MiB + 3), PoolSpec("kv_cache", 0, 8 * MiB)]


@pytest.fixture(scope="module")
def lib_path():
    r = subprocess.run(["make", "-s", "-C", str(REPO / "interceptor"), "all"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return str(REPO / "interceptor" / "build" / "libfrmps_vmm.so")


def child_env() -> dict:
    import frmps_engine

    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(frmps_engine.__file__).resolve().parents[1]))
    env.pop("FRMPS_LIBCUDA", None)
    return env


def run_child(code: str, pass_fds=(), timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=child_env(), pass_fds=pass_fds, timeout=timeout)


def fill_pattern(t, seed: int):
    n = t.numel()
    t.copy_(((torch.arange(n, device=t.device, dtype=torch.int64) * 7 + seed) % 251).to(torch.uint8))


def test_active_pools_are_cuda_tensors_over_the_pools(lib_path):
    b = CudaVmmBackend("cuda", library=lib_path)
    try:
        pools = b.allocate(SPECS)
        for i, p in enumerate(pools):
            assert p.tensor.is_cuda and p.tensor.dtype == torch.uint8
            assert p.tensor.numel() == p.spec.size
            assert p.tensor.data_ptr() == p.address
            assert os.get_inheritable(p.fd) is False  # the driver sets FD_CLOEXEC
            fill_pattern(p.tensor, i)
        torch.cuda.synchronize()
        expect = ((torch.arange(SPECS[1].size, dtype=torch.int64) * 7 + 1) % 251).to(torch.uint8)
        assert torch.equal(pools[1].tensor.cpu(), expect)
    finally:
        b.close()


def test_memory_outlives_its_exporter(lib_path):
    """Exporter process sends its fd and exits; we hold the fd without CUDA;
    a third process maps it and finds the bytes."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    exporter = f"""
        import os, socket, torch
        from frmps_engine.sdk.memory.base import PoolSpec
        from frmps_engine.sdk.memory.cuda_vmm import CudaVmmBackend
        b = CudaVmmBackend("cuda", library={lib_path!r})
        (p,) = b.allocate([PoolSpec("kv_cache", 0, {8 * MiB})])
        p.tensor.copy_(((torch.arange(p.tensor.numel(), device="cuda") * 7 + 5) % 251).to(torch.uint8))
        torch.cuda.synchronize()
        s = socket.socket(fileno={child.fileno()})
        socket.send_fds(s, [b"x"], [p.fd])
        os._exit(0)  # no teardown: like a dying engine
    """
    r = run_child(exporter, pass_fds=[child.fileno()])
    child.close()
    assert r.returncode == 0, r.stderr
    _, fds, _, _ = socket.recv_fds(parent, 1, 1)
    parent.close()
    assert len(fds) == 1
    importer = f"""
        import torch
        from frmps_engine.sdk.memory.base import PoolSpec
        from frmps_engine.sdk.memory.cuda_vmm import CudaVmmBackend
        b = CudaVmmBackend("cuda", library={lib_path!r})
        (p,) = b.map([PoolSpec("kv_cache", 0, {8 * MiB})], [{fds[0]}], readonly=True)
        expect = ((torch.arange(p.tensor.numel(), device="cuda") * 7 + 5) % 251).to(torch.uint8)
        assert torch.equal(p.tensor, expect), "bytes differ"
        b.close()
        print("imported ok")
    """
    r = run_child(importer, pass_fds=fds)
    os.close(fds[0])
    assert r.returncode == 0 and "imported ok" in r.stdout, r.stderr


def test_standby_graph_captured_on_scratch_writes_shared_memory_after_swap(lib_path):
    active = CudaVmmBackend("cuda", library=lib_path)
    try:
        pools = active.allocate(SPECS)
        for i, p in enumerate(pools):
            fill_pattern(p.tensor, i)
        torch.cuda.synchronize()
        before = pools[1].tensor.clone()
        standby = f"""
            import time, torch
            from frmps_engine.sdk.memory.base import PoolSpec
            from frmps_engine.sdk.memory.cuda_vmm import CudaVmmBackend
            specs = [PoolSpec("weights", 0, {SPECS[0].size}), PoolSpec("kv_cache", 0, {SPECS[1].size})]
            b = CudaVmmBackend("cuda", library={lib_path!r})
            reserved = b.reserve(specs)
            kv = reserved[1].tensor
            # Initialise on scratch: warm-up and graph capture write the scratch only.
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                kv[:4096].add_(1)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                kv[:4096].add_(1)
            torch.cuda.synchronize()
            addrs = [r.address for r in reserved]
            t0 = time.perf_counter()
            mapped = b.map(specs, [{pools[0].fd}, {pools[1].fd}], readonly=True)
            t1 = time.perf_counter()
            assert [m.address for m in mapped] == addrs, "map moved the pools"
            expect = ((torch.arange(kv.numel(), device="cuda") * 7 + 1) % 251).to(torch.uint8)
            assert torch.equal(kv, expect), "standby does not see the active's KV"
            t2 = time.perf_counter()
            b.make_writable("kv_cache")
            t3 = time.perf_counter()
            g.replay()
            torch.cuda.synchronize()
            print(f"sleep-map {{(t1 - t0) * 1e3:.2f}} ms, wake-make_writable {{(t3 - t2) * 1e3:.3f}} ms")
            # The pools' fds are the parent's (inherited); close() closes our copies.
            b.close()
            print("standby ok")
        """
        # The child gets its own copies of the exported fds.
        for p in pools:
            os.set_inheritable(p.fd, True)
        try:
            r = run_child(standby, pass_fds=[p.fd for p in pools])
        finally:
            for p in pools:
                os.set_inheritable(p.fd, False)
        assert r.returncode == 0 and "standby ok" in r.stdout, r.stdout + r.stderr
        print(r.stdout.strip())
        after = pools[1].tensor
        torch.cuda.synchronize()
        assert torch.equal(after[:4096].cpu(), (before[:4096].cpu() + 1))  # the replay wrote the real memory
        assert torch.equal(after[4096:].cpu(), before[4096:].cpu())
    finally:
        active.close()


def test_standby_write_before_wake_fails_and_leaves_memory_intact(lib_path):
    active = CudaVmmBackend("cuda", library=lib_path)
    try:
        (p,) = active.allocate(SPECS[1:])
        fill_pattern(p.tensor, 3)
        torch.cuda.synchronize()
        before = p.tensor.cpu()
        os.set_inheritable(p.fd, True)
        try:
            r = run_child(f"""
                import sys, torch
                from frmps_engine.sdk.memory.base import PoolSpec
                from frmps_engine.sdk.memory.cuda_vmm import CudaVmmBackend
                b = CudaVmmBackend("cuda", library={lib_path!r})
                (m,) = b.map([PoolSpec("kv_cache", 0, {SPECS[1].size})], [{p.fd}], readonly=True)
                try:
                    m.tensor[:1024].fill_(9)
                    torch.cuda.synchronize()
                except Exception as e:
                    print("write failed:", e)
                    import os; os._exit(3)
                print("write succeeded")
            """, pass_fds=[p.fd])
        finally:
            os.set_inheritable(p.fd, False)
        assert r.returncode == 3, r.stdout + r.stderr
        assert torch.equal(p.tensor.cpu(), before)
    finally:
        active.close()


def test_pluggable_allocator_places_torch_tensors_in_the_pool(lib_path):
    b = CudaVmmBackend("cuda", library=lib_path)
    try:
        (w,) = b.allocate([PoolSpec("weights", 0, 64 * MiB)])
        alloc = b.pluggable_allocator()
        pool = torch.cuda.MemPool(alloc.allocator())
        with b.allocation_region("weights"), torch.cuda.use_mem_pool(pool):
            x = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
            x.fill_(7)
        torch.cuda.synchronize()
        assert w.address <= x.data_ptr() < w.address + w.spec.size
        assert int(w.tensor[x.data_ptr() - w.address]) == 7
        del x
        del pool
    finally:
        b.close()
