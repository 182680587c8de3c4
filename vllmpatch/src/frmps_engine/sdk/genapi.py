"""The generation API (proto/frmps/v1/generation.proto) served over a unix socket.

A threaded gRPC server: each stream waits on its request's condition variable
and wakes as soon as the engine loop appends tokens, so a token reaches the
wire one thread hand-off after the step that produced it.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
from concurrent import futures
from typing import Callable, Protocol

import grpc

from frmps_engine._proto.frmps.v1 import control_pb2, generation_pb2, generation_pb2_grpc

from .detok import TextStream
from .engine_api import Tokenizer, vocab_size
from .stream import DuplicateRequest, RequestStream
from .params import InvalidRequest, normalize

log = logging.getLogger(__name__)

_FINISH_PB = {
    "stop": generation_pb2.FINISH_REASON_STOP,
    "length": generation_pb2.FINISH_REASON_LENGTH,
    "abort": generation_pb2.FINISH_REASON_ABORT,
}


class GenerationBackend(Protocol):
    """What the server needs from the engine side (the runner's EngineLoop + adapter)."""

    model: str
    max_model_len: int

    def tokenizer(self) -> Tokenizer: ...
    def serving(self) -> bool: ...
    def submit(self, key: int, prompt_ids: list[int], params: control_pb2.SamplingParams) -> RequestStream: ...
    def get(self, key: int) -> RequestStream | None: ...
    def abort(self, key: int) -> bool: ...
    def stop_at(self, stream: RequestStream, n_tokens: int, stop: str) -> None: ...
    def load(self) -> tuple[int, int]: ...


def chat_message(m) -> dict:
    """A ChatMessage as a chat template takes it (vLLM's conversation message): role
    and content, and where the message has them an assistant's tool_calls (their
    arguments JSON values), a tool result's tool_call_id, a name."""
    d = {"role": m.role, "content": m.content}
    calls = getattr(m, "tool_calls_json", "")
    if calls:
        try:
            d["tool_calls"] = json.loads(calls)
        except ValueError as e:
            raise InvalidRequest(f"message tool_calls_json is not JSON: {e}") from None
    has = getattr(m, "HasField", None)
    for field in ("tool_call_id", "name"):
        if has is not None and has(field):
            d[field] = getattr(m, field)
    return d


def chat_tools(tools_json: str) -> list | None:
    """A request's tools_json as the chat template takes them (None: no tools)."""
    if not tools_json:
        return None
    try:
        tools = json.loads(tools_json)
    except ValueError as e:
        raise InvalidRequest(f"tools_json is not JSON: {e}") from None
    if not isinstance(tools, list):
        raise InvalidRequest("tools_json must be a JSON array")
    return tools or None


def chat_to_ids(tok: Tokenizer, messages, add_generation_prompt: bool, tools_json: str = "") -> list[int]:
    """Apply the tokenizer's chat template, with the request's tools when it has
    some. The generation prompt is added when asked or when the last message is
    not the assistant's (proto3 cannot tell unset from false)."""
    msgs = [chat_message(m) for m in messages]
    if not msgs:
        raise InvalidRequest("messages must not be empty")
    agp = add_generation_prompt or msgs[-1]["role"] != "assistant"
    tools = chat_tools(tools_json)
    if tools is not None:
        # Only with tools: a tokenizer of an older adapter need not take them.
        try:
            return list(tok.apply_chat_template(msgs, add_generation_prompt=agp, tools=tools))
        except TypeError as e:
            raise InvalidRequest(f"this engine's chat template does not take tools: {e}") from None
    try:
        return list(tok.apply_chat_template(msgs, add_generation_prompt=agp))
    except TypeError:
        return list(tok.apply_chat_template(msgs))


# The type of a protobuf message's repeated integer field (one type for every such
# field of every message, whichever protobuf implementation runs): its items are ints.
_PB_REPEATED_INTS = type(control_pb2.ResumeRequest().prompt_token_ids)


def pb_ints(field) -> list[int]:
    """A message's repeated integer field as a new list. Slicing a field gives a list
    with upb in one call (list(field) iterates it item by item); any other
    implementation's result is made a list."""
    ids = field[:]
    return ids if type(ids) is list else list(ids)


def input_to_ids(tok: Tokenizer, *, prompt: str | None = None, prompt_token_ids=None, messages=None,
                 add_generation_prompt: bool = False, tools_json: str = "") -> list[int]:
    if messages is not None:
        return chat_to_ids(tok, messages, add_generation_prompt, tools_json)
    if prompt_token_ids is not None:
        # A message's field holds ints already: copied without an int() per token
        # (half the cost for a long prompt, on a takeover's path).
        ids = pb_ints(prompt_token_ids) if type(prompt_token_ids) is _PB_REPEATED_INTS else list(map(int, prompt_token_ids))
        vocab = vocab_size(tok)
        if vocab is not None and ids and max(ids) >= vocab:  # (a takeover's path: C loops only)
            bad = [t for t in ids if t >= vocab]
            raise InvalidRequest(f"prompt token ids {bad[:5]} outside the vocabulary (size {vocab})")
        return ids
    if prompt is not None:
        return list(tok.encode(prompt))
    raise InvalidRequest("request has no input: set prompt, prompt_token_ids or messages")


def request_ids(tok: Tokenizer, request) -> list[int]:
    """The token ids of a request's input (a GenerateRequest's or a TokenizeRequest's
    ``input`` oneof: prompt, prompt_token_ids or messages)."""
    which = request.WhichOneof("input")
    return input_to_ids(
        tok,
        prompt=request.prompt if which == "prompt" else None,
        prompt_token_ids=request.prompt_token_ids.ids if which == "prompt_token_ids" else None,
        messages=request.messages.messages if which == "messages" else None,
        add_generation_prompt=request.add_generation_prompt,
        tools_json=request.tools_json,
    )


def first_chunk(ids: list[int]) -> generation_pb2.GenerateResponse:
    """A request's first chunk: its prompt's length (the caller checks its limits
    before any output exists) and its ids (the front door resumes with them)."""
    return generation_pb2.GenerateResponse(usage=generation_pb2.Usage(prompt_tokens=len(ids)), prompt_token_ids=ids)


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, backend: GenerationBackend, wait_tick_s: float = 1.0):
        self._b = backend
        self._tick = wait_tick_s
        # Set when the server stops: a Stream with no request left on it ends then,
        # rather than holding the stop for its whole grace (the supervisor keeps its
        # Stream open between requests).
        self.stopping = threading.Event()

    # -- RPCs -----------------------------------------------------------------
    def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.ServicerContext):
        try:
            stream, ids = self._submit(request)
        except _Refused as e:
            context.abort(e.code, e.message)
        # First chunk at once: the caller checks limits on prompt_tokens before any output exists.
        yield first_chunk(ids)
        yield from self._follow(stream, 0, context)

    def _submit(self, request: generation_pb2.GenerateRequest) -> tuple[RequestStream, list[int]]:
        """Check and start a request; _Refused says why not."""
        if not self._b.serving():
            raise _Refused(grpc.StatusCode.UNAVAILABLE, "engine is not serving (standby or shutting down)")
        tok = self._b.tokenizer()
        try:
            ids = request_ids(tok, request)
            if not ids:
                raise InvalidRequest("prompt is empty after tokenization")
            if len(ids) >= self._b.max_model_len:
                raise InvalidRequest(
                    f"prompt has {len(ids)} tokens; this model's max_model_len is {self._b.max_model_len} "
                    "(the prompt must leave room for at least one output token)"
                )
            params = normalize(request.params, request.key, len(ids), self._b.max_model_len, vocab_size(tok))
        except InvalidRequest as e:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        try:
            return self._b.submit(request.key, ids, params), ids
        except DuplicateRequest as e:
            raise _Refused(grpc.StatusCode.ALREADY_EXISTS, str(e)) from None

    def Resume(self, request: generation_pb2.ResumeStreamRequest, context: grpc.ServicerContext):
        stream = self._b.get(request.key)
        if stream is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no request with key {request.key} on this engine")
        yield from self._follow(stream, request.delivered, context, _detok_of(request))

    def Abort(self, request: generation_pb2.AbortRequest, context: grpc.ServicerContext):
        if not self._b.abort(request.key):
            context.abort(grpc.StatusCode.NOT_FOUND, f"no request with key {request.key} on this engine")
        return generation_pb2.AbortResponse(found=True)

    def Health(self, request, context):
        running, waiting = self._b.load()
        return generation_pb2.HealthResponse(
            serving=self._b.serving(), model=self._b.model, max_model_len=self._b.max_model_len,
            running=running, waiting=waiting,
        )

    def Tokenize(self, request: generation_pb2.TokenizeRequest, context: grpc.ServicerContext):
        """A prompt's or chat messages' token ids, as Generate tokenizes them."""
        try:
            ids = request_ids(self._b.tokenizer(), request)
        except InvalidRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return generation_pb2.TokenIds(ids=ids)

    def Detokenize(self, request: generation_pb2.TokenIds, context: grpc.ServicerContext):
        tok = self._b.tokenizer()
        try:
            ids = input_to_ids(tok, prompt_token_ids=request.ids)  # checks them against the vocabulary
        except InvalidRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return generation_pb2.DetokenizeResponse(text=tok.decode(ids))

    def Stream(self, request_iterator, context: grpc.ServicerContext):
        mux = _Mux(self)
        threading.Thread(target=mux.read, args=(request_iterator,), name="frmps-gen-stream-in", daemon=True).start()
        try:
            while context.is_active():
                msg = mux.next_chunks(self._tick)
                if msg is not None:
                    yield msg
                elif mux.done() or (self.stopping.is_set() and mux.idle()):
                    return
        finally:
            mux.close()

    # -- streaming --------------------------------------------------------------
    def _follow(self, stream: RequestStream, start: int, context: grpc.ServicerContext,
                detok: generation_pb2.DetokState | None = None):
        f = _Follower(self._b, stream, start, detok)
        while True:
            with stream.cond:
                if not f.ready():
                    stream.cond.wait(self._tick)
            if not context.is_active():
                return
            out = f.poll()
            if out is None:
                continue
            resp, err, done = out
            if err is not None:
                context.abort(*err)
            yield resp
            if done:
                return


