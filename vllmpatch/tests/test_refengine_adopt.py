"""Takeover on CPU: a second RefCore on the same pool tensors adopts the
requests from the last sync's committed views and continues exactly like a
run without the fault, computing only what the sync did not cover."""

from __future__ import annotations

import pytest

from e2e import require

torch = require("torch")
# one_torch_thread (conftest.py): one intra-op thread for the whole module.
pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]

from frmps_engine.refengine import EngineConfig, RefCore, SamplingParams  # noqa: E402
from frmps_engine.sdk import engine_api  # noqa: E402


def make_cfg(budget: int) -> EngineConfig:
    return EngineConfig.from_preset("tiny", num_blocks=128, max_num_batched_tokens=budget)


def make_requests(lengths, sampling: str, max_tokens: int):
    g = torch.Generator().manual_seed(sum(lengths))
    reqs = []
    for i, n in enumerate(lengths):
        key = 100 + i
        if sampling == "greedy" or (sampling == "mixed" and i % 2 == 0):
            sp = SamplingParams(max_tokens=max_tokens + i, temperature=0.0)
        else:
            # Half the seeded ones bring no seed: the engine derives it from the key.
            sp = SamplingParams(max_tokens=max_tokens + i, temperature=0.8, top_p=0.95, top_k=100,
                                seed=(7 * i if i % 4 == 1 else None))
        reqs.append((key, torch.randint(0, 256, (n,), generator=g).tolist(), sp))
    return reqs


_REF: dict[str, dict[int, list[int]]] = {}


def no_fault(reqs, budget):
    memo = repr((reqs, budget))
    if memo not in _REF:
        cfg = make_cfg(budget)
        _REF[memo] = RefCore(cfg, RefCore.allocate_pools(cfg), True).generate(reqs)
    return _REF[memo]


def failover(reqs, budget: int, kill_step: int, sync_every: int, lag: int = 0):
    """Run the active for kill_step steps, syncing every sync_every steps; the client
    lags `lag` tokens behind what the active produced. Then a standby built on the
    same pools adopts everything and runs to the end."""
    cfg = make_cfg(budget)
    pools = RefCore.allocate_pools(cfg)
    active = RefCore(cfg, pools, load_weights=True)
    for key, ids, sp in reqs:
        active.add_request(key, ids, sp)
    produced = {key: [] for key, _, _ in reqs}
    finished_at = {}
    snapshot = {}
    for step in range(1, kill_step + 1):
        if not active.has_work():
            break
        for o in active.step():
            assert o.output_index == len(produced[o.key])
            produced[o.key] += o.new_token_ids
            if o.finished:
                finished_at[o.key] = len(produced[o.key])
        if step % sync_every == 0:
            for v in active.request_views():
                if v.finished or v.aborted:
                    snapshot.pop(v.key, None)  # the supervisor forgets finished requests
                else:
                    snapshot[v.key] = v
    del active  # SIGKILL stand-in: nothing of it survives but the pools

    standby = RefCore(cfg, pools, load_weights=False)
    delivered = {k: toks[: max(0, len(toks) - lag)] for k, toks in produced.items()}
    expect_reused = expect_first_pass = 0
    adopted = {}
    for key, ids, sp in reqs:
        if key in finished_at and len(delivered[key]) == finished_at[key]:
            continue  # the client has the whole answer
        v = snapshot.get(key)
        if v is None:
            res = standby.adopt_request(key, sp, ids, len(ids), 0, [], None, delivered[key])
        else:
            res = standby.adopt_request(key, sp, v.token_ids, v.num_prompt, v.num_computed, v.block_ids, v.seed,
                                        delivered[key])
            assert v.token_ids[: v.num_prompt] == ids
        adopted[key] = res
        assert isinstance(res, engine_api.AdoptResult)  # what the SDK runner reads
        if not res.finished:
            # Covered tokens are reused; the first pass computes exactly the rest.
            full = len(ids) + max(len(delivered[key]), len(v.token_ids) - v.num_prompt if v else 0)
            reused = min(v.num_computed, full - 1) if v else 0
            assert res.reused_tokens == reused and res.prefill_tokens == full - reused
            expect_reused += reused
            expect_first_pass += full - reused
    assert standby.counters["adopted_tokens_reused"] == expect_reused

    final = {k: list(t) for k, t in delivered.items()}
    first = True
    while standby.has_work():
        for o in standby.step():
            assert o.output_index == len(final[o.key]), "a token was lost or repeated"
            final[o.key] += o.new_token_ids
        if first:
            first = False
            c = standby.counters
            assert c["prefill_tokens_computed"] + c["decode_tokens"] == expect_first_pass
            assert c["forward_passes"] == (1 if expect_first_pass else 0)
    # Over the whole run the standby computed each token past the covered ones once.
    total = sum(len(ids) + len(final[key]) - 1 - adopted[key].reused_tokens
                for key, ids, _ in reqs if key in adopted and not adopted[key].finished)
    c = standby.counters
    assert c["prefill_tokens_computed"] + c["decode_tokens"] == total
    assert c["preemptions"] == 0
    standby.request_views()
    standby.blocks.check()
    assert standby.blocks.num_free == cfg.num_blocks - 1
    return final, standby, snapshot


