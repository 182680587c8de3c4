"""Incremental detokenization with stop strings.

The text handed out after n output tokens is a function of those n tokens
only (never of how they were chunked), so an engine that takes over a stream
at token index d can recompute exactly what the client already got as text
and continue from there.
"""

from __future__ import annotations

import weakref
from typing import Callable, Sequence

from .engine_api import Tokenizer

_INCOMPLETE = "\ufffd"

# Text kept once handed out, beyond what stop matching needs: trimmed in chunks so
# that a long stream's text does not grow (and get copied) without bound.
_TRIM = 4096

_ONE_CACHES: "weakref.WeakKeyDictionary[object, dict[int, str]]" = weakref.WeakKeyDictionary()


def window_decoder(tok: Tokenizer) -> Callable[[list[int], int, int], str]:
    """decode(ids[a:b]) for the detokenizers' windows, with the one-token windows
    (the "prefix" of every step once text flows: half the decode calls) served
    from a per-tokenizer cache. decode is a pure function of the ids, so this
    returns exactly what tok.decode would; it makes replaying a resumed stream's
    delivered tokens about twice as fast."""
    try:
        one = _ONE_CACHES.setdefault(tok, {})
    except TypeError:  # not weak-referenceable: a cache for this caller only
        one = {}
    decode = tok.decode

    def window(ids: list[int], a: int, b: int) -> str:
        if b - a == 1 and 0 <= a < len(ids):
            t = ids[a]
            s = one.get(t)
            if s is None:
                s = one[t] = decode([t])
            return s
        return decode(ids[a:b]) if b > a else ""

    return window


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), include_stop: bool = False):
        self._window = window_decoder(tokenizer)
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
        ids = self._ids
        ids.append(int(tid))
        prefix_text = self._window(ids, self._prefix, self._read)
        new_text = self._window(ids, self._prefix, len(ids))
        # A trailing U+FFFD means a multi-byte character is still incomplete: wait for more tokens.
        if len(new_text) > len(prefix_text) and not new_text.endswith(_INCOMPLETE):
            self._text += new_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self._ids)

    def offsets(self) -> tuple[int, int] | None:
        """(prefix, read) in token indices, where they are the whole state: with no
        stop strings no text is held back, so restore() continues exactly from them.
        None for a stream with stop strings (or one that stopped)."""
        if self._stop or self.stopped is not None or self._sent != len(self._text):
            return None
        return self._prefix, self._read

    def restore(self, ids: Sequence[int], prefix: int, read: int) -> bool:
        """Continue after the delivered tokens ids from the offsets another engine's
        stream reported for them (offsets()), instead of replaying them (prime).
        False, changing nothing, where offsets cannot stand for the state (stop
        strings, or offsets that do not fit the tokens): prime then."""
        if self._stop or self._ids or not 0 <= prefix <= read <= len(ids):
            return False
        self._ids = [int(t) for t in ids]
        self._prefix, self._read = prefix, read
        return True

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
        # Only text not yet handed out and the stop window before it matter from here on.
        cut = min(self._sent, len(self._text) - self._hold)
        if cut > _TRIM:
            self._text = self._text[cut:]
            self._sent -= cut
        return len(ids), delta, None

    def flush(self) -> str:
        """The request finished: hand out everything held back, incomplete characters included."""
        if self.stopped is None and self._read < len(self._ids):
            prefix_text = self._window(self._ids, self._prefix, self._read)
            self._text += self._window(self._ids, self._prefix, len(self._ids))[len(prefix_text) :]
            self._prefix = self._read = len(self._ids)
        delta = self._text[self._sent :]
        self._sent = len(self._text)
        return delta
