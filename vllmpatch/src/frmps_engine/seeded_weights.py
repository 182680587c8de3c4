"""A seeded test checkpoint: random weights that behave like a trained model's.

``write_seeded_checkpoint(out_dir, preset, seed)`` writes a Hugging Face
Qwen2ForCausalLM checkpoint (``model.safetensors``, or shards of at most 5 GB
with ``model.safetensors.index.json``) of a preset's shapes in bfloat16, plus
``frmps_weights.json`` naming the generator. Engines load it with their own
loaders: the reference engine, transformers, ``vllm serve DIR``.

Why not all-uniform ("dummy") weights: vLLM's dummy weights (uniform in
+-1e-3, norms included) make every logit ~0, so the next token is uniform and
greedy output ignores the context; weights drawn normal(0, 0.02) with unit norms
depend on the context but give a flat distribution (top-1 probability near
1/vocab), so a seeded sample is decided by the sampler's random numbers. Neither
can show that a KV cache was carried over correctly. The ``trained`` scheme
scales each matrix the way a trained model's are scaled:

- embeddings (and an untied LM head) ``embed_std`` (0.02, Qwen's
  initializer_range);
- q/k/v, gate/up: std ``gain / sqrt(fan_in)``, so their outputs have unit
  scale after the RMSNorm; q and k get ``qk_gain`` (2.0), which makes the
  attention scores' std about qk_gain**2 = 4 (attention picks positions
  instead of averaging them);
- residual-out projections (o_proj, down_proj): ``1 / sqrt(fan_in)`` times
  ``1 / sqrt(2 * layers)`` (GPT-2's depth scaling), so the residual stream grows
  to below unit scale (rms 0.7 after qwen2.5-0.5b's last layer), some 35 times
  the embedding's 0.02: the last hidden state is made by the layers (the
  context), not by the current token's embedding;
- q/k/v biases ``bias_std`` (0.1);
- norm weights ``1 + norm_spread * z`` (0.1);
- the final norm's weights set the logit scale: ``logit_std / (embed_std *
  sqrt(hidden))`` (times 1 + 0.1 z), so the logits' standard deviation over the
  vocabulary is ``logit_std`` (8). The maximum of ~150k such logits stands
  about 4.9 standard deviations out and the gap to the runner-up is about
  logit_std / 4.9 ~ 1.6 nats: a peaked distribution that is not one-hot.

Every value comes from a counter-based hash of (seed, tensor name, element
index) computed with exact integer arithmetic and one rounded multiply-add,
so a tensor's bytes depend neither on the order tensors are written in nor on
the device that computes them (CUDA when available, else the CPU). A normal
variate is the centred, scaled sum of the hash's four bytes (Irwin-Hall, |z| <=
3.46, steps of 0.007 standard deviations): close to Gaussian and exact on every
device.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

GENERATOR = "frmps-seeded"
VERSION = 1
# A shard holds at most this many bytes (Hugging Face's default max_shard_size "5GB").
MAX_SHARD_BYTES = 5 * 10**9
WEIGHTS_JSON = "frmps_weights.json"
M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Scheme:
    """How each kind of tensor is drawn (see the module docstring)."""

    name: str = "trained"
    embed_std: float = 0.02
    qk_gain: float = 2.0
    v_gain: float = 1.0
    mlp_gain: float = 1.0
    resid_gain: float = 1.0  # times 1/sqrt(2L)
    bias_std: float = 0.1
    norm_spread: float = 0.1
    logit_std: float = 8.0
    # Baselines (what other runs used): "uniform" draws every tensor, norms
    # included, uniform in +-uniform_bound (vLLM's load_format="dummy"); "normal"
    # draws every matrix, embedding and bias normal(0, normal_std), norms at 1.
    uniform_bound: float = 1e-3
    normal_std: float = 0.02


SCHEMES: dict[str, Scheme] = {
    "trained": Scheme(),
    "uniform": Scheme(name="uniform"),
    "normal": Scheme(name="normal"),
}


def _shape(preset_or_shape: Any):
    from frmps_engine.refengine.config import PRESETS, ConfigError, ModelShape

    if isinstance(preset_or_shape, ModelShape):
        return preset_or_shape
    if isinstance(preset_or_shape, str) and preset_or_shape in PRESETS:
        return PRESETS[preset_or_shape]
    raise ConfigError(f"no model preset {preset_or_shape!r} (known: {', '.join(sorted(PRESETS))})")


def hf_tensors(shape) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor Qwen2ForCausalLM saves, in its order.
    kind: embed, lm_head, q, k, v, q_bias, k_bias, v_bias, o, gate, up, down, norm, final_norm."""
    H, I, V = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    q, kv = shape.q_size, shape.kv_size
    out: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (V, H), "embed")]
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (q, H), "q"),
            (p + "self_attn.q_proj.bias", (q,), "q_bias"),
            (p + "self_attn.k_proj.weight", (kv, H), "k"),
            (p + "self_attn.k_proj.bias", (kv,), "k_bias"),
            (p + "self_attn.v_proj.weight", (kv, H), "v"),
            (p + "self_attn.v_proj.bias", (kv,), "v_bias"),
            (p + "self_attn.o_proj.weight", (H, q), "o"),
            (p + "mlp.gate_proj.weight", (I, H), "gate"),
            (p + "mlp.up_proj.weight", (I, H), "up"),
            (p + "mlp.down_proj.weight", (H, I), "down"),
            (p + "input_layernorm.weight", (H,), "norm"),
            (p + "post_attention_layernorm.weight", (H,), "norm"),
        ]
    out.append(("model.norm.weight", (H,), "final_norm"))
    if not shape.tie_word_embeddings:
        out.append(("lm_head.weight", (V, H), "lm_head"))
    return out


