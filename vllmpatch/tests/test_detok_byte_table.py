"""Detokenizing from a byte table (sdk/detok.py: byte_level_pieces, TextStream):
the same text, token for token, as decoding windows through the tokenizer.

The tokenizer is the byte-level BPE one frmps writes into its model directories
(modeldir.tokenizer_json: byte symbols, merges, Qwen2.5's added tokens, special
and not), at a small vocabulary; ids are drawn from the whole of it and past it,
so invalid and incomplete UTF-8, skipped special tokens and unknown ids all occur."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

pytest.importorskip("tokenizers")

from frmps_engine.modeldir import QWEN_ADDED_TOKENS, regular_tokens, tokenizer_json  # noqa: E402
from frmps_engine.refengine.tokenizer import HFTokenizer  # noqa: E402
from frmps_engine.sdk.detok import TextStream, byte_level_pieces, byte_pieces, warm  # noqa: E402

VOCAB = 1024


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("bytetok")
    (d / "tokenizer.json").write_text(tokenizer_json(VOCAB))
    t = HFTokenizer(str(d))
    assert byte_pieces(t) is None  # built by warm(), never on a request's path
    warm(t)
    assert byte_pieces(t) is not None
    return t


class Windowed:
    """The same tokenizer without its byte table: TextStream decodes windows."""

    def __init__(self, tok):
        self.decode = tok.decode


def _run(tokenizer, ids, chunks, stop=()):
    ts = TextStream(tokenizer, stop)
    out, i = [], 0
    for c in chunks:
        out.append(ts.feed(ids[i:i + c]))
        i += c
        out.append(ts.offsets())
        if out[-2][2] is not None:
            break
    out.append(ts.flush())
    return out


ids_st = st.lists(st.integers(0, VOCAB + 8), max_size=50)
bytes_st = st.lists(st.integers(0, 255), max_size=50)  # the byte symbols: UTF-8 made and broken byte by byte


@settings(max_examples=300, deadline=None)
@given(st.one_of(ids_st, bytes_st), st.lists(st.integers(1, 4), min_size=1, max_size=20),
       st.sampled_from([(), ("\ufffd",), ("a",), ("ab", "b")]))
def test_byte_table_hands_out_what_windows_do(tok, ids, chunks, stop):
    chunks = chunks * (len(ids) // sum(chunks) + 1)
    assert _run(tok, ids, chunks, stop) == _run(Windowed(tok), ids, chunks, stop)


@settings(max_examples=200, deadline=None)
@given(st.one_of(ids_st, bytes_st), st.integers(0, 50), st.booleans())
def test_offsets_carry_over_between_the_two_ways(tok, ids, d, table_first):
    """A stream restored from the other way's offsets continues with the same text
    (an engine that takes over need not decode as the one before it did)."""
    d = min(d, len(ids))
    a, b = (tok, Windowed(tok)) if table_first else (Windowed(tok), tok)
    first = TextStream(a)
    first.feed(ids[:d])
    second = TextStream(b)
    assert second.restore(ids[:d], *first.offsets())
    assert second.feed(ids[d:])[1] + second.flush() == first.feed(ids[d:])[1] + first.flush()


def test_added_tokens_special_ones_skipped(tok):
    pieces = byte_pieces(tok)
    first = regular_tokens(VOCAB)
    for k, (content, special) in enumerate(QWEN_ADDED_TOKENS):
        assert pieces[first + k] == (b"" if special else content.encode()), content
    assert any(not special for _, special in QWEN_ADDED_TOKENS)  # both kinds are covered


class _Backend:
    """The tokenizers.Tokenizer under test with one thing changed."""

    def __init__(self, real, decode=None, decoder=None):
        self._real, self._decode, self._decoder = real, decode, decoder

    def __getattr__(self, name):
        return getattr(self._real, name)

    @property
    def decoder(self):
        return self._decoder if self._decoder is not None else self._real.decoder

    def decode(self, ids, skip_special_tokens=True):
        out = self._real.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._decode(ids, out) if self._decode is not None else out


def test_a_table_is_built_only_where_it_decodes_as_the_tokenizer(tok):
    """Negative controls: a tokenizer whose decode differs from the bytes' UTF-8 on a
    rarely seen token, or whose decoder is not ByteLevel, gets no table (its streams
    decode windows)."""
    real = tok._tok
    assert byte_level_pieces(real) == byte_pieces(tok)
    odd = max(i for i in range(VOCAB) if byte_pieces(tok)[i])  # among the last ids: always sampled

    def cleans_up(ids, text):  # e.g. a decoder that post-processes one token
        return text.replace(tok.decode([odd]), "?") if odd in ids else text

    assert byte_level_pieces(_Backend(real, decode=cleans_up)) is None
    from tokenizers import decoders

    assert byte_level_pieces(_Backend(real, decoder=decoders.Metaspace())) is None
