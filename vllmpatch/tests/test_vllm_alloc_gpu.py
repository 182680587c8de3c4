"""The vLLM adapter's allocation contexts (frmps_engine.vllm.allocation) on a
real GPU, through torch's CUDA route (CUDAPluggableAllocator over the
interceptor's frmps_malloc + torch.cuda.MemPool): what tests/vllm/
test_allocation.py checks on the CPU with a test double for that route.
Neither module imports vLLM, so this runs where vLLM cannot be installed.
Skipped without a CUDA GPU. The standby runs in another process, as in
production (fds by inheritance). Not yet run on a GPU."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from e2e import require

torch = require("torch")

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from frmps_engine.sdk.memory.base import PoolSpec  # noqa: E402
from frmps_engine.sdk.memory.cuda_vmm import CudaVmmBackend  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
MiB = 1 << 20
SPECS = [PoolSpec("weights", 0, 64 * MiB), PoolSpec("kv_cache", 0, 12 * MiB)]

# Built the same way, in the same order, by the active and the standby.
BUILD = textwrap.dedent(
    """
    def build(seed):
        torch.manual_seed(seed)
        with torch.device("cuda"):
            return torch.nn.Sequential(torch.nn.Embedding(4096, 256), torch.nn.Linear(256, 1024),
                                       torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 4096))
    """
)
exec(BUILD)  # defines build()


@pytest.fixture(scope="module")
def lib_path():
    r = subprocess.run(["make", "-s", "-C", str(REPO / "interceptor"), "all"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return str(REPO / "interceptor" / "build" / "libfrmps_vmm.so")


def contexts(pools, role, lib_path):
    from frmps_engine.vllm.allocation import CudaMemPools, Interceptor, PoolContexts
    from frmps_engine.vllm.pools import PoolController

    ctl = PoolController.external({p.spec.key: p.tensor for p in pools}, role)
    return ctl, PoolContexts(Interceptor(lib_path), CudaMemPools("cuda:0")).attach(ctl)


def inside(t, pool) -> bool:
    st = t.untyped_storage()
    return pool.address <= st.data_ptr() and st.data_ptr() + st.nbytes() <= pool.address + pool.spec.size


def outside_names(model, pool) -> list[str]:
    return [name for name, p in model.named_parameters() if not inside(p, pool)]


def release(ctx) -> None:
    """Drop the MemPools once no tensor of theirs is referenced (their teardown
    hands the segments back through frmps_free), before the pools go."""
    import gc

    gc.collect()
    torch.cuda.synchronize()
    ctx.close()


def test_phases_place_torch_allocations_in_the_pools_and_overflow_is_pool_full(lib_path):
    from frmps_engine.vllm.allocation import PoolFull

    b = CudaVmmBackend("cuda", library=lib_path)
    try:
        pools = b.allocate(SPECS)
        by = {p.spec.tag: p for p in pools}
        ctl, ctx = contexts(pools, "active", lib_path)
        with ctx(ctl, "weights"):
            model = build(1)
        with ctx(ctl, "kv_cache"):
            kv = torch.zeros(11 * MiB, dtype=torch.int8, device="cuda")
        other = torch.empty(MiB, device="cuda")
        assert outside_names(model, by["weights"]) == []
        assert kv.data_ptr() == by["kv_cache"].address
        assert not inside(other, by["weights"]) and not inside(other, by["kv_cache"])
        out = model[1:](model[0](torch.arange(8, device="cuda")))  # kernels run on the pooled parameters
        torch.cuda.synchronize()
        assert out.shape == (8, 4096) and bool(torch.isfinite(out).all())
        # torch took one 12 MiB segment for the 11 MiB KV tensor; the weights' segments hold the parameters.
        # torch's MemPool holds the 12 MiB segment; what the phase counts as placed is
        # the tensor (test double) or its segment (real torch), depending on the route.
        assert b.library.pool_used(by["kv_cache"].extra["handle"]) == 12 * MiB
        assert 11 * MiB <= ctl.placed["kv_cache"] <= 12 * MiB
        assert b.library.pool_used(by["weights"].extra["handle"]) >= ctl.placed["weights"] > 0
        assert ctl.check_placement("weights", model.named_parameters())
        # The kv_cache pool is full: torch's OutOfMemoryError (frmps_malloc returned NULL) becomes PoolFull.
        with pytest.raises(PoolFull, match="frmps kv_cache pool is full"):
            with ctx(ctl, "kv_cache"):
                torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        with ctx(ctl, "weights"):  # the region was closed: the next phase works
            extra = torch.ones(1000, device="cuda")
        assert inside(extra, by["weights"])
        del model, kv, other, out, extra
        release(ctx)
    finally:
        b.close()


def test_standby_on_scratch_gets_the_active_offsets_and_sees_its_memory_after_the_swap(lib_path):
    b = CudaVmmBackend("cuda", library=lib_path)
    try:
        pools = b.allocate(SPECS)
        ctl, ctx = contexts(pools, "active", lib_path)
        with ctx(ctl, "weights"):
            model = build(1)
        with ctx(ctl, "kv_cache"):
            kv = torch.zeros(11 * MiB, dtype=torch.int8, device="cuda")
        kv[:4096] = 7
        torch.cuda.synchronize()
        digest = ctl.check_placement("weights", model.named_parameters())
        standby = BUILD + textwrap.dedent(
            f"""
            import torch
            from frmps_engine.sdk.memory.base import PoolSpec
            from frmps_engine.sdk.memory.cuda_vmm import CudaVmmBackend
            from frmps_engine.vllm.allocation import CudaMemPools, Interceptor, PoolContexts
            from frmps_engine.vllm.pools import PoolController
            specs = [PoolSpec("weights", 0, {SPECS[0].size}), PoolSpec("kv_cache", 0, {SPECS[1].size})]
            b = CudaVmmBackend("cuda", library={lib_path!r})
            reserved = b.reserve(specs)
            ctl = PoolController.external({{p.spec.key: p.tensor for p in reserved}}, "standby")
            ctx = PoolContexts(Interceptor({lib_path!r}), CudaMemPools("cuda:0")).attach(ctl)
            with ctx(ctl, "weights"):
                model = build(2)  # its own values, on scratch
            with ctx(ctl, "kv_cache"):
                kv = torch.zeros(11 * {MiB}, dtype=torch.int8, device="cuda")
            print("digest", ctl.check_placement("weights", model.named_parameters()), flush=True)
            torch.cuda.synchronize()
            b.map(specs, [{pools[0].fd}, {pools[1].fd}], readonly=True)
            ref = build(1)  # the active's values, rebuilt in private memory
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert torch.equal(p, q), name
            assert int(kv[:4096].sum()) == 7 * 4096 and int(kv[4096:].abs().sum()) == 0
            print("standby ok", flush=True)
            import os
            os._exit(0)
            """
        )
        before = {k: v.clone() for k, v in model.state_dict().items()}
        for p in pools:
            os.set_inheritable(p.fd, True)
        try:
            import frmps_engine

            env = dict(os.environ, PYTHONPATH=str(pathlib.Path(frmps_engine.__file__).resolve().parents[1]))
            env.pop("FRMPS_LIBCUDA", None)
            r = subprocess.run([sys.executable, "-c", standby], capture_output=True, text=True, env=env,
                               pass_fds=[p.fd for p in pools], timeout=180)
        finally:
            for p in pools:
                os.set_inheritable(p.fd, False)
        assert r.returncode == 0 and "standby ok" in r.stdout, r.stdout + r.stderr
        assert re.search(rf"^digest {digest}$", r.stdout, re.M), (digest, r.stdout)
        changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
        assert changed == []  # the standby's build wrote only its scratch
        del model, kv, before
        release(ctx)
    finally:
        b.close()
