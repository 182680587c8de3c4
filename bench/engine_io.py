"""What the bench's engine processes (baseline_engine, sync_overhead, vllm_baseline)
share: JSON-line events on stdout, commands on stdin, the exit on a sticky device
error, and the recovery of requests without KV (a re-prefill of prompt +
delivered tokens) for any core with the reference engine's interface. Standard
library only (imported before the heavy imports are timed).
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from typing import Any, Callable

_out_lock = threading.Lock()


def emit(ev: str, **kw) -> None:
    kw.setdefault("t", time.time())
    line = json.dumps({"ev": ev, **kw}, separators=(",", ":"))
    with _out_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def die_on_device_error(e: BaseException) -> None:
    """A CUDA error is sticky: report it and exit at once, like an engine does."""
    from frmps_engine.sdk.loop import is_device_error

    if is_device_error(e):
        try:
            emit("fault", error=str(e).splitlines()[0][:300] if str(e) else type(e).__name__)
        finally:
            os._exit(3)


def sync(device: str) -> None:
    if device != "cpu":
        import torch

        torch.cuda.synchronize()


def read_commands(q: queue.Queue) -> None:
    for line in sys.stdin:
        line = line.strip()
        if line:
            try:
                q.put(json.loads(line))
            except json.JSONDecodeError as e:
                emit("error", error=f"bad command: {e}")
    q.put({"cmd": "eof"})


def step_delay() -> float:
    """FRMPS_TEST_STEP_DELAY_MS: the engines' test knob (CPU checks slow every step so that
    kill points land on time); the bench sets it for the victim too on the CPU, never on the GPU."""
    try:
        return max(0.0, float(os.environ.get("FRMPS_TEST_STEP_DELAY_MS", "0") or 0) / 1000)
    except ValueError:
        return 0.0


def recover(core, requests: list[dict], sampling: Callable[[dict], Any]) -> dict:
    """Adopt each request with no KV (prompt + delivered tokens recomputed in one
    pass: the engine's own path for a request with no snapshot) and step until
    every one has its next token. Emits first_token per request."""
    for r in requests:
        core.adopt_request(int(r["key"]), sampling(r), r["prompt"], len(r["prompt"]), 0, [], r.get("seed"),
                           r.get("delivered", []))
    waiting = {int(r["key"]) for r in requests}
    first: dict[int, float] = {}
    steps = 0
    if not core.has_work():
        raise RuntimeError("nothing to recover: every request had finished before the fault")
    while waiting:
        outs = core.step()
        steps += 1
        t = time.time()
        for o in outs:
            if o.key in waiting and o.new_token_ids:
                first[o.key] = t
                emit("first_token", key=o.key, i=o.output_index, ids=list(o.new_token_ids), t=t)
                waiting.discard(o.key)
        if not core.has_work() and waiting:
            raise RuntimeError(f"requests {sorted(waiting)} had finished before the fault: nothing to recover")
    return {"steps": steps, "first_token_unix": first}


def decode_more(core, n_steps: int) -> None:
    for _ in range(n_steps):
        if not core.has_work():
            break
        t0 = time.time()
        outs = core.step()
        t = time.time()
        for o in outs:
            if o.new_token_ids:
                emit("tok", key=o.key, i=o.output_index, ids=list(o.new_token_ids), t=t, step_s=round(t - t0, 6))


def serve_victim(core, sampling: Callable[[dict], Any], t_process: float) -> int:
    """The victim's life: say ready, take "generate" commands, step, emit every token,
    until stdin ends (or the fault kills the process)."""
    delay = step_delay()
    emit("ready", pid=os.getpid(), init_s=round(time.time() - t_process, 3))
    q: queue.Queue = queue.Queue()
    threading.Thread(target=read_commands, args=(q,), daemon=True).start()
    while True:
        try:
            while True:
                cmd = q.get(block=not core.has_work())
                if cmd["cmd"] in ("exit", "eof"):
                    return 0
                if cmd["cmd"] == "generate":
                    for r in cmd["requests"]:
                        core.add_request(int(r["key"]), r["prompt"], sampling(r))
        except queue.Empty:
            pass
        try:
            outs = core.step()
        except Exception as e:
            die_on_device_error(e)
            raise
        if delay:
            time.sleep(delay)
        t = time.time()
        for o in outs:
            if o.new_token_ids:
                emit("tok", key=o.key, i=o.output_index, ids=list(o.new_token_ids), t=t)
            if o.finished:
                emit("finished", key=o.key, t=t)


def serve_sleep_commands(core, sampling: Callable[[dict], Any], wake: Callable[[], dict],
                         sleep: Callable[[], None]) -> int:
    """The sleep-only victim's command loop, once its engine is built and asleep:
    "wake" runs ``wake()`` (its timings go into the "woke" event), then the
    recovery of the command's requests, then "then_steps" more steps; "sleep" runs
    ``sleep()``. Until stdin ends."""
    import traceback

    q: queue.Queue = queue.Queue()
    threading.Thread(target=read_commands, args=(q,), daemon=True).start()
    awake = False
    while True:
        cmd = q.get()
        if cmd["cmd"] in ("exit", "eof"):
            return 0
        try:
            if cmd["cmd"] == "wake":
                if awake:
                    emit("error", error="already awake")
                    continue
                t_cmd = time.time()
                w0 = time.perf_counter()
                fields = wake()
                awake = True
                w1 = time.perf_counter()
                rec = recover(core, cmd["requests"], sampling)
                w2 = time.perf_counter()
                emit("woke", received_unix=t_cmd, **fields, prefill_s=round(w2 - w1, 6), total_s=round(w2 - w0, 6),
                     steps=rec["steps"])
                decode_more(core, int(cmd.get("then_steps", 0)))
                emit("decoded")
            elif cmd["cmd"] == "sleep":
                sleep()
                awake = False
                emit("slept")
            else:
                emit("error", error=f"unknown command {cmd.get('cmd')!r}")
        except Exception as e:
            die_on_device_error(e)
            emit("error", error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
