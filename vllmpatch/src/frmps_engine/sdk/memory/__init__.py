"""Shareable memory pools for the engine's weights and KV cache.

Backends: ``host-shm`` (CPU: /dev/shm files mapped by both engines) and
``cuda-vmm`` (GPU: CUDA VMM handles exported as POSIX fds, through the
interceptor library). See ``base.MemoryBackend`` for the lifecycle.
"""

from __future__ import annotations

from .base import MemoryBackend, MemoryError_, Pool, PoolSpec, SizeMismatch, check_specs_match

__all__ = ["MemoryBackend", "MemoryError_", "Pool", "PoolSpec", "SizeMismatch", "check_specs_match", "get_backend",
           "BackendName"]


KNOWN_BACKENDS = ("host-shm", "cuda-vmm")


def _unknown(name: str) -> MemoryError_:
    return MemoryError_(f"unknown memory backend {name!r} (known: {', '.join(KNOWN_BACKENDS)})")


def get_backend(name: str, device: str = "cpu") -> MemoryBackend:
    """Build the backend named on the command line ("host-shm" or "cuda-vmm")."""
    if name == "host-shm":
        from .host_shm import HostShmBackend

        return HostShmBackend()
    if name == "cuda-vmm":
        from .cuda_vmm import CudaVmmBackend

        return CudaVmmBackend(device=device)
    raise _unknown(name)


class BackendName:
    """The backend's name without the backend: what an engine process passes on when
    its pools live in other processes (the ranks of a tensor-parallel vLLM engine
    build their own, ``ProcessGroup.group_memory``), so that it opens no device of
    its own — the cuda-vmm backend would create a CUDA context here."""

    def __init__(self, name: str):
        if name not in KNOWN_BACKENDS:
            raise _unknown(name)
        self.name = name

    def close(self) -> None:
        pass
