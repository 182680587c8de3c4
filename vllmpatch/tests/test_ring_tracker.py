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


def test_failed_publish_forces_full(rig):
    w, t, r = rig
    a = req(1, [1, 2], [1])
    t.sync(0, [a])
    huge = req(2, list(range(200_000)), [1])
    with pytest.raises(Exception):
        t.sync(1, [a, huge])
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


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32), sync_every=st.sampled_from([1, 2, 5]), parts=st.booleans())
def test_reader_follows_engine(tmp_path_factory, seed, sync_every, parts):
    """A random engine (arrivals, decode, preemption, finish, abort, forget)
    through the tracker: after every record the reader holds the engine's state.
    With parts: the views are O(1) snapshots whose lists grew after they were taken."""
    p = str(tmp_path_factory.mktemp("t") / "ring")
    create_ring(p, 1 << 20)
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
            views = list(pending.values()) + [x for x in wl.live.values() if x.key not in pending]
            if parts:
                views = [PartsView(v, [7777777] * (v.key % 3)) for v in views]
            t.sync(step, views)
            pending.clear()
            r.poll()
            assert not r.stale
            assert _digest_of_reader(r) == state_digest(wl.live.values()), f"step {step}"
    r.close()
