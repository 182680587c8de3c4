"""A real vLLM Scheduler (FrmpsScheduler via scheduler_cls) reports the committed
state of its requests (``frmps_views``), checked against what a model runner was
told to compute (FakeModel, a labelled test double); the engine loop publishes
those views to the ring every N steps (sdk/loop.py, the one owner of that
cadence), checked here over the vLLM core."""

from __future__ import annotations

import pytest

from vhelpers import (BLOCK_SIZE, FakeModel, RecordingTracker, SchedulerCore, block_pool_invariants, make_request,
                      make_scheduler, make_vllm_config, step, write_tiny_model)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


def cdiv(a, b):
    return -(-a // b)


def expected_view(model: FakeModel, req, prompt):
    rid = req.request_id
    computed = model.computed.get(rid, [])
    # Positions were computed in order, once each, from 0.
    assert computed == list(range(len(computed)))
    n = len(computed)
    return {
        "token_ids": list(prompt) + model.sampled.get(rid, []),
        "num_computed": n,
        "block_ids": model.blocks.get(rid, [])[: cdiv(n, BLOCK_SIZE)],
        "num_prompt": len(prompt),
    }


@pytest.mark.parametrize("read_every", [1, 3])
def test_views_are_the_committed_state_whenever_they_are_read(model_dir, read_every):
    """The views read every ``read_every`` computing steps (as the engine loop reads
    them every sync_every steps): each request's committed tokens, KV and blocks;
    a finished request once, in the first read after it finished, then never again."""
    from frmps_engine.vllm import SCHEDULER_CLS
    from frmps_engine.vllm.scheduler import FrmpsScheduler
    from frmps_engine.sdk.seeds import derive_seed

    vc = make_vllm_config(model_dir, num_blocks=64, max_num_batched_tokens=48, scheduler_cls=SCHEDULER_CLS)
    sched = make_scheduler(vc)
    assert type(sched) is FrmpsScheduler
    tracker = RecordingTracker()
    assert sched.frmps_views() == []

    prompts = {1: list(range(10, 50)), 2: list(range(100, 120)), 3: list(range(200, 270))}
    max_tokens = {1: 6, 2: 20, 3: 9}
    reqs = {k: make_request(k, p, max_tokens=max_tokens[k]) for k, p in prompts.items()}
    for r in reqs.values():
        sched.add_request(r)
    model = FakeModel()
    finished_published: dict[int, int] = {}
    steps = 0
    for _ in range(200):
        if not sched.has_requests():
            break
        if step(sched, model).total_num_scheduled_tokens == 0:
            # A step that computes nothing (vLLM reporting finished ids) is not counted.
            continue
        steps += 1
        if steps % read_every:
            continue
        tracker.sync(steps, sched.frmps_views())
        _, views = tracker.records[-1]
        by_key = {v.key: v for v in views}
        for key, req in reqs.items():
            if key in finished_published:
                assert key not in by_key, "a finished request is published once, then forgotten"
                continue
            v = by_key[key]
            exp = expected_view(model, req, prompts[key])
            assert v.token_ids == exp["token_ids"]
            assert v.num_computed == exp["num_computed"]
            assert v.block_ids == exp["block_ids"]
            assert v.num_prompt == exp["num_prompt"]
            assert v.seed == derive_seed(key)
            assert not v.aborted
            if v.finished:
                finished_published[key] = steps
                assert len(v.token_ids) - v.num_prompt == max_tokens[key]
    assert not sched.has_requests()
    if steps % read_every:
        tracker.sync(steps, sched.frmps_views())
        for v in tracker.records[-1][1]:
            finished_published[v.key] = steps
    assert sorted(finished_published) == [1, 2, 3]
    # Chunked prefill happened (48-token budget, 70-token prompt), so the views
    # above covered partially computed prompts too.
    chunks3 = [so.num_scheduled_tokens["frmps-3"] for so in model.steps if "frmps-3" in so.num_scheduled_tokens]
    assert chunks3[0] < 70 and sum(c for c in chunks3 if c > 1) == 70
    summary = block_pool_invariants(sched)
    assert summary == {"free": 63, "held": 0}


def test_committed_excludes_in_flight_tokens_and_publishes_aborts(model_dir):
    from vllm.v1.request import RequestStatus

    from frmps_engine.vllm import SCHEDULER_CLS

    vc = make_vllm_config(model_dir, num_blocks=32, scheduler_cls=SCHEDULER_CLS)
    sched = make_scheduler(vc)
    prompt = list(range(5, 38))  # 33 tokens: 3 blocks
    sched.add_request(make_request(7, prompt, max_tokens=30))
    sched.add_request(make_request(8, list(range(40, 50)), max_tokens=30))
    model = FakeModel()
    step(sched, model)
    step(sched, model)
    # Schedule a step but do not process its output yet, as with async scheduling:
    # num_computed_tokens already counts the in-flight token.
    so = sched.schedule()
    req = sched.requests["frmps-7"]
    assert req.num_in_flight_tokens == 1
    (v7,) = [v for v in sched.frmps_views() if v.key == 7]
    assert v7.num_computed == req.num_computed_tokens - 1 == 34
    assert v7.token_ids == prompt + model.sampled["frmps-7"]
    sched.update_from_output(so, model.run(sched, so))
    # Abort one; the next publish says so once.
    sched.finish_requests("frmps-8", RequestStatus.FINISHED_ABORTED)
    step(sched, model)
    views = {v.key: v for v in sched.frmps_views()}
    assert views[8].aborted and not views[8].finished
    assert not views[7].finished
    step(sched, model)
    assert 8 not in {v.key for v in sched.frmps_views()}
    block_pool_invariants(sched)


def test_requests_without_explicit_seed_are_refused(model_dir):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from frmps_engine.vllm import SCHEDULER_CLS

    sched = make_scheduler(make_vllm_config(model_dir, scheduler_cls=SCHEDULER_CLS))
    r = Request(request_id="frmps-9", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=4), pooling_params=None)
    with pytest.raises(ValueError, match="no explicit seed"):
        sched.add_request(r)
    assert not sched.has_requests() and "frmps-9" not in sched.requests  # refused, not queued


