"""Model shapes, engine configuration and the shared-pool layout.

The pool layout is a pure function of the configuration: the active and the
standby derive it independently and the supervisor checks that they agree, so
nothing here may depend on the process, the machine or the clock.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A model or engine configuration that cannot be used."""


@dataclass(frozen=True)
class ModelShape:
    """Qwen2-architecture hyper-parameters (names follow Hugging Face's config.json)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    head_dim: int = 0  # 0: hidden_size // num_heads
    qkv_bias: bool = True
    # Standard deviation of the "dummy" random weights.
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"model shape: {name} must be a positive integer, got {v!r}")
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ConfigError(
                    f"model shape: hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model shape: num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"model shape: head_dim {self.head_dim} must be even for RoPE")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


_QWEN_COMMON: dict[str, Any] = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=32768)

PRESETS: dict[str, ModelShape] = {
    "qwen2.5-0.5b": ModelShape(896, 24, 14, 2, 4864, 151936, True, **_QWEN_COMMON),
    "qwen2.5-1.5b": ModelShape(1536, 28, 12, 2, 8960, 151936, True, **_QWEN_COMMON),
    "qwen2.5-3b": ModelShape(2048, 36, 16, 2, 11008, 151936, True, **_QWEN_COMMON),
    "qwen2.5-7b": ModelShape(3584, 28, 28, 4, 18944, 152064, False, **_QWEN_COMMON),
    "qwen2.5-14b": ModelShape(5120, 48, 40, 8, 13824, 152064, False, **_QWEN_COMMON),
    # Test models: byte-level tokenizer friendly (vocab >= 259), larger init so
    # that greedy choices are well separated.
    "tiny": ModelShape(64, 2, 4, 2, 128, 512, True, rope_theta=10_000.0, max_position_embeddings=4096, init_std=0.1),
    "tiny-untied": ModelShape(
        64, 2, 4, 2, 128, 512, False, rope_theta=10_000.0, max_position_embeddings=4096, init_std=0.1
    ),
    "small": ModelShape(256, 4, 8, 2, 704, 1024, True, max_position_embeddings=8192, init_std=0.05),
}


class _Presets:
    """Names accepted by EngineConfig.from_preset besides a model directory.
    Call it for a sorted list (`presets()`), or use it as a container (`name in presets`)."""

    def __call__(self) -> list[str]:
        return sorted(PRESETS)

    def __iter__(self):
        return iter(sorted(PRESETS))

    def __contains__(self, name: object) -> bool:
        return name in PRESETS

    def __len__(self) -> int:
        return len(PRESETS)

    def __getitem__(self, name: str) -> ModelShape:
        return PRESETS[name]

    def __repr__(self) -> str:
        return f"presets({', '.join(sorted(PRESETS))})"


presets = _Presets()


# RoPE variants the engine implements: the plain rotary embedding only.
_ROPE_TYPES = ("default",)
# Checkpoint dtypes the loader converts from (to the engine's dtype).
_CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")


def _given(raw: dict, name: str, default: Any = None) -> Any:
    """A config field, with JSON null read as absent (transformers writes null
    for unset optional fields, e.g. num_key_value_heads, head_dim)."""
    v = raw.get(name)
    return default if v is None else v


def rope_from_hf_config(raw: dict) -> tuple[float, str]:
    """(rope_theta, rope_type) as transformers reads them, from either form it has
    written. transformers 5 writes ``rope_parameters: {"rope_theta": ...,
    "rope_type": "default"}``; transformers 4 wrote a top-level ``rope_theta`` and
    ``rope_scaling`` (null, or a dict with ``type`` or ``rope_type``). transformers
    5 reads the dict from ``rope_scaling`` if set, else ``rope_parameters``; the
    base from that dict, else the top-level ``rope_theta``, else 10,000; the type
    from ``rope_type``, else ``type``, else "default"
    (modeling_rope_utils.RotaryEmbeddingConfigMixin). A dict nested by layer type
    (``{"full_attention": {...}, ...}``) must name one RoPE for all layers.
    Raises ConfigError for a RoPE the engine does not implement (scaled RoPE:
    linear, dynamic, yarn, llama3, longrope, ...; a partial rotary factor)."""
    rp = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(rp, dict):
        raise ConfigError(f"rope_parameters/rope_scaling must be an object, got {rp!r}")
    layer_types = raw.get("layer_types") or ()
    nested = [k for k in rp if k in layer_types]
    if nested:
        ropes = [rp[k] for k in nested if rp[k] is not None]
        if any(r != ropes[0] for r in ropes):
            raise ConfigError(f"rope_parameters differ between layer types ({', '.join(nested)}): "
                              "the engine applies one RoPE to every layer")
        rp = ropes[0] if ropes else {}
        if not isinstance(rp, dict):
            raise ConfigError(f"rope_parameters of a layer type must be an object, got {rp!r}")
    theta = rp.get("rope_theta")
    if theta is None:
        theta = _given(raw, "rope_theta", 10000.0)
    rope_type = rp.get("rope_type") or rp.get("type") or "default"
    if rope_type not in _ROPE_TYPES:
        raise ConfigError(f"RoPE type {rope_type!r} ({rp}) is not implemented by the reference engine "
                          f"(only {', '.join(_ROPE_TYPES)}): serving it with plain RoPE would give wrong outputs")
    partial = rp.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise ConfigError(f"partial_rotary_factor {partial} is not implemented by the reference engine (only 1.0)")
    theta = float(theta)
    if not theta > 0:
        raise ConfigError(f"rope_theta must be positive, got {theta}")
    return theta, str(rope_type)


def _sliding_layers(raw: dict, num_layers: int) -> list[int]:
    """The layers that attend through a sliding window, as transformers' Qwen2
    reads the config (models/qwen2/configuration_qwen2.py): none unless
    ``use_sliding_window`` and ``sliding_window`` are set; then the layers
    ``layer_types`` marks "sliding_attention", or (no layer_types, as transformers
    4 wrote it) layers from ``max_window_layers`` (default 28) on."""
    if not raw.get("use_sliding_window") or raw.get("sliding_window") is None:
        return []
    layer_types = raw.get("layer_types")
    if layer_types:
        return [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    return list(range(int(_given(raw, "max_window_layers", 28)), num_layers))


def shape_from_hf_config(model_dir: str) -> ModelShape:
    """Read a Hugging Face Qwen2 config.json from a model directory, as
    transformers 5 writes it (``rope_parameters``, ``dtype``, ``layer_types``)
    and as transformers 4 did (``rope_theta``, ``rope_scaling``, ``torch_dtype``).
    Fields the engine cannot honour (scaled RoPE, an active sliding window, an
    activation other than SiLU, a quantized checkpoint) are refused here rather
    than served wrongly. Absent fields take transformers' Qwen2Config defaults
    where the engine has them (num_key_value_heads: num_attention_heads;
    rms_norm_eps 1e-6; max_position_embeddings 32768; tie_word_embeddings false);
    the sizes themselves must be given."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"model directory {model_dir!r} has no config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"read model config {path!r}: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"model config {path!r}: expected a JSON object")
    archs = raw.get("architectures") or []
    mtype = raw.get("model_type")
    if mtype not in (None, "qwen2") and not any(str(a).startswith("Qwen2") for a in archs):
        raise ConfigError(f"model config {path!r}: model_type {mtype!r} is not supported (only qwen2)")
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        layers = int(raw["num_hidden_layers"])
        act = _given(raw, "hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not implemented by the reference engine (only silu)")
        if raw.get("quantization_config"):
            raise ConfigError("quantized checkpoints are not supported by the reference engine "
                              f"(quantization_config {raw['quantization_config']})")
        # transformers 5 writes "dtype", transformers 4 "torch_dtype": the checkpoint's
        # dtype, which the loader converts to the engine's own (EngineConfig.dtype).
        ckpt_dtype = _given(raw, "dtype", _given(raw, "torch_dtype"))
        if ckpt_dtype is not None and ckpt_dtype not in _CHECKPOINT_DTYPES:
            raise ConfigError(f"checkpoint dtype {ckpt_dtype!r} is not supported (use one of {', '.join(_CHECKPOINT_DTYPES)})")
        rope_theta, _ = rope_from_hf_config(raw)
        positions = int(_given(raw, "max_position_embeddings", 32768))
        sliding = _sliding_layers(raw, layers)
        if sliding and int(raw["sliding_window"]) < positions:
            raise ConfigError(
                f"sliding-window attention (window {raw['sliding_window']} on layers {sliding[0]}..{sliding[-1]}) "
                "is not implemented by the reference engine: serving it with full attention would give wrong outputs")
        # Qwen2 always has q/k/v biases and no o_proj bias (transformers'
        # Qwen2Attention hard-codes them; an attention_bias field is not read).
        return ModelShape(
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(_given(raw, "num_key_value_heads", heads)),
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            tie_word_embeddings=bool(_given(raw, "tie_word_embeddings", False)),
            rope_theta=rope_theta,
            rms_norm_eps=float(_given(raw, "rms_norm_eps", 1e-6)),
            max_position_embeddings=positions,
            head_dim=int(_given(raw, "head_dim", 0)),
        )
    except KeyError as e:
        raise ConfigError(f"model config {path!r}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise ConfigError(f"model config {path!r}: {e}") from None
        raise ConfigError(f"model config {path!r}: bad value: {e}") from None


_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "half": "float16"}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# Pool sizes are rounded up to the CUDA VMM allocation granularity so that the
# cuda-vmm backend can map them as-is; offsets inside the weights pool are
# aligned for vectorised loads.
POOL_ALIGN = 2 << 20
TENSOR_ALIGN = 256
NULL_BLOCK = 0  # block 0 is never handed out: padded rows of CUDA-graph batches write there


