"""The KV cache's size from --gpu-memory-utilization and `vllm serve`'s defaults
(frmps_engine/vllm/sizing.py), on fake memory figures."""

from __future__ import annotations

import pytest

GiB = 1 << 30
H200 = (143 * GiB + 771 * (1 << 20), "NVIDIA H200")  # NVML's total of a 141 GB H200, about


def _report(**kw):
    from frmps_engine.vllm import sizing

    base = dict(gpu_total=100 * GiB, utilization=0.9, weights=15 * GiB, activations=3 * GiB,
                graphs=1 * GiB, context=1 * GiB, mps=GiB // 2)
    base.update(kw)
    return sizing.MemoryReport(**base)


def test_the_kv_cache_gets_what_the_budget_leaves():
    from frmps_engine.vllm import sizing

    b = sizing.size_kv(_report(), block_bytes=1 << 20, min_blocks=10, layers=28)
    # 0.9 x 100 GiB = 90 GiB; weights 15; two engines x (1 + 3 + 1) = 10; MPS 0.5; 28 x 2 MiB rounding.
    room = 90 * GiB - 15 * GiB - 10 * GiB - GiB // 2 - 28 * (2 << 20)
    assert b.num_blocks == room // (1 << 20)
    assert b.kv_bytes == b.num_blocks << 20
    assert b.budget_bytes == 90 * GiB and b.weights_bytes == 15 * GiB
    assert b.reserved == {"contexts": 2 * GiB, "activations": 6 * GiB, "graphs": 2 * GiB, "mps": GiB // 2,
                          "kv_rounding": 28 * (2 << 20)}
    assert b.reserved_bytes == sum(b.reserved.values())
    assert b.weights_bytes + b.kv_bytes + b.reserved_bytes <= b.budget_bytes
    assert b.source == "estimated" and "blocks of 1048576 bytes" in b.line()
    # One standby less (engines=1) leaves one engine's reserve more for KV.
    one = sizing.size_kv(_report(engines=1), block_bytes=1 << 20, min_blocks=10, layers=28)
    assert one.num_blocks - b.num_blocks == 5 * 1024


def test_the_layouts_kv_pool_is_kept_within_the_room():
    """Where the pool the layout allocates is larger than blocks x block bytes
    (torch's segments), the count is lowered until the pool fits."""
    from frmps_engine.vllm import sizing

    plain = sizing.size_kv(_report(), block_bytes=1 << 20, min_blocks=10, layers=28)
    padded = sizing.size_kv(_report(), block_bytes=1 << 20, min_blocks=10, layers=28,
                            kv_pool_bytes=lambda n: n * (1 << 20) + 300 * (1 << 20))
    assert padded.num_blocks == plain.num_blocks - 300
    assert padded.kv_bytes == padded.num_blocks * (1 << 20) + 300 * (1 << 20)


def test_too_little_memory_is_refused_with_what_to_change():
    from frmps_engine.vllm import sizing

    with pytest.raises(sizing.SizingError) as e:  # weights alone overflow the budget
        sizing.size_kv(_report(gpu_total=16 * GiB), block_bytes=1 << 20, min_blocks=10, layers=28)
    msg = str(e.value)
    assert "--gpu-memory-utilization 0.9 of the GPU's 16.00 GiB is 14.40 GiB" in msg
    assert "weights take 15.00 GiB" in msg and "give --num-blocks" in msg and "--max-model-len" in msg
    # Room for some blocks, but fewer than one longest request needs.
    with pytest.raises(sizing.SizingError, match="fewer than the 2049 one request"):
        sizing.size_kv(_report(gpu_total=30 * GiB), block_bytes=1 << 20, min_blocks=2049, layers=28)
    for u in (0, -0.1, 1.01):
        with pytest.raises(sizing.SizingError, match="must be in"):
            sizing.size_kv(_report(utilization=u), block_bytes=1 << 20, min_blocks=1, layers=1)


@pytest.mark.parametrize("memory,name,want", [
    (143 * GiB, "NVIDIA H200", (1024, 8192)),
    (80 * GiB, "NVIDIA H100 80GB HBM3", (1024, 8192)),
    (70 * GiB, "NVIDIA H100", (1024, 8192)),
    (70 * GiB - 1, "NVIDIA H100", (256, 2048)),
    (80 * GiB, "NVIDIA A100-SXM4-80GB", (256, 2048)),
    (24 * GiB, "NVIDIA L4", (256, 2048)),
])
def test_serve_defaults_follow_vllms_own_rule(monkeypatch, memory, name, want):
    """sizing.serve_batch_defaults against vLLM's EngineArgs.get_batch_defaults
    (the installed vLLM's rule, its platform faked) for the OpenAI server."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext

    from frmps_engine.vllm import sizing

    monkeypatch.setattr(type(current_platform), "get_device_total_memory", classmethod(lambda cls, i=0: memory))
    monkeypatch.setattr(type(current_platform), "get_device_name", classmethod(lambda cls, i=0: name))
    monkeypatch.setattr(type(current_platform), "is_tpu", lambda self: False, raising=False)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False, raising=False)
    tokens, seqs = EngineArgs.get_batch_defaults(world_size=1)
    vllm_says = (seqs[UsageContext.OPENAI_API_SERVER], tokens[UsageContext.OPENAI_API_SERVER])
    assert sizing.serve_batch_defaults(memory, name) == vllm_says == want


def test_the_models_context_length_as_vllm_derives_it():
    from frmps_engine.vllm.sizing import model_max_len

    assert model_max_len({"max_position_embeddings": 32768}) == 32768
    assert model_max_len({"max_position_embeddings": 32768}, {"model_max_length": 131072}) == 32768
    assert model_max_len({"max_position_embeddings": 32768}, {"model_max_length": 8192}) == 8192
    assert model_max_len({"max_position_embeddings": 32768, "n_positions": 4096}) == 4096
    assert model_max_len({}) == 2048
    yarn = {"max_position_embeddings": 32768,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    assert model_max_len(yarn) == 131072
    assert model_max_len({"max_position_embeddings": 8192, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}) == 8192
    assert model_max_len({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}}) == 8192


def test_the_preset_context_length_matches_vllms_model_config(tmp_path):
    """vLLM's own ModelConfig (max_model_len not given) derives the same for the
    Qwen2.5-7B preset directory frmps serves."""
    from vllm.config import ModelConfig

    from frmps_engine import modeldir
    from frmps_engine.vllm.modelcfg import hf_config, tokenizer_config
    from frmps_engine.vllm.sizing import model_max_len

    d = modeldir.write("qwen2.5-7b", str(tmp_path / "q7"))
    assert model_max_len(hf_config(d), tokenizer_config(d)) == ModelConfig(model=d, tokenizer=d).max_model_len == 32768


def _q7_adapter(tmp_path, monkeypatch, gpu=H200, env=None, **cfg):
    from frmps_engine import modeldir
    from frmps_engine.vllm.engine import VllmAdapter, VllmEngineConfig

    d = modeldir.write("qwen2.5-7b", str(tmp_path / "q7"))
    def fake_gpu(self):  # NVML's figures, faked
        self._gpu_name = gpu[1]
        return gpu

    monkeypatch.setattr(VllmAdapter, "_gpu", fake_gpu)
    for k in ("CUDA_MPS_PIPE_DIRECTORY",):
        monkeypatch.delenv(k, raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    return VllmAdapter(VllmEngineConfig(model=d, device="cuda", **cfg))


def test_a_7b_on_an_h200_without_num_blocks(tmp_path, monkeypatch):
    """No --num-blocks: the adapter sizes the KV cache on the GPU's figures; the
    model's own context length and `vllm serve`'s batch limits; the layout holds
    the count; the standby (same configuration) derives the same layout."""
    from frmps_engine.vllm import sizing

    ad = _q7_adapter(tmp_path, monkeypatch, env={"CUDA_MPS_PIPE_DIRECTORY": "/run/mps"})
    b = ad.kv_budget
    assert ad.max_model_len == 32768 and ad.batch_limits(*H200) == (1024, 8192)
    assert ad.num_blocks == b.num_blocks > 100_000 and b.source == "estimated"
    w, kv = ad.pool_layout()
    assert (b.weights_bytes, b.kv_bytes) == (w.size, kv.size)
    assert b.block_bytes == 28 * 2 * 16 * 4 * 128 * 2  # layers x K,V x tokens x KV heads x head dim x bf16
    assert b.reserved["mps"] == sizing.MPS_SERVER_BYTES
    assert w.size + kv.size + b.reserved_bytes <= b.budget_bytes == int(0.9 * H200[0])
    # The KV pool takes what is left, up to the pool layout's rounding (which differs
    # between vLLM versions: ~2 MiB on 0.33, ~7 MiB on 0.26).
    assert b.budget_bytes - (w.size + kv.size + b.reserved_bytes) < 2 * b.block_bytes + (64 << 20)
    standby = _q7_adapter(tmp_path, monkeypatch, env={"CUDA_MPS_PIPE_DIRECTORY": "/run/mps"})
    assert standby.pool_layout() == ad.pool_layout()
    ea = ad.engine_args(True, 0.5)
    assert (ea.num_gpu_blocks_override, ea.max_model_len, ea.kv_cache_memory_bytes) == (ad.num_blocks, 32768, kv.size)
    # Not given: vLLM applies `vllm serve`'s defaults itself (create_core passes its usage context).
    assert (ea.max_num_seqs, ea.max_num_batched_tokens) == (None, None)
    # A lower fraction, fewer blocks; --num-blocks wins and is reported as given.
    low = _q7_adapter(tmp_path, monkeypatch, gpu_memory_utilization=0.5)
    assert 0 < low.num_blocks < ad.num_blocks
    given = _q7_adapter(tmp_path, monkeypatch, num_blocks=2048)
    assert given.num_blocks == 2048 and given.kv_budget.source == "--num-blocks"
    assert given.kv_budget.kv_bytes == given.pool_layout()[1].size


def test_a_gpu_too_small_for_the_model_is_refused_at_start(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"--engine vllm: no room for the KV cache.*weights take"):
        _q7_adapter(tmp_path, monkeypatch, gpu=(16 * GiB, "NVIDIA T4"))
    # Room for blocks, but not for one request of the model's 32,768 tokens.
    with pytest.raises(ValueError, match="fewer than the 2049 one request"):
        _q7_adapter(tmp_path, monkeypatch, gpu=(24 * GiB, "NVIDIA L4"))
    # A shorter --max-model-len fits.
    assert _q7_adapter(tmp_path, monkeypatch, gpu=(24 * GiB, "NVIDIA L4"), max_model_len=4096).num_blocks > 257


def test_without_nvml_the_adapter_asks_for_num_blocks(tmp_path, monkeypatch):
    from frmps_engine import modeldir
    from frmps_engine.vllm.engine import VllmAdapter, VllmEngineConfig

    def no_gpu(self):
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setattr(VllmAdapter, "_gpu", no_gpu)
    d = modeldir.write("qwen2.5-0.5b", str(tmp_path / "q05"))
    with pytest.raises(ValueError, match=r"cannot read the GPU's memory.*NVML.*give --num-blocks"):
        VllmAdapter(VllmEngineConfig(model=d, device="cuda"))


def test_the_ring_check(tmp_path, monkeypatch):
    """The largest FULL record of the defaults (1,024 requests, 32,768 tokens, the
    KV cache's tokens) against the ring: the default 8 MiB ring (2 MiB records)
    does not hold it and the runner says which ring would."""
    from types import SimpleNamespace

    from frmps_engine.ring.layout import PAYLOAD_PER_ENTRY, ring_capacity_needed
    from frmps_engine.sdk.runner import ring_room_note
    from frmps_engine.vllm import sizing

    rec = sizing.ring_record_bytes(max_num_seqs=1024, max_model_len=32768, block_size=16, kv_tokens=10_000,
                                   entry_bytes=PAYLOAD_PER_ENTRY)
    assert rec == 1024 * PAYLOAD_PER_ENTRY + 4 * (10_000 + 1024 * 16 + 10_000 // 16 + 1024)
    short = sizing.ring_record_bytes(max_num_seqs=4, max_model_len=100, block_size=16, kv_tokens=10**9,
                                     entry_bytes=PAYLOAD_PER_ENTRY)
    assert short == 4 * PAYLOAD_PER_ENTRY + 4 * (400 + 4 * 7)
    ad = _q7_adapter(tmp_path, monkeypatch)
    assert ad.ring_record_bytes > 2 << 20  # more than an 8 MiB ring's records
    pub = SimpleNamespace(_writer=SimpleNamespace(max_record=(8 << 20) // 2))
    line = ring_room_note(ad.ring_record_bytes, pub)
    need = ring_capacity_needed(ad.ring_record_bytes)
    assert f"--ring-capacity {need}" in line and need // 4 >= ad.ring_record_bytes
    assert ring_room_note(ad.ring_record_bytes, SimpleNamespace(_writer=SimpleNamespace(max_record=need // 2))) == ""


def test_the_budget_goes_into_the_hello(tmp_path, monkeypatch):
    from frmps_engine.sdk.runner import kv_budget_pb

    b = _q7_adapter(tmp_path, monkeypatch).kv_budget
    pb = kv_budget_pb(b)
    assert (pb.num_blocks, pb.kv_bytes, pb.weights_bytes, pb.budget_bytes, pb.source) == (
        b.num_blocks, b.kv_bytes, b.weights_bytes, b.budget_bytes, "estimated")
    assert dict(pb.reserved) == b.reserved and abs(pb.utilization - 0.9) < 1e-12
    assert kv_budget_pb(None) is None


def test_the_engine_cli_takes_the_fraction(tmp_path, monkeypatch, capsys):
    from frmps_engine.cli import build_parser, engine_options
    from frmps_engine.vllm.engine import make_adapter

    base = ["serve", "--role", "active", "--model", "m", "--control-socket", "s", "--generation-socket", "g"]
    for bad in ("0", "1.5", "-0.2", "x"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(base + ["--gpu-memory-utilization", bad])
    assert engine_options(build_parser().parse_args(base)).gpu_memory_utilization is None
    opts = engine_options(build_parser().parse_args(base + ["--gpu-memory-utilization", "0.5"]))
    assert opts.gpu_memory_utilization == 0.5
    ad = _q7_adapter(tmp_path, monkeypatch)  # writes the model directory and fakes the GPU
    half = make_adapter(opts.__class__(**{**opts.__dict__, "model": ad.cfg.model, "device": "cuda"}))
    assert half.cfg.gpu_memory_utilization == 0.5 and half.kv_budget.utilization == 0.5
    assert half.num_blocks < ad.num_blocks
