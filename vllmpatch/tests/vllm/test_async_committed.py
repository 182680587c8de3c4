"""With async scheduling the next step is scheduled before the previous step's
output is processed. FrmpsAsyncScheduler must publish only what processed
outputs committed (FakeModel is a labelled test double for the model runner)."""

from __future__ import annotations

import pytest

from vhelpers import BLOCK_SIZE, FakeModel, block_pool_invariants, make_request, make_scheduler, make_vllm_config, write_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


def test_async_pipeline_publishes_only_processed_steps(model_dir):
    from frmps_engine.vllm import ASYNC_SCHEDULER_CLS

    vc = make_vllm_config(model_dir, num_blocks=64, async_scheduling=True, scheduler_cls=ASYNC_SCHEDULER_CLS, max_num_batched_tokens=32)
    sched = make_scheduler(vc)
    prompts = {31: list(range(10, 50)), 32: list(range(60, 75))}
    for k, p in prompts.items():
        sched.add_request(make_request(k, p, max_tokens=8))
    model = FakeModel()
    processed: dict[str, list[int]] = {}  # positions of steps whose output was processed
    sampled: dict[str, list[int]] = {}
    pending = None  # (scheduler_output, model_output, positions, tokens) in flight
    checked = overlapped = 0
    for _ in range(80):
        if not sched.has_requests() and pending is None:
            break
        so = sched.schedule()
        before = {rid: list(v) for rid, v in model.computed.items()}
        before_s = {rid: list(v) for rid, v in model.sampled.items()}
        out = model.run(sched, so)  # the "GPU" runs it now...
        step_pos = {rid: model.computed[rid][len(before.get(rid, [])):] for rid in so.num_scheduled_tokens}
        step_tok = {rid: model.sampled.get(rid, [])[len(before_s.get(rid, [])):] for rid in so.num_scheduled_tokens}
        if pending is not None:  # ...while the previous step's output is processed
            pso, pout, ppos, ptok = pending
            sched.update_from_output(pso, pout)
            for rid, pos in ppos.items():
                processed.setdefault(rid, []).extend(pos)
                sampled.setdefault(rid, []).extend(ptok[rid])
            if pso.total_num_scheduled_tokens:
                views = sched.frmps_views()  # read as the engine loop does between steps
                for v in views:
                    rid = f"frmps-{v.key}"
                    if v.finished:
                        continue
                    req = sched.requests[rid]
                    if req.num_in_flight_tokens:
                        # vLLM's own count already includes the step still in flight.
                        assert v.num_computed < req.num_computed_tokens
                        overlapped += 1
                    assert v.num_computed == len(processed.get(rid, []))
                    assert v.token_ids == prompts[v.key] + sampled.get(rid, [])
                    assert v.block_ids == model.blocks[rid][: -(-v.num_computed // BLOCK_SIZE)]
                    checked += 1
        pending = (so, out, step_pos, step_tok) if so.total_num_scheduled_tokens else None
    assert checked > 5 and overlapped > 5
    assert not sched.has_requests()
    assert block_pool_invariants(sched) == {"free": 63, "held": 0}
