"""The reference engine's scheduler on its own: no model, no device. A labelled test
double stands in for the model: ``fake_token`` "samples" a token from (seed,
position) only, as the real sampler's noise does, so a run's outputs depend on
nothing but the requests, whatever the schedule."""

from __future__ import annotations

from collections import defaultdict

import pytest

from e2e import require

require("torch")  # the refengine package imports it; the scheduler itself does not use it
pytestmark = pytest.mark.torch

from frmps_engine.refengine import ByteTokenizer, EngineConfig, SamplingParams  # noqa: E402
from frmps_engine.refengine.scheduler import (  # noqa: E402
    DefaultPolicy,
    ExactPolicy,
    Scheduler,
    SchedulerOutput,
)

B = 4  # max_num_seqs
C = 16  # max_num_batched_tokens
BS = 16  # the tiny preset's block size


def make(exact: bool = False, num_blocks: int = 64, **kw) -> Scheduler:
    cfg = EngineConfig.from_preset("tiny", num_blocks=num_blocks, max_num_seqs=kw.pop("max_num_seqs", B),
                                   max_num_batched_tokens=kw.pop("max_num_batched_tokens", C), exact=exact, **kw)
    return Scheduler(cfg, ByteTokenizer())


def fake_token(seed: int, position: int) -> int:
    """TEST DOUBLE for the model + sampler: a byte from (seed, position) only."""
    return 32 + (seed * 7919 + position * 104729) % 90


def prompt(key: int, n: int) -> list[int]:
    return [(key * 13 + i) % 200 + 1 for i in range(n)]


def params(max_tokens: int, seed: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=seed)


def run_pass(s: Scheduler, wrong_at: set[tuple[int, int]] = frozenset()) -> tuple[SchedulerOutput, list]:
    """One pass with the fake model; (key, position) in wrong_at samples a different token."""
    batch = s.schedule()
    toks = []
    for row in batch.sampled:
        t = fake_token(row.request.seed, row.position)
        toks.append(t + 1 if (row.request.key, row.position) in wrong_at else t)
    return batch, s.update_from_output(batch, toks)


class Run:
    """Drives a scheduler to the end; records every pass's shape per (key, position)."""

    def __init__(self, s: Scheduler):
        self.s = s
        self.out: dict[int, list[int]] = defaultdict(list)
        self.finish: dict[int, str] = {}
        self.shape: dict[tuple[int, int], tuple] = {}
        # Per pass: (pad_decode_to, [(key, start, tokens, num_prompt), ...]).
        self.passes: list[tuple[int | None, list[tuple[int, int, int, int]]]] = []

    def step(self) -> SchedulerOutput:
        batch, outs = run_pass(self.s)
        if batch:
            self.passes.append((batch.pad_decode_to, [(r.key, r.num_computed - n, n, r.num_prompt) for r, n in batch]))
        decode = batch.pad_decode_to is not None
        for req, n in batch:
            start = req.num_computed - n  # committed by update_from_output
            kind = ("decode", batch.pad_decode_to) if decode else ("prefill", start, n, len(batch))
            for p in range(start, start + n):
                self.shape[(req.key, p)] = kind
        for o in outs:
            assert o.output_index == len(self.out[o.key]), "outputs are contiguous, each token once"
            self.out[o.key] += o.new_token_ids
            if o.finished:
                self.finish[o.key] = o.finish_reason
        return batch

    def until_idle(self, limit: int = 2000) -> Run:
        for _ in range(limit):
            if not self.s.has_work():
                return self
            self.step()
        raise AssertionError("scheduler did not finish")


REQS = [(1, 40, 9), (2, 7, 12), (3, 23, 6), (4, 3, 15)]  # (key, prompt length, max_tokens)


def expected_output(key: int, plen: int, max_tokens: int) -> list[int]:
    from frmps_engine.refengine import default_seed

    return [fake_token(default_seed(key), plen + i) for i in range(max_tokens)]


def staggered(exact: bool, stagger: int, **kw) -> Run:
    run = Run(make(exact, **kw))
    pending = list(REQS)
    step = 0
    while pending or run.s.has_work():
        while pending and step >= stagger * (len(REQS) - len(pending)):
            key, plen, mt = pending.pop(0)
            run.s.add_request(key, prompt(key, plen), params(mt))
        run.step()
        step += 1
    return run


@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
def test_every_request_completes_with_its_own_tokens(exact):
    run = staggered(exact, stagger=2)
    for key, plen, mt in REQS:
        assert run.out[key] == expected_output(key, plen, mt)
        assert run.finish[key] == "length"
    s = run.s
    assert not s.requests and not s.running and not s.waiting
    s.request_views()  # the consumer has seen the retirements: quarantined blocks come back
    s.blocks.check()
    assert s.blocks.num_free == s.cfg.num_blocks - 1
    assert s.counters["generated_tokens"] == sum(mt for _, _, mt in REQS)