# prompt 40 with a 16-token budget: steps 1-3 prefill (16+16+8), token 1 at step 3.
KILLS = {"start": 0, "mid_prefill": 2, "after1": 3, "after2": 4, "after15": 17, "after16": 18, "after17": 19}


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("sync_every", [1, 16])
@pytest.mark.parametrize("kill", list(KILLS))
def test_single_request_failover_is_exact(sampling, sync_every, kill):
    reqs = make_requests([40], sampling, max_tokens=40)
    ref = no_fault(reqs, budget=16)
    for lag in (0, 2):
        final, standby, snap = failover(reqs, 16, KILLS[kill], sync_every, lag)
        assert final == ref, (kill, lag)
    if kill == "mid_prefill" and sync_every == 1:
        v = snap[100]
        assert v.num_computed == 32 and len(v.token_ids) == 40  # adopted mid-prefill: 32 reused
    if kill == "after16" and sync_every == 16:
        assert snap[100].num_computed == 40 + 13  # synced at step 16 = 14 tokens out


ADJUSTED = dict(logit_bias={7: 3.0, 11: -2.0}, min_tokens=20, presence_penalty=0.6, frequency_penalty=0.4,
                repetition_penalty=1.3)


@pytest.mark.parametrize("kill_step", [2, 5, 19, 30])
def test_failover_with_penalties_bias_and_min_tokens_is_exact(kill_step):
    """The adjustments depend on the tokens before the position sampled: the
    standby, holding the delivered tokens, adjusts exactly as the active would."""
    g = torch.Generator().manual_seed(5)
    reqs = [(200, torch.randint(0, 256, (24,), generator=g).tolist(), SamplingParams(max_tokens=40, temperature=0.0, **ADJUSTED)),
            (201, torch.randint(0, 256, (9,), generator=g).tolist(),
             SamplingParams(max_tokens=35, temperature=0.9, seed=3, **ADJUSTED))]
    ref = no_fault(reqs, budget=16)
    plain = no_fault([(k, ids, SamplingParams(max_tokens=sp.max_tokens, temperature=sp.temperature, seed=sp.seed))
                      for k, ids, sp in reqs], budget=16)
    assert ref[200] != plain[200] and ref[201] != plain[201]  # the adjustments act
    for sync_every in (1, 16):
        final, _, _ = failover(reqs, 16, kill_step, sync_every, lag=1)
        assert final == ref, (kill_step, sync_every)


@pytest.mark.parametrize("kill_step", [2, 6, 20])
def test_failover_of_a_structured_output_request_is_exact(kill_step):
    """The standby's matcher replays the delivered tokens and continues the grammar
    where the active stood (a fresh matcher would refuse the rest)."""
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, 256, (20,), generator=g).tolist()
    reqs = [(300, prompt, SamplingParams(max_tokens=40, temperature=0.9, seed=2, structured=("regex", "[a-z]{12}-[0-9]{12}"))),
            (301, prompt[:7], SamplingParams(max_tokens=30, temperature=0.0, structured=("grammar", 'root ::= ("ab" | "cd")+ "."')))]
    ref = no_fault(reqs, budget=16)
    assert len(ref[300]) == 26 and bytes(ref[300][12:13]) == b"-"  # the regex, then the end of sequence
    for sync_every in (1, 16):
        final, _, _ = failover(reqs, 16, kill_step, sync_every, lag=1)
        assert final == ref, (kill_step, sync_every)


def test_after_100_tokens():
    ((key, ids, _),) = make_requests([30], "seeded", max_tokens=130)
    reqs = [(key, ids, SamplingParams(max_tokens=130, temperature=1.0, seed=5, ignore_eos=True))]
    ref = no_fault(reqs, budget=64)
    for sync_every in (1, 16):
        final, standby, _ = failover(reqs, 64, 101, sync_every, lag=1)
        assert final == ref
        assert standby.counters["adopted_tokens_reused"] >= 30 + 100 - 16 - 1


