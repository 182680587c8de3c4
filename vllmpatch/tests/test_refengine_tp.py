"""Tensor parallelism of the reference engine on the CPU: shards, the pool layout,
a TP=2 group over gloo (worker processes started by rank 0) against the unsharded
engine, and the group's death handling."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from e2e import require

torch = require("torch")

from bench.procs import alive, wait_gone  # noqa: E402
from frmps_engine.refengine import ConfigError, EngineConfig, RefCore, SamplingParams, pool_layout  # noqa: E402
from frmps_engine.refengine import tp  # noqa: E402
from frmps_engine.refengine.config import param_specs, rank_pools  # noqa: E402
from frmps_engine.refengine.weights import init_dummy, param_views, shard  # noqa: E402
from frmps_engine.sdk.memory import SizeMismatch  # noqa: E402
from frmps_engine.sdk.memory.host_shm import HostShmBackend  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.timeout(300)]

SRC = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "src"))


def test_config_refuses_uneven_shards():
    cfg = EngineConfig.from_preset("tiny")  # 4 heads, 2 KV heads, intermediate 128
    with pytest.raises(ConfigError, match="num_kv_heads"):
        cfg.replace(tensor_parallel_size=4)
    with pytest.raises(ConfigError, match="num_heads"):
        cfg.replace(tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="positive"):
        cfg.replace(tensor_parallel_size=0)


def test_pool_layout_is_per_rank():
    one = EngineConfig.from_preset("tiny")
    two = one.replace(tensor_parallel_size=2)
    assert [(p.tag, p.index) for p in pool_layout(one)] == [("weights", 0), ("kv_cache", 0)]
    assert [(p.tag, p.index) for p in pool_layout(two)] == [("weights", 0), ("kv_cache", 0), ("weights", 1), ("kv_cache", 1)]
    assert rank_pools(two, 1) == pool_layout(two)[2:]
    # Each rank's KV cache holds half the KV heads; its weights less than the whole.
    kv1, kv2 = pool_layout(one)[1].size, pool_layout(two)[1].size
    assert kv2 * 2 == kv1 or kv2 * 2 - kv1 < 4 << 20
    shapes = {p.name: p.shape for p in param_specs(two)}
    s = one.shape
    assert shapes["layers.0.qkv_proj.weight"] == ((s.q_size + 2 * s.kv_size) // 2, s.hidden_size)
    assert shapes["layers.0.o_proj.weight"] == (s.hidden_size, s.q_size // 2)
    assert shapes["layers.0.down_proj.weight"] == (s.hidden_size, s.intermediate_size // 2)
    assert shapes["embed_tokens"] == (s.vocab_size, s.hidden_size)


def test_dummy_shards_are_cut_from_the_unsharded_weights():
    one = EngineConfig.from_preset("tiny-untied")
    two = one.replace(tensor_parallel_size=2)
    full = param_views(one, RefCore.allocate_pools(one)[("weights", 0)])
    init_dummy(one, full)
    for rank in range(2):
        mine = param_views(two, RefCore.allocate_pools(two, rank)[("weights", rank)])
        init_dummy(two, mine, rank)
        for name, t in mine.items():
            assert torch.equal(t, shard(two, name, full[name], rank)), (rank, name)
    # The two shards of o_proj put together are the whole matrix.
    halves = []
    for rank in range(2):
        w = param_views(two, RefCore.allocate_pools(two, rank)[("weights", rank)])
        init_dummy(two, w, rank)
        halves.append(w["layers.1.o_proj.weight"].clone())
    assert torch.equal(torch.cat(halves, dim=1), full["layers.1.o_proj.weight"])


def _prompts(base: int) -> list:
    return [(base + k, list(range(3 + k, 40 + 23 * k)),
             SamplingParams(max_tokens=24, temperature=0.0 if k % 2 else 0.8, top_p=0.95, seed=k)) for k in range(4)]


@pytest.fixture
def group():
    # One group at a time: torch.distributed has one default group per process.
    cfg = EngineConfig.from_preset("tiny", max_num_batched_tokens=32).replace(tensor_parallel_size=2)
    g = tp.Group(cfg)
    deaths: list[str] = []
    g.on_death = deaths.append  # TEST DOUBLE of the runner's exit: record instead of exiting
    g.deaths = deaths
    yield g
    g.close()


def test_tp2_matches_tp1_and_is_deterministic(group):
    cfg2 = group.cfg
    cfg1 = cfg2.full()
    ref = RefCore(cfg1, RefCore.allocate_pools(cfg1), load_weights=True).generate(_prompts(0))
    mem = tp.GroupMemory(group, HostShmBackend())
    try:
        pools = mem.allocate(pool_layout(cfg2))
        assert [p.spec.index for p in pools] == [0, 0, 1, 1]
        assert all(p.fd >= 0 for p in pools), "every rank's pools come back as fds to export"
        group.build(True)
        core = RefCore(cfg2, {p.spec.key: p.tensor for p in pools}, load_weights=True, comm=group.comm, workers=group)
        core.warmup()
        first = core.generate(_prompts(0))
        second = core.generate(_prompts(100))
    finally:
        mem.close()
    assert first == ref, "TP=2 output differs from the unsharded engine's"
    assert [second[100 + k] for k in range(4)] == [first[k] for k in range(4)], "two TP=2 runs differ"
    assert group.deaths == []


def test_group_memory_refuses_a_foreign_layout(group):
    mem = tp.GroupMemory(group, HostShmBackend())
    bad = [s for s in pool_layout(group.cfg)]
    bad[3] = type(bad[3])("kv_cache", 1, bad[3].size + (2 << 20))
    r, w = os.pipe()
    try:
        with pytest.raises(SizeMismatch):
            mem.map(bad, [os.dup(r) for _ in bad], readonly=True)
    finally:
        os.close(r)
        os.close(w)
        mem.close()


def test_worker_death_is_reported_once_with_its_rank():
    cfg = EngineConfig.from_preset("tiny").replace(tensor_parallel_size=2)
    g = tp.Group(cfg)
    got: list[str] = []
    seen = threading.Event()

    def on_death(cause: str) -> None:  # TEST DOUBLE of the runner's exit
        got.append(cause)
        seen.set()

    g.on_death = on_death
    pid = g.workers[0].proc.pid
    try:
        assert g.dead_peer(0.05) is None, "a live group reported a dead peer"
        os.kill(pid, signal.SIGKILL)
        # What a failed step asks (it may ask before the watcher reaped the worker).
        cause = g.dead_peer(20)
        assert seen.wait(20), "no death reported"
    finally:
        g.close()
    assert got == [f"tensor-parallel rank 1 (pid {pid}) died: killed by signal 9"] == [cause]
    assert not alive(pid)


def test_workers_die_with_rank_0():
    """PR_SET_PDEATHSIG: rank 0 exits without stopping anything, in a session of
    its own (nobody fences its group): its worker must still die."""
    script = textwrap.dedent("""
        import os, sys
        from frmps_engine.refengine import EngineConfig, tp
        g = tp.Group(EngineConfig.from_preset("tiny").replace(tensor_parallel_size=2))
        print(g.workers[0].proc.pid, flush=True)
        sys.stdin.readline()
        os._exit(0)
    """)
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=env, start_new_session=True)
    try:
        worker = int(p.stdout.readline())
        assert alive(worker)
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.wait(60) == 0
        assert wait_gone([worker], 20.0) == [], f"worker {worker} outlived rank 0"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
