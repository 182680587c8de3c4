"""Loading a model directory in Hugging Face layout: config.json, tokenizer.json, safetensors."""

from __future__ import annotations

import json

import pytest

from e2e import require

torch = require("torch")
pytestmark = pytest.mark.torch
safetensors_torch = require("safetensors.torch")
tokenizers = require("tokenizers")

from frmps_engine.refengine import EngineConfig, RefCore, SamplingParams, WeightsError  # noqa: E402
from frmps_engine.refengine.tokenizer import HFTokenizer, IncrementalDetokenizer  # noqa: E402


def export_hf(core: RefCore, d, drop: str | None = None) -> None:
    """Write core's weights under Hugging Face names (q/k/v and gate/up split again)."""
    s = core.cfg.shape
    p = core.model.params
    out = {"model.embed_tokens.weight": p["embed_tokens"], "model.norm.weight": p["norm"]}
    q, kv, inter = s.q_size, s.kv_size, s.intermediate_size
    for i in range(s.num_layers):
        hf, us = f"model.layers.{i}.", f"layers.{i}."
        w, b = p[us + "qkv_proj.weight"], p[us + "qkv_proj.bias"]
        out[hf + "self_attn.q_proj.weight"], out[hf + "self_attn.k_proj.weight"], out[hf + "self_attn.v_proj.weight"] = (
            w[:q], w[q : q + kv], w[q + kv :])
        out[hf + "self_attn.q_proj.bias"], out[hf + "self_attn.k_proj.bias"], out[hf + "self_attn.v_proj.bias"] = (
            b[:q], b[q : q + kv], b[q + kv :])
        out[hf + "self_attn.o_proj.weight"] = p[us + "o_proj.weight"]
        out[hf + "mlp.gate_proj.weight"] = p[us + "gate_up_proj.weight"][:inter]
        out[hf + "mlp.up_proj.weight"] = p[us + "gate_up_proj.weight"][inter:]
        out[hf + "mlp.down_proj.weight"] = p[us + "down_proj.weight"]
        out[hf + "input_layernorm.weight"] = p[us + "input_layernorm"]
        out[hf + "post_attention_layernorm.weight"] = p[us + "post_attention_layernorm"]
    if drop:
        del out[drop]
    out = {k: v.clone().contiguous() for k, v in out.items()}
    names = sorted(out)
    half = len(names) // 2  # two shards, as real checkpoints come
    safetensors_torch.save_file({k: out[k] for k in names[:half]}, str(d / "model-00001-of-00002.safetensors"))
    safetensors_torch.save_file({k: out[k] for k in names[half:]}, str(d / "model-00002-of-00002.safetensors"))
    s_ = core.cfg.shape
    (d / "config.json").write_text(json.dumps(dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=s_.hidden_size,
        num_hidden_layers=s_.num_layers, num_attention_heads=s_.num_heads, num_key_value_heads=s_.num_kv_heads,
        intermediate_size=s_.intermediate_size, vocab_size=s_.vocab_size, tie_word_embeddings=True,
        rope_theta=s_.rope_theta, rms_norm_eps=s_.rms_norm_eps, max_position_embeddings=s_.max_position_embeddings)))


def write_tokenizer(d) -> None:
    """A small byte-level BPE tokenizer.json with the ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, héllo wörld € 😀 the quick brown fox"] * 20, trainer)
    tok.save(str(d / "tokenizer.json"))


def test_safetensors_round_trip_and_tokenizer(tmp_path):
    cfg = EngineConfig.from_preset("tiny", num_blocks=32)
    src = RefCore(cfg, RefCore.allocate_pools(cfg), True)
    export_hf(src, tmp_path)
    write_tokenizer(tmp_path)
    cfg2 = EngineConfig.from_preset(str(tmp_path), num_blocks=32, max_model_len=512)
    assert cfg2.weights == str(tmp_path) and cfg2.shape.hidden_size == 64
    core = RefCore(cfg2, RefCore.allocate_pools(cfg2), True)
    for name, t in src.model.params.items():
        assert torch.equal(core.model.params[name], t), name
    assert isinstance(core.tokenizer, HFTokenizer)
    tok = core.tokenizer
    assert tok.eos_token_id == tok._tok.token_to_id("<|im_end|>")
    text = "héllo wörld € 😀"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    d = IncrementalDetokenizer(tok)
    assert "".join(d.add(i) for i in ids) + d.flush() == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert chat[0] == tok._tok.token_to_id("<|im_start|>")
    assert tok._tok.decode(chat, skip_special_tokens=False) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert core.generate([(1, chat, sp)]) == src.generate([(1, chat, sp)])


def test_incomplete_checkpoint_is_refused(tmp_path):
    cfg = EngineConfig.from_preset("tiny", num_blocks=32)
    src = RefCore(cfg, RefCore.allocate_pools(cfg), True)
    export_hf(src, tmp_path, drop="model.layers.1.mlp.up_proj.weight")
    cfg2 = EngineConfig.from_preset(str(tmp_path), num_blocks=32, max_model_len=512)
    with pytest.raises(WeightsError, match="lack model.layers.1.mlp.up_proj.weight"):
        RefCore(cfg2, RefCore.allocate_pools(cfg2), True)
    # A standby never reads the weights, so it does not notice.
    RefCore(cfg2, RefCore.allocate_pools(cfg2), False)


def test_wrong_shapes_are_refused(tmp_path):
    cfg = EngineConfig.from_preset("tiny", num_blocks=32)
    export_hf(RefCore(cfg, RefCore.allocate_pools(cfg), True), tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    conf["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(conf))
    cfg2 = EngineConfig.from_preset(str(tmp_path), num_blocks=32, max_model_len=512)
    with pytest.raises(WeightsError, match="has shape"):
        RefCore(cfg2, RefCore.allocate_pools(cfg2), True)
