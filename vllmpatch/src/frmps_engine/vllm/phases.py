"""Diagnostics: where a step's host time goes inside vLLM (FRMPS_DEBUG_STEP_PHASES).

A takeover's first step cannot overlap its host work with a previous step's
device work (async scheduling does that for every later step), so each
millisecond of that host work — vLLM's scheduler, the V2 model runner
registering the adopted requests, staging their tokens, block tables and
sampler state, preparing the inputs and the attention metadata — is a
millisecond of the takeover. The loop's step lines say how long the host work
took in all; this says in which of vLLM's calls.

With ``FRMPS_DEBUG_STEP_PHASES=1`` the engine wraps the calls named in
``TARGETS`` on the objects of this process's engine (its scheduler and, where
the V2 model runner runs in this process, the runner and its parts). The wrappers
only record while the tracer is armed: the engine loop arms it for the steps it
traces after a takeover, and, with ``FRMPS_DEBUG_STEP_PHASES=N`` (N > 1), also
for every Nth step (a steady step, where the host work overlaps the device, to
compare with). Each such step gets one log line: every wrapped call with its
start after the step began and its duration, in ms, nested calls marked by
depth. Targets missing in a vLLM version are skipped; the tracer is off (and
wraps nothing) unless the variable is set.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any, Callable

# (path from the root objects, method): "scheduler" is the engine core's
# scheduler, "runner" its model runner (V2: vllm/v1/worker/gpu/model_runner.py).
TARGETS: tuple[tuple[str, str], ...] = (
    ("scheduler", "schedule"),
    ("scheduler", "update_from_output"),
    ("runner", "execute_model"),
    ("runner", "finish_requests"),
    ("runner", "add_requests"),
    ("runner", "update_requests"),
    ("runner", "prepare_inputs"),
    ("runner", "prepare_attn"),
    ("runner", "sample_tokens"),
    ("runner", "sample"),
    ("runner", "postprocess_sampled"),
    ("runner.req_states", "add_request"),
    ("runner.req_states", "apply_staged_writes"),
    ("runner.block_tables", "append_block_ids"),
    ("runner.block_tables", "apply_staged_writes"),
    ("runner.model_state", "add_request"),
    ("runner.model_state", "apply_staged_writes"),
    ("runner.model_state", "prepare_inputs"),
    ("runner.model_state", "prepare_attn"),
    ("runner.sampler", "add_request"),
    ("runner.sampler", "apply_staged_writes"),
    ("runner.cudagraph_manager", "run_fullgraph"),
    ("runner.cudagraph_manager", "run_pw_graph"),
    ("runner.kv_connector", "pre_forward"),
    # frmps's own work inside a step: adopted requests' prefix-cache work
    # (adoption.DeferredPrefixCache, run once the second step is launched).
    ("frmps.deferred_prefix_cache", "run"),
)


def every_from_env(env: dict[str, str] | None = None) -> int | None:
    """None: off. 1: the traced steps after a takeover. N > 1: also every Nth step."""
    raw = (os.environ if env is None else env).get("FRMPS_DEBUG_STEP_PHASES", "").strip()
    if not raw.isdigit() and raw != "":
        raise ValueError(f"FRMPS_DEBUG_STEP_PHASES={raw!r}: want 0, 1 or a step interval")
    return int(raw or 0) or None


def _resolve(roots: dict[str, Any], path: str) -> Any:
    head, *rest = path.split(".")
    obj = roots.get(head)
    for part in rest:
        if obj is None:
            return None
        obj = getattr(obj, part, None)
    return obj


class StepPhases:
    """Times the wrapped calls of one armed step (see the module's doc)."""

    def __init__(self, roots: dict[str, Any], every: int = 1, targets=TARGETS):
        self.every = every
        self.wrapped: list[str] = []
        self._armed = False
        self._thread: int | None = None
        self._t0 = 0
        self._depth = 0
        self._events: list[tuple[int, int, int, str]] = []  # (start ns, end ns, depth, name)
        for path, name in targets:
            obj = _resolve(roots, path)
            fn = getattr(obj, name, None) if obj is not None else None
            if not callable(fn) or getattr(fn, "_frmps_phase", False):
                continue
            label = name if path in ("scheduler", "runner") else f"{path.split('.', 1)[1]}.{name}"
            setattr(obj, name, self._wrap(fn, label))
            self.wrapped.append(label)

    def _wrap(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self._armed or threading.get_ident() != self._thread:
                return fn(*args, **kwargs)
            depth = self._depth
            self._depth = depth + 1
            t = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self._events.append((t, time.perf_counter_ns(), depth, label))
                self._depth = depth

        timed._frmps_phase = True  # type: ignore[attr-defined]
        return timed

    def due(self, step: int) -> bool:
        """Whether the loop should trace step number ``step`` (1-based) on its own."""
        return self.every > 1 and step % self.every == 0

    def arm(self) -> None:
        """Record the calls the current thread makes until report()."""
        self._events = []
        self._depth = 0
        self._thread = threading.get_ident()
        self._t0 = time.perf_counter_ns()
        self._armed = True

    def report(self) -> str:
        """Disarm; the recorded calls in start order as "name start+duration" (ms
        from arm()), each nested call prefixed by one '>' per level."""
        self._armed = False
        events = sorted(self._events, key=lambda e: (e[0], e[2]))
        self._events = []
        if not events:
            return "no vLLM call traced"
        parts = [f"{'>' * d}{name} {(s - self._t0) / 1e6:.2f}+{(e - s) / 1e6:.2f}" for s, e, d, name in events]
        return ", ".join(parts)


def install(core: Any, runner: Any, env: dict[str, str] | None = None, frmps: Any = None) -> StepPhases | None:
    """The tracer for an engine core (and its model runner, None where it runs in
    other processes; ``frmps``: the adapter's core, for its own work), when
    FRMPS_DEBUG_STEP_PHASES asks for one."""
    every = every_from_env(env)
    if every is None:
        return None
    return StepPhases({"scheduler": getattr(core, "scheduler", None), "runner": runner, "frmps": frmps}, every)