def test_async_scheduler_variant_is_selected_and_reports_its_views(model_dir):
    from frmps_engine.vllm import ASYNC_SCHEDULER_CLS
    from frmps_engine.vllm.scheduler import FrmpsAsyncScheduler

    vc = make_vllm_config(model_dir, scheduler_cls=ASYNC_SCHEDULER_CLS)
    sched = make_scheduler(vc)
    assert isinstance(sched, FrmpsAsyncScheduler)
    sched.add_request(make_request(11, list(range(20)), max_tokens=5))
    model = FakeModel()
    for _ in range(4):
        step(sched, model)
    (v,) = sched.frmps_views()
    assert v.num_computed == len(model.computed["frmps-11"])
    assert v.token_ids == list(range(20)) + model.sampled["frmps-11"]


def test_published_block_ids_follow_preemption_and_reallocation(model_dir):
    """The scheduler keeps each request's block ids between publishes and only
    appends the new ones; a preemption frees the blocks and a later allocation
    gives new ones. Every publish must still equal vLLM's own block table, cut to
    the committed tokens (what a standby maps)."""
    from frmps_engine.vllm import SCHEDULER_CLS

    # 12 blocks of 16 for three requests that each grow to 6 blocks: vLLM must preempt.
    vc = make_vllm_config(model_dir, num_blocks=13, max_num_batched_tokens=64, scheduler_cls=SCHEDULER_CLS)
    sched = make_scheduler(vc)
    assert sched._frmps_blocks_of is not None, "full attention: the cached block ids are in use"
    reqs = {k: make_request(k, list(range(30 * k, 30 * k + 40)), max_tokens=50) for k in (1, 2, 3)}
    for r in reqs.values():
        sched.add_request(r)
    model = FakeModel()
    checked = 0
    for _ in range(400):
        if not sched.has_requests():
            break
        step(sched, model)
        for v in sched.frmps_views():
            req = reqs[v.key]
            if v.finished or v.aborted or sched.requests.get(req.request_id) is not req:
                continue
            table = sched.kv_cache_manager.get_block_ids(req.request_id)[0]
            assert v.block_ids == table[: cdiv(v.num_computed, BLOCK_SIZE)], (v.key, v.num_computed)
            checked += 1
    assert not sched.has_requests() and checked > 100
    assert sum(r.num_preemptions for r in reqs.values()) >= 1, "the test must go through a preemption"
    assert sched._frmps_pub == {}, "finished requests leave the publish cache"
    block_pool_invariants(sched)


