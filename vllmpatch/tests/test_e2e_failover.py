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
ENGINE_ENV = {"FRMPS_TEST_STEP_DELAY_MS": "15"}
ENGINE_ARGS = ["--engine-arg=--max-num-batched-tokens=64"]

LONG_PROMPT = "Once upon a time, in a land of shared GPUs, " * 8   # ~350 byte tokens: 6 prefill chunks
KILL_POINTS = ["before_first_token", "mid_prefill", 1, 2, 15, 16, 17, 100]


def request_body(i: int, seeded: bool) -> dict:
    body = {"model": "tiny", "prompt": LONG_PROMPT[: 40 + 37 * i], "max_tokens": 140 + 9 * i,
            "ignore_eos": True}
    if seeded:
        body.update(temperature=0.9, top_p=0.95, top_k=50, seed=1000 + i)
    else:
        body.update(temperature=0.0)
    return body


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


@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kill_at", KILL_POINTS, ids=str)
def test_failover_is_exact(dep: Deployment, kill_at, seeded: bool, concurrency: int):
    bodies = [request_body(i, seeded) for i in range(concurrency)]
    reference = run_batch(dep, bodies)
    for r in reference:
        assert r.done and r.error is None and r.completion_tokens == len(r.token_ids) > 0

    failovers_before = len(dep.status().get("failovers") or [])
    killer = Killer(dep, after=kill_at if isinstance(kill_at, int) else 1)
    delay = {"before_first_token": 0.005, "mid_prefill": 0.045}.get(kill_at) if isinstance(kill_at, str) else None
    got = run_batch(dep, bodies, killer, kill_delay_s=delay)
    assert killer.fired.is_set()

    for ref, out in zip(reference, got):
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
    prompt_len = len(body["prompt"])
    # at kill time >= 40 tokens were out; the last sync is at most sync_every steps old
    assert reused >= prompt_len + 40 - 16 - 1
    assert prefilled <= 16 + 1 + 8   # tokens after the last sync (+ in-flight slack)
