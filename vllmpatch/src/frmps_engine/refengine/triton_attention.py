"""Paged-attention decode kernel (Triton): one query token per sequence.

One program per (sequence, KV head) walks the sequence's block table in tiles,
keeping an online softmax; the query heads that share the KV head (GQA) are
processed together so every K/V byte is loaded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    Q, K, V, O, BT, CL, scale,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    stride_kb, stride_ks, stride_kh,
    G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr,
    PREC: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(CL + b).to(tl.int32)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, HD)
    gmask = offs_g < G
    heads = kvh * G + offs_g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=gmask[:, None], other=0.0)
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, HD], tl.float32)
    for start in range(0, ctx, TILE):
        offs_t = start + tl.arange(0, TILE)
        tmask = offs_t < ctx
        blk = tl.load(BT + b * stride_bt + offs_t // BS, mask=tmask, other=0).to(tl.int64)
        slot = offs_t % BS
        koff = blk[:, None] * stride_kb + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :]
        k = tl.load(K + koff, mask=tmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V + koff, mask=tmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m = m_new
    out = acc / l[:, None]
    tl.store(O + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=gmask[:, None])


def paged_decode(
    q: torch.Tensor,  # [B, H, HD]
    k_cache: torch.Tensor,  # [NB, BS, KVH, HD]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    ctx_lens: torch.Tensor,  # [B] (>= 1)
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    B, H, HD = q.shape
    _, BS, KVH, _ = k_cache.shape
    G = H // KVH
    GP = max(16, triton.next_power_of_2(G))
    if out is None:
        out = torch.empty_like(q)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and q.stride(2) == 1
    tile = 64 if HD <= 128 else 32
    _paged_decode_kernel[(B, KVH)](
        q, k_cache, v_cache, out, block_tables, ctx_lens, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        G=G, GP=GP, HD=HD, BS=BS, TILE=tile, num_warps=4,
        # float32 caches get full-precision dots (the default would be TF32).
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
