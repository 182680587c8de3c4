"""vLLM tensor parallelism (frmps_engine/vllm/tp.py) in its CPU-testable
parts: the per-rank pool layout and weights estimate, the role/pools hand-off to the
workers, the fd exchange between rank 0 and the ranks, and rank 0's group memory
driving ranks through ``ExecutorDouble`` — a labelled test double for vLLM's
MultiprocExecutor.collective_rpc that runs the callable for every rank on threads
of this process, each with the rank's own PoolController double. vLLM's workers,
GPUs and the interceptor are not involved: the path as a whole needs two GPUs."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest

from frmps_engine.sdk.memory.base import MemoryError_, PoolSpec, SizeMismatch
from frmps_engine.vllm import tp
from frmps_engine.vllm.testing import TINY_QWEN2, write_tiny_model


def memfd(content: bytes) -> int:
    fd = os.memfd_create("frmps-tp-test")
    os.write(fd, content)
    return fd


def read_fd(fd: int) -> bytes:
    return os.pread(fd, 64, 0)


SPECS = [PoolSpec("weights", 0, 4096), PoolSpec("kv_cache", 0, 2048),
         PoolSpec("weights", 1, 4096), PoolSpec("kv_cache", 1, 2048)]


def test_pools_reach_the_workers_through_their_environment():
    raw = tp.pools_env(SPECS, "standby", "cuda-vmm")
    role, memory, specs = tp.parse_pools_env(raw)
    assert (role, memory, specs) == ("standby", "cuda-vmm", SPECS)
    assert tp.rank_specs(specs, 1) == SPECS[2:]
    for bad in ("", "{}", '{"role": "boss", "memory": "m", "pools": [["weights", 0, 1]]}',
                '{"role": "active", "memory": "m", "pools": []}'):
        with pytest.raises(ValueError):
            tp.parse_pools_env(bad)
    with pytest.raises(ValueError):
        tp.pools_env(SPECS, "spare", "cuda-vmm")


class RankController:
    """Test double of one rank's PoolController (its specs, fds, brokered mapping, flips)."""

    def __init__(self, rank: int, specs):
        self.specs = [s for s in specs if s.index == rank]
        self.exported = [memfd(f"rank{rank}-{s.tag}".encode()) for s in self.specs]
        self.brokered: list[bytes] = []
        self.suspended = False
        self.backend = SimpleNamespace(flips=[])
        self.backend.make_writable = lambda tag: self.backend.flips.append((tag, "rw"))
        self.backend.make_readonly = lambda tag: self.backend.flips.append((tag, "ro"))

    def fds(self):
        return list(self.exported)

    def provide_brokered(self, fds):
        self.brokered = [read_fd(fd) for fd in fds]
        for fd in fds:
            os.close(fd)

    def suspend(self):
        self.suspended = True


