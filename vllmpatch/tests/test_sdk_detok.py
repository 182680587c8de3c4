"""Incremental detokenization: UTF-8 across tokens, stop strings, chunking independence."""

from hypothesis import given, settings, strategies as st

from frmps_engine.sdk.detok import TextStream
from frmps_engine.sdk.testing.fake_engine import FakeTokenizer

TOK = FakeTokenizer()


def _run(ids, chunks, stop=(), include=False):
    ts = TextStream(TOK, stop, include)
    out, accepted, i = [], 0, 0
    for c in chunks:
        n, delta, hit = ts.feed(ids[i:i + c])
        out.append(delta)
        accepted += n
        i += c
        if hit is not None:
            break
    out.append(ts.flush())
    return "".join(out), accepted, ts.stopped


def test_multibyte_character_split_over_tokens():
    ids = TOK.encode("añb€c")
    ts = TextStream(TOK)
    deltas = [ts.feed([t])[1] for t in ids]
    assert "".join(deltas) == "añb€c"
    assert "\ufffd" not in "".join(deltas)
    assert deltas[2] == "ñ" and deltas[1] == ""  # held until the character is complete


def test_stop_string_across_tokens_is_cut_and_held_back():
    ids = TOK.encode("hello STOP world")
    text, n, stop = _run(ids, [1] * len(ids), stop=["STOP"])
    assert (text, stop) == ("hello ", "STOP")
    assert n == len("hello STOP")  # tokens after the match are not accepted
    text, _, _ = _run(ids, [1] * len(ids), stop=["STOP"], include=True)
    assert text == "hello STOP"
    ts = TextStream(TOK, ["STOP"])
    # The last len("STOP")-1 characters are held back: they could start a stop string.
    assert ts.feed(TOK.encode("abcS"))[1] == "a"
    assert ts.feed(TOK.encode("x"))[1] == "b"
    assert ts.flush() == "cSx"


def test_no_stop_flush_emits_incomplete_bytes():
    ts = TextStream(TOK)
    assert ts.feed([0xE2, 0x82])[1] == ""
    assert ts.flush() == "\ufffd"


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abSTOP €ñ", max_size=40), st.lists(st.integers(1, 5), min_size=1, max_size=60))
def test_text_does_not_depend_on_chunking(s, chunks):
    ids = TOK.encode(s)
    chunks = chunks * (len(ids) // max(1, sum(chunks)) + 1)
    a = _run(ids, [1] * max(1, len(ids)), stop=["STOP"])
    b = _run(ids, chunks, stop=["STOP"])
    assert a == b
    cut = s.find("STOP")
    assert a[0] == (s if cut < 0 else s[:cut])


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet="ab €ñ", min_size=1, max_size=30), st.integers(0, 60))
def test_resume_prime_continues_the_text(s, d):
    """A stream taken over at token d hands out exactly the text the client is missing."""
    ids = TOK.encode(s)
    d = min(d, len(ids))
    first = TextStream(TOK)
    sent = first.feed(ids[:d])[1]
    second = TextStream(TOK)
    second.prime(ids[:d])
    rest = second.feed(ids[d:])[1] + second.flush()
    assert sent + rest == s


class _CountingTokenizer:
    """FakeTokenizer that counts decode calls (test double)."""

    def __init__(self):
        self.calls = 0

    def decode(self, ids):
        self.calls += 1
        return TOK.decode(ids)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 255), max_size=80), st.integers(0, 80), st.integers(0, 80))
def test_window_decoder_is_the_tokenizers_decode(ids, a, b):
    """The one-token cache returns exactly what decode does, for every window."""
    from frmps_engine.sdk.detok import window_decoder

    w = window_decoder(TOK)
    assert w(ids, a, b) == (TOK.decode(ids[a:b]) if b > a else "")
    assert w(ids, a, b) == (TOK.decode(ids[a:b]) if b > a else "")  # served from the cache now


def test_priming_decodes_one_token_windows_once():
    """Replaying a resumed stream's tokens: once text flows, every step's prefix is
    a one-token window, decoded once per token id for the tokenizer's lifetime."""
    tok = _CountingTokenizer()
    ids = TOK.encode("abcd" * 50)
    TextStream(tok).prime(ids)
    first = tok.calls
    assert first < 2 * len(ids) - 100  # without the cache: two decode calls per token
    tok.calls = 0
    TextStream(tok).prime(ids)
    assert tok.calls <= len(ids) + 4  # every one-token window is cached by now


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.sampled_from(["", "STOP", "€Z"]), st.integers(1, 7))
def test_long_streams_keep_only_the_text_they_still_need(reps, stop, chunk):
    """A long stream's text is trimmed once handed out, without changing a delta or
    a stop match (a match more than a trim's length into the stream)."""
    body = "añb€c d" * (1000 * reps)
    s = body + (stop or "xyz") + "tail"
    ids = TOK.encode(s)
    text, n, hit = _run(ids, [chunk] * (len(ids) // chunk + 1), stop=[stop] if stop else [])
    if stop:
        assert (text, hit, n) == (body, stop, len(TOK.encode(body + stop)))
    else:
        assert (text, hit) == (s, None)
    ts = TextStream(TOK, [stop] if stop else [])
    ts.feed(TOK.encode(body))
    assert len(ts._text) < 4096 + 64  # not the ~7,000 characters per repetition handed out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 255), max_size=60), st.integers(0, 60), st.lists(st.integers(1, 4), min_size=1, max_size=20))
def test_restore_from_offsets_continues_exactly(ids, d, chunks):
    """A stream restored from another stream's offsets after d tokens hands out
    exactly the text the first one would have (bytes 0-255: invalid and
    incomplete UTF-8 included, so the offsets are not trivial)."""
    d = min(d, len(ids))
    first = TextStream(TOK)
    i = 0
    for c in chunks * (d // max(1, sum(chunks)) + 1):
        if i >= d:
            break
        first.feed(ids[i:min(d, i + c)])
        i = min(d, i + c)
    off = first.offsets()
    assert off is not None
    second = TextStream(TOK)
    assert second.restore(ids[:d], *off)
    want = first.feed(ids[d:])[1] + first.flush()
    assert second.feed(ids[d:])[1] + second.flush() == want


def test_restore_refuses_what_offsets_cannot_stand_for():
    ts = TextStream(TOK, ["STOP"])
    ts.feed(TOK.encode("abc"))
    assert ts.offsets() is None  # text is held back for the stop string
    assert not TextStream(TOK, ["STOP"]).restore(TOK.encode("abc"), 0, 3)
    assert not TextStream(TOK).restore(TOK.encode("abc"), 2, 1)
    assert not TextStream(TOK).restore(TOK.encode("abc"), 0, 4)
    used = TextStream(TOK)
    used.feed(TOK.encode("x"))
    assert not used.restore(TOK.encode("abc"), 0, 3)  # only a fresh stream
