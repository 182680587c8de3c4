"""The standby's per-thread stack (sdk/stack.py) on the CPU, against the
interceptor's fake libcuda (a TEST DOUBLE: a context starts with a 1 KiB stack,
cuCtxSetLimit rounds to 16 bytes, and launching its kernel "frmps_deep_stack"
grows the stack to 4 KiB and keeps it, as the driver does). Each case runs in a
fresh process, so the fake's context starts anew. What it does on a GPU:
bench/results/ (the standby's "asleep" lines and memory)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest


REPO = pathlib.Path(__file__).resolve().parents[2]
SRC = REPO / "vllmpatch" / "src"

# Grows the fake context's stack the way a real engine's warm-up does: a launch.
PRELUDE = """
import ctypes, os, threading
from frmps_engine.sdk import stack as st
cu = ctypes.CDLL(os.environ["FRMPS_LIBCUDA"])
def deep_launch():
    assert cu.cuInit(0) == 0
    ctx, mod, fn = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
    assert cu.cuCtxSetCurrent(ctx) == 0
    assert cu.cuModuleLoadData(ctypes.byref(mod), b".entry frmps_deep_stack(") == 0
    assert cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"frmps_deep_stack") == 0
    assert cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, None, None) == 0
    assert cu.cuCtxSetCurrent(None) == 0
def fail_next(name, err):
    cu.fake_cuda_fail(name.encode(), err, 1)
