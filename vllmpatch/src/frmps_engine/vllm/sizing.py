"""How big the KV cache of a vLLM deployment is when ``--num-blocks`` is not given,
and the engine defaults ``vllm serve`` would use (VLLM.md, "Sizing").

``vllm serve`` gives the KV cache what is left of ``gpu_memory_utilization`` x
the GPU's memory once its one engine has loaded the weights and profiled a step
of ``max_num_batched_tokens`` tokens (vllm/v1/worker/gpu_worker.py,
determine_available_memory). frmps runs two engines on the GPU, plus MPS's
server: the fraction covers all of them. The weights and the KV cache are
shared pools the active allocates and the standby maps (no second copy); each
engine has its own CUDA context, activations and CUDA graphs.

frmps must fix the block count before the active builds vLLM: the active
announces its pools (and the block count) in its Hello, allocates them, and
only then builds vLLM in them. So the non-KV memory is estimated, not profiled:
the weights pool exactly (its layout), the rest from the model's shape and the
batch limits (``activation_bytes``) plus documented per-engine reserves. After
the build the active logs what it really uses next to the estimate
(``measured_line``).

Everything here is a pure function of its arguments (the tests feed it fake
memory figures); engine.py gathers the real ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GiB = 1 << 30
MiB = 1 << 20

# Per engine: its CUDA context, cuBLAS/cuDNN workspaces and what else lives
# outside torch's allocator: a CUDA 12/13 context with torch's libraries loaded,
# and what a standby holds beyond it outside torch's allocator (VLLM.md has the
# figures). 1 GiB covers both with room.
ENGINE_CONTEXT_BYTES = 1 * GiB
# Per engine: vLLM's CUDA graphs (piecewise, up to 512 tokens by default; vLLM's
# own profile_cudagraph_memory estimate is a few hundred MiB at 7B-14B).
ENGINE_GRAPHS_BYTES = 1 * GiB
# The MPS server's own context on the GPU (frmps's private daemon).
MPS_SERVER_BYTES = 512 * MiB
# torch rounds each layer's KV allocation up to whole 2 MiB segments
# (pools.torch_segments_bytes): room for that per layer.
KV_SEGMENT_SLACK = 2 * MiB

# vLLM's batch defaults for `vllm serve` (the OpenAI API server's usage context),
# EngineArgs.get_batch_defaults (0.26.0 engine/arg_utils.py:2437-2512; the same in
# 0.33.0): a GPU of >= 70 GiB that is not an A100 gets 1,024 sequences and 8,192
# batched tokens, any other GPU 256 and 2,048; vLLM's CPU platform 128 x and
# 2,048 x the world size.
LARGE_GPU_BYTES = 70 * GiB


def serve_batch_defaults(device_memory: int, device_name: str, *, cpu: bool = False,
                         world_size: int = 1) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) as ``vllm serve`` picks them."""
    if cpu:
        return 128 * world_size, 2048 * world_size
    if device_memory >= LARGE_GPU_BYTES and "a100" not in device_name.lower():
        return 1024, 8192
    return 256, 2048


_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                 "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")


def model_max_len(hf: dict, tokenizer_config: dict | None = None) -> int:
    """The context length vLLM derives for a model when none is given
    (vllm/config/model.py _get_and_verify_max_len and
    ModelArchConfigConvertor.derive_max_model_len_and_key): the smallest of the
    config's length keys (model_max_length wins where set), capped by the
    tokenizer's model_max_length, times a RoPE scaling factor (yarn: from its
    original_max_position_embeddings; su/longrope/llama3: no factor; longrope
    defaults to original_max_position_embeddings), 2,048 where no key is set."""
    text = hf.get("text_config") or hf
    derived = math.inf
    for key in _MAX_LEN_KEYS:
        v = text.get(key)
        if v is not None:
            derived = min(derived, v)
    if text.get("model_max_length"):
        derived = text["model_max_length"]
    if tokenizer_config and tokenizer_config.get("model_max_length") is not None:
        derived = min(derived, tokenizer_config["model_max_length"])
    if derived == math.inf:
        derived = 2048
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    if rope and "gemma3" not in str(hf.get("model_type", "")):
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type == "longrope":
            return int(text.get("original_max_position_embeddings", derived))
        if rope_type not in ("su", "llama3"):
            factor = rope.get("factor", 1.0) or 1.0
            if rope_type == "yarn":
                derived = rope["original_max_position_embeddings"]
            derived *= factor
    return int(derived)


