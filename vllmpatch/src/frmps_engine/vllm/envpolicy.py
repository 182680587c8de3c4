"""The vLLM engine's environment policy: what frmps reads from the engine's
environment (FRMPS_VLLM_ASYNC_SCHEDULING, FRMPS_VLLM_STRUCTURED_OUTPUTS_CONFIG)
and the defaults it sets there for vLLM, torch and Triton before they read it
(each only where the operator has not set the variable)."""

from __future__ import annotations

import os
from typing import Mapping, MutableMapping


def async_scheduling_from_env(env: Mapping[str, str]) -> bool | None:
    """FRMPS_VLLM_ASYNC_SCHEDULING (both engines read the same environment): unset,
    empty or auto: vLLM decides, as for vLLM alone (on unless the model, the
    speculative decoding or the executor rules it out); 1: on; 0: off (the
    synchronous step).

    The pipelined step overlaps the host's work on a step (its outputs, the ring
    publish, the next schedule) with the device's work on the next, which keeps
    frmps's per-step host work off the device's path; the views the ring gets are
    committed state only (the step in flight excluded), so takeovers stay exact."""
    v = env.get("FRMPS_VLLM_ASYNC_SCHEDULING", "").strip()
    if v in ("", "auto"):
        return None
    if v == "1":
        return True
    if v == "0":
        return False
    raise ValueError(f"FRMPS_VLLM_ASYNC_SCHEDULING={v!r}: use auto (the default: vLLM decides), 1 (on) or 0 (off)")


MEGA_AOT_ENV = "VLLM_USE_MEGA_AOT_ARTIFACT"


