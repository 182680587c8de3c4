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


# A directory: with CHECKSUM_ENV, an engine whose core has ``param_checksums()``
# (the vLLM adapter's) also writes its model's per-parameter checksums there, as
# JSON, each time it logs the pool checksums (bench/gpu/weights_check.py).
PARAM_CHECKSUM_ENV = "FRMPS_DEBUG_PARAM_CHECKSUMS"
_MASK = (1 << 64) - 1


def tensor_checksum(t) -> str:
    """``dtype:shape:hex`` of a tensor's exact contents, equal on any device: its
    bytes read as int16 words, each times (position mod 65521) + 1, summed in
    wrapping int64 (in chunks, so a large tensor needs little scratch). One changed
    element, or two swapped, changes it."""
    import torch

    flat = t.detach().contiguous().view(-1)
    words = flat.view(torch.int16) if flat.element_size() % 2 == 0 else flat.view(torch.uint8)
    total, chunk = 0, 1 << 24
    for start in range(0, words.numel(), chunk):
        w = words[start:start + chunk].to(torch.int64)
        pos = torch.arange(start, start + w.numel(), device=w.device, dtype=torch.int64) % 65521 + 1
        total = (total + int((w * pos).sum())) & _MASK
    return f"{str(t.dtype).removeprefix('torch.')}:{'x'.join(map(str, t.shape))}:{total:016x}"


def write_param_checksums(directory: str, record: dict) -> str:
    """Write one engine's record ({role, pid, when, weights, mapped, params}) as
    ``<role>-<pid>-<n>.json`` in ``directory`` (atomically); returns the path."""
    import json
    import os
    import tempfile

    os.makedirs(directory, exist_ok=True)
    n = sum(1 for f in os.listdir(directory) if f.startswith(f"{record['role']}-{record['pid']}-"))
    path = os.path.join(directory, f"{record['role']}-{record['pid']}-{n}.json")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.rename(tmp, path)
    return path


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
