"""A spare's head start for the vLLM engine (the factory's preload hook,
proto/frmps/v1/ENGINE.md, spares): vLLM's modules, and the model's tokenizer,
loaded before the spare knows its role. No GPU involved."""

from __future__ import annotations

import logging
from typing import Any

from .modelcfg import hf_config

# What a spare imports ahead of need (sdk/spare.py): vLLM's engine core, its
# GPU worker and model runner (torch._dynamo and the rest come with them) and
# this adapter's vLLM-side modules. The model's own module comes from the list
# a served engine wrote. Importing these never initialises CUDA.
_PRELOAD = (
    "vllm", "vllm.engine.arg_utils", "vllm.v1.engine.core", "vllm.v1.executor.abstract", "vllm.v1.request",
    "vllm.tokenizers.registry", "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner",
    "frmps_engine.vllm.scheduler", "frmps_engine.vllm.sleep_backend", "frmps_engine.vllm.plugin",
    # The structured-output backend a standby builds in its warm-up (VllmCore.warm_takeover):
    # importing its grammar library takes most of that.
    "vllm.v1.structured_output.backend_xgrammar", "xgrammar",
)


# Tokenizers a spare loaded before it knew its role, by model: the adapter built
# after the activation takes its own from here (vLLM's get_tokenizer caches
# nothing; Qwen2.5's takes about a second).
_PRELOADED_TOKENIZERS: dict[str, Any] = {}


def take_tokenizer(model: str) -> Any:
    """The tokenizer a spare preloaded for ``model``, handed over once (None
    without one)."""
    return _PRELOADED_TOKENIZERS.pop(model, None)


def preload(model: str | None = None) -> None:
    """The factory's preload hook (proto/frmps/v1/ENGINE.md, spares): vLLM's modules,
    and the model's tokenizer (no GPU involved)."""
    from ..sdk.spare import import_modules

    import_modules(_PRELOAD)  # a module that initialised CUDA is caught by the spare's check
    if model:
        try:
            from vllm.tokenizers.registry import get_tokenizer

            _PRELOADED_TOKENIZERS[model] = get_tokenizer(model)
        except Exception as e:  # only a head start: the engine loads it itself, and says why not
            logging.getLogger(__name__).warning("spare: could not preload the tokenizer of %s: %s", model, e)
            return
        tok = _seed_vllm_tokenizer_cache(model)
        if tok is not None:
            _seed_xgrammar_tokenizer_info(model, tok)


def _seed_vllm_tokenizer_cache(model: str) -> Any:
    """vLLM's engine core reads the tokenizer once more for its structured-output
    manager, through ``cached_tokenizer_from_config`` (an lru_cache over
    ``get_tokenizer``, keyed by the model config's tokenizer fields), a second read of
    the tokenizer on the engine's start. A spare
    fills that cache with the fields of the model config frmps's engine arguments
    give (``engine_args``: the model directory as tokenizer, the defaults
    otherwise), so the engine built after the activation finds it; a config that
    differs is a miss, which only costs the read. vLLM's object stays its own (the
    engine's own tokenizer is a separate one, used from the gRPC threads)."""
    from types import SimpleNamespace

    try:
        from vllm.tokenizers.registry import cached_tokenizer_from_config

        return cached_tokenizer_from_config(SimpleNamespace(
            skip_tokenizer_init=False, hf_config=None, model=model, tokenizer=model, code_revision=None,
            runner_type="generate", tokenizer_mode="auto", tokenizer_revision=None, trust_remote_code=False))
    except Exception as e:  # a head start only
        logging.getLogger(__name__).warning("spare: could not fill vLLM's tokenizer cache for %s: %s", model, e)
        return None


_XGRAMMAR_HANDED_OVER: list[str] = []  # the models whose prebuilt vocabulary index vLLM took (tests read it)


def _seed_xgrammar_tokenizer_info(model: str, tok: Any) -> None:
    """vLLM's xgrammar backend indexes the tokenizer's vocabulary when it is built
    (``xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=<the model's>)``,
    vllm/v1/structured_output/backend_xgrammar.py), which a standby does in its
    takeover warm-up (``VllmCore._warm_structured_outputs``), on its start. A spare builds
    it ahead for vLLM's cached tokenizer (``_seed_vllm_tokenizer_cache``) and the
    model's vocabulary size, and hands it over once: the first call with that very
    tokenizer object and those arguments gets it, every other call builds its own.
    The index is a pure function of the tokenizer and the size."""
    try:
        import xgrammar as xgr

        vocab = int(hf_config(model)["vocab_size"])
        built = [xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)]
        build = xgr.TokenizerInfo.from_huggingface

        def from_huggingface(tokenizer: Any, **kw: Any) -> Any:
            if built and tokenizer is tok and kw == {"vocab_size": vocab}:
                _XGRAMMAR_HANDED_OVER.append(model)
                return built.pop()
            return build(tokenizer, **kw)

        xgr.TokenizerInfo.from_huggingface = staticmethod(from_huggingface)
    except Exception as e:  # a head start only
        logging.getLogger(__name__).warning("spare: could not index the vocabulary for grammars ahead (%s): %s", model, e)
