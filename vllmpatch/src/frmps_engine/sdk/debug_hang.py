"""Test hook: an engine step that never finishes.

Enabled only when the engine starts with ``FRMPS_DEBUG_HANG_SIGNAL=1``: then
SIGUSR2 makes the engine loop run ``hang`` as part of its next step (or, while
idle, where its idle device check runs). On a GPU it launches a kernel that
spins for ever on the current stream; the engine's own stream waits for that
stream before each step's work, so the step blocks at its next synchronise,
as with a kernel that never returns. On the CPU the loop thread itself blocks.
Either way the heartbeat thread keeps beating and reports a step whose age
grows past its bound: the supervisor's progress rule, not its liveness rule,
must fence the engine (SIGKILL of its process group tears the CUDA context down
with the kernel still spinning).
"""

from __future__ import annotations

import threading

ENV = "FRMPS_DEBUG_HANG_SIGNAL"

# ~73 years of clock cycles at 2 GHz: the kernel never finishes.
_FOREVER_CYCLES = 1 << 62


def hang(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        with torch.cuda.device(torch.device(device)):
            torch.cuda._sleep(_FOREVER_CYCLES)  # asynchronous: the step's sync is where it blocks
        return
    threading.Event().wait()