@dataclass(frozen=True)
class EngineConfig:
    model: str
    shape: ModelShape
    device: str = "cpu"
    dtype: str = "float32"
    num_blocks: int = 256
    block_size: int = 16
    max_model_len: int = 2048
    weights: str = "dummy"  # "dummy" or a directory with *.safetensors
    model_dir: str | None = None  # for tokenizer.json
    seed: int = 0
    max_num_seqs: int = 64
    # Token budget of one step (chunked prefill splits prompts to fit).
    max_num_batched_tokens: int = 512
    # CPU: pad GEMMs to >= 16 rows so every row is computed by the same kernel,
    # which makes results independent of batch composition (see README).
    batch_invariant: bool = True
    cuda_graphs: bool = True
    # Detokenize outputs (RequestOutput.text). Under frmps's SDK the generation
    # service makes the text from the token ids itself, so the adapter turns this
    # off: the engine then decodes only requests with stop strings, and a takeover
    # does not replay every delivered token through the detokenizer.
    text_outputs: bool = True
    # "triton" (paged decode kernel) or "torch" (gather blocks + SDPA).
    attention: str = "triton"
    # Exact mode (GPU default): every token's KV and logits come from a pass whose
    # shapes depend only on that request, so a standby that resumes a request
    # reproduces it bit for bit. Decode steps always run at one batch size
    # (max_num_seqs, padded); prefill runs one request per pass in chunks aligned
    # to max_num_batched_tokens; tokens after the last sync are replayed by
    # decode steps, never folded into a prefill. See README ("Exact mode").
    exact: bool = False
    # A standby reuses the KV named by the snapshot (frmps's point). False is the
    # ablation: every adopted token is recomputed.
    kv_reuse: bool = True
    # Tensor parallelism: the model is sharded over this many ranks (one process
    # and one device each; README "Tensor parallelism"). Every pool, shape and
    # offset below is one rank's; pool_layout lists the pools of every rank.
    tensor_parallel_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @staticmethod
    def from_preset(
        name: str,
        device: str = "cpu",
        num_blocks: int | None = None,
        block_size: int = 16,
        max_model_len: int | None = None,
        dtype: str | None = None,
        weights: str | None = None,
        seed: int = 0,
        **kw: Any,
    ) -> "EngineConfig":
        """A preset name, or a model directory (config.json, tokenizer.json, *.safetensors)."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"model must be a preset name or a directory, got {name!r}")
        model_dir = None
        if name in PRESETS:
            shape = PRESETS[name]
        elif os.path.isdir(name):
            shape = shape_from_hf_config(name)
            model_dir = name
        else:
            raise ConfigError(f"unknown model {name!r}: not a directory and not a preset ({', '.join(presets())})")
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            raise ConfigError(f"device must be 'cpu' or 'cuda', got {device!r}")
        on_gpu = device != "cpu"
        dt = _DTYPES.get(dtype or ("bfloat16" if on_gpu else "float32"))
        if dt is None:
            raise ConfigError(f"dtype {dtype!r} not supported ({', '.join(sorted(set(_DTYPES.values())))})")
        if block_size <= 0 or block_size & (block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {block_size}")
        mml = max_model_len if max_model_len is not None else min(shape.max_position_embeddings, 4096 if on_gpu else 2048)
        if mml <= 0 or mml > shape.max_position_embeddings:
            raise ConfigError(
                f"max_model_len {mml} out of range (1..{shape.max_position_embeddings} for {name!r})"
            )
        if num_blocks is None:
            # Room for a few full-length sequences plus the reserved null block.
            num_blocks = 4 * math.ceil(mml / block_size) + 1
        if num_blocks < 2:
            raise ConfigError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if weights is None:
            from frmps_engine.modeldir import has_weights

            try:
                weights = model_dir if model_dir and has_weights(model_dir) else "dummy"
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if weights != "dummy" and not os.path.isdir(weights):
            raise ConfigError(f"weights must be 'dummy' or a directory with safetensors, got {weights!r}")
        defaults: dict[str, Any] = {}
        if on_gpu:
            defaults.update(max_num_seqs=256, max_num_batched_tokens=2048, batch_invariant=False, exact=True)
        else:
            defaults.update(cuda_graphs=False, attention="torch")
        defaults.update(kw)
        cfg = EngineConfig(
            model=name, shape=shape, device=device, dtype=dt, num_blocks=int(num_blocks), block_size=block_size,
            max_model_len=int(mml), weights=weights, model_dir=model_dir, seed=int(seed), **defaults,
        )
        cfg.validate()
        return cfg

    def replace(self, **kw: Any) -> "EngineConfig":
        cfg = dataclasses.replace(self, **kw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ConfigError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.attention not in ("triton", "torch"):
            raise ConfigError(f"attention must be 'triton' or 'torch', got {self.attention!r}")
        if self.dtype not in _DTYPE_BYTES:
            raise ConfigError(f"dtype {self.dtype!r} not supported")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        if tp > 1:
            s = self.shape
            for what, n in (("num_heads", s.num_heads), ("num_kv_heads", s.num_kv_heads),
                            ("intermediate_size", s.intermediate_size)):
                if n % tp:
                    raise ConfigError(f"tensor_parallel_size {tp} does not divide the model's {what} ({n}): "
                                      "each rank holds an equal share")
        if self.exact:
            if self.max_num_seqs > 512:
                raise ConfigError(f"exact mode decodes at one batch size: max_num_seqs must be <= 512, got {self.max_num_seqs}")

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def max_blocks_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)

    @property
    def local_heads(self) -> int:
        """Query heads of one tensor-parallel rank."""
        return self.shape.num_heads // self.tensor_parallel_size

    @property
    def local_kv_heads(self) -> int:
        """KV heads of one tensor-parallel rank (its share of the KV cache)."""
        return self.shape.num_kv_heads // self.tensor_parallel_size

    @property
    def local_intermediate(self) -> int:
        return self.shape.intermediate_size // self.tensor_parallel_size

    def full(self) -> "EngineConfig":
        """The same model unsharded (tensor_parallel_size 1): the reference that
        shards are cut from."""
        return self if self.tensor_parallel_size == 1 else dataclasses.replace(self, tensor_parallel_size=1)

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one KV block across all layers (K and V) on one rank."""
        s = self.shape
        return s.num_layers * 2 * self.block_size * self.local_kv_heads * s.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class PoolSpec:
    tag: str  # "weights" | "kv_cache"
    index: int
    size: int  # bytes


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    offset: int  # bytes into the weights pool
    kind: str  # "matrix" | "bias" | "norm" | "embedding"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def param_specs(cfg: EngineConfig) -> list[ParamSpec]:
    """Every parameter of one rank with its byte offset in that rank's weights pool
    (q/k/v and gate/up fused). With tensor parallelism q/k/v and gate/up are split
    by heads and rows (column-parallel), o_proj and down_proj by columns
    (row-parallel); embedding, norms and LM head are whole on every rank."""
    s = cfg.shape
    H, I = s.hidden_size, cfg.local_intermediate
    q, kv = cfg.local_heads * s.head_dim, cfg.local_kv_heads * s.head_dim
    items: list[tuple[str, tuple[int, ...], str]] = [("embed_tokens", (s.vocab_size, H), "embedding")]
    for i in range(s.num_layers):
        p = f"layers.{i}."
        items += [
            (p + "input_layernorm", (H,), "norm"),
            (p + "qkv_proj.weight", (q + 2 * kv, H), "matrix"),
        ]
        if s.qkv_bias:
            items.append((p + "qkv_proj.bias", (q + 2 * kv,), "bias"))
        items += [
            (p + "o_proj.weight", (H, q), "matrix"),
            (p + "post_attention_layernorm", (H,), "norm"),
            (p + "gate_up_proj.weight", (2 * I, H), "matrix"),
            (p + "down_proj.weight", (H, I), "matrix"),
        ]
    items.append(("norm", (H,), "norm"))
    if not s.tie_word_embeddings:
        items.append(("lm_head", (s.vocab_size, H), "matrix"))
    out, off = [], 0
    for name, shp, kind in items:
        out.append(ParamSpec(name, shp, off, kind))
        off += _round_up(math.prod(shp) * cfg.dtype_bytes, TENSOR_ALIGN)
    return out


