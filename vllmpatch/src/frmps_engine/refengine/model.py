"""Qwen2 decoder over a paged KV cache, with parameters and KV living in the shared pools.

CPU path: attention per sequence over its gathered blocks, queries grouped by
KV block and padded to a full block, GEMMs padded to >= 16 rows. Every query is
then computed with the same shapes whether it arrives in a prefill chunk, a
decode step, alone or in a batch, so float32 results are bit-identical across
batch compositions (tested).
GPU path: bf16; decode through a Triton paged-attention kernel and CUDA graphs
at bucketed batch sizes; prefill through SDPA over the gathered blocks.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from .config import NULL_BLOCK, EngineConfig
from .weights import TORCH_DTYPES, kv_views, param_views


@dataclass
class SeqChunk:
    q_start: int  # first row of this sequence in the flattened batch
    q_len: int
    start_pos: int  # position of the first query token (= tokens already in the cache)
    block_ids: list[int]


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64, block * block_size + offset
    seqs: list[SeqChunk]
    logits_rows: torch.Tensor  # [n] rows whose logits are wanted
    extra: dict = field(default_factory=dict)


class AllReduce(Protocol):
    """Sums a tensor over the tensor-parallel group, in place (tp.Comm)."""

    def all_reduce(self, t: torch.Tensor) -> None: ...


class Qwen2Model:
    """One rank's shard of the model. With ``comm`` (tensor parallelism) the
    attention heads and MLP columns are this rank's share, and the outputs of
    o_proj and down_proj are summed over the group; only rank 0 computes logits."""

    def __init__(self, cfg: EngineConfig, weights_pool: torch.Tensor, kv_pool: torch.Tensor,
                 comm: AllReduce | None = None, rank: int = 0) -> None:
        self.cfg = cfg
        s = cfg.shape
        self.device = torch.device(cfg.device)
        self.dtype = TORCH_DTYPES[cfg.dtype]
        self.params = param_views(cfg, weights_pool)
        self.kv = kv_views(cfg, kv_pool)  # [L, 2, NB, BS, KVH, HD]
        self.comm = comm
        self.wants_logits = rank == 0
        self.H, self.KVH, self.HD = cfg.local_heads, cfg.local_kv_heads, s.head_dim
        self.q_size, self.kv_size = self.H * self.HD, self.KVH * self.HD
        self.G = self.H // self.KVH
        self.scale = 1.0 / math.sqrt(self.HD)
        self.bs = cfg.block_size
        self.pad_rows = 16 if cfg.batch_invariant else 0
        # Exact mode on a GPU: prefill GEMMs run at power-of-two row counts, so the
        # kernels a standby needs are a small known set it loads at start-up (warm-up)
        # instead of on its first catch-up. Decode (one fixed size) is not padded.
        self.pow2_prefill = cfg.exact and self.device.type == "cuda"
        self._pad_pow2 = False
        self.layers = []
        for i in range(s.num_layers):
            p = f"layers.{i}."
            self.layers.append((
                self.params[p + "input_layernorm"],
                self.params[p + "qkv_proj.weight"],
                self.params.get(p + "qkv_proj.bias"),
                self.params[p + "o_proj.weight"],
                self.params[p + "post_attention_layernorm"],
                self.params[p + "gate_up_proj.weight"],
                self.params[p + "down_proj.weight"],
            ))
        self.embed = self.params["embed_tokens"]
        self.final_norm = self.params["norm"]
        self.lm_head = self.embed if s.tie_word_embeddings else self.params["lm_head"]
        # RoPE tables (private to the process, not shared).
        half = self.HD // 2
        inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, self.HD, 2, dtype=torch.int64).float() / self.HD))
        t = torch.arange(cfg.max_model_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        rope_dtype = torch.float32 if self.dtype == torch.float32 else self.dtype
        # Full-width tables with the sign of rotate_half folded into sin:
        # rope(x) = x * cos + roll(x, half) * sin_signed.
        cos, sin = freqs.cos(), freqs.sin()
        self.cos = torch.cat([cos, cos], -1).to(rope_dtype).to(self.device)
        self.sin = torch.cat([-sin, sin], -1).to(rope_dtype).to(self.device)
        assert self.cos.shape[1] == 2 * half
        if self.device.type == "cuda":
            # cuDNN's SDPA failed at run time on the H100 for masked prefill chunks
            # ("mha_graph.execute ... is_good()"); flash / memory-efficient / math only.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self._triton = None
        interpret = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (tests)
        if cfg.attention == "triton" and (self.device.type == "cuda" or interpret):
            try:
                from .triton_attention import paged_decode
            except ImportError:  # no Triton: gathered-block SDPA, no CUDA graphs
                paged_decode = None
            self._triton = paged_decode
        self.attention_backend = "triton" if self._triton is not None else "torch"

    # ---- building blocks -------------------------------------------------
    def padded_rows(self, n: int) -> int:
        """Rows a GEMM of n rows runs at."""
        if self._pad_pow2:
            return max(16, 1 << max(n - 1, 0).bit_length())
        return max(n, self.pad_rows)

    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        n = x.shape[0]
        m = self.padded_rows(n)
        if m > n:
            xp = x.new_zeros((m, x.shape[1]))
            xp[:n] = x
            return F.linear(xp, w, b)[:n]
        return F.linear(x, w, b)

    def _rmsnorm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        eps = self.cfg.shape.rms_norm_eps
        if self.device.type == "cuda":
            return F.rms_norm(x, (x.shape[-1],), w, eps)  # one fused kernel
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return w * xf.to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as x1*cos - x2*sin | x2*cos + x1*sin (HF's rotate_half form).
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin

    def _reduced(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's partial sums, summed over the group."""
        if self.comm is not None:
            x = x.contiguous()
            self.comm.all_reduce(x)
        return x

    def _run_layers(self, input_ids, positions, slots, attend) -> torch.Tensor:
        T = input_ids.shape[0]
        qs, kvs = self.q_size, self.kv_size
        x = F.embedding(input_ids, self.embed)
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        for li, (ln1, wqkv, bqkv, wo, ln2, wgu, wd) in enumerate(self.layers):
            h = self._rmsnorm(x, ln1)
            qkv = self._linear(h, wqkv, bqkv)
            # q and k are adjacent in the fused projection: rotate both at once.
            qk = self._rope(qkv[:, : qs + kvs].view(T, self.H + self.KVH, self.HD), cos, sin)
            q, k = qk[:, : self.H], qk[:, self.H :]
            v = qkv[:, qs + kvs :].view(T, self.KVH, self.HD)
            kc, vc = self.kv[li, 0], self.kv[li, 1]
            kc.view(-1, self.KVH, self.HD).index_copy_(0, slots, k)
            vc.view(-1, self.KVH, self.HD).index_copy_(0, slots, v)
            o = attend(li, q, kc, vc)
            x = x + self._reduced(self._linear(o.reshape(T, qs), wo))
            h = self._rmsnorm(x, ln2)
            gu = self._linear(h, wgu)
            g, u = gu.chunk(2, dim=-1)
            x = x + self._reduced(self._linear(F.silu(g) * u, wd))
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if not self.wants_logits:  # a tensor-parallel worker: rank 0 samples
            return x.new_empty((x.shape[0], 0), dtype=torch.float32)
        return self._linear(self._rmsnorm(x, self.final_norm), self.lm_head).float()

    # ---- generic (varlen) forward -----------------------------------------
    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits [len(logits_rows), vocab] (float32) for a mixed prefill/decode batch."""
        key_slots = [self._key_slots(sq) for sq in batch.seqs]
        decode_idx = [i for i, sq in enumerate(batch.seqs) if sq.q_len == 1]
        use_kernel = self._triton is not None and decode_idx
        if use_kernel:
            bt, cl = self._tables([batch.seqs[i] for i in decode_idx])
            drows = torch.tensor([batch.seqs[i].q_start for i in decode_idx], device=self.device)
        dset = set(decode_idx) if use_kernel else set()

        # Rows that belong to no sequence pad the batch to a fixed size (exact mode);
        # they attend to nothing and their zero outputs stay in their own rows.
        padded = sum(sq.q_len for sq in batch.seqs) < batch.input_ids.shape[0]

        def attend(li, q, kc, vc):
            shape = (q.shape[0], self.H, self.HD)
            out = torch.zeros(shape, dtype=q.dtype, device=q.device) if padded else torch.empty(shape, dtype=q.dtype, device=q.device)
            if use_kernel:
                out[drows] = self._triton(q[drows].contiguous(), kc, vc, bt, cl, self.scale)
            for i, sq in enumerate(batch.seqs):
                if i in dset:
                    continue
                qs = q[sq.q_start : sq.q_start + sq.q_len]
                if self.device.type == "cuda":
                    out[sq.q_start : sq.q_start + sq.q_len] = self._attn_sdpa(qs, kc, vc, sq, key_slots[i])
                else:
                    out[sq.q_start : sq.q_start + sq.q_len] = self._attn_grouped(qs, kc, vc, sq, key_slots[i])
            return out

        self._pad_pow2 = self.pow2_prefill
        try:
            x = self._run_layers(batch.input_ids, batch.positions, batch.slots, attend)
            return self._logits(x[batch.logits_rows])
        finally:
            self._pad_pow2 = False

    def _key_slots(self, sq: SeqChunk) -> torch.Tensor:
        end = sq.start_pos + sq.q_len
        nb = -(-end // self.bs)
        blocks = torch.tensor(sq.block_ids[:nb], dtype=torch.int64)
        slots = (blocks[:, None] * self.bs + torch.arange(self.bs)[None, :]).reshape(-1)
        return slots.to(self.device)

    def _attn_grouped(self, q, kc, vc, sq: SeqChunk, key_slots) -> torch.Tensor:
        """Queries grouped by KV block; each group attends over the keys up to the
        end of its block (later keys masked) with a query count padded to the block
        size, so a query's arithmetic never depends on its neighbours."""
        n_all, H, HD = q.shape
        KVH, G, bs = self.KVH, self.G, self.bs
        K = kc.view(-1, KVH, HD)[key_slots]  # [nb*bs, KVH, HD]
        V = vc.view(-1, KVH, HD)[key_slots]
        out = torch.empty((n_all, H, HD), dtype=q.dtype, device=q.device)
        pad = bs if self.pad_rows else 0
        r = 0
        while r < n_all:
            pos0 = sq.start_pos + r
            blk = pos0 // bs
            n = min(n_all - r, (blk + 1) * bs - pos0)
            ctx = (blk + 1) * bs
            npad = max(n, pad)
            qg = q[r : r + n]
            if npad > n:
                qg = torch.cat([qg, qg.new_zeros((npad - n, H, HD))])
            qg = (qg * self.scale).view(npad, KVH, G, HD).permute(1, 2, 0, 3).reshape(KVH, G * npad, HD)
            scores = torch.bmm(qg, K[:ctx].permute(1, 2, 0))  # [KVH, G*npad, ctx]
            qpos = pos0 + torch.arange(npad, device=q.device)
            allowed = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]  # [npad, ctx]
            scores = scores.view(KVH, G, npad, ctx).masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(KVH, G * npad, ctx)
            og = torch.bmm(probs, V[:ctx].permute(1, 0, 2))  # [KVH, G*npad, HD]
            og = og.view(KVH, G, npad, HD).permute(2, 0, 1, 3).reshape(npad, H, HD)
            out[r : r + n] = og[:n]
            r += n
        return out

    def _attn_sdpa(self, q, kc, vc, sq: SeqChunk, key_slots) -> torch.Tensor:
        """GPU prefill: SDPA over the sequence's gathered blocks."""
        n, H, HD = q.shape
        end = sq.start_pos + n
        qt = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, HD]
        K = kc.view(-1, self.KVH, self.HD)[key_slots[:end]].transpose(0, 1).unsqueeze(0)
        V = vc.view(-1, self.KVH, self.HD)[key_slots[:end]].transpose(0, 1).unsqueeze(0)
        if sq.start_pos == 0:
            o = F.scaled_dot_product_attention(qt, K, V, is_causal=True, enable_gqa=True)
        else:
            qpos = sq.start_pos + torch.arange(n, device=q.device)
            allowed = torch.arange(end, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(qt, K, V, attn_mask=allowed, enable_gqa=True)
        return o[0].transpose(0, 1)

    def _tables(self, seqs: list[SeqChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        maxb = max(len(sq.block_ids) for sq in seqs)
        bt = np.zeros((len(seqs), maxb), dtype=np.int32)
        for i, sq in enumerate(seqs):
            bt[i, : len(sq.block_ids)] = sq.block_ids
        cl = torch.tensor([sq.start_pos + 1 for sq in seqs], dtype=torch.int32)
        return torch.from_numpy(bt).to(self.device), cl.to(self.device)

    # ---- GPU decode (fixed shapes, CUDA-graph friendly) --------------------
    def decode_forward(self, input_ids, positions, slots, block_tables, ctx_lens) -> torch.Tensor:
        """One token per sequence; every tensor has a static shape (graph capture)."""

        out = torch.empty((input_ids.shape[0], self.H, self.HD), dtype=self.dtype, device=self.device)

        def attend(li, q, kc, vc):
            return self._triton(q, kc, vc, block_tables, ctx_lens, self.scale, out=out)

        x = self._run_layers(input_ids, positions, slots, attend)
        return self._logits(x)


class CudaGraphDecoder:
    """Decode steps on static buffers, replayed from CUDA graphs captured at
    bucketed batch sizes (with graphs=False the same code runs eagerly).

    Padded rows write their KV to the reserved null block and attend to one
    slot of it; their logits are dropped.
    """

    BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)

    def __init__(self, model: Qwen2Model, max_batch: int, graphs: bool = True, buckets: list[int] | None = None,
                 stream: torch.cuda.Stream | None = None) -> None:
        self.model = model
        self.stream = stream  # warm-up and capture stream (None: a new side stream)
        # Tensor parallelism runs decode eagerly: its all-reduces are not captured.
        self.use_graphs = graphs and model.device.type == "cuda" and model.comm is None
        if buckets is not None:
            if not buckets or sorted(set(buckets)) != list(buckets) or buckets[-1] != max_batch or buckets[0] < 1:
                raise ValueError(f"buckets must be increasing, positive and end at max_batch {max_batch}: {buckets}")
            self.buckets = list(buckets)
        else:
            self.buckets = [b for b in self.BUCKETS if b < max_batch] + [max_batch]
        dev = model.device
        bm = self.buckets[-1]
        self.maxb = model.cfg.max_blocks_per_seq
        self.meta = torch.zeros((4, bm), dtype=torch.int64, device=dev)  # ids, positions, slots, ctx_lens
        self.meta[3].fill_(1)
        self.block_tables = torch.full((bm, self.maxb), NULL_BLOCK, dtype=torch.int32, device=dev)
        pin = dev.type == "cuda"
        self._meta_host = torch.zeros((4, bm), dtype=torch.int64, pin_memory=pin)
        self._bt_host = torch.zeros((bm, self.maxb), dtype=torch.int32, pin_memory=pin)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _run(self, b: int) -> torch.Tensor:
        m = self.meta
        return self.model.decode_forward(m[0, :b], m[1, :b], m[2, :b], self.block_tables[:b], m[3, :b])

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.use_graphs:
            return
        pool = torch.cuda.graph_pool_handle()
        stream = self.stream if self.stream is not None else torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # Every bucket once eagerly, so nothing compiles or loads during capture.
            for b in reversed(self.buckets):
                self._run(b)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for b in reversed(self.buckets):
            g = torch.cuda.CUDAGraph()
            # Captured on the warm-up's stream: its cuBLAS workspace is reused, not a new one.
            with torch.cuda.graph(g, pool=pool, stream=stream):
                self.outputs[b] = self._run(b)
            self.graphs[b] = g
        # Launch each graph once now: the first launch uploads the executable graph
        # (tens of ms for a model's worth of kernels), which a standby must not pay in
        # its takeover. The static buffers hold padding rows: only the null block is written.
        for g in self.graphs.values():
            g.replay()
        torch.cuda.synchronize()

    def bucket(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    @torch.inference_mode()
    def run(self, input_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]]) -> torch.Tensor:
        n = len(input_ids)
        b = self.bucket(n)
        if b is None:
            raise ValueError(f"decode batch of {n} exceeds the largest bucket {self.buckets[-1]}")
        mh = self._meta_host
        mh[:, :b].zero_()
        mh[0, :n] = torch.tensor(input_ids, dtype=torch.int64)
        mh[1, :n] = torch.tensor(positions, dtype=torch.int64)
        mh[2, :n] = torch.tensor(slots, dtype=torch.int64)
        mh[3, :b] = 1
        mh[3, :n] = mh[1, :n] + 1
        bt = self._bt_host
        width = max(len(t) for t in tables)
        bt[:b, :width].zero_()
        for i, t in enumerate(tables):
            bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        self.meta[:, :b].copy_(mh[:, :b], non_blocking=True)
        self.block_tables[:b, :width].copy_(bt[:b, :width], non_blocking=True)
        if self.use_graphs:
            self.graphs[b].replay()
            return self.outputs[b][:n]
        return self._run(b)[:n]