def tensor_law(kind: str, tshape: tuple[int, ...], shape, scheme: Scheme) -> tuple[str, float, float]:
    """(law, centre, scale) of a tensor: law "normal" (centre + scale * z) or
    "uniform" (centre + uniform in +-scale)."""
    if scheme.name == "uniform":
        return "uniform", 0.0, scheme.uniform_bound
    if scheme.name == "normal":
        if kind in ("norm", "final_norm"):
            return "normal", 1.0, 0.0
        return "normal", 0.0, scheme.normal_std
    if scheme.name != "trained":
        raise ValueError(f"unknown weight scheme {scheme.name!r} (known: {', '.join(SCHEMES)})")
    H, L = shape.hidden_size, shape.num_layers
    if kind in ("embed", "lm_head"):
        return "normal", 0.0, scheme.embed_std
    if kind in ("q", "k"):
        return "normal", 0.0, scheme.qk_gain / math.sqrt(H)
    if kind == "v":
        return "normal", 0.0, scheme.v_gain / math.sqrt(H)
    if kind in ("gate", "up"):
        return "normal", 0.0, scheme.mlp_gain / math.sqrt(H)
    if kind in ("o", "down"):
        return "normal", 0.0, scheme.resid_gain / math.sqrt(tshape[1]) / math.sqrt(2 * L)
    if kind.endswith("_bias"):
        return "normal", 0.0, scheme.bias_std
    if kind == "norm":
        return "normal", 1.0, scheme.norm_spread
    if kind == "final_norm":
        g = scheme.logit_std / (scheme.embed_std * math.sqrt(H))
        return "normal", g, g * scheme.norm_spread
    raise ValueError(f"unknown tensor kind {kind!r}")


def tensor_keys(seed: int, name: str) -> tuple[int, int]:
    """Two 32-bit keys of one tensor, from (seed, name) alone."""
    d = hashlib.sha256(f"{GENERATOR}-v{VERSION}/{int(seed)}/{name}".encode()).digest()
    return int.from_bytes(d[:4], "little"), int.from_bytes(d[4:8], "little")


