"""Acceptance: tensor parallelism (TP=2 over gloo) through the real supervisor.

`frmps serve --tensor-parallel-size 2` on the CPU: each engine is a group of two
processes, rank 0 (the engine the supervisor launched) and rank 1 (its child).
While concurrent streams run we SIGKILL rank 1 of the active (a worker: rank 0
must notice and die, and the standby group takes over), then rank 0 of the new
active; every stream must equal the no-fault TP=2 run token for token, and no
rank may outlive its group, during the run or after shutdown.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import pytest

from e2e import Deployment, deployment
from bench.procs import live_children, wait_gone

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(600)]

ENGINE_ENV = {"FRMPS_TEST_STEP_DELAY_MS": "5"}
ENGINE_ARGS = ["--tensor-parallel-size=2", "--engine-arg=--max-num-batched-tokens=64", "--max-restarts=1000000"]
PROMPT = "Tensor parallel groups fail as one. " * 4


def bodies() -> list[dict]:
    out = []
    for i in range(4):
        b = {"model": "tiny", "prompt": PROMPT[: 140 - 20 * i], "max_tokens": 90 + 7 * i, "ignore_eos": True}
        b.update(temperature=0.9, top_p=0.95, seed=50 + i) if i % 2 else b.update(temperature=0.0)
        out.append(b)
    return out


def engines(dep: Deployment) -> dict[str, int]:
    return {e["role"]: int(e["pid"]) for e in dep.status().get("engines", []) if e.get("pid")}


def active_log(dep: Deployment) -> str:
    return next(e["log_path"] for e in dep.status()["engines"] if e["role"] == "active")


def exit_line(path: str, timeout: float = 20.0) -> str:
    """The supervisor's record of how the engine logging to path exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if " exited: " in line and line.startswith("frmps: ")]
        if lines:
            return lines[-1]
        time.sleep(0.05)
    return ""


def run(dep: Deployment, kill_pid: int | None = None, after: int = 20):
    fired = []

    def on_token(n: int) -> None:
        if kill_pid is not None and n >= after and not fired:
            fired.append(n)
            os.kill(kill_pid, signal.SIGKILL)

    bs = bodies()
    with cf.ThreadPoolExecutor(len(bs)) as pool:
        futs = [pool.submit(dep.stream, "/v1/completions", b, on_token if i == 0 else None) for i, b in enumerate(bs)]
        outs = [f.result() for f in futs]
    if kill_pid is not None:
        assert fired, "the kill never fired"
    return outs


def check_same(ref, got) -> None:
    for r, o in zip(ref, got):
        assert o.error is None, o.error
        assert o.done and len(o.ids) == 1
        assert o.token_ids == r.token_ids, "resumed TP=2 output differs from the no-fault TP=2 run"
        assert o.completion_tokens == r.completion_tokens == len(r.token_ids)


def test_tp2_failover_on_either_rank():
    seen_ranks: set[int] = set()
    with deployment(sync_every=1, env=ENGINE_ENV, extra_args=ENGINE_ARGS) as dep:
        st = dep.status()
        assert st.get("tensor_parallel_size") == 2, st
        pids = engines(dep)
        groups = {role: live_children(pid) for role, pid in pids.items()}
        assert all(len(c) == 1 for c in groups.values()), f"each engine must have one worker rank: {groups}"
        seen_ranks |= {p for c in groups.values() for p in c}
        ref = run(dep)
        for r in ref:
            assert r.done and r.error is None and r.completion_tokens == len(r.token_ids) > 0

        # 1. A worker (rank 1) of the active dies: rank 0 reports it and exits; the standby group takes over.
        old_active, old_standby, worker = pids["active"], pids["standby"], groups["active"][0]
        old_log = active_log(dep)
        check_same(ref, run(dep, kill_pid=worker))
        st = dep.wait_state("serving_ready")
        fo = st["failovers"][0]
        assert fo["ok"], fo
        assert "tensor-parallel rank 1" in fo["detail"], fo
        assert exit_line(old_log).endswith("exited: exit code 4"), "rank 0 must exit with its peer-died code"
        assert wait_gone([old_active, worker]) == [], "the failed group left a rank behind"
        pids = engines(dep)
        assert pids["active"] == old_standby, "the standby group did not take over"
        new_groups = {role: live_children(pid) for role, pid in pids.items()}
        seen_ranks |= {p for c in new_groups.values() for p in c}

        # 2. Rank 0 of the new active dies: its worker must not survive it.
        old_active, old_standby, worker = pids["active"], pids["standby"], new_groups["active"][0]
        check_same(ref, run(dep, kill_pid=old_active, after=35))
        st = dep.wait_state("serving_ready")
        assert len(st["failovers"]) == 2 and st["failovers"][0]["ok"], st["failovers"]
        assert engines(dep)["active"] == old_standby
        assert wait_gone([old_active, worker]) == [], "rank 1 outlived its rank 0"
        pids = engines(dep)
        seen_ranks |= {p for pid in pids.values() for p in live_children(pid)}
        seen_ranks |= set(pids.values())
    assert wait_gone(seen_ranks) == [], "ranks left after shutdown"
