"""The bench's fault trigger outside a measured point: a sweep's negative controls run
before any point, when the context names no trigger yet. They must get --fault's first
kind, not a path to the faults folder itself (a GPU K sweep's controls failed that way:
"PermissionError: ... 'bench/build/faults/'")."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from bench.deploy import MpsTrigger
from bench.experiment_base import make_trigger
from bench.results import ResultFile
from bench.runctx import Budget, Ctx


class _Dep:
    def mps_client_env(self) -> dict[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": "/nonexistent"}


def _ctx(tmp_path, fault: str) -> Ctx:
    args = SimpleNamespace(mps=True, faults_dir=str(tmp_path / "faults"), fault=fault)
    return Ctx(args=args, out_dir=str(tmp_path), run_id="t", budget=Budget(0),
               results=ResultFile(str(tmp_path), "correctness", "t"))


def test_trigger_outside_a_point_takes_the_first_fault_kind(tmp_path):
    t = make_trigger(_ctx(tmp_path, "misaligned:load,shared_oob:shared"), _Dep())
    assert isinstance(t, MpsTrigger)
    assert t.path == os.path.join(str(tmp_path / "faults"), "misaligned") and t.variant == "load"


def test_trigger_inside_a_point_keeps_the_points_kind(tmp_path):
    ctx = _ctx(tmp_path, "misaligned:load,shared_oob:shared")
    ctx.fault = ctx.fault_for({"trial": 1})
    assert make_trigger(ctx, _Dep()).spec == "shared_oob:shared"


def test_a_trigger_without_a_program_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no fault program"):
        MpsTrigger(str(tmp_path), "", {})


def test_a_folder_is_not_a_trigger(tmp_path):
    (tmp_path / "misaligned").mkdir()  # executable, as folders are: still not a program
    t = MpsTrigger(str(tmp_path), "misaligned:load", {})
    with pytest.raises(Exception, match="is missing"):
        t.prepare()
