"""DeltaTracker semantics: what it publishes for each kind of engine change,
and that a reader following its records always holds the engine's state."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frmps_engine.ring import DeltaTracker, RingWriter, create_ring, layout
from frmps_engine.ring._testwriter import FakeRequest, Workload, state_digest
from frmps_engine.ring.reader import RingReader

R, F, A = layout.FLAG_RESET, layout.FLAG_FINISHED, layout.FLAG_ABORTED


@pytest.fixture
def rig(tmp_path):
    p = str(tmp_path / "ring")
    create_ring(p, 1 << 20)
    r = RingReader(p)
    w = RingWriter.attach(p)
    yield w, DeltaTracker(w), r
    w.close()
    r.close()


def last(r: RingReader):
    r.poll()
    rec = r.records[-1]
    return rec.type, {e.key: (e.flags, e.blocks, e.tokens, e.num_computed, e.num_prompt) for e in rec.entries}


def req(key, tokens, blocks, num_prompt=2):
    """A fake engine request with all its tokens computed."""
    r = FakeRequest(key, 1000 + key, list(tokens), list(blocks))
    r.num_prompt = num_prompt
    r.num_computed = len(tokens)
    return r


def test_first_sync_is_full_then_deltas(rig):
    w, t, r = rig
    a = req(1, [10, 11], [5])
    t.sync(0, [a])
    typ, es = last(r)
    assert typ == layout.TYPE_FULL and es == {1: (R, [5], [10, 11], 2, 2)}
    # No change: the entry is left out (the record is still published).
    t.sync(1, [a])
    assert last(r) == (layout.TYPE_DELTA, {})
    # Appends: only the new tokens and blocks.
    a.token_ids += [12, 13]
    a.block_ids.append(6)
    a.num_computed = 3
    t.sync(2, [a])
    assert last(r) == (layout.TYPE_DELTA, {1: (0, [6], [12, 13], 3, 0)})
    # Only num_computed moved.
    a.num_computed = 4
    t.sync(3, [a])
    assert last(r) == (layout.TYPE_DELTA, {1: (0, [], [], 4, 0)})
    assert r.snapshot[1].tokens == [10, 11, 12, 13] and r.snapshot[1].blocks == [5, 6]


@pytest.mark.parametrize(
    "change",
    [
        lambda a: setattr(a, "block_ids", [9, 6]),  # first block replaced
        lambda a: setattr(a, "block_ids", [5, 9]),  # last published block replaced
        lambda a: setattr(a, "block_ids", [5]),  # shrunk
        lambda a: setattr(a, "block_ids", [7, 8, 9]),  # preempted into fresh blocks
    ],
)
def test_non_append_block_change_resets(rig, change):
    w, t, r = rig
    a = req(1, [10, 11, 12], [5, 6])
    t.sync(0, [a])
    change(a)
    t.sync(1, [a])
    typ, es = last(r)
    assert es[1][0] == R and es[1][1] == a.block_ids and es[1][2] == [10, 11, 12] and es[1][4] == 2
    assert r.snapshot[1].blocks == a.block_ids


def test_explicit_reset(rig):
    w, t, r = rig
    a = req(1, [10, 11, 12], [5, 6, 7])
    t.sync(0, [a])
    a.block_ids[1] = 99  # middle block: invisible to the O(1) append check
    t.reset(1)
    t.sync(1, [a])
    assert last(r)[1][1][0] == R and r.snapshot[1].blocks == [5, 99, 7]


def test_finished_and_aborted_published_once(rig):
    w, t, r = rig
    a, b, c = req(1, [1, 2], [1]), req(2, [3, 4], [2]), req(3, [5, 6], [3])
    t.sync(0, [a, b, c])
    a.token_ids.append(9)
    a.finished = True
    b.aborted = True
    t.sync(1, [a, b, c])
    typ, es = last(r)
    assert es == {1: (F, [], [9], 2, 0), 2: (A, [], [], 2, 0)}
    assert set(r.snapshot) == {3}
    t.sync(2, [a, b, c])  # the engine still lists them: published once only ...
    typ, es = last(r)
    # ... a finished request that shows up again is a new sighting: RESET+FINISHED,
    # which the reader applies and drops, so the snapshot stays right.
    assert set(r.snapshot) == {3}


def test_forget_tells_the_reader(rig):
    w, t, r = rig
    a, b = req(1, [1, 2], [1]), req(2, [3, 4], [2])
    t.sync(0, [a, b])
    t.forget(1)
    t.sync(1, [b])
    assert last(r) == (layout.TYPE_DELTA, {1: (A, [], [], 0, 0)})
    assert set(r.snapshot) == {2}
    t.forget(12345)  # unknown: nothing to tell
    t.sync(2, [b])
    assert last(r) == (layout.TYPE_DELTA, {})


def test_resync_request_gets_full(rig, tmp_path):
    w, t, r = rig
    a = req(1, [1, 2], [1])
    t.sync(0, [a])
    r.poll()
    r2 = RingReader(w.path)  # a restarted supervisor asks for full state
    assert w.resync_requested()
    a.token_ids.append(3)
    t.sync(1, [a])
    assert not w.resync_requested()
    r2.poll()
    assert r2.records[-1].type == layout.TYPE_FULL and not r2.stale
    assert r2.snapshot[1].tokens == [1, 2, 3]
    assert last(r)[0] == layout.TYPE_FULL and r.snapshot[1].tokens == [1, 2, 3]
    r2.close()


def test_failed_publish_forces_full(rig, monkeypatch):
    w, t, r = rig
    a = req(1, [1, 2], [1])
    t.sync(0, [a])
    real = w.publish_columns

    def fail_once(*args, **kw):  # TEST DOUBLE of a publish that fails (e.g. a closed ring)
        monkeypatch.setattr(w, "publish_columns", real)
        raise RuntimeError("publish failed")

    monkeypatch.setattr(w, "publish_columns", fail_once)
    with pytest.raises(RuntimeError):
        t.sync(1, [a, req(2, [3, 4], [2])])
    t.sync(2, [a])
    assert last(r)[0] == layout.TYPE_FULL and set(r.snapshot) == {1}


def _digest_of_reader(r: RingReader) -> str:
    views = []
    for s in r.snapshot.values():
        v = FakeRequest(s.key, s.seed, s.tokens, s.blocks)
        v.num_prompt, v.num_computed = s.num_prompt, s.num_computed
        views.append(v)
    return state_digest(views)


class PartsView:
    """A view with parts(): live lists that have grown past the view's lengths since
    it was taken (the reference engine's O(1) snapshot). Only the first n count."""

    def __init__(self, v, junk):
        self.key, self.seed, self.num_prompt, self.num_computed = v.key, v.seed, v.num_prompt, v.num_computed
        self.finished, self.aborted = v.finished, v.aborted
        self._p = (list(v.block_ids) + junk, len(v.block_ids), list(v.token_ids) + junk, len(v.token_ids))

    @property
    def block_ids(self):
        raise AssertionError("the tracker must use parts()")

    token_ids = block_ids

    def parts(self):
        return self._p


def drive(p: str, seed: int, sync_every: int, after_record, wrap=lambda views: views) -> None:
    """A random engine (arrivals, decode, preemption, finish, abort, forget) through
    the tracker onto the ring at p for 150 steps; after_record(reader, live) after
    every record."""
    r = RingReader(p)
    with RingWriter.attach(p) as w:
        t = DeltaTracker(w)
        wl = Workload(seed, max_live=12)
        t.sync(0, [])
        pending = {}
        for step in range(1, 150):
            for v in wl.step(t):
                pending[v.key] = v
            for k in [k for k, v in pending.items() if k not in wl.live and not (v.finished or v.aborted)]:
                del pending[k]
            if step % sync_every:
                continue
            t.sync(step, wrap(list(pending.values()) + [x for x in wl.live.values() if x.key not in pending]))
            pending.clear()
            after_record(r, list(wl.live.values()))
    r.close()


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32), sync_every=st.sampled_from([1, 2, 5]), parts=st.booleans())
def test_reader_follows_engine(tmp_path_factory, seed, sync_every, parts):
    """A random engine through the tracker: after every record the reader holds the
    engine's state. With parts: the views are O(1) snapshots whose lists grew after
    they were taken."""
    p = str(tmp_path_factory.mktemp("t") / "ring")
    create_ring(p, 1 << 20)

    def check(r, live):
        r.poll()
        assert not r.stale
        assert _digest_of_reader(r) == state_digest(live)

    wrap = (lambda views: [PartsView(v, [7777777] * (v.key % 3)) for v in views]) if parts else (lambda views: views)
    drive(p, seed, sync_every, check, wrap)