class ExecutorDouble:
    """Labelled double of vLLM's MultiprocExecutor.collective_rpc: the callable runs for
    every rank at once (threads), with ``get_controller()`` answering each rank's own."""

    def __init__(self, ranks: int, monkeypatch, fail_rank: int | None = None):
        from frmps_engine.vllm import pools

        self.local = threading.local()
        self.controllers = [RankController(r, SPECS) for r in range(ranks)]
        self.fail_rank = fail_rank
        monkeypatch.setattr(pools, "get_controller", lambda: self.local.controller)

    def collective_rpc(self, fn, args=()):
        results, errors = [None] * len(self.controllers), []

        def one(rank):
            self.local.controller = self.controllers[rank]
            try:
                if rank == self.fail_rank:
                    raise RuntimeError(f"rank {rank} failed before connecting")
                results[rank] = fn(SimpleNamespace(rank=rank), *args)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=one, args=(r,)) for r in range(len(self.controllers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        if errors:
            raise errors[0]
        return results


def test_group_memory_collects_every_ranks_fds_for_the_runner(monkeypatch):
    ex = ExecutorDouble(2, monkeypatch)
    gm = tp.VllmGroupMemory("cuda-vmm", 2)
    pools = gm.allocate(SPECS)
    assert [p.spec for p in pools] == SPECS and all(p.fd == -1 for p in pools)
    gm.attach(ex)
    gm.collect()
    assert [read_fd(p.fd) for p in pools] == [b"rank0-weights", b"rank0-kv_cache", b"rank1-weights", b"rank1-kv_cache"]
    gm.close()
    assert all(p.fd == -1 for p in pools)


def test_rank_zero_gathers_each_ranks_triton_start_line(monkeypatch):
    """Each worker's own compile watch (tp_worker installs it); rank 0 logs the ranks' lines."""
    from frmps_engine.vllm import triton_watch

    ex = ExecutorDouble(2, monkeypatch)
    gm = tp.VllmGroupMemory("cuda-vmm", 2)
    gm.allocate(SPECS)
    gm.attach(ex)
    monkeypatch.setattr(triton_watch, "PROCESS_WATCH", None)
    assert gm.rank_triton_summaries() == ["no Triton compile watch in this rank"] * 2
    w = triton_watch.TritonCompileWatch()
    w.hits = 3
    monkeypatch.setattr(triton_watch, "PROCESS_WATCH", w)
    lines = gm.rank_triton_summaries()
    assert len(lines) == 2 and all(x.startswith("Triton during the start: 3 kernels from the cache, 0 compiled")
                                   for x in lines)


def test_group_memory_hands_each_rank_its_brokered_fds_and_flips_every_rank(monkeypatch):
    ex = ExecutorDouble(2, monkeypatch)
    gm = tp.VllmGroupMemory("cuda-vmm", 2)
    gm.reserve(SPECS)
    gm.attach(ex)
    fds = [memfd(f"brokered-{s.tag}-{s.index}".encode()) for s in SPECS]
    pools = gm.map(SPECS, fds, readonly=True)
    assert all(p.readonly for p in pools)
    for fd in fds:  # rank 0's copies are closed: the ranks hold their own
        with pytest.raises(OSError):
            os.fstat(fd)
    assert ex.controllers[1].brokered == [b"brokered-weights-1", b"brokered-kv_cache-1"]
    assert all(c.suspended for c in ex.controllers)
    gm.make_writable("kv_cache")
    gm.make_readonly("kv_cache")
    assert [c.backend.flips for c in ex.controllers] == [[("kv_cache", "rw"), ("kv_cache", "ro")]] * 2


def test_group_memory_refuses_what_is_not_its_layout(monkeypatch):
    gm = tp.VllmGroupMemory("cuda-vmm", 2)
    with pytest.raises(MemoryError_, match="ranks \\[0\\]"):
        gm.allocate(SPECS[:2])
    gm.reserve(SPECS)
    with pytest.raises(MemoryError_, match="not up yet"):
        gm.make_writable("kv_cache")
    gm.attach(ExecutorDouble(2, monkeypatch))
    fds = [memfd(b"x") for _ in SPECS[:2]]
    with pytest.raises(SizeMismatch):
        gm.map(SPECS[:2], fds, readonly=True)
    for fd in fds:  # closed even when refused
        with pytest.raises(OSError):
            os.fstat(fd)


def test_a_rank_that_fails_ends_the_exchange_at_once(monkeypatch):
    """A rank that raises before connecting: the error comes back now, not after the
    exchange's timeout, and the other ranks' fds are not kept."""
    import time

    ex = ExecutorDouble(2, monkeypatch, fail_rank=1)
    gm = tp.VllmGroupMemory("cuda-vmm", 2)
    pools = gm.allocate(SPECS)
    gm.attach(ex)
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        gm.collect()
    assert time.monotonic() - t < 10
    assert all(p.fd == -1 for p in pools)


def test_the_exchange_refuses_a_peer_without_the_token():
    with tp.FdExchange() as x:
        assert os.stat(x.dir).st_mode & 0o777 == 0o700 and os.stat(x.path).st_mode & 0o777 == 0o600

        def rpc():
            with pytest.raises(Exception):
                tp._call_rank_zero(x.path, "not-the-token", 0, {"op": "pools"})

        with pytest.raises(MemoryError_, match="unexpected peer"):
            x.run(1, lambda *a: None, rpc, timeout=10)
    assert not os.path.exists(x.dir)


def test_per_rank_weights_and_kv_pools(tmp_path, monkeypatch):
    from frmps_engine.vllm.engine import make_adapter
    from frmps_engine.vllm.modelcfg import weight_tensors

    cfg = {**TINY_QWEN2, "tie_word_embeddings": False}
    one, two = weight_tensors(cfg, "float32"), weight_tensors(cfg, "float32", tp=2)
    h = cfg["hidden_size"]
    norms = (2 * cfg["num_hidden_layers"] + 1) * h * 4  # replicated on every rank
    assert sum(two) - norms == (sum(one) - norms) // 2
    with pytest.raises(ValueError, match="does not divide"):
        weight_tensors({**cfg, "num_attention_heads": 6, "num_key_value_heads": 3}, "float32", tp=4)

    model = write_tiny_model(tmp_path / "m")
    args = SimpleNamespace(model=model, num_blocks=4096, dtype="float32", device="cuda", tensor_parallel_size=2)
    layout2 = make_adapter(args).pool_layout()
    layout1 = make_adapter(SimpleNamespace(**{**vars(args), "tensor_parallel_size": 1})).pool_layout()
    assert [(s.tag, s.index) for s in layout2] == [("weights", 0), ("kv_cache", 0), ("weights", 1), ("kv_cache", 1)]
    assert layout2[0].size == layout2[2].size and layout2[1].size == layout2[3].size
    assert layout2[1].size < layout1[1].size  # 2 KV heads: one per rank
    ad = make_adapter(args)
    ea = ad.engine_args(True, 0.5)
    assert ea.tensor_parallel_size == 2 and ea.distributed_executor_backend == "mp" and ea.disable_custom_all_reduce
    assert ea.worker_extension_cls == tp.WORKER_EXTENSION
    # Rank 0 opens no device: its memory backend is a name, and the group memory replaces it.
    from frmps_engine.sdk import memory

    one = make_adapter(SimpleNamespace(**{**vars(args), "tensor_parallel_size": 1}))
    assert ad.workers_own_pools and not one.workers_own_pools
    gm = ad.group_memory(memory.BackendName("cuda-vmm"))
    assert isinstance(gm, tp.VllmGroupMemory) and gm.name == "cuda-vmm" and gm.ranks == 2
    with pytest.raises(memory.MemoryError_):
        memory.BackendName("disk")


def test_worker_setup_builds_only_a_tp_workers_own_pools(monkeypatch):
    from frmps_engine.vllm import allocation, pools

    installed = []
    monkeypatch.setattr(pools, "install_controller", installed.append)
    monkeypatch.setattr(pools, "set_context_factory", lambda f: None)
    monkeypatch.setattr(allocation, "cuda_contexts", lambda c: None)
    worker = SimpleNamespace(rank=1, device="cpu")
    assert tp.worker_setup(worker, env={}) is False and not installed
    env = {tp.POOLS_ENV: tp.pools_env(SPECS, "active", "host-shm")}
    assert tp.worker_setup(worker, env=env) is True
    (c,) = installed
    try:
        assert [s.index for s in c.specs] == [1, 1] and c.role == "active" and c.state == "READY"
        assert len(c.fds()) == 2
    finally:
        c.backend.close()
    with pytest.raises(MemoryError_, match="no pools"):
        tp.worker_setup(SimpleNamespace(rank=5, device="cpu"), env=env)


def test_a_spawned_worker_registers_the_plugin_through_the_worker_extension(tmp_path):
    """What vLLM's worker does in a fresh (spawned) process: resolve the engine's
    worker_extension_cls. With frmps_engine only on PYTHONPATH (no entry point to
    find), that import alone must put the tp-worker-pools patch on Worker.init_device."""
    import subprocess
    import sys

    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(tp.__file__))))
    probe = (
        "from vllm.utils.import_utils import resolve_obj_by_qualname\n"
        "from frmps_engine.vllm import triton_watch\n"
        "from frmps_engine.vllm.patches import TP_WORKER_POOLS\n"
        "assert triton_watch.PROCESS_WATCH is None\n"
        "assert not TP_WORKER_POOLS.is_applied()\n"
        f"ext = resolve_obj_by_qualname({tp.WORKER_EXTENSION!r})\n"
        "from frmps_engine.vllm import plugin\n"
        "assert plugin.is_registered()\n"
        "assert TP_WORKER_POOLS.is_applied()\n"
        "import importlib.util\n"
        "if importlib.util.find_spec('triton'):\n"
        "    assert triton_watch.PROCESS_WATCH is not None, 'no compile watch in the worker'\n"
        "assert not [a for a in vars(ext) if not a.startswith('__')], 'the extension adds attributes'\n"
        "import logging\n"
        "logging.getLogger('frmps_engine.vllm.tp').info('a rank line')\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # The test environments install frmps_engine with its entry point: VLLM_PLUGINS keeps vLLM from
    # loading it, as in a worker of an engine run from a source tree.
    env.update(PYTHONPATH=src, VLLM_PLUGINS="none")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1] == "ok"
    assert "INFO frmps_engine.vllm.tp: a rank line" in out.stderr  # a worker's frmps lines reach its log