@pytest.mark.parametrize("sync_every", [1, 16])
@pytest.mark.parametrize("kill_step", [1, 3, 10, 17, 30])
def test_eight_concurrent_requests_failover_is_exact(sync_every, kill_step):
    reqs = make_requests([5, 40, 17, 1, 33, 64, 16, 3], "mixed", max_tokens=24)
    ref = no_fault(reqs, budget=48)
    for lag in (0, 3):
        final, _, _ = failover(reqs, 48, kill_step, sync_every, lag)
        assert final == ref, (kill_step, lag)


def test_snapshot_ahead_of_client_emits_pending_first():
    reqs = make_requests([20], "greedy", max_tokens=30)
    ref = no_fault(reqs, budget=64)[100]
    cfg = make_cfg(64)
    pools = RefCore.allocate_pools(cfg)
    a = RefCore(cfg, pools, True)
    a.add_request(*reqs[0])
    for _ in range(10):
        a.step()
    (v,) = a.request_views()
    b = RefCore(cfg, pools, False)
    res = b.adopt_request(100, reqs[0][2], v.token_ids, v.num_prompt, v.num_computed, v.block_ids, v.seed, ref[:4])
    assert res.pending_tokens == 6 and res.reused_tokens == v.num_computed
    outs = b.step()
    assert outs[0].output_index == 4 and outs[0].new_token_ids == ref[4:10] and not outs[0].finished
    assert outs[1].output_index == 10 and outs[1].new_token_ids == [ref[10]]
    assert b.counters["prefill_tokens_computed"] + b.counters["decode_tokens"] == 1


def test_adopt_already_finished_request_reports_finish():
    reqs = make_requests([20], "greedy", max_tokens=8)
    ref = no_fault(reqs, budget=64)[100]
    cfg = make_cfg(64)
    b = RefCore(cfg, RefCore.allocate_pools(cfg), False)
    # The client got all 8 tokens but not the finish: the standby reports it without computing.
    res = b.adopt_request(100, reqs[0][2], reqs[0][1], 20, 0, [], None, ref)
    assert res.finished
    (o,) = b.step()
    assert o.finished and o.finish_reason == "length" and o.new_token_ids == [] and o.output_index == 8
    assert b.counters["forward_passes"] == 0 and not b.has_work()
    assert [x.finished for x in b.request_views()] == [True]


def test_adopted_blocks_are_pinned_and_freed():
    reqs = make_requests([40], "greedy", max_tokens=20)
    cfg = make_cfg(64)
    pools = RefCore.allocate_pools(cfg)
    a = RefCore(cfg, pools, True)
    a.add_request(*reqs[0])
    for _ in range(5):
        a.step()
    (v,) = a.request_views()
    b = RefCore(cfg, pools, False)
    b.adopt_request(100, reqs[0][2], v.token_ids, v.num_prompt, v.num_computed, v.block_ids, v.seed, v.token_ids[40:])
    assert all(b.blocks.refcount(x) == 1 for x in v.block_ids)
    assert b.blocks.num_free == cfg.num_blocks - 1 - len(v.block_ids)
    # A new request must not get the adopted blocks.
    b.add_request(1, [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
    b.step()
    views = {x.key: x for x in b.request_views()}
    assert not set(views[1].block_ids) & set(v.block_ids)
    while b.has_work():
        b.step()
    b.request_views()
    b.blocks.check()
    assert b.blocks.num_free == cfg.num_blocks - 1


def test_warm_takeover_leaves_nothing_behind():
    """A standby runs a takeover's host path once before it sleeps: afterwards it
    holds no request and no block, its counters are as before, and the requests it
    adopts later finish exactly as without the warm-up."""
    reqs = make_requests([20, 37, 5], "mixed", 12)
    cfg = make_cfg(64)
    core = RefCore(cfg, RefCore.allocate_pools(cfg), load_weights=True)
    before = dict(core.counters)
    steps = []
    real = core.step
    core.step = lambda *a, **k: steps.append(real(*a, **k)) or steps[-1]
    core.warm_takeover()
    del core.step
    assert [len(o.new_token_ids) for o in steps[0]] == [1, 1]  # both throwaway requests computed a token
    assert not core.has_work() and core.request_views() == [] and dict(core.counters) == before
    assert core.scheduler.blocks.num_free == cfg.num_blocks - 1
    got = core.generate(reqs)
    assert got == no_fault(reqs, 64)
