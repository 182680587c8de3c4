"""Test hook: a real GPU fault inside this engine's own CUDA context.

Enabled only when the engine starts with ``FRMPS_DEBUG_FAULT_SIGNAL=1``: then
SIGUSR1 makes the engine loop launch a kernel that stores 1 TiB past a live
allocation (an MMU fault, ``cudaErrorIllegalAddress``) and synchronise. The
engine then takes its ordinary sticky-error path (Fault on the control socket,
exit 3). Fault triggers in ``bench/faults`` reach an engine only through a
shared MPS server; a promoted standby runs outside MPS, so failover drills of
that engine need this hook.
"""

from __future__ import annotations

ENV = "FRMPS_DEBUG_FAULT_SIGNAL"

_kernel = None


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def _store_far(P, off):
        tl.store(P + off, 1.0)

    return _store_far


def prepare(device: str) -> None:
    """Compile the kernel now (a harmless store into a fresh tensor), so the fault
    itself later costs no compile time."""
    global _kernel
    import torch

    if not str(device).startswith("cuda"):
        return
    if _kernel is None:
        _kernel = _build()
    x = torch.zeros(1, device=device)
    _kernel[(1,)](x, 0)
    torch.cuda.synchronize()


def illegal_address(device: str) -> None:
    """Fault the current CUDA context; raises the CUDA error torch reports."""
    global _kernel
    import torch

    if not str(device).startswith("cuda"):
        raise RuntimeError("debug fault: the engine does not run on a GPU")
    if _kernel is None:
        _kernel = _build()
    x = torch.zeros(1, device=device)
    _kernel[(1,)](x, 1 << 40)
    torch.cuda.synchronize()


# Test hook: with FRMPS_DEBUG_POOL_CHECKSUM=1 the engine logs a checksum of each
# shared pool when it becomes ready, and again on CHECKSUM_SIGNAL. A harness
# compares the active's checksum at its Ready (before any standby exists) with
# one taken after the standby has started and slept while the active stayed
# idle: equal sums show that the standby's start wrote only its own memory.
CHECKSUM_ENV = "FRMPS_DEBUG_POOL_CHECKSUM"


def checksum_signal() -> int:
    import signal

    return signal.SIGRTMIN + 1


def pool_checksums(pools) -> str:
    """'weights[0]=<hex> kv_cache[0]=<hex>': the wrapping int64 sum of each pool
    (read on its device; a GPU reads tens of GB in milliseconds)."""
    import torch

    parts = []
    for p in pools:
        t = p.tensor
        n = t.numel() // 8 * 8
        s = int(t[:n].view(torch.int64).sum()) & 0xFFFFFFFFFFFFFFFF
        parts.append(f"{p.spec.tag}[{p.spec.index}]={s:016x}")
    return " ".join(parts)