def _detok_of(r: generation_pb2.ResumeStreamRequest) -> generation_pb2.DetokState | None:
    """The previous engine's detokenizer state a resume brings, if any."""
    return r.detok if r.HasField("detok") else None


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class _Follower:
    """One reader of a request's output from index ``start``: the chunks Generate
    or Resume send, one poll at a time, never blocking."""

    def __init__(self, backend: GenerationBackend, stream: RequestStream, start: int,
                 detok: generation_pb2.DetokState | None = None):
        self._b = backend
        self.stream = stream
        self.idx = start
        self.primed = False
        self.detok = detok  # the previous engine's detokenizer state at `start` (ResumeStreamRequest.detok)
        p = stream.params
        self.text = TextStream(backend.tokenizer(), list(p.stop), p.include_stop_str_in_output)

    def ready(self) -> bool:
        """Something to send (caller holds stream.cond)."""
        s = self.stream
        return s.finished or len(s.output) > self.idx or (not self.primed and len(s.output) >= self.idx)

    def poll(self, into: Callable[[], generation_pb2.GenerateResponse] | None = None):
        """None (nothing yet), or (response, error, done): error is (StatusCode, message)
        and ends this reader, as does done. ``into``: where the response is built (a
        chunk's response added to a StreamResponse: building in place spares protobuf
        the copy a submessage passed to a constructor costs); a new one by default."""
        stream = self.stream
        if not self.primed:
            with stream.cond:
                if len(stream.output) < self.idx and not stream.finished:
                    return None
                delivered = stream.output[: self.idx]
            if len(delivered) < self.idx:
                return None, (grpc.StatusCode.OUT_OF_RANGE, f"request {stream.key} has {len(delivered)} output "
                              f"tokens, client says it received {self.idx}"), True
            try:
                # The delivered tokens' text is the client's already: take the previous
                # engine's detokenizer offsets where they suffice, else replay them.
                d = self.detok
                if d is None or not self.text.restore(delivered, d.prefix, d.read):
                    self.text.prime(delivered)
            except ValueError as e:
                return None, (grpc.StatusCode.FAILED_PRECONDITION, f"request {stream.key}: {e}"), True
            self.primed = True
        idx = self.idx
        with stream.cond:
            new = stream.output[idx:]
            lps = stream.logprobs[idx:] if stream.logprobs is not None else None
            finished, reason, stop_reason, error = stream.finished, stream.finish_reason, stream.stop_reason, stream.error
            invalid, moved = stream.error_invalid, stream.moved
        if moved:
            # Handed over (a planned handover): send what this engine produced,
            # then end the stream; the front door resumes it on the next engine.
            if not new:
                return None, (grpc.StatusCode.UNAVAILABLE,
                              f"request {stream.key} moved to another engine (planned handover)"), True
            finished = False
        if error is not None:
            code = grpc.StatusCode.INVALID_ARGUMENT if invalid else grpc.StatusCode.INTERNAL
            return None, (code, f"request {stream.key}: {error}"), True
        if not new and not finished:
            return None
        n, delta, stop = self.text.feed(new)
        if stop is not None:
            new = new[:n]
            self._b.stop_at(stream, idx + n, stop)
            finished, reason, stop_reason = True, "stop", stop
        done = finished  # read with `new` under the lock: nothing follows a finish
        if done:
            delta += self.text.flush()
        resp = into() if into is not None else generation_pb2.GenerateResponse()
        resp.token_ids.extend(new)
        resp.text = delta
        resp.output_index = idx
        usage = resp.usage
        usage.prompt_tokens = stream.prompt_len
        usage.completion_tokens = idx + len(new)
        if lps is not None and new:
            resp.logprobs.extend(self._logprobs(new, lps[: len(new)]))
        if done:
            resp.finish_reason = _FINISH_PB.get(reason or "stop", generation_pb2.FINISH_REASON_STOP)
            resp.stop_reason = stop_reason or ""
        else:
            off = self.text.offsets()
            if off is not None:
                d = resp.detok
                d.prefix, d.read = off
        self.idx = idx + len(new)
        return resp, None, done


    def _logprobs(self, ids: list[int], lps: list) -> list[generation_pb2.TokenLogprobs]:
        """The chunk's logprobs, with each token's text alone; a token the core gave
        none for (it should not happen) gets an entry with only its text."""
        decode = self._b.tokenizer().decode
        out = []
        for tok, lp in zip(ids, lps):
            e = generation_pb2.TokenLogprobs(token=decode([tok]))
            if lp is not None:
                logprob, rank, top_ids, top_lps = lp
                e.logprob, e.rank = logprob, rank
                e.top_ids.extend(top_ids)
                e.top_logprobs.extend(top_lps)
                e.top_tokens.extend(decode([t]) for t in top_ids)
            out.append(e)
        return out


