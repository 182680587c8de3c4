"""The plugin entry point, the version guard, the patch registry and the sleep
backend, against the real vLLM package (each supported version)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest


# -- version guard ---------------------------------------------------------------
@pytest.mark.parametrize(
    "found", ["0.25.0", "0.26.1", "0.26.0rc1", "0.27.0", "0.32.0", "0.33.1", "0.33.0rc1", "0.34.0", "1.0.0", "0.33", "0.26"]
)
def test_version_guard_refuses_other_versions(found):
    from frmps_engine.vllm.version import VllmVersionError, check_vllm_version

    with pytest.raises(VllmVersionError) as err:
        check_vllm_version(found)
    msg = str(err.value)
    assert f"found vllm {found}" in msg and "supports only vllm==0.26.0 or vllm==0.33.0" in msg


@pytest.mark.parametrize("found,public", [("0.26.0", "0.26.0"), ("0.26.0+cu130", "0.26.0"),
                                          ("0.33.0", "0.33.0"), ("0.33.0+cu130", "0.33.0")])
def test_version_guard_accepts_the_supported_versions(found, public):
    from frmps_engine.vllm import compat
    from frmps_engine.vllm.version import check_vllm_version

    assert check_vllm_version(found) == public
    assert compat.for_version(found).VERSION == public


def test_version_guard_detects_the_installed_vllm_and_missing_vllm(monkeypatch):
    from importlib import metadata

    from frmps_engine.vllm import compat, version

    installed = metadata.version("vllm").split("+", 1)[0]
    assert version.check_vllm_version() == installed
    assert compat.current().VERSION == installed
    monkeypatch.setattr(version, "installed_vllm_version", lambda: None)
    with pytest.raises(version.VllmVersionError, match="vLLM is not installed"):
        version.check_vllm_version()


def test_register_refuses_another_vllm_and_registers_nothing(monkeypatch):
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

    from frmps_engine.vllm import plugin, version

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(version, "installed_vllm_version", lambda: "0.34.0")
    before = dict(SleepModeBackendFactory._registry)
    monkeypatch.setattr(SleepModeBackendFactory, "_registry", {k: v for k, v in before.items() if k != "frmps"})
    with pytest.raises(version.VllmVersionError, match="found vllm 0.34.0"):
        plugin.register()
    assert "frmps" not in SleepModeBackendFactory._registry
    assert not plugin.is_registered()


# -- registration ----------------------------------------------------------------
def test_register_is_idempotent():
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

    from frmps_engine.vllm import plugin
    from frmps_engine.vllm.patches import patches
    from frmps_engine.vllm.sleep_backend import FrmpsSleepBackend

    for _ in range(3):
        plugin.register()
    # Even with the module flag lost (a re-imported module, a forked process that
    # calls it again), a second registration neither raises nor stacks patches.
    plugin._registered = False
    plugin.register()
    assert SleepModeBackendFactory.get_backend_class("frmps") is FrmpsSleepBackend
    for patch in patches():
        assert patch.is_applied()
        owner, attr = patch._owner_attr()
        assert not hasattr(getattr(owner, attr).__wrapped__, "__frmps_patch__"), "patch applied twice"


def test_vllm_loads_the_plugin_through_its_entry_point(tmp_path, monkeypatch):
    """vLLM's own loader finds `frmps` in vllm.general_plugins and runs it; loading twice is harmless."""
    import vllm.plugins as vp
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

    from frmps_engine.vllm import plugin

    dist = tmp_path / "frmps_engine_plugin_probe-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: frmps-engine-plugin-probe\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text("[vllm.general_plugins]\nfrmps = frmps_engine.vllm.plugin:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = vp.load_plugins_by_group(vp.DEFAULT_PLUGINS_GROUP)
    assert found["frmps"] is plugin.register
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(vp, "plugins_loaded", False)
    vp.load_general_plugins()
    assert plugin.is_registered()
    monkeypatch.setattr(vp, "plugins_loaded", False)
    vp.load_general_plugins()  # a second process-level load
    assert "frmps" in SleepModeBackendFactory._registry


# -- patch registry --------------------------------------------------------------
@pytest.mark.parametrize("version", ["0.26.0", "0.33.0"])
def test_every_patch_is_documented(version):
    from frmps_engine.vllm import compat

    registry = compat.for_version(version).PATCHES
    assert registry, "the registry lists the remaining patches"
    assert len({p.name for p in registry}) == len(registry)
    for p in registry:
        assert p.why and p.how and p.removable_when and ":" in p.target


