"""prime-fault (sdk/primefault.py) on the CPU, against the interceptor's fake
libcuda (a TEST DOUBLE: its one "kernel", frmps_prime_fault, reports
CUDA_ERROR_MISALIGNED_ADDRESS when its 8-byte access is misaligned). Each case
runs in a fresh process: the fake's context error is sticky, as a real one is.
What it shows on a GPU: bench/results/2026-11-27-h200x2-fault-path/."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest


REPO = pathlib.Path(__file__).resolve().parents[2]
SRC = REPO / "vllmpatch" / "src"


@pytest.fixture(scope="module")
def fake(fake_libcuda):
    return fake_libcuda


def run(code: str, libcuda: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FRMPS_LIBCUDA": libcuda, "PYTHONPATH": str(SRC)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=60)


def test_the_kernel_faults_with_a_misaligned_address(fake):
    r = run("""
        from frmps_engine.sdk import primefault
        print(primefault.prime(0))
    """, fake)
    assert r.returncode == 0, r.stderr
    assert "'code': 716" in r.stdout and "'fatal': True" in r.stdout and "CUDA_ERROR_MISALIGNED_ADDRESS" in r.stdout


def test_cli_exit_codes(fake):
    env = {**os.environ, "FRMPS_LIBCUDA": fake, "PYTHONPATH": str(SRC)}
    cli = [sys.executable, "-m", "frmps_engine.cli", "prime-fault"]
    r = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "the fault path is primed" in r.stdout, r.stdout + r.stderr
    # A device this process does not see: refused before any launch.
    r = subprocess.run(cli + ["--device", "3"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cuDeviceGet(3)" in r.stdout and "CUDA_ERROR_INVALID_DEVICE" in r.stdout, r.stdout
    # No driver at all.
    r = subprocess.run(cli, env={**env, "FRMPS_LIBCUDA": "/nonexistent/libcuda.so.1"}, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "no CUDA driver library" in r.stdout, r.stdout


def test_a_failed_driver_call_or_no_fault_is_reported(fake):
    # The module does not load: a PrimeError naming the call, nothing launched.
    r = run("""
        import ctypes
        from frmps_engine.sdk import primefault
        ctypes.CDLL(primefault.os.environ["FRMPS_LIBCUDA"]).fake_cuda_fail(b"cuModuleLoadData", 500, 1)
        try:
            primefault.prime(0)
        except primefault.PrimeError as e:
            print("refused:", e)
    """, fake)
    assert "refused: cuModuleLoadData: CUDA_ERROR_NOT_FOUND (500)" in r.stdout, r.stdout + r.stderr
    # A kernel that runs without an error (the fake runs any other kernel as a no-op):
    # not primed, exit 1.
    r = run("""
        import sys
        from frmps_engine.sdk import primefault
        primefault.KERNEL = b"frmps_no_fault"
        primefault.PTX = primefault.PTX.replace(b"frmps_prime_fault", b"frmps_no_fault")
        sys.exit(primefault.main(0))
    """, fake)
    assert r.returncode == 1 and "CUDA_SUCCESS (0)" in r.stdout and "not primed" in r.stdout, r.stdout + r.stderr