def activation_bytes(hf: dict, *, max_num_batched_tokens: int, max_num_seqs: int, dtype_bytes: int,
                     tp: int = 1) -> int:
    """One engine's peak of activation memory in vLLM's profile run, estimated
    from the model's shape: the larger of

    - the forward pass over ``max_num_batched_tokens`` tokens: the hidden state
      and residual, the fused qkv, the attention output and the MLP's gate_up and
      its activation (the largest intermediates live at once), twice over for
      what torch.compile's buffers and the allocator's rounding add;
    - the sampler's warm-up on ``min(max_num_seqs, max_num_batched_tokens)`` rows
      of logits over the whole vocabulary: the logits in the model's dtype and in
      float32, top-k/top-p's sorted float32 values and int64 indices, and the
      float32 probabilities (22 bytes a logit).
    """
    h = int(hf["hidden_size"])
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads", heads))
    hd = int(hf.get("head_dim") or h // heads)
    inter = int(hf.get("intermediate_size", 4 * h))
    vocab = int(hf["vocab_size"])
    t = int(max_num_batched_tokens)
    qkv = (heads + 2 * kv_heads) * hd // tp
    per_token = 2 * h + qkv + h + (2 * inter + inter) // tp
    forward = 2 * t * per_token * dtype_bytes
    rows = min(int(max_num_seqs), t)
    sampler = rows * vocab * (dtype_bytes + 4 + 4 + 8 + 4) + t * h * dtype_bytes
    return max(forward, sampler)


@dataclass(frozen=True)
class MemoryReport:
    """What the sizing reads, per GPU (per rank with tensor parallelism)."""

    gpu_total: int  # the GPU's memory (NVML), bytes
    utilization: float  # --gpu-memory-utilization
    weights: int  # the weights pool, bytes (shared by both engines)
    activations: int  # one engine's activation peak (activation_bytes)
    graphs: int = ENGINE_GRAPHS_BYTES  # one engine's CUDA graphs
    context: int = ENGINE_CONTEXT_BYTES  # one engine's CUDA context and workspaces
    mps: int = MPS_SERVER_BYTES  # the MPS server (0 without MPS)
    engines: int = 2  # the active and its standby


@dataclass(frozen=True)
class KVBudget:
    """The sizing's outcome (control.proto KVBudget)."""

    gpu_total_bytes: int
    utilization: float
    budget_bytes: int
    weights_bytes: int
    kv_bytes: int
    num_blocks: int
    block_bytes: int
    reserved_bytes: int
    reserved: dict[str, int] = field(default_factory=dict)  # the reserve by item
    source: str = "estimated"  # "estimated" (sized here) or "--num-blocks"

    def line(self) -> str:
        """The engine's one log line at start."""
        items = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.reserved.items())
        return (f"KV cache: {self.num_blocks} blocks of {self.block_bytes} bytes = {self.kv_bytes / GiB:.2f} GiB "
                f"({self.source}); budget {self.budget_bytes / GiB:.2f} GiB = {self.utilization:g} x "
                f"{self.gpu_total_bytes / GiB:.2f} GiB: weights {self.weights_bytes / GiB:.2f} GiB, "
                f"reserved {self.reserved_bytes / GiB:.2f} GiB ({items or 'none'})")


class SizingError(ValueError):
    """Nothing (or too little) is left for the KV cache."""