def test_every_patch_of_the_installed_version_targets_an_existing_vllm_attribute():
    from frmps_engine.vllm.patches import patches

    for p in patches():
        owner, attr = p._owner_attr()
        assert callable(getattr(owner, attr)), p.target


class _Ctx:
    """Test double for an allocation context."""

    def __init__(self, tag):
        self.tag = tag


class FakeMemoryBackend:
    """Test double for frmps_engine.sdk.memory.MemoryBackend: records calls, hands out bytearrays."""

    def __init__(self):
        self.calls = []

    def _pools(self, specs, readonly=False, fds=None):
        return [
            SimpleNamespace(spec=s, tensor=bytearray(8), fd=(fds[i] if fds else 100 + i), readonly=readonly)
            for i, s in enumerate(specs)
        ]

    def allocate(self, specs):
        self.calls.append(("allocate", [s.tag for s in specs]))
        return self._pools(specs)

    def reserve(self, specs):
        self.calls.append(("reserve", [s.tag for s in specs]))
        return self._pools(specs)

    def map(self, specs, fds, readonly):
        self.calls.append(("map", list(fds), readonly))
        return self._pools(specs, readonly, fds)

    def make_writable(self, tag):
        self.calls.append(("make_writable", tag))

    def close(self):
        self.calls.append(("close",))


@pytest.fixture
def controller():
    from frmps_engine.vllm import pools

    def make(role):
        c = pools.PoolController(FakeMemoryBackend(), pools.pool_layout(10 << 20, 30 << 20), role)
        c.setup()
        pools.install_controller(c)
        return c

    yield make
    pools.install_controller(None)
    pools.set_context_factory(None)


def _worker(backend):
    """Test double for vllm.v1.worker.gpu_worker.Worker: what the patched method reads."""
    return SimpleNamespace(vllm_config=SimpleNamespace(model_config=SimpleNamespace(sleep_mode_backend=backend, enable_cumem_allocator=True)))


def test_worker_pool_context_patch(controller):
    from vllm.v1.worker.gpu_worker import Worker

    from frmps_engine.vllm import compat, pools
    from frmps_engine.vllm.patches import patches

    (patch,) = [p for p in patches() if p.name == "worker-pool-context"]
    patch.apply()
    ctl = controller("active")
    pools.set_context_factory(lambda c, tag: _Ctx(tag))

    frmps_worker = _worker("frmps")
    ctx = Worker._maybe_get_memory_pool_context(frmps_worker, "kv_cache")
    if compat.current().WORKER_PLACES_KV:
        assert isinstance(ctx, _Ctx) and ctx.tag == "kv_cache"
    else:
        # 0.26: the tag covers the runner's whole initialize_kv_cache; it only arms
        # the allocation-level patches, and refuses a phase in which they placed nothing.
        assert not isinstance(ctx, _Ctx)
        with pytest.raises(pools.PlacementError, match="without placing the KV cache"):
            with ctx:
                assert pools.armed_kv_controller() is ctl
        assert pools.armed_kv_controller() is None
        with Worker._maybe_get_memory_pool_context(frmps_worker, "kv_cache"):
            ctl.record_placed("kv_cache", 4096)  # what the allocation patch's context records
    # "weights" is only checked here: the loader patch places the model.
    ctx = Worker._maybe_get_memory_pool_context(frmps_worker, "weights")
    assert not isinstance(ctx, _Ctx)
    ctl.placed["weights"] = 0
    with ctx:
        ctl.record_placed("weights", 4096)  # what the loader's allocation context records
    # Every other tag of the frmps backend is private memory, without CuMemAllocator.
    for tag in ("runtime", "workspace"):
        assert isinstance(Worker._maybe_get_memory_pool_context(frmps_worker, tag), contextlib.nullcontext)
    # Other backends reach vLLM's own code: on this GPU-less platform that is
    # get_mem_allocator_instance() refusing (device_allocator/__init__.py:51).
    for tag in ("weights", "kv_cache", "runtime"):
        with pytest.raises(RuntimeError, match="Sleep mode allocator is not available"):
            Worker._maybe_get_memory_pool_context(_worker("cumem"), tag)
    # Without an allocation context installed, the frmps pools refuse clearly.
    pools.set_context_factory(None)
    with pytest.raises(RuntimeError, match="no allocation context is installed for the frmps kv_cache pool"):
        if compat.current().WORKER_PLACES_KV:
            Worker._maybe_get_memory_pool_context(frmps_worker, "kv_cache")
        else:
            with Worker._maybe_get_memory_pool_context(frmps_worker, "kv_cache"):
                ctl.memory_pool_context("kv_cache")


