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
