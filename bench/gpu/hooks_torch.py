"""Driver-API hooks seen from PyTorch: run with libfrmps_vmm.so in LD_PRELOAD.

torch's caching allocator calls cudaMalloc; bundled cudart reaches the driver
through dlsym(libcuda, "cuGetProcAddress_v2") and cuGetProcAddress, which the
interceptor hooks. Inside frmps_alloc_begin("weights") ... frmps_alloc_end()
the segment must land in the "weights" pool; outside it must not; freeing the
segment (empty_cache -> cudaFree -> cuMemFree_v2) must return it to the pool.

Usage: LD_PRELOAD=.../libfrmps_vmm.so python hooks_torch.py enabled|disabled
Prints one line per check; exits 1 on any failure."""

import ctypes
import os
import sys

import torch

MiB = 1 << 20
mode = sys.argv[1] if len(sys.argv) > 1 else "enabled"
lib = ctypes.CDLL(os.environ["FRMPS_VMM_LIB"])  # the preloaded instance
lib.frmps_last_error.restype = ctypes.c_char_p
lib.frmps_pool_create.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.c_size_t, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]
lib.frmps_pool_ptr.restype = ctypes.c_ulonglong
lib.frmps_pool_ptr.argtypes = [ctypes.c_void_p]
lib.frmps_pool_size.restype = ctypes.c_size_t
lib.frmps_pool_size.argtypes = [ctypes.c_void_p]
lib.frmps_pool_used.restype = ctypes.c_size_t
lib.frmps_pool_used.argtypes = [ctypes.c_void_p]
lib.frmps_alloc_begin.argtypes = [ctypes.c_char_p]

failures = 0


def check(ok: bool, what: str) -> None:
    global failures
    print(f"{'PASS' if ok else 'FAIL'} {what}", flush=True)
    failures += 0 if ok else 1


torch.zeros(1, device="cuda")  # context + allocator initialised
pool = ctypes.c_void_p()
st = lib.frmps_pool_create(b"weights", 0, 256 * MiB, 0, ctypes.byref(pool))
if mode == "disabled":
    check(st == 4, f"kill switch: frmps_pool_create refused ({st}: {lib.frmps_last_error().decode()})")
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    x.fill_(1)
    torch.cuda.synchronize()
    check(int(x.sum()) == 64 * MiB, "kill switch: torch allocates and computes normally")
    sys.exit(1 if failures else 0)

check(st == 0, f"pool created ({lib.frmps_last_error().decode()})")
base, size = lib.frmps_pool_ptr(pool), lib.frmps_pool_size(pool)

lib.frmps_alloc_begin(b"weights")
try:
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
finally:
    lib.frmps_alloc_end()
check(base <= x.data_ptr() < base + size, f"cudaMalloc inside the region landed in the pool ({x.data_ptr():#x} in [{base:#x}, +{size}))")
check(lib.frmps_pool_used(pool) >= 64 * MiB, f"pool accounts the segment ({lib.frmps_pool_used(pool)} bytes used)")
x.fill_(3)
torch.cuda.synchronize()
check(int(x.sum()) == 3 * 64 * MiB, "kernels read and write the pooled tensor")

y = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
check(not (base <= y.data_ptr() < base + size), "cudaMalloc outside the region passes through")

del x
torch.cuda.empty_cache()
check(lib.frmps_pool_used(pool) == 0, f"cudaFree returned the segment to the pool ({lib.frmps_pool_used(pool)} bytes used)")
del y
torch.cuda.empty_cache()
sys.exit(1 if failures else 0)
