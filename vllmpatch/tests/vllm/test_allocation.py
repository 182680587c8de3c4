"""The allocation contexts that place vLLM's weights and KV cache in frmps'
pools (allocation.py), on the CPU: the real interceptor library and the SDK's
cuda-vmm backend over the interceptor's fake driver, with ``HostMemPools`` as
the labelled test double for torch's CUDA MemPool route (poolhelpers.py).
The same contexts on a GPU: VLLM.md, "GPU validation"."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from e2e import require

from poolhelpers import MiB, HostMemPools, build_interceptor, inside, storage_range, vmm_backend

torch = require("torch")


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    got = build_interceptor(tmp_path_factory.mktemp("vmm"), ("active", "standby", "stray"))
    if got is None:
        pytest.skip("needs a C compiler and make to build the interceptor")
    return got



def specs(weights_mib: int = 16, kv_mib: int = 12):
    from frmps_engine.sdk.memory.base import PoolSpec

    return [PoolSpec("weights", 0, weights_mib * MiB), PoolSpec("kv_cache", 0, kv_mib * MiB)]


class Engine:
    """One engine's memory side: backend, controller, contexts (installed globally, as create_core does)."""

    def __init__(self, lib: str, role: str, layout, torch_pools=None):
        from frmps_engine.vllm import pools
        from frmps_engine.vllm.allocation import Interceptor, PoolContexts

        self.backend = vmm_backend(lib)
        got = self.backend.allocate(layout) if role == "active" else self.backend.reserve(layout)
        self.pools = {p.spec.tag: p for p in got}
        self.controller = pools.PoolController.external({p.spec.key: p.tensor for p in got}, role)
        self.torch_pools = torch_pools or HostMemPools()
        self.contexts = PoolContexts(Interceptor(lib), self.torch_pools).attach(self.controller)
        self.install()

    def install(self):
        from frmps_engine.vllm import pools

        pools.install_controller(self.controller)
        pools.set_context_factory(self.contexts)

    def phase(self, tag):
        return self.controller.memory_pool_context(tag)

    def used(self, tag) -> int:
        return self.backend.library.pool_used(self.pools[tag].extra["handle"])

    def close(self):
        self.contexts.close()
        self.backend.close()


@pytest.fixture
def engines():
    from frmps_engine.vllm import pools

    made: list[Engine] = []

    def make(lib, role="active", layout=None, torch_pools=None):
        e = Engine(lib, role, layout or specs(), torch_pools)
        made.append(e)
        return e

    yield make
    pools.install_controller(None)
    pools.set_context_factory(None)
    for e in reversed(made):
        e.close()