class _RecordingPublisher:
    """TEST DOUBLE of sdk/loop.py's RingPublisher: records each record's step, the
    views (copied) and how many batches the stand-in model had run when it was
    published."""

    def __init__(self, model):
        self.model, self.records = model, []

    def publish_full(self, step_no, views):
        self.sync(step_no, views)

    def sync(self, step_no, views):
        import copy

        self.records.append((step_no, [copy.deepcopy(v) for v in views], len(self.model.steps)))

    def close(self):
        pass


@pytest.mark.parametrize("sync_every", [1, 3])
def test_the_engine_loop_publishes_the_committed_state_every_n_steps(model_dir, sync_every):
    """The one owner of the sync cadence is the engine loop (sdk/loop.py): over the
    vLLM core (VllmCore on the real FrmpsScheduler, synchronous steps) it publishes
    a record after the step where a request got its first token, every
    ``sync_every`` steps, and when it goes idle; each record is the committed state
    after its step (one sampled token per step after the prefill, the KV of all but
    the newest), published inside the next step once its batch is launched
    (FrmpsScheduler.get_grammar_bitmask), and each request's finish is published
    once."""
    import time

    from vllm import SamplingParams

    from frmps_engine._proto.frmps.v1 import control_pb2
    from frmps_engine.sdk.loop import EngineLoop
    from frmps_engine.vllm import SCHEDULER_CLS
    from frmps_engine.vllm.core import VllmCore

    sched = make_scheduler(make_vllm_config(model_dir, num_blocks=64, scheduler_cls=SCHEDULER_CLS))
    model = FakeModel()
    core = VllmCore(SchedulerCore(sched, model=model))
    loop = EngineLoop(core, sync_every=sync_every)
    pub = _RecordingPublisher(model)
    loop.attach_ring(pub)
    assert pub.records == [(0, [], 0)]  # the FULL record owed on attach
    prompts = {1: list(range(10, 30)), 2: list(range(40, 45))}  # both prefill in the first step
    n = 10
    streams = {k: loop.submit(k, p, control_pb2.SamplingParams(max_tokens=n),
                              SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, seed=k))
               for k, p in prompts.items()}
    loop.start()
    try:
        for s in streams.values():
            with s.cond:
                assert s.cond.wait_for(lambda s=s: s.finished, 30)
        deadline = time.monotonic() + 10  # then the loop goes idle: its last record is of its last step
        while (core.has_work() or pub.records[-1][0] != loop.step_count) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop(10)
    last = loop.step_count
    steps = [r[0] for r in pub.records[1:]]
    want = [1] + [s for s in range(1, last + 1) if s % sync_every == 0 and s > 1]
    assert steps == want + ([last] if want[-1] != last else []), steps
    finished = []
    for step_no, views, batches in pub.records[1:]:
        # Inside the next step, its batch launched (still the state after step_no: that
        # batch is in flight); the last record between steps, the loop going idle.
        assert batches == (step_no + 1 if step_no < last else last), (step_no, batches)
        by_key = {v.key: v for v in views}
        assert set(by_key) == set(prompts) - set(finished), (step_no, set(by_key))
        for k, v in by_key.items():
            if v.finished:  # in the first record after the step that finished it
                assert step_no >= n and len(v.token_ids) == len(prompts[k]) + n
                finished.append(k)
                continue
            out = streams[k].output
            assert v.token_ids == prompts[k] + out[:step_no], (k, step_no)
            assert v.num_computed == len(prompts[k]) + step_no - 1
            assert v.block_ids == model.blocks[f"frmps-{k}"][: -(-v.num_computed // BLOCK_SIZE)]
    assert sorted(finished) == sorted(prompts)