class _Mux:
    """The requests of one Stream: operations read on their own thread, output
    collected for all of them each time any of them changes (RequestStream.wakers),
    so under load one message carries one engine step for every request."""

    def __init__(self, svc: GenerationService):
        self._svc = svc
        self._cond = threading.Condition()
        self._dirty = False
        self._eof = False
        self._pending: list[generation_pb2.StreamChunk] = []
        self._followers: dict[int, _Follower] = {}

    def _wake(self) -> None:
        with self._cond:
            self._dirty = True
            self._cond.notify()

    def read(self, requests) -> None:
        try:
            for req in requests:
                op = req.WhichOneof("op")
                if op == "generate":
                    self._generate(req.generate)
                elif op == "resume":
                    r = req.resume
                    self._follow(r.key, self._svc._b.get(r.key), r.delivered, _detok_of(r))
                elif op == "detach":
                    self._drop(req.detach.key)
        except grpc.RpcError:
            pass  # the client went away: Stream's loop sees the context end
        except Exception:
            log.exception("generation stream: reading requests failed")
        finally:
            with self._cond:
                self._eof = True
                self._cond.notify()

    def _generate(self, g: generation_pb2.GenerateRequest) -> None:
        try:
            stream, ids = self._svc._submit(g)
        except _Refused as e:
            self._error(g.key, e.code, e.message)
            return
        with self._cond:
            self._pending.append(generation_pb2.StreamChunk(key=g.key, response=first_chunk(ids)))
        self._follow(g.key, stream, 0)

    def _follow(self, key: int, stream: RequestStream | None, start: int,
                detok: generation_pb2.DetokState | None = None) -> None:
        if stream is None:
            self._error(key, grpc.StatusCode.NOT_FOUND, f"no request with key {key} on this engine")
            return
        f = _Follower(self._svc._b, stream, start, detok)
        with self._cond:
            old = self._followers.pop(key, None)
            self._followers[key] = f
        if old is not None:
            self._unwatch(old)
        with stream.cond:
            stream.wakers.append(self._wake)
        self._wake()

    def _drop(self, key: int) -> None:
        with self._cond:
            f = self._followers.pop(key, None)
        if f is not None:
            self._unwatch(f)

    def _unwatch(self, f: _Follower) -> None:
        with f.stream.cond:
            try:
                f.stream.wakers.remove(self._wake)
            except ValueError:
                pass

    def _error(self, key: int, code: grpc.StatusCode, message: str) -> None:
        with self._cond:
            self._pending.append(generation_pb2.StreamChunk(key=key, status_code=code.value[0], status_message=message))
            self._dirty = True
            self._cond.notify()

    def next_chunks(self, timeout: float) -> generation_pb2.StreamResponse | None:
        """One message with whatever every followed request has to send (None:
        nothing), its chunks built in place."""
        with self._cond:
            if not (self._dirty or self._pending or self._eof):
                self._cond.wait(timeout)
            self._dirty = False
            pending, self._pending = self._pending, []
            followers = list(self._followers.items())
        msg = generation_pb2.StreamResponse(chunks=pending)
        add = msg.chunks.add
        ended = []
        for key, f in followers:
            # The chunk is added only once the follower has something to send.
            out = f.poll(lambda key=key: add(key=key).response)
            if out is None:
                continue
            resp, err, done = out
            if err is not None:
                add(key=key, status_code=err[0].value[0], status_message=err[1])
            if done or err is not None:
                ended.append((key, f))
        for key, f in ended:
            with self._cond:
                if self._followers.get(key) is f:
                    del self._followers[key]
            self._unwatch(f)
        return msg if msg.chunks else None

    def done(self) -> bool:
        with self._cond:
            return self._eof and not self._followers and not self._pending

    def idle(self) -> bool:
        """No request followed and nothing left to send."""
        with self._cond:
            return not self._followers and not self._pending

    def close(self) -> None:
        with self._cond:
            followers, self._followers = list(self._followers.values()), {}
        for f in followers:
            self._unwatch(f)


