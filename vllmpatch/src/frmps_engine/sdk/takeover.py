"""A standby's takeover (a Resume), both modes: the runner's part of it.

The KV flip (``KvFlip``: the KV cache made writable on a thread of its own,
beside the adoption and, behind a device gate, the first step's host work), the
takeover's times and its log line (``Takeover``), and ``Takeovers``: the
Runner's Resume handling (checks, adoption of each request, the ring, the reply;
the Runner mixes it in, runner.py).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from frmps_engine._proto.frmps.v1 import control_pb2

from .engine_api import DeviceGate, vocab_size
from .genapi import input_to_ids, pb_ints
from .loop import EngineLoop, RingPublisher, is_device_error
from .memory import MemoryBackend
from .params import InvalidRequest, normalize
from .stack import StandbyStack

# The runner's logger: these are the engine process's lifecycle lines, under one name.
log = logging.getLogger("frmps_engine.sdk.runner")


class KvFlip:
    """``memory.make_writable("kv_cache")`` on a thread of its own, started at
    construction; ``join()`` waits for it, returns how long it took (ns) and
    raises what it raised."""

    def __init__(self, memory: MemoryBackend, needed: bool = True):
        self._memory = memory
        self._took = 0
        self._error: BaseException | None = None
        self._done = threading.Event()
        self.done_ns = 0  # perf_counter_ns when the flip ended
        self.gate_entered_ns = 0  # when the device gate's wait began (the engine loop's thread)
        self.gate_reached = threading.Event()  # set there: the first step's host work is done
        self._thread: threading.Thread | None = None
        if not needed:  # the KV cache is writable already (FRMPS_STANDBY_KV=writable): no thread
            self.done_ns = time.perf_counter_ns()
            self._done.set()
            return
        self._thread = threading.Thread(target=self._run, name="frmps-kv-flip", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t = time.perf_counter_ns()
        try:
            self._memory.make_writable("kv_cache")
        except BaseException as e:  # re-raised by join() on the takeover's thread
            self._error = e
        self.done_ns = time.perf_counter_ns()
        self._took = self.done_ns - t
        self._done.set()

    def join(self) -> int:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._took

    def wait(self) -> None:
        """The device gate (engine_api.DeviceGate): returns once the KV cache is
        writable; raises the flip's error."""
        self.gate_entered_ns = time.perf_counter_ns()
        self.gate_reached.set()
        self._done.wait()
        if self._error is not None:
            raise self._error


@dataclass
class Takeover:
    """A takeover's times up to its reply (Runner._beside_the_flip)."""

    flip: KvFlip
    gated: bool = False
    started: Any = None  # what the start function returned (core mode: the connection's ns)
    ring_error: str = ""
    adopt_ns: int = 0
    adopt_cpu_ns: int = 0
    ring_ns: int = 0
    wake_ns: int = 0
    reply_waited_ns: int = -1  # how long the reply waited for the first step's host work (-1: it did not)

    def line(self, outcomes: list, took: int, loop: EngineLoop, t0: int) -> str:
        """The takeover's log line (bench/loglines.py TAKEOVER reads it)."""
        return (f"took over {len(outcomes)} requests in {took / 1e6:.2f} ms "
                f"({sum(o.reused_tokens for o in outcomes)} reused tokens, "
                f"{sum(o.prefilled_tokens for o in outcomes)} to prefill; KV writable in {self.wake_ns / 1e6:.3f} ms; "
                f"adoption {self.adopt_ns / 1e6:.2f} ms, ring attach {self.ring_ns / 1e6:.2f} ms; "
                f"adoption CPU {self.adopt_cpu_ns / 1e6:.2f} ms, the KV flip beside it); "
                + self._gate_note(loop.started_ns - t0, t0)
                + (f"; the reply waited {self.reply_waited_ns / 1e6:.2f} ms for the first step's host work"
                   if self.reply_waited_ns >= 0 else ""))

    def first_step_note(self, t0: int, stack: "StandbyStack") -> str:
        """For the loop's first-step line, written once that step is done: when its
        host work reached the device gate (the takeover's line is written before, and
        at a fast flip cannot say), and what the stack's regrowth did."""
        parts = []
        entered, done = self.flip.gate_entered_ns, self.flip.done_ns
        if self.gated and entered:
            parts.append(f"reached the device gate {(entered - t0) / 1e6:.2f} ms into the takeover, "
                         f"{(entered - done) / 1e6:+.2f} ms from the flip's end")
        note = stack.note()
        if note:
            parts.append(note)
        return "; ".join(parts)

    def _gate_note(self, t_loop: int, t0: int) -> str:
        """The line's account of the first step's start (the device gate)."""
        where = "beside" if self.gated else "after"
        started = f"loop started {where} the KV flip, {t_loop / 1e6:.2f} ms into the takeover"
        if not self.gated:
            return started
        entered, done = self.flip.gate_entered_ns, self.flip.done_ns
        if not entered or entered > done:
            return (f"{started}; its first step's host work had not reached the device gate when the flip ended"
                    + (f" ({(done - t0) / 1e6:.2f} ms into the takeover)" if done else ""))
        return (f"{started}; its first step's host work reached the device gate {(entered - t0) / 1e6:.2f} ms "
                f"into the takeover and waited {(done - entered) / 1e6:.2f} ms there for the flip")


