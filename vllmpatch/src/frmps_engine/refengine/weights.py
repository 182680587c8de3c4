"""Parameter views into the weights pool, dummy initialisation and safetensors loading."""

from __future__ import annotations

import glob
import os

import torch

from .config import ConfigError, EngineConfig, ParamSpec, kv_cache_shape, param_specs, rank_pools

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightsError(ValueError):
    pass


def check_pools(cfg: EngineConfig, pools: dict, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights and KV pools of one tensor-parallel rank, checked against pool_layout(cfg)."""
    out = []
    for spec in rank_pools(cfg, rank):
        t = pools.get((spec.tag, spec.index))
        if t is None:
            raise ConfigError(f"pool {spec.tag}/{spec.index} missing (have {sorted(pools)})")
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
            raise ConfigError(f"pool {spec.tag}/{spec.index} must be a contiguous 1-D uint8 tensor")
        if t.numel() < spec.size:
            raise ConfigError(f"pool {spec.tag}/{spec.index} has {t.numel()} bytes, layout needs {spec.size}")
        want = torch.device(cfg.device)
        if t.device.type != want.type:
            raise ConfigError(f"pool {spec.tag}/{spec.index} is on {t.device}, engine device is {cfg.device}")
        out.append(t)
    return out[0], out[1]


def param_views(cfg: EngineConfig, pool: torch.Tensor) -> dict[str, torch.Tensor]:
    dt = TORCH_DTYPES[cfg.dtype]
    views = {}
    for p in param_specs(cfg):
        nbytes = p.numel * cfg.dtype_bytes
        views[p.name] = pool[p.offset : p.offset + nbytes].view(dt).view(p.shape)
    return views


def kv_views(cfg: EngineConfig, pool: torch.Tensor) -> torch.Tensor:
    """[layers, 2, num_blocks, block_size, kv_heads, head_dim] view of the KV pool."""
    shape = kv_cache_shape(cfg)
    n = 1
    for s in shape:
        n *= s
    return pool[: n * cfg.dtype_bytes].view(TORCH_DTYPES[cfg.dtype]).view(shape)


def shard(cfg: EngineConfig, name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the unsharded parameter ``full`` (a view or a copy)."""
    n = cfg.tensor_parallel_size
    if n == 1:
        return full
    s = cfg.shape
    if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
        q, kv = cfg.local_heads * s.head_dim, cfg.local_kv_heads * s.head_dim
        fq, fkv = s.q_size, s.kv_size
        return torch.cat([full[rank * q:(rank + 1) * q], full[fq + rank * kv:fq + (rank + 1) * kv],
                          full[fq + fkv + rank * kv:fq + fkv + (rank + 1) * kv]])
    if name.endswith("gate_up_proj.weight"):
        i, fi = cfg.local_intermediate, s.intermediate_size
        return torch.cat([full[rank * i:(rank + 1) * i], full[fi + rank * i:fi + (rank + 1) * i]])
    if name.endswith("o_proj.weight"):
        q = cfg.local_heads * s.head_dim
        return full[:, rank * q:(rank + 1) * q]
    if name.endswith("down_proj.weight"):
        i = cfg.local_intermediate
        return full[:, rank * i:(rank + 1) * i]
    return full  # embedding, norms, LM head: whole on every rank


@torch.no_grad()
def init_dummy(cfg: EngineConfig, params: dict[str, torch.Tensor], rank: int = 0) -> None:
    """Seeded random weights. Each tensor has its own generator seeded from
    (cfg.seed, its index), so the result does not depend on load order. The
    generator is the device's own (Philox on CUDA, MT19937 on the CPU): the same
    seed gives different weights on CPU and GPU. With tensor parallelism each rank
    draws the whole tensor and keeps its shard, so a sharded model holds exactly
    the unsharded model's weights (and every rank's are fixed by (seed, rank))."""
    std = cfg.shape.init_std
    dev = torch.device(cfg.device)
    full_specs = param_specs(cfg.full())
    for i, spec in enumerate(param_specs(cfg)):
        t = params[spec.name]
        if spec.kind == "norm":
            t.fill_(1.0)
            continue
        g = torch.Generator(device=dev)
        g.manual_seed((cfg.seed * 1_000_003 + i) & 0x7FFFFFFFFFFFFFFF)
        if cfg.tensor_parallel_size == 1:
            t.normal_(0.0, std, generator=g)
            continue
        full = torch.empty(full_specs[i].shape, dtype=t.dtype, device=dev)
        full.normal_(0.0, std, generator=g)
        t.copy_(shard(cfg, spec.name, full, rank))
        del full


def _hf_targets(cfg: EngineConfig) -> dict[str, tuple[str, int, int]]:
    """HF tensor name -> (our parameter, first row, row count)."""
    s = cfg.shape
    q, kv, inter = s.q_size, s.kv_size, s.intermediate_size
    m: dict[str, tuple[str, int, int]] = {
        "model.embed_tokens.weight": ("embed_tokens", 0, s.vocab_size),
        "model.norm.weight": ("norm", 0, s.hidden_size),
    }
    if not s.tie_word_embeddings:
        m["lm_head.weight"] = ("lm_head", 0, s.vocab_size)
    for i in range(s.num_layers):
        hf, us = f"model.layers.{i}.", f"layers.{i}."
        m[hf + "input_layernorm.weight"] = (us + "input_layernorm", 0, s.hidden_size)
        m[hf + "post_attention_layernorm.weight"] = (us + "post_attention_layernorm", 0, s.hidden_size)
        for j, (name, rows) in enumerate((("q_proj", q), ("k_proj", kv), ("v_proj", kv))):
            start = (0, q, q + kv)[j]
            m[hf + f"self_attn.{name}.weight"] = (us + "qkv_proj.weight", start, rows)
            if s.qkv_bias:
                m[hf + f"self_attn.{name}.bias"] = (us + "qkv_proj.bias", start, rows)
        m[hf + "self_attn.o_proj.weight"] = (us + "o_proj.weight", 0, s.hidden_size)
        m[hf + "mlp.gate_proj.weight"] = (us + "gate_up_proj.weight", 0, inter)
        m[hf + "mlp.up_proj.weight"] = (us + "gate_up_proj.weight", inter, inter)
        m[hf + "mlp.down_proj.weight"] = (us + "down_proj.weight", 0, s.hidden_size)
    return m


@torch.no_grad()
def load_safetensors(cfg: EngineConfig, params: dict[str, torch.Tensor], directory: str, rank: int = 0) -> None:
    """Load a Hugging Face checkpoint into params (rank ``rank``'s shard of it)."""
    if cfg.tensor_parallel_size == 1:
        _load_full(cfg, params, directory)
        return
    # Sharded: load each whole parameter on the host, keep this rank's part.
    full_cfg = cfg.full()
    dt = TORCH_DTYPES[cfg.dtype]
    full = {p.name: torch.empty(p.shape, dtype=dt) for p in param_specs(full_cfg)}
    _load_full(full_cfg, full, directory)
    for name, t in params.items():
        t.copy_(shard(cfg, name, full.pop(name), rank))


@torch.no_grad()
def _load_full(cfg: EngineConfig, params: dict[str, torch.Tensor], directory: str) -> None:
    try:
        from safetensors import safe_open
    except ImportError as e:  # pragma: no cover
        raise WeightsError("the 'safetensors' package is needed to load weights") from e
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise WeightsError(f"no *.safetensors files in {directory!r}")
    targets = _hf_targets(cfg)
    done: set[str] = set()
    for f in files:
        try:
            with safe_open(f, framework="pt", device="cpu") as st:
                for name in st.keys():
                    tgt = targets.get(name)
                    if tgt is None:
                        if name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq"):
                            continue  # tied head / recomputed buffers
                        raise WeightsError(f"{os.path.basename(f)}: unexpected tensor {name!r}")
                    pname, start, rows = tgt
                    src = st.get_tensor(name)
                    dst = params[pname].narrow(0, start, rows)
                    if tuple(src.shape) != tuple(dst.shape):
                        raise WeightsError(
                            f"{os.path.basename(f)}: {name} has shape {tuple(src.shape)}, model expects {tuple(dst.shape)}"
                        )
                    dst.copy_(src.to(dst.dtype))
                    done.add(name)
        except WeightsError:
            raise
        except Exception as e:  # safetensors raises its own error types
            raise WeightsError(f"read {f!r}: {e}") from e
    missing = sorted(set(targets) - done)
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightsError(f"weights in {directory!r} lack {', '.join(missing[:5])}{more}")


def specs(cfg: EngineConfig) -> list[ParamSpec]:
    return param_specs(cfg)
