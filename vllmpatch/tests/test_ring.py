"""Ring writer (frmps_engine.ring) against the Python reader, the CRC
reference and the shared test vectors."""

from __future__ import annotations

import os
import platform
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frmps_engine.ring import RequestDelta, RingError, RingWriter, create_ring
from frmps_engine.ring import _crc32c, layout, vectors
from frmps_engine.ring.reader import ResyncNeeded, RingReader

TESTDATA = Path(__file__).resolve().parents[2] / "ringbuf" / "testdata"


@pytest.fixture
def ring(tmp_path):
    p = str(tmp_path / "ring")
    create_ring(p, 1 << 16)
    return p


def test_create_ring(tmp_path):
    p = str(tmp_path / "r")
    create_ring(p, 4096)
    st_ = os.stat(p)
    assert stat.S_IMODE(st_.st_mode) == 0o600
    assert st_.st_size == layout.HEADER_SIZE + 4096
    with pytest.raises(FileExistsError):
        create_ring(p, 4096)
    for bad in (0, 2048, 4097, 6144, 1 << 35):
        with pytest.raises(RingError):
            create_ring(str(tmp_path / f"bad{bad}"), bad)
        assert not os.path.exists(tmp_path / f"bad{bad}")


@pytest.mark.parametrize(
    "offset,value,match",
    [
        (0, b"XRMPSRNG", "magic"),
        (8, (2).to_bytes(4, "little"), "version"),
        (12, (8192).to_bytes(4, "little"), "header_size"),
        (16, (6144).to_bytes(8, "little"), "capacity"),
        (16, (8192).to_bytes(8, "little"), "file size"),
    ],
)
def test_attach_bad_header(ring, offset, value, match):
    with open(ring, "r+b") as f:
        f.seek(offset)
        f.write(value)
    with pytest.raises(RingError, match=match):
        RingWriter.attach(ring)
    with pytest.raises(RingError, match=match):
        RingReader(ring)


def test_attach_truncated(tmp_path):
    p = tmp_path / "short"
    p.write_bytes(b"FRMPSRNG")
    with pytest.raises(RingError):
        RingWriter.attach(str(p))


