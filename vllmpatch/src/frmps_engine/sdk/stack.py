"""The per-thread stack (local memory) the CUDA driver reserves for a context.

The driver sizes a context's local memory for its per-thread stack times every
thread the device can hold at once (SMs x threads per SM: 270,336 on an H100
SXM, so 264 MiB per KiB). It grows the stack when a launch needs more than the
current size and never shrinks it back (CU_LIMIT_STACK_SIZE in the driver API's
cuCtxSetLimit: "the driver automatically increases the per-thread stack size for
each kernel launch as needed. This size isn't reset back to the original value
after each launch"). A standby that has captured and warmed an engine's kernels
therefore keeps whatever the most demanding of them asked for, although it runs
nothing while asleep.

``StandbyStack`` gives that back while the standby sleeps (set the limit to the
driver's default) and asks for it again when the standby takes over, on a thread
of its own beside the KV flip, so the first step does not pay for the growth. If
that request fails (the GPU's memory is taken until the dead engine's context is
torn down), the first launch that needs the stack grows it, as the driver would
anyway: the stack's size never affects what a kernel computes.

``FRMPS_STANDBY_STACK=keep`` leaves the stack as the engine left it (for A/B runs
on a GPU); the default is ``reset``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

LIBCUDA_ENV = "FRMPS_LIBCUDA"
POLICY_ENV = "FRMPS_STANDBY_STACK"
CU_LIMIT_STACK_SIZE = 0
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR = 39
# What the driver starts a context with on every GPU frmps runs on (sm_70 and later).
DEFAULT_STACK_BYTES = 1024


class DriverError(RuntimeError):
    """A driver call failed; ``code`` is its CUresult."""

    def __init__(self, what: str, code: int):
        super().__init__(f"{what}: CUresult {code}")
        self.code = code


def policy(env: dict[str, str] | None = None) -> str:
    """``reset`` (the default) or ``keep``; ValueError for anything else."""
    v = (os.environ if env is None else env).get(POLICY_ENV, "").strip().lower()
    if v in ("", "reset"):
        return "reset"
    if v == "keep":
        return "keep"
    raise ValueError(f"{POLICY_ENV}={v!r}: use reset (the default) or keep")


def _libcuda() -> Any:
    return ctypes.CDLL(os.environ.get(LIBCUDA_ENV) or "libcuda.so.1")


class ContextStack:
    """CU_LIMIT_STACK_SIZE of a device's primary context (the one the CUDA runtime,
    and so torch, uses), read and set from any thread: each call retains the
    primary context, makes it current for the call and puts back what was current.
    ``cu`` is the driver library (a ctypes CDLL, or a test double with the same
    functions)."""

    def __init__(self, ordinal: int, cu: Any = None):
        self._cu = cu if cu is not None else _libcuda()
        self._check("cuInit", self._cu.cuInit(0))
        dev = ctypes.c_int()
        self._check(f"cuDeviceGet({ordinal})", self._cu.cuDeviceGet(ctypes.byref(dev), ordinal))
        self._dev = dev.value
        self.threads = self._attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) * \
            self._attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR)

    @staticmethod
    def _check(what: str, code: int) -> None:
        if code != 0:
            raise DriverError(what, code)

    def _attr(self, attr: int) -> int:
        v = ctypes.c_int()
        self._check(f"cuDeviceGetAttribute({attr})", self._cu.cuDeviceGetAttribute(ctypes.byref(v), attr, self._dev))
        return v.value

    def _in_context(self, fn):
        ctx = ctypes.c_void_p()
        self._check("cuDevicePrimaryCtxRetain", self._cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), self._dev))
        try:
            self._check("cuCtxPushCurrent", self._cu.cuCtxPushCurrent_v2(ctx))
            try:
                return fn()
            finally:
                self._cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        finally:
            self._cu.cuDevicePrimaryCtxRelease_v2(self._dev)

    def _get(self) -> int:
        v = ctypes.c_size_t()
        self._check("cuCtxGetLimit(STACK_SIZE)", self._cu.cuCtxGetLimit(ctypes.byref(v), CU_LIMIT_STACK_SIZE))
        return int(v.value)

    def get(self) -> int:
        """The per-thread stack in bytes."""
        return self._in_context(self._get)

    def set(self, nbytes: int) -> int:
        """Ask for ``nbytes`` per thread; returns the size the driver chose."""

        def do() -> int:
            self._check(f"cuCtxSetLimit(STACK_SIZE, {nbytes})",
                        self._cu.cuCtxSetLimit(CU_LIMIT_STACK_SIZE, ctypes.c_size_t(nbytes)))
            return self._get()

        return self._in_context(do)

    def mib(self, per_thread: int) -> float:
        """Local memory (MiB) a per-thread stack of that size reserves on this device."""
        return per_thread * self.threads / 2**20


class StandbyStack:
    """The standby's share of the stack policy (module docstring). ``shrink()`` when
    it goes to sleep, ``regrow()`` (returns at once: a thread does the work) when it
    takes over, ``note()`` for the takeover's log line. The two never overlap (a
    lock). Never raises: the stack is an optimisation of the standby's memory, not
    worth a failed start or takeover."""

    def __init__(self, stack: ContextStack | None, mode: str = "reset"):
        self._stack = stack
        self._mode = mode
        self._lock = threading.Lock()
        self.grown = 0  # the stack the engine had before shrink(); 0: nothing to regrow
        self._thread: threading.Thread | None = None
        self._result = ""

    @classmethod
    def for_device(cls, device: str) -> "StandbyStack":
        """For this process's CUDA device ``device`` ("cuda", "cuda:N"), if this
        process has initialised CUDA there (torch); a no-op otherwise (CPU, or a
        group whose ranks are other processes)."""
        if not device.startswith("cuda"):
            return cls(None)
        try:
            mode = policy()
            import torch

            if not torch.cuda.is_initialized():
                return cls(None)
            ordinal = int(device.split(":", 1)[1]) if ":" in device else torch.cuda.current_device()
            return cls(ContextStack(ordinal), mode)
        except Exception as e:  # noqa: BLE001 - see the class docstring
            log.warning("the standby's per-thread stack is left as it is: %s", e)
            return cls(None)

    def shrink(self, asleep: Callable[[], bool] = lambda: True) -> str:
        """Give the stack back; a note for the "asleep" log lines ('' where there is
        no stack to manage, or where ``asleep()``, asked under the lock, says the
        engine is serving again)."""
        if self._stack is None:
            return ""
        with self._lock:
            if not asleep():
                return ""
            self.grown = 0
            try:
                size = self._stack.get()
                if self._mode == "keep" or size <= DEFAULT_STACK_BYTES:
                    return f"; per-thread stack {size} B ({self._stack.mib(size):.0f} MiB), kept"
                t = time.perf_counter_ns()
                after = self._stack.set(DEFAULT_STACK_BYTES)
                took = (time.perf_counter_ns() - t) / 1e6
                self.grown = size
                return (f"; per-thread stack {size} B reset to {after} B while asleep "
                        f"({self._stack.mib(size - after):.0f} MiB of local memory given back, {took:.2f} ms)")
            except Exception as e:  # noqa: BLE001
                return f"; per-thread stack: unknown ({e})"

    def shrink_later(self, say: Callable[[str], Any], asleep: Callable[[], bool]) -> None:
        """shrink(asleep) on a thread of its own, its note passed to ``say`` (a planned
        handover's old engine: its Reply does not wait for the driver; a takeover
        right after it finds the stack as the engine left it, or given back)."""
        if self._stack is not None:
            threading.Thread(target=lambda: say(self.shrink(asleep)), name="frmps-stack", daemon=True).start()

    def regrow(self) -> None:
        """Ask for the engine's stack again, on a thread of its own (none when there
        is nothing to regrow: the common case, a takeover's path)."""
        self._result = ""
        self._thread = None
        if self._stack is None or not self.grown:
            return

        def run() -> None:
            with self._lock:
                size, self.grown = self.grown, 0
                if not size:
                    return
                t = time.perf_counter_ns()
                try:
                    got = self._stack.set(size)
                    self._result = f"per-thread stack back to {got} B in {(time.perf_counter_ns() - t) / 1e6:.2f} ms"
                except Exception as e:  # noqa: BLE001 - the first launch that needs it grows it
                    self._result = (f"per-thread stack not regrown ({e}, after {(time.perf_counter_ns() - t) / 1e6:.2f}"
                                    " ms): the first launch that needs it grows it")

        self._thread = threading.Thread(target=run, name="frmps-stack", daemon=True)
        self._thread.start()

    def note(self, wait_s: float = 0.0) -> str:
        """What the last regrow() did ('' if nothing); waits up to ``wait_s`` for it."""
        t = self._thread
        if t is not None:
            t.join(wait_s)
            if t.is_alive():
                return "per-thread stack regrowth still running"
        return self._result
