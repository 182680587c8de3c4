"""Memory backends: host-shm pools shared between processes, read-only standby mappings, size checks."""

import hashlib
import os
import stat
import subprocess
import sys

import pytest

from e2e import require
from frmps_engine.sdk.memory import MemoryError_, PoolSpec, SizeMismatch, check_specs_match, get_backend
from frmps_engine.sdk.memory.cuda_vmm import VmmUnavailable

pytestmark = pytest.mark.torch
torch = require("torch")

SPECS = [PoolSpec("weights", 0, 8192), PoolSpec("kv_cache", 0, 4096 * 3)]

# A standby in another process: maps the fds it inherited and acts on them.
_CHILD = r"""
import hashlib, os, sys
from frmps_engine.sdk.memory import PoolSpec, get_backend
mode, specs = sys.argv[1], [PoolSpec("weights", 0, 8192), PoolSpec("kv_cache", 0, 4096 * 3)]
fds = [int(x) for x in sys.argv[2:]]
b = get_backend("host-shm")
pools = b.map(specs, fds, readonly=(mode != "write"))
if mode == "read":
    print(hashlib.sha256(bytes(pools[0].tensor.numpy()) + bytes(pools[1].tensor.numpy())).hexdigest())
elif mode == "write":
    pools[1].tensor[:5] = torch_ = __import__("torch").tensor([9, 8, 7, 6, 5], dtype=__import__("torch").uint8)
    print("wrote")
elif mode == "write-readonly":
    print("about to write", flush=True)
    pools[1].tensor[0] = 1          # must fault: the mapping is PROT_READ
    print("WROTE")
elif mode == "writable":
    b.make_writable("kv_cache")
    pools[1].tensor[0] = 42
    print("ok")
elif mode == "handover":  # took over, then handed over: read-only again
    b.make_writable("kv_cache")
    pools[1].tensor[0] = 43
    b.make_readonly("kv_cache")
    b.make_readonly("kv_cache")  # idempotent
    assert [p.readonly for p in b.pools()] == [True, True]
    print("about to write", flush=True)
    pools[1].tensor[0] = 1          # must fault: read-only again
    print("WROTE")
"""


def _child(mode, fds):
    return subprocess.run([sys.executable, "-c", _CHILD, mode, *map(str, fds)], pass_fds=fds,
                          capture_output=True, text=True, timeout=60)


def _digest(pools):
    return hashlib.sha256(b"".join(bytes(p.tensor.numpy()) for p in pools)).hexdigest()


@pytest.fixture
def active():
    b = get_backend("host-shm")
    pools = b.allocate(SPECS)
    for i, p in enumerate(pools):
        p.tensor.copy_(torch.arange(p.spec.size, dtype=torch.int64).mul(i + 3).remainder(251).to(torch.uint8))
    yield b, pools
    del pools
    b.close()


def test_allocate_creates_private_unlinked_pools(active):
    _, pools = active
    for p in pools:
        st = os.fstat(p.fd)
        assert st.st_nlink == 0, "the pool file must be unlinked: only fds keep it alive"
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == p.spec.size and p.tensor.numel() == p.spec.size and p.tensor.dtype == torch.uint8


def test_standby_reads_what_the_active_wrote_and_never_modifies_it(active):
    _, pools = active
    before = _digest(pools)
    r = _child("read", [p.fd for p in pools])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == before
    assert _digest(pools) == before


def test_writes_are_shared_both_ways(active):
    _, pools = active
    r = _child("write", [p.fd for p in pools])
    assert r.returncode == 0, r.stderr
    assert pools[1].tensor[:5].tolist() == [9, 8, 7, 6, 5]


def test_readonly_mapping_faults_on_write(active):
    _, pools = active
    before = _digest(pools)
    r = _child("write-readonly", [p.fd for p in pools])
    assert r.returncode == -11, (r.returncode, r.stdout, r.stderr)  # SIGSEGV
    assert "about to write" in r.stdout and "WROTE" not in r.stdout
    assert _digest(pools) == before


