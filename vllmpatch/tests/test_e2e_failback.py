"""Acceptance on the CPU: failback through the real supervisor.

`frmps serve` with real reference engines and the MPS control daemon's test
double (engines are placed as on a GPU; on the CPU they do not use MPS). Each
SIGKILL of the active (the stand-in for an MPS fault) is followed by a
failover to the standby outside MPS, a fresh standby started inside MPS and a
planned handover back to it: after every fault the active is in MPS again and
the standby outside, and every stream finished token-identical to the
no-fault run, each token once. With --spare on (the default on GPUs), the
engine started after each fault is the spare, an engine process started ahead
of need with its imports done.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import pytest

from e2e import deployment

pytestmark = [pytest.mark.torch, pytest.mark.timeout(600)]

ENGINE_ENV = {"FRMPS_TEST_STEP_DELAY_MS": "15"}
ARGS = ["--max-restarts=1000", "--spare=on"]
# Long enough (~15 ms a step) to span the failover, the fresh standby's start and the handover.
MAX_TOKENS = 900
BODIES = [{"model": "tiny", "prompt": f"request {i}: " + "abc " * (5 + 3 * i), "max_tokens": MAX_TOKENS, "ignore_eos": True,
           **({"temperature": 0.9, "seed": 40 + i} if i % 2 else {"temperature": 0.0})} for i in range(4)]


def engines(st: dict) -> dict:
    return {e["role"]: e for e in st.get("engines", [])}


def wait_placement_restored(dep, failbacks: int, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    st: dict = {}
    while time.monotonic() < deadline:
        st = dep.status()
        fb = st.get("failback") or {}
        e = engines(st)
        if (st.get("state") == "serving_ready" and int(fb.get("succeeded", 0)) >= failbacks and fb.get("placement_ok")
                and e.get("active", {}).get("in_mps") and not e.get("standby", {}).get("in_mps")):
            return st
        time.sleep(0.05)
    raise AssertionError(f"placement not restored within {timeout}s: {st}\n{dep.log_tail()}")


def wait_spare_ready(dep, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    st: dict = {}
    while time.monotonic() < deadline:
        st = dep.status()
        if (st.get("spare") or {}).get("state") == "ready":
            return st
        time.sleep(0.05)
    raise AssertionError(f"no ready spare within {timeout}s: {st.get('spare')}\n{dep.log_tail()}")


def test_every_fault_is_followed_by_failback_and_streams_stay_exact():
    with deployment(sync_every=1, env=ENGINE_ENV, extra_args=ARGS, fake_mps=True) as dep:
        st = dep.status()
        assert engines(st)["active"]["in_mps"] and not engines(st)["standby"].get("in_mps")
        with cf.ThreadPoolExecutor(len(BODIES)) as pool:
            reference = list(pool.map(lambda b: dep.stream("/v1/completions", b), BODIES))
        for r in reference:
            assert r.done and r.error is None and len(r.token_ids) == MAX_TOKENS
        for fault in range(1, 3):
            spare_pid = int(wait_spare_ready(dep)["spare"]["pid"])
            standby_pid = int(engines(dep.status())["standby"]["pid"])
            with cf.ThreadPoolExecutor(len(BODIES)) as pool:
                futs = [pool.submit(dep.stream, "/v1/completions", b) for b in BODIES]
                time.sleep(0.6)  # mid-stream
                os.kill(dep.active_pid(), signal.SIGKILL)
                got = [f.result() for f in futs]
                ended = time.time()
            for r, ref in zip(got, reference):
                assert r.error is None and r.done, r.error
                assert r.token_ids == ref.token_ids, f"fault {fault}: output differs from the no-fault run"
                assert r.completion_tokens == len(ref.token_ids) and len(r.ids) == 1
            st = wait_placement_restored(dep, fault)
            # The handover ran while the streams were still open: it moved them too.
            assert int(st["failback"]["last_unix_nanos"]) / 1e9 < ended, "the streams ended before the handover"
            e = engines(st)
            # The engine promoted by the failover is the standby again, asleep outside MPS.
            assert int(e["standby"]["pid"]) == standby_pid, (standby_pid, e)
            assert int(st["failback"]["failed"]) == 0
            # The engine started after the fault, now the active in MPS, was the spare.
            assert int(e["active"]["pid"]) == spare_pid and e["active"].get("from_spare"), (spare_pid, e)
            assert int(st["spare"]["activations"]) == fault and int(st["spare"].get("cold_starts", 0)) == 0, st["spare"]
            with open(e["active"]["log_path"]) as f:
                assert "spare activated after" in f.read()
        assert len(st["failovers"]) == 2
        # A handover moved every request with a fresh sync: a stream's longest pause
        # during it is reported by the supervisor as the handover's first-token time.
        assert float(st["failback"]["last_duration_seconds"]) > 0
