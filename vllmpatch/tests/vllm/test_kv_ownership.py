"""Who wrote the KV each step reads, across handovers and takeovers, on vLLM's real
scheduler (prefix caching, async scheduling, deferred prefix-cache work) over the
stand-in model (TEST DOUBLE: it keeps no KV, so a shadow of the shared pool does):
every (block, slot) a step computes is marked with the request and position that
wrote it, and every position a step attends to must have been written by a request
whose tokens up to that position are the reader's. Two engines share the shadow, as
an active and its standby share the KV pool.

The sequence is the one a GPU proof found inexact at 0.5B (bench/results/
2026-11-30-h200x2-exact-9beb760/): prompts served again through the prefix cache; a
planned handover right after one request's first token, with other requests still
waiting; the next engine serving new requests from its prefix cache; then a fault of
that engine and a takeover by the first, which serves the prompts again."""

from __future__ import annotations

import pytest

from frmps_engine.vllm.testing import BLOCK_SIZE
from test_engine import engine, model_dir, params  # noqa: F401  (fixture)

BS = BLOCK_SIZE


def make_engine(model_dir):  # noqa: F811
    return engine(model_dir, mode="async", prefix_caching=True, num_blocks=256, max_num_batched_tokens=512,
                  v2_runner=True)


class Shadow:
    """The shared KV pool's owners: (block, slot) -> (request key, position)."""

    def __init__(self):
        self.owner: dict[tuple[int, int], tuple[int, int]] = {}
        self.reads: list[tuple[str, int, int, tuple[int, int] | None]] = []  # (engine, key, pos, owner)
        self.first_start: dict[int, int] = {}  # a request's first computed position (> 0: KV it did not compute)

    def watch(self, name: str, eng) -> None:
        from frmps_engine.vllm.state import key_for_request_id

        model, sched = eng.core.model, eng.scheduler
        (manager,) = sched.kv_cache_manager.coordinator.single_type_managers
        inner = model.run

        def run(scheduler, so):
            for rid, n in so.num_scheduled_tokens.items():
                req, key = scheduler.requests[rid], key_for_request_id(rid)
                start = req.num_computed_tokens - n
                self.first_start.setdefault(key, start)
                blocks = [b.block_id for b in manager.req_to_blocks[rid]]
                for pos in range(start):  # attended to
                    self.reads.append((name, key, pos, self.owner.get((blocks[pos // BS], pos % BS))))
                for pos in range(start, start + n):  # computed: its KV written
                    self.owner[(blocks[pos // BS], pos % BS)] = (key, pos)
            return inner(scheduler, so)

        model.run = run

    def wrong(self, tokens: dict[int, list[int]]) -> list[tuple]:
        """Reads of a position whose KV another prefix (or nobody) wrote."""
        bad = []
        for name, key, pos, own in self.reads:
            if own is None:
                bad.append((name, key, pos, "never written"))
                continue
            wkey, wpos = own
            if wpos != pos or tokens[wkey][: pos + 1] != tokens[key][: pos + 1]:
                bad.append((name, key, pos, own))
        return bad


@pytest.mark.parametrize("control", [None, "swap-two-blocks"])
def test_every_read_finds_its_own_prefixs_kv_across_a_handover_and_a_fault(model_dir, control):  # noqa: F811
    """control: the negative control: the takeover after the fault adopts one request
    with two of its blocks swapped in the published list, and the check must see it."""
    shadow = Shadow()
    a, b = make_engine(model_dir), make_engine(model_dir)
    b.warm_takeover()  # on the standby's own memory, before it maps the shared pool
    shadow.watch("A", a)
    shadow.watch("B", b)
    got: dict[int, list[int]] = {}
    prompts: dict[int, list[int]] = {}
    P = {1: list(range(100, 100 + 3 * BS + 5)), 3: list(range(300, 300 + 5 * BS + 8))}

    def add(eng, key, which, n=24):
        prompts[key] = P[which]
        eng.add_request(key, P[which], params(n))

    def step(eng, times=1):
        for _ in range(times):
            for o in eng.step():
                assert o.output_index == len(got.setdefault(o.key, []))
                got[o.key].extend(o.new_token_ids)

    def drain(eng):
        for _ in range(400):
            if not eng.has_work():
                return
            step(eng)
        raise AssertionError("did not finish")

    def take_over(new, views, swap=False):
        for v in views:
            if v.finished:
                continue
            d = got.get(v.key, [])
            blocks = v.block_ids
            if swap and len(blocks) >= 2:
                blocks, swap = [blocks[1], blocks[0], *blocks[2:]], False
            new.adopt_request(v.key, params(24), v.token_ids[: v.num_prompt] + d, v.num_prompt, v.num_computed,
                              blocks, v.seed, d)

    # A serves prompt 3 and prompt 1 once: both in its prefix cache.
    add(a, 10, 3)
    add(a, 11, 1)
    drain(a)
    # Prompt 3 again: a prefix hit, its first token out; seven requests still waiting.
    add(a, 12, 3)
    while not got.get(12):
        step(a)
    for k in range(13, 20):
        add(a, k, 1 if k == 13 else 3 if k % 2 else 1)
    # The planned handover: the step in flight finishes, the state is published, A forgets.
    for o in a.finish_in_flight():
        got.setdefault(o.key, []).extend(o.new_token_ids)
    views = list(a.request_views())
    a.reset()
    take_over(b, views)
    step(b, 6)
    add(b, 20, 1)  # prompt 1 again, through B's prefix cache
    add(b, 21, 3)
    step(b, 8)
    # B dies (its last step's writes landed); A takes over from B's last published state.
    views = list(b.request_views())
    take_over(a, views, swap=control == "swap-two-blocks")
    step(a, 3)
    add(a, 22, 1)  # prompt 1 again, through A's prefix cache (blocks adopted from B)
    add(a, 23, 3)
    drain(a)
    tokens = {k: prompts[k] + got.get(k, []) for k in prompts}
    assert len(shadow.reads) > 1000
    # the paths under test were taken: prefix hits in A before the handover, in B from
    # its own cache, and in A after the takeover from blocks it adopted from B
    assert shadow.first_start[12] > 0 and shadow.first_start[20] > 0 and shadow.first_start[22] > 0, shadow.first_start
    bad = shadow.wrong(tokens)
    if control is None:
        assert not bad, bad[:10]
    else:
        assert bad, "a swapped block table passed the check"
