"""Chaos through the real `frmps serve` on the CPU (bench.chaos):
concurrent streaming and non-streaming OpenAI clients, completions and chat,
greedy and seeded, while the active is SIGKILLed repeatedly, hung with
SIGSTOP, killed again right after its standby took over (a double fault), and
while the supervisor itself is SIGKILLed and restarted. Every completed output
equals its no-fault output; a request fails only while no engine can serve,
and then cleanly (503 with Retry-After, or an in-stream error after exact
tokens); the supervisor's descriptors and goroutines come back to their
baseline, its only children are the two engines, and nothing is left on disk
after it stops. `make soak` runs the same harness for 1,000 kills."""

from __future__ import annotations

import os
import sys
import time

import pytest

from e2e import frmps_bin
from bench.chaos import (Clients, Serve, baseline, check, double_fault, goroutine_dump, hang_active,
                                      kill_active, kill_supervisor, reference_outputs, settle, summarize, workload)

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.mark.parametrize("spare", [False, True], ids=["cold", "spare"])
def test_chaos(tmp_path, spare):
    # --stall-timeout: the default (30 s) would make the SIGSTOP case slow; 2 s until
    # the hang-detection defaults are shortened. spare: --spare on (the GPU default),
    # every engine after the first pair launched from a spare.
    serve = Serve(frmps_bin(), sys.executable, str(tmp_path), sync_every=4, step_delay_ms=5,
                  extra_args=["--stall-timeout=2s"], spare=spare)
    requests = workload(12)
    t = [time.monotonic()]
    try:
        serve.start()
        reference = reference_outputs(serve, requests)
        serve.wait_spare()
        base = baseline(serve)
        t.append(time.monotonic())
        assert base.children == 2 + spare and base.shm_files == 1 and base.sockets == 4 and base.zombies == 0, base

        windows = []
        with Clients(lambda: serve.base, requests, 6) as clients:
            kill_active(serve)
            kill_active(serve)
            assert hang_active(serve) == "stalled"
            windows.append(double_fault(serve))
            kill_active(serve)
        t.append(time.monotonic())
        fos = serve.failovers()
        problems = check(clients.outcomes, requests, reference, windows)
        assert not problems, "\n".join(problems[:20])
        first = summarize(clients.outcomes)
        assert first["completed"] >= 12, first
        assert sum(int(f.get("resumed_requests", 0)) for f in fos) > 0, "no request was in flight at any failover"
        after, diff = settle(serve, base)
        if diff:  # what the extra goroutines are (ends the supervisor: the run has failed)
            stacks = goroutine_dump(serve) if any(d.startswith("goroutines") for d in diff) else ""
            raise AssertionError(f"not back to the baseline after {len(fos)} failovers: {diff}\n{stacks[:12000]}")
        if spare:  # every engine launched after the first pair was a spare, even in the double fault
            sp = serve.status().get("spare") or {}
            assert int(sp.get("activations", 0)) >= len(fos) and int(sp.get("cold_starts", 0)) == 0, sp

        with Clients(lambda: serve.base, requests, 6) as clients:
            w, stale = kill_supervisor(serve)
            windows.append(w)
            kill_active(serve)
        t.append(time.monotonic())
        assert not stale, f"left by the killed supervisor: {stale}"
        problems = check(clients.outcomes, requests, reference, windows)
        assert not problems, "\n".join(problems[:20])
        second = summarize(clients.outcomes)
        assert second["completed"] >= 6, second
        restarted, diff = settle(serve, base)
        if diff:
            stacks = goroutine_dump(serve) if any(d.startswith("goroutines") for d in diff) else ""
            raise AssertionError(f"the restarted supervisor: {diff}\n{stacks[:12000]}")

        engines = [int(e["pid"]) for e in serve.status()["engines"]]
        assert serve.stop() == 0
        assert not os.listdir(serve.ring_dir), os.listdir(serve.ring_dir)
        assert not os.path.exists(serve.run_dir), os.listdir(serve.run_dir)
        assert serve.records() == []
        assert not [p for p in engines if os.path.exists(f"/proc/{p}")], "engines outlived a clean stop"
        t.append(time.monotonic())
        print(f"\nchaos: {first} then {second}; {len(fos)} failovers before the supervisor kill; "
              f"phases (start+reference, faults, supervisor kill, stop) {[round(b - a, 1) for a, b in zip(t, t[1:])]} s")
    finally:
        if serve.proc is not None:
            serve.kill()
        serve.remove_dirs()
