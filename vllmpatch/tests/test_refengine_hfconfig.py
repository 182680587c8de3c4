"""A checkpoint as transformers writes it serves what transformers computes.

A small Qwen2 saved by transformers 5 (``rope_parameters.rope_theta``) and the
same rewritten as transformers 4 wrote it (top-level ``rope_theta``): the
reference engine's greedy output equals transformers' own ``generate`` token for
token. Plus the config fields the engine reads both ways, and what it refuses.
"""

from __future__ import annotations

import json

import pytest

from e2e import require

torch = require("torch")
transformers = require("transformers")
pytestmark = pytest.mark.torch

import hfckpt  # noqa: E402
from frmps_engine.refengine import ConfigError, EngineConfig, RefCore, SamplingParams  # noqa: E402
from frmps_engine.refengine.config import shape_from_hf_config  # noqa: E402

NEW = 12


def _ref_greedy(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    cfg = EngineConfig.from_preset(model_dir, num_blocks=64, max_model_len=256)
    assert cfg.weights == model_dir  # the directory's checkpoint, not dummy weights
    core = RefCore(cfg, RefCore.allocate_pools(cfg), load_weights=True)
    sp = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    got = core.generate([(i, p, sp) for i, p in enumerate(prompts)])
    return [got[i] for i in range(len(prompts))]


@pytest.mark.parametrize("style,tie,dtype", [("t5", True, "float32"), ("t4", True, "float32"),
                                              ("t5", False, "bfloat16")])
def test_greedy_output_equals_transformers(tmp_path, one_torch_thread, style, tie, dtype):
    d = hfckpt.write_checkpoint(str(tmp_path / "m"), style=style, tie=tie, dtype=dtype)
    raw = json.load(open(f"{d}/config.json"))
    if style == "t5":  # what this test is about: transformers 5 moved the RoPE base
        assert "rope_theta" not in raw and raw["rope_parameters"]["rope_theta"] == hfckpt.ROPE_THETA
    else:
        assert raw["rope_theta"] == hfckpt.ROPE_THETA and "rope_parameters" not in raw
    prompts = [hfckpt.tokenize(d, t) for t in hfckpt.PROMPTS]
    want = hfckpt.hf_greedy(d, prompts, NEW)
    assert _ref_greedy(d, prompts) == want


def _write(tmp_path, **fields) -> str:
    base = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", **hfckpt.SHAPE)
    d = tmp_path / "c"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({**base, **fields}))
    return str(d)


def test_config_fields_read_both_ways(tmp_path):
    # transformers 5: rope_parameters, dtype, layer_types, nulls for unset fields.
    s = shape_from_hf_config(_write(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                                    dtype="bfloat16", layer_types=["full_attention"] * 4, num_key_value_heads=None,
                                    head_dim=None, tie_word_embeddings=True, use_sliding_window=False,
                                    sliding_window=None))
    assert (s.rope_theta, s.num_kv_heads, s.head_dim, s.tie_word_embeddings) == (5e5, 8, 16, True)
    # transformers 4: top-level rope_theta, rope_scaling null, torch_dtype.
    s = shape_from_hf_config(_write(tmp_path, rope_theta=2e4, rope_scaling=None, torch_dtype="float32",
                                    num_key_value_heads=2, rms_norm_eps=1e-5, head_dim=32))
    assert (s.rope_theta, s.num_kv_heads, s.rms_norm_eps, s.head_dim) == (2e4, 2, 1e-5, 32)
    # Nested by layer type, one RoPE for all: accepted.
    s = shape_from_hf_config(_write(tmp_path, layer_types=["full_attention"] * 4,
                                    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 3e3}}))
    assert s.rope_theta == 3e3
    # rope_parameters wins over a top-level rope_theta, as in transformers 5.
    assert shape_from_hf_config(_write(tmp_path, rope_theta=1.0,
                                       rope_parameters={"rope_theta": 7e3})).rope_theta == 7e3
    # Neither: transformers' default.
    assert shape_from_hf_config(_write(tmp_path)).rope_theta == 10000.0
    # An inactive sliding window (use_sliding_window false, or a window past every position) is fine.
    shape_from_hf_config(_write(tmp_path, use_sliding_window=False, sliding_window=128))
    shape_from_hf_config(_write(tmp_path, use_sliding_window=True, sliding_window=4096, max_window_layers=0))


@pytest.mark.parametrize("fields,why", [
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}), "RoPE type 'yarn'"),
    (dict(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0}), "RoPE type 'linear'"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "RoPE type 'dynamic'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
    (dict(layer_types=["full_attention", "sliding_attention"] * 2,
          rope_parameters={"full_attention": {"rope_theta": 1e4}, "sliding_attention": {"rope_theta": 1e6}}), "differ between layer types"),
    (dict(use_sliding_window=True, sliding_window=128, max_window_layers=1), "sliding-window attention"),
    (dict(use_sliding_window=True, sliding_window=128, layer_types=["sliding_attention"] * 4), "sliding-window attention"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(quantization_config={"quant_method": "awq"}), "quantized"),
    (dict(dtype="float8_e4m3fn"), "checkpoint dtype"),
])
def test_config_fields_the_engine_cannot_serve_are_refused(tmp_path, fields, why):
    with pytest.raises(ConfigError, match=why):
        shape_from_hf_config(_write(tmp_path, **fields))


def test_pytorch_only_checkpoint_is_refused_not_served_as_dummy(tmp_path):
    d = _write(tmp_path)
    (tmp_path / "c" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        EngineConfig.from_preset(d, num_blocks=16, max_model_len=64)
    # Explicit dummy weights are still possible, and a directory without weights is dummy.
    assert EngineConfig.from_preset(d, num_blocks=16, max_model_len=64, weights="dummy").weights == "dummy"
    (tmp_path / "c" / "pytorch_model.bin").unlink()
    assert EngineConfig.from_preset(d, num_blocks=16, max_model_len=64).weights == "dummy"


def test_adapters_say_where_the_weights_come_from(tmp_path):
    """Hello.weights: loaded:<dir> for a directory with a checkpoint, dummy for a
    preset, a directory without weights, or --weights dummy."""
    from frmps_engine.sdk.adapters import AdapterError, EngineOptions, RefAdapter

    d = hfckpt.write_checkpoint(str(tmp_path / "m"), num_hidden_layers=1)
    assert RefAdapter(EngineOptions(model=d, num_blocks=16, max_model_len=64)).weights == f"loaded:{d}"
    assert RefAdapter(EngineOptions(model=d, num_blocks=16, max_model_len=64, weights="dummy")).weights == "dummy"
    assert RefAdapter(EngineOptions(model="tiny", num_blocks=16)).weights == "dummy"
    bare = _write(tmp_path)
    assert RefAdapter(EngineOptions(model=bare, num_blocks=16, max_model_len=64)).weights == "dummy"
    with pytest.raises(AdapterError, match="--weights 'load'"):
        RefAdapter(EngineOptions(model=d, num_blocks=16, max_model_len=64, weights="load"))


def test_engine_cli_weights_flag():
    from frmps_engine import cli

    base = ["serve", "--role", "active", "--model", "tiny", "--control-socket", "/x", "--generation-socket", "/y"]
    assert cli.engine_options(cli.build_parser().parse_args(base)).weights == "auto"
    assert cli.engine_options(cli.build_parser().parse_args(base + ["--weights", "dummy"])).weights == "dummy"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(base + ["--weights", "load"])
