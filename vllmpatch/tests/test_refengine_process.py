"""Takeover across processes: an active engine process maps file-backed pools,
runs, syncs, runs on and is SIGKILLed; this process maps the same files with
load_weights=False, adopts, and must continue exactly like a no-fault run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from e2e import require

torch = require("torch")
pytestmark = pytest.mark.torch

from frmps_engine.refengine import EngineConfig, RefCore, SamplingParams, pool_layout  # noqa: E402

ACTIVE = textwrap.dedent(
    """
    import json, os, signal, sys, torch
    torch.set_num_threads(1)
    from frmps_engine.refengine import EngineConfig, RefCore, SamplingParams, pool_layout
    d = sys.argv[1]
    cfg = EngineConfig.from_preset("tiny", num_blocks=64, max_num_batched_tokens=24)
    pools = {(p.tag, p.index): torch.from_file(os.path.join(d, f"{p.tag}-{p.index}"), shared=True, size=p.size,
                                               dtype=torch.uint8) for p in pool_layout(cfg)}
    core = RefCore(cfg, pools, load_weights=True)
    for key, ids, kw in json.loads(sys.argv[2]):
        core.add_request(key, ids, SamplingParams(**kw))
    got = {}
    views = []
    for step in range(1, 20):
        for o in core.step():
            got.setdefault(o.key, []).extend(o.new_token_ids)
        if step == 11:
            views = [dict(key=v.key, seed=v.seed, block_ids=v.block_ids, token_ids=v.token_ids,
                          num_prompt=v.num_prompt, num_computed=v.num_computed, finished=v.finished)
                     for v in core.request_views()]
    print(json.dumps(dict(views=views, delivered=got)), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_kill9_active_process_then_adopt(tmp_path):
    cfg = EngineConfig.from_preset("tiny", num_blocks=64, max_num_batched_tokens=24)
    for p in pool_layout(cfg):
        with open(tmp_path / f"{p.tag}-{p.index}", "wb") as f:
            f.truncate(p.size)
    g = torch.Generator().manual_seed(9)
    reqs = [(k, torch.randint(0, 256, (n,), generator=g).tolist(),
             dict(max_tokens=30, temperature=0.0 if k % 2 else 0.7, seed=k if k == 2 else None, ignore_eos=True))
            for k, n in [(1, 30), (2, 9), (3, 50), (4, 2)]]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", ACTIVE, str(tmp_path), json.dumps(reqs)], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    state = json.loads(r.stdout)
    delivered = {int(k): v for k, v in state["delivered"].items()}
    views = {v["key"]: v for v in state["views"]}

    ref = RefCore(cfg, RefCore.allocate_pools(cfg), True).generate(
        [(k, ids, SamplingParams(**kw)) for k, ids, kw in reqs])
    pools = {(p.tag, p.index): torch.from_file(str(tmp_path / f"{p.tag}-{p.index}"), shared=True, size=p.size,
                                               dtype=torch.uint8) for p in pool_layout(cfg)}
    standby = RefCore(cfg, pools, load_weights=False)
    reused = 0
    for k, ids, kw in reqs:
        v = views[k]
        assert not v["finished"]
        standby.adopt_request(k, SamplingParams(**kw), v["token_ids"], v["num_prompt"], v["num_computed"],
                              v["block_ids"], v["seed"], delivered.get(k, []))
        reused += v["num_computed"]
    assert reused > 0 and standby.counters["adopted_tokens_reused"] == reused
    final = {k: list(delivered.get(k, [])) for k, _, _ in reqs}
    while standby.has_work():
        for o in standby.step():
            assert o.output_index == len(final[o.key])
            final[o.key] += o.new_token_ids
    assert final == ref