def mega_aot_default(env: MutableMapping[str, str], torch_version: str) -> bool:
    """Sets VLLM_USE_MEGA_AOT_ARTIFACT=1 in ``env`` (the engine's own environment,
    before vLLM reads it) unless it is set already, or vLLM's AOT compile cache is
    off (VLLM_USE_AOT_COMPILE=0, VLLM_DISABLE_COMPILE_CACHE=1) or torch is older
    than 2.10 (no AOT compile); returns whether it is on.

    With it, an engine whose model vLLM compiled before loads the compiled model
    whole from vLLM's cache instead of unpickling its FX graph, splitting it again
    and loading each piece (vLLM 0.26, vllm/compilation/caching.py): most of the
    time an engine spends loading its compiled model, and so of a restore after a
    failover. vLLM turns it on by itself from torch 2.12; on torch 2.11 (vLLM 0.26's
    pin) it is opt-in. The compiled model is the same either way."""
    if MEGA_AOT_ENV in env:
        return env[MEGA_AOT_ENV].strip() == "1"
    if env.get("VLLM_USE_AOT_COMPILE", "").strip() == "0" or env.get("VLLM_DISABLE_COMPILE_CACHE", "").strip() not in ("", "0"):
        return False
    try:
        major, minor = (int(x) for x in torch_version.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    if (major, minor) < (2, 10):
        return False
    env[MEGA_AOT_ENV] = "1"
    return True


FLASHINFER_SAMPLER_ENV = "VLLM_USE_FLASHINFER_SAMPLER"


def importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def flashinfer_sampler_default(env: MutableMapping[str, str], have_flashinfer: bool) -> str:
    """vLLM samples top-k/top-p with FlashInfer unless VLLM_USE_FLASHINFER_SAMPLER=0
    (its default is 1), and an engine whose interpreter has no flashinfer package
    fails while it starts. Where flashinfer is missing and the variable is unset,
    sets it to 0 in ``env`` (the engine's own environment, before vLLM reads it:
    vLLM's PyTorch/Triton sampler) and returns the line to log; where it is set to
    1 without flashinfer, refuses (ValueError: an engine option refused) with what
    to do. Returns "" where nothing changes."""
    v = env.get(FLASHINFER_SAMPLER_ENV, "").strip()
    if have_flashinfer:
        return ""
    if v == "":
        env[FLASHINFER_SAMPLER_ENV] = "0"
        return (f"flashinfer is not installed: {FLASHINFER_SAMPLER_ENV}=0 (vLLM's PyTorch/Triton top-k/top-p "
                f"sampler; install flashinfer or set {FLASHINFER_SAMPLER_ENV} yourself to choose)")
    if v not in ("0", "false", "False"):
        raise ValueError(f"{FLASHINFER_SAMPLER_ENV}={v} asks vLLM for FlashInfer's sampler, but flashinfer is not "
                         f"installed in the engines' interpreter: install it, or unset the variable "
                         f"(frmps then sets it to 0)")
    return ""


TRITON_CACHE_ENV = "TRITON_CACHE_DIR"


def triton_cache_default(env: MutableMapping[str, str], vllm_cache_root: str) -> str:
    """Points TRITON_CACHE_DIR at ``<vLLM's cache root>/triton_cache`` in ``env`` (the
    engine's own environment) unless it is set; returns the directory in use.

    Where an engine loads vLLM's compiled model whole (mega_aot_default), vLLM
    initialises its compiler's cache with ``disable_cache=True`` and so never sets
    TRITON_CACHE_DIR (vllm/compilation/compiler_interface.py, initialize_cache).
    The kernels vLLM's warm-up compiles outside torch.compile (its V2 runner's and
    sampler's) then land in whichever directory the variable names at that moment:
    unset (Triton's own ~/.triton/cache) until inductor loads one of its kernels,
    which sets it to ``<inductor cache>/triton/<device>``
    (torch/_inductor/runtime/triton_heuristics.py). One directory per cache root
    keeps every engine's kernels in one place the operator manages with vLLM's
    cache (triton_watch.py logs a miss with its cache key's parts). Triton keys its
    cache by the kernel's source, options and target, so models and
    engines can share the directory."""
    if env.get(TRITON_CACHE_ENV, "").strip():
        return env[TRITON_CACHE_ENV]
    path = os.path.join(vllm_cache_root, "triton_cache")
    env[TRITON_CACHE_ENV] = path
    return path


TRITON_PTXAS_ENV = "TRITON_PTXAS_PATH"


def triton_ptxas_default(env: MutableMapping[str, str], torch_dir: str) -> str:
    """Points TRITON_PTXAS_PATH at torch's own ptxas (``<torch>/bin/ptxas``) in
    ``env`` before anything compiles, unless it is set or torch ships none; returns
    the path in use ("" where Triton keeps its bundled ptxas).

    Triton keys its disk cache with its backend's hash, ``ptxas --version`` and the
    GPU's arch, and reads the version once per process (lru_cache,
    triton/backends/nvidia/compiler.py). Inductor sets TRITON_PTXAS_PATH to torch's
    ptxas the first time it compiles a Triton kernel
    (torch/_inductor/runtime/compile_tasks.py, _set_triton_ptxas_path), so an engine
    that read the version before that keys its cache with Triton's bundled ptxas
    (CUDA 12.8 in Triton 3.6.0) and one that read it after with torch's (13.0 in
    torch 2.11+cu130) — which order, each engine's first compiles decide. Engines of
    one deployment can so key their caches two ways, and one finds none of the
    other's kernels: it compiles them all again, in its restore. Setting it first,
    as inductor would, gives every engine one hash."""
    if env.get(TRITON_PTXAS_ENV, "").strip():
        return env[TRITON_PTXAS_ENV]
    ptxas = os.path.join(torch_dir, "bin", "ptxas")
    if not (os.path.isfile(ptxas) and os.access(ptxas, os.X_OK)):
        return ""
    env[TRITON_PTXAS_ENV] = ptxas
    return ptxas


STRUCTURED_OUTPUTS_ENV = "FRMPS_VLLM_STRUCTURED_OUTPUTS_CONFIG"


def structured_outputs_from_env(env: Mapping[str, str]) -> dict | None:
    """FRMPS_VLLM_STRUCTURED_OUTPUTS_CONFIG: vLLM's ``--structured-outputs-config``
    as JSON (e.g. ``{"backend": "xgrammar", "disable_any_whitespace": true}``) for
    every engine (both read the same environment). The grammar runs in the engine,
    so with ``--frontend vllm`` give the API server the same through
    ``--frontend-arg=--structured-outputs-config=...``. Unset: vLLM's defaults."""
    import json

    from vllm.config import StructuredOutputsConfig

    v = env.get(STRUCTURED_OUTPUTS_ENV, "").strip()
    if not v:
        return None
    try:
        cfg = json.loads(v)
    except ValueError as exc:
        raise ValueError(f"{STRUCTURED_OUTPUTS_ENV}: not JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{STRUCTURED_OUTPUTS_ENV}: want a JSON object, got {type(cfg).__name__}")
    try:
        StructuredOutputsConfig(**cfg)  # vLLM's own checks of names and values
    except Exception as exc:  # noqa: BLE001 - vLLM raises TypeError, ValueError or pydantic's errors
        raise ValueError(f"{STRUCTURED_OUTPUTS_ENV}: vLLM refuses {cfg}: {exc}") from None
    return cfg


BI_KEEP_AOT_ENV = "FRMPS_DEBUG_BI_KEEP_AOT"


def keep_aot_in_batch_invariant_mode(env: MutableMapping[str, str]) -> bool:
    """A diagnostic experiment (sdk/README.md, diagnostic switches), off unless
    FRMPS_DEBUG_BI_KEEP_AOT=1 with VLLM_BATCH_INVARIANT=1: vLLM 0.26's
    batch-invariant mode turns vLLM's AOT compile off while the worker starts
    (model_executor/layers/batch_invariant.py, override_envs_for_invariance sets
    VLLM_USE_AOT_COMPILE=0), so every engine started after a fault traces its model
    again (the restore under --exact: 25-30 s against 7-13 s). vLLM 0.33 no longer
    does (its override leaves the AOT compile alone). With the switch, the override
    keeps VLLM_USE_AOT_COMPILE as it was; whether the output stays batch-invariant
    so is for the GPU to show (bench/gpu/margin_bound.py --keep-aot, the exact
    proof). Returns whether the override was wrapped (False: switch off, or a vLLM
    without that override)."""
    if env.get(BI_KEEP_AOT_ENV, "").strip() != "1" or env.get("VLLM_BATCH_INVARIANT", "").strip() in ("", "0"):
        return False
    try:
        import vllm.model_executor.layers.batch_invariant as bi
    except ImportError:
        return False
    original = getattr(bi, "override_envs_for_invariance", None)
    if original is None:
        return False
    if getattr(original, "__frmps_keeps_aot__", False):
        return True

    def override_envs_for_invariance(*args, **kwargs):
        had = os.environ.get("VLLM_USE_AOT_COMPILE")
        try:
            return original(*args, **kwargs)
        finally:
            if had is None:
                os.environ.pop("VLLM_USE_AOT_COMPILE", None)
            else:
                os.environ["VLLM_USE_AOT_COMPILE"] = had

    override_envs_for_invariance.__frmps_keeps_aot__ = True  # type: ignore[attr-defined]
    override_envs_for_invariance.__wrapped__ = original  # type: ignore[attr-defined]
    bi.override_envs_for_invariance = override_envs_for_invariance
    return True


INDUCTOR_DETERMINISTIC_ENV = "TORCHINDUCTOR_DETERMINISTIC"


def inductor_deterministic(env: Mapping[str, str]) -> bool:
    """TORCHINDUCTOR_DETERMINISTIC=1, as `frmps serve --exact` sets it for vLLM's engines."""
    return env.get(INDUCTOR_DETERMINISTIC_ENV, "").strip() == "1"


def pin_inductor_deterministic(env: Mapping[str, str]) -> bool:
    """With TORCHINDUCTOR_DETERMINISTIC=1 (`frmps serve --exact` sets it): keeps
    Inductor's deterministic mode on in this process for good; returns whether it
    is pinned. Call it before anything is compiled.

    Why the mode: where a compiled reduction (the model's fused residual add and
    RMSNorm, the sampler's softmax in vllm/v1/sample/ops/topk_topp_sampler.py) has
    several candidate block sizes and warp counts, Inductor times them when the
    kernel first runs and keeps the fastest: a choice of that process, of what else
    ran on the GPU while it timed, and the choice sets the reduction's rounding
    (torch/_inductor/runtime/triton_heuristics.py,
    filter_reduction_configs_for_determinism). Two engines of one deployment could
    then compute a token differently, and a stream taken over from one by the other
    would not be exact, batch-invariant kernels or not. In deterministic mode
    Inductor picks by its heuristics, the same in every process. (Read from
    Inductor's source; one 14B engine of 8 computing unlike the others under
    --exact, bench/results/2026-11-30-h200x2-vllm-exact-14b/, is what such a
    choice would look like; it has not been reproduced on purpose.)

    Why the pin: the variable sets the mode when torch._inductor.config is
    imported, but Dynamo restores torch.use_deterministic_algorithms' state after
    tracing each frame, and that function writes the state (off) over Inductor's
    flag (torch 2.11 and 2.13: torch/_dynamo/convert_frame.py, torch/__init__.py),
    so every frame compiled after the first would time again. The wrapper keeps
    the flag on whatever the state written."""
    if not inductor_deterministic(env):
        return False
    import torch
    import torch._inductor.config as inductor_config

    original = torch.use_deterministic_algorithms
    if getattr(original, "_frmps_pinned", False):
        return True

    def use_deterministic_algorithms(mode: bool, *, warn_only: bool = False) -> None:
        original(mode, warn_only=warn_only)
        inductor_config.deterministic = True

    use_deterministic_algorithms._frmps_pinned = True  # type: ignore[attr-defined]
    use_deterministic_algorithms.__doc__ = original.__doc__
    torch.use_deterministic_algorithms = use_deterministic_algorithms
    inductor_config.deterministic = True
    return True


# Inductor settings of vLLM's compilation config under --exact: its deterministic
# mode (see pin_inductor_deterministic), and no combo kernels. vLLM 0.26 turns combo
# kernels on with benchmark_combo_kernel (config/compilation.py), which times
# candidate groupings while compiling: a timed choice, and one that Inductor's
# deterministic mode refuses with a RuntimeError (a 14B engine on the H200 died so).
# vLLM 0.33 leaves that benchmark off where the mode is on; off entirely is what the
# GPU runs measured.
EXACT_INDUCTOR_CONFIG = {"deterministic": True, "combo_kernels": False, "benchmark_combo_kernel": False}


def exact_compilation_config(compilation_config: object) -> object:
    """``compilation_config`` as ``--vllm-arg`` gives it (None, a dict or vLLM's
    CompilationConfig) with EXACT_INDUCTOR_CONFIG in its ``inductor_compile_config``
    (the config vLLM applies to every Inductor compile of the model and hashes into
    its compile cache's key); the rest of a given config kept."""
    import copy

    if compilation_config is None:
        return {"inductor_compile_config": dict(EXACT_INDUCTOR_CONFIG)}
    cc = copy.deepcopy(compilation_config)
    if isinstance(cc, dict):
        cc["inductor_compile_config"] = {**(cc.get("inductor_compile_config") or {}), **EXACT_INDUCTOR_CONFIG}
    else:
        cc.inductor_compile_config = {**(getattr(cc, "inductor_compile_config", None) or {}),  # type: ignore[attr-defined]
                                      **EXACT_INDUCTOR_CONFIG}
    return cc
