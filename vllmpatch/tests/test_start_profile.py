"""bench/gpu/start_profile.py: inclusive time per function of the busiest thread,
each function counted once per stack (recursion and several lines of one function)."""

from __future__ import annotations

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("start_profile", os.path.join(REPO, "bench", "gpu", "start_profile.py"))
sp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sp)

RAW = """\
thread (0x1): "MainThread";run (/x/site-packages/frmps_engine/sdk/runner.py:180);load (/x/site-packages/vllm/a.py:10) 300
thread (0x1): "MainThread";run (/x/site-packages/frmps_engine/sdk/runner.py:180);compile (/x/site-packages/vllm/b.py:5);compile (/x/site-packages/vllm/b.py:9) 100
thread (0x1): "MainThread";run (/x/site-packages/frmps_engine/sdk/runner.py:181) 20
thread (0x2): "heartbeat";wait (/usr/lib/python3.12/threading.py:355) 50
bad line
"""


def test_inclusive_time_of_the_busiest_thread(tmp_path):
    p = tmp_path / "start-standby-1.stacks"
    p.write_text(RAW)
    s = sp.summarize(sp.read_stacks(str(p)), rate=200, top=10)
    assert s["busiest"] == 'thread (0x1): "MainThread"' and s["busiest_s"] == 2.1
    inc = dict(s["inclusive_s"])
    assert inc == {"run (frmps_engine/sdk/runner.py)": 2.1, "load (vllm/a.py)": 1.5, "compile (vllm/b.py)": 0.5}
    assert s["threads"]['thread (0x2): "heartbeat"'] == 0.25


def test_cli_writes_json(tmp_path, capsys):
    p = tmp_path / "a.stacks"
    p.write_text(RAW)
    assert sp.main([str(p), "--json", str(tmp_path / "o.json")]) == 0
    assert "load (vllm/a.py)" in capsys.readouterr().out and (tmp_path / "o.json").exists()
