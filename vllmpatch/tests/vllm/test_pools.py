"""The kv_cache pool size equals what vLLM 0.33.0's own planner gives its single
KV backing allocation (KVCacheTensor.size) for the pinned block count."""

from __future__ import annotations

import pytest

from vhelpers import make_vllm_config, write_tiny_model


@pytest.mark.parametrize("layers,heads,head_size,blocks", [(2, 2, 32, 100), (28, 4, 128, 517)])
def test_kv_pool_size_matches_vllm_planner(tmp_path, layers, heads, head_size, blocks):
    import torch
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from frmps_engine.vllm.pools import kv_cache_bytes

    vc = make_vllm_config(write_tiny_model(tmp_path / "m"), num_blocks=64)
    vc.cache_config.num_gpu_blocks_override = blocks  # what both engines pin
    vc.cache_config.kv_cache_layout = "NHD"  # normally resolved by the engine core
    spec = FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=head_size, dtype=torch.bfloat16)
    specs = [{f"model.layers.{i}.self_attn.attn": spec for i in range(layers)}]
    (cfg,) = get_kv_cache_configs(vc, specs, [1 << 40], get_global_kv_cache_groups(vc, specs))
    assert cfg.num_blocks == blocks
    sizes = {t.size for t in cfg.kv_cache_tensors}
    assert len(sizes) == 1  # one backing allocation (vllm/v1/worker/utils.py:579-581)
    want = kv_cache_bytes(num_layers=layers, num_blocks=blocks, block_size=16, num_kv_heads=heads, head_size=head_size, dtype_bytes=2)
    assert sizes.pop() == want
