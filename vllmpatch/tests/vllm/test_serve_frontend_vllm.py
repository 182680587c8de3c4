"""`frmps serve --frontend vllm` end to end on the CPU: the Go supervisor, vLLM's own
OpenAI API server as the front door (the frontend process, `frmps_engine.cli
frontend`), and two engine processes in core mode, with a real failover by
SIGKILL of the active engine mid-stream.

TEST DOUBLES, both labelled where they are defined: the engines are
``frmps_engine.vllm.testing:cpu_engine`` (the vLLM adapter and vLLM's real
scheduler over a stand-in model that samples ``seeded_token(seed, position)``;
no GPU), and the frontend process gets vLLM's CPU platform through its test hook
(FRMPS_TEST_VLLM_CPU_PLATFORM=1: the pinned CUDA wheels cannot build a serve
config on a machine without a GPU). Everything else is what a GPU deployment
runs: the supervisor, its launch of the frontend and the engines, the ring, the
Frontend service's EngineLost/EngineBack, adoption from the frontend's ledger."""

from __future__ import annotations

import os
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # vllmpatch/tests: e2e helpers

from e2e import deployment  # noqa: E402
from test_e2e_failback import engines, wait_placement_restored, wait_spare_ready  # noqa: E402

from frmps_engine.vllm.testing import seeded_token  # noqa: E402

SRC = str(Path(__file__).resolve().parents[2] / "src")
PROMPT = list(range(100, 124))
MAX_TOKENS = 60
KILL_AFTER = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from frmps_engine import modeldir

    # The Qwen2.5 preset's directory: its config and a tokenizer (vLLM's API server detokenizes).
    return modeldir.write("qwen2.5-0.5b", str(tmp_path_factory.mktemp("qwen") / "m"))


def wait_models(base: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{base}/v1/models did not answer in {timeout:.0f} s"
        time.sleep(0.25)


class Stream(threading.Thread):
    """A streamed /v1/completions through the official openai client, token ids kept."""

    def __init__(self, base: str, seed: int | None, max_tokens: int = MAX_TOKENS):
        super().__init__(daemon=True)
        self.base, self.seed, self.max_tokens = base, seed, max_tokens
        self.ids: list[int] = []
        self.finish: str | None = None
        self.error: BaseException | None = None

    def run(self):
        import openai

        client = openai.OpenAI(base_url=f"{self.base}/v1", api_key="EMPTY", max_retries=0, timeout=120)
        extra = {"return_token_ids": True, "ignore_eos": True}
        try:
            for ch in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=self.max_tokens, stream=True,
                                                temperature=0.8, seed=self.seed, extra_body=extra):
                for c in ch.choices:
                    self.ids.extend(getattr(c, "token_ids", None) or [])
                    if c.finish_reason:
                        self.finish = c.finish_reason
        except BaseException as e:  # reported by the test
            self.error = e


