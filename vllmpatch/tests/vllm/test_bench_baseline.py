"""The bench's vLLM baselines (bench.vllm_baseline) on the CPU:
``BaselineCore`` over vLLM's real (plain) scheduler, with the model runner and
vLLM's EngineCore replaced by the labelled test doubles of
frmps_engine.vllm.testing; and the EngineArgs the GPU path builds, checked
against this vLLM version's EngineArgs. Building vLLM's engine, its sleep mode
and loading the checkpoint need the GPU (bench/gpu/session.sh, stage
vllm-bench)."""

from __future__ import annotations

import argparse

import pytest

from vhelpers import SchedulerCore, make_scheduler, make_vllm_config, write_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


def core(model_dir):
    from bench.vllm_baseline import BaselineCore

    # vLLM's own scheduler: the baselines run plain vLLM, none of frmps.
    sched = make_scheduler(make_vllm_config(model_dir, num_blocks=64))
    assert type(sched).__module__.startswith("vllm.")
    return BaselineCore(SchedulerCore(sched))


def run(c, limit=200):
    """Step to the end: {key: {output index: token}}, and the keys that finished."""
    got: dict[int, dict[int, int]] = {}
    finished = set()
    for _ in range(limit):
        if not c.has_work():
            return got, finished
        for o in c.step():
            for j, t in enumerate(o.new_token_ids):
                assert o.output_index + j not in got.setdefault(o.key, {}), "an index emitted twice"
                got[o.key][o.output_index + j] = t
            if o.finished:
                finished.add(o.key)
    raise AssertionError("did not finish")


def test_serves_and_recovers_by_re_prefill(model_dir):
    from bench.engine_io import recover
    from bench.vllm_baseline import sampling

    prompt = list(range(10, 40))
    victim = core(model_dir)
    victim.add_request(7, prompt, sampling({"max_tokens": 12}))
    got, finished = run(victim)
    assert finished == {7} and sorted(got[7]) == list(range(12))
    delivered = [got[7][i] for i in range(5)]
    # The recovery: prompt + the 5 delivered tokens re-prefilled as one prompt; the
    # outputs continue at index 5, and the request ends at the same 12 tokens.
    standby = core(model_dir)
    res = standby.adopt_request(7, sampling({"max_tokens": 12}), prompt, len(prompt), 0, [], None, delivered)
    assert (res.reused_tokens, res.prefill_tokens) == (0, len(prompt) + 5)
    (req,) = standby.scheduler.requests.values()
    assert list(req.prompt_token_ids) == prompt + delivered and req.sampling_params.max_tokens == 7
    outs = standby.step()
    assert [(o.key, o.output_index, len(o.new_token_ids)) for o in outs] == [(7, 5, 1)]
    rest, finished = run(standby)
    assert finished == {7} and sorted(rest[7]) == list(range(6, 12))
    # Through the roles' own recovery (engine_io.recover), which emits first_token.
    again = core(model_dir)
    r = recover(again, [{"key": 7, "prompt": prompt, "max_tokens": 12, "delivered": delivered}], sampling)
    assert r["steps"] == 1 and set(r["first_token_unix"]) == {7}
    with pytest.raises(ValueError, match="without KV"):
        core(model_dir).adopt_request(8, sampling({"max_tokens": 4}), prompt, len(prompt), 16, [1], None, [])
    with pytest.raises(ValueError, match="nothing left"):
        core(model_dir).adopt_request(8, sampling({"max_tokens": 4}), prompt, len(prompt), 0, [], None, [1, 2, 3, 4])


def test_abort_all_frees_every_block(model_dir):
    from bench.vllm_baseline import sampling

    c = core(model_dir)
    free0 = c.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    for k in range(3):
        c.add_request(k, list(range(5, 45)), sampling({"max_tokens": 50}))
    c.step()
    assert c.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() < free0
    c.abort_all()
    assert not c.has_work() and c.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free0
    with pytest.raises(ValueError, match="already exists"):
        c.add_request(1, [5, 6], sampling({"max_tokens": 2}))
        c.add_request(1, [5, 6], sampling({"max_tokens": 2}))


@pytest.mark.parametrize("sleep,fmt,eager", [(True, "dummy", False), (False, "safetensors", True)])
def test_engine_args_name_this_vllms_fields(model_dir, sleep, fmt, eager):
    """What the GPU path hands vLLM: the deployment's block count and context, its KV
    bytes (nothing sized from free memory), sleep mode for the sleep-only standby,
    the checkpoint's format and eager mode for a cold start without graphs."""
    from bench.vllm_baseline import engine_args, kv_bytes

    ns = argparse.Namespace(num_blocks=64, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=0, seed=0)
    ea = engine_args(ns, model_dir, load_format=fmt, sleep=sleep, eager=eager, gpu_memory_utilization=0.5)
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}
    assert (ea.enable_sleep_mode, ea.load_format, ea.enforce_eager) == (sleep, fmt, eager)
    assert (ea.num_gpu_blocks_override, ea.max_model_len, ea.max_num_seqs, ea.block_size) == (64, 512, 8, 16)
    assert ea.kv_cache_memory_bytes == kv_bytes(cfg, 64, 16, "bfloat16") == 2 * 64 * 2 * 16 * 2 * 16 * 2
    assert ea.tensor_parallel_size == 1 and ea.distributed_executor_backend == "uni" and ea.gpu_memory_utilization == 0.5
    assert "frmps" not in str(getattr(ea, "scheduler_cls", ""))  # plain vLLM
    with pytest.raises(ValueError, match="--num-blocks"):
        engine_args(argparse.Namespace(**{**vars(ns), "num_blocks": 0}), model_dir, load_format="dummy")