def test_loader_weights_pool_patch(tmp_path):
    """vLLM's BaseModelLoader.load_model runs inside the frmps weights context
    for the frmps backend only, and checks where the model landed."""
    import torch
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from frmps_engine.vllm import pools
    from frmps_engine.vllm.patches import patches
    from vcompat import model_factory
    from vhelpers import make_vllm_config, write_tiny_model

    (patch,) = [p for p in patches() if p.name == "loader-weights-pool"]
    patch.apply()
    assert patch.is_applied()

    class TinyLoader(BaseModelLoader):
        """Test double for a model loader."""

        def download_model(self, model_config):
            pass

        def load_weights(self, model, model_config):
            pass

    entered = []

    class Recording:
        """Test double for an allocation context: records the tag it was entered for."""

        def __init__(self, tag):
            self.tag = tag

        def __enter__(self):
            entered.append(self.tag)

        def __exit__(self, *exc):
            return False

    ctl = pools.PoolController.external({("weights", 0): torch.zeros(4096, dtype=torch.uint8),
                                          ("kv_cache", 0): torch.zeros(4096, dtype=torch.uint8)}, "active")
    pools.install_controller(ctl)
    pools.set_context_factory(lambda c, tag: Recording(tag))
    vc = make_vllm_config(write_tiny_model(tmp_path / "m"))
    loader = TinyLoader(LoadConfig())
    try:
        with model_factory(TinyLoader, lambda: torch.nn.Linear(4, 4)):
            loader.load_model(vllm_config=vc, model_config=vc.model_config)  # the cumem backend: untouched
            assert entered == []
            vc.model_config.sleep_mode_backend = "frmps"
            # The test double's pools are not where torch put the model: the placement check says so.
            with pytest.raises(pools.PlacementError, match=r"2 tensor\(s\) outside the frmps weights pool.*\bweight \("):
                loader.load_model(vllm_config=vc, model_config=vc.model_config)
            assert entered == ["weights"]
    finally:
        pools.install_controller(None)
        pools.set_context_factory(None)


@pytest.mark.parametrize("role", ["standby", "active"])
def test_the_load_has_memory_phases(tmp_path, monkeypatch, role):
    """With FRMPS_DEBUG_MEMORY_PHASES the model's construction and its initialisation
    (the loader's own) each get a memory line; the loader's own load_weights is back
    afterwards."""
    import torch
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from frmps_engine.vllm import patches as patches_mod, pools
    from frmps_engine.vllm.patches import patches
    from vcompat import model_factory
    from vhelpers import make_vllm_config, write_tiny_model

    (patch,) = [p for p in patches() if p.name == "loader-weights-pool"]
    patch.apply()
    calls = []

    class TinyLoader(BaseModelLoader):
        """Test double for a model loader: its initialisation fills 7s."""

        def download_model(self, model_config):
            pass

        def load_weights(self, model, model_config):
            calls.append("loader")
            with torch.no_grad():
                for t in model.state_dict().values():
                    t.fill_(7.0)

    notes = []
    monkeypatch.setattr(patches_mod.memphase, "note", notes.append)
    monkeypatch.setenv("FRMPS_DEBUG_MEMORY_PHASES", "1")
    lin = torch.nn.Linear(4, 4)
    ctl = pools.PoolController.external({("weights", 0): torch.zeros(4096, dtype=torch.uint8),
                                          ("kv_cache", 0): torch.zeros(4096, dtype=torch.uint8)}, role)
    pools.install_controller(ctl)
    pools.set_context_factory(lambda c, tag: contextlib.nullcontext())
    vc = make_vllm_config(write_tiny_model(tmp_path / "m"))
    vc.model_config.sleep_mode_backend = "frmps"
    loader = TinyLoader(LoadConfig())
    try:
        with model_factory(TinyLoader, lambda: lin):
            with pytest.raises(pools.PlacementError):  # the test double's pools are not where torch put it
                loader.load_model(vllm_config=vc, model_config=vc.model_config)
    finally:
        pools.install_controller(None)
        pools.set_context_factory(None)
    assert notes == ["model constructed", "weights initialised"]
    assert calls == ["loader"]
    assert all(bool((t == 7.0).all()) for t in lin.state_dict().values()), lin.state_dict()
    assert "load_weights" not in vars(loader) and loader.load_weights.__func__ is TinyLoader.load_weights