def weights_bytes(cfg: EngineConfig) -> int:
    """Bytes of parameters proper (no alignment padding): what one decode step must read."""
    return sum(p.numel for p in param_specs(cfg)) * cfg.dtype_bytes


def kv_cache_shape(cfg: EngineConfig) -> tuple[int, ...]:
    """One rank's KV cache: its share of the KV heads, every block (block ids are
    the same on every rank)."""
    s = cfg.shape
    return (s.num_layers, 2, cfg.num_blocks, cfg.block_size, cfg.local_kv_heads, s.head_dim)


def pool_layout(cfg: EngineConfig) -> list[PoolSpec]:
    """The shared pools, in a fixed order: weights then kv_cache of rank 0, then of
    rank 1, ...; a pool's index is its rank (the pools of rank r live on its device)."""
    specs = param_specs(cfg)
    last = specs[-1]
    wsize = _round_up(last.offset + last.numel * cfg.dtype_bytes, POOL_ALIGN)
    kv = _round_up(math.prod(kv_cache_shape(cfg)) * cfg.dtype_bytes, POOL_ALIGN)
    out: list[PoolSpec] = []
    for rank in range(cfg.tensor_parallel_size):
        out += [PoolSpec("weights", rank, wsize), PoolSpec("kv_cache", rank, kv)]
    return out


def rank_pools(cfg: EngineConfig, rank: int) -> list[PoolSpec]:
    """The pools of one rank: its weights and its KV cache."""
    return [p for p in pool_layout(cfg) if p.index == rank]


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


# torch gives every (cuBLAS handle, stream) pair a workspace: 32 MiB by default on
# Hopper. A standby holds its workspace for as long as it lives; 4 MiB is what cuBLAS
# documents as enough for pre-Hopper GPUs, and on the H100 the engine's GEMMs were not
# slower with it (bench/gpu/workspace_speed.py; results in bench/results/). Active and
# standby must agree (cuBLAS picks kernels knowing the workspace size), so it is set the
# same way in every engine process, and a value already in the environment wins.
CUBLAS_WORKSPACE_DEFAULT = ":4096:1"


def apply_cuda_env(device: str) -> None:
    """Call before the process's first cuBLAS call (torch reads the variable once)."""
    import os

    if str(device).startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_DEFAULT)
