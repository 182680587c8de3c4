"""Engine names, and loading an engine's adapter by name.

This module owns what ``--engine`` may name: ``ref`` (the reference engine),
``vllm`` (the vLLM adapter), or ``package.module:Factory``, any importable
callable that takes ``EngineOptions`` and returns an ``EngineAdapter``
(proto/frmps/v1/ENGINE.md). ``frmps serve --engine NAME`` asks it once before
anything starts (its interpreter check calls ``resolve``, as
``python -m frmps_engine.cli check-engine NAME`` does); the Go
supervisor passes the name through to every engine it launches.
"""

from __future__ import annotations

import importlib
import logging
import re
from dataclasses import dataclass
from typing import Any, Callable

from frmps_engine._proto.frmps.v1 import control_pb2

from ..modeldir import weights_source
from .engine_api import EngineAdapter
from .params import structured_constraint


class AdapterError(Exception):
    pass


@dataclass
class EngineOptions:
    model: str
    device: str = "cpu"
    num_blocks: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None  # the vLLM adapter's KV sizing (None: 0.9)
    seed: int = 0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    exact: bool | None = None  # None: the engine's default (the reference engine: on for GPUs)
    kv_reuse: bool = True  # False: a standby recomputes adopted KV (ablation)
    tensor_parallel_size: int = 1  # ranks the model is sharded over (one process and device each)
    vllm_args: tuple[str, ...] = ()  # --vllm-arg: vLLM's own engine flags (the vLLM adapter only)
    # --weights: "auto" (a model directory's checkpoint, dummy where it has none) or "dummy".
    weights: str = "auto"


KNOWN = {
    "ref": "frmps_engine.sdk.adapters:RefAdapter",
    "vllm": "frmps_engine.vllm.engine:make_adapter",
}

Factory = Callable[[EngineOptions], EngineAdapter]

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_TARGET = re.compile(rf"({_IDENT}(?:\.{_IDENT})*):({_IDENT})")


def resolve(engine: str) -> tuple[str, Factory]:
    """(import target, factory) of an engine name; AdapterError saying why not.
    Imports the factory's module (a known engine's imports nothing heavy: vLLM
    itself is imported only when its adapter is built)."""
    target = KNOWN.get(engine, engine)
    m = _TARGET.fullmatch(target)
    if m is None:
        raise AdapterError(f"unknown engine {engine!r}: want {', '.join(KNOWN)}, "
                           "or an adapter factory as package.module:Factory")
    mod_name, attr = m.groups()
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise AdapterError(f"engine {engine!r}: cannot import {mod_name}: {e}") from e
    try:
        factory = getattr(mod, attr)
    except AttributeError:
        raise AdapterError(f"engine {engine!r}: module {mod_name} has no {attr}") from None
    if not callable(factory):
        raise AdapterError(f"engine {engine!r}: {target} is a {type(factory).__name__}, not a callable factory")
    return target, factory


def load_adapter(engine: str, opts: EngineOptions) -> EngineAdapter:
    return resolve(engine)[1](opts)


