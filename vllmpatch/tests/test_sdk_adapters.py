"""Engine names (sdk/adapters.py owns them): what --engine may name, and the
`check-engine` command that `frmps serve` runs once before it starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from frmps_engine.sdk import adapters
from frmps_engine.sdk.adapters import AdapterError, resolve


def test_known_names_and_factories_resolve_alike():
    target, factory = resolve("ref")
    assert target == "frmps_engine.sdk.adapters:RefAdapter" and factory is adapters.RefAdapter
    assert resolve(target) == (target, adapters.RefAdapter)
    assert resolve("vllm")[0] == "frmps_engine.vllm.engine:make_adapter"  # imports no vLLM


@pytest.mark.parametrize("name,why", [
    ("tgi", "unknown engine 'tgi': want ref, vllm, or an adapter factory as package.module:Factory"),
    ("", "unknown engine ''"),
    ("-x", "unknown engine '-x'"),
    ("pkg.mod:", "unknown engine"),
    (":Factory", "unknown engine"),
    ("pkg..mod:F", "unknown engine"),
    ("pkg.mod:F.G", "unknown engine"),
    ("1pkg:F", "unknown engine"),
    ("nosuch_pkg_frmps.mod:F", "cannot import nosuch_pkg_frmps.mod"),
    ("frmps_engine.sdk.adapters:NoSuch", "module frmps_engine.sdk.adapters has no NoSuch"),
    ("frmps_engine.sdk.adapters:KNOWN", "is a dict, not a callable factory"),
])
def test_bad_names_say_why(name, why):
    with pytest.raises(AdapterError) as e:
        resolve(name)
    assert why in str(e.value)


def test_check_engine_command():
    ok = subprocess.run([sys.executable, "-m", "frmps_engine.cli", "check-engine", "ref"],
                        capture_output=True, text=True, timeout=60)
    assert (ok.returncode, ok.stdout.strip()) == (0, "frmps_engine.sdk.adapters:RefAdapter")
    bad = subprocess.run([sys.executable, "-m", "frmps_engine.cli", "check-engine", "--", "tgi"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip() == ("frmps-engine: unknown engine 'tgi': want ref, vllm, "
                                  "or an adapter factory as package.module:Factory")
