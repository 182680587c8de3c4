"""VllmCore (the SDK's Core protocol over vLLM) driven through a
scheduler-only stand-in for vLLM's EngineCore: ``SchedulerCore`` is a labelled
test double that runs the real FrmpsScheduler with FakeModel instead of a GPU
model executor. Tests taking ``mode`` run both ways vLLM steps: synchronously,
and with async scheduling (FrmpsAsyncScheduler behind EngineCore's batch queue,
one step always in flight)."""

from __future__ import annotations

import pytest

from vhelpers import BLOCK_SIZE, SchedulerCore, fake_token, make_scheduler, make_vllm_config, write_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


class CharTokenizer:
    """Test double tokenizer: token t decodes to '<t>'."""

    eos_token_id = 2

    def decode(self, ids):
        return "".join(f"<{t}>" for t in ids)


@pytest.fixture(params=["sync", "async"])
def mode(request):
    return request.param


def engine(model_dir, tokenizer=None, mode="sync", prefix_caching=False, kv_reuse=True, num_blocks=64,
           max_num_batched_tokens=256, v2_runner=False):
    """v2_runner: the scheduler works for vLLM's V2 model runner, as on the GPU (it hands
    the runner every token id, and adoption folds no output into the prompt); without
    Triton here vLLM itself chose V1."""
    from frmps_engine.vllm.core import VllmCore
    from frmps_engine.vllm.engine import scheduler_cls_for

    vc = make_vllm_config(model_dir, num_blocks=num_blocks, async_scheduling=mode == "async",
                          enable_prefix_caching=prefix_caching, max_num_batched_tokens=max_num_batched_tokens)
    vc.scheduler_config.scheduler_cls = scheduler_cls_for(vc)
    sc = SchedulerCore(make_scheduler(vc), batch_queue_size=2 if mode == "async" else 1)
    if prefix_caching:
        from vhelpers import block_hasher

        sc.request_block_hasher = block_hasher()  # as EngineCore sets it with prefix caching on
    if v2_runner:
        sc.scheduler.use_v2_model_runner = True
    return VllmCore(sc, tokenizer, kv_reuse=kv_reuse)


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


def test_generates_with_explicit_seeds_and_contiguous_indices(model_dir, mode):
    from frmps_engine.sdk.seeds import derive_seed

    eng = engine(model_dir, mode=mode)
    for k, p in PROMPTS.items():
        eng.add_request(k, p, params(MAX[k]))
    assert {r.sampling_params.seed for r in eng.scheduler.requests.values()} == {derive_seed(41), derive_seed(42)}
    outs = drain(eng)
    got = by_key(outs)
    finals = {o.key: o.finish_reason for o in outs if o.finished}
    assert finals == {41: "length", 42: "length"}
    for k in PROMPTS:
        assert len(got[k]) == MAX[k]
    assert got == by_key(_run_all(model_dir))  # the same tokens however vLLM steps
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


def test_capabilities_of_the_vllm_core(model_dir):
    """What the SDK probes (sdk/engine_api.py): the vLLM core reports its load and
    step size, can be reset for a handover and finishes its step in flight before
    one (Pipelined); with the synchronous step it has a launch hook (the loop's publish
    runs once the batch is launched), with async scheduling not (the loop publishes
    between steps, under the next batch's device work); no idle device check; its
    tokenizer does not say its vocabulary size."""
    from frmps_engine.sdk import engine_api

    eng = engine(model_dir, CharTokenizer())
    assert isinstance(eng, engine_api.Core)
    for cap in (engine_api.StepSize, engine_api.LoadReport, engine_api.Resettable, engine_api.Pipelined,
                engine_api.TakeoverWarmup, engine_api.LaunchHook, engine_api.DeviceGate):
        assert isinstance(eng, cap), cap.__name__
    assert not isinstance(eng, engine_api.DeviceCheck)
    assert engine_api.has_launch_hook(eng)
    assert not engine_api.has_launch_hook(engine(model_dir, CharTokenizer(), mode="async"))
    from frmps_engine.vllm.tokenizer import VllmTokenizer

    assert engine_api.vocab_size(VllmTokenizer(CharTokenizer())) is None


def test_the_launch_hook_runs_once_per_step_between_launch_and_output(model_dir):
    """step(on_launch=fn) runs fn where EngineCore.step asks for the grammar bitmask:
    after the batch is launched, before its output is processed. The views fn reads
    then are the committed state of the step before (the batch's tokens in flight),
    the same record a publish after that step would make."""
    eng = engine(model_dir, CharTokenizer())
    for key, prompt in PROMPTS.items():
        eng.add_request(key, prompt, params(MAX[key]))
    seen: list[dict] = []
    before: list[dict] = []

    def hook():
        seen.append({v.key: (v.num_computed, v.token_ids, v.block_ids) for v in eng.request_views()})
        assert all(r.num_in_flight_tokens > 0 for r in eng.scheduler.running), "called after the launch"

    outs = []
    for _ in range(300):
        if not eng.has_work():
            break
        before.append({v.key: (v.num_computed, v.token_ids, v.block_ids) for v in eng.request_views()})
        n = len(seen)
        outs.extend(eng.step(on_launch=hook))
        assert len(seen) == n + 1, "once per step"
        assert eng.scheduler.frmps_on_launch is None
    assert not eng.has_work()
    # Live requests' state in the hook = the state published between steps before it.
    for b, s in zip(before, seen):
        for key, st in s.items():
            if key in b:
                assert st == b[key]
    got = by_key(outs)
    assert {k: len(v) for k, v in got.items()} == MAX
    # A step without the hook, and an async engine, never call it.
    eng2 = engine(model_dir, CharTokenizer(), mode="async")
    eng2.add_request(41, PROMPTS[41], params(3))
    calls = []
    for _ in range(20):
        if not eng2.has_work():
            break
        eng2.step(on_launch=lambda: calls.append(1))
    assert calls == [] and not eng2.has_work()


def test_a_scheduler_without_the_frmps_members_is_refused(model_dir):
    from frmps_engine.vllm.core import FrmpsSchedulerAPI, VllmCore

    plain = make_scheduler(make_vllm_config(model_dir, num_blocks=64))  # vLLM's own scheduler
    assert not isinstance(plain, FrmpsSchedulerAPI)
    with pytest.raises(TypeError, match="set scheduler_cls=frmps_engine.vllm.scheduler.FrmpsScheduler"):
        VllmCore(SchedulerCore(plain))


@pytest.mark.parametrize("kill_after", [2, 5, 11])
def test_takeover_resumes_exactly_without_recomputing_synced_tokens(model_dir, kill_after, mode):
    """With async scheduling the views are read while the next step is in flight:
    they must hold only what processed outputs committed, or the standby would
    skip or repeat a token."""
    from frmps_engine.sdk import engine_api

    reference = by_key(_run_all(model_dir))
    active = engine(model_dir, mode=mode)
    assert isinstance(active, engine_api.Core) and isinstance(active, engine_api.Resettable)
    for k, p in PROMPTS.items():
        active.add_request(k, p, params(MAX[k]))
    delivered: dict[int, list[int]] = {k: [] for k in PROMPTS}
    views = []
    in_flight = 0
    for i in range(kill_after):
        for o in active.step():
            delivered[o.key].extend(o.new_token_ids)
        if i % 4 == 3 or i == 0:  # sync every 4 steps, and once at the start
            views = list(active.request_views())
            if mode == "async":
                in_flight += bool(active.core.batch_queue)
                for v in views:
                    req = active.scheduler.requests.get(f"frmps-{v.key}")
                    if v.finished or req is None:
                        continue
                    assert v.num_computed == req.num_computed_tokens - req.num_in_flight_tokens
                    assert v.token_ids == PROMPTS[v.key] + delivered[v.key]
    views = {v.key: v for v in views if not v.finished}
    if mode == "async":
        assert in_flight, "the views were read with a step in flight"

    standby = engine(model_dir, mode=mode)
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
        prefilled += res.prefill_tokens
        # The SDK runner reads the result through the engine contract (a mismatch here
        # failed every takeover of the first GPU run).
        assert isinstance(res, engine_api.AdoptResult)
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