def test_default_policy_decodes_first_and_chunks_prefill_to_the_budget():
    s = make(max_num_batched_tokens=10)
    s.add_request(1, prompt(1, 3), params(5))
    batch, _ = run_pass(s)
    assert [(r.key, n) for r, n in batch] == [(1, 3)] and batch.pad_decode_to is None
    s.add_request(2, prompt(2, 25), params(5))
    batch, outs = run_pass(s)
    # The running request's one decode token first, then 9 prompt tokens of the newcomer.
    assert [(r.key, n) for r, n in batch] == [(1, 1), (2, 9)]
    assert [row.request.key if row else None for row in batch.rows] == [1, None]  # no logits mid-prompt
    assert [o.key for o in outs] == [1]
    batch, _ = run_pass(s)
    assert [(r.key, n) for r, n in batch] == [(1, 1), (2, 9)]
    batch, outs = run_pass(s)
    assert [(r.key, n) for r, n in batch] == [(1, 1), (2, 7)]  # the prompt's last chunk samples
    assert sorted(o.key for o in outs) == [1, 2]


def test_admission_stops_at_max_num_seqs():
    s = make(max_num_seqs=2, max_num_batched_tokens=100)
    for k in (1, 2, 3):
        s.add_request(k, prompt(k, 4), params(3))
    batch, _ = run_pass(s)
    assert sorted(r.key for r, _ in batch) == [1, 2]
    assert [r.key for r in s.waiting] == [3]


def test_committed_state_moves_only_when_the_pass_is_reported():
    """Between schedule() and update_from_output() the views are the previous pass's:
    the engine publishes the ring there while the device computes."""
    s = make(max_num_batched_tokens=64)
    s.add_request(1, prompt(1, 20), params(4))
    s.request_views()
    batch = s.schedule()
    (v,) = s.request_views()
    assert v.num_computed == 0 and len(v.token_ids) == 20 and v.block_ids == batch.chunks[0][0].block_ids
    s.update_from_output(batch, [fake_token(batch.sampled[0].request.seed, 20)])
    (v,) = s.request_views()
    assert v.num_computed == 20 and len(v.token_ids) == 21


def test_update_checks_the_token_count():
    s = make()
    s.add_request(1, prompt(1, 5), params(2))
    batch = s.schedule()
    with pytest.raises(ValueError, match="1 rows"):
        s.update_from_output(batch, [])


def test_preemption_recomputes_the_newest_request_later():
    """Two requests that cannot both hold their KV: the newest is preempted (blocks
    released, recomputed from scratch later) and both still finish correctly."""
    s = make(num_blocks=5, max_num_batched_tokens=64)  # 4 usable blocks of 16 tokens
    s.add_request(1, prompt(1, 30), params(30))  # grows to 60 tokens: 4 blocks
    s.add_request(2, prompt(2, 20), params(20))  # grows to 40 tokens: 3 blocks
    run = Run(s).until_idle()
    assert s.counters["preemptions"] > 0
    assert run.out[1] == expected_output(1, 30, 30)
    assert run.out[2] == expected_output(2, 20, 20)


def test_exact_policy_pass_shapes():
    """A pass is a decode pass of every request past its prompt, padded to B rows,
    or one prefill chunk of one request that ends at the prompt's end or at a
    multiple of C; the two alternate while both wait."""
    run = staggered(exact=True, stagger=3)
    plen = {k: n for k, n, _ in REQS}
    kinds = []
    for pad, chunks in run.passes:
        decode = [n == 1 and start >= num_prompt for _, start, n, num_prompt in chunks]
        assert all(decode) or (len(chunks) == 1 and not decode[0]), "a pass mixes prefill and decode"
        if pad is not None:
            assert all(decode) and pad == B
            kinds.append("d")
        else:
            ((key, start, n, _),) = chunks
            assert start % C == 0 and (start + n == plen[key] or (start + n) % C == 0), (key, start, n)
            kinds.append("p")
    assert run.s.counters["replay_mismatches"] == 0


def test_exact_policy_alternates_decode_and_prefill():
    s = make(exact=True)
    s.add_request(1, prompt(1, 5), params(20))
    run = Run(s)
    run.step()
    s.add_request(2, prompt(2, 40), params(3))
    for _ in range(8):
        run.step()
    kinds = ["d" if pad is not None else "p" for pad, _ in run.passes]
    # Request 2's prompt (16 + 16 + 8) interleaves with request 1's decodes, then both decode.
    assert "".join(kinds) == "pdpdpdpdd"
    assert [n for pad, chunks in run.passes if pad is None for _, _, n, _ in chunks] == [5, 16, 16, 8]


def test_exact_shapes_do_not_depend_on_arrivals_and_default_ones_do():
    a, b = staggered(True, 0), staggered(True, 5)
    assert a.shape == b.shape and a.out == b.out
    a, b = staggered(False, 0), staggered(False, 5)
    assert a.out == b.out
    assert a.shape != b.shape  # the control: the same check fails for the default policy


def _synced(s: Scheduler, steps: int):
    """Run `steps` passes, then the ring's view of every live request."""
    run = Run(s)
    for _ in range(steps):
        run.step()
    return run, {v.key: v for v in s.request_views() if not (v.finished or v.aborted)}


