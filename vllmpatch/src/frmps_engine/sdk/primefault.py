"""Prime a GPU's fault path: one deliberate fault in a throwaway CUDA context.

The first fatal fault of an MPS client on a GPU since the machine started costs
far more than every later one: the MPS server takes that much longer to tear its
clients down ("to be torn down" -> "exiting"), with no engine involved, in a new
MPS daemon too (bench/gpu/fault_teardown_probe.py shows it). A standby taking
over waits for that teardown, so the first real fault of a deployment stalls.
``frmps serve --prime-fault-path``
runs this module once per GPU inside its private MPS daemon before the active
starts: the cost is paid while nothing serves, by a client that is alone in its
MPS server. It leaves an Xid 13 and an Xid 43 in the kernel log.

No torch: the driver API through ctypes, one kernel as PTX (JIT-compiled by the
driver) doing an 8-byte load at an address 4 mod 8 — CUDA_ERROR_MISALIGNED_ADDRESS,
what bench/faults/misaligned.cu does.

    python -m frmps_engine.cli prime-fault [--device N]

Exit codes: 0 the fault happened (the expected error came back), 1 something
else came back (no error, or another one), 2 no driver or no device.
"""

from __future__ import annotations

import ctypes
import os
import time

LIBCUDA_ENV = "FRMPS_LIBCUDA"
CUDA_ERROR_MISALIGNED_ADDRESS = 716
# Errors that show the kernel faulted in a way the MPS server treats as fatal: misaligned
# address, illegal address, illegal instruction, launch failure (their names come from the
# driver, cuGetErrorName).
FATAL = frozenset({CUDA_ERROR_MISALIGNED_ADDRESS, 700, 715, 719})

KERNEL = b"frmps_prime_fault"
PTX = b"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry frmps_prime_fault(.param .u64 p)
{
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [p];
    cvta.to.global.u64 %rd1, %rd1;
    add.s64 %rd2, %rd1, 4;
    ld.volatile.global.u64 %rd3, [%rd2];
    st.volatile.global.u64 [%rd1], %rd3;
    ret;
}
"""


class PrimeError(RuntimeError):
    """No driver, no device, or a driver call failed before the faulting launch."""


def _lib(path: str | None = None):
    name = path or os.environ.get(LIBCUDA_ENV) or "libcuda.so.1"
    try:
        return ctypes.CDLL(name)
    except OSError as e:
        raise PrimeError(f"no CUDA driver library ({name}): {e}") from e


def _name(cu, code: int) -> str:
    s = ctypes.c_char_p()
    try:
        if cu.cuGetErrorName(code, ctypes.byref(s)) == 0 and s.value:
            return s.value.decode()
    except AttributeError:
        pass
    return f"CUresult {code}"


def prime(device: int = 0, libcuda: str | None = None) -> dict:
    """Fault once on ``device`` (an index as this process sees the GPUs) and return
    {"code", "error", "fatal", "seconds"}: code is what cuCtxSynchronize returned.
    PrimeError when it could not get as far as the launch."""
    cu = _lib(libcuda)

    def call(what: str, code: int) -> None:
        if code != 0:
            raise PrimeError(f"{what}: {_name(cu, code)} ({code})")

    t0 = time.monotonic()
    call("cuInit", cu.cuInit(0))
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    call(f"cuDeviceGet({device})", cu.cuDeviceGet(ctypes.byref(dev), device))
    call("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
    call("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))
    ptr = ctypes.c_uint64()
    call("cuMemAlloc", cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(64)))
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    call("cuModuleLoadData", cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(PTX)))
    call("cuModuleGetFunction", cu.cuModuleGetFunction(ctypes.byref(fn), mod, ctypes.c_char_p(KERNEL)))
    arg = ctypes.c_uint64(ptr.value)
    params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(arg), ctypes.c_void_p))
    launch = cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, params, None)
    code = launch if launch != 0 else cu.cuCtxSynchronize()
    return {"code": code, "error": _name(cu, code), "fatal": code in FATAL,
            "seconds": round(time.monotonic() - t0, 3)}


def main(device: int = 0) -> int:
    try:
        r = prime(device)
    except PrimeError as e:
        print(f"prime-fault: {e}", flush=True)
        return 2
    verdict = "the fault path is primed" if r["fatal"] else "no fatal fault: not primed"
    print(f"prime-fault: device {device}: {r['error']} ({r['code']}) after {r['seconds']} s: {verdict}", flush=True)
    return 0 if r["fatal"] else 1