class GenerationServer:
    """The gRPC server bound to a unix socket that only our uid can use (0600).

    Each open stream holds one worker thread (created lazily), hence the large pool.
    """

    def __init__(self, backend: GenerationBackend, socket_path: str, max_workers: int = 1024):
        self.path = socket_path
        self.endpoint = "unix://" + os.path.abspath(socket_path)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="frmps-gen"),
            options=[("grpc.so_reuseport", 0)],
        )
        self._svc = GenerationService(backend)
        generation_pb2_grpc.add_GenerationServicer_to_server(self._svc, self._server)
        self._started = False

    def start(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISSOCK(st.st_mode):
                raise OSError(f"generation socket {self.path} exists and is not a socket")
            os.unlink(self.path)  # stale socket of a previous engine
        old = os.umask(0o177)  # the socket is created 0600 (no window where others could connect)
        try:
            if self._server.add_insecure_port(self.endpoint) == 0:
                raise OSError(f"cannot bind generation socket {self.path}")
            self._server.start()
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self._started = True

    def stop(self, grace: float | None = None) -> None:
        """Stop taking RPCs; those still running get ``grace`` seconds, except an idle
        Stream, which ends within a wait tick."""
        if self._started:
            self._svc.stopping.set()
            self._server.stop(grace).wait()
            self._started = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
