"""The seeded checkpoint's bytes do not depend on the device that draws them
(skipped without CUDA): the GPU path (torch int64) against the CPU path (numpy
uint32), tensor by tensor, and a whole checkpoint's file."""

from __future__ import annotations

import hashlib
import os

import pytest

from e2e import require

torch = require("torch")
pytestmark = [pytest.mark.torch, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("law,centre,scale", [("normal", 0.0, 0.02), ("normal", 11.95, 1.195), ("uniform", 0.0, 1e-3)])
def test_cuda_draws_the_cpus_bytes(law, centre, scale):
    from frmps_engine import seeded_weights as sw

    n = (1 << 24) + 12_345  # more than one GPU chunk
    keys = sw.tensor_keys(0, "model.embed_tokens.weight")
    a = sw.draw(n, keys, law, centre, scale, "cpu")
    b = sw.draw(n, keys, law, centre, scale, "cuda").cpu()
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_a_checkpoint_written_on_the_gpu_is_the_cpus(tmp_path):
    from frmps_engine import seeded_weights as sw

    sw.write_seeded_checkpoint(str(tmp_path / "cpu"), "tiny", 3, device="cpu")
    sw.write_seeded_checkpoint(str(tmp_path / "gpu"), "tiny", 3, device="cuda")

    def sha(d):
        with open(os.path.join(d, "model.safetensors"), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    assert sha(tmp_path / "cpu") == sha(tmp_path / "gpu")
