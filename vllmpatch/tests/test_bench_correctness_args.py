"""`frmps bench correctness --exact` with vLLM starts `frmps serve --exact`, the flag a
user runs (vLLM's batch-invariant kernels with Triton attention), not an environment
variable of its own; the reference engine's exact mode stays its engine argument."""
from __future__ import annotations

import types

from bench.__main__ import build_parser
from bench.experiment_base import serve_opts
from bench.experiments import exact_serve_args


def _args(*argv: str):
    return build_parser().parse_args(["correctness", *argv])


def test_exact_and_its_old_name_ask_frmps_serve_for_exact():
    for flag in ("--exact", "--batch-invariant"):
        a = _args("--engine", "vllm", flag)
        assert a.batch_invariant and exact_serve_args(a) == ["--exact"]
    assert exact_serve_args(_args("--engine", "vllm")) == []
    assert exact_serve_args(_args("--engine", "ref", "--exact")) == []  # the reference engine's is an engine arg


def test_the_serve_command_carries_exact_and_no_batch_invariant_env():
    a = _args("--engine", "vllm", "--exact", "--model", "/models/m")
    a.python, a.frmps, a.mps, a.memory, a.device = "python3", "frmps", True, "cuda-vmm", "cuda"
    ctx = types.SimpleNamespace(args=a, cpu=False)
    opts = serve_opts(ctx, "/models/m", 1, [], num_blocks=64, max_model_len=512, serve_args=exact_serve_args(a))
    cmd = opts.command(8000, "127.0.0.1:1", "/run", "/log")
    assert cmd.count("--exact") == 1 and "VLLM_BATCH_INVARIANT" not in opts.env
    plain = serve_opts(ctx, "/models/m", 1, [], num_blocks=64, max_model_len=512)
    assert "--exact" not in plain.command(8000, "127.0.0.1:1", "/run", "/log")