class RefAdapter:
    """The reference engine (frmps_engine.refengine). With tensor_parallel_size N > 1
    this process is rank 0 and starts ranks 1..N-1 here (refengine/tp.py); build
    it on the process's main thread, whose end the workers' death signal follows.
    A group of one (N = 1) changes nothing: group_memory returns the backend as is."""

    name = "ref"

    @staticmethod
    def preload() -> None:
        """Imports for a spare (sdk/spare.py); never initialises CUDA."""
        from .spare import import_modules

        import_modules(("torch", "frmps_engine.refengine"))

    def __init__(self, opts: EngineOptions):
        if opts.vllm_args:
            raise AdapterError(f"--vllm-arg {' '.join(opts.vllm_args)!r}: vLLM's flags need --engine vllm")
        try:
            from frmps_engine import refengine
        except ImportError as e:
            raise AdapterError(f"reference engine unavailable: {e}") from e
        self._re = refengine
        refengine.config.apply_cuda_env(opts.device)
        # The generation service detokenizes (sdk/detok.py): the engine's own text is
        # needed for stop strings only.
        kw: dict[str, Any] = {"device": opts.device, "seed": opts.seed, "text_outputs": False}
        if opts.num_blocks is not None:
            kw["num_blocks"] = opts.num_blocks
        if opts.max_model_len is not None:
            kw["max_model_len"] = opts.max_model_len
        for name, value in (("max_num_seqs", opts.max_num_seqs), ("max_num_batched_tokens", opts.max_num_batched_tokens),
                            ("exact", opts.exact)):
            if value is not None:
                kw[name] = value
        if not opts.kv_reuse:
            kw["kv_reuse"] = False
        if opts.weights == "dummy":
            kw["weights"] = "dummy"
        elif opts.weights != "auto":
            raise AdapterError(f"--weights {opts.weights!r}: want auto or dummy")
        if opts.tensor_parallel_size != 1:
            kw["tensor_parallel_size"] = opts.tensor_parallel_size
        try:
            # A preset name or a model directory.
            self.cfg = refengine.EngineConfig.from_preset(opts.model, **kw)
        except (ValueError, OSError) as e:  # refengine's ConfigError is a ValueError
            raise AdapterError(f"model {opts.model!r}: {e}") from e
        import frmps_engine

        self.version = frmps_engine.__version__
        self.model = opts.model
        self.device = opts.device
        self.block_size = int(self.cfg.block_size)
        self.num_blocks = int(self.cfg.num_blocks)
        self.max_model_len = int(self.cfg.max_model_len)
        # Hello.weights: the directory the active loads into the weights pool (and the standby maps), or dummy.
        self.weights = weights_source(self.cfg.weights, self.cfg.weights != "dummy")
        self._tok = None
        self.core = None
        self.group = None
        if self.cfg.tensor_parallel_size > 1:
            from frmps_engine.refengine import tp

            try:
                self.group = tp.Group(self.cfg, log_level=logging.getLevelName(logging.getLogger().level))
            except (tp.GroupError, OSError, RuntimeError) as e:  # RuntimeError: torch.distributed's
                raise AdapterError(f"tensor-parallel group of {self.cfg.tensor_parallel_size}: {e}") from e

    def pool_layout(self):
        return list(self._re.pool_layout(self.cfg))

    def group_memory(self, local):
        if self.group is None:
            return local
        from frmps_engine.refengine import tp

        return tp.GroupMemory(self.group, local)

    def on_peer_death(self, fn) -> None:
        if self.group is not None:
            self.group.on_death = fn

    def dead_peer(self, wait_s: float) -> str | None:
        return self.group.dead_peer(wait_s) if self.group is not None else None

    def create_core(self, pools, load_weights: bool):
        if self.group is None:
            core = self._re.RefCore(self.cfg, pools, load_weights=load_weights)
        else:
            self.group.build(load_weights)
            core = self._re.RefCore(self.cfg, pools, load_weights=load_weights, comm=self.group.comm,
                                    workers=self.group)
        # GPU: capture decode graphs now, off the takeover path. A standby does this on
        # its reserved (private) ranges, before the shared pools are mapped in place.
        core.warmup()
        self.core = core
        return core

    def tokenizer(self):
        if self.core is not None:
            return self.core.tokenizer
        if self._tok is None:
            self._tok = self._re.load_tokenizer(self.cfg.model_dir)
        return self._tok

    def sampling_params(self, p: control_pb2.SamplingParams, seed: int):
        return self._re.SamplingParams(
            max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=seed,
            stop=tuple(p.stop), stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos,
            include_stop_str_in_output=p.include_stop_str_in_output,
            logprobs=p.logprobs if p.HasField("logprobs") else None,
            logit_bias=tuple(p.logit_bias.items()), min_tokens=p.min_tokens, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty or 1.0,
            structured=structured_constraint(p),
        )
