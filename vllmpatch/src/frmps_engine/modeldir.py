"""A Hugging Face model directory for a preset, for dummy-weight runs.

``frmps model init qwen2.5-7b`` (or ``python -m frmps_engine.cli model-dir``)
writes what vLLM and the reference engine both read from a model directory:

- ``config.json``: the real Qwen2.5 configuration of the preset's size
  (architecture, shapes, RoPE, norms, vocabulary, special token ids);
- ``generation_config.json``;
- ``tokenizer.json``: a byte-level BPE tokenizer built here with the
  ``tokenizers`` library, whose ids cover the model's whole vocabulary (a
  model with random weights samples any id, and every id must decode): the
  256 byte symbols, then merges of byte pairs and triples up to Qwen2.5's
  151,643 regular tokens, then Qwen2.5's special tokens at their real ids
  (``<|endoftext|>`` 151643, ``<|im_start|>`` 151644, ``<|im_end|>`` 151645,
  ...), then reserved special tokens up to ``vocab_size``;
- ``tokenizer_config.json`` with a ChatML chat template (Qwen2.5's format,
  tools included) and ``special_tokens_map.json``.

By default no weights are written: engines initialise them at random (vLLM's
``load_format="dummy"``, the reference engine's dummy weights). With
``weights="seeded"`` (``frmps model init PRESET --weights seeded [--seed N]``)
the directory also holds a seeded safetensors checkpoint whose weights are
scaled like a trained model's (frmps_engine/seeded_weights.py): a peaked,
context-dependent next-token distribution, which the exactness checks need.
The output is a pure function of the preset (and seed), so two runs write the
same bytes. A directory a user already has (real weights, real tokenizer) is
used unchanged. With seeded weights the reference engine's test presets (tiny,
...) get the same files at their size, Qwen's special tokens right after their
regular tokens.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

# Qwen2.5's added tokens, in id order from 151643 (special: skipped when decoding).
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False),
)
QWEN_REGULAR_TOKENS = 151643
QWEN_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML, as Qwen2.5 formats chats: an optional system turn (with the tool
# list when tools are given), tool calls as <tool_call>{json}</tool_call> in
# assistant turns, tool results as <tool_response> in user turns.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{- (tool_call.arguments if tool_call.arguments is string else tool_call.arguments | tojson) }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def config_json(preset: str, *, test_presets: bool = False) -> dict[str, Any]:
    """Qwen2.5's config.json for a preset (the shapes are the reference engine's
    presets, which are the released Qwen2.5 models' config.json values). With
    ``test_presets`` (seeded checkpoints only) the reference engine's test presets
    (tiny, ...) too: the same fields at their shapes, their special tokens right
    after their regular ones (as tokenizer_json places them)."""
    from frmps_engine.refengine.config import PRESETS

    names = sorted(n for n in PRESETS if test_presets or n.startswith("qwen2.5-"))
    if preset not in names:
        raise ValueError(f"no model directory preset {preset!r} (known: {', '.join(names)})")
    q = PRESETS[preset]
    first_special = regular_tokens(q.vocab_size)
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": first_special,
        "eos_token_id": first_special + 2,
        "hidden_act": "silu",
        "hidden_size": q.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": q.intermediate_size,
        "max_position_embeddings": q.max_position_embeddings,
        "max_window_layers": q.num_layers,
        "model_type": "qwen2",
        "num_attention_heads": q.num_heads,
        "num_hidden_layers": q.num_layers,
        "num_key_value_heads": q.num_kv_heads,
        "rms_norm_eps": q.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": q.rope_theta,
        "sliding_window": 131072,
        "tie_word_embeddings": q.tie_word_embeddings,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.43.1",  # as released; transformers 5 reads it to skip a Mistral-only fix
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": q.vocab_size,
    }


def regular_tokens(vocab_size: int) -> int:
    """Regular (non-special) tokens of a vocabulary: Qwen2.5's 151,643, or fewer
    where the vocabulary is smaller (room left for Qwen's added tokens)."""
    return min(QWEN_REGULAR_TOKENS, vocab_size - len(QWEN_ADDED_TOKENS))


def byte_alphabet() -> list[str]:
    """GPT-2's byte-level symbols, in byte order (what ByteLevel pre-tokenization emits)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def tokenizer_json(vocab_size: int, regular: int = QWEN_REGULAR_TOKENS) -> str:
    """A byte-level BPE tokenizer.json with ids 0..vocab_size-1 all defined.

    Regular tokens: the 256 byte symbols, then every byte pair (in byte
    order), then byte triples (pair + byte) until ``regular`` tokens; each
    merged token has the one merge that makes it, ranked in id order. Then the
    added tokens of Qwen2.5 and reserved specials up to ``vocab_size``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = list(QWEN_ADDED_TOKENS)
    regular = min(regular, regular_tokens(vocab_size))
    if regular < 256:
        raise ValueError(f"vocabulary of {vocab_size} is too small for a byte-level tokenizer with Qwen's specials")
    alphabet = byte_alphabet()
    vocab: dict[str, int] = {s: i for i, s in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    pairs = ((a, b) for a in alphabet for b in alphabet)
    triples = ((a + b, c) for a in alphabet for b in alphabet for c in alphabet)
    for left, right in itertools.chain(pairs, triples):
        if len(vocab) >= regular:
            break
        tok = left + right
        if tok in vocab:
            continue
        vocab[tok] = len(vocab)
        merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    # Qwen2's pre-tokenization: its split pattern, then byte-level symbols.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(s, special=special, normalized=False) for s, special in specials]
    reserved = vocab_size - regular - len(specials)
    added += [AddedToken(f"<|frmps_reserved_{i}|>", special=True, normalized=False) for i in range(max(0, reserved))]
    tok.add_tokens([a for a in added if not a.special])
    tok.add_special_tokens([a for a in added if a.special])
    # add_tokens/add_special_tokens assign ids in call order; put them back in Qwen's order.
    data = json.loads(tok.to_str())
    ids = {s: regular + i for i, (s, _) in enumerate(specials)}
    for i in range(max(0, reserved)):
        ids[f"<|frmps_reserved_{i}|>"] = regular + len(specials) + i
    for entry in data["added_tokens"]:
        entry["id"] = ids[entry["content"]]
    data["added_tokens"].sort(key=lambda e: e["id"])
    return json.dumps(data, ensure_ascii=False, sort_keys=True)


WEIGHTS = ("none", "seeded")


def write(preset: str, out: str, *, force: bool = False, weights: str = "none", seed: int = 0,
          log: Callable[[str], None] | None = None) -> str:
    """Write the model directory of ``preset`` to ``out`` (atomically: a
    temporary sibling renamed into place). An existing ``out`` is kept unless
    ``force``; returns ``out``.

    weights="seeded" also writes the seeded checkpoint of that size
    (frmps_engine.seeded_weights, seed ``seed``). An existing directory is then
    kept only if it holds that checkpoint (same generator version and seed)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    # The test presets (tiny, ...) get directories only with seeded weights: without
    # weights the reference engine's own presets (byte tokenizer) serve them.
    cfg = config_json(preset, test_presets=weights == "seeded")
    out = os.path.abspath(out)
    if os.path.exists(out) and not force:
        if not os.path.isfile(os.path.join(out, "config.json")):
            raise FileExistsError(f"{out} exists and is not a model directory")
        if weights == "seeded":
            from frmps_engine import seeded_weights

            have = seeded_weights.read_description(out)
            if not have or have.get("version") != seeded_weights.VERSION or have.get("seed") != int(seed) \
                    or have.get("scheme", {}).get("name") != "trained":
                what = (f"seeded weights of seed {have.get('seed')} (version {have.get('version')})" if have
                        else "no seeded weights")
                raise FileExistsError(f"{out} exists with {what}; use --force to rewrite it with seed {seed}")
        return out
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".frmps-model-", dir=parent)
    try:
        first_special = regular_tokens(cfg["vocab_size"])
        note = (
            f"# {preset} (dummy weights)\n\nWritten by `frmps model init {preset}`: Qwen2.5's configuration of this "
            "size and a byte-level BPE tokenizer built locally that covers the whole vocabulary. There are no "
            "weights: engines initialise them at random, so outputs are not meaningful text.\n"
        )
        if weights == "seeded":
            note = (
                f"# {preset} (seeded weights, seed {seed})\n\nWritten by `frmps model init {preset} --weights seeded "
                f"--seed {seed}`: Qwen2.5's configuration of this size, a byte-level BPE tokenizer built locally that "
                "covers the whole vocabulary, and a seeded random checkpoint whose weights are scaled like a trained "
                "model's (frmps_weights.json: the generator and its scales). Its next-token distribution is peaked and "
                "depends on the context, so greedy and seeded outputs check that the KV cache is right; the text is "
                "not meaningful.\n"
            )
        files = {
            "config.json": json.dumps(cfg, indent=2, sort_keys=True),
            "generation_config.json": json.dumps(
                {"bos_token_id": first_special, "eos_token_id": [first_special + 2, first_special], "do_sample": False},
                indent=2, sort_keys=True,
            ),
            "tokenizer.json": tokenizer_json(cfg["vocab_size"]),
            "tokenizer_config.json": json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "model_max_length": cfg["max_position_embeddings"],
                    "bos_token": None,
                    "eos_token": "<|im_end|>",
                    "pad_token": "<|endoftext|>",
                    "unk_token": None,
                    "clean_up_tokenization_spaces": False,
                    "split_special_tokens": False,
                    "chat_template": CHAT_TEMPLATE,
                },
                indent=2, sort_keys=True,
            ),
            "special_tokens_map.json": json.dumps(
                {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                 "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]},
                indent=2, sort_keys=True,
            ),
            "FRMPS_MODEL.md": note,
        }
        for name, text in files.items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                f.write(text + ("\n" if not text.endswith("\n") else ""))
        if weights == "seeded":
            from frmps_engine import seeded_weights

            seeded_weights.write_seeded_checkpoint(tmp, preset, seed, log=log)
        if force and os.path.isdir(out):
            import shutil

            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def has_weights(model_dir: str) -> bool:
    """Whether a model directory holds a checkpoint the engines load: True with
    ``*.safetensors`` files, False with no weights files at all (a directory
    :func:`write` made: dummy weights). A directory holding only PyTorch pickles
    (``*.bin``, ``*.pt``, ``*.pth``) raises ValueError: the engines load
    safetensors only, and serving random weights in their place would be the
    silent kind of wrong."""
    try:
        names = os.listdir(model_dir)
    except OSError as e:
        raise ValueError(f"model directory {model_dir!r}: {e}") from e
    if any(n.endswith(".safetensors") for n in names):
        return True
    pickles = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth")))
    if pickles:
        raise ValueError(
            f"model directory {model_dir!r} holds PyTorch weights ({', '.join(pickles[:3])}) but no *.safetensors: "
            "frmps loads safetensors only (convert the checkpoint, e.g. save_pretrained(..., safe_serialization=True)), "
            "or use dummy weights explicitly (--weights dummy)")
    return False


def weights_source(model_dir: str | None, loaded: bool) -> str:
    """What Hello.weights says: ``loaded:<model dir>`` or ``dummy``."""
    return f"loaded:{model_dir}" if loaded and model_dir else "dummy"


def default_dir(preset: str, weights: str = "none", seed: int = 0) -> str:
    """Where ``frmps`` keeps a preset's directory: $FRMPS_MODEL_CACHE, else
    $XDG_CACHE_HOME/frmps/models, else ~/.cache/frmps/models; PRESET for the
    directory without weights, PRESET-seeded-SEED for a seeded checkpoint."""
    base = os.environ.get("FRMPS_MODEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "frmps", "models"
    )
    return os.path.join(base, preset if weights == "none" else f"{preset}-{weights}-{int(seed)}")
