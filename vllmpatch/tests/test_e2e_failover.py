"""Acceptance: real failover on the CPU through the real supervisor.

`frmps serve` runs the Go supervisor with an active and a standby reference
engine (tiny model, host-shm pools). We SIGKILL the active at chosen points of
a streamed generation and check that every resumed output equals the no-fault
output token for token, that each client gets every token exactly once, that
the standby reused the synced KV instead of recomputing it, and that a fresh
standby is re-armed after every failover.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest

from e2e import Deployment, Killer, deployment

pytestmark = [pytest.mark.torch, pytest.mark.timeout(1200)]

# A slow step makes "before the first token" and "mid-prefill" reachable from
# outside; the prefill chunk budget splits the long prompt into several steps.
ENGINE_ENV = {"FRMPS_TEST_STEP_DELAY_MS": "10"}
# Every test kills on purpose: keep the crash-loop breaker out of the way.
ENGINE_ARGS = ["--engine-arg=--max-num-batched-tokens=64", "--max-restarts=1000000"]

LONG_PROMPT = "Once upon a time, in a land of shared GPUs, " * 8   # 352 byte-level tokens
KILL_POINTS = ["before_first_token", "mid_prefill", 1, 2, 15, 16, 17, 100]


def request_body(i: int, seeded: bool) -> dict:
    # request 0 has the longest prompt (5 prefill chunks), so "mid-prefill" is reachable
    body = {"model": "tiny", "prompt": LONG_PROMPT[: 300 - 30 * i], "max_tokens": 140 + 9 * i,
            "ignore_eos": True}
    if seeded:
        body.update(temperature=0.9, top_p=0.95, top_k=50, seed=1000 + i)
    else:
        body.update(temperature=0.0)
    return body


# Workloads: one request alone (greedy or seeded), or 8 concurrent requests of
# different lengths, half greedy and half seeded.
WORKLOADS = {
    "1-greedy": [request_body(0, seeded=False)],
    "1-seeded": [request_body(0, seeded=True)],
    "8-mixed": [request_body(i, seeded=i % 2 == 1) for i in range(8)],
}


def run_batch(dep: Deployment, bodies: list[dict], killer: Killer | None = None,
              kill_delay_s: float | None = None):
    with cf.ThreadPoolExecutor(len(bodies)) as pool:
        futs = [pool.submit(dep.stream, "/v1/completions", b, killer.on_token if (killer and i == 0
                            and kill_delay_s is None) else None) for i, b in enumerate(bodies)]
        if killer and kill_delay_s is not None:
            time.sleep(kill_delay_s)
            killer.fire()
        return [f.result() for f in futs]


@pytest.fixture(scope="module", params=[1, 16], ids=lambda n: f"sync{n}")
def dep(request):
    with deployment(sync_every=request.param, env=ENGINE_ENV, extra_args=ENGINE_ARGS) as d:
        yield d


@pytest.fixture(scope="module")
def reference(dep):
    """No-fault outputs per workload, computed once per deployment."""
    cache: dict[str, list] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = run_batch(dep, WORKLOADS[name])
            for r in cache[name]:
                assert r.done and r.error is None and r.completion_tokens == len(r.token_ids) > 0
        return cache[name]
    return get


@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize("kill_at", KILL_POINTS, ids=str)
def test_failover_is_exact(dep: Deployment, reference, kill_at, workload: str):
    bodies = WORKLOADS[workload]
    ref_outs = reference(workload)

    failovers_before = len(dep.status().get("failovers") or [])
    killer = Killer(dep, after=kill_at if isinstance(kill_at, int) else 1)
    delay = {"before_first_token": 0.003, "mid_prefill": 0.03}.get(kill_at) if isinstance(kill_at, str) else None
    got = run_batch(dep, bodies, killer, kill_delay_s=delay)
    assert killer.fired.is_set()

    for ref, out in zip(ref_outs, got):
        assert out.error is None, out.error
        assert out.done, "stream closed without [DONE]"
        assert len(out.ids) == 1, f"one completion id across the failover, got {out.ids}"
        assert out.token_ids == ref.token_ids, "resumed output differs from the no-fault run"
        assert out.text == ref.text
        assert out.completion_tokens == ref.completion_tokens == len(ref.token_ids)
        assert out.finish_reason == ref.finish_reason

    st = dep.wait_state("serving_ready")          # a fresh standby was re-armed
    fos = st.get("failovers") or []
    assert len(fos) == failovers_before + 1, fos
    assert fos[0]["ok"], fos[0]
    assert float(fos[0]["first_token_seconds"]) > 0, fos[0]
    assert dep.active_pid() != killer.pid


def test_resume_reuses_synced_kv(dep: Deployment):
    """Engine counters prove the standby did not recompute tokens the last sync covered."""
    body = request_body(3, seeded=True)
    killer = Killer(dep, after=40)
    run_batch(dep, [body], killer)
    st = dep.wait_state("serving_ready")
    fo = st["failovers"][0]
    assert fo["ok"], fo
    reused, prefilled = int(fo["reused_tokens"]), int(fo["prefilled_tokens"])
    prompt_len = len(body["prompt"])  # byte-level tokenizer: one token per byte
    # at kill time >= 40 tokens were out; the last sync is at most sync_every steps old
    assert reused >= prompt_len + 40 - 16 - 1
    assert prefilled <= 16 + 1 + 8   # tokens after the last sync (+ in-flight slack)


@pytest.fixture(scope="module")
def exact_dep():
    args = ENGINE_ARGS + ["--engine-arg=--exact", "--engine-arg=--max-num-seqs=8"]
    with deployment(sync_every=16, env=ENGINE_ENV, extra_args=args) as d:
        yield d


@pytest.mark.parametrize("kill_at", ["mid_prefill", 2, 17, 100], ids=str)
def test_failover_is_exact_in_exact_mode(exact_dep: Deployment, kill_at):
    """The same acceptance with the engines in exact mode (the GPU default): the
    standby replays the unsynced tokens by decode steps and still matches."""
    bodies = WORKLOADS["8-mixed"]
    ref_outs = run_batch(exact_dep, bodies)
    killer = Killer(exact_dep, after=kill_at if isinstance(kill_at, int) else 1)
    got = run_batch(exact_dep, bodies, killer, kill_delay_s=0.03 if kill_at == "mid_prefill" else None)
    assert killer.fired.is_set()
    for ref, out in zip(ref_outs, got):
        assert out.error is None and out.done, out.error
        assert out.token_ids == ref.token_ids, "resumed output differs from the no-fault run"
    st = exact_dep.wait_state("serving_ready")
    assert st["failovers"][0]["ok"], st["failovers"][0]