def build_model(seed: int):
    """The same modules in the same order as another engine would build them."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(512, 64), torch.nn.Linear(64, 128), torch.nn.LayerNorm(128))


# -- placement --------------------------------------------------------------------
def test_weights_and_kv_phases_place_tensors_in_their_pools(libs, engines):
    e = engines(libs["active"])
    w, kv = e.pools["weights"].tensor, e.pools["kv_cache"].tensor
    assert e.torch_pools.checked == 1  # attach() asked torch's side whether it can route
    with e.phase("weights"):
        model = build_model(0)
        extra = torch.ones(1000)
    with e.phase("kv_cache"):
        cache = torch.zeros(11 * MiB, dtype=torch.int8)
    later = torch.empty(1000)

    for name, p in list(model.named_parameters()) + [("extra", extra)]:
        assert inside(p, w) and not inside(p, kv), name
    assert inside(cache, kv) and storage_range(cache)[0] == kv.data_ptr()  # the KV cache starts the pool
    assert not inside(later, w) and not inside(later, kv)
    assert float(extra.sum()) == 1000.0 and int(cache.abs().sum()) == 0  # values computed by the ops survive the move
    # The interceptor accounts every segment torch took; the controller records the bytes tensors hold.
    assert e.used("weights") == sum(n for _, n in e.contexts._pools["weights"].segments)
    kept = [p for _, p in model.named_parameters()] + [extra]
    assert e.controller.placed["weights"] == sum(-(-storage_range(t)[1] // 512) * 512 for t in kept)
    assert e.used("kv_cache") == 12 * MiB and e.controller.placed["kv_cache"] == 11 * MiB  # torch: a 12 MiB segment
    digest = e.controller.check_placement("weights", model.named_parameters())
    assert len(digest) == 16
    # close() drops both MemPools, which hand their segments back to the interceptor.
    e.contexts.close()
    assert e.torch_pools.released == 2 and e.used("weights") == e.used("kv_cache") == 0


def test_a_phase_beyond_its_pool_fails_loudly_and_leaves_no_region_open(libs, engines):
    from frmps_engine.sdk.memory.base import MemoryError_
    from frmps_engine.vllm.allocation import PoolFull
    from frmps_engine.vllm.pools import PoolExhausted

    e = engines(libs["active"], layout=specs(weights_mib=4, kv_mib=2))
    with pytest.raises(PoolFull, match=r"frmps kv_cache pool is full: .*pool 2097152 bytes.*underestimates") as err:
        with e.phase("kv_cache"):
            torch.zeros(3 * MiB, dtype=torch.int8)  # torch asks for a 20 MiB segment; the pool has 2 MiB
    assert isinstance(err.value, PoolExhausted) and isinstance(err.value, MemoryError_)  # the runner refuses to start
    assert e.used("kv_cache") == 0 and "kv_cache" not in e.controller.placed
    # The region was closed: the other pool's phase works, and so does a fitting KV allocation.
    with e.phase("weights"):
        a = torch.empty(100)
    with e.phase("kv_cache"):
        b = torch.zeros(MiB, dtype=torch.int8)
    assert inside(a, e.pools["weights"].tensor) and inside(b, e.pools["kv_cache"].tensor)
    # Filling the weights pool one segment at a time fails on the third 2 MiB segment of a 4 MiB pool.
    with pytest.raises(PoolFull, match="frmps weights pool is full"):
        with e.phase("weights"):
            keep = [torch.empty(256) for _ in range(3)]  # noqa: F841


def test_allocations_outside_any_pool_phase_use_the_default_allocator(libs, engines):
    import ctypes

    e = engines(libs["active"])
    before = {tag: e.used(tag) for tag in e.pools}
    x = torch.empty(MiB)
    for t in e.pools.values():
        assert not inside(x, t.tensor)
    # The allocator itself passes through with no region open (the fake driver's cuMemAlloc).
    lib = ctypes.CDLL(libs["active"])
    lib.frmps_malloc.restype = ctypes.c_void_p
    lib.frmps_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.frmps_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    p = lib.frmps_malloc(MiB, 0, None)
    assert p and all(not (t.address <= p < t.address + t.spec.size) for t in e.pools.values())
    lib.frmps_free(p, MiB, 0, None)
    assert {tag: e.used(tag) for tag in e.pools} == before


def test_a_phase_that_places_nothing_or_nests_is_refused(libs, engines):
    from frmps_engine.vllm.pools import PlacementError

    e = engines(libs["active"])
    with pytest.raises(PlacementError, match="frmps weights phase placed nothing"):
        with e.phase("weights"):
            pass
    with pytest.raises(PlacementError, match="entered inside the weights phase"):
        with e.phase("weights"):
            with e.phase("kv_cache"):
                pass


def test_contexts_refuse_a_library_copy_that_does_not_own_the_pools(libs, engines):
    from frmps_engine.vllm.allocation import Interceptor, PoolContexts
    from frmps_engine.vllm.pools import PlacementError

    e = engines(libs["active"])
    with pytest.raises(PlacementError, match=r"stray-libfrmps_vmm\.so cannot allocate in its (\w+) region: no pool tagged \1 exists"):
        PoolContexts(Interceptor(libs["stray"]), HostMemPools()).attach(e.controller)
    # A copy that has a pool of the tag, but not this controller's, is refused too.
    other = vmm_backend(libs["stray"])
    try:
        other.allocate(specs())
        with pytest.raises(PlacementError, match=r"carves its (\w+) region at 0x[0-9a-f]+, outside the frmps \1 pool"):
            PoolContexts(Interceptor(libs["stray"]), HostMemPools()).attach(e.controller)
    finally:
        other.close()


def test_check_placement_names_tensors_outside_the_pool(libs, engines):
    from frmps_engine.vllm.pools import PlacementError

    e = engines(libs["active"])
    with e.phase("weights"):
        model = build_model(0)
    model.add_module("late", torch.nn.Linear(4, 4))  # built after the phase: private memory
    with pytest.raises(PlacementError, match=r"2 tensor\(s\) outside the frmps weights pool.*late\.weight"):
        e.controller.check_placement("weights", model.named_parameters())


# -- the standby ------------------------------------------------------------------
def test_standby_builds_on_scratch_at_the_active_offsets_then_sees_the_active_memory(libs, engines):
    """The standby reserves its pools (one scratch chunk mapped over each range),
    builds the same model under the same contexts, and gets the active's offsets;
    its own writes land on scratch; after the brokered handles are mapped in place
    its tensors read the active's weights and KV."""
    active = engines(libs["active"])
    with active.phase("weights"):
        a_model = build_model(seed=1)
    with active.phase("kv_cache"):
        a_kv = torch.zeros(11 * MiB, dtype=torch.int8)
    a_kv[:1000] = 7
    a_digest = active.controller.check_placement("weights", a_model.named_parameters())
    a_state = {k: v.clone() for k, v in a_model.state_dict().items()}

    standby = engines(libs["standby"], role="standby")
    standby.install()
    with standby.phase("weights"):
        s_model = build_model(seed=2)  # "dummy" weights of its own: written to scratch
    with standby.phase("kv_cache"):
        s_kv = torch.zeros(11 * MiB, dtype=torch.int8)
    assert standby.controller.check_placement("weights", s_model.named_parameters()) == a_digest
    offsets = lambda m, base: [(n, p.data_ptr() - base) for n, p in m.named_parameters()]  # noqa: E731
    assert offsets(s_model, standby.pools["weights"].address) == offsets(a_model, active.pools["weights"].address)
    assert s_kv.data_ptr() - standby.pools["kv_cache"].address == a_kv.data_ptr() - active.pools["kv_cache"].address == 0
    assert not torch.equal(s_model[1].weight, a_model[1].weight)
    for k, v in a_model.state_dict().items():  # the standby's initialisation never touched the active's memory
        assert torch.equal(v, a_state[k]), k
    assert int(a_kv[:1000].sum()) == 7000

    # Sleep: the SDK runner maps the brokered fds at the reserved addresses, read-only.
    fds = [os.dup(active.pools[s.tag].fd) for s in specs()]
    standby.backend.map(specs(), fds, readonly=True)
    for k, v in s_model.state_dict().items():
        assert torch.equal(v, a_state[k]), k
    assert int(s_kv[:1000].sum()) == 7000


