"""A model directory's configuration as the vLLM adapter reads it, and the
weights pool's size from it: the parameter tensors vLLM builds for a
Llama-family decoder, per tensor-parallel rank."""

from __future__ import annotations

import json
import os
from typing import Any


def hf_config(model: str) -> dict:
    path = os.path.join(model, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as exc:
        raise ValueError(f"model directory {model!r} has no readable config.json: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from exc


def tokenizer_config(model: str) -> dict | None:
    """The model directory's tokenizer_config.json (None without one): vLLM caps
    the context length with its model_max_length."""
    try:
        with open(os.path.join(model, "tokenizer_config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_DECODERS = {"Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM"}
# transformers' defaults (its config classes) for fields a config.json may leave
# out, as vLLM then sees them: every decoder here defaults to untied embeddings;
# the position count differs by architecture.
_DEFAULT_POSITIONS = {"Qwen2ForCausalLM": 32768, "Qwen3ForCausalLM": 32768, "LlamaForCausalLM": 2048,
                      "MistralForCausalLM": 4096 * 32}


def cfg_field(cfg: dict, name: str, default: Any = None) -> Any:
    """A config.json field with JSON null read as absent, as transformers reads it
    (it writes null for unset optional fields: num_key_value_heads, head_dim).
    The fields the formulas read are top-level in what transformers 4 and 5
    write alike; only RoPE moved (rope_parameters), which the formulas do not read."""
    v = cfg.get(name)
    return default if v is None else v


def weight_tensors(cfg: dict, dtype: str, allocated: bool = False, tp: int = 1) -> list[int]:
    """Bytes of each parameter tensor of a Llama-family decoder (Qwen2/Qwen3/
    Llama/Mistral), in vLLM's construction order (vllm/model_executor/models/
    qwen2.py: embed_tokens; per layer qkv_proj, o_proj, mlp, two norms; norm;
    lm_head). Vocabulary-sized tensors are padded to 64 rows, as
    VocabParallelEmbedding does. ``allocated``: every tensor vLLM allocates,
    including a tied lm_head's own weight, which ParallelLMHead creates before
    tie_weights replaces it (qwen2.py:480-487) and whose memory then stays
    cached in the pool's MemPool. ``tp``: one rank's shard of a tensor-parallel
    group, as vLLM's parallel layers split it (vocabulary rows and attention heads
    and MLP columns divided by ``tp``, KV heads too or one replicated per rank when
    there are fewer than ranks, norms whole: layers/vocab_parallel_embedding.py,
    layers/linear.py QKVParallelLinear)."""
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in _DECODERS:
        raise ValueError(f"architecture {arch} has no frmps weights-pool formula yet (known: {sorted(_DECODERS)})")
    nb = DTYPE_BYTES[dtype]
    h, i, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    v = -(-cfg["vocab_size"] // 64) * 64
    heads = cfg["num_attention_heads"]
    kvh = cfg_field(cfg, "num_key_value_heads", heads)
    hd = cfg_field(cfg, "head_dim") or h // heads
    if tp < 1 or heads % tp or i % tp or v % tp or (kvh >= tp and kvh % tp) or (kvh < tp and tp % kvh):
        raise ValueError(f"tensor parallel size {tp} does not divide the model ({heads} heads, {kvh} KV heads, "
                         f"intermediate {i}, vocabulary {v})")
    heads, kvh, i, v = heads // tp, max(1, kvh // tp), i // tp, v // tp
    per_layer = [h * (heads + 2 * kvh) * hd]  # fused qkv (vLLM's QKVParallelLinear)
    if arch == "Qwen2ForCausalLM":
        per_layer.append((heads + 2 * kvh) * hd)  # Qwen2 has q/k/v biases
    per_layer.append(heads * hd * h)  # o_proj
    if arch == "Qwen3ForCausalLM":
        per_layer += [hd, hd]  # q_norm, k_norm
    per_layer += [2 * i * h, i * h, h, h]  # fused gate_up, down, two RMSNorms
    tensors = [v * h] + per_layer * L + [h]
    if allocated or not cfg_field(cfg, "tie_word_embeddings", False):
        tensors.append(v * h)
    return [n * nb for n in tensors]


def weight_bytes(cfg: dict, dtype: str) -> int:
    """Parameter bytes of a Llama-family decoder, each tensor padded to the
    512 bytes torch's caching allocator rounds every block to."""
    return sum(-(-n // 512) * 512 for n in weight_tensors(cfg, dtype))


def weights_pool_bytes(cfg: dict, dtype: str, tp: int = 1) -> int:
    """The weights pool: what vLLM's model loader allocates inside it
    (patches.py, loader-weights-pool), in the segments torch asks for.

    The parameters (and a tied lm_head's discarded weight) as torch's caching
    allocator packs them in construction order (pools.torch_segments_bytes);
    the rotary embedding's cos/sin cache (one buffer, max_position_embeddings x
    head_dim in the model dtype) and its float32 intermediates
    (vllm/model_executor/layers/rotary_embedding/base.py:94-103; freed, but
    their segments stay cached in the pool's MemPool); and one more small
    (2 MiB) and large (20 MiB) segment for what this formula does not list
    (attention scales, loader temporaries). An estimate of vLLM's allocation
    sequence, not a replay of it: the GPU validation logs the bytes actually
    placed (VLLM.md), and a pool that is too small stops the load with
    PoolFull.

    Plus headroom (2 %, at least 64 MiB) for fragmentation: when an allocation
    misses, torch releases its cached free segments and retries, which leaves
    holes in the pool's first-fit carve-out that a large tensor allocated last
    (the lm_head) cannot use: without it, a large lm_head can miss with more than
    its size free in the pool, in pieces."""
    from .pools import TORCH_LARGE_SEGMENT, TORCH_SMALL_SEGMENT, torch_segments_bytes

    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    hd = cfg_field(cfg, "head_dim") or h // heads
    arch = (cfg.get("architectures") or ["?"])[0]
    positions = int(cfg_field(cfg, "max_position_embeddings", _DEFAULT_POSITIONS.get(arch, 0)))
    rope = positions * hd * DTYPE_BYTES[dtype] + positions * hd * 4 * 5 // 2  # cache + cat, freqs, cos, sin (fp32)
    allocated = weight_tensors(cfg, dtype, allocated=True, tp=tp)
    est = torch_segments_bytes(allocated) + rope + TORCH_SMALL_SEGMENT + TORCH_LARGE_SEGMENT
    return est + max(64 << 20, est // 50)