cu.fake_cuda_primary_refs.restype = ctypes.c_long
"""


@pytest.fixture(scope="module")
def fake(fake_libcuda):
    return fake_libcuda


def run(code: str, libcuda: str, **env: str) -> str:
    full = {k: v for k, v in os.environ.items() if k != "FRMPS_STANDBY_STACK"}
    full.update(FRMPS_LIBCUDA=libcuda, PYTHONPATH=str(SRC), **env)
    r = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], env=full, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_context_stack_reads_and_sets_the_primary_context_from_any_thread(fake):
    out = run("""
        s = st.ContextStack(0)
        print("threads", s.threads, "mib-per-kib", s.mib(1024))
        print("start", s.get())
        deep_launch()
        print("grown", s.get())
        got = []
        t = threading.Thread(target=lambda: got.append(s.set(1000)))  # a thread with no context current
        t.start(); t.join()
        print("set", got[0], s.get())
        cur = ctypes.c_void_p(1)
        assert cu.cuCtxGetCurrent(ctypes.byref(cur)) == 0
        print("current", cur.value, "refs", cu.fake_cuda_primary_refs())
    """, fake)
    assert "threads 270336 mib-per-kib 264.0" in out
    assert "start 1024" in out and "grown 4096" in out
    assert "set 1008 1008" in out  # the driver's rounding comes back
    # Each call put back what was current (nothing) and released the context it retained
    # (the one reference left is deep_launch's own).
    assert "current None refs 1" in out


def test_context_stack_errors_name_the_call(fake):
    out = run("""
        try:
            st.ContextStack(3)
        except st.DriverError as e:
            print("bad device:", e, e.code)
        s = st.ContextStack(0)
        fail_next("cuCtxGetLimit", 201)
        try:
            s.get()
        except st.DriverError as e:
            print("get:", e)
        print("refs", cu.fake_cuda_primary_refs())
    """, fake)
    assert "bad device: cuDeviceGet(3): CUresult 101 101" in out
    assert "get: cuCtxGetLimit(STACK_SIZE): CUresult 201" in out
    assert "refs 0" in out  # released on the error path too


def test_standby_gives_the_grown_stack_back_asleep_and_regrows_it_at_a_takeover(fake):
    out = run("""
        deep_launch()
        s = st.ContextStack(0)
        sb = st.StandbyStack(s)
        print("shrink", sb.shrink())
        print("asleep", s.get())
        sb.regrow()
        print("note", sb.note(10))
        print("awake", s.get())
        # Back to sleep, with the stack the engine ran with: given back again.
        print("shrink2", sb.shrink())
        print("asleep2", s.get())
    """, fake)
    assert "shrink ; per-thread stack 4096 B reset to 1024 B while asleep (792 MiB of local memory given back" in out
    assert "asleep 1024" in out
    assert "note per-thread stack back to 4096 B in" in out
    assert "awake 4096" in out
    assert "shrink2 ; per-thread stack 4096 B reset to 1024 B" in out and "asleep2 1024" in out


def test_a_late_shrink_leaves_an_engine_that_serves_again_alone(fake):
    """A planned handover's old engine gives its stack back on a thread; if a takeover
    has made it the active by then, the stack stays (asleep() says so, under the lock)."""
    out = run("""
        deep_launch()
        s = st.ContextStack(0)
        sb = st.StandbyStack(s)
        notes = []
        sb.shrink_later(notes.append, lambda: False)
        for t in threading.enumerate():
            if t.name == "frmps-stack":
                t.join(10)
        print("notes", notes, s.get(), sb.grown)
        sb.shrink_later(notes.append, lambda: True)
        for t in threading.enumerate():
            if t.name == "frmps-stack":
                t.join(10)
        print("later", notes[-1], s.get())
    """, fake)
    assert "notes [''] 4096 0" in out
    assert "later ; per-thread stack 4096 B reset to 1024 B" in out and out.strip().endswith("1024")


def test_standby_stack_that_never_grew_is_kept_and_not_regrown(fake):
    out = run("""
        s = st.ContextStack(0)
        sb = st.StandbyStack(s)
        print("shrink", sb.shrink())
        sb.regrow()
        print("note", repr(sb.note(10)), s.get())
    """, fake)
    assert "shrink ; per-thread stack 1024 B (264 MiB), kept" in out
    assert "note '' 1024" in out


def test_keep_policy_leaves_the_stack(fake):
    out = run("""
        deep_launch()
        s = st.ContextStack(0)
        sb = st.StandbyStack(s, st.policy())
        print("shrink", sb.shrink(), s.get())
    """, fake, FRMPS_STANDBY_STACK="keep")
    assert "shrink ; per-thread stack 4096 B (1056 MiB), kept 4096" in out


def test_a_failed_regrowth_is_reported_and_left_to_the_first_launch(fake):
    out = run("""
        deep_launch()
        s = st.ContextStack(0)
        sb = st.StandbyStack(s)
        sb.shrink()
        fail_next("cuCtxSetLimit", 2)  # CUDA_ERROR_OUT_OF_MEMORY: the dead engine's memory not yet freed
        sb.regrow()
        print("note", sb.note(10))
        print("after", s.get())
        deep_launch()  # the first launch that needs it: the driver grows it
        print("launched", s.get())
    """, fake)
    assert "note per-thread stack not regrown (cuCtxSetLimit(STACK_SIZE, 4096): CUresult 2" in out
    assert "the first launch that needs it grows it" in out
    assert "after 1024" in out and "launched 4096" in out


def test_a_failed_shrink_is_a_note_not_an_error(fake):
    out = run("""
        deep_launch()
        s = st.ContextStack(0)
        sb = st.StandbyStack(s)
        fail_next("cuCtxSetLimit", 999)
        print("shrink", sb.shrink(), sb.grown)
        sb.regrow()
        print("note", repr(sb.note(10)))
    """, fake)
    assert "shrink ; per-thread stack: unknown (cuCtxSetLimit(STACK_SIZE, 1024): CUresult 999) 0" in out
    assert "note ''" in out


def test_policy_values():
    from frmps_engine.sdk import stack as st

    assert st.policy({}) == "reset" and st.policy({"FRMPS_STANDBY_STACK": "Reset "}) == "reset"
    assert st.policy({"FRMPS_STANDBY_STACK": "keep"}) == "keep"
    with pytest.raises(ValueError, match="FRMPS_STANDBY_STACK='shrink'"):
        st.policy({"FRMPS_STANDBY_STACK": "shrink"})


def test_no_cuda_device_means_no_stack_to_manage():
    from frmps_engine.sdk import stack as st

    sb = st.StandbyStack.for_device("cpu")
    assert sb.shrink() == "" and sb.note() == ""
    sb.regrow()
    assert sb.note(1) == ""