def _env() -> dict:
    return {"FRMPS_TEST_VLLM_CPU_PLATFORM": "1", "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}


ARGS = ["--frontend", "vllm", "--served-model-name", "tiny", "--memory", "host-shm", "--num-blocks", "256",
        "--max-model-len", "1024", "--sync-every", "1"]
ENGINE = "frmps_engine.vllm.testing:cpu_engine"


@pytest.mark.slow
def test_failover_through_vllms_api_server(model_dir):
    with deployment(model=model_dir, engine=ENGINE, extra_args=ARGS, env=_env()) as dep:
        wait_models(dep.base)
        st = dep.wait_state("serving_ready")
        standby = [e for e in st["engines"] if e.get("role") == "standby"]
        assert standby, st
        # No fault: the stand-in's tokens for the request's seed, after the prompt.
        want = {s: [seeded_token(s, len(PROMPT) + i) for i in range(MAX_TOKENS)] for s in (11, 12)}
        ref = Stream(dep.base, 11)
        ref.run()
        assert ref.error is None and ref.ids == want[11] and ref.finish == "length", (ref.error, ref.ids)

        streams = [Stream(dep.base, 11), Stream(dep.base, 12), Stream(dep.base, None)]
        for s in streams:
            s.start()
        deadline = time.monotonic() + 60
        while not all(len(s.ids) >= KILL_AFTER for s in streams):
            assert time.monotonic() < deadline and not any(s.error for s in streams), \
                ([s.error for s in streams], dep.log_tail())
            time.sleep(0.005)
        pid = dep.active_pid()
        os.kill(pid, 9)
        # frmps's probes on vLLM's app: alive and ready through the failover (its requests are held, not refused).
        for _ in range(10):
            for probe in ("livez", "readyz"):
                with urllib.request.urlopen(f"{dep.base}/{probe}", timeout=5) as r:
                    assert r.status == 200, probe
            time.sleep(0.01)
        for s in streams:
            s.join(120)
            assert not s.is_alive() and s.error is None, f"{s.error!r}\n{dep.log_tail()}"
            assert s.finish == "length" and len(s.ids) == MAX_TOKENS, (s.finish, len(s.ids))
        # Every token once, in order: the no-fault stream of each seed.
        assert streams[0].ids == want[11] and streams[1].ids == want[12]
        st = dep.status()
        active = [e for e in st["engines"] if e.get("role") == "active"]
        assert active and int(active[0]["pid"]) != pid, st
        # The supervisor re-arms a standby; a request after the failover is served.
        dep.wait_state("serving_ready", timeout=120)
        after = Stream(dep.base, 12)
        after.run()
        assert after.error is None and after.ids == want[12], (after.error, dep.log_tail())
        log = Path(dep.log_path).read_text(errors="replace")
        assert "failover done" in log and "resumed=3" in log, dep.log_tail()
        assert "vLLM frontend: engine back" in log, dep.log_tail()
        # Status shows the frontend process: serving again, one loss, one engine back.
        deadline = time.monotonic() + 10
        while True:
            fe = dep.status().get("frontend") or {}
            if fe.get("state") == "serving" or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert fe.get("kind") == "vllm" and fe.get("state") == "serving" and fe.get("engine_connected"), fe
        assert int(fe.get("engine_lost", 0)) == 1 and int(fe.get("engine_back", 0)) == 1, fe
        assert fe.get("vllm_version") and int(fe.get("pid", 0)) > 0, fe


@pytest.mark.slow
def test_failback_hands_open_streams_over_through_vllms_api_server(model_dir):
    """With MPS placement (the test double of nvidia-cuda-mps-control, as on a GPU):
    after the active is killed mid-stream, the engine started from the spare in
    "MPS" takes the open streams over in a planned handover (Handoff, then
    EngineLost, Resume, EngineBack) while they are still running, and the engine
    promoted by the failover goes back to sleep as the standby."""
    long_tokens = 700  # ~7 s at the stand-in's 10 ms a step: spans the failover, the new engine's start, the handover
    want = {s: [seeded_token(s, len(PROMPT) + i) for i in range(long_tokens)] for s in (21, 22)}
    with deployment(model=model_dir, engine=ENGINE, extra_args=ARGS + ["--spare=on", "--max-restarts=1000"],
                    env=_env(), fake_mps=True) as dep:
        wait_models(dep.base)
        e = engines(dep.status())
        assert e["active"]["in_mps"] and not e["standby"].get("in_mps"), e
        spare_pid = int(wait_spare_ready(dep)["spare"]["pid"])
        standby_pid = int(e["standby"]["pid"])
        streams = [Stream(dep.base, 21, long_tokens), Stream(dep.base, 22, long_tokens), Stream(dep.base, None, long_tokens)]
        for s in streams:
            s.start()
        deadline = time.monotonic() + 60
        while not all(len(s.ids) >= KILL_AFTER for s in streams):
            assert time.monotonic() < deadline and not any(s.error for s in streams), dep.log_tail()
            time.sleep(0.005)
        os.kill(dep.active_pid(), 9)
        for s in streams:
            s.join(180)
            assert not s.is_alive() and s.error is None, f"{s.error!r}\n{dep.log_tail()}"
            assert s.finish == "length" and len(s.ids) == long_tokens, (s.finish, len(s.ids))
        ended = time.time()
        assert streams[0].ids == want[21] and streams[1].ids == want[22]
        st = wait_placement_restored(dep, 1)
        assert int(st["failback"]["last_unix_nanos"]) / 1e9 < ended, "the streams ended before the handover"
        assert int(st["failback"]["failed"]) == 0
        e = engines(st)
        assert int(e["standby"]["pid"]) == standby_pid, (standby_pid, e)
        assert int(e["active"]["pid"]) == spare_pid and e["active"].get("from_spare"), (spare_pid, e)
        log = open(dep.log_path, errors="replace").read()
        assert log.count("vLLM frontend: engine back") >= 2, dep.log_tail()  # the failover's and the handover's
