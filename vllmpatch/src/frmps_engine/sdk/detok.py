"""Incremental detokenization with stop strings.

The text handed out after n output tokens is a function of those n tokens
only (never of how they were chunked), so an engine that takes over a stream
at token index d can recompute exactly what the client already got as text
and continue from there.
"""

from __future__ import annotations

import random
import weakref
from typing import Any, Callable, Sequence

from .engine_api import Tokenizer

_INCOMPLETE = "\ufffd"

# Text kept once handed out, beyond what stop matching needs: trimmed in chunks so
# that a long stream's text does not grow (and get copied) without bound.
_TRIM = 4096

_ONE_CACHES: "weakref.WeakKeyDictionary[object, dict[int, str]]" = weakref.WeakKeyDictionary()
# Per tokenizer: its byte table (byte_level_pieces), or None where it has none; set by warm().
_PIECES: "weakref.WeakKeyDictionary[object, list[bytes] | None]" = weakref.WeakKeyDictionary()


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


def byte_level_pieces(backend: Any) -> list[bytes] | None:
    """For a ``tokenizers.Tokenizer`` whose decoder is ByteLevel (GPT-2's, Qwen's,
    Llama 3's): each id's bytes, so that its decode with special tokens skipped is
    ``b"".join(pieces[i] for i in ids).decode("utf-8", "replace")``, an id past
    the table decoding to nothing. Special added tokens are b""; a token with a
    character outside the byte alphabet is its UTF-8 (as the ByteLevel decoder
    does). Checked against ``backend.decode`` on a sample (every special and added
    token, a spread of the vocabulary alone and in pairs, runs of single-byte
    tokens that make invalid and incomplete UTF-8, ids past the vocabulary); None
    for any other decoder, or if any sample differs. ~0.2 s for Qwen's 152k ids:
    built where an engine warms up (``warm``), never on a request's path."""
    try:
        if type(backend.decoder).__name__ != "ByteLevel":
            return None
        from ..modeldir import byte_alphabet

        n = int(backend.get_vocab_size(with_added_tokens=True))
        added = backend.get_added_tokens_decoder()
        alphabet = {c: b for b, c in enumerate(byte_alphabet())}
        pieces: list[bytes] = []
        for i in range(n):
            a = added.get(i)
            tok = backend.id_to_token(i)
            if (a is not None and a.special) or tok is None:
                pieces.append(b"")
                continue
            try:
                pieces.append(bytes([alphabet[c] for c in tok]))
            except KeyError:
                pieces.append(tok.encode("utf-8"))
        rng = random.Random(0)
        singles = [i for i, p in enumerate(pieces) if len(p) == 1]
        spread = list(range(0, n, max(1, n // 512)))[:512] + list(range(max(0, n - 64), n))
        sample = [[i] for i in [*added, *spread, n, n + 7]]
        sample += [[a, b] for a, b in zip(spread, reversed(spread))]
        sample += [[rng.choice(singles) for _ in range(rng.randint(2, 6))] for _ in range(512)] if singles else []
        sample += [[rng.randrange(n + 8) for _ in range(rng.randint(1, 6))] for _ in range(256)]
        for ids in sample:
            got = b"".join(pieces[i] if i < n else b"" for i in ids).decode("utf-8", "replace")
            if got != backend.decode(ids, skip_special_tokens=True):
                return None
    except Exception:  # any surprise: the tokenizer's own decode
        return None
    return pieces


def warm(tokenizer: Tokenizer) -> None:
    """Build what the tokenizer's detokenizing needs before requests come: its byte
    table, from the ``tokenizers.Tokenizer`` its ``decode_backend()`` names (a
    tokenizer without one, or whose backend is not byte-level, gets none). Once
    per tokenizer."""
    try:
        if tokenizer in _PIECES:
            return
        backend = getattr(tokenizer, "decode_backend", None)
        b = backend() if backend is not None else None
        _PIECES[tokenizer] = byte_level_pieces(b) if b is not None else None
    except TypeError:  # not weak-referenceable: its streams decode windows
        pass


def byte_pieces(tokenizer: Tokenizer) -> list[bytes] | None:
    """The tokenizer's byte table, once warm() built one; else None."""
    try:
        return _PIECES.get(tokenizer)
    except TypeError:
        return None


class TextStream:
    """The text of a request's output tokens, handed out as it becomes final.

    Decoding is the tokenizer's ``decode`` over windows of the ids (vLLM's
    prefix/read offsets), or, where the tokenizer has a byte table
    (``byte_pieces``: byte-level BPE, the table built by ``warm``), the bytes of
    the tokens since the last text handed out, decoded as UTF-8: the same text
    (a byte-level decode is the UTF-8 of the tokens' bytes, and text is handed out
    only up to a complete character, so the bytes after it decode alone as they
    would after it), without a decode call per token."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), include_stop: bool = False):
        self._pieces: Sequence[bytes] | None = byte_pieces(tokenizer)
        self._pending = b""  # with a byte table: the bytes of the tokens from _read on
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
        tid = int(tid)
        ids.append(tid)
        pieces = self._pieces
        if pieces is not None:
            pending = self._pending + pieces[tid] if tid < len(pieces) else self._pending
            if pending:
                text = pending.decode("utf-8", "replace")
                if text[-1] != _INCOMPLETE:
                    self._text += text
                    self._prefix = self._read
                    self._read = len(ids)
                    pending = b""
            self._pending = pending
            return
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
        if self._pieces is not None:
            n = len(self._pieces)
            self._pending = b"".join([self._pieces[t] for t in self._ids[read:] if t < n])
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
            if self._pieces is not None:
                self._text += self._pending.decode("utf-8", "replace")
                self._pending = b""
            else:
                prefix_text = self._window(self._ids, self._prefix, self._read)
                self._text += self._window(self._ids, self._prefix, len(self._ids))[len(prefix_text) :]
            self._prefix = self._read = len(self._ids)
        delta = self._text[self._sent :]
        self._sent = len(self._text)
        return delta