def _mix32_np(x):
    """lowbias32, a 32-bit integer finaliser, in place on a numpy uint32 array (wraps mod 2**32)."""
    import numpy as np

    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x2C1B3C6D)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x297A2D39)
    x ^= x >> np.uint32(15)
    return x


def _mix32_torch(x: torch.Tensor) -> torch.Tensor:
    """The same finaliser on int64 values in [0, 2**32), in place: multipliers below
    2**31 keep every product inside int64, so the arithmetic is exact on every device."""
    x.bitwise_xor_(x >> 16).mul_(0x7FEB352D).bitwise_and_(M32)
    x.bitwise_xor_(x >> 15).mul_(0x2C1B3C6D).bitwise_and_(M32)
    x.bitwise_xor_(x >> 16).mul_(0x297A2D39).bitwise_and_(M32)
    return x.bitwise_xor_(x >> 15)


def _values(h, law: str, centre: float, scale: float, xp: str):
    """Float64 values of one 32-bit hash per element (numpy uint32 or torch int64):
    uniform: centre + scale * (2 (h + 1/2) / 2**32 - 1); normal: centre + scale * z,
    z the centred sum of h's four bytes (Irwin-Hall, variance 4 (256**2 - 1) / 12)."""
    if law == "uniform":
        v = (h.astype("float64") if xp == "np" else h.double()) * (2.0 * scale / 2**32)
        v += scale / 2**32 - scale
        return v + centre if centre else v
    if law != "normal":
        raise ValueError(f"unknown law {law!r}")
    if xp == "np":
        import numpy as np

        b = (h & np.uint32(255)).astype(np.int32)
        b += (h >> np.uint32(8)) & np.uint32(255)
        b += (h >> np.uint32(16)) & np.uint32(255)
        b += h >> np.uint32(24)
        v = (b - 510).astype(np.float64)
    else:
        v = ((h & 255) + ((h >> 8) & 255) + ((h >> 16) & 255) + (h >> 24) - 510).double()
    v *= scale / IH_STD
    return v + centre if centre else v


IH_STD = math.sqrt(4 * (256**2 - 1) / 12)  # std of the sum of four uniform bytes


@torch.no_grad()
def draw(n: int, keys: tuple[int, int], law: str, centre: float, scale: float,
         device: str | torch.device = "cpu") -> torch.Tensor:
    """n values of a law as a bfloat16 tensor on ``device``: a pure function of
    (n, keys, law, centre, scale). Element i is drawn from the hash
    mix32(mix32(i ^ k1) ^ k2). On the CPU the hash runs in numpy uint32 (fast);
    elsewhere in torch int64 (exact): the same integers, then the same IEEE
    double operations, rounded to float32, then to bfloat16."""
    if n > M32:
        raise ValueError(f"tensor of {n} elements is too large for the generator's 32-bit counter")
    dev = torch.device(device)
    out = torch.empty(n, dtype=torch.bfloat16, device=dev)
    k1, k2 = keys
    if dev.type == "cpu":
        import numpy as np

        chunk = 1 << 16  # stays in cache
        for start in range(0, n, chunk):
            m = min(chunk, n - start)
            h = np.arange(start, start + m, dtype=np.uint32)
            h ^= np.uint32(k1)
            _mix32_np(h)
            h ^= np.uint32(k2)
            _mix32_np(h)
            v = _values(h, law, centre, scale, "np").astype(np.float32)
            out[start:start + m].copy_(torch.from_numpy(v))
        return out
    chunk = 1 << 24
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        h = torch.arange(start, start + m, dtype=torch.int64, device=dev).bitwise_xor_(k1)
        _mix32_torch(h).bitwise_xor_(k2)
        _mix32_torch(h)
        out[start:start + m].copy_(_values(h, law, centre, scale, "torch").float())
        del h
    return out


def checkpoint_bytes(preset_or_shape: Any) -> int:
    """Bytes of the bfloat16 tensors a checkpoint holds."""
    return sum(math.prod(s) * 2 for _, s, _ in hf_tensors(_shape(preset_or_shape)))


