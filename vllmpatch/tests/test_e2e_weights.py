"""A user's model directory through `frmps serve` on the CPU: a Qwen2 checkpoint
saved by transformers 5 (RoPE base in rope_parameters) is served with its own
weights, status and the engines' logs say so, and greedy streams equal
transformers' own output, across a SIGKILL of the active."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

import hfckpt
from e2e import Killer, deployment, require

pytestmark = [pytest.mark.torch, pytest.mark.timeout(900)]
require("transformers")

NEW = 60


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return hfckpt.write_checkpoint(str(tmp_path_factory.mktemp("ck") / "qwen2-t5"))


@pytest.fixture(scope="module")
def want(ckpt):
    prompts = [hfckpt.tokenize(ckpt, t) for t in hfckpt.PROMPTS]
    return prompts, hfckpt.hf_greedy(ckpt, prompts, NEW)


def test_served_weights_are_the_directorys_and_match_transformers_across_a_kill(ckpt, want):
    prompts, ref = want
    with deployment(model=ckpt, env={"FRMPS_TEST_STEP_DELAY_MS": "10"}, extra_args=["--max-restarts=1000000"]) as dep:
        st = dep.status()
        engines = {e["role"]: e for e in st["engines"]}
        assert {r: e.get("weights") for r, e in engines.items()} == \
            {"active": f"loaded:{ckpt}", "standby": f"loaded:{ckpt}"}, st
        logs = {r: open(e["logPath"] if "logPath" in e else e["log_path"]).read() for r, e in engines.items()}
        assert f"weights: loaded:{ckpt} (this engine loads them into the shared weights pool)" in logs["active"]
        assert f"weights: loaded:{ckpt} (this engine loads none: it maps the active's weights pool)" in logs["standby"]

        bodies = [{"model": ckpt, "prompt": p, "max_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
                  for p in prompts]
        killer = Killer(dep, after=20)
        with cf.ThreadPoolExecutor(len(bodies)) as pool:
            futs = [pool.submit(dep.stream, "/v1/completions", b, killer.on_token if i == 0 else None)
                    for i, b in enumerate(bodies)]
            got = [f.result() for f in futs]
        assert killer.fired.is_set()
        for out, r in zip(got, ref):
            assert out.error is None and out.done, out.error
            assert out.token_ids == r, "served output differs from transformers' own greedy output"
        st = dep.wait_state("serving_ready")
        assert len(st.get("failovers") or []) == 1 and st["failovers"][0]["ok"], st
        assert dep.active_pid() != killer.pid
