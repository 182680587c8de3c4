"""The engine side of vLLM's engine-core protocol, for frmps's vLLM engine
(``OPENAI.md``, design (a), "What building it takes", step 2).

vLLM's API server (with ``FrmpsAsyncMPClient``, ``client.py``) binds a ROUTER
for inputs and a PULL for outputs; an engine connects a DEALER with identity
``engine_index.to_bytes(2, "little")`` and a PUSH, sends its ready message on
the DEALER, then receives ``(type, *msgpack frames)`` messages and pushes
msgpack-encoded ``EngineCoreOutputs`` (v1/engine/core.py:1933-2108; 0.26:
:1583-1753; ``OPENAI.md`` has the client's lines). ``EngineCoreServer`` speaks
that protocol around frmps's ``VllmCore`` (``core.py``):

- the engine loop is the SDK's ``EngineLoop`` (``sdk/loop.py``), the one the
  runner drives: it steps the core, publishes the ring (every ``sync_every``
  steps, plus after a first token, overlapped with the next step where the core
  allows) and reports device errors. Its request streams are not used: the
  core hands each step's outputs, as vLLM's scheduler made them, to this
  server (``VllmCore.engine_outputs``), which sends them unchanged, so logprobs,
  stop reasons and events reach vLLM's output processor as from vLLM's own
  engine;
- inputs are decoded with vLLM's ``MsgpackDecoder`` on an input thread (as
  vLLM's ``process_input_sockets`` does) and handed to the loop thread; outputs
  are encoded with vLLM's ``MsgpackEncoder`` on an output thread;
- ADD: the request must come from the frmps client (``ledger.py``): named
  ``frmps-<key>`` with its ring key in ``sampling_params.extra_args['frmps_key']``
  and a seed; it is added as vLLM's ``Request.from_engine_core_request`` builds
  it, with its own SamplingParams. What a standby could not resume is refused
  with an error output for that request (``FinishReason.ERROR``), as vLLM
  refuses a request it cannot preprocess (``_send_error_outputs_to_client``);
- ABORT: the ids are aborted in the core; UTILITY: the calls vLLM's API server
  makes on its own (``reset_mm_cache`` and ``get_supported_tasks`` at start:
  launchers/api_server/entry.py:107, 132; 0.26: entrypoints/openai/api_server.py:188,
  670) and the harmless dev-mode ones are answered; every other method fails
  with a message naming it (the caller gets vLLM's utility-call exception);
- it never sends ``ENGINE_CORE_DEAD``: an engine that fails goes silent and the
  supervisor reports the death (``FrmpsAsyncMPClient.engine_lost``). vLLM's
  client treats that message as fatal to every request.

A promoted standby adopts the frontend's resume entries before it connects
(``adopt_entries``): each request continues after the tokens the frontend
received (``EngineCoreOutput`` carries no index, so the engine emits only new
tokens, which vLLM's scheduler does for an adopted request).

The runner's core mode (``sdk/runner.py``, ``cli serve --core-input/--core-output``)
runs one of these in the engine process in place of the generation API: an
active from its start, a promoted standby after it adopted a control Resume
(``adopt_resume``: the ``ResumeRequest.engine_request`` bytes), and a planned
handover leaves through ``hand_over``. Not launched by ``frmps serve`` yet
(``OPENAI.md``, "Status").
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import zmq

from ...sdk.loop import EngineLoop, RingPublisher, is_device_error
from ...sdk.seeds import to_uint64
from ..state import key_for_request_id, request_id_for_key
from ..adoption import request_fields
from . import HANDOVER_FENCE_CALL_ID
from .ledger import EXTRA_ARGS_KEY

log = logging.getLogger(__name__)

_DRAINED = object()  # queued last by hand_over: the output thread has sent everything before it


class RefusedRequest(ValueError):
    """A request this engine cannot serve (and a standby could not resume)."""


def check_request(request: Any) -> int:
    """The ring key of an ``EngineCoreRequest`` the frmps client sent; raises
    RefusedRequest (with the reason) for anything a standby could not resume."""
    rid = request.request_id
    sp = request.sampling_params
    if sp is None:
        raise RefusedRequest(f"request {rid}: frmps engines serve generation only (no sampling params)")
    key = (sp.extra_args or {}).get(EXTRA_ARGS_KEY)
    if type(key) is not int or key < 1:
        raise RefusedRequest(f"request {rid}: no ring key in sampling_params.extra_args[{EXTRA_ARGS_KEY!r}] "
                             "(requests must come through frmps's engine-core client)")
    if rid != request_id_for_key(key):
        raise RefusedRequest(f"request {rid}: ring key {key} names {request_id_for_key(key)}")
    if sp.seed is None:
        raise RefusedRequest(f"request {rid}: no seed (frmps's client fixes one on every request)")
    if request.prompt_token_ids is None or getattr(request, "prompt_embeds", None) is not None:
        raise RefusedRequest(f"request {rid}: prompt embeddings cannot be resumed")
    if not request.prompt_token_ids:
        raise RefusedRequest(f"request {rid}: empty prompt")
    if request.mm_features:
        raise RefusedRequest(f"request {rid}: not yet: multimodal inputs (adoption does not carry them)")
    if request.lora_request is not None:
        raise RefusedRequest(f"request {rid}: not yet: LoRA adapters (adoption does not carry them)")
    if getattr(request, "resumable", False):
        raise RefusedRequest(f"request {rid}: not yet: streaming-input (resumable) requests")
    return key


@dataclass
class ResumeItem:
    """One request to adopt: the EngineCoreRequest as the frontend sent it and
    the output tokens it received (what ``adopt_entries`` reads of a
    ``ledger.Entry``)."""

    key: int
    request: Any
    delivered: list[int]

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self.request.prompt_token_ids or ())


@dataclass
class RingState:
    """A ring snapshot of one request as ``adopt_entries`` reads it, from a
    control ``RequestSnapshot``."""

    tokens: list[int]
    num_prompt: int
    num_computed: int
    blocks: list[int]
    seed: int

    @classmethod
    def from_pb(cls, snap: Any) -> "RingState":
        return cls(list(snap.token_ids), int(snap.num_prompt_tokens), int(snap.num_computed_tokens),
                   list(snap.block_ids), int(snap.seed))


@dataclass
class EntryOutcome:
    key: int
    request_id: str
    ok: bool
    error: str = ""
    reused_tokens: int = 0
    prefill_tokens: int = 0


def adopt_entries(core: Any, entries: Iterable[Any], snapshots: Mapping[int, Any]) -> list[EntryOutcome]:
    """Adopt the frontend's resume entries (``ledger.Entry``: the EngineCoreRequest
    as sent, the output tokens the frontend received) into ``core`` (a VllmCore),
    each with its own SamplingParams and seed.

    ``snapshots`` maps ring keys to the ring's committed state of each request
    (``frmps_engine.ring.reader`` States, or anything with ``tokens``,
    ``num_prompt``, ``num_computed``, ``blocks``, ``seed``). With a snapshot the
    request is adopted on its KV blocks (``VllmCore.adopt_request``, as the
    runner's takeover does); without one it is prefilled over prompt + received
    tokens, or added afresh when nothing was received. Structured-output requests
    get their grammar advanced over the received tokens (adoption.py).

    Runs on the loop's thread (or before the loop starts). One entry's failure
    does not stop the others: its outcome says why, and a device error is raised."""
    from vllm.v1.request import Request

    out: list[EntryOutcome] = []
    for e in entries:
        rid = getattr(e.request, "request_id", "?")
        in_core = False
        try:
            key = check_request(e.request)
            if key != e.key:
                raise RefusedRequest(f"request {rid}: entry key {e.key} differs from the request's {key}")
            sp = e.request.sampling_params
            prompt = list(e.prompt_token_ids)
            if list(e.request.prompt_token_ids) != prompt:
                raise RefusedRequest(f"request {rid}: entry prompt differs from the request's")
            delivered = list(e.delivered)
            seed = to_uint64(sp.seed)
            snap = snapshots.get(key)
            if snap is not None:
                tokens = list(snap.tokens)
                if int(snap.num_prompt) != len(prompt) or tokens[: len(prompt)] != prompt:
                    raise RefusedRequest(f"request {rid}: the ring's prompt differs from the request's")
                if int(snap.seed) != seed:
                    raise RefusedRequest(f"request {rid}: the ring's seed {snap.seed} differs from the request's {seed}")
                res = core.adopt_request(key, sp, tokens, len(prompt), int(snap.num_computed), list(snap.blocks),
                                         seed, delivered, request_fields(e.request))
                in_core = True
                reused, prefill = int(res.reused_tokens), int(res.prefill_tokens)
            elif delivered:
                res = core.adopt_request(key, sp, prompt, len(prompt), 0, [], seed, delivered, request_fields(e.request))
                in_core = True
                reused, prefill = int(res.reused_tokens), int(res.prefill_tokens)
            else:
                core.add_vllm_request(key, Request.from_engine_core_request(e.request, core.core.request_block_hasher))
                in_core = True
                reused, prefill = 0, len(prompt)
            out.append(EntryOutcome(key, rid, True, reused_tokens=reused, prefill_tokens=prefill))
        except Exception as ex:
            if is_device_error(ex):
                raise
            log.warning("adoption of %s failed: %s", rid, ex)
            if in_core:
                core.abort(e.key)
            out.append(EntryOutcome(int(e.key), rid, False, error=str(ex)))
    return out


# Utility calls answered without the core (text-only generation engine, no sleep
# through the frontend: frmps's supervisor drives sleep and wake itself).
_STATIC_UTILITIES: dict[str, Callable[..., Any]] = {
    "get_supported_tasks": lambda: ("generate",),
    "reset_mm_cache": lambda: None,
    "reset_encoder_cache": lambda: None,
    "is_sleeping": lambda: False,
}


class EngineCoreServer:
    """frmps's VllmCore behind vLLM's engine-core sockets (see the module docstring).

    ``core``: a VllmCore built without a tokenizer (vLLM's frontend matches stop
    strings; the engine must not end a request on one behind its back).
    ``ring_path``: publish the committed state to this ring (created by the
    supervisor) as the runner does. ``on_fatal(exc)``: called once, on the loop
    thread, when the engine loop dies (a device error or a bug); the server has
    gone silent by then, and the caller ends the process. ``on_error(exc)``: the
    loop's hook for a death that is not a device error, before ``on_fatal``
    (``EngineLoop``).

    ``adopt`` (a promoted standby) before ``start``; ``start`` connects and sends
    the ready message. ``halt`` stops abruptly (tests: an engine that dies or
    wedges); ``close`` releases the sockets."""

    def __init__(self, core: Any, input_address: str, output_address: str, *, engine_index: int = 0,
                 sync_every: int = 1, ring_path: str | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None, step_delay_s: float = 0.0):
        from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType, UtilityOutput
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult

        from ..compat import current

        if core.tokenizer is not None:
            raise ValueError("build the VllmCore without a tokenizer: vLLM's frontend matches stop strings")
        self.compat = current()
        self.core = core
        self.vllm_config = core.scheduler.vllm_config
        self.engine_index = int(engine_index)
        self.identity = self.engine_index.to_bytes(2, "little")
        self.input_address, self.output_address = input_address, output_address
        self._T, self._Outs, self._UOut, self._UResult = EngineCoreRequestType, EngineCoreOutputs, UtilityOutput, UtilityResult
        self._dec_req, self._dec_any = MsgpackDecoder(EngineCoreRequest), MsgpackDecoder()
        self._enc = MsgpackEncoder()
        self._user_fatal = on_fatal
        self.loop = EngineLoop(core, sync_every=sync_every, on_fatal=self._fatal, on_error=on_error,
                               step_delay_s=step_delay_s)
        self._ring_path = ring_path
        core.engine_outputs = self._emit
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._silent = threading.Event()  # nothing more is sent (halted or dead)
        self._stop_io = threading.Event()
        self._stop_in = threading.Event()  # no more inputs taken (handover, shutdown)
        self._ctx = zmq.Context()
        self._sockets: list[zmq.Socket] = []
        self._threads: list[threading.Thread] = []
        self._started = False
        # Observable state (tests, logs).
        self.refused: list[tuple[str, str]] = []  # (request id or "", why)
        self.sent_batches = 0  # EngineCoreOutputs with request outputs sent
        self.dead: BaseException | None = None

    # -- adoption (a promoted standby, before start) ----------------------------------
    def adopt(self, entries: Iterable[Any], snapshots: Mapping[int, Any]) -> list[EntryOutcome]:
        """Adopt the frontend's resume entries (``adopt_entries``). Entries that
        fail are ended with an error output once the server is connected."""
        outcomes = self.loop.call(lambda: adopt_entries(self.core, entries, snapshots))
        for o in outcomes:
            if not o.ok:
                self._refuse(o.request_id, o.error)
        return outcomes

    def adopt_resume(self, requests: Iterable[Any]) -> list[EntryOutcome]:
        """Adopt a control Resume's requests (``control_pb2.ResumeRequest`` with
        ``engine_request``: the EngineCoreRequest in vLLM's msgpack, as the
        frontend sent it; ``delivered_token_ids``; the ring's ``snapshot`` when
        the request reached a sync). Outcomes in the requests' order; one that
        does not decode fails alone, with an error output (under the engine id
        its key names) once the server is connected."""
        items: list[tuple[int, ResumeItem | None, str]] = []
        snapshots: dict[int, RingState] = {}
        for r in requests:
            key = int(r.key)
            try:
                req = self._dec_req.decode(r.engine_request)
            except Exception as e:
                items.append((key, None, f"request {request_id_for_key(key)}: engine_request does not decode as "
                                         f"this vLLM's EngineCoreRequest: {e}"))
                continue
            items.append((key, ResumeItem(key, req, list(r.delivered_token_ids)), ""))
            if r.HasField("snapshot"):
                snapshots[key] = RingState.from_pb(r.snapshot)
        adopted = iter(self.adopt([it for _, it, _ in items if it is not None], snapshots))
        out: list[EntryOutcome] = []
        for key, it, why in items:
            if it is None:
                rid = request_id_for_key(key)
                self._refuse(rid, why)
                out.append(EntryOutcome(key, rid, False, error=why))
            else:
                out.append(next(adopted))
        return out

    # -- lifecycle --------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> None:
        if self._started:
            raise RuntimeError("engine server already started")
        self._started = True
        if self._ring_path:
            self.loop.attach_ring(RingPublisher(self._ring_path))
        ready = [threading.Event(), threading.Event()]
        self._threads = [
            threading.Thread(target=self._output_thread, args=(ready[0],), name="frmps-ec-out", daemon=True),
            threading.Thread(target=self._input_thread, args=(ready[1],), name="frmps-ec-in", daemon=True),
        ]
        for t in self._threads:
            t.start()
        for ev in ready:
            if not ev.wait(timeout):
                raise TimeoutError("engine-core sockets did not connect")
        self.loop.start()

    def stop_input(self, timeout: float = 5.0) -> None:
        """Take no more messages from the frontend (what it sends from now on stays
        unread and is dropped with the socket: its resume ledger still holds every
        request it sent). Requests already taken go on."""
        self._stop_in.set()
        for t in self._threads:
            if t.name == "frmps-ec-in":
                t.join(timeout)

    def hand_over(self, timeout: float = 30.0) -> int:
        """A planned handover: take no more inputs, let the loop finish the step in
        flight, publish every request to the ring (a FULL record) and forget them
        (``EngineLoop.hand_over``), send every output made until then, and
        disconnect. Nothing ends the frontend's requests (no ENGINE_CORE_DEAD, no
        abort output): the next engine adopts them. Returns how many requests the
        engine held."""
        self.stop_input()
        self.loop.hand_over(timeout)
        n = self.loop.last_handover.requests
        self.core.engine_outputs = None
        # After the last outputs: the frontend's drain ends here, not after a quiet period.
        self._out.put(self._Outs(utility_output=self._UOut(HANDOVER_FENCE_CALL_ID, result=self._UResult(None))))
        self._out.put(_DRAINED)
        for t in self._threads:
            t.join(timeout)
        if any(t.is_alive() for t in self._threads):
            raise TimeoutError(f"engine-core sockets did not drain within {timeout:.0f}s")
        self.close()
        return n

    def halt(self, close_sockets: bool = True) -> None:
        """Stop abruptly, sending nothing more: what the frontend sees of a process
        that dies (``close_sockets``) or wedges (sockets left open until ``close``)."""
        self._silent.set()
        self.loop.stop(5.0)
        self._stop_io.set()
        for t in self._threads:
            t.join(5.0)
        if close_sockets:
            self.close()

    def close(self) -> None:
        self._silent.set()
        self._stop_io.set()
        if self.loop.running:
            self.loop.stop(5.0)
        for t in self._threads:
            t.join(5.0)
        for s in self._sockets:
            s.close(linger=0)
        self._sockets = []
        if not self._ctx.closed:
            self._ctx.term()

    @property
    def running(self) -> bool:
        return self.loop.running and not self._silent.is_set()

    def _fatal(self, e: BaseException) -> None:
        # The engine loop died: go silent (never ENGINE_CORE_DEAD; the supervisor
        # reports the death) and let the caller end the process.
        self.dead = e
        self._silent.set()
        self._stop_io.set()
        log.error("engine loop died (%s): the engine-core server is silent from now on", e)
        if self._user_fatal is not None:
            self._user_fatal(e)

    # -- outputs ----------------------------------------------------------------------
    def _emit(self, outputs_by_client: Any) -> None:
        """VllmCore.engine_outputs: queue each step's outputs for the output thread."""
        for outs in outputs_by_client.values():
            self._out.put(outs)

    def _refuse(self, request_id: str, why: str) -> None:
        log.warning("refused: %s", why)
        self.refused.append((request_id, why))
        if request_id:
            self._out.put(self._Outs(outputs=[self.compat.error_output(request_id, why)],
                                     finished_requests={request_id}))

    def _reply(self, call_id: int, result: Any = None, failure: str | None = None) -> None:
        out = self._UOut(call_id, failure_message=failure, result=None if failure else self._UResult(result))
        self._out.put(self._Outs(utility_output=out))

    def _output_thread(self, ready: threading.Event) -> None:
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(self.output_address)
        self._sockets.append(push)
        ready.set()
        while not self._stop_io.is_set():
            try:
                outs = self._out.get(timeout=0.05)
            except queue.Empty:
                continue
            if outs is _DRAINED:  # a handover: all sent; deliver what zmq still queues
                push.setsockopt(zmq.LINGER, 5000)
                self._sockets.remove(push)
                push.close()
                return
            if self._silent.is_set():
                break
            outs.engine_index = self.engine_index
            push.send_multipart(self._enc.encode(outs), copy=False)
            if outs.outputs:
                self.sent_batches += 1

    # -- inputs -----------------------------------------------------------------------
    def _input_thread(self, ready: threading.Event) -> None:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, self.identity)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.input_address)
        self._sockets.append(dealer)
        # The ready message: the frontend's ROUTER can address this identity only
        # after it has heard from it.
        dealer.send(self.compat.ready_response(self.vllm_config, self.engine_index))
        ready.set()
        while not (self._stop_io.is_set() or self._stop_in.is_set()):
            if not dealer.poll(10):  # stop_input waits for this thread to leave
                continue
            frames = dealer.recv_multipart(copy=False)
            if self._silent.is_set() or self._stop_in.is_set():
                break
            try:
                self._on_message(frames)
            except Exception:  # a bad message never takes the engine down
                log.exception("engine-core message dropped")

    def _on_message(self, frames: list) -> None:
        kind, data = bytes(frames[0].buffer), frames[1:]
        try:
            t = self._T(kind)
        except ValueError:
            self._refuse("", f"unknown engine-core message type {kind!r}: ignored")
            return
        if t is self._T.ADD:
            self._on_add(data)
        elif t is self._T.ABORT:
            ids = self._dec_any.decode(data)
            if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                self._refuse("", f"malformed abort {ids!r}: ignored")
                return
            self.loop.post(lambda: self._abort(ids))
        elif t is self._T.UTILITY:
            self._on_utility(self._dec_any.decode(data))
        else:
            self._refuse("", f"engine-core message {t.name} is not served by a frmps engine: ignored")

    def _on_add(self, data: list) -> None:
        from vllm.v1.request import Request

        try:
            req = self._dec_req.decode(data)
        except Exception as e:
            self._refuse(self._request_id_of(data), f"malformed request: {e}")
            return
        try:
            key = check_request(req)
            request = Request.from_engine_core_request(req, self.core.core.request_block_hasher)
        except Exception as e:
            self._refuse(str(req.request_id), str(e))
            return
        self.loop.post(lambda: self._add(key, request))

    def _request_id_of(self, data: list) -> str:
        """The id of an ADD whose frames do not decode as an EngineCoreRequest, when
        the first field of the array is a string (else "": only logged)."""
        try:
            fields = self._dec_any.decode(data)
        except Exception:
            return ""
        if isinstance(fields, (list, tuple)) and fields and isinstance(fields[0], str):
            return fields[0]
        return ""

    def _add(self, key: int, request: Any) -> None:  # loop thread
        try:
            self.core.add_vllm_request(key, request)
        except Exception as e:
            if is_device_error(e):
                raise
            self._refuse(request.request_id, f"engine refused request {request.request_id}: {e}")

    def _abort(self, ids: list[str]) -> None:  # loop thread
        for rid in ids:
            key = key_for_request_id(rid)
            if key is not None:
                self.core.abort(key)

    def _on_utility(self, msg: Any) -> None:
        try:
            _client, call_id, method, args = msg
        except (TypeError, ValueError):
            self._refuse("", f"malformed utility call {msg!r}: ignored")
            return
        args = tuple(args or ())
        fn = _STATIC_UTILITIES.get(method)
        if fn is not None:
            try:
                self._reply(call_id, fn(*args))
            except TypeError as e:
                self._reply(call_id, failure=f"Call to {method} method failed: {e}")
            return
        if method == "reset_prefix_cache":
            self.loop.post(lambda: self._reset_prefix_cache(call_id, args))
            return
        self._reply(call_id, failure=f"Call to {method} method failed: not supported by a frmps engine")

    def _reset_prefix_cache(self, call_id: int, args: tuple) -> None:  # loop thread
        reset_running = bool(args[0]) if args else False
        if reset_running or (len(args) > 1 and args[1]):
            self._reply(call_id, failure="Call to reset_prefix_cache method failed: a frmps engine resets "
                                         "only the free blocks' cache (no reset_running_requests, reset_connector)")
            return
        self._reply(call_id, bool(self.core.scheduler.reset_prefix_cache()))
