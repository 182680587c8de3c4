"""A request's output as the engine produced it, read by any number of the
generation API's streams (sdk/genapi.py); the engine loop (sdk/loop.py) appends
each step's tokens."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

_FINISH = {"stop", "length", "abort"}


class DuplicateRequest(Exception):
    pass


def _wants_logprobs(params: Any) -> bool:
    """A request that asked for logprobs (control_pb2.SamplingParams.logprobs set)."""
    has = getattr(params, "HasField", None)
    return bool(has is not None and has("logprobs"))


class RequestStream:
    """The output buffer of one request, read by any number of gRPC streams.

    ``output`` holds every output token from index 0 (for an adopted request it
    starts with the tokens the client already received), so a stream can start
    at any index.
    """

    def __init__(self, key: int, prompt_len: int, params: Any, output: list[int] | None = None):
        self.key = key
        self.prompt_len = prompt_len
        self.params = params  # normalised control_pb2.SamplingParams
        self.output: list[int] = list(output or [])
        # With params.logprobs: each output token's (logprob, rank, top ids, top
        # logprobs), aligned with output (None for the tokens delivered before an
        # adoption: the client has theirs).
        self.logprobs: list | None = [None] * len(self.output) if _wants_logprobs(params) else None
        self.await_first_resumed = False  # adopted at a takeover: log when its first new token goes out
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_reason: str = ""
        self.error: str | None = None
        self.error_invalid = False
        self.moved = False  # handed over to another engine (move())
        self.finished_at = 0.0
        self.debug_prompt: list[int] | None = None  # FRMPS_DEBUG_TOKEN_LOG only
        self.cond = threading.Condition()
        # Called at every change, besides cond's own waiters (under cond, or for
        # the engine's outputs once per step after all of them: _dispatch): a
        # stream that follows many requests (genapi's Stream) waits on one
        # condition of its own.
        self.wakers: list[Callable[[], None]] = []

    def _changed(self, defer: set[Callable[[], None]] | None = None) -> None:
        """Wake the readers; with defer, the wakers are added to it instead of called,
        for the caller to call once each after a whole step's outputs (one stream
        following many requests then wakes once per step, not once per request)."""
        self.cond.notify_all()
        if defer is not None:
            defer.update(self.wakers)
            return
        for wake in self.wakers:
            wake()

    def _append(self, index: int, ids, finished: bool, reason: str | None, stop_reason: Any,
                defer: set[Callable[[], None]] | None = None, logprobs: Any = None) -> None:
        with self.cond:
            if self.finished:
                return
            have = len(self.output)
            ids = list(ids)
            if index > have:
                self.error = f"engine emitted output index {index} but only {have} tokens exist"
                self.finished = True
            else:
                # Overlap happens only for adopted requests whose delivered tokens were re-emitted.
                self.output.extend(ids[have - index :])
                if self.logprobs is not None:
                    lps = list(logprobs) if logprobs is not None else [None] * len(ids)
                    self.logprobs.extend(lps[have - index :])
                if finished:
                    self.finished = True
                    self.finish_reason = reason if reason in _FINISH else "stop"
                    self.stop_reason = "" if stop_reason is None else str(stop_reason)
            if self.finished:
                self.finished_at = time.monotonic()
            self._changed(defer)

    def fail(self, msg: str, invalid: bool = False) -> None:
        with self.cond:
            if not self.finished:
                self.error, self.error_invalid = msg, invalid
                self.finished = True
                self.finished_at = time.monotonic()
            self._changed()

    def move(self) -> bool:
        """The request now belongs to another engine (a planned handover): followers
        send what they have not sent yet, then end the stream with UNAVAILABLE, and
        the front door resumes it there. False if it had finished already."""
        with self.cond:
            if self.finished:
                return False
            self.moved = self.finished = True
            self.finished_at = time.monotonic()
            self._changed()
            return True

    def finish(self, reason: str, stop_reason: str = "", truncate_to: int | None = None) -> bool:
        """Finish from outside the core (abort, a stop string found by the detokenizer)."""
        with self.cond:
            if self.finished:
                return False
            if truncate_to is not None:
                del self.output[truncate_to:]
                if self.logprobs is not None:
                    del self.logprobs[truncate_to:]
            self.finished, self.finish_reason, self.stop_reason = True, reason, stop_reason
            self.finished_at = time.monotonic()
            self._changed()
            return True