def test_refuses_other_architectures(ring, monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    with pytest.raises(RingError, match="x86-64"):
        RingWriter.attach(ring)


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 27, 28, 63, 64, 65, 100, 1023, 1024, 1025, 4096 + 7, 70000, 300001, 2_100_003])
def test_crc32c_numpy_matches_reference(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    want = _crc32c.crc32c_ref(data) if n <= 5000 else _crc32c_ref_fast(data)
    assert _crc32c.crc32c_np(data) == want
    assert _crc32c.crc32c(data) == want


def _crc32c_ref_fast(data: bytes) -> int:
    # Byte-table reference for long inputs (the bitwise one is slow).
    t = _crc32c._T.tolist()
    crc = 0xFFFFFFFF
    for x in data:
        crc = t[(crc ^ x) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def test_crc32c_check_value():
    assert _crc32c.crc32c_np(b"123456789") == 0xE3069283
    assert _crc32c.crc32c_ref(b"123456789") == 0xE3069283


def test_first_record_must_be_full(ring):
    with RingWriter.attach(ring) as w:
        with pytest.raises(RingError, match="FULL"):
            w.publish(1, [])
        with pytest.raises(RingError, match="RESET"):
            w.publish(1, [RequestDelta(1, 1, 0)], full=True)
        w.publish(0, [], full=True)
        w.publish(1, [])


def test_column_checks(ring):
    with RingWriter.attach(ring) as w:
        w.publish(0, [], full=True)
        with pytest.raises(RingError, match="add up"):
            w.publish_columns(1, [1], [0], [0], [0], [0], [2], [0], [5], [])
        with pytest.raises(RingError, match="entries"):
            w.publish_columns(1, [1, 2], [0], [0], [0], [0], [0], [0], [], [])
        with pytest.raises(RingError, match="capacity/2"):
            w.publish(1, [RequestDelta(1, 1, 0, reset=True, tokens=[0] * 9000)])


def test_attach_bumps_epoch(ring):
    for want in (1, 2, 3):
        with RingWriter.attach(ring) as w:
            assert w.epoch == want
            w.publish(0, [], full=True)


entry_st = st.builds(
    RequestDelta,
    key=st.integers(0, 2**64 - 1),
    seed=st.integers(0, 2**64 - 1),
    num_computed=st.integers(0, 3),
    num_prompt=st.integers(0, 3),
    reset=st.just(True),
    finished=st.booleans(),
    aborted=st.booleans(),
    blocks=st.lists(st.integers(0, 2**32 - 1), max_size=8),
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=3, max_size=40),
)


@settings(max_examples=30, deadline=None)
@given(records=st.lists(st.lists(entry_st, max_size=6, unique_by=lambda e: e.key), min_size=1, max_size=20))
def test_round_trip(tmp_path_factory, records):
    """Whatever the writer publishes, the reader decodes exactly, across wraps."""
    p = str(tmp_path_factory.mktemp("rt") / "ring")
    create_ring(p, 8192)
    r = RingReader(p)
    with RingWriter.attach(p) as w:
        for i, entries in enumerate(records):
            seq = w.publish(i, entries, full=True)
            r.poll()
            rec = r.records[-1]
            assert (rec.seq, rec.type, rec.step, rec.epoch) == (seq, layout.TYPE_FULL, i, w.epoch)
            got = [(e.key, e.seed, e.num_computed, e.num_prompt, e.flags, e.blocks, e.tokens) for e in rec.entries]
            want = [
                (e.key, e.seed, e.num_computed, e.num_prompt,
                 layout.FLAG_RESET | (layout.FLAG_FINISHED if e.finished else 0) | (layout.FLAG_ABORTED if e.aborted else 0),
                 list(e.blocks), list(e.tokens))
                for e in entries
            ]  # fmt: skip
            assert got == want
            live = {e.key for e in entries if not (e.finished or e.aborted)}
            assert set(r.snapshot) == live and not r.stale
    r.close()


def test_delta_compaction_and_wrap(ring):
    r = RingReader(ring)
    with RingWriter.attach(ring) as w:
        w.publish(0, [RequestDelta(5, 9, 2, 3, reset=True, blocks=[1], tokens=[7, 8, 9])], full=True)
        toks = [7, 8, 9]
        blocks = [1]
        for i in range(1, 2000):
            nb = [100 + i] if i % 16 == 0 else []
            blocks += nb
            toks.append(i)
            w.publish(i, [RequestDelta(5, 9, len(toks) - 1, blocks=nb, tokens=[i])])
            if i % 7 == 0:
                r.poll()
        r.poll()
    assert w.cursor > 2 * w.capacity  # wrapped, with PADs
    assert any(rec.type == layout.TYPE_PAD for rec in r.records)
    s = r.snapshot[5]
    assert (s.tokens, s.blocks, s.num_computed, s.num_prompt, s.seed) == (toks, blocks, len(toks) - 1, 3, 9)
    r.close()


def test_overrun_then_full(ring):
    r = RingReader(ring)
    with RingWriter.attach(ring) as w:
        w.publish(0, [], full=True)
        r.poll()
        for i in range(1, 3000):
            w.publish(i, [RequestDelta(1, 1, 0, reset=True, tokens=[1] * 20)])
        with pytest.raises(ResyncNeeded, match="overrun"):
            r.poll()
        assert r.stale and w.resync_requested()
        w.publish(3000, [RequestDelta(2, 1, 1, 1, reset=True, tokens=[4])], full=True)
        assert not w.resync_requested()
        assert r.poll() == 1 and not r.stale and set(r.snapshot) == {2}
    r.close()


def test_corrupt_record_is_refused(ring):
    r = RingReader(ring)
    with RingWriter.attach(ring) as w:
        w.publish(0, [RequestDelta(1, 1, 1, 1, reset=True, tokens=[4])], full=True)
        r.poll()
        pos = w.cursor
        w.publish(1, [RequestDelta(1, 1, 2, tokens=[5])])
    with open(ring, "r+b") as f:  # flip a payload bit behind the writer's back
        f.seek(layout.HEADER_SIZE + pos + 40)
        b = f.read(1)
        f.seek(layout.HEADER_SIZE + pos + 40)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(ResyncNeeded, match="crc"):
        r.poll()
    assert r.stale and r.snapshot[1].tokens == [4]
    r.close()


def test_vectors_decode_go_writer(tmp_path):
    """The Go writer's ring (ringbuf/testdata/go_writer.ring) decodes to the scenario."""
    import json

    sc = json.loads((TESTDATA / "scenario.json").read_text())
    p = tmp_path / "go.ring"
    shutil.copy(TESTDATA / "go_writer.ring", p)
    r = RingReader(str(p), start=sc["start"])
    n = r.poll()
    assert [(x.seq, x.type, x.epoch, x.step) for x in r.records] == [
        (x["seq"], x["type"], x["epoch"], x["step"]) for x in sc["records"]
    ]
    assert n == sum(1 for x in sc["records"] if x["type"] != layout.TYPE_PAD)
    assert not r.stale
    got = {
        str(k): {"seed": s.seed, "num_prompt": s.num_prompt, "num_computed": s.num_computed, "blocks": s.blocks, "tokens": s.tokens}
        for k, s in r.snapshot.items()
    }
    assert got == sc["final"]
    r.close()


def test_vectors_python_writer_reproduces(tmp_path):
    """The committed vectors are what the current generator and writer produce."""
    import json

    sc = vectors.build_scenario()
    assert json.loads(json.dumps(sc)) == json.loads((TESTDATA / "scenario.json").read_text())
    p = str(tmp_path / "py.ring")
    vectors.write_ring(sc, p)
    assert Path(p).read_bytes() == (TESTDATA / "py_writer.ring").read_bytes()


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=0, max_size=4096), cursor=st.integers(0, 3 * 4096), flips=st.lists(st.integers(0, 4095), max_size=8))
def test_python_reader_never_crashes(tmp_path_factory, data, cursor, flips):
    """Arbitrary bytes in the data region (and a real ring with flipped bytes):
    the Python reader raises RingError or succeeds, nothing else."""
    p = str(tmp_path_factory.mktemp("fz") / "ring")
    create_ring(p, 4096)
    with RingWriter.attach(p) as w:
        w.publish(0, [RequestDelta(1, 2, 1, 1, reset=True, blocks=[3], tokens=[4])], full=True)
        for i in range(1, 30):
            w.publish(i, [RequestDelta(1, 2, 1 + i, tokens=[i])])
    with open(p, "r+b") as f:
        if data:
            f.seek(layout.HEADER_SIZE)
            f.write(data)
        for off in flips:
            f.seek(layout.HEADER_SIZE + off)
            b = f.read(1)
            f.seek(layout.HEADER_SIZE + off)
            f.write(bytes([b[0] ^ 0x5A]))
        f.seek(layout.OFF_WRITE_CURSOR)
        f.write(cursor.to_bytes(8, "little"))
    r = RingReader(p, start=0)
    for _ in range(3):
        try:
            r.poll()
        except RingError:
            pass
        for s in r.snapshot.values():
            assert s.num_computed <= len(s.tokens) and s.num_prompt <= len(s.tokens)
    r.close()


@pytest.mark.parametrize("n_tokens", [40_000, 40_001])
def test_large_record_grows_the_scratch_to_whole_words(tmp_path, n_tokens):
    """A record more than twice the writer's scratch buffer, of any length (here with an
    odd number of 4-byte columns), is published and read back whole."""
    p = str(tmp_path / "ring")
    create_ring(p, 1 << 20)
    r = RingReader(p)
    with RingWriter.attach(p) as w:
        tokens = [i % 50_000 for i in range(n_tokens)]
        w.publish(7, [RequestDelta(key=1, seed=2, num_computed=n_tokens, num_prompt=5, reset=True,
                                   blocks=[3], tokens=tokens)], full=True)
        r.poll()
        (e,) = r.records[-1].entries
        assert (e.key, e.num_computed, e.blocks, e.tokens) == (1, n_tokens, [3], tokens)
    r.close()