# ---- records larger than the ring takes -------------------------------------------


@pytest.fixture
def small(tmp_path):
    """A 8 KiB ring: records of at most 2 KiB (a quarter)."""
    p = str(tmp_path / "ring")
    create_ring(p, 8192)
    r = RingReader(p)
    w = RingWriter.attach(p)
    yield w, DeltaTracker(w), r
    w.close()
    r.close()


def held(r: RingReader, reqs):
    """The reader's snapshot: which requests it holds, each checked equal to the engine's state."""
    r.poll()
    by_key = {q.key: q for q in reqs}
    for key, s in r.snapshot.items():
        q = by_key[key]
        assert (s.seed, s.num_prompt, s.num_computed, s.blocks, s.tokens) == (
            q.seed, q.num_prompt, q.num_computed, q.block_ids, q.token_ids), key
    return set(r.snapshot)


def long_req(key, n_tokens):
    return req(key, range(key * 1000, key * 1000 + n_tokens), range(key * 100, key * 100 + n_tokens // 16 + 1))


def test_a_full_record_too_large_for_the_ring_leaves_requests_out_and_says_so(small, caplog):
    """Eight requests of 200 tokens (~7 KiB of state) against 2 KiB records: the FULL
    record carries the requests that fit, the reader holds exactly those (a takeover
    re-prefills the others), the engine keeps publishing, and the log names the ring
    size needed. When the next record has room, the left-out requests come in whole."""
    w, t, r = small
    reqs = [long_req(i, 200) for i in range(1, 9)]
    t.sync(0, reqs)
    got = held(r, reqs)
    assert r.records[-1].type == layout.TYPE_FULL and len(r.records) == 1
    assert 0 < len(got) < len(reqs)
    assert "size the ring (frmps serve --ring-capacity) to at least 32768 bytes" in caplog.text
    # The next record: what the reader holds goes as small deltas, which leaves room
    # for the requests left out, tried again whole (RESET).
    for q in reqs:
        q.token_ids.append(7)
        q.num_computed += 1
    t.sync(1, reqs)
    assert held(r, reqs) > got
    assert r.records[-1].type == layout.TYPE_DELTA
    for q in reqs[:6]:
        q.finished = True
    t.sync(2, reqs)
    assert held(r, reqs) == {q.key for q in reqs[6:]}
    assert len(caplog.records) == 1, "the warning is logged once"


def test_a_delta_too_large_for_the_ring_drops_the_request_from_the_snapshot(small):
    """A known request that grew by more than a record takes is dropped by a
    RESET+ABORTED tombstone (not left stale in the reader), and published again
    whole when it fits."""
    w, t, r = small
    a, b = req(1, [10, 11], [5]), req(2, [20, 21], [6])
    t.sync(0, [a, b])
    assert held(r, [a, b]) == {1, 2}
    a.token_ids += list(range(100, 700))  # 600 tokens: 2.4 KiB on its own
    a.num_computed = len(a.token_ids)
    b.token_ids.append(22)
    b.num_computed = 3
    t.sync(1, [a, b])
    assert held(r, [a, b]) == {2}
    a.token_ids = a.token_ids[:300]  # (a test's liberty: the engine state shrank to what fits)
    a.num_computed = 300
    t.sync(2, [a, b])
    assert held(r, [a, b]) == {1, 2}


def test_a_record_whose_tombstones_alone_overflow_is_refused(small):
    w, t, r = small
    t.sync(0, [])  # a FULL record leaves out what does not fit; a DELTA owes each new request a tombstone
    with pytest.raises(Exception, match="do not fit in a ring record"):
        t.sync(1, [req(i, [1, 2], [i]) for i in range(1, 200)])  # 199 × 36 B of entries alone > 2 KiB


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32), sync_every=st.sampled_from([1, 2, 5]))
def test_reader_holds_a_true_part_of_the_engine_on_a_ring_too_small(tmp_path_factory, seed, sync_every):
    """The random engine of test_reader_follows_engine on a 4 KiB ring (records of at
    most 1 KiB; the engine's state grows to several times that): every record is
    published, the reader never goes stale, and every request it holds equals the
    engine's state of that request (what it lacks, a takeover re-prefills)."""
    p = str(tmp_path_factory.mktemp("t") / "ring")
    create_ring(p, 4096)
    seen = {"held": 0}

    def check(r, live):
        seen["held"] += len(held(r, live))
        assert not r.stale

    drive(p, seed, sync_every, check)
    assert seen["held"]
