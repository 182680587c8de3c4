"""Engine adapters known to the CLI, and loading one by name.

``--engine ref`` is the reference engine; ``--engine package.module:Factory``
loads any other adapter (the vLLM adapter, test doubles) the same way.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from frmps_engine._proto.frmps.v1 import control_pb2

from .engine_api import EngineAdapter


class AdapterError(Exception):
    pass


@dataclass
class EngineOptions:
    model: str
    device: str = "cpu"
    num_blocks: int | None = None
    max_model_len: int | None = None
    seed: int = 0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    exact: bool | None = None  # None: the engine's default (the reference engine: on for GPUs)
    kv_reuse: bool = True  # False: a standby recomputes adopted KV (ablation)


KNOWN = {
    "ref": "frmps_engine.sdk.adapters:RefAdapter",
    "vllm": "frmps_engine.vllm.engine:make_adapter",
}


def load_adapter(engine: str, opts: EngineOptions) -> EngineAdapter:
    target = KNOWN.get(engine, engine)
    if ":" not in target:
        raise AdapterError(f"unknown engine {engine!r} (known: {', '.join(KNOWN)}, or module:Factory)")
    mod_name, _, attr = target.partition(":")
    try:
        factory: Callable[[EngineOptions], EngineAdapter] = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise AdapterError(f"engine {engine!r}: cannot load {target}: {e}") from e
    return factory(opts)


class RefAdapter:
    """The reference engine (frmps_engine.refengine)."""

    name = "ref"

    def __init__(self, opts: EngineOptions):
        try:
            from frmps_engine import refengine
        except ImportError as e:
            raise AdapterError(f"reference engine unavailable: {e}") from e
        self._re = refengine
        refengine.config.apply_cuda_env(opts.device)
        kw: dict[str, Any] = {"device": opts.device, "seed": opts.seed}
        if opts.num_blocks is not None:
            kw["num_blocks"] = opts.num_blocks
        if opts.max_model_len is not None:
            kw["max_model_len"] = opts.max_model_len
        for name in ("max_num_seqs", "max_num_batched_tokens", "exact"):
            if getattr(opts, name) is not None:
                kw[name] = getattr(opts, name)
        if not opts.kv_reuse:
            kw["kv_reuse"] = False
        try:
            # A preset name or a model directory.
            self.cfg = refengine.EngineConfig.from_preset(opts.model, **kw)
        except (ValueError, OSError) as e:  # refengine's ConfigError is a ValueError
            raise AdapterError(f"model {opts.model!r}: {e}") from e
        import frmps_engine

        self.version = getattr(refengine, "__version__", frmps_engine.__version__)
        self.model = opts.model
        self.device = opts.device
        self.block_size = int(self.cfg.block_size)
        self.num_blocks = int(self.cfg.num_blocks)
        self.max_model_len = int(self.cfg.max_model_len)
        self._tok = None
        self.core = None

    def pool_layout(self):
        return list(self._re.pool_layout(self.cfg))

    def create_core(self, pools, load_weights: bool):
        core = self._re.EngineCore(self.cfg, pools, load_weights=load_weights)
        # GPU: capture decode graphs now, off the takeover path. A standby does this on
        # its reserved (private) ranges, before the shared pools are mapped in place.
        core.warmup()
        self.core = core
        return core

    def tokenizer(self):
        if self.core is not None:
            return self.core.tokenizer
        if self._tok is None:
            self._tok = self._re.load_tokenizer(getattr(self.cfg, "model_dir", None))
        return self._tok

    def sampling_params(self, p: control_pb2.SamplingParams, seed: int):
        return self._re.SamplingParams(
            max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=seed,
            stop=tuple(p.stop), stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos,
            include_stop_str_in_output=p.include_stop_str_in_output,
        )
