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
import sys
import time

import pytest

from e2e import deployment, frmps_bin, http_json
from bench import kv_digests
from bench.procs import alive
from frmps_engine.sdk import kv_digest
from bench.serve import Serve, ServeOpts

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


@pytest.mark.slow
def test_every_fault_is_followed_by_failback_and_streams_stay_exact(tmp_path):
    """Also with the KV digests on (FRMPS_DEBUG_KV_DIGESTS, bench/kv_digests.py): what
    each handover left, each takeover adopted and each prompt was served from holds,
    block for block, the KV its token prefix has everywhere else."""
    kv_dir = str(tmp_path / "kv")
    with deployment(sync_every=1, env={**ENGINE_ENV, kv_digest.ENV: kv_dir}, extra_args=ARGS, fake_mps=True) as dep:
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
    records, torn = kv_digests.load([kv_dir])
    rep = kv_digests.check(records, torn)
    assert rep.events.get("handover-out", 0) >= 2 * len(BODIES) and rep.events.get("adopt", 0) >= 4 * len(BODIES), rep.line()
    # every request's prompt, once per engine that served it: the no-fault run's and two faults' streams
    assert rep.events.get("prompt", 0) >= 3 * len(BODIES), rep.line()
    assert rep.compared > 0 and rep.ok, (rep.line(), rep.violations[:3])


def test_two_spares_restore_back_to_back_faults_from_ready_spares():
    """--spares 2: a fault right after a restore (before the consumed spare's
    replacement could finish its imports) is restored from the other spare,
    ready since the start, not from a cold or half-imported process."""
    with deployment(sync_every=1, env=ENGINE_ENV, extra_args=ARGS + ["--spares=2"], fake_mps=True) as dep:
        deadline = time.monotonic() + 120
        while int((dep.status().get("spare") or {}).get("ready_count", 0)) < 2:
            assert time.monotonic() < deadline, f"two spares not ready: {dep.status().get('spare')}\n{dep.log_tail()}"
            time.sleep(0.05)
        assert int(dep.status()["spare"]["size"]) == 2
        assert int(dep.status()["spare"].get("rss_bytes", 0)) > 2 * (20 << 20)  # two imported interpreters
        taken = []
        for fault in (1, 2):
            sp = dep.status()["spare"]
            assert sp["state"] == "ready" and int(sp.get("ready_count", 0)) >= 1, sp
            taken.append(int(sp["pid"]))
            os.kill(dep.active_pid(), signal.SIGKILL)
            st = wait_placement_restored(dep, fault)
            e = engines(st)
            assert int(e["active"]["pid"]) == taken[-1] and e["active"].get("from_spare"), (taken, e)
        assert taken[0] != taken[1]
        assert int(st["spare"]["activations"]) == 2 and int(st["spare"].get("cold_starts", 0)) == 0, st["spare"]


def test_spare_dies_with_a_killed_supervisor(tmp_path):
    """SIGKILL of the supervisor (the OOM killer): the engines and the spare die with it
    (parent-death signal), leaving no process behind."""
    opts = ServeOpts(frmps=frmps_bin(), python=sys.executable, model="tiny", engine="ref", device="cpu", memory=None,
                     mps=False, sync_every=None,
                     serve_args=["--spare=on", "--state-dir", str(tmp_path / "state"), "--ring-dir", str(tmp_path)])
    srv = Serve(opts, str(tmp_path / "run"), str(tmp_path / "serve.log"))
    proc = srv.start()
    try:
        deadline, st = time.monotonic() + 120, {}
        while time.monotonic() < deadline and (st.get("spare") or {}).get("state") != "ready":
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                code, _, got = http_json("GET", f"{srv.admin_url}/v1/admin/status", timeout=5)
                st = got if code == 200 else {}
            except OSError:  # not listening yet
                st = {}
            time.sleep(0.1)
        assert (st.get("spare") or {}).get("state") == "ready", st
        pids = [int(e["pid"]) for e in st["engines"]] + [int(st["spare"]["pid"])]
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 20
    left = pids
    while left and time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]  # a zombie is dead, waiting for init to reap it
        time.sleep(0.05)
    assert not left, f"processes left after the supervisor was killed: {left}"
