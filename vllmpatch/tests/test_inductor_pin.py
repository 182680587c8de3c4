"""envpolicy.pin_inductor_deterministic: Inductor's deterministic mode stays on after
Dynamo traces a frame (each case in a fresh interpreter: the pin changes torch for
the process; the eager backend, so no compiler runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from e2e import require

pytestmark = [pytest.mark.torch, pytest.mark.timeout(300)]

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
CASE = """
import json, os, sys
from frmps_engine.vllm.envpolicy import pin_inductor_deterministic
pinned = pin_inductor_deterministic(os.environ) if sys.argv[1] == "pin" else False
import torch, torch._inductor.config as ic
before = ic.deterministic
f = torch.compile(lambda x: x * 2, backend="eager")
f(torch.ones(2))
after_frame = ic.deterministic
torch.use_deterministic_algorithms(False)
print(json.dumps({"pinned": pinned, "before": before, "after_frame": after_frame, "after_call": ic.deterministic,
                  "algorithms": torch.are_deterministic_algorithms_enabled()}))
"""


def run(mode: str, value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_DETERMINISTIC"}
    if value is not None:
        env["TORCHINDUCTOR_DETERMINISTIC"] = value
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", CASE, mode], env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_pinned_mode_survives_dynamo_and_explicit_calls():
    require("torch")
    r = run("pin", "1")
    assert r == {"pinned": True, "before": True, "after_frame": True, "after_call": True, "algorithms": False}


def test_without_the_pin_dynamo_turns_the_mode_off():
    # the reason for the pin (and the check's negative control): the variable alone
    # holds only until Dynamo's first traced frame
    require("torch")
    r = run("none", "1")
    assert r["before"] is True and r["after_frame"] is False


def test_not_pinned_without_the_variable():
    require("torch")
    assert run("pin", None) == {"pinned": False, "before": False, "after_frame": False, "after_call": False,
                                "algorithms": False}
    assert run("pin", "0")["pinned"] is False