# The most a takeover's reply waits for its first step's host work (Runner._beside_the_flip).
REPLY_AFTER_HOST_WORK_MAX_S = 0.02


class Takeovers:
    """The Runner's Resume handling (a mixin: the Runner's state and its other
    methods are its own, runner.py)."""

    def on_resume(self, env_id: int, msg: control_pb2.Resume):
        t0 = time.perf_counter_ns()
        if self.role != control_pb2.ROLE_STANDBY or not self._slept or self._resumed:
            return control_pb2.Reply(ok=False, error="Resume is for a sleeping standby (send Sleep first)")
        mismatch = self._resume_mismatch(msg)
        if mismatch:  # refused whole, nothing adopted: still a sleeping standby
            log.error("%s", mismatch)
            return control_pb2.Reply(ok=False, error=mismatch)
        self._resumed = True
        # No collector pass in the middle of a takeover (it is re-enabled below).
        gc.disable()
        try:
            if self.cfg.core_mode:
                return self._take_over_core(env_id, msg, t0)
            return self._take_over(env_id, msg, t0)
        finally:
            gc.enable()

    def _resume_mismatch(self, msg: control_pb2.Resume) -> str:
        """Why this Resume's requests are of the other frontend's kind ("" when
        they fit): requests with ``engine_request`` come from vLLM's API server as
        the frontend and are adopted only in core mode; requests without it come
        from the Go front door and are adopted only in the normal mode."""
        if self.cfg.core_mode:
            bad = [r.key for r in msg.requests if not r.engine_request]
            if bad:
                return (f"Resume refused: this engine serves vLLM's engine-core protocol (core mode), and "
                        f"{len(bad)} of {len(msg.requests)} requests carry no engine_request (keys "
                        f"{_keys(bad)}): a resume set of the generation API's front door? Nothing adopted")
            return ""
        bad = [r.key for r in msg.requests if r.engine_request]
        if bad:
            return (f"Resume refused: {len(bad)} of {len(msg.requests)} requests carry engine_request (keys "
                    f"{_keys(bad)}), a resume set of vLLM's API server as frontend, but this engine serves "
                    f"frmps's generation API (not core mode). Nothing adopted")
        return ""

    def _take_over_core(self, env_id: int, msg: control_pb2.Resume, t0: int):
        """Core mode's takeover: adopt the frontend's requests (their EngineCoreRequests
        with the tokens it received and the ring's snapshots) beside the KV flip,
        attach the ring, connect to the frontend under the engine's identity (the
        ready message: its held messages follow, and the adopted requests' outputs
        continue each stream where the frontend stopped) and reply. With a device
        gate the connection and the first step's host work come before the flip's
        end (``_beside_the_flip``); without one, after the reply."""
        self.server = self._engine_core_server(msg.sync_every or self.welcome.sync_every or 1)
        self.loop = self.server.loop

        def adopt() -> list:
            try:
                adopted = self.server.adopt_resume(msg.requests)
            except Exception as e:  # one request's failure is its outcome; this is the engine's
                if is_device_error(e):
                    self._fatal(e)
                raise
            return [control_pb2.ResumeOutcome(key=o.key, ok=o.ok, error=o.error, reused_tokens=o.reused_tokens,
                                              prefilled_tokens=o.prefill_tokens) for o in adopted]

        outcomes, tk = self._beside_the_flip(msg, adopt, self._start_core_server, t0)
        took = self._reply_serving(env_id, outcomes, tk.ring_error, t0)
        t_connect = tk.started if tk.gated else self._start_core_server()
        log.info("%s; connected to the frontend in %.2f ms, %s the reply (%s)", tk.line(outcomes, took, self.loop, t0),
                 t_connect / 1e6, "before" if tk.gated else "after", self._serving_on())
        self.log_counters("after takeover")
        return None

    def _start_core_server(self) -> int:
        """Connect to the frontend, send the ready message, start the loop; returns
        how long that took (ns). Not connected, the engine is of no use: the
        frontend would wait for it forever."""
        t = time.perf_counter_ns()
        try:
            self.server.start()
        except Exception as e:
            self._fatal(e)
            raise  # not reached: _fatal exits
        return time.perf_counter_ns() - t

    def _prepare_first_steps(self) -> None:
        self.loop.trace_steps = 3
        # The first step's outputs go out as soon as its device work is done, not once
        # a pipelined core's next batch is in flight (EngineLoop.deliver_first_step).
        self.loop.deliver_first_step = True

    def _reply_serving(self, env_id: int, outcomes: list, ring_error: str, t0: int) -> int:
        """Become the serving active and send the Resume's Reply; returns the takeover's ns."""
        self.backend.loop = self.loop
        self.role = control_pb2.ROLE_ACTIVE
        self.backend.is_serving = True
        took = time.perf_counter_ns() - t0
        self.client.reply(env_id, control_pb2.Reply(ok=True, error=ring_error, took_ns=took, resumed=outcomes))
        return took

    def _attach_resume_ring(self, msg: control_pb2.Resume) -> str:
        """Attach the ring a Resume names; "" or why the engine serves without it. Its
        FULL record goes out with the first step (EngineLoop.attach_ring), off the path
        to the first resumed token."""
        ring_path = msg.ring_path or self.welcome.ring_path
        if not ring_path:
            return ""
        try:
            self.loop.attach_ring(RingPublisher(ring_path, self.cfg.ring_module), full_now=False)
        except Exception as e:
            if is_device_error(e):
                raise
            # Serving without a ring beats not serving: only the next failover loses
            # its snapshot. The Reply says so; the supervisor decides what to do.
            msg_ = f"serving without the ring: attach {ring_path}: {e}"
            log.error("%s", msg_)
            return msg_
        return ""

    def _take_over(self, env_id: int, msg: control_pb2.Resume, t0: int):
        self.loop = self._engine_loop(msg.sync_every or self.welcome.sync_every or 1)
        outcomes, tk = self._beside_the_flip(msg, lambda: [self._adopt(r) for r in msg.requests], self.loop.start, t0)
        took = self._reply_serving(env_id, outcomes, tk.ring_error, t0)
        if not tk.gated:
            self.loop.start()
        log.info("%s", tk.line(outcomes, took, self.loop, t0))
        self.log_counters("after takeover")
        return None

    def _beside_the_flip(self, msg: control_pb2.Resume, adopt: Callable[[], list],
                         start: Callable[[], Any], t0: int) -> tuple[list, "Takeover"]:
        """A takeover up to its reply, both modes. The KV flip overlaps the adoption
        and, behind a device gate, the first step's host work: after a fault the
        flip's driver call waits on the MPS server tearing the dead context down
        (ctypes releases the GIL meanwhile), and adoption is host work on the
        scheduler only. Once the requests are adopted and the ring attached, a core
        with engine_api.DeviceGate gets the gate and ``start`` runs (the loop
        starts: it schedules and prepares its first step and waits at the gate for
        the flip before its first device work that touches the KV cache); without
        one the caller starts the loop after the flip. Returns the adoption's
        outcomes and the takeover's times (``t0``: when the Resume arrived)."""
        tk = Takeover(KvFlip(self.memory, needed=not self._kv_writable))
        self._standby_stack().regrow()  # beside the flip and the adoption (sdk/stack.py)
        # Negative controls (FRMPS_TEST_TAKEOVER_FAULT, tests and benches only).
        faults = self._faults.arm(self.core) if self._faults is not None else None
        try:
            t, c = time.perf_counter_ns(), time.thread_time_ns()
            if faults is not None:
                faults.install()
                try:
                    outcomes = adopt()
                finally:
                    faults.remove()
            else:
                outcomes = adopt()
            tk.adopt_cpu_ns, tk.adopt_ns = time.thread_time_ns() - c, time.perf_counter_ns() - t
            t = time.perf_counter_ns()
            tk.ring_error = self._attach_resume_ring(msg)  # inline: the loop has not started
            tk.ring_ns = time.perf_counter_ns() - t
            self._prepare_first_steps()
            self.loop.first_step_note = lambda: tk.first_step_note(t0, self._standby_stack())
            wait = tk.flip.wait if faults is None else faults.gate(tk.flip.wait)
            if self._kv_digests is not None:  # a diagnostic: after the controls' KV writes
                wait = self._digest_after(wait, msg, outcomes)
            if isinstance(self.core, DeviceGate) and self.core.gate_device(wait):
                tk.gated = True
                tk.started = start()
        finally:
            tk.wake_ns = tk.flip.join()  # raises the flip's error (a device error: the engine is lost)
        if faults is not None and not tk.gated:
            faults.apply_kv()  # the KV cache is writable and the loop has not started
        if self._kv_digests is not None and not tk.gated:
            self._record_adopted(msg, outcomes)
        if tk.gated and any(o.ok for o in outcomes):
            # The reply, the supervisor's promotion and the front door's streams
            # attaching to this engine (its generation server's threads) all want the
            # GIL, and beside the first step's host work they would delay the step's
            # launch. Once that host work has reached the device gate the device runs
            # the step for milliseconds: reply then. Bounded, for a first step that
            # never gets there (a kernel compiled on the spot, a step that fails).
            t = time.perf_counter_ns()
            tk.flip.gate_reached.wait(REPLY_AFTER_HOST_WORK_MAX_S)
            tk.reply_waited_ns = time.perf_counter_ns() - t
        return outcomes, tk

    def _digest_after(self, wait: Callable[[], None], msg: control_pb2.Resume, outcomes: list) -> Callable[[], None]:
        def gated() -> None:
            wait()
            self._record_adopted(msg, outcomes)

        return gated

    def _record_adopted(self, msg: control_pb2.Resume, outcomes: list) -> None:
        """FRMPS_DEBUG_KV_DIGESTS (sdk/kv_digest.py): the KV of every request adopted
        with KV, as the snapshot's blocks hold it for the tokens the adoption reused."""
        reused = {o.key: int(o.reused_tokens) for o in outcomes if o.ok and o.reused_tokens}
        entries = []
        for r in msg.requests:
            if r.key not in reused or not r.HasField("snapshot"):
                continue
            snap = r.snapshot
            if snap.token_ids:
                tokens = list(snap.token_ids)
            elif r.prompt_token_ids:
                tokens = list(r.prompt_token_ids) + list(snap.output_token_ids)
            else:
                continue  # a prompt as text: its tokens are the engine's, not the message's
            entries.append((r.key, tokens, reused[r.key], list(snap.block_ids)))
        self._kv_digests.write(self.core, "adopt", entries)

    def _adopt(self, r: control_pb2.ResumeRequest) -> control_pb2.ResumeOutcome:
        in_core = False  # the core took the request: a later failure must abort it there
        try:
            if self.loop.get(r.key) is not None:
                raise InvalidRequest(f"request key {r.key} appears twice in the resume set")
            tok = self.adapter.tokenizer()
            # Each repeated field is read into a list once (a cost per item); the lists
            # go on to the core as they are.
            ids = input_to_ids(
                tok,
                prompt=r.prompt,
                prompt_token_ids=r.prompt_token_ids if r.prompt_token_ids else None,
                messages=list(r.messages) if r.messages else None,
                tools_json=r.tools_json,
            )
            if not ids:
                raise InvalidRequest("empty prompt")
            params = normalize(r.params, r.key, len(ids), self.adapter.max_model_len, vocab_size(tok))
            delivered = pb_ints(r.delivered_token_ids)
            if r.HasField("snapshot"):
                snap = r.snapshot
                if not snap.token_ids and snap.num_prompt_tokens and r.prompt_token_ids and not r.messages:
                    # The supervisor left the prompt out (it is this request's prompt_token_ids,
                    # control.proto): convert and check each prompt token once, not twice.
                    if snap.num_prompt_tokens != len(ids):
                        raise InvalidRequest("snapshot prompt length differs from the request's prompt")
                    token_ids = ids + pb_ints(snap.output_token_ids)
                else:
                    token_ids = pb_ints(snap.token_ids)
                    if snap.num_prompt_tokens != len(ids) or token_ids[: len(ids)] != ids:
                        raise InvalidRequest("snapshot prompt tokens differ from the request's prompt")
                seed = snap.seed
                params.seed = seed
                res = self.core.adopt_request(
                    r.key, self.adapter.sampling_params(params, seed), token_ids, snap.num_prompt_tokens,
                    snap.num_computed_tokens, pb_ints(snap.block_ids), seed, delivered,
                )
                in_core = True
                reused, prefilled = int(res.reused_tokens), int(res.prefill_tokens)
            elif delivered:
                # Never reached a sync: full prefill of prompt + delivered output.
                res = self.core.adopt_request(
                    r.key, self.adapter.sampling_params(params, params.seed), ids, len(ids), 0, [], params.seed, delivered,
                )
                in_core = True
                reused, prefilled = int(res.reused_tokens), int(res.prefill_tokens)
            else:
                self.core.add_request(r.key, ids, self.adapter.sampling_params(params, params.seed))
                in_core = True
                reused, prefilled = 0, len(ids)
            self.loop.register_adopted(r.key, len(ids), params, delivered, prompt_ids=ids)
            return control_pb2.ResumeOutcome(key=r.key, ok=True, reused_tokens=reused, prefilled_tokens=prefilled)
        except Exception as e:
            if is_device_error(e):
                self._fatal(e)
            log.warning("takeover of request %d failed: %s", r.key, e)
            if in_core:  # it must not run on with no stream to follow it
                try:
                    self.core.abort(r.key)
                except Exception as abort_error:
                    log.warning("takeover of request %d: abort after the failure: %s", r.key, abort_error)
            return control_pb2.ResumeOutcome(key=r.key, ok=False, error=str(e))


def _keys(keys: list[int], most: int = 8) -> str:
    shown = ", ".join(str(k) for k in keys[:most])
    return shown + (f", … ({len(keys) - most} more)" if len(keys) > most else "")
