"""The Triton paged-decode kernel, run by Triton's CPU interpreter against a torch reference."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")
pytestmark = pytest.mark.torch

SCRIPT = textwrap.dedent(
    """
    import math, torch
    from frmps_engine.refengine.triton_attention import paged_decode
    torch.manual_seed(0)
    for H, KVH, HD, ctxs in [(4, 2, 64, [1, 16, 17, 70]), (14, 2, 64, [5, 33]), (8, 8, 32, [130])]:
        NB, BS = 40, 16
        kc = torch.randn(NB, BS, KVH, HD)
        vc = torch.randn(NB, BS, KVH, HD)
        B = len(ctxs)
        q = torch.randn(B, H, HD)
        perm = torch.randperm(NB - 1) + 1
        tables = torch.zeros(B, 12, dtype=torch.int32)
        used = 0
        for b, c in enumerate(ctxs):
            n = -(-c // BS)
            tables[b, :n] = perm[used:used + n].to(torch.int32)
            used += n
        cl = torch.tensor(ctxs, dtype=torch.int32)
        out = paged_decode(q, kc, vc, tables, cl, 1 / math.sqrt(HD))
        for b, c in enumerate(ctxs):
            n = -(-c // BS)
            slots = (tables[b, :n].long()[:, None] * BS + torch.arange(BS)).reshape(-1)[:c]
            K = kc.view(-1, KVH, HD)[slots].repeat_interleave(H // KVH, 1)  # [c, H, HD]
            V = vc.view(-1, KVH, HD)[slots].repeat_interleave(H // KVH, 1)
            att = torch.einsum("hd,chd->hc", q[b], K) / math.sqrt(HD)
            ref = torch.einsum("hc,chd->hd", att.softmax(-1), V)
            torch.testing.assert_close(out[b], ref, rtol=2e-3, atol=2e-3)
    print("OK")
    """
)


def test_paged_decode_kernel_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