def plan_shards(tensors: list[tuple[str, tuple[int, ...], str]], max_bytes: int = MAX_SHARD_BYTES) -> list[list[int]]:
    """Indices of the tensors of each shard: in order, a new shard when the next tensor would pass max_bytes."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, s, _) in enumerate(tensors):
        b = math.prod(s) * 2
        if shards[-1] and size + b > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += b
    return shards


def write_seeded_checkpoint(out_dir: str, preset_or_shape: Any, seed: int = 0, *, scheme: str | Scheme = "trained",
                            device: str | torch.device | None = None, max_shard_bytes: int = MAX_SHARD_BYTES,
                            log: Callable[[str], None] | None = None) -> dict:
    """Write the seeded checkpoint of a preset (or a refengine ModelShape) into
    ``out_dir`` (created if needed): the safetensors file(s), the index when
    sharded, and frmps_weights.json. Generates on ``device`` (default: CUDA when
    available, else the CPU), one shard in host memory at a time. Returns what
    frmps_weights.json holds (plus the seconds taken)."""
    from safetensors.torch import save_file

    shape = _shape(preset_or_shape)
    sch = SCHEMES[scheme] if isinstance(scheme, str) else scheme
    if isinstance(scheme, str) and scheme not in SCHEMES:
        raise ValueError(f"unknown weight scheme {scheme!r} (known: {', '.join(SCHEMES)})")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    t0 = time.monotonic()
    os.makedirs(out_dir, exist_ok=True)
    tensors = hf_tensors(shape)
    shards = plan_shards(tensors, max_shard_bytes)
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map: dict[str, str] = {}
    total = 0
    for fname, idxs in zip(files, shards):
        shard: dict[str, torch.Tensor] = {}
        for i in idxs:
            name, tshape, kind = tensors[i]
            law, centre, scale = tensor_law(kind, tshape, shape, sch)
            numel = math.prod(tshape)
            t = draw(numel, tensor_keys(seed, name), law, centre, scale, dev)
            shard[name] = t.view(tshape).cpu()
            del t
            weight_map[name] = fname
            total += numel * 2
        save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
        os.chmod(os.path.join(out_dir, fname), 0o644)  # readable like the directory's other files
        del shard
        if log:
            log(f"wrote {fname} ({len(idxs)} tensors) at {time.monotonic() - t0:.1f} s")
    if n > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
            f.write("\n")
    desc = describe(shape, seed, sch)
    desc["files"] = files
    desc["total_bytes"] = total
    with open(os.path.join(out_dir, WEIGHTS_JSON), "w", encoding="utf-8") as f:
        json.dump(desc, f, indent=2, sort_keys=True)
        f.write("\n")
    desc["seconds"] = round(time.monotonic() - t0, 2)
    desc["device"] = str(dev)
    return desc


def describe(shape, seed: int, scheme: Scheme) -> dict:
    """frmps_weights.json: the generator, its version, seed and scales (the laws per tensor kind)."""
    kinds = {}
    for name, tshape, kind in hf_tensors(shape):
        if kind not in kinds:  # every layer draws a kind alike
            law, centre, scale = tensor_law(kind, tshape, shape, scheme)
            kinds[kind] = {"law": law, "centre": centre, "scale": scale}
    return {
        "generator": GENERATOR,
        "version": VERSION,
        "seed": int(seed),
        "scheme": asdict(scheme),
        "dtype": "bfloat16",
        "laws": kinds,
        "normal": "Irwin-Hall: centred sum of the four bytes of mix32(mix32(index ^ k1) ^ k2), scaled to unit variance",
        "keys": "sha256(f'frmps-seeded-v{version}/{seed}/{tensor name}')[:8] -> two 32-bit keys",
    }


def read_description(model_dir: str) -> dict | None:
    """frmps_weights.json of a directory, or None if it has none."""
    try:
        with open(os.path.join(model_dir, WEIGHTS_JSON), encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