# -- through vLLM's own code ---------------------------------------------------------
@pytest.fixture
def frmps_vllm_config(tmp_path):
    from vhelpers import make_vllm_config, write_tiny_model

    vc = make_vllm_config(write_tiny_model(tmp_path / "m"), num_blocks=64)
    vc.model_config.sleep_mode_backend = "frmps"
    return vc


def _tiny_loader():
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    class TinyLoader(BaseModelLoader):
        """Test double for a model loader: builds a small model; vLLM's own
        BaseModelLoader.load_model drives it (dtype, device, load, post-processing)."""

        def download_model(self, model_config):
            pass

        def load_weights(self, model, model_config):
            for p in model.parameters():
                p.data.fill_(0.5)

    return TinyLoader(LoadConfig(load_format="dummy")), TinyLoader


def _worker(backend="frmps"):
    """Test double for vllm.v1.worker.gpu_worker.Worker: what the patched method reads."""
    return SimpleNamespace(vllm_config=SimpleNamespace(model_config=SimpleNamespace(sleep_mode_backend=backend, enable_cumem_allocator=True)))


def test_vllm_worker_and_loader_place_the_model_and_kv_cache(libs, engines, frmps_vllm_config, caplog):
    """vLLM's own Worker._maybe_get_memory_pool_context (patched), BaseModelLoader.load_model
    (patched) and the model runner's KV allocation (0.26: patched too), on a KV cache config
    from vLLM's planner: the model lands in the weights pool, the KV cache fills a pool sized
    by pools.pool_layout exactly."""
    import logging

    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.gpu_worker import Worker

    from frmps_engine.vllm import compat, plugin
    from frmps_engine.vllm.pools import kv_cache_bytes, pool_layout, torch_segment_bytes
    from vcompat import allocate_kv_cache, model_factory, plan_kv_cache

    plugin.register()
    vc = frmps_vllm_config
    # 1400 blocks: every KV allocation is over 10 MiB, so torch (and this test's
    # allocator double, which does not pack) gives each a segment of its own.
    vc.cache_config.num_gpu_blocks_override = 1400
    vc.cache_config.kv_cache_layout = "NHD"
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    layers = {f"model.layers.{i}.self_attn.attn": spec for i in range(2)}
    (kv_config,) = plan_kv_cache(vc, [layers])
    kv = kv_cache_bytes(num_layers=2, num_blocks=1400, block_size=16, num_kv_heads=2, head_size=32, dtype_bytes=4)
    allocations = compat.current().kv_cache_allocations(2, kv // 2)
    assert {t.size for t in kv_config.kv_cache_tensors} == set(allocations)  # vLLM's own plan
    layout = pool_layout(16 * MiB, allocations)
    assert min(allocations) >= 10 * MiB and layout[1].size == sum(torch_segment_bytes(n) for n in allocations)

    e = engines(libs["active"], layout=layout)
    worker = _worker()
    caplog.set_level(logging.INFO, logger="frmps_engine.vllm")
    loader, loader_cls = _tiny_loader()
    with model_factory(loader_cls, lambda: build_model(0)):
        with Worker._maybe_get_memory_pool_context(worker, "weights"):
            model = loader.load_model(vllm_config=vc, model_config=vc.model_config)
            sampler_state = torch.zeros(64, 512, dtype=torch.int32)  # the runner's own state in the same phase
    assert all(inside(p, e.pools["weights"].tensor) for p in model.parameters())
    assert all(float(p.detach().float().mean()) == 0.5 for p in model.parameters())
    assert not inside(sampler_state, e.pools["weights"].tensor)  # private, writable after a takeover
    assert any("frmps weights placement" in r.getMessage() for r in caplog.records)
    places_kv = compat.current().WORKER_PLACES_KV
    with Worker._maybe_get_memory_pool_context(worker, "kv_cache"):
        # 0.26: the runner builds block tables in the same phase; they must stay private.
        block_tables = None if places_kv else torch.zeros(64, 32, dtype=torch.int32)
        caches = allocate_kv_cache(kv_config, torch.device("cpu"), vc)
    assert set(caches) == set(layers)
    for t in caches.values():
        assert inside(t, e.pools["kv_cache"].tensor)
    if not places_kv:
        assert not inside(block_tables, e.pools["kv_cache"].tensor)  # private
        assert any("frmps kv_cache placement digest" in r.getMessage() for r in caplog.records)
    assert e.used("kv_cache") == layout[1].size  # exactly full
    # Every other tag of the frmps backend is private memory (torch's default allocator).
    with Worker._maybe_get_memory_pool_context(worker, "runtime"):
        rt = torch.empty(1000)
    assert not inside(rt, e.pools["weights"].tensor) and not inside(rt, e.pools["kv_cache"].tensor)


def test_worker_weights_phase_refuses_a_load_that_bypassed_the_loader(libs, engines):
    from vllm.v1.worker.gpu_worker import Worker

    from frmps_engine.vllm import plugin
    from frmps_engine.vllm.pools import PlacementError

    plugin.register()
    engines(libs["active"])
    with pytest.raises(PlacementError, match="without placing anything in the frmps weights pool"):
        with Worker._maybe_get_memory_pool_context(_worker(), "weights"):
            torch.nn.Linear(8, 8)  # a model built without BaseModelLoader.load_model


def test_cuda_contexts_refuse_host_shm_pools():
    """--engine vllm on CPU pools stops before vLLM is built, saying why."""
    from frmps_engine.sdk.memory.host_shm import HostShmBackend
    from frmps_engine.vllm.allocation import cuda_contexts
    from frmps_engine.vllm.pools import PoolController

    b = HostShmBackend()
    try:
        got = b.allocate(specs(weights_mib=2, kv_mib=2))
        ctl = PoolController.external({p.spec.key: p.tensor for p in got}, "active")
        with pytest.raises(ValueError, match=r"--device cuda --memory cuda-vmm.*\['cpu'\].*refuses sleep mode on CPU"):
            cuda_contexts(ctl)
    finally:
        b.close()