def test_rank_zero_starts_its_workers_with_spawn(tmp_path, monkeypatch):
    """A forked worker would hold rank 0's connection to the supervisor open after rank 0 died."""
    model = write_tiny_model(tmp_path / "m")
    monkeypatch.setenv(tp.MULTIPROC_METHOD_ENV, "fork")
    monkeypatch.setenv(tp.POOLS_ENV, "")  # restored (removed) after the test
    from frmps_engine.sdk import memory
    from frmps_engine.vllm.engine import make_adapter

    ad = make_adapter(SimpleNamespace(model=model, num_blocks=4096, dtype="float32", device="cuda",
                                      tensor_parallel_size=2))
    ad.group_memory(memory.BackendName("cuda-vmm"))
    ad._tp_prepare(load_weights=False)
    assert os.environ[tp.MULTIPROC_METHOD_ENV] == "spawn"
    assert tp.parse_pools_env(os.environ[tp.POOLS_ENV])[0] == "standby"


def test_a_failed_step_finds_the_dead_worker(tmp_path, monkeypatch):
    """vLLM's executor raises "Executor failed" once its monitor saw a worker die, before
    its failure callback runs: dead_peer must name the dead worker for the runner (the
    requests then stay open for the standby), and the callback must report the same.
    The executor is a labelled double: its workers' ``proc.exitcode`` is all that is read."""
    model = write_tiny_model(tmp_path / "m")
    monkeypatch.setenv(tp.MULTIPROC_METHOD_ENV, "spawn")
    from frmps_engine.sdk import memory
    from frmps_engine.vllm.engine import make_adapter

    ad = make_adapter(SimpleNamespace(model=model, num_blocks=4096, dtype="float32", device="cuda",
                                      tensor_parallel_size=2))
    ad.group_memory(memory.BackendName("cuda-vmm"))
    assert ad.dead_peer(0.05) is None, "no workers yet: nobody died"
    workers = [SimpleNamespace(rank=r, proc=SimpleNamespace(pid=100 + r, exitcode=None)) for r in range(2)]
    ad._group_memory.attach(SimpleNamespace(workers=workers))
    assert ad.dead_peer(0.05) is None
    threading.Timer(0.2, lambda: setattr(workers[1].proc, "exitcode", -9)).start()
    assert ad.dead_peer(10) == "tensor-parallel rank 1 (vLLM worker pid 101) died: killed by signal 9"
    # vLLM's executor then shuts rank 0 down: the one that died first is still the one named.
    workers[0].proc.exitcode = -15
    reported = []
    ad.on_peer_death(reported.append)
    ad._worker_died()
    assert reported == ["tensor-parallel rank 1 (vLLM worker pid 101) died: killed by signal 9"]
    one = make_adapter(SimpleNamespace(model=model, num_blocks=4096, dtype="float32", device="cuda"))
    assert one.dead_peer(10) is None
