"""VllmEngineCore (the SDK's EngineCore protocol over vLLM) driven through a
scheduler-only stand-in for vLLM's EngineCore: ``SchedulerCore`` is a labelled
test double that runs the real FrmpsScheduler with FakeModel instead of a GPU
model executor."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from vhelpers import FakeModel, fake_token, make_scheduler, make_vllm_config, write_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@dataclass
class SchedulerCore:
    """Test double for vllm.v1.engine.core.EngineCore: same methods the adapter uses."""

    scheduler: object
    model: FakeModel = field(default_factory=FakeModel)
    request_block_hasher: object = None

    def add_request(self, request):
        self.scheduler.add_request(request)

    def abort_requests(self, ids):
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def step(self):
        if not self.scheduler.has_requests():
            return {}, False
        so = self.scheduler.schedule()
        outs = self.scheduler.update_from_output(so, self.model.run(self.scheduler, so))
        return outs, so.total_num_scheduled_tokens > 0


class CharTokenizer:
    """Test double tokenizer: token t decodes to '<t>'."""

    eos_token_id = 2

    def decode(self, ids):
        return "".join(f"<{t}>" for t in ids)


def engine(model_dir, tokenizer=None):
    from frmps_engine.vllm import SCHEDULER_CLS
    from frmps_engine.vllm.engine import VllmEngineCore

    sched = make_scheduler(make_vllm_config(model_dir, num_blocks=64, scheduler_cls=SCHEDULER_CLS))
    return VllmEngineCore(SchedulerCore(sched), tokenizer)


def params(max_tokens, stop=None):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop=stop)


def drain(eng, limit=300):
    outs = []
    for _ in range(limit):
        if not eng.has_work():
            return outs
        outs.extend(eng.step())
    raise AssertionError("engine did not finish")


def by_key(outs):
    got = {}
    for o in outs:
        toks = got.setdefault(o.key, [])
        assert o.output_index == len(toks), "outputs are contiguous, each token once"
        toks.extend(o.new_token_ids)
    return got


PROMPTS = {41: list(range(10, 45)), 42: list(range(60, 70))}
MAX = {41: 10, 42: 25}


def test_generates_with_explicit_seeds_and_contiguous_indices(model_dir):
    from frmps_engine.vllm.seeds import derive_seed

    eng = engine(model_dir)
    for k, p in PROMPTS.items():
        eng.add_request(k, p, params(MAX[k]))
    assert {r.sampling_params.seed for r in eng.scheduler.requests.values()} == {derive_seed(41), derive_seed(42)}
    outs = drain(eng)
    got = by_key(outs)
    finals = {o.key: o.finish_reason for o in outs if o.finished}
    assert finals == {41: "length", 42: "length"}
    for k in PROMPTS:
        assert len(got[k]) == MAX[k]
    assert eng.counters["prefill_tokens_computed"] == sum(len(p) for p in PROMPTS.values())
    with pytest.raises(ValueError, match="empty prompt"):
        eng.add_request(43, [], params(3))
    assert eng.abort(99) is False


def test_reports_each_steps_tokens_and_its_load(model_dir):
    """What the SDK's heartbeats read: the tokens of the step just scheduled (both
    prompts' prefill first, then one decode token per request) and the running and
    waiting counts."""
    eng = engine(model_dir)
    for k, p in PROMPTS.items():
        eng.add_request(k, p, params(MAX[k]))
    assert (eng.num_running(), eng.num_waiting(), eng.scheduled_tokens) == (0, 2, 0)
    eng.step()
    assert eng.scheduled_tokens == sum(len(p) for p in PROMPTS.values())
    assert (eng.num_running(), eng.num_waiting()) == (2, 0)
    eng.step()
    assert eng.scheduled_tokens == 2
    drain(eng)
    assert (eng.num_running(), eng.num_waiting()) == (0, 0)


@pytest.mark.parametrize("kill_after", [2, 5, 11])
def test_takeover_resumes_exactly_without_recomputing_synced_tokens(model_dir, kill_after):
    reference = by_key(_run_all(model_dir))
    active = engine(model_dir)
    for k, p in PROMPTS.items():
        active.add_request(k, p, params(MAX[k]))
    delivered: dict[int, list[int]] = {k: [] for k in PROMPTS}
    views = []
    for i in range(kill_after):
        for o in active.step():
            delivered[o.key].extend(o.new_token_ids)
        if i % 4 == 3 or i == 0:  # sync every 4 steps, and once at the start
            views = list(active.request_views())
    views = {v.key: v for v in views if not v.finished}

    standby = engine(model_dir)
    reused = prefilled = 0
    for k, p in PROMPTS.items():
        if len(delivered[k]) >= MAX[k]:
            continue
        v = views.get(k)
        res = standby.adopt_request(
            k, params(MAX[k]),
            token_ids=v.token_ids if v else p, num_prompt=len(p), num_computed=v.num_computed if v else 0,
            block_ids=v.block_ids if v else [], seed=v.seed if v else 0, delivered_token_ids=delivered[k],
        )
        reused += res.reused_tokens
        prefilled += res.prefilled_tokens
    outs = drain(standby)
    for o in outs:
        assert o.output_index >= len(delivered[o.key])
        assert o.output_index == len(delivered[o.key]), "the first output continues at the delivered index"
        delivered[o.key].extend(o.new_token_ids)
    assert delivered == reference
    c = standby.counters
    assert c["adopted_tokens_reused"] == reused
    # Prefill on the standby computed exactly the uncovered tokens, once.
    assert c["prefill_tokens_computed"] == prefilled


def _run_all(model_dir):
    eng = engine(model_dir)
    for k, p in PROMPTS.items():
        eng.add_request(k, p, params(MAX[k]))
    return drain(eng)


def test_stop_string_finishes_and_aborts_in_vllm(model_dir):
    eng = engine(model_dir, CharTokenizer())
    p = PROMPTS[41]
    third = fake_token("frmps-41", len(p) + 2)  # the 3rd generated token
    eng.add_request(41, p, params(20, stop=[f"<{third}>"]))
    outs = drain(eng)
    got = by_key(outs)
    assert len(got[41]) == 3
    last = outs[-1]
    assert last.finished and last.finish_reason == "stop" and last.stop_reason == f"<{third}>"
    assert not eng.scheduler.has_requests()


def test_adapter_layout_params_and_refusals(model_dir):
    from types import SimpleNamespace

    import torch
    import transformers

    from frmps_engine._proto.frmps.v1 import control_pb2
    from frmps_engine.vllm.engine import make_adapter, weight_bytes, weights_pool_bytes
    from frmps_engine.vllm.pools import ALIGN, round_up

    args = SimpleNamespace(model=model_dir, num_blocks=100, block_size=16, max_model_len=256, dtype="float32", sync_every=4)
    ad = make_adapter(args)
    assert (ad.name, ad.version, ad.num_blocks) == ("vllm", "0.33.0", 100)
    w, kv = ad.pool_layout()
    assert (w.tag, kv.tag) == ("weights", "kv_cache") and w.size % ALIGN == 0 and kv.size % ALIGN == 0
    assert ad.pool_layout() == [w, kv]  # deterministic
    assert w.size == round_up(weights_pool_bytes(ad.hf, "float32"), ALIGN)

    # The weights formula counts exactly the model's parameters (transformers'
    # Qwen2 on the meta device), plus at most one 512-byte pad per tensor.
    import json

    cfg = json.load(open(f"{model_dir}/config.json"))
    with torch.device("meta"):
        m = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg))
    params = {id(p): p for p in m.parameters()}.values()  # tied embeddings once
    exact = sum(p.numel() for p in params) * 4
    got = weight_bytes(cfg, "float32")
    assert exact <= got <= exact + 512 * (len(list(params)) + 1)

    sp = ad.sampling_params(
        control_pb2.SamplingParams(max_tokens=0, temperature=0.7, top_p=0.9, top_k=5, stop=["x"], stop_token_ids=[9], ignore_eos=True),
        seed=123,
    )
    assert (sp.max_tokens, sp.seed, sp.top_k, sp.stop, sp.stop_token_ids, sp.ignore_eos) == (256, 123, 5, ["x"], [9], True)

    with pytest.raises(ValueError, match="--num-blocks is required"):
        make_adapter(SimpleNamespace(model=model_dir, num_blocks=0))
    with pytest.raises(ValueError, match="no readable config.json"):
        make_adapter(SimpleNamespace(model=model_dir + "/missing", num_blocks=10))
    with pytest.raises(ValueError, match="no frmps weights-pool formula"):
        weight_bytes({**cfg, "architectures": ["GPT2LMHeadModel"]}, "float32")


# Qwen2.5-7B- and 0.5B-shaped configs: the weights-pool estimate holds every
# tensor of 10 MiB or more in its own 2 MiB-rounded torch segment plus the rest,
# and stays close to the parameter bytes.
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944,
    "num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": 28, "vocab_size": 152064,
    "max_position_embeddings": 32768, "tie_word_embeddings": False,
}


@pytest.mark.parametrize("cfg", [QWEN25_7B, {**QWEN25_7B, "hidden_size": 896, "intermediate_size": 4864,
                                             "num_attention_heads": 14, "num_key_value_heads": 2,
                                             "num_hidden_layers": 24, "tie_word_embeddings": True}])
def test_weights_pool_estimate_covers_torch_segments(cfg):
    from frmps_engine.vllm.engine import _weight_tensors, weight_bytes, weights_pool_bytes
    from frmps_engine.vllm.pools import TORCH_MIN_LARGE_ALLOC, torch_segment_bytes

    tensors = _weight_tensors(cfg, "bfloat16", allocated=True)
    pool = weights_pool_bytes(cfg, "bfloat16")
    big = sum(torch_segment_bytes(n) for n in tensors if n >= TORCH_MIN_LARGE_ALLOC)
    rest = sum(n for n in tensors if n < TORCH_MIN_LARGE_ALLOC)
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = 32768 * hd * 2
    assert pool >= big + rest + rope
    # vLLM allocates a tied lm_head before tying it (qwen2.py:480-487): counted in the pool, not in the weights.
    vocab_rows = cfg["vocab_size"] * cfg["hidden_size"] * 2
    tied = vocab_rows if cfg["tie_word_embeddings"] else 0
    assert len(tensors) == len(_weight_tensors(cfg, "bfloat16")) + (1 if tied else 0)
    assert pool - tied - weight_bytes(cfg, "bfloat16") < 0.12 * weight_bytes(cfg, "bfloat16")


def test_create_core_refuses_cpu_pools_before_building_vllm(model_dir):
    """--engine vllm with --memory host-shm: a clear refusal, nothing installed."""
    from types import SimpleNamespace

    from frmps_engine.sdk.memory.host_shm import HostShmBackend
    from frmps_engine.vllm import pools
    from frmps_engine.vllm.engine import make_adapter

    ad = make_adapter(SimpleNamespace(model=model_dir, num_blocks=64, dtype="float32", device="cpu"))
    b = HostShmBackend()
    try:
        got = b.allocate(ad.pool_layout())
        with pytest.raises(ValueError, match="--engine vllm needs its pools on one CUDA device"):
            ad.create_core({p.spec.key: p.tensor for p in got}, load_weights=True)
    finally:
        b.close()
    with pytest.raises(RuntimeError, match="no frmps pool controller is installed"):
        pools.get_controller()


def test_engine_args_take_the_kv_cache_from_the_pool_and_fit_the_startup_check(model_dir):
    """vLLM's worker checks free >= gpu_memory_utilization x total at start; the
    pools are already allocated then, so the fraction is capped at what is free,
    and the KV cache size comes from the pool, not from free memory."""
    from types import SimpleNamespace

    from frmps_engine.vllm.engine import make_adapter, startup_memory_fraction

    GiB = 1 << 30
    assert startup_memory_fraction(70 * GiB, 80 * GiB, 0.9) == pytest.approx(0.98 * 70 / 80)
    assert startup_memory_fraction(79 * GiB, 80 * GiB, 0.5) == 0.5
    assert startup_memory_fraction(0, 80 * GiB, 0.9) == 0.01  # vLLM then refuses with its own message
    with pytest.raises(ValueError, match="bad device memory figures"):
        startup_memory_fraction(1, 0, 0.9)
    ad = make_adapter(SimpleNamespace(model=model_dir, num_blocks=100, dtype="float32"))
    for load in (True, False):
        ea = ad.engine_args(load, 0.42)
        assert ea.kv_cache_memory_bytes == ad.pool_layout()[1].size and ea.gpu_memory_utilization == 0.42
        assert (ea.num_gpu_blocks_override, ea.sleep_mode_backend, ea.enable_sleep_mode) == (100, "frmps", True)
        assert ea.load_format == "dummy"  # this adapter was not asked to load weights (weights="dummy")


def test_reference_engine_only_flags_are_refused():
    from frmps_engine.sdk.adapters import AdapterError, EngineOptions
    from frmps_engine.vllm.engine import make_adapter

    with pytest.raises(AdapterError, match="VLLM_BATCH_INVARIANT"):
        make_adapter(EngineOptions(model="m", device="cuda", exact=True))
    with pytest.raises(AdapterError, match="reference engine only"):
        make_adapter(EngineOptions(model="m", device="cuda", kv_reuse=False))
