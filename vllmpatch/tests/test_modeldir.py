"""`frmps model init` / frmps_engine.modeldir: a preset's model directory that
the reference engine and vLLM both read (vLLM's side: tests/vllm/test_engine.py)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

pytestmark = pytest.mark.torch  # the preset shapes come from the reference engine's config


@pytest.fixture(scope="module")
def q05(tmp_path_factory):
    from frmps_engine import modeldir

    return modeldir.write("qwen2.5-0.5b", str(tmp_path_factory.mktemp("models") / "q05"))


def test_config_is_the_presets_shape(q05):
    from frmps_engine.refengine.config import PRESETS, shape_from_hf_config

    shape = shape_from_hf_config(q05)
    want = PRESETS["qwen2.5-0.5b"]
    for f in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size",
              "tie_word_embeddings", "rope_theta", "rms_norm_eps", "max_position_embeddings", "head_dim"):
        assert getattr(shape, f) == getattr(want, f), f
    cfg = json.load(open(os.path.join(q05, "config.json")))
    assert (cfg["architectures"], cfg["model_type"], cfg["eos_token_id"]) == (["Qwen2ForCausalLM"], "qwen2", 151645)


def test_every_id_of_the_vocabulary_decodes_and_specials_sit_at_qwens_ids(q05):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(q05, "tokenizer.json"))
    vocab = json.load(open(os.path.join(q05, "config.json")))["vocab_size"]
    assert tok.get_vocab_size(with_added_tokens=True) == vocab
    assert [i for i in range(vocab) if tok.id_to_token(i) is None] == []
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>")] == [
        151643, 151644, 151645, 151657]
    text = "Hello, world! Grüße 你好 2024\n\tindent"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert max(ids) < 151643 and len(ids) < len(text.encode())  # merges apply
    assert tok.decode(ids) == text
    # A random model samples any id: every one decodes to text (specials skipped).
    assert isinstance(tok.decode(list(range(151600, vocab))), str)


def test_reference_engine_and_transformers_agree_on_the_directory(q05):
    from transformers import AutoTokenizer

    from frmps_engine.refengine import EngineConfig, load_tokenizer

    cfg = EngineConfig.from_preset(q05)
    assert cfg.model_dir == q05 and cfg.weights == "dummy"
    ours = load_tokenizer(q05)
    hf = AutoTokenizer.from_pretrained(q05)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there, 123!"}]
    hf_ids = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ours.apply_chat_template(msgs) == list(hf_ids)
    assert ours.eos_token_id == hf.eos_token_id == 151645
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    rendered = hf.apply_chat_template([{"role": "user", "content": "weather?"}], tools=tools,
                                      add_generation_prompt=True, tokenize=False)
    assert "<tools>" in rendered and '"get_weather"' in rendered and rendered.endswith("<|im_start|>assistant\n")


# A conversation with tools: the tools in the system turn, an assistant's calls
# (arguments as the SDK hands them over: JSON values, decoded from OpenAI's
# strings), results of two calls in one user turn.
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather, °C.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "description": None, "parameters": None}}]
TOOL_CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "Weather and time in Zürich?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
                    {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "21"},
    {"role": "tool", "tool_call_id": "c2", "name": "get_time", "content": "noon"},
    {"role": "assistant", "content": "21 °C at noon."},
    {"role": "user", "content": "Thanks"},
]


def test_reference_engine_renders_tools_as_the_directorys_template(q05):
    """The reference engine's ChatML (refengine.tokenizer.chatml) renders tools,
    tool calls and tool results as the directory's chat template does through
    transformers (what the vLLM adapter runs): same text, same ids, with and
    without a system message."""
    from transformers import AutoTokenizer

    from frmps_engine.refengine import load_tokenizer
    from frmps_engine.refengine.tokenizer import chatml

    ours = load_tokenizer(q05)
    hf = AutoTokenizer.from_pretrained(q05)
    for msgs in (TOOL_CHAT, TOOL_CHAT[1:]):
        for tools in (TOOLS, None):
            for agp in (True, False):
                want = hf.apply_chat_template(msgs, tools=tools, add_generation_prompt=agp, tokenize=False)
                assert chatml(msgs, agp, tools) == want
                ids = hf.apply_chat_template(msgs, tools=tools, add_generation_prompt=agp, tokenize=True)["input_ids"]
                assert ours.apply_chat_template(msgs, agp, tools=tools) == list(ids)
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n" in chatml(TOOL_CHAT, True, TOOLS)


def test_writes_are_deterministic_and_keep_an_existing_directory(tmp_path, q05):
    from frmps_engine import modeldir

    again = modeldir.write("qwen2.5-0.5b", str(tmp_path / "again"))
    for name in sorted(os.listdir(q05)):
        assert open(os.path.join(q05, name), "rb").read() == open(os.path.join(again, name), "rb").read(), name
    marker = os.path.join(again, "config.json")
    os.utime(marker, (1, 1))
    assert modeldir.write("qwen2.5-0.5b", again) == again and os.stat(marker).st_mtime == 1  # kept
    modeldir.write("qwen2.5-0.5b", again, force=True)
    assert os.stat(marker).st_mtime != 1
    (tmp_path / "junk").mkdir()
    with pytest.raises(FileExistsError, match="not a model directory"):
        modeldir.write("qwen2.5-0.5b", str(tmp_path / "junk"))
    with pytest.raises(ValueError, match="no model directory preset 'tiny'"):
        modeldir.config_json("tiny")
    # A seeded checkpoint of a test preset has a directory (the reference engine's
    # tests), Qwen's specials right after its regular tokens.
    tiny = modeldir.config_json("tiny", test_presets=True)
    assert (tiny["vocab_size"], tiny["bos_token_id"], tiny["eos_token_id"]) == (512, 490, 492)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".frmps-model-")]  # no temporaries left


def test_frmps_model_init_writes_into_the_cache(tmp_path):
    """The CLI a user runs: `frmps model init PRESET` prints the directory it wrote."""
    frmps = os.environ.get("FRMPS_BIN")
    if not frmps:
        pytest.skip("FRMPS_BIN (the built frmps binary) is not set")
    env = dict(os.environ, FRMPS_MODEL_CACHE=str(tmp_path / "cache"))
    import sys

    env["FRMPS_PYTHON"] = sys.executable
    out = subprocess.run([frmps, "model", "init", "qwen2.5-1.5b"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    path = out.stdout.strip()
    assert path == str(tmp_path / "cache" / "qwen2.5-1.5b")
    assert json.load(open(os.path.join(path, "config.json")))["hidden_size"] == 1536
    bad = subprocess.run([frmps, "model", "init", "qwen9"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "no model directory preset 'qwen9'" in bad.stderr
