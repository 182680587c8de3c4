"""bench/gpu/openai_fault_proof.py --cpu: the script that proves the OpenAI
surface of `frmps serve --frontend vllm` across real MPS faults on a GPU, run
here end to end with the labelled test doubles of test_serve_frontend_vllm
(engines `frmps_engine.vllm.testing:cpu_engine`, vLLM's CPU platform in the
frontend, the MPS control daemon's double, SIGKILL of the active as the fault).
It checks the script (every case in flight at the fault, every one judged equal
to its no-fault result), not GPU faults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # vllmpatch/tests: e2e helpers

from e2e import frmps_bin, require  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
require("openai")


# The script's check, through the vLLM the GPU runs it with: `make test` runs this folder
# under 0.26.0 and 0.33.0, and vLLM's API server on 0.33.0 behind `--frontend vllm` is
# test_serve_frontend_vllm's.
@pytest.mark.slow
@pytest.mark.only_vllm("0.26.0")
def test_openai_fault_proof_cpu_check(tmp_path):
    from frmps_engine import modeldir

    model = modeldir.write("qwen2.5-0.5b", str(tmp_path / "m"))
    out = tmp_path / "proof.json"
    env = dict(os.environ, PYTHONPATH=str(REPO / "vllmpatch" / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "openai_fault_proof.py"), "--cpu", "--frmps", frmps_bin(),
                        "--python", sys.executable, "--model", model, "--served-model-name", "tiny", "--max-tokens", "250",
                        "--max-model-len", "1024", "--num-blocks", "512", "--faults", "1", "--workdir", str(tmp_path / "w"),
                        # the test engines (frmps_engine.vllm.testing) have no FRMPS_TEST_TAKEOVER_FAULT switch
                        "--controls", "off",
                        "--out", str(out)], env=env, capture_output=True, text=True, timeout=600, cwd=str(REPO))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert not rep.get("error") and len(rep["faults"]) == 1, rep.get("error")
    f = rep["faults"][0]
    assert f["active_in_mps_before"] and f["failover"]["ok"], f
    assert len(f["cases"]) == 11  # the cases that do not need a real model's logits
    for cid, v in f["cases"].items():
        assert v["in_flight_at_fault"], (cid, v)
        # the unseeded case is only checked complete, every other one equals its no-fault result
        assert v["verdict"] == ("completed" if cid == "cmpl-n2-stream-unseeded" else "exact"), (cid, v)
    assert rep["controls_mode"] == "off"
    assert rep["headline"].startswith("10/10 streams in flight at a fault or handover exact"), rep["headline"]
    # The stops chosen from a no-fault answer, past its middle: the runs end there.
    for cid in ("cmpl-token-ids-prompt-stop-ids", "chat-stop-seeded-stream"):
        assert rep["prepared"][cid] is not None, rep["prepared"]
        assert all(ch["finish"] == "stop" for ch in rep["reference"][cid]["choices"].values()), rep["reference"][cid]
    body = next(c["body"] for c in rep["cases"] if c["id"] == "cmpl-token-ids-prompt-stop-ids")
    assert isinstance(body["prompt"], list) and body["extra_body"]["stop_token_ids"] == [rep["prepared"]["cmpl-token-ids-prompt-stop-ids"]]
