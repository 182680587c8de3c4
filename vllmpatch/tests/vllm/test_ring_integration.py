"""FrmpsScheduler's views published through the real ring writer (RingWriter +
DeltaTracker, as the engine loop's RingPublisher does), read back with the ring's
Python reader: the snapshot equals the scheduler's committed state, and a second
scheduler adopts straight from that snapshot."""

from __future__ import annotations

import pytest

from vhelpers import BLOCK_SIZE, FakeModel, block_pool_invariants, make_request, make_scheduler, make_vllm_config, step, write_tiny_model

from frmps_engine import ring
from frmps_engine.ring import reader as reader_mod


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


def test_ring_snapshot_matches_committed_state_and_feeds_adoption(model_dir, tmp_path):
    from vllm import SamplingParams

    from frmps_engine.vllm import SCHEDULER_CLS
    from frmps_engine.vllm.adoption import plan_adoption

    path = str(tmp_path / "ring")
    ring.create_ring(path, 1 << 20)
    reader = reader_mod.RingReader(path)
    vc = make_vllm_config(model_dir, num_blocks=64, scheduler_cls=SCHEDULER_CLS)
    active = make_scheduler(vc)
    writer = ring.RingWriter.attach(path)
    tracker = ring.DeltaTracker(writer)
    tracker.sync(0, active.frmps_views())  # the FULL record owed on attach
    prompts = {1: list(range(10, 45)), 2: list(range(50, 60))}
    for k, p in prompts.items():
        active.add_request(make_request(k, p, max_tokens=20))
    model = FakeModel()
    for n in range(1, 7):  # a sync every 2 steps
        step(active, model)
        if n % 2 == 0:
            tracker.sync(n, active.frmps_views())
    reader.poll()
    assert not reader.stale
    views = {v.key: v for v in active.frmps_views()}
    assert set(reader.snapshot) == set(prompts)
    for k, s in reader.snapshot.items():
        v = views[k]
        assert (s.tokens, s.blocks, s.num_computed, s.num_prompt, s.seed) == (
            v.token_ids, v.block_ids, v.num_computed, v.num_prompt, v.seed
        )

    standby = make_scheduler(make_vllm_config(model_dir, num_blocks=64, scheduler_cls=SCHEDULER_CLS))
    for k, s in reader.snapshot.items():
        plan = plan_adoption(
            key=k, token_ids=s.tokens, num_prompt=s.num_prompt, num_computed=s.num_computed, block_ids=s.blocks,
            seed=s.seed, delivered_token_ids=model.sampled[f"frmps-{k}"], block_size=BLOCK_SIZE, num_blocks=64,
        )
        standby.frmps_adopt(plan, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    so = standby.schedule()
    for nr in so.scheduled_new_reqs:
        k = int(nr.req_id.split("-")[1])
        assert nr.block_ids[0][: len(reader.snapshot[k].blocks)] == reader.snapshot[k].blocks
    block_pool_invariants(standby)
    writer.close()
