"""The kv_cache pool holds what vLLM's own planner gives for the pinned block
count: 0.33, one backing allocation for every layer; 0.26, one per layer
(KVCacheTensor.size each), as the version's compat module says."""

from __future__ import annotations

import pytest

from vhelpers import make_vllm_config, write_tiny_model


@pytest.mark.parametrize("layers,heads,head_size,blocks", [(2, 2, 32, 100), (28, 4, 128, 517)])
def test_kv_pool_size_matches_vllm_planner(tmp_path, layers, heads, head_size, blocks):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from frmps_engine.vllm import compat
    from frmps_engine.vllm.pools import kv_cache_bytes
    from vcompat import plan_kv_cache

    vc = make_vllm_config(write_tiny_model(tmp_path / "m"), num_blocks=64)
    vc.cache_config.num_gpu_blocks_override = blocks  # what both engines pin
    vc.cache_config.kv_cache_layout = "NHD"  # normally resolved by the engine core
    spec = FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=head_size, dtype=torch.bfloat16)
    specs = [{f"model.layers.{i}.self_attn.attn": spec for i in range(layers)}]
    (cfg,) = plan_kv_cache(vc, specs)
    assert cfg.num_blocks == blocks
    want = kv_cache_bytes(num_layers=layers, num_blocks=blocks, block_size=16, num_kv_heads=heads, head_size=head_size, dtype_bytes=2)
    allocations = compat.current().kv_cache_allocations(layers, want // layers)
    # Each KVCacheTensor's size is one backing allocation (0.33: every layer's
    # tensor names the same one, vllm/v1/worker/utils.py:579-581; 0.26: one per layer).
    assert {t.size for t in cfg.kv_cache_tensors} == set(allocations)
    assert sum(allocations) == want