def test_make_writable_flips_kv(active):
    _, pools = active
    r = _child("writable", [p.fd for p in pools])
    assert r.returncode == 0, r.stderr
    assert int(pools[1].tensor[0]) == 42


def test_make_readonly_flips_kv_back(active):
    _, pools = active
    r = _child("handover", [p.fd for p in pools])
    assert r.returncode == -11, (r.returncode, r.stdout, r.stderr)  # SIGSEGV on the write after make_readonly
    assert "about to write" in r.stdout and "WROTE" not in r.stdout
    assert int(pools[1].tensor[0]) == 43


def test_reserve_then_map_in_place(active, no_fd_leak):
    _, pools = active
    standby = get_backend("host-shm")
    reserved = standby.reserve(SPECS)
    tensors = [p.tensor for p in reserved]
    ptrs = [t.data_ptr() for t in tensors]
    tensors[1][:3] = 77  # scratch writes before Sleep stay private
    fds = [os.dup(p.fd) for p in pools]
    mapped = standby.map(SPECS, fds, readonly=True)
    assert [p.tensor.data_ptr() for p in mapped] == ptrs
    # The tensors built on the reservation now see the active's bytes.
    assert torch.equal(tensors[0], pools[0].tensor) and torch.equal(tensors[1], pools[1].tensor)
    assert int(pools[1].tensor[0]) != 77
    standby.make_writable("kv_cache")
    tensors[1][0] = 200
    assert int(pools[1].tensor[0]) == 200
    with pytest.raises(MemoryError_, match="no mapped pool has tag 'nope'"):
        standby.make_writable("nope")
    del tensors, mapped, reserved
    standby.close()


def test_size_mismatch_lists_every_pool_and_closes_fds(active, no_fd_leak):
    _, pools = active
    wrong = [PoolSpec("weights", 0, 8192 * 2), PoolSpec("kv_cache", 0, 4096)]
    fds = [os.dup(p.fd) for p in pools]
    b = get_backend("host-shm")
    with pytest.raises(SizeMismatch) as ei:
        b.map(wrong, fds, readonly=True)
    msg = str(ei.value)
    assert "weights[0]: fd holds 8192 bytes, layout says 16384" in msg
    assert "kv_cache[0]: fd holds 12288 bytes, layout says 4096" in msg
    with pytest.raises(SizeMismatch, match="2 pools but 1 fds"):
        b.map(SPECS, [os.dup(pools[0].fd)], readonly=True)
    b.close()


def test_non_shm_fd_is_refused(no_fd_leak):
    r, w = os.pipe()
    os.close(w)
    b = get_backend("host-shm")
    with pytest.raises(SizeMismatch, match="not a shared-memory file"):
        b.map([PoolSpec("kv_cache", 0, 16)], [r], readonly=True)
    b.close()


def test_check_specs_match():
    check_specs_match(SPECS, [PoolSpec("weights", 0, 8192), PoolSpec("kv_cache", 0, 12288)])
    with pytest.raises(SizeMismatch, match=r"pool 1: engine expects kv_cache\[0\] 12288 bytes, got kv_cache\[0\] 100 bytes"):
        check_specs_match(SPECS, [PoolSpec("weights", 0, 8192), PoolSpec("kv_cache", 0, 100)])
    with pytest.raises(SizeMismatch, match="engine expects 2 pools, got 1"):
        check_specs_match(SPECS, SPECS[:1])


def test_bad_specs_and_backends():
    b = get_backend("host-shm")
    with pytest.raises(MemoryError_, match="size must be > 0"):
        b.allocate([PoolSpec("kv_cache", 0, 0)])
    with pytest.raises(MemoryError_, match="unknown memory backend 'tmpfs'"):
        get_backend("tmpfs")
    with pytest.raises(VmmUnavailable, match="needs a GPU device"):
        get_backend("cuda-vmm", "cpu")
    with pytest.raises(VmmUnavailable, match="cuda-vmm backend needs (the interceptor library|a CUDA GPU)"):
        get_backend("cuda-vmm", "cuda:0")