# -- sleep backend ---------------------------------------------------------------
def test_sleep_backend_maps_brokered_pools_readonly_then_wakes_kv(controller):
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

    from frmps_engine.vllm import plugin

    plugin.register()
    standby = controller("standby")
    backend = SleepModeBackendFactory.create_backend(SimpleNamespace(sleep_mode_backend="frmps"))
    assert backend.state() == "RUNNING"
    with pytest.raises(RuntimeError, match="no brokered fds"):
        backend.suspend(1)
    standby.provide_brokered([7, 8])
    backend.suspend(1)
    assert backend.state() == "SUSPENDED"
    assert standby.backend.calls[-1] == ("map", [7, 8], True)
    assert all(p.readonly for p in standby.pools.values())
    backend.resume(["weights"])  # weights never become writable
    assert ("make_writable", "weights") not in standby.backend.calls
    assert ("make_writable", "kv_cache") not in standby.backend.calls
    backend.resume(["kv_cache"])
    assert standby.backend.calls[-1] == ("make_writable", "kv_cache")
    assert backend.state() == "RUNNING"
    with pytest.raises(RuntimeError, match="cannot be discarded"):
        backend.discard(("kv_cache",))


def test_sleep_backend_refuses_on_active_and_without_controller(controller):
    from frmps_engine.vllm import pools
    from frmps_engine.vllm.sleep_backend import FrmpsSleepBackend

    controller("active")
    with pytest.raises(RuntimeError, match="never sleeps"):
        FrmpsSleepBackend().suspend(1)
    pools.install_controller(None)
    with pytest.raises(RuntimeError, match="no frmps pool controller is installed"):
        FrmpsSleepBackend().resume(None)


def test_kv_pool_size_matches_vllm_page_size():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from frmps_engine.vllm.pools import kv_cache_bytes

    for heads, hd, dtype, nbytes in ((2, 16, torch.float32, 4), (8, 128, torch.bfloat16, 2)):
        spec = FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=hd, dtype=dtype)
        got = kv_cache_bytes(num_layers=28, num_blocks=1000, block_size=16, num_kv_heads=heads, head_size=hd, dtype_bytes=nbytes)
        assert got == 28 * 1000 * spec.page_size_bytes


def test_pool_layout_holds_the_segments_torch_requests():
    from frmps_engine.vllm.pools import pool_layout, torch_segment_bytes

    MiB = 1 << 20
    # c10/cuda/CUDACachingAllocator.cpp: <= 1 MiB -> 2 MiB, < 10 MiB -> 20 MiB, else 2 MiB multiples.
    assert [torch_segment_bytes(n) for n in (1, MiB, MiB + 1, 10 * MiB - 1, 10 * MiB, 10 * MiB + 1)] == [
        2 * MiB, 2 * MiB, 20 * MiB, 20 * MiB, 10 * MiB, 12 * MiB,
    ]
    for kv in (1, 3 * MiB, 10 * MiB, 4 * 1024 * MiB + 7):
        w, k = pool_layout(5 * MiB, kv)
        assert k.size == torch_segment_bytes(kv) and k.size % (2 * MiB) == 0
        assert w.size == 6 * MiB
    with pytest.raises(ValueError, match="must be >= 1"):
        torch_segment_bytes(0)


def test_torch_segments_bytes_follows_the_caching_allocator():
    from frmps_engine.vllm.pools import torch_segments_bytes

    MiB = 1 << 20
    assert torch_segments_bytes([]) == 0
    assert torch_segments_bytes([100] * 4096) == 2 * MiB  # 4096 x 512-byte blocks fill one 2 MiB segment
    assert torch_segments_bytes([100] * 4097) == 2 * 2 * MiB
    assert torch_segments_bytes([3 * MiB, 3 * MiB]) == 20 * MiB  # mid-size requests share a 20 MiB segment
    # 1.5 MiB requests: 13 fit a 20 MiB segment (the last takes the unsplittable 2 MiB rest), the 14th opens another.
    assert torch_segments_bytes([3 * MiB // 2] * 13) == 20 * MiB
    assert torch_segments_bytes([3 * MiB // 2] * 14) == 40 * MiB
    assert torch_segments_bytes([11 * MiB]) == 12 * MiB  # large: rounded to 2 MiB
    # A large segment's 1 MiB+ rest serves a later mid-size request; a rest of 1 MiB or less is not kept.
    assert torch_segments_bytes([11 * MiB - MiB // 2, 3 * MiB // 2]) == 12 * MiB
    assert torch_segments_bytes([11 * MiB + MiB // 2, 3 * MiB // 2]) == 12 * MiB + 20 * MiB
    # At max_split_size (20 MiB, vLLM's load) and above, blocks are not split: the rest is lost.
    assert torch_segments_bytes([21 * MiB, 3 * MiB // 2]) == 22 * MiB + 20 * MiB
    # Small and large pools never share blocks.
    assert torch_segments_bytes([19 * MiB, MiB // 2]) == 20 * MiB + 2 * MiB
