"""The frmps sleep-mode backend, registered with vLLM's SleepModeBackendFactory
as ``frmps`` and selected with ``--sleep-mode-backend frmps``.

vLLM 0.33.0's interface (vllm/device_allocator/sleep_mode_backend.py:37-113):
``suspend(level)``, ``resume(tags)``, ``discard(tags)`` plus capability class
methods; the worker builds it with no arguments (gpu_worker.py:252-262) and
calls it from ``Worker.sleep`` / ``wake_up`` / ``discard`` (gpu_worker.py:320,
342, 372). The backend only switches mappings; the memory and its state live
in ``pools.PoolController``.
"""

from __future__ import annotations

from vllm.device_allocator.sleep_mode_backend import SleepModeBackend

from .pools import get_controller


class FrmpsSleepBackend(SleepModeBackend):
    def suspend(self, level: int = 1) -> None:
        # Level does not matter: nothing is offloaded or discarded; the standby's
        # placeholder memory is replaced by the brokered pools, mapped read-only.
        get_controller().suspend(level)
        self._state = "SUSPENDED"

    def resume(self, tags: list[str] | None = None) -> None:
        self._state = "RESUMING"
        get_controller().resume(tags)
        self._state = "RUNNING"

    def discard(self, tags: tuple[str, ...]) -> None:
        raise RuntimeError(
            "frmps sleep-mode backend: pools are shared with another engine through the supervisor "
            f"and cannot be discarded by one engine (tags {tags!r})"
        )

    @classmethod
    def preserves_communicators(cls) -> bool:
        return True  # nothing but pool mappings changes

    @classmethod
    def preserves_compiled_artifacts(cls) -> bool:
        return True

    @classmethod
    def preserves_graphs_with_communicators(cls) -> bool:
        # Graphs were captured on the same virtual addresses the brokered pools
        # are mapped into, so they stay valid.
        return True
