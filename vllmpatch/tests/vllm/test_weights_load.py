"""Real weights with --engine vllm: a model directory with *.safetensors is
loaded by the active (vLLM's own loader, into the weights pool), never by the
standby (dummy into its placeholder, then the active's pool mapped in place),
and dummy weights only where the directory has none.

The last test drives vLLM's real DefaultModelLoader on the CPU (vLLM's CPU
platform, a one-rank gloo group) under frmps's loader patch, over pools from the
interceptor library on its fake driver (poolhelpers.py): the checkpoint's
tensors land in the active's weights pool, and a standby that built dummy
weights at the same offsets reads the file's values once it maps that pool.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from e2e import require

torch = require("torch")

import hfckpt  # noqa: E402  (vllmpatch/tests)


@pytest.fixture(scope="module", params=[(False, "bfloat16"), (True, "float32")], ids=["untied-bf16", "tied-fp32"])
def ckpt(tmp_path_factory, request):
    # Saved in bfloat16 with untied embeddings, or in float32 with tied ones; served in float32 below.
    tie, dtype = request.param
    return hfckpt.write_checkpoint(str(tmp_path_factory.mktemp("ck") / "m"), tie=tie, dtype=dtype,
                                   num_hidden_layers=2)


def _adapter(model, **kw):
    from frmps_engine.sdk.adapters import EngineOptions
    from frmps_engine.vllm.engine import make_adapter

    return make_adapter(EngineOptions(model=model, num_blocks=64, **kw))


def test_active_loads_the_checkpoint_the_standby_never_does(ckpt, tmp_path):
    from frmps_engine.vllm.engine import FRMPS_OWNED_ENGINE_ARGS
    from vhelpers import write_tiny_model

    ad = _adapter(ckpt)
    assert (ad.cfg.weights, ad.weights) == ("load", f"loaded:{ckpt}")
    assert ad.engine_args(True, 0.5).load_format == "safetensors"  # the active: vLLM's own loader
    assert ad.engine_args(False, 0.5).load_format == "dummy"  # the standby: never reads the files
    # Both agree on the pools whatever they load (the layout is the configuration's).
    assert ad.pool_layout() == _adapter(ckpt, weights="dummy").pool_layout()
    # --weights dummy: random weights even with a checkpoint there.
    forced = _adapter(ckpt, weights="dummy")
    assert (forced.cfg.weights, forced.weights, forced.engine_args(True, 0.5).load_format) == ("dummy", "dummy", "dummy")
    # No weights in the directory (frmps model init's kind): dummy for both roles.
    bare = _adapter(write_tiny_model(tmp_path / "bare"))
    assert (bare.cfg.weights, bare.weights) == ("dummy", "dummy")
    assert {bare.engine_args(r, 0.5).load_format for r in (True, False)} == {"dummy"}
    # PyTorch pickles only: refused, not served as dummy.
    pt = write_tiny_model(tmp_path / "pt")
    open(os.path.join(pt, "pytorch_model.bin"), "wb").close()
    from frmps_engine.sdk.adapters import AdapterError

    with pytest.raises(AdapterError, match="no \\*.safetensors"):
        _adapter(pt)
    assert _adapter(pt, weights="dummy").cfg.weights == "dummy"
    with pytest.raises(AdapterError, match="--weights 'x'"):
        _adapter(ckpt, weights="x")
    # vLLM's own --load-format stays frmps's (vllm_overrides refuses it), naming --weights.
    assert "--weights" in FRMPS_OWNED_ENGINE_ARGS["load_format"]


def test_pool_formulas_read_nulls_as_transformers_does(ckpt):
    """transformers writes null for unset optional fields; the pool formulas read
    them as absent (num_key_value_heads: the attention heads; head_dim: hidden /
    heads), as vLLM does through transformers."""
    import json

    from frmps_engine.vllm.modelcfg import weights_pool_bytes

    cfg = json.load(open(f"{ckpt}/config.json"))
    assert "rope_parameters" in cfg and "rope_theta" not in cfg  # as transformers 5 wrote it
    full = {**cfg, "num_key_value_heads": cfg["num_attention_heads"], "head_dim": 16}
    assert weights_pool_bytes({**full, "num_key_value_heads": None, "head_dim": None}, "bfloat16") == \
        weights_pool_bytes(full, "bfloat16")
    # No max_position_embeddings: transformers' Qwen2 default (32768) sizes the RoPE cache, not 0.
    short = {k: v for k, v in full.items() if k != "max_position_embeddings"}
    assert weights_pool_bytes(short, "bfloat16") == weights_pool_bytes({**full, "max_position_embeddings": 32768}, "bfloat16")


# -- vLLM's real loader on the CPU ---------------------------------------------------
@pytest.fixture
def cpu_vllm():
    """vLLM's CPU platform and a one-rank process group, for building vLLM's own
    Qwen2 model on the CPU; both are process-wide, and restored afterwards."""
    import vllm.platforms as vp
    from vllm.platforms.cpu import CpuPlatform

    saved = vp._current_platform
    vp._current_platform = CpuPlatform()
    yield
    from vllm.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()
    vp._current_platform = saved


def _tensors_from_data_allocate():
    """``torch.tensor(data)`` on the CPU makes no dispatcher call that allocates, so
    the pool double (HostMemPools) would not see it; on a GPU it is an allocation
    like any other (vLLM's attention scales are made so). This mode clones such
    tensors, which the double then places."""
    from torch.overrides import TorchFunctionMode

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.tensor and out.device.type == "cpu":
                return out.clone()
            return out

    return Mode()


def _load(vc, load_format: str):
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel, parallel_state
    from vllm.model_executor.model_loader import get_model_loader

    from vllm.model_executor.layers import rotary_embedding

    vc.load_config.load_format = load_format
    # vLLM keeps one rotary embedding per set of parameters for the process; each
    # engine here stands for a process of its own, which builds its own.
    rotary_embedding._ROPE_DICT.clear()
    with set_current_vllm_config(vc):
        if not parallel_state.model_parallel_is_initialized():
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            initialize_model_parallel(1, 1)
        loader = get_model_loader(vc.load_config)
        with _tensors_from_data_allocate():
            return loader.load_model(vllm_config=vc, model_config=vc.model_config)


def _file_tensors(ckpt: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(ckpt)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(ckpt, f)))
    return out


def _expected(files: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """vLLM's parameter ``name`` from the file's tensors (q/k/v and gate/up fused)."""
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for key, parts in fused.items():
        if f".{key}." in name:
            return torch.cat([files[name.replace(key, p)] for p in parts])
    return files[name]


def test_vllm_default_loader_puts_the_checkpoint_in_the_pool_and_the_standby_maps_it(ckpt, cpu_vllm, tmp_path,
                                                                                     monkeypatch):
    import poolhelpers
    from poolhelpers import build_interceptor, inside

    monkeypatch.setattr(poolhelpers, "PACK_SMALL", True)  # small tensors share segments, as in torch

    libs = build_interceptor(tmp_path, ("active", "standby"))
    if libs is None:
        from e2e import missing

        missing("needs a C compiler and make to build the interceptor")
    from test_allocation import Engine

    from frmps_engine.vllm import plugin, pools
    from frmps_engine.vllm.modelcfg import weights_pool_bytes
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig

    plugin.register()
    from frmps_engine.vllm.engine import make_adapter

    ad = make_adapter(SimpleNamespace(model=ckpt, num_blocks=64, dtype="float32", device="cpu"))
    layout = ad.pool_layout()
    def vc():  # one per engine: vLLM registers each model's layers in its config
        mc = ModelConfig(model=ckpt, dtype="float32", max_model_len=256, seed=0, skip_tokenizer_init=True)
        mc.sleep_mode_backend = "frmps"
        return VllmConfig(model_config=mc, load_config=LoadConfig(), device_config=DeviceConfig(device="cpu"))

    files = _file_tensors(ckpt)
    made = []
    try:
        active = Engine(libs["active"], "active", layout)
        made.append(active)
        model = _load(vc(), ad.load_format(True))
        w = active.pools["weights"].tensor
        params = dict(model.named_parameters())
        assert params and all(inside(p, w) for p in params.values())
        tied = "lm_head.weight" not in files
        assert ("lm_head.weight" in params) != tied  # a tied head is the embedding (vLLM lists it once)
        for name, p in params.items():  # the file's values, in the engine's dtype (bf16 -> float32 exactly)
            assert p.dtype == torch.float32, name
            assert torch.equal(p.detach(), _expected(files, name).float()), name
        # The formula that sized the pool holds what the real load placed there.
        assert active.used("weights") <= layout[0].size
        assert active.controller.placed["weights"] <= weights_pool_bytes(ad.hf, "float32")
        want = {n: p.detach().clone() for n, p in params.items()}
        _check_gpu_script_file_side(ckpt, files, params, tmp_path)

        standby = Engine(libs["standby"], "standby", layout)
        made.append(standby)
        s_model = _load(vc(), ad.load_format(False))  # "dummy": random values, on its scratch
        s_params = dict(s_model.named_parameters())
        assert set(s_params) == set(params)
        assert not torch.equal(s_params["model.embed_tokens.weight"].detach(), want["model.embed_tokens.weight"])
        base_a, base_s = active.pools["weights"].address, standby.pools["weights"].address
        assert {n: p.data_ptr() - base_s for n, p in s_params.items()} == {n: p.data_ptr() - base_a for n, p in params.items()}
        for n, p in params.items():  # the standby's initialisation left the active's weights alone
            assert torch.equal(p.detach(), want[n]), n
        fds = [os.dup(active.pools[s.tag].fd) for s in layout]
        standby.backend.map(layout, fds, readonly=True)
        for n, p in s_params.items():
            assert torch.equal(p.detach(), want[n]), n
    except Exception as e:
        # Reported as text now: the tensors in a failing frame's arguments live in the
        # pools, which are gone by the time pytest would format the traceback.
        import traceback

        pytest.fail(f"{type(e).__name__}: {e}\n{traceback.format_exc()}", pytrace=False)
    finally:
        pools.install_controller(None)
        pools.set_context_factory(None)
        for e in reversed(made):
            e.close()


def _check_gpu_script_file_side(ckpt, files, params, tmp_path):
    """bench/gpu/weights_check.py's side of the comparison, against the parameters
    vLLM's loader built here: its expected checksums from the file equal the
    model's (debug_fault.tensor_checksum, the engines' hook), and its perturbed copy
    differs in exactly the parameter holding the changed tensor."""
    import importlib.util

    from frmps_engine.sdk.debug_fault import tensor_checksum

    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench", "gpu", "weights_check.py")
    spec = importlib.util.spec_from_file_location("weights_check", path)
    wc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wc)
    got = {n: tensor_checksum(p) for n, p in params.items()}
    assert wc.compare(got, wc.expected(files, got, "float32")) == []
    bad_dir, tensor = wc.perturbed_copy(ckpt, files, str(tmp_path / "perturbed"))
    assert wc.compare(got, wc.expected(wc.file_tensors(bad_dir), got, "float32")) == [wc.param_of(tensor)]
    assert ".gate_up_proj." not in tensor and wc.param_of(tensor) == tensor  # down_proj: not fused
    assert wc.param_of("model.layers.0.self_attn.k_proj.bias") == "model.layers.0.self_attn.qkv_proj.bias"
