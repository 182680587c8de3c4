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
