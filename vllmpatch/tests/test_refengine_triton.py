"""The Triton paged-decode kernel, run by Triton's CPU interpreter against a torch reference."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from e2e import require

require("torch")
require("triton")
pytestmark = pytest.mark.torch

SCRIPT = textwrap.dedent(
    """
    import math, torch
    from frmps_engine.refengine.triton_attention import paged_decode
    torch.manual_seed(0)
    # float16 stands in for bfloat16, whose dots Triton's interpreter cannot emulate.
    for H, KVH, HD, ctxs, dt in [(4, 2, 64, [1, 16, 17, 70], torch.float32), (14, 2, 64, [33], torch.float32),
                                 (8, 8, 32, [130], torch.float32), (28, 4, 128, [40, 64], torch.float16)]:
        NB, BS = 40, 16
        kc = torch.randn(NB, BS, KVH, HD).to(dt)
        vc = torch.randn(NB, BS, KVH, HD).to(dt)
        B = len(ctxs)
        q = torch.randn(B, H, HD).to(dt)
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
            K = kc.view(-1, KVH, HD)[slots].float().repeat_interleave(H // KVH, 1)  # [c, H, HD]
            V = vc.view(-1, KVH, HD)[slots].float().repeat_interleave(H // KVH, 1)
            att = torch.einsum("hd,chd->hc", q[b].float(), K) / math.sqrt(HD)
            ref = torch.einsum("hc,chd->hd", att.softmax(-1), V)
            assert out.dtype == dt
            torch.testing.assert_close(out[b].float(), ref, rtol=4e-3, atol=4e-3)
    print("OK")
    """
)


def test_paged_decode_kernel_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


ENGINE_SCRIPT = textwrap.dedent(
    """
    import torch
    torch.set_num_threads(1)
    from frmps_engine.refengine import EngineConfig, RefCore, SamplingParams
    g = torch.Generator().manual_seed(0)
    reqs = [(k, torch.randint(0, 256, (n,), generator=g).tolist(),
             SamplingParams(max_tokens=8, temperature=0.0 if k % 2 else 0.9, seed=k, ignore_eos=True))
            for k, n in [(1, 5), (2, 23), (3, 40)]]
    outs, logits = {}, {}
    for att in ("torch", "triton"):
        cfg = EngineConfig.from_preset("tiny", num_blocks=32, attention=att, max_num_seqs=8)
        core = RefCore(cfg, RefCore.allocate_pools(cfg), True)
        rec = []
        fwd = core.model.decode_forward
        core.model.decode_forward = lambda *a: (rec.append(fwd(*a)), rec[-1])[1]
        outs[att] = core.generate(reqs)
        logits[att] = rec
        if att == "triton":
            # 3 decoding requests run in the bucket of 4: one padded row on the null block.
            assert core._graphs is not None and core._graphs.bucket(3) == 4
            assert len(rec) == 7 and rec[0].shape == (4, 512), (len(rec), rec[0].shape)
    assert outs["torch"] == outs["triton"], outs
    # Exact mode: one bucket (max_num_seqs), every decode step padded to it.
    cfg = EngineConfig.from_preset("tiny", num_blocks=32, attention="triton", max_num_seqs=8, exact=True)
    core = RefCore(cfg, RefCore.allocate_pools(cfg), True)
    rec = []
    fwd = core.model.decode_forward
    core.model.decode_forward = lambda *a: (rec.append(fwd(*a)), rec[-1])[1]
    assert core.generate(reqs) == outs["torch"]
    assert core._graphs.buckets == [8] and rec and all(r.shape == (8, 512) for r in rec)
    print("OK")
    """
)


def test_static_decode_path_interpreted():
    # The GPU decode path (static buffers, bucket padding, null block, Triton
    # kernel) on the CPU: it must produce the tokens of the torch attention path.
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
