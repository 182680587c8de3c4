"""Incremental detokenization with stop strings.

The text handed out after n output tokens is a function of those n tokens
only (never of how they were chunked), so an engine that takes over a stream
at token index d can recompute exactly what the client already got as text
and continue from there.
"""

from __future__ import annotations

from typing import Sequence

from .engine_api import Tokenizer

_INCOMPLETE = "\ufffd"


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), include_stop: bool = False):
        self._tok = tokenizer
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop
        # Text that could still become the start of a stop string is held back.
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix = 0  # decode window start (keeps context for tokenizers that merge spaces)
        self._read = 0  # tokens whose text is already in self._text
        self._text = ""
        self._sent = 0  # chars of self._text handed out
        self.stopped: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self._ids)

    def _push(self, tid: int) -> None:
        self._ids.append(int(tid))
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read]) if self._read > self._prefix else ""
        new_text = self._tok.decode(self._ids[self._prefix :])
        # A trailing U+FFFD means a multi-byte character is still incomplete: wait for more tokens.
        if len(new_text) > len(prefix_text) and not new_text.endswith(_INCOMPLETE):
            self._text += new_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self._ids)

    def prime(self, ids: Sequence[int]) -> None:
        """Replay tokens the client already has (a resumed stream) without handing out their text."""
        n, _, _ = self.feed(ids)
        if n != len(ids):
            raise ValueError("prime: a stop string ends inside the delivered tokens")

    def feed(self, ids: Sequence[int]) -> tuple[int, str, str | None]:
        """Consume tokens; return (tokens accepted, text delta, stop string matched or None).

        On a stop-string match the tokens after the matching one are not accepted.
        """
        if self.stopped is not None:
            return 0, "", self.stopped
        for i, tid in enumerate(ids):
            before = len(self._text)
            self._push(tid)
            if self._stop and len(self._text) > before:
                start = max(0, before - self._hold)
                hit = None
                for s in self._stop:
                    p = self._text.find(s, start)
                    if p >= 0 and (hit is None or p < hit[0]):
                        hit = (p, s)
                if hit is not None:
                    p, s = hit
                    self._text = self._text[: p + len(s) if self._include_stop else p]
                    self.stopped = s
                    delta = self._text[self._sent :]
                    self._sent = len(self._text)
                    return i + 1, delta, s
        limit = len(self._text) - self._hold
        delta = ""
        if limit > self._sent:
            delta = self._text[self._sent : limit]
            self._sent = limit
        return len(ids), delta, None

    def flush(self) -> str:
        """The request finished: hand out everything held back, incomplete characters included."""
        if self.stopped is None and self._read < len(self._ids):
            prefix_text = self._tok.decode(self._ids[self._prefix : self._read]) if self._read > self._prefix else ""
            self._text += self._tok.decode(self._ids[self._prefix :])[len(prefix_text) :]
            self._prefix = self._read = len(self._ids)
        delta = self._text[self._sent :]
        self._sent = len(self._text)
        return delta