def _four_steps(model_dir, mode="sync"):
    """An engine four steps into PROMPTS: (engine, tokens delivered per key, its ring views by key)."""
    eng = engine(model_dir, mode=mode)
    for k, p in PROMPTS.items():
        eng.add_request(k, p, params(MAX[k]))
    delivered: dict[int, list[int]] = {k: [] for k in PROMPTS}
    for _ in range(4):
        for o in eng.step():
            delivered[o.key].extend(o.new_token_ids)
    return eng, delivered, {v.key: v for v in eng.request_views()}


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
    from frmps_engine.vllm.engine import make_adapter
    from frmps_engine.vllm.modelcfg import weight_bytes, weights_pool_bytes
    from frmps_engine.vllm.pools import ALIGN, round_up

    args = SimpleNamespace(model=model_dir, num_blocks=100, block_size=16, max_model_len=256, dtype="float32")
    ad = make_adapter(args)
    from importlib import metadata

    assert (ad.name, ad.version, ad.num_blocks) == ("vllm", metadata.version("vllm").split("+")[0], 100)
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
    assert sp.logprobs is None
    assert ad.sampling_params(control_pb2.SamplingParams(max_tokens=4, logprobs=3), seed=1).logprobs == 3
    assert ad.sampling_params(control_pb2.SamplingParams(max_tokens=4, logprobs=0), seed=1).logprobs == 0
    assert (sp.logit_bias, sp.min_tokens, sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (None, 0, 0, 0, 1)
    adj = ad.sampling_params(control_pb2.SamplingParams(max_tokens=8, logit_bias={5: 2.5}, min_tokens=3, presence_penalty=0.5,
                                                        frequency_penalty=-1.0, repetition_penalty=1.25), seed=1)
    assert (adj.logit_bias, adj.min_tokens, adj.presence_penalty, adj.frequency_penalty, adj.repetition_penalty) == (
        {5: 2.5}, 3, 0.5, -1.0, 1.25)

    # No --num-blocks and no GPU to size the KV cache on (sizing.py; test_sizing.py).
    with pytest.raises(ValueError, match="give --num-blocks"):
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
    from frmps_engine.vllm.modelcfg import weight_bytes, weight_tensors, weights_pool_bytes
    from frmps_engine.vllm.pools import TORCH_MIN_LARGE_ALLOC, torch_segment_bytes

    tensors = weight_tensors(cfg, "bfloat16", allocated=True)
    pool = weights_pool_bytes(cfg, "bfloat16")
    big = sum(torch_segment_bytes(n) for n in tensors if n >= TORCH_MIN_LARGE_ALLOC)
    rest = sum(n for n in tensors if n < TORCH_MIN_LARGE_ALLOC)
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = 32768 * hd * 2
    assert pool >= big + rest + rope
    # vLLM allocates a tied lm_head before tying it (qwen2.py:480-487): counted in the pool, not in the weights.
    vocab_rows = cfg["vocab_size"] * cfg["hidden_size"] * 2
    tied = vocab_rows if cfg["tie_word_embeddings"] else 0
    assert len(tensors) == len(weight_tensors(cfg, "bfloat16")) + (1 if tied else 0)
    # Not wasteful: within 12 % of the weights, plus the fragmentation headroom (2 %, at least 64 MiB).
    w = weight_bytes(cfg, "bfloat16")
    assert pool - tied - w < 0.12 * w + max(64 << 20, 0.021 * pool)
    # The headroom that qwen2.5-7b's lm_head needed on the H100 (missed with 1.07 GiB free in pieces).
    if not cfg["tie_word_embeddings"]:
        assert pool - (big + rest + rope) >= 0.02 * w


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
        assert (ea.num_gpu_blocks_override, ea.enable_sleep_mode) == (100, True)
        for name, value in ad.compat.engine_args("frmps").items():  # 0.33: the backend rides on EngineArgs
            assert getattr(ea, name) == value
        assert ea.load_format == "dummy"  # this adapter was not asked to load weights (weights="dummy")
    # The backend must reach vLLM's ModelConfig: 0.26's EngineArgs has no field for it,
    # so finish_config sets it on the built config; 0.33's checks that EngineArgs carried it.
    from vhelpers import make_vllm_config

    vc = make_vllm_config(model_dir)
    assert vc.model_config.sleep_mode_backend == "cumem"
    if "sleep_mode_backend" in ad.compat.engine_args("frmps"):
        with pytest.raises(ValueError, match="sleep_mode_backend 'cumem'"):
            ad.compat.finish_config(vc, "frmps")
    else:
        ad.compat.finish_config(vc, "frmps")
        assert vc.model_config.sleep_mode_backend == "frmps"


def test_reference_engine_only_flags_are_refused():
    from frmps_engine.sdk.adapters import AdapterError, EngineOptions
    from frmps_engine.vllm.engine import make_adapter

    with pytest.raises(AdapterError, match="VLLM_BATCH_INVARIANT"):
        make_adapter(EngineOptions(model="m", device="cuda", exact=True))


def test_no_kv_reuse_reaches_the_vllm_adapter(model_dir):
    """--no-kv-reuse (frmps bench's no-KV ablation) is the vLLM adapter's too."""
    from frmps_engine.sdk.adapters import EngineOptions
    from frmps_engine.vllm.engine import make_adapter

    assert make_adapter(EngineOptions(model=model_dir, num_blocks=64, kv_reuse=False)).cfg.kv_reuse is False
    assert make_adapter(EngineOptions(model=model_dir, num_blocks=64)).cfg.kv_reuse is True


def test_no_kv_reuse_adopts_with_nothing_computed_and_prefills_it_all(model_dir):
    """The ablation: the standby takes the requests over without the snapshot's KV —
    nothing reused, no snapshot block held, the first step a prefill of each request's
    prompt and delivered tokens — and finishes them (the stand-in model keeps no KV,
    so its outputs equal the reference's either way)."""
    from frmps_engine.vllm.core import VllmCore

    reference = by_key(_run_all(model_dir))
    _, delivered, views = _four_steps(model_dir)
    standby = engine(model_dir)
    standby = VllmCore(standby.core, kv_reuse=False)
    for k, v in views.items():
        assert v.num_computed > 0 and v.block_ids  # the snapshot has KV to reuse: the ablation ignores it
        r = standby.adopt_request(k, params(MAX[k]), v.token_ids, v.num_prompt, v.num_computed, v.block_ids,
                                  v.seed, delivered[k])
        assert r.reused_tokens == 0 and r.prefill_tokens == len(PROMPTS[k]) + len(delivered[k])
        req = standby.scheduler.requests[f"frmps-{k}"]
        assert req.num_computed_tokens == 0
    pool = standby.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # no snapshot block taken
    for o in drain(standby):
        assert o.output_index == len(delivered[o.key])
        delivered[o.key].extend(o.new_token_ids)
    assert delivered == reference


def test_unseeded_and_negative_seeds_from_the_sdk_reach_vllm_and_the_ring(model_dir):
    """Through the SDK's own path (normalize -> adapter.sampling_params ->
    add_request): an unseeded request gets the SDK's derived seed, which vLLM
    can hold for every key (some keys' splitmix64 values are >= 2**63), and a
    negative client seed (-5: uint64 2**64-5 on the wire) works too; the ring
    view carries each request's wire seed back exactly. (-1 is vLLM's "no
    seed": SamplingParams turns it into None, and the request then gets the
    derived seed, as an unseeded one.)"""
    from frmps_engine._proto.frmps.v1 import control_pb2
    from frmps_engine.sdk.params import normalize
    from frmps_engine.sdk.seeds import derive_seed, splitmix64
    from frmps_engine.vllm.engine import VllmAdapter, VllmEngineConfig

    adapter = VllmAdapter(VllmEngineConfig(model=model_dir, num_blocks=64, max_model_len=512))
    keys = [k for k in range(1, 200) if splitmix64(k) >= 1 << 63][:3] + [7]
    assert len(keys) == 4, "keys whose raw splitmix64 does not fit an int64"
    eng = engine(model_dir)
    wire: dict[int, int] = {}
    for k in keys:
        p = normalize(control_pb2.SamplingParams(max_tokens=4, temperature=0.7), k, 5, 512)
        assert p.seed == derive_seed(k) < 1 << 63
        eng.add_request(k, [10 + k % 50] * 5, adapter.sampling_params(p, p.seed))
        wire[k] = p.seed
    neg = normalize(control_pb2.SamplingParams(max_tokens=4, temperature=0.7, seed=(1 << 64) - 5), 300, 5, 512)
    eng.add_request(300, [11] * 5, adapter.sampling_params(neg, neg.seed))
    wire[300] = (1 << 64) - 5
    assert eng.scheduler.requests["frmps-300"].sampling_params.seed == -5  # what vllm serve gives seed=-5
    minus_one = normalize(control_pb2.SamplingParams(max_tokens=4, temperature=0.7, seed=(1 << 64) - 1), 301, 5, 512)
    eng.add_request(301, [12] * 5, adapter.sampling_params(minus_one, minus_one.seed))
    wire[301] = derive_seed(301)
    views = {v.key: v.seed for v in eng.request_views()}
    assert views == wire
    got = by_key(drain(eng))
    assert {k: len(v) for k, v in got.items()} == {k: 4 for k in wire}
    # A standby adopting the seed -1 request before any sync (wire seed 2**64-1,
    # no snapshot) must sample with the seed the active used: the derived one.
    standby = engine(model_dir)
    standby.adopt_request(301, adapter.sampling_params(minus_one, minus_one.seed), [12] * 5, 5, 0, [], minus_one.seed, [])
    assert standby.scheduler.requests["frmps-301"].sampling_params.seed == derive_seed(301)


def test_a_presets_model_directory_works_with_vllms_tokenizer(tmp_path):
    """`frmps model init qwen2.5-0.5b` writes a directory vLLM reads: its
    tokenizer (through vLLM's get_tokenizer), the chat template and the pool
    layout of the real shapes."""
    from frmps_engine import modeldir
    from frmps_engine.refengine import load_tokenizer
    from frmps_engine.vllm.engine import VllmAdapter, VllmEngineConfig

    d = modeldir.write("qwen2.5-0.5b", str(tmp_path / "q05"))
    ad = VllmAdapter(VllmEngineConfig(model=d, num_blocks=512, max_model_len=4096))
    tok = ad.tokenizer()
    assert tok.eos_token_id == 151645
    msgs = [{"role": "user", "content": "hello"}]
    assert tok.apply_chat_template(msgs) == load_tokenizer(d).apply_chat_template(msgs)
    ids = tok.encode("a tiny test")
    assert tok.decode(ids) == "a tiny test"
    w, kv = ad.pool_layout()
    # 494M bf16 parameters (0.99 GB), the tied lm_head's discarded copy (0.27 GB), segments.
    assert 1.2e9 < w.size < 1.45e9
    assert kv.size >= 24 * 512 * 16 * 2 * 2 * 64 * 2  # layers x blocks x tokens x K,V x heads x dim x bf16


def test_requests_stop_at_the_models_end_of_sequence_tokens(tmp_path):
    """Like vllm serve: the tokenizer's EOS and generation_config.json's eos ids
    end a request unless ignore_eos (vLLM's input processor sets them; frmps
    builds SamplingParams itself, so the adapter must)."""
    from frmps_engine import modeldir
    from frmps_engine._proto.frmps.v1 import control_pb2
    from frmps_engine.vllm.engine import VllmAdapter, VllmEngineConfig

    d = modeldir.write("qwen2.5-0.5b", str(tmp_path / "q05"))
    ad = VllmAdapter(VllmEngineConfig(model=d, num_blocks=64, max_model_len=512))
    sp = ad.sampling_params(control_pb2.SamplingParams(max_tokens=8, stop_token_ids=[7]), seed=1)
    assert sp.eos_token_id == 151645
    assert set(sp.stop_token_ids) == {7, 151643}  # generation_config's other eos id, and the client's
    assert sp.all_stop_token_ids >= {151643, 151645, 7}
    ignore = ad.sampling_params(control_pb2.SamplingParams(max_tokens=8, ignore_eos=True), seed=1)
    assert ignore.eos_token_id is None and ignore.stop_token_ids == []


def test_reset_hands_the_requests_over_and_the_engine_can_adopt_them_back(model_dir, mode):
    """A planned handover on vLLM: reset() aborts every request in the real
    scheduler (blocks back to the pool), the ring views forget them, and the
    same engine later adopts them again (as a standby that is resumed) and
    finishes them exactly: the ids freed at the abort reach the model runner
    in the same step as the re-adopted requests, freed first."""
    reference = by_key(_run_all(model_dir))
    eng, delivered, views = _four_steps(model_dir, mode)
    pool = eng.scheduler.kv_cache_manager.block_pool
    eng.reset()
    assert not eng.has_work() and list(eng.request_views()) == []
    assert not eng.core.batch_queue  # nothing left in flight
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # all but the null block
    for k, v in views.items():
        eng.adopt_request(k, params(MAX[k]), v.token_ids, v.num_prompt, v.num_computed, v.block_ids, v.seed,
                          delivered[k])
    for o in drain(eng):
        assert o.output_index == len(delivered[o.key])
        delivered[o.key].extend(o.new_token_ids)
    assert delivered == reference


def test_batch_limits_reach_vllm(model_dir):
    """--max-num-seqs / --max-num-batched-tokens (the engine CLI's options) set vLLM's
    own limits, which also bound the CUDA graphs it captures."""
    from frmps_engine.sdk.adapters import EngineOptions
    from frmps_engine.vllm.engine import make_adapter

    ea = make_adapter(EngineOptions(model=model_dir, num_blocks=100, max_num_seqs=8, max_num_batched_tokens=512)).engine_args(True, 0.5)
    assert (ea.max_num_seqs, ea.max_num_batched_tokens) == (8, 512)
    default = make_adapter(EngineOptions(model=model_dir, num_blocks=100)).engine_args(True, 0.5)
    from vllm.engine.arg_utils import EngineArgs

    assert default.max_num_seqs == EngineArgs.max_num_seqs  # vLLM's own default when not given


def test_an_abort_while_its_batch_is_in_flight_is_processed(model_dir):
    """Async scheduling: a request aborted with its batch in flight leaves vLLM's
    scheduler at once, but the batch's output is still to be processed, so the
    core has work until the batch queue is empty; the other request is unharmed."""
    eng = engine(model_dir, mode="async")
    for k, p in PROMPTS.items():
        eng.add_request(k, p, params(MAX[k]))
    got: dict[int, list[int]] = {k: [] for k in PROMPTS}
    while not eng.core.batch_queue:
        for o in eng.step():
            got[o.key].extend(o.new_token_ids)
    assert eng.abort(41)
    for o in drain(eng):
        assert o.key == 42 or o.finish_reason == "abort"
        got[o.key].extend(o.new_token_ids)
    assert not eng.has_work() and not eng.core.batch_queue
    assert got[42] == by_key(_run_all(model_dir))[42]
    pool = eng.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_the_scheduler_class_follows_vllms_async_decision(model_dir, monkeypatch):
    """--engine vllm leaves async scheduling to vLLM (as vLLM alone does) unless
    FRMPS_VLLM_ASYNC_SCHEDULING says 0 or 1; either way the frmps scheduler of the
    matching kind goes into the built config."""
    from types import SimpleNamespace

    from frmps_engine.vllm import ASYNC_SCHEDULER_CLS, SCHEDULER_CLS
    from frmps_engine.vllm.engine import make_adapter, scheduler_cls_for

    monkeypatch.delenv("FRMPS_VLLM_ASYNC_SCHEDULING", raising=False)
    ad = make_adapter(SimpleNamespace(model=model_dir, num_blocks=100, dtype="float32"))
    assert ad.engine_args(True, 0.5).async_scheduling is None
    monkeypatch.setenv("FRMPS_VLLM_ASYNC_SCHEDULING", "0")
    ad = make_adapter(SimpleNamespace(model=model_dir, num_blocks=100, dtype="float32"))
    assert ad.engine_args(True, 0.5).async_scheduling is False
    for on, cls in ((True, ASYNC_SCHEDULER_CLS), (False, SCHEDULER_CLS)):
        vc = make_vllm_config(model_dir, async_scheduling=on)
        assert scheduler_cls_for(vc) == cls
        vc.scheduler_config.scheduler_cls = cls
        assert make_scheduler(vc).__class__.__name__ == cls.rsplit(".", 1)[1]


def test_finish_in_flight_completes_the_pipeline_without_scheduling(model_dir):
    """engine_api.Pipelined: with async scheduling a step is in flight between
    step() calls; finish_in_flight processes it without launching another, so the
    views then hold every token delivered, with nothing in flight, and stepping on
    afterwards continues exactly."""
    from frmps_engine.sdk import engine_api

    reference = by_key(_run_all(model_dir))
    eng = engine(model_dir, mode="async")
    assert isinstance(eng, engine_api.Pipelined)
    assert eng.finish_in_flight() == []  # nothing in flight yet
    for k, p in PROMPTS.items():
        eng.add_request(k, p, params(MAX[k]))
    got: dict[int, list[int]] = {k: [] for k in PROMPTS}
    for _ in range(4):
        for o in eng.step():
            got[o.key].extend(o.new_token_ids)
    assert eng.core.batch_queue
    launched = len(eng.core.model.steps)
    outs = eng.finish_in_flight()
    assert outs and len(eng.core.model.steps) == launched, "processed the batch in flight, launched none"
    for o in outs:
        assert o.output_index == len(got[o.key])
        got[o.key].extend(o.new_token_ids)
    assert not eng.core.batch_queue and not eng.scheduler.frmps_hold
    for v in eng.request_views():
        req = eng.scheduler.requests[f"frmps-{v.key}"]
        assert req.num_in_flight_tokens == 0 and v.num_computed == req.num_computed_tokens
        assert v.token_ids == PROMPTS[v.key] + got[v.key]
    for o in drain(eng):
        assert o.output_index == len(got[o.key])
        got[o.key].extend(o.new_token_ids)
    assert got == reference


@pytest.mark.parametrize("first", [True, False], ids=["delivered-first", "pipelined"])
def test_a_takeovers_first_step_is_delivered_before_the_second_is_launched(model_dir, first):
    """EngineLoop.deliver_first_step (set for a takeover) over vLLM's async core: the
    first step's tokens reach the streams before the second step is scheduled,
    where the pipeline would hold them until then; the outputs are the same."""
    import time

    from frmps_engine._proto.frmps.v1 import control_pb2
    from frmps_engine.sdk.loop import EngineLoop

    eng = engine(model_dir, mode="async")
    loop = EngineLoop(eng, sync_every=1000)
    loop.deliver_first_step = first
    seen: list[int] = []  # tokens the streams held when each step began
    streams: dict = {}

    def recording(on_launch=None, _fn=eng.step):
        seen.append(sum(len(s.output) for s in streams.values()))
        return _fn(on_launch)

    eng.step = recording
    for k, p in PROMPTS.items():  # queued before the loop starts, as an adoption's requests are
        streams[k] = loop.submit(k, p, control_pb2.SamplingParams(max_tokens=MAX[k]), params(MAX[k]))
    loop.start()
    deadline = time.monotonic() + 10
    while any(len(s.output) < MAX[k] for k, s in streams.items()) and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.stop(10)
    assert seen[1] == (len(PROMPTS) if first else 0)
    assert {k: s.output for k, s in streams.items()} == by_key(_run_all(model_dir))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_device_gate_waits_after_the_runners_host_work_and_before_the_forward(model_dir, mode):
    """engine_api.DeviceGate over the model runner's ``kv_connector.pre_forward``
    (vLLM's V2 runner calls it right before the forward pass; the stand-in model
    calls it where V2 does): the first step's scheduling and the runner's block
    tables come before the gate's wait, the computing after it; once only (the
    connector's own pre_forward is back afterwards), and the outputs are those of
    an ungated engine. Adopted requests, as a takeover's."""
    from frmps_engine.vllm.core import _pre_forward_owner

    eng = engine(model_dir, mode=mode)
    model = eng.core.model
    kvc = _pre_forward_owner(eng.core)
    assert kvc is model.kv_connector
    adopt_prompts(eng)
    at_gate = []

    def wait():
        at_gate.append((dict(model.blocks), {r: list(v) for r, v in model.computed.items()}))

    assert eng.gate_device(wait) is True
    got = drain(eng)
    assert len(at_gate) == 1, "the gate is once"
    blocks, computed = at_gate[0]
    assert set(blocks) == {f"frmps-{k}" for k in PROMPTS}, "the runner's host work had not run at the gate"
    assert computed == {}, "something was computed before the gate"
    assert "pre_forward" not in vars(kvc), "the connector's own pre_forward is not back"

    plain = engine(model_dir, mode=mode)
    adopt_prompts(plain)
    assert tokens_of(got) == tokens_of(drain(plain))


def test_step_phases_time_vllm_calls_of_an_armed_step(model_dir, monkeypatch):
    """FRMPS_DEBUG_STEP_PHASES=1: the core times the scheduler's calls and the
    runner's (here the test double's kv_connector.pre_forward, where the V2 runner
    calls it) of an armed step only, beside the device gate, and changes no output."""
    monkeypatch.setenv("FRMPS_DEBUG_STEP_PHASES", "1")
    eng = engine(model_dir, mode="async", prefix_caching=True)
    tr = eng.step_phases
    assert tr is not None and {"schedule", "update_from_output", "kv_connector.pre_forward",
                               "deferred_prefix_cache.run"} <= set(tr.wrapped)
    adopt_prompts(eng)
    assert eng.gate_device(lambda: None) is True
    tr.arm()
    got = eng.step()
    line = tr.report()
    names = [p.split(" ")[0] for p in line.split(", ")]
    assert names[0] == "schedule" and "kv_connector.pre_forward" in names, line
    assert "deferred_prefix_cache.run" not in names, line  # the first step's is the next step's
    assert tr.report() == "no vLLM call traced"  # disarmed: nothing recorded since
    tr.arm()
    got += eng.step()
    names = [p.split(" ")[0] for p in tr.report().split(", ")]
    # The adopted requests' prefix-cache work ran after the second forward's launch.
    assert names.index("deferred_prefix_cache.run") > names.index("kv_connector.pre_forward"), names
    got += eng.step()
    assert tr.report() == "no vLLM call traced"
    got += drain(eng)
    monkeypatch.delenv("FRMPS_DEBUG_STEP_PHASES")
    plain = engine(model_dir, mode="async", prefix_caching=True)
    assert plain.step_phases is None
    adopt_prompts(plain)
    assert tokens_of(got) == tokens_of(drain(plain))


def tokens_of(outs):
    return sorted((o.key, o.output_index, list(o.new_token_ids)) for o in outs)


def adopt_prompts(eng):
    """Adopt PROMPTS as a takeover would: each prompt computed on blocks of its own,
    one token (7) delivered."""
    first = 1
    for k, p in PROMPTS.items():
        n = -(-len(p) // BLOCK_SIZE)
        eng.adopt_request(k, params(MAX[k]), p + [7], len(p), len(p), list(range(first, first + n)), 0, [7])
        first += n


def test_no_device_gate_without_a_runner_in_this_process(model_dir):
    """A core whose model runner is not reachable here (vLLM's V1 runner has no
    pre_forward; tensor-parallel ranks run in other processes): gate_device says
    False, and the runner starts its loop after the flip."""
    eng = engine(model_dir)
    del eng.core.model.kv_connector  # as vLLM's V1 runner: no kv_connector
    assert eng.gate_device(lambda: None) is False


@pytest.mark.parametrize("mode_", ["sync", "async"])
def test_hand_over_publishes_every_delivered_token_with_nothing_in_flight(model_dir, tmp_path, mode_):
    """The engine loop's planned handover over the vLLM core: the step in flight
    finishes first, so every token the model computed reaches its stream and the
    FULL record, no computing step runs after that record (the device is idle
    before the pools are handed over), and vLLM holds no request afterwards."""
    import json
    import threading

    from frmps_engine._proto.frmps.v1 import control_pb2
    from frmps_engine.sdk.loop import EngineLoop, RingPublisher

    eng = engine(model_dir, mode=mode_)
    loop = EngineLoop(eng, sync_every=1000)
    ring = str(tmp_path / "ring")
    open(ring, "w").close()
    computing = lambda: sum(1 for so in eng.core.model.steps if so.total_num_scheduled_tokens)  # noqa: E731
    at_full: list[int] = []

    class Recording(RingPublisher):
        def publish_full(self, step, views):
            at_full.append(computing())
            super().publish_full(step, views)

    loop.attach_ring(Recording(ring, "frmps_engine.sdk.testing.fake_ring"))
    gate = threading.Event()
    stepped = [0]

    def slow(on_launch=None, _fn=eng.step):  # hold the loop after a few steps so the requests are mid-way
        stepped[0] += 1
        if stepped[0] == 6:
            gate.wait(10)
        return _fn(on_launch)

    eng.step = slow
    loop.start()
    streams = {k: loop.submit(k, p, control_pb2.SamplingParams(max_tokens=MAX[k]), params(MAX[k]))
               for k, p in PROMPTS.items()}
    for _ in range(500):
        if stepped[0] >= 6:
            break
        threading.Event().wait(0.01)
    threading.Timer(0.2, gate.set).start()
    moved = loop.hand_over(timeout=10)
    assert moved == 2 and not loop.running
    ht = loop.last_handover
    assert (ht.requests, ht.moved) == (2, 2)
    # The gate held the loop's step ~0.2 s: the call waited for it, the rest was quick.
    assert ht.wait_ms > 50 and min(ht.in_flight_ms, ht.publish_ms, ht.move_ms, ht.reset_ms, ht.stop_ms) >= 0
    assert ht.line().startswith(f"waited {ht.wait_ms:.2f} ms for the loop, in-flight step ")
    assert not eng.core.batch_queue and not eng.has_work()
    assert at_full[-1] == computing(), "no computing step after the FULL record"
    full = [r for r in (json.loads(x) for x in open(ring)) if r.get("full")][-1]
    entries = {e["key"]: e for e in full["entries"]}
    for k, s in streams.items():
        assert s.moved and 0 < len(s.output) < MAX[k]
        assert s.output == eng.core.model.sampled[f"frmps-{k}"], "every computed token was delivered"
        e = entries[k]
        assert e["tokens"] == PROMPTS[k] + s.output, "the record holds exactly the delivered tokens"
        assert e["num_computed"] == len(e["tokens"]) - 1


def test_async_scheduling_switch_from_the_environment(model_dir, monkeypatch):
    from types import SimpleNamespace

    from frmps_engine.vllm.engine import make_adapter

    # vLLM decides unless told (unset, empty, auto); 0 and 1 force it.
    from frmps_engine.vllm.envpolicy import async_scheduling_from_env
    assert [async_scheduling_from_env(e) for e in ({}, {"FRMPS_VLLM_ASYNC_SCHEDULING": ""},
                                                   {"FRMPS_VLLM_ASYNC_SCHEDULING": "0"},
                                                   {"FRMPS_VLLM_ASYNC_SCHEDULING": "1"},
                                                   {"FRMPS_VLLM_ASYNC_SCHEDULING": "auto"})] == [None, None, False, True, None]
    with pytest.raises(ValueError, match=r"use auto \(the default: vLLM decides\), 1 \(on\) or 0 \(off\)"):
        async_scheduling_from_env({"FRMPS_VLLM_ASYNC_SCHEDULING": "yes"})
    from frmps_engine.sdk.adapters import AdapterError

    monkeypatch.setenv("FRMPS_VLLM_ASYNC_SCHEDULING", "on")
    with pytest.raises(AdapterError, match="FRMPS_VLLM_ASYNC_SCHEDULING='on'"):
        make_adapter(SimpleNamespace(model=model_dir, num_blocks=100, dtype="float32"))
    monkeypatch.setenv("FRMPS_VLLM_ASYNC_SCHEDULING", "0")
    ea = make_adapter(SimpleNamespace(model=model_dir, num_blocks=100, dtype="float32")).engine_args(True, 0.5)
    assert ea.async_scheduling is False


def test_mega_aot_artifact_is_on_by_default_where_vllm_can_use_it(monkeypatch):
    """frmps's engines load vLLM's compiled model whole (VLLM_USE_MEGA_AOT_ARTIFACT=1)
    unless the user said otherwise, AOT compile is off, or torch has no AOT compile;
    the variable is the one vLLM reads."""
    from frmps_engine.vllm.envpolicy import MEGA_AOT_ENV, mega_aot_default

    env: dict = {}
    assert mega_aot_default(env, "2.11.0+cu130") and env == {MEGA_AOT_ENV: "1"}
    for given, on in (({MEGA_AOT_ENV: "0"}, False), ({MEGA_AOT_ENV: "1"}, True),
                      ({"VLLM_USE_AOT_COMPILE": "0"}, False), ({"VLLM_DISABLE_COMPILE_CACHE": "1"}, False)):
        env = dict(given)
        assert mega_aot_default(env, "2.11.0") is on and env == given
    env = {}
    assert not mega_aot_default(env, "2.9.1") and env == {}
    assert not mega_aot_default(env, "weird") and env == {}

    import os

    import vllm.envs

    monkeypatch.setenv(MEGA_AOT_ENV, "0")  # recorded, so that teardown removes what the default sets
    monkeypatch.delenv(MEGA_AOT_ENV)
    import torch

    vllm.envs.disable_envs_cache()  # an EngineCore built earlier in this process froze the variables
    assert mega_aot_default(os.environ, torch.__version__)
    assert vllm.envs.VLLM_USE_MEGA_AOT_ARTIFACT is True


def test_flashinfer_sampler_off_where_flashinfer_is_missing():
    from frmps_engine.vllm.envpolicy import FLASHINFER_SAMPLER_ENV as V, flashinfer_sampler_default

    env: dict[str, str] = {}
    note = flashinfer_sampler_default(env, have_flashinfer=False)
    assert env[V] == "0" and "flashinfer is not installed" in note
    for given in ("0", "1"):  # the user's choice stands where flashinfer is there
        env = {V: given}
        assert flashinfer_sampler_default(env, have_flashinfer=True) == "" and env == {V: given}
    env = {}
    assert flashinfer_sampler_default(env, have_flashinfer=True) == "" and env == {}  # vLLM's default: FlashInfer
    env = {V: "0"}
    assert flashinfer_sampler_default(env, have_flashinfer=False) == "" and env == {V: "0"}
    with pytest.raises(ValueError, match="flashinfer is not installed"):
        flashinfer_sampler_default({V: "1"}, have_flashinfer=False)


def test_triton_cache_is_pinned_unless_the_user_set_it(tmp_path):
    """With the compiled model loaded whole vLLM leaves TRITON_CACHE_DIR alone, so
    frmps names one directory under vLLM's cache root; a user's choice stands."""
    from frmps_engine.vllm.envpolicy import TRITON_CACHE_ENV, triton_cache_default

    env: dict = {}
    assert triton_cache_default(env, str(tmp_path)) == str(tmp_path / "triton_cache")
    assert env == {TRITON_CACHE_ENV: str(tmp_path / "triton_cache")}
    env = {TRITON_CACHE_ENV: "/elsewhere"}
    assert triton_cache_default(env, str(tmp_path)) == "/elsewhere" and env == {TRITON_CACHE_ENV: "/elsewhere"}
    env = {TRITON_CACHE_ENV: " "}  # a blank value names no directory
    assert triton_cache_default(env, str(tmp_path)) == str(tmp_path / "triton_cache")


def test_triton_ptxas_is_torchs_from_the_start(tmp_path):
    """Inductor points Triton at torch's ptxas on its first compile; frmps does so
    before any, so that every engine keys Triton's cache with the same ptxas."""
    from frmps_engine.vllm.envpolicy import TRITON_PTXAS_ENV, triton_ptxas_default

    env: dict = {}
    assert triton_ptxas_default(env, str(tmp_path)) == "" and env == {}  # torch ships no ptxas
    (tmp_path / "bin").mkdir()
    ptxas = tmp_path / "bin" / "ptxas"
    ptxas.write_text("#!/bin/sh\n")
    ptxas.chmod(0o644)
    assert triton_ptxas_default(env, str(tmp_path)) == "" and env == {}  # not executable: Triton's own
    ptxas.chmod(0o755)
    assert triton_ptxas_default(env, str(tmp_path)) == str(ptxas) and env == {TRITON_PTXAS_ENV: str(ptxas)}
    env = {TRITON_PTXAS_ENV: "/opt/cuda/bin/ptxas"}  # the user's choice stands
    assert triton_ptxas_default(env, str(tmp_path)) == "/opt/cuda/bin/ptxas"
    assert env == {TRITON_PTXAS_ENV: "/opt/cuda/bin/ptxas"}


def test_structured_outputs_config_from_the_environment(model_dir, monkeypatch):
    from types import SimpleNamespace

    from frmps_engine.sdk.adapters import AdapterError
    from frmps_engine.vllm.engine import make_adapter
    from frmps_engine.vllm.envpolicy import STRUCTURED_OUTPUTS_ENV

    args = SimpleNamespace(model=model_dir, num_blocks=100, dtype="float32")
    monkeypatch.delenv(STRUCTURED_OUTPUTS_ENV, raising=False)
    default = make_adapter(args).engine_args(True, 0.5).structured_outputs_config
    monkeypatch.setenv(STRUCTURED_OUTPUTS_ENV, '{"backend": "xgrammar", "disable_any_whitespace": true}')
    so = make_adapter(args).engine_args(True, 0.5).structured_outputs_config
    assert so.backend == "xgrammar" and so.disable_any_whitespace is True
    assert getattr(default, "disable_any_whitespace", False) is False
    for bad, msg in (("{", "not JSON"), ("[1]", "want a JSON object"), ('{"no_such_field": 1}', "vLLM refuses")):
        monkeypatch.setenv(STRUCTURED_OUTPUTS_ENV, bad)
        with pytest.raises(AdapterError, match=msg):
            make_adapter(args)


def test_a_spares_preload_imports_vllm_and_hands_its_tokenizer_to_the_adapter(tmp_path):
    """sdk/spare.py runs the factory's preload hook with the model: vLLM's modules are
    imported without initialising CUDA, the tokenizer is read once, and the adapter
    built after the activation takes it instead of reading it again."""
    import sys

    from frmps_engine import modeldir
    from frmps_engine.sdk import spare
    from frmps_engine.vllm import preload
    from frmps_engine.vllm.engine import VllmAdapter, VllmEngineConfig, make_adapter

    d = modeldir.write("qwen2.5-0.5b", str(tmp_path / "q05"))
    preload._PRELOADED_TOKENIZERS.clear()
    summary = spare.preload("vllm", None, model=d)
    assert "modules loaded" in summary and "vllm.v1.engine.core" in sys.modules and "xgrammar" in sys.modules
    assert not spare.driver_initialised()
    preloaded = preload._PRELOADED_TOKENIZERS[d]
    assert make_adapter.preload is preload.preload
    ad = VllmAdapter(VllmEngineConfig(model=d, num_blocks=512, max_model_len=4096))
    assert ad.tokenizer()._tok is preloaded and d not in preload._PRELOADED_TOKENIZERS  # taken, once
    other = VllmAdapter(VllmEngineConfig(model=d, num_blocks=512, max_model_len=4096))
    assert other.tokenizer()._tok is not preloaded  # a second engine in this process reads its own
    # vLLM's own tokenizer cache (its structured-output manager's) was filled for the model
    # config the adapter's engine arguments give: the engine core's read is a hit.
    from vllm.tokenizers.registry import cached_get_tokenizer, cached_tokenizer_from_config

    from vllm.config import ModelConfig

    ea = ad.engine_args(False, 0.5)  # its tokenizer fields (the whole config needs a GPU: sleep mode)
    mc = ModelConfig(model=ea.model, tokenizer=ea.tokenizer, tokenizer_mode=ea.tokenizer_mode, runner=ea.runner,
                     tokenizer_revision=ea.tokenizer_revision, trust_remote_code=ea.trust_remote_code)
    hits = cached_get_tokenizer.cache_info().hits
    vllm_tok = cached_tokenizer_from_config(mc)
    assert cached_get_tokenizer.cache_info().hits == hits + 1 and vllm_tok is not preloaded
    # ... and the vocabulary index of vLLM's xgrammar backend was built ahead: vLLM's own
    # backend takes it, once.
    import xgrammar as xgr
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    from frmps_engine.vllm.testing import make_vllm_config

    vocab = mc.get_vocab_size()
    preload._XGRAMMAR_HANDED_OVER.clear()
    XgrammarBackend(make_vllm_config(d, tokenizer=True), tokenizer=vllm_tok, vocab_size=vocab)
    assert preload._XGRAMMAR_HANDED_OVER == [d]
    again = xgr.TokenizerInfo.from_huggingface(vllm_tok, vocab_size=vocab)  # built anew: handed over once
    assert preload._XGRAMMAR_HANDED_OVER == [d] and again.vocab_size == vocab
    # A model the spare could not read is only a lost head start.
    spare.preload("vllm", None, model=str(tmp_path / "missing"))
    assert str(tmp_path / "missing") not in preload._PRELOADED_TOKENIZERS


def test_the_tokenizers_backend_decode_is_used_only_where_it_equals_decode(tmp_path):
    """A resumed stream replays its delivered tokens through decode: the Rust
    backend's decode gives the same text as the Hugging Face tokenizer's (checked
    here on random ids, specials included) at a fraction of the cost; a tokenizer
    whose decode also cleans up spaces keeps its own decode."""
    import random

    from frmps_engine import modeldir
    from frmps_engine.vllm.engine import VllmAdapter, VllmEngineConfig
    from frmps_engine.vllm.tokenizer import VllmTokenizer

    d = modeldir.write("qwen2.5-0.5b", str(tmp_path / "q05"))
    tok = VllmAdapter(VllmEngineConfig(model=d, num_blocks=64, max_model_len=512)).tokenizer()
    assert tok._backend is not None
    hf = tok._tok
    n = hf.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    rng = random.Random(5)
    for _ in range(2000):
        ids = [rng.randrange(n) for _ in range(rng.randint(1, 6))]
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)

    class Cleaning:  # test double: a fast tokenizer whose decode cleans up spaces
        backend_tokenizer = hf.backend_tokenizer
        clean_up_tokenization_spaces = True
        eos_token_id = hf.eos_token_id

        def decode(self, ids, skip_special_tokens=False):
            return hf.decode(ids, skip_special_tokens=skip_special_tokens).replace(" ,", ",")

    assert VllmTokenizer(Cleaning())._backend is None

    from frmps_engine.sdk.detok import TextStream, byte_pieces, warm

    cleaning = VllmTokenizer(Cleaning())
    warm(cleaning)
    assert byte_pieces(cleaning) is None  # its streams decode windows through its own decode

    # The byte table streams decode from (sdk/detok.py), built where the engine
    # warms up: the same text as the Hugging Face tokenizer's decode, here on the
    # preset's whole vocabulary (152k ids), ids past it and runs of byte tokens.
    assert byte_pieces(tok) is None
    warm(tok)
    pieces = byte_pieces(tok)
    assert pieces is not None and len(pieces) == n
    singles = [i for i, p in enumerate(pieces) if len(p) == 1]
    for _ in range(300):
        ids = [rng.choice(singles) if rng.random() < 0.5 else rng.randrange(n + 8) for _ in range(rng.randint(1, 40))]
        table, windows = TextStream(tok), TextStream(VllmTokenizer(hf))
        out = [table.feed([t]) for t in ids] + [table.flush()]
        assert out == [windows.feed([t]) for t in ids] + [windows.flush()]
        assert "".join(o[1] for o in out[:-1]) + out[-1] == tok.decode(ids)  # the stream's text is the decode

    class Differs(Cleaning):  # claims no clean-up, yet decodes differently: the sample check refuses it
        clean_up_tokenization_spaces = False

        def decode(self, ids, skip_special_tokens=False):
            text = hf.decode(ids, skip_special_tokens=skip_special_tokens)
            return text[1:] if text.startswith(" ") else text  # e.g. a decoder that strips a leading space

    assert VllmTokenizer(Differs())._backend is None


def test_a_handover_forgets_the_prefix_cache(model_dir, mode):
    """After a planned handover the other engine owns the KV cache and overwrites
    blocks at will, so the prefix-cache hashes this engine still holds for its
    freed blocks would point at foreign contents when it serves again (it takes
    over after the next fault): reset() drops them. Without that, a new request
    with a prompt this engine had served would skip its prefill over stale KV."""
    eng = engine(model_dir, mode=mode, prefix_caching=True)
    prompt = list(range(10, 10 + 40))  # two full blocks of 16 and a partial one
    eng.add_request(1, prompt, params(4))
    drain(eng)
    eng.add_request(2, prompt, params(4))
    eng.step()
    assert eng.scheduled_tokens == 40 - 32  # the cache works: two full blocks hit
    eng.reset()
    eng.add_request(3, prompt, params(4))
    eng.step()
    assert eng.scheduled_tokens == 40  # nothing stale is reused: the whole prompt is computed
    drain(eng)


def test_adopting_with_nothing_computed_may_hit_the_prefix_cache(model_dir, mode):
    """A request adopted with no KV to reuse (it never reached a sync, or the
    no-KV-reuse ablation) is a fresh prefill: vLLM's prefix cache may serve its
    prompt's full blocks like any new request's. Found on the GPU: the standby of
    a `--no-kv-reuse` deployment died in its takeover warm-up (two requests with
    one prompt) on vLLM's assertion that a request holding blocks gets no cache
    hit, because the adoption had registered the request with no blocks."""
    def fresh(kv_reuse=True):
        return engine(model_dir, mode=mode, prefix_caching=True, kv_reuse=kv_reuse)

    prompt = list(range(10, 10 + 40))  # two full blocks of 16 and a partial one
    ref = fresh()
    ref.add_request(2, prompt, params(6))
    want = by_key(drain(ref))[2]
    for kv_reuse in (True, False):
        eng = fresh(kv_reuse)
        eng.add_request(1, prompt, params(6))
        drain(eng)  # its full blocks are in the prefix cache now
        # Never synced: nothing computed, no blocks (and with kv_reuse=False the
        # adapter drops what it is given), one token delivered before the death.
        eng.adopt_request(2, params(6), prompt + want[:1], len(prompt), 0 if kv_reuse else 32,
                          [] if kv_reuse else [5, 6], 7, want[:1])
        outs = eng.step()
        assert eng.scheduled_tokens == 41 - 32, "the adopted prefill hits the two cached blocks"
        got = want[:1]
        for o in [o for o in outs + drain(eng) if o.key == 2]:
            assert o.output_index == len(got), "the outputs go on after the delivered token, each once"
            got = got + list(o.new_token_ids)
        assert got == want


def test_adopted_blocks_enter_the_prefix_cache_once_the_second_step_is_launched(model_dir, mode):
    """An adopted request's block hashes and its blocks' entry in vLLM's prefix
    cache wait for its second step's launch (DeferredPrefixCache), the CPU half of
    an adoption moved off the first resumed token's path. The request's output is
    the no-fault one, its hashes are those of its tokens, and a new request with
    its prompt then reuses the adopted full blocks."""
    from vhelpers import make_request

    prompt = list(range(10, 10 + 40))  # two full blocks of 16 and a partial one
    ref = engine(model_dir, mode=mode, prefix_caching=True)
    ref.add_request(1, prompt, params(12))
    want = by_key(drain(ref))[1]
    eng = engine(model_dir, mode=mode, prefix_caching=True)
    pool = eng.scheduler.kv_cache_manager.block_pool
    delivered = want[:5]
    # The KV of the prompt and four delivered tokens is in blocks 3, 4, 5 (the
    # stand-in model's tokens depend on the position only).
    eng.adopt_request(1, params(12), prompt + delivered, len(prompt), 44, [3, 4, 5], 7, delivered)
    req = eng.scheduler.requests["frmps-1"]
    assert req.block_hashes == [] and pool.blocks[3].block_hash is None
    outs = eng.step()
    assert req.block_hashes == [], "not in the first step: off the first token's path"
    outs += eng.step()
    assert not eng.deferred_prefix_cache, "done in the second step"
    hasher = eng.core.request_block_hasher
    assert req.block_hashes[:2] == make_request(1, prompt + delivered, hasher=hasher).block_hashes[:2]
    assert pool.blocks[3].block_hash is not None and pool.blocks[4].block_hash is not None
    eng.add_request(2, prompt, params(4))
    outs += eng.step()
    assert eng.scheduled_tokens == 1 + 40 - 32, "request 1's token, and request 2's prompt past the adopted full blocks"
    got = {1: list(delivered), 2: []}
    for o in outs + drain(eng):
        assert o.output_index == len(got[o.key]), "the outputs go on after the delivered tokens, each once"
        got[o.key] += list(o.new_token_ids)
    assert got[1] == want and len(got[2]) == 4


def test_the_first_step_after_a_takeover_resumes_decodes_before_any_prefill(model_dir, mode):
    """A takeover's first step resumes every adopted request whose KV was
    published, and leaves a whole-prompt prefill (a request adopted before its
    prompt's KV reached the ring, or a new one) to the next step: in one batch the
    prefill could push the step out of vLLM's CUDA graphs, and every resumed
    stream would wait for it. Every request's output is its no-fault output."""
    want = by_key(_run_all(model_dir))
    eng = engine(model_dir, mode=mode)
    p41, p42 = PROMPTS[41], PROMPTS[42]
    # 41: its prompt and two delivered tokens in blocks 1-3, one token to compute.
    eng.adopt_request(41, params(MAX[41]), p41 + want[41][:2], len(p41), len(p41) + 1, [1, 2, 3], 0, want[41][:2])
    # 42: one token delivered, nothing published: its prompt and that token to prefill.
    eng.adopt_request(42, params(MAX[42]), p42, len(p42), 0, [], 0, want[42][:1])
    outs = eng.step()
    assert eng.scheduled_tokens == 1
    outs += eng.step()
    assert eng.scheduled_tokens == 1 + len(p42) + 1, "the prefill runs in the second step"
    got = {41: list(want[41][:2]), 42: list(want[42][:1])}
    for o in outs + drain(eng):
        assert o.output_index == len(got[o.key])
        got[o.key] += list(o.new_token_ids)
    assert got == want
    # Only the step after an adoption holds prefills back: a new request later is
    # scheduled with the running one.
    eng.adopt_request(43, params(4), p42, len(p42), 0, [], 0, [])
    eng.step()
    assert eng.scheduled_tokens == len(p42), "nothing needs only one token: the prefill is not held"


def test_a_replay_after_the_last_sync_stays_in_the_first_step(model_dir, mode):
    """With --sync-every > 1 a resumed stream recomputes the tokens past its last
    sync: that replay holds KV and runs in the takeover's first step with the
    streams that need one token (only whole-prompt prefills wait)."""
    want = by_key(_run_all(model_dir))
    eng = engine(model_dir, mode=mode)
    p41, p42 = PROMPTS[41], PROMPTS[42]
    # 41: four tokens delivered, its KV synced up to the prompt: five tokens to replay.
    eng.adopt_request(41, params(MAX[41]), p41 + want[41][:4], len(p41), len(p41), [1, 2, 3], 0, want[41][:4])
    # 42: one token delivered, its KV synced: one token to compute.
    eng.adopt_request(42, params(MAX[42]), p42 + want[42][:1], len(p42), len(p42), [4], 0, want[42][:1])
    outs = eng.step()
    assert eng.scheduled_tokens == 4 + 1
    got = {41: list(want[41][:4]), 42: list(want[42][:1])}
    for o in outs + drain(eng):
        assert o.output_index == len(got[o.key])
        got[o.key] += list(o.new_token_ids)
    assert got == want


def test_a_reset_drops_prefix_cache_work_not_yet_done(model_dir, mode):
    """A handover's reset before the adopted requests' first step forgets their
    deferred prefix-cache work (the next engine owns the blocks), and an adoption
    after it defers its own."""
    prompt = list(range(10, 10 + 40))
    eng = engine(model_dir, mode=mode, prefix_caching=True)
    eng.adopt_request(1, params(12), prompt + [7], len(prompt), 40, [3, 4, 5], 7, [7])
    assert eng.deferred_prefix_cache
    eng.reset()
    assert not eng.deferred_prefix_cache
    pool = eng.scheduler.kv_cache_manager.block_pool
    assert all(pool.blocks[b].block_hash is None for b in (3, 4, 5))
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    eng.adopt_request(2, params(12), prompt + [7], len(prompt), 40, [3, 4, 5], 7, [7])
    drain(eng)
    assert not eng.deferred_prefix_cache


def test_warm_takeover_leaves_nothing_behind(model_dir, mode):
    """A standby runs a takeover's host path once before it sleeps (two throwaway
    requests adopted, stepped, reset): afterwards vLLM holds no request, every
    block is free, the prefix cache and the counters are as before, and a run on
    the engine equals one on an engine that never warmed."""
    reference = by_key(_run_all(model_dir))
    eng = engine(model_dir, mode=mode)
    before = eng.counters
    produced = []
    step = eng.step
    eng.step = lambda: (lambda outs: (produced.extend(t for o in outs for t in o.new_token_ids), outs)[1])(step())
    eng.warm_takeover()
    del eng.step
    assert len(produced) == 2  # both throwaway requests were adopted and computed a token
    pool = eng.scheduler.kv_cache_manager.block_pool
    assert not eng.has_work() and list(eng.request_views()) == []
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert eng.counters == before
    for k, p in PROMPTS.items():
        eng.add_request(k, p, params(MAX[k]))
    assert by_key(drain(eng)) == reference


def test_warm_takeover_without_kv_reuse_and_with_the_prefix_cache(model_dir, mode):
    """The no-KV-reuse ablation's standby (prefix caching on, vLLM's default): its
    warm-up adopts two requests with one prompt and nothing computed; the second
    hits the first's cached block. It died there on the GPU before the adoption
    stopped registering such requests with the KV manager."""
    eng = engine(model_dir, mode=mode, prefix_caching=True, kv_reuse=False)
    eng.warm_takeover()
    pool = eng.scheduler.kv_cache_manager.block_pool
    assert not eng.has_work() and pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_vllm_args_reach_engine_args_and_frmps_owned_ones_are_refused(model_dir, monkeypatch):
    """--vllm-arg: vLLM's own engine flags, parsed by vLLM's parser, applied over
    frmps's choices; the ones frmps sets itself (pool sizes and layout, role,
    seed rule) refused by name; what vLLM's parser refuses, refused."""
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    # vLLM's parser computes its defaults from its configs, one of which asks the
    # platform for a device type: the CUDA wheels find none on a machine without a
    # GPU (the frontend's CPU tests force the CPU platform the same way).
    monkeypatch.setattr(platforms, "_current_platform", CpuPlatform())

    from frmps_engine.sdk.adapters import AdapterError
    from frmps_engine.vllm.engine import vllm_overrides

    assert vllm_overrides([]) == {}
    got = vllm_overrides(["--max-logprobs=50", "--enable-prefix-caching", "--max-num-seqs", "12",
                          "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}'])
    assert got["max_logprobs"] == 50 and got["enable_prefix_caching"] is True and got["max_num_seqs"] == 12
    so = got["structured_outputs_config"]
    assert so.backend == "xgrammar" and so.disable_any_whitespace is True
    # One token, as the supervisor passes it (--vllm-arg=--structured-outputs-config={...}).
    one = vllm_overrides(['--structured-outputs-config={"backend": "guidance"}'])
    assert one["structured_outputs_config"].backend == "guidance"
    for flag, want in (("--dtype=float16", "dtype"), ("--num-gpu-blocks-override=9", "use --num-blocks"),
                       ("--seed=3", "seed rule"), ("--kv-cache-dtype=fp8", "KV pool layout")):
        with pytest.raises(ValueError, match=want):
            vllm_overrides([flag])
    with pytest.raises(ValueError, match="refuse"):
        vllm_overrides(["--no-such-vllm-flag"])
    # Through the engine CLI's own parser, as the supervisor launches an engine
    # (a GPU run found the flag parsed by the CLI and then dropped before the adapter).
    from frmps_engine import cli
    from frmps_engine.sdk.adapters import load_adapter

    def launched(*vllm_args):
        args = cli.build_parser().parse_args(
            ["serve", "--engine", "vllm", "--role", "active", "--model", model_dir, "--control-socket", "c.sock",
             "--core-input", "ipc:///x", "--core-output", "ipc:///y", "--device", "cuda", "--memory", "cuda-vmm",
             "--num-blocks", "64", "--max-num-seqs", "4", *(f"--vllm-arg={a}" for a in vllm_args)])
        return cli.engine_options(args)

    so = '--structured-outputs-config={"backend": "xgrammar", "disable_any_whitespace": true}'
    ad = load_adapter("vllm", launched("--max-logprobs=7", "--max-num-seqs=9", so))
    ea = ad.engine_args(False, 0.5)
    assert ea.max_logprobs == 7 and ea.max_num_seqs == 9  # over frmps's own --max-num-seqs
    assert ea.structured_outputs_config.disable_any_whitespace is True
    assert ea.num_gpu_blocks_override == 64 and ea.seed == 0  # frmps's still
    with pytest.raises(AdapterError, match="frmps sets max-model-len"):
        load_adapter("vllm", launched("--max-model-len=99"))
    with pytest.raises(AdapterError, match="need --engine vllm"):
        load_adapter("ref", launched("--max-logprobs=7"))


def test_keep_aot_switch_leaves_vllms_aot_compile_as_it_was(monkeypatch):
    """FRMPS_DEBUG_BI_KEEP_AOT (an experiment): vLLM 0.26's batch-invariant override
    turns VLLM_USE_AOT_COMPILE off; with the switch it stays as it was. Off unless
    both variables are set; a vLLM without that override (0.33) needs nothing."""
    import importlib
    import os

    from frmps_engine.vllm.envpolicy import BI_KEEP_AOT_ENV, keep_aot_in_batch_invariant_mode

    assert not keep_aot_in_batch_invariant_mode({BI_KEEP_AOT_ENV: "1"})  # not batch-invariant
    assert not keep_aot_in_batch_invariant_mode({"VLLM_BATCH_INVARIANT": "1"})  # switch off
    try:
        bi = importlib.import_module("vllm.model_executor.layers.batch_invariant")
    except ImportError:
        bi = None
    original = getattr(bi, "override_envs_for_invariance", None)
    on = {BI_KEEP_AOT_ENV: "1", "VLLM_BATCH_INVARIANT": "1"}
    if original is None:  # vLLM 0.33: the override moved and leaves the AOT compile alone
        assert not keep_aot_in_batch_invariant_mode(on)
        return
    monkeypatch.setattr(bi, "override_envs_for_invariance", original)  # restored after the test
    saved = dict(os.environ)
    try:
        for before in (None, "1"):
            os.environ.pop("VLLM_USE_AOT_COMPILE", None)
            if before is not None:
                os.environ["VLLM_USE_AOT_COMPILE"] = before
            original()  # vLLM's own: the AOT compile off (the negative control of the check below)
            assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"
            os.environ.pop("VLLM_USE_AOT_COMPILE", None)
            if before is not None:
                os.environ["VLLM_USE_AOT_COMPILE"] = before
            assert keep_aot_in_batch_invariant_mode(on) and keep_aot_in_batch_invariant_mode(on)  # idempotent
            bi.override_envs_for_invariance()
            assert os.environ.get("VLLM_USE_AOT_COMPILE") == before
            assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8", "the rest of vLLM's override still runs"
            assert bi.override_envs_for_invariance.__wrapped__ is original
            bi.override_envs_for_invariance = original
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_logprobs_come_from_vllms_per_request_lists_cut_to_the_requests_k():
    """vLLM's LogprobsLists of one request (its real type; the rows as its sampler
    fills them: the sampled token first, then the batch's most likely tokens)."""
    import numpy as np
    from vllm.v1.outputs import LogprobsLists

    from frmps_engine.vllm.core import _logprobs

    lists = LogprobsLists(np.array([[7, 3, 7, 9], [4, 4, 1, 2]]), np.array([[-1.5, -0.5, -1.5, -2.0], [-0.1, -0.1, -3.0, -4.0]]),
                          np.array([2, 1]))
    assert _logprobs(lists, 2, 2) == [(-1.5, 2, [3, 7], [-0.5, -1.5]), (-0.1, 1, [4, 1], [-0.1, -3.0])]
    assert _logprobs(lists, 2, 0) == [(-1.5, 2, [], []), (-0.1, 1, [], [])]
    assert _logprobs(None, 2, 2) is None


def test_exact_engines_compile_with_inductors_deterministic_mode(model_dir, monkeypatch):
    """Under --exact (TORCHINDUCTOR_DETERMINISTIC=1 in the engines' environment) vLLM's
    compilation config gets Inductor's deterministic mode and no combo kernels, over a
    --vllm-arg compilation config whose other keys stay; without the variable, vLLM's
    own config (combo kernels as vLLM chooses)."""
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(platforms, "_current_platform", CpuPlatform())  # vLLM's parser asks the platform
    from frmps_engine.sdk.adapters import EngineOptions
    from frmps_engine.vllm.engine import make_adapter
    from frmps_engine.vllm.envpolicy import EXACT_INDUCTOR_CONFIG

    def inductor(env: str | None, *vllm_args: str) -> dict:
        if env is None:
            monkeypatch.delenv("TORCHINDUCTOR_DETERMINISTIC", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_DETERMINISTIC", env)
        ea = make_adapter(EngineOptions(model=model_dir, num_blocks=100, vllm_args=vllm_args)).engine_args(True, 0.5)
        cc = ea.compilation_config
        return dict(cc.inductor_compile_config if not isinstance(cc, dict) else cc.get("inductor_compile_config") or {})

    got = inductor("1")
    assert {k: got.get(k) for k in EXACT_INDUCTOR_CONFIG} == EXACT_INDUCTOR_CONFIG
    given = inductor("1", '--compilation-config={"inductor_compile_config": {"max_autotune": false, "deterministic": false}}')
    assert given.get("max_autotune") is False and {k: given.get(k) for k in EXACT_INDUCTOR_CONFIG} == EXACT_INDUCTOR_CONFIG
    for env in (None, "0"):
        assert "deterministic" not in inductor(env)