def _snapshot_and_delivered():
    """The active ran 6 passes (a 40-token prompt in chunks of 16, 16, 8, then three
    decodes) and published; the client then got 3 more tokens."""
    active = make()
    active.add_request(1, prompt(1, 40), params(20))
    _, snap = _synced(active, 6)
    v = snap[1]
    assert (v.num_computed, len(v.token_ids)) == (43, 44)
    delivered = v.token_ids[40:] + [fake_token(v.seed, p) for p in (44, 45, 46)]
    return v, delivered


def _finish(s: Scheduler, key: int, delivered: list[int]) -> list[int]:
    run = Run(s)
    run.out[key] = list(delivered)
    return run.until_idle().out[key]


def test_default_adoption_computes_the_tail_in_one_pass():
    """One pass computes every token after the snapshot's KV, whatever the budget,
    and samples the first new token; the request ends as the active's would have."""
    v, delivered = _snapshot_and_delivered()
    standby = make(max_num_batched_tokens=2)
    res = standby.adopt_request(1, params(20), v.token_ids, 40, v.num_computed, v.block_ids, v.seed, delivered)
    assert (res.reused_tokens, res.prefill_tokens, res.pending_tokens) == (43, 4, 0)
    batch = standby.schedule()
    assert [(r.key, n) for r, n in batch] == [(1, 4)]
    assert [(row.position, row.expected) for row in batch.sampled] == [(47, None)]
    standby.update_from_output(batch, [fake_token(v.seed, 47)])
    out = _finish(standby, 1, delivered + [fake_token(v.seed, 47)])
    assert out == expected_output(1, 40, 20)
    assert standby.counters["replayed_tokens"] == 0


def test_exact_adoption_replays_the_unsynced_tokens_by_decode_passes():
    """The tokens after the last sync are recomputed one decode pass at a time, each
    sample checked against the token the client has (positions 44, 45, 46), then
    the request continues."""
    v, delivered = _snapshot_and_delivered()
    standby = make(exact=True)
    res = standby.adopt_request(1, params(20), v.token_ids, 40, v.num_computed, v.block_ids, v.seed, delivered)
    assert (res.reused_tokens, res.prefill_tokens) == (43, 4)
    batch = standby.schedule()
    assert [(r.key, n) for r, n in batch] == [(1, 1)] and batch.pad_decode_to == B
    assert [(row.position, row.expected) for row in batch.sampled] == [(44, delivered[4])]
    standby.update_from_output(batch, [fake_token(v.seed, 44)])
    assert _finish(standby, 1, delivered) == expected_output(1, 40, 20)
    assert standby.counters["replayed_tokens"] == 3 and standby.counters["replay_mismatches"] == 0


@pytest.mark.parametrize("exact,reused,first_chunk", [(False, 20, (20, 20)), (True, 16, (16, 16))],
                         ids=["default", "exact"])
def test_adoption_mid_prompt(exact, reused, first_chunk):
    """A snapshot 20 tokens into a 40-token prompt: the default policy keeps all 20;
    the exact one recomputes from the chunk boundary (16) in aligned chunks."""
    s = make(exact=exact)
    res = s.adopt_request(1, params(6), prompt(1, 40), 40, 20, [5, 6], None, [])
    assert res.reused_tokens == reused
    batch = s.schedule()
    ((req, n),) = batch
    assert (req.num_computed, n) == first_chunk
    s.update_from_output(batch, [fake_token(r.request.seed, r.position) for r in batch.sampled])
    assert _finish(s, 1, batch_outputs(batch)) == expected_output(1, 40, 6)


def batch_outputs(batch: SchedulerOutput) -> list[int]:
    return [fake_token(r.request.seed, r.position) for r in batch.sampled if r.expected is None]


def test_exact_replay_counts_a_divergence():
    """A delivered token the model would not produce is replayed, counted as a
    mismatch and kept (the client has it)."""
    key = 1
    good = expected_output(key, 12, 8)
    bad = list(good[:5])
    bad[2] += 1
    s = make(exact=True)
    s.adopt_request(key, params(8), prompt(key, 12), 12, 0, [], None, bad)
    run = Run(s)
    run.out[key] = list(bad)
    run.until_idle()
    assert s.counters["replayed_tokens"] == 5 and s.counters["replay_mismatches"] == 1
    assert run.out[key][:5] == bad and len(run.out[key]) == 8


def test_abort_and_reset_free_everything():
    s = make()
    for k in (1, 2, 3):
        s.add_request(k, prompt(k, 30), params(10))
    run_pass(s)
    s.request_views()
    assert s.abort(2) and not s.abort(2)
    (gone,) = [v for v in s.request_views() if v.aborted]
    assert gone.key == 2
    s.reset()
    assert not s.has_work() and not s.requests
    s.blocks.check()
    assert s.blocks.num_free == s.cfg.num_blocks - 1


def test_policy_is_chosen_by_the_configuration():
    assert isinstance(make(exact=False).policy, DefaultPolicy)
    p = make(exact=True).policy
    assert isinstance(p, ExactPolicy) and p.decode_rows == B and p.replays_known_tokens
