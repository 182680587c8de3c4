"""`frmps serve --engine package.module:Factory`: an engine adapter outside
frmps_engine's built-in ones, reached through the real supervisor. The adapter
here is the SDK's TEST DOUBLE engine (sdk/testing/fake_engine.py), whose tokens
depend on the shared pools' contents, so a takeover continues a stream exactly
only if the weights and KV really crossed to the standby."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from e2e import Killer, deployment, frmps_bin

pytestmark = [pytest.mark.torch, pytest.mark.timeout(300)]

FAKE = "frmps_engine.sdk.testing.fake_engine:FakeAdapter"


def test_an_adapter_named_by_module_serves_and_fails_over():
    with deployment(sync_every=2, engine=FAKE, model="fake-tiny", env={"FRMPS_FAKE_STEP_DELAY_MS": "20"}) as dep:
        assert dep.status()["engine"] == FAKE
        body = {"model": "fake-tiny", "prompt": "hello", "max_tokens": 12, "temperature": 0}
        ref = dep.stream("/v1/completions", body)
        assert ref.error is None and ref.finish_reason == "length" and len(ref.token_ids) == 12
        killer = Killer(dep, after=5)
        got = dep.stream("/v1/completions", body, on_token=killer.on_token)
        assert killer.fired.is_set()
        assert got.error is None and got.token_ids == ref.token_ids and got.text == ref.text
        dep.wait_state("serving_ready")
        assert dep.status()["failovers"][0]["ok"]


@pytest.mark.parametrize("engine,why", [
    ("tgi", "unknown engine 'tgi'"),
    ("nosuch.engines:Factory", "cannot import nosuch.engines"),
])
def test_a_bad_engine_name_stops_serve_at_once(engine, why):
    r = subprocess.run([frmps_bin(), "serve", "--engine", engine, "--no-mps", "--state-dir", "", "--port", "0",
                        "--admin-addr", "127.0.0.1:0", "--python", sys.executable],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert why in r.stderr, r.stderr



@pytest.mark.parametrize("engine,model,arg,why", [
    # the reference engine's parser refuses it
    ("ref", "tiny", "--engine-arg=--bogus", "unrecognized arguments: --bogus"),
    # the adapter's constructor refuses its options (ValueError, as vLLM's config checks raise)
    ("refusing_adapter:Refusing", "tiny", "--engine-arg=--max-model-len=64", "max_model_len 64: refused"),
])
def test_a_refused_engine_option_stops_serve_at_once(tmp_path, engine, model, arg, why):
    """An engine that refuses its options before anything served: `frmps serve`
    exits 1 after that one engine start (no restart, no crash_loop kept up), with
    the engine's reason on its last stderr line; it leaves no ring behind."""
    (tmp_path / "refusing_adapter.py").write_text(
        "def Refusing(opts):\n    raise ValueError(f'max_model_len {opts.max_model_len}: refused')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([frmps_bin(), "serve", "--engine", engine, "--model", model, "--device", "cpu", "--no-mps", arg,
                        "--state-dir", str(tmp_path / "state"), "--ring-dir", str(tmp_path),
                        "--port", "0", "--admin-addr", "127.0.0.1:0", "--python", sys.executable],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1, r.stderr[-3000:]
    assert r.stderr.count("engine launched") == 1, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("frmps: no engine ever served") and why in last, last
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".ring")]
