"""The reference engine: a compact paged-KV Qwen2 engine on PyTorch.

    from frmps_engine.refengine import EngineConfig, RefCore, SamplingParams, pool_layout
    cfg = EngineConfig.from_preset("tiny")
    core = RefCore(cfg, RefCore.allocate_pools(cfg), load_weights=True)
"""

from .block_manager import BlockError, BlockManager
from .config import ConfigError, EngineConfig, ModelShape, PoolSpec, pool_layout, presets, weights_bytes
from .engine import RefCore
from .sampling import SamplingParams, default_seed
from .scheduler import AdoptError, AdoptResult, EngineError, RequestOutput, RequestView, Scheduler, SchedulerOutput
from .tokenizer import ByteTokenizer, IncrementalDetokenizer, TextState, TokenizerError, load_tokenizer
from .weights import WeightsError

__all__ = [
    "AdoptError", "AdoptResult", "BlockError", "BlockManager", "ByteTokenizer", "ConfigError", "EngineConfig",
    "RefCore", "EngineError", "IncrementalDetokenizer", "ModelShape", "PoolSpec", "RequestOutput", "RequestView",
    "SamplingParams", "Scheduler", "SchedulerOutput", "TextState", "TokenizerError", "WeightsError", "default_seed", "load_tokenizer",
    "pool_layout", "presets", "weights_bytes",
]
