"""`frmps model init PRESET --weights seeded`: the seeded checkpoint
(frmps_engine/seeded_weights.py) and the sensitivity measure
(bench.sensitivity) that shows the model's output depends on its
context. The GPU half (CUDA draws the same bytes): test_seeded_weights_gpu.py."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

pytestmark = pytest.mark.torch


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from frmps_engine import modeldir

    return modeldir.write("tiny", str(tmp_path_factory.mktemp("m") / "tiny"), weights="seeded", seed=0)


@pytest.fixture(scope="module")
def uniform_tiny(tmp_path_factory, tiny):
    from bench.sensitivity import baseline_dir

    return baseline_dir(tiny, "uniform", str(tmp_path_factory.mktemp("baseline")))


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path, tiny):
    from frmps_engine import seeded_weights

    again = seeded_weights.write_seeded_checkpoint(str(tmp_path / "a"), "tiny", 0)
    other = seeded_weights.write_seeded_checkpoint(str(tmp_path / "b"), "tiny", 1)
    assert again["files"] == ["model.safetensors"] and again["seed"] == 0 and other["seed"] == 1
    assert _sha(str(tmp_path / "a" / "model.safetensors")) == _sha(os.path.join(tiny, "model.safetensors"))
    assert _sha(str(tmp_path / "b" / "model.safetensors")) != _sha(os.path.join(tiny, "model.safetensors"))
    desc = json.load(open(os.path.join(tiny, "frmps_weights.json")))
    assert (desc["generator"], desc["version"], desc["seed"], desc["scheme"]["name"]) == (
        "frmps-seeded", seeded_weights.VERSION, 0, "trained")


def test_a_tensor_depends_only_on_seed_and_name(tiny):
    """Drawn alone, a tensor has the bytes it has in the checkpoint (order does not matter)."""
    import math

    import torch
    from safetensors.torch import load_file

    from frmps_engine import seeded_weights as sw
    from frmps_engine.refengine.config import PRESETS

    saved = load_file(os.path.join(tiny, "model.safetensors"))
    shape = PRESETS["tiny"]
    by_name = {n: (s, k) for n, s, k in sw.hf_tensors(shape)}
    for name in ("model.layers.1.mlp.up_proj.weight", "model.norm.weight", "model.layers.0.self_attn.k_proj.bias"):
        s, kind = by_name[name]
        law, centre, scale = sw.tensor_law(kind, s, shape, sw.SCHEMES["trained"])
        alone = sw.draw(math.prod(s), sw.tensor_keys(0, name), law, centre, scale, "cpu").view(s)
        assert torch.equal(alone.view(torch.int16), saved[name].view(torch.int16)), name


@pytest.mark.parametrize("law,centre,scale", [("normal", 0.0, 0.05), ("normal", 1.0, 0.1), ("uniform", 0.0, 1e-3)])
def test_numpy_and_torch_integer_paths_draw_the_same_bytes(law, centre, scale):
    """The CPU draws with numpy uint32, a GPU with torch int64: the same integers and
    float operations, so the same bytes (run here with torch int64 on the CPU)."""
    import torch

    from frmps_engine import seeded_weights as sw

    n, (k1, k2) = 300_007, sw.tensor_keys(5, "x")
    a = sw.draw(n, (k1, k2), law, centre, scale, "cpu")
    h = torch.arange(n, dtype=torch.int64).bitwise_xor_(k1)
    sw._mix32_torch(h).bitwise_xor_(k2)
    sw._mix32_torch(h)
    b = sw._values(h, law, centre, scale, "torch").float().to(torch.bfloat16)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    f = a.float()
    assert abs(f.mean().item() - centre) < 0.01 * max(scale, 1e-3) * 10
    want_std = scale if law == "normal" else scale / 3**0.5
    assert abs(f.std().item() / want_std - 1) < 0.02


def test_laws_are_the_documented_scales():
    import math

    from frmps_engine import seeded_weights as sw
    from frmps_engine.refengine.config import PRESETS

    s, sch = PRESETS["qwen2.5-0.5b"], sw.SCHEMES["trained"]
    law = {k: sw.tensor_law(k, shp, s, sch) for _, shp, k in sw.hf_tensors(s)}
    assert law["q"][2] == pytest.approx(2.0 / math.sqrt(896))
    assert law["down"][2] == pytest.approx(1 / math.sqrt(4864) / math.sqrt(48))
    assert law["o"][2] == pytest.approx(1 / math.sqrt(896) / math.sqrt(48))
    assert law["final_norm"][1] == pytest.approx(8.0 / (0.02 * math.sqrt(896)))
    assert law["norm"][1:] == (1.0, 0.1)


def test_shard_plan_keeps_every_shard_under_the_limit():
    import math

    from frmps_engine import seeded_weights as sw
    from frmps_engine.refengine.config import PRESETS

    for preset, want in (("qwen2.5-0.5b", 1), ("qwen2.5-7b", 4), ("qwen2.5-14b", 6)):
        ts = sw.hf_tensors(PRESETS[preset])
        shards = sw.plan_shards(ts)
        assert len(shards) == want, preset
        assert sorted(i for sh in shards for i in sh) == list(range(len(ts)))
        assert all(sum(math.prod(ts[i][1]) * 2 for i in sh) <= sw.MAX_SHARD_BYTES for sh in shards)


@pytest.mark.parametrize("preset", ["tiny", "tiny-untied"])
def test_transformers_loads_it_strictly(tmp_path, preset):
    import torch
    from transformers import Qwen2ForCausalLM

    from frmps_engine import modeldir

    d = modeldir.write(preset, str(tmp_path / preset), weights="seeded", seed=0)
    model, info = Qwen2ForCausalLM.from_pretrained(d, dtype=torch.bfloat16, output_loading_info=True)
    assert info["missing_keys"] in (set(), []) and info["unexpected_keys"] in (set(), []), info
    assert not info.get("mismatched_keys"), info
    from safetensors.torch import load_file

    saved = load_file(os.path.join(d, "model.safetensors"))
    assert ("lm_head.weight" in saved) == (preset == "tiny-untied")
    sd = model.state_dict()
    for name, t in saved.items():
        assert torch.equal(sd[name], t), name


def test_sharded_checkpoint_loads_in_transformers_and_the_reference_engine(tmp_path, tiny):
    """Shards with an index (what 7B and 14B get) hold the same tensors as one file."""
    import shutil

    import torch
    from transformers import Qwen2ForCausalLM

    from frmps_engine import seeded_weights
    from frmps_engine.refengine import EngineConfig
    from frmps_engine.refengine.engine import RefCore

    d = str(tmp_path / "sharded")
    shutil.copytree(tiny, d)
    os.unlink(os.path.join(d, "model.safetensors"))
    desc = seeded_weights.write_seeded_checkpoint(d, "tiny", 0, max_shard_bytes=60_000)
    assert len(desc["files"]) > 2 and desc["files"][0] == f"model-00001-of-{len(desc['files']):05d}.safetensors"
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    assert set(index["weight_map"].values()) == set(desc["files"])
    assert index["metadata"]["total_size"] == seeded_weights.checkpoint_bytes("tiny")
    _, info = Qwen2ForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    one, many = EngineConfig.from_preset(tiny), EngineConfig.from_preset(d)
    assert many.weights == d
    a = RefCore(one, RefCore.allocate_pools(one), load_weights=True)
    b = RefCore(many, RefCore.allocate_pools(many), load_weights=True)
    for name, t in a.model.params.items():
        assert torch.equal(t, b.model.params[name]), name


def test_reference_engine_loads_it(tiny):
    import torch
    from safetensors.torch import load_file

    from frmps_engine.refengine import EngineConfig
    from frmps_engine.refengine.engine import RefCore

    cfg = EngineConfig.from_preset(tiny)
    assert cfg.weights == tiny and cfg.shape.rope_theta == 10_000.0
    core = RefCore(cfg, RefCore.allocate_pools(cfg), load_weights=True)
    saved = load_file(os.path.join(tiny, "model.safetensors"))
    p = core.model.params
    q = saved["model.layers.1.self_attn.q_proj.weight"].float()
    assert torch.equal(p["layers.1.qkv_proj.weight"][: q.shape[0]], q)
    assert torch.equal(p["norm"], saved["model.norm.weight"].float())


def sensitivity_row(model_dir: str, differ_at: int | None = None) -> dict:
    """The sensitivity measure at a small size (6 pairs, 20 context tokens, 12 generated)."""
    from bench.sensitivity import make_pairs, run_row

    pairs = make_pairs(512, 6, 20, seed=0, differ_at=differ_at)
    return run_row("ref", model_dir, pairs, 12, 1234, "cpu")


def assert_sensitive(row: dict) -> None:
    assert row["greedy_identical"] == 0, row["greedy_first_differences"]
    assert row["seeded_identical"] == 0, row["seeded_first_differences"]
    assert row["top1_prob"]["p50"] > 0.3 and row["top1_prob"]["p90"] < 0.9999, row["top1_prob"]
    assert row["distinct_mean"] > 0.6 and row["looping"] <= 1 / 6, (row["distinct_mean"], row["looping"])
    assert row["verdict"] == "sensitive", row["reasons"]


def test_seeded_tiny_is_peaked_and_context_sensitive(tiny):
    assert_sensitive(sensitivity_row(tiny))


def test_one_changed_token_far_back_changes_the_output(tiny):
    """Prompts that differ only in their first token (19 tokens before the shared
    last one) still continue differently: a wrong KV entry far back shows."""
    from bench.sensitivity import make_pairs

    for a, b in make_pairs(512, 6, 20, seed=0, differ_at=0):
        assert a[0] != b[0] and a[1:] == b[1:]
    row = sensitivity_row(tiny, differ_at=0)
    assert row["greedy_identical"] == 0 and row["seeded_identical"] == 0, row["greedy_first_differences"]


def test_vllm_style_uniform_weights_fail_the_same_check(uniform_tiny):
    """The negative control: vLLM's dummy weights (uniform +-1e-3, norms too) make
    every continuation of a pair identical and the distribution flat."""
    row = sensitivity_row(uniform_tiny)
    assert row["greedy_identical"] == 1 and row["verdict"] == "INSENSITIVE"
    assert row["top1_prob"]["p50"] == pytest.approx(1 / 512, rel=0.01)
    with pytest.raises(AssertionError):
        assert_sensitive(row)


def test_model_dir_cli_writes_seeded_and_refuses_another_seed_in_place(tmp_path, capsys):
    from frmps_engine import cli

    def run(argv):
        return cli.model_dir(cli.build_parser().parse_args(argv))

    out = str(tmp_path / "t")
    assert run(["model-dir", "tiny", "--out", out, "--weights", "seeded", "--seed", "7"]) == 0
    assert json.load(open(os.path.join(out, "frmps_weights.json")))["seed"] == 7
    assert run(["model-dir", "tiny", "--out", out, "--weights", "seeded", "--seed", "7"]) == 0  # kept
    assert run(["model-dir", "tiny", "--out", out, "--weights", "seeded", "--seed", "8"]) == 2
    assert "use --force" in capsys.readouterr().err
    assert run(["model-dir", "tiny", "--out", out, "--weights", "seeded", "--seed", "8", "--force"]) == 0
    assert json.load(open(os.path.join(out, "frmps_weights.json")))["seed"] == 8


def test_default_directories_keep_weights_apart(monkeypatch, tmp_path):
    from frmps_engine import modeldir

    monkeypatch.setenv("FRMPS_MODEL_CACHE", str(tmp_path))
    assert modeldir.default_dir("qwen2.5-7b") == str(tmp_path / "qwen2.5-7b")
    assert modeldir.default_dir("qwen2.5-7b", "seeded", 3) == str(tmp_path / "qwen2.5-7b-seeded-3")