def size_kv(report: MemoryReport, *, block_bytes: int, min_blocks: int, layers: int,
            kv_pool_bytes=None) -> KVBudget:
    """The block count that keeps the whole deployment within
    ``utilization x gpu_total``: budget - weights - every engine's context,
    graphs and activations - MPS's server, in whole blocks (less torch's
    per-layer segment rounding). ``kv_pool_bytes(n)``, where given, is the KV
    pool the layout would allocate for n blocks; the count is lowered until it
    fits. Raises SizingError when fewer than ``min_blocks`` (one request of the
    longest context) fit."""
    if not 0 < report.utilization <= 1:
        raise SizingError(f"--gpu-memory-utilization must be in (0, 1], got {report.utilization}")
    if report.gpu_total <= 0 or block_bytes <= 0:
        raise SizingError(f"bad memory figures: GPU {report.gpu_total} bytes, block {block_bytes} bytes")
    budget = int(report.utilization * report.gpu_total)
    reserved = {
        "contexts": report.engines * report.context,
        "activations": report.engines * report.activations,
        "graphs": report.engines * report.graphs,
        "mps": report.mps,
        "kv_rounding": layers * KV_SEGMENT_SLACK,
    }
    reserve = sum(reserved.values())
    room = budget - report.weights - reserve
    blocks = max(0, room // block_bytes)
    if kv_pool_bytes is not None:
        while blocks > 0 and kv_pool_bytes(blocks) > room:
            blocks -= max(1, -(-(kv_pool_bytes(blocks) - room) // block_bytes))
    kv = kv_pool_bytes(blocks) if (kv_pool_bytes is not None and blocks > 0) else blocks * block_bytes
    if blocks < min_blocks:
        items = ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in reserved.items())
        raise SizingError(
            f"no room for the KV cache: --gpu-memory-utilization {report.utilization:g} of the GPU's "
            f"{report.gpu_total / GiB:.2f} GiB is {budget / GiB:.2f} GiB; the weights take "
            f"{report.weights / GiB:.2f} GiB and both engines and MPS {reserve / GiB:.2f} GiB ({items}), "
            f"leaving {max(room, 0) / GiB:.2f} GiB: {blocks} blocks of {block_bytes} bytes, fewer than the "
            f"{min_blocks} one request of the longest context needs. Raise --gpu-memory-utilization, lower "
            f"--max-model-len (or --max-num-seqs / --max-num-batched-tokens: the activations), or give --num-blocks")
    return KVBudget(gpu_total_bytes=report.gpu_total, utilization=report.utilization, budget_bytes=budget,
                    weights_bytes=report.weights, kv_bytes=kv, num_blocks=blocks, block_bytes=block_bytes,
                    reserved_bytes=reserve, reserved=reserved, source="estimated")


def given_blocks(num_blocks: int, *, block_bytes: int, weights: int, kv_bytes: int, gpu_total: int,
                 utilization: float) -> KVBudget:
    """The budget of a deployment whose block count was given (``--num-blocks``):
    reported, not checked (the operator chose it)."""
    budget = int(utilization * gpu_total) if gpu_total > 0 else 0
    return KVBudget(gpu_total_bytes=gpu_total, utilization=utilization, budget_bytes=budget, weights_bytes=weights,
                    kv_bytes=kv_bytes, num_blocks=num_blocks, block_bytes=block_bytes, reserved_bytes=0,
                    reserved={}, source="--num-blocks")


# The ring (ringbuf/FORMAT.md, ring/tracker.py): a record never exceeds a quarter
# of the ring; one request's entry is PAYLOAD_PER_ENTRY bytes plus 4 per block id
# and per token.
def ring_record_bytes(*, max_num_seqs: int, max_model_len: int, block_size: int, kv_tokens: int,
                      entry_bytes: int) -> int:
    """The largest FULL record an engine can publish: up to ``max_num_seqs``
    running requests of up to ``max_model_len`` tokens each, and no more tokens
    in all than the KV cache holds (``kv_tokens``: blocks x block size; a running
    request's tokens all have KV), plus one partial block per request."""
    tokens = min(max_num_seqs * max_model_len, kv_tokens + max_num_seqs * block_size)
    blocks = min(max_num_seqs * -(-max_model_len // block_size), kv_tokens // block_size + max_num_seqs)
    return max_num_seqs * entry_bytes + 4 * (tokens + blocks)
