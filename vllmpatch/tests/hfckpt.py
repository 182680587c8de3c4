"""A small Qwen2 checkpoint written by transformers itself, for tests that check
what an engine serves against transformers' own output.

``write_checkpoint`` builds ``Qwen2ForCausalLM(Qwen2Config(...))`` with
normal(0, 0.1) weights (norm weights 1), saves it with ``save_pretrained``
(safetensors, the config.json transformers writes: transformers 5 puts the RoPE
base in ``rope_parameters``), then adds the project's byte-level tokenizer
(frmps_engine.modeldir) so the directory is a complete model directory.
``style="t4"`` rewrites config.json the way transformers 4 wrote it (top-level
``rope_theta``, ``rope_scaling: null``, ``torch_dtype``).

``hf_greedy`` is transformers' greedy ``generate`` on the saved directory
(loaded back with ``from_pretrained``, float32, end-of-sequence ignored).
"""

from __future__ import annotations

import json
import os
from typing import Any

# Small, but every field a real Qwen2.5 config has that the engines read; the RoPE
# base is Qwen2.5's (1e6), not transformers' default 10,000, so that a reader that
# misses it serves a different model.
# At this size greedy continuations vary (smaller ones settle on one repeated token).
SHAPE: dict[str, Any] = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                             intermediate_size=256, vocab_size=512, max_position_embeddings=4096, rms_norm_eps=1e-6)
ROPE_THETA = 1_000_000.0
PROMPTS = ("hello world, the quick brown fox", "frmps keeps serving through faults", "1 2 3 4 5 6 7 8 9")


def write_checkpoint(out: str, *, style: str = "t5", tie: bool = True, dtype: str = "float32", seed: int = 0,
                     rope_theta: float = ROPE_THETA, **shape: Any) -> str:
    import torch
    import transformers

    from frmps_engine import modeldir

    if style not in ("t5", "t4"):
        raise ValueError(f"style {style!r}: want t5 or t4")
    conf = transformers.Qwen2Config(
        **{**SHAPE, **shape}, tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        bos_token_id=None, eos_token_id=None,
    )
    conf.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(conf)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.1)
    model = model.to(getattr(torch, dtype))
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)  # safetensors
    if style == "t4":
        path = os.path.join(out, "config.json")
        with open(path) as f:
            raw = json.load(f)
        rp = raw.pop("rope_parameters")
        raw["rope_theta"], raw["rope_scaling"] = rp["rope_theta"], None
        raw["torch_dtype"] = raw.pop("dtype", dtype)
        raw.pop("layer_types", None)
        raw["transformers_version"] = "4.43.1"
        with open(path, "w") as f:
            json.dump(raw, f, indent=2)
    vocab = (shape.get("vocab_size") or SHAPE["vocab_size"])
    files = {
        "tokenizer.json": modeldir.tokenizer_json(vocab),
        "tokenizer_config.json": json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": SHAPE["max_position_embeddings"],
            "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
            "clean_up_tokenization_spaces": False, "split_special_tokens": False,
            "chat_template": modeldir.CHAT_TEMPLATE}),
    }
    for name, text in files.items():
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            f.write(text)
    return out


def tokenize(model_dir: str, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).encode(text, add_special_tokens=False).ids


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy continuation of each prompt (token ids), float32 on the CPU."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            got = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(got[0, len(ids):].tolist())
    return out
