"""The vLLM engine's adapter (the SDK's ``EngineAdapter``): ``python -m
frmps_engine.cli serve --engine vllm --model <hf-dir> ...`` makes the SDK runner
call ``make_adapter(args)``; the adapter derives the pool layout and builds a
``VllmCore`` (core.py) on vLLM's in-process EngineCore.

The vLLM side is built with official knobs only:
- ``scheduler_cls`` = FrmpsScheduler (committed views, adoption, counters);
- ``enable_sleep_mode`` + ``sleep_mode_backend="frmps"`` (pools.PoolController);
- ``num_gpu_blocks_override`` so both engines have the same block count;
- ``load_format="safetensors"`` for the active when the model directory holds
  ``*.safetensors`` (vLLM's own loader reads them into the weights pool), else
  ``"dummy"``; ``load_format="dummy"`` always for a standby, so it never loads
  weights: whatever it initialises lands in its private placeholder pools, and
  it serves the active's weights pool once it maps it;
- ``tensor_parallel_size=1`` and the in-process executor (the worker shares this
  process, hence the pool controller), or vLLM's worker processes (tp.py).

The environment policy is envpolicy.py, a spare's preload preload.py, the model
configuration and the weights pool's size modelcfg.py.

This module imports vLLM only inside functions, so the SDK can list engines
without vLLM installed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from . import SCHEDULER_CLS, SLEEP_BACKEND_NAME, sizing
from .core import VllmCore
from .envpolicy import (BI_KEEP_AOT_ENV, INDUCTOR_DETERMINISTIC_ENV, MEGA_AOT_ENV, TRITON_PTXAS_ENV,
                        async_scheduling_from_env, exact_compilation_config, flashinfer_sampler_default, importable,
                        inductor_deterministic, keep_aot_in_batch_invariant_mode, mega_aot_default,
                        pin_inductor_deterministic, structured_outputs_from_env, triton_cache_default,
                        triton_ptxas_default)
from .modelcfg import DTYPE_BYTES, cfg_field, hf_config, tokenizer_config, weights_pool_bytes
from .pools import PoolSpec, kv_cache_bytes, pool_layout
from .preload import preload, take_tokenizer
from .tokenizer import VllmTokenizer
from .tp import WORKER_EXTENSION as TP_WORKER_EXTENSION
from .triton_watch import watch_from_env
from ..modeldir import weights_source
from ..sdk.engine_api import rank_death
from ..sdk.params import structured_constraint
from ..sdk.seeds import to_int64


def startup_memory_fraction(free: int, total: int, wanted: float) -> float:
    """The gpu_memory_utilization to hand vLLM. Its worker refuses to start
    unless free memory >= gpu_memory_utilization x total (v1/worker/utils.py:
    716-770, called from gpu_worker.py:542), but frmps allocated the shared
    pools before vLLM starts (and the other engine shares the GPU), so the
    fraction is capped at what is free then. With ``kv_cache_memory_bytes``
    given and the block count pinned, vLLM sizes nothing else from it
    (gpu_worker.py:656-681 skips the memory profiling)."""
    if total <= 0 or free < 0:
        raise ValueError(f"bad device memory figures: {free} free of {total}")
    return max(0.01, min(float(wanted), 0.98 * free / total))


@dataclass
class VllmEngineConfig:
    model: str
    device: str = "cuda"
    num_blocks: int = 0  # 0: sized from --gpu-memory-utilization (sizing.py)
    block_size: int = 16
    max_model_len: int = 0  # 0: the model's own context length, as vLLM derives it
    dtype: str = "bfloat16"
    # "load": the active reads the model directory's *.safetensors into the weights
    # pool (a standby never loads: it maps that pool); "dummy": random weights.
    weights: str = "dummy"
    # None: vLLM decides (on where its executor and model runner support it, as
    # for vLLM alone); the scheduler class follows its decision (scheduler_cls_for).
    async_scheduling: bool | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int | None = None  # None: vLLM's default for `vllm serve`
    max_num_batched_tokens: int | None = None
    # vLLM's StructuredOutputsConfig fields (None: vLLM's defaults); from
    # FRMPS_VLLM_STRUCTURED_OUTPUTS_CONFIG.
    structured_outputs: dict | None = None
    # EngineArgs fields from --vllm-arg (vllm_overrides): vLLM's own flags,
    # applied over frmps's choices except those frmps owns.
    overrides: dict = field(default_factory=dict)
    # Ranks of a tensor-parallel group (tp.py); 1: the in-process executor.
    tensor_parallel_size: int = 1
    # False: the no-KV ablation (--no-kv-reuse, frmps bench's baseline): a standby recomputes adopted KV.
    kv_reuse: bool = True


def scheduler_cls_for(vllm_config: Any) -> str:
    """The frmps scheduler for a built VllmConfig: the async variant where vLLM
    settled on async scheduling (its platform hook has the last word, after
    EngineArgs), else the synchronous one. A synchronous scheduler under async
    scheduling would misread the in-flight step's placeholders."""
    from . import ASYNC_SCHEDULER_CLS

    return ASYNC_SCHEDULER_CLS if vllm_config.scheduler_config.async_scheduling else SCHEDULER_CLS


class VllmAdapter:
    """The SDK's EngineAdapter for the supported vLLM versions (``compat``)."""

    name = "vllm"

    def __init__(self, cfg: VllmEngineConfig):
        from .compat import current

        self.compat = current()
        self.version = self.compat.VERSION
        if cfg.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {cfg.dtype!r} not supported (use one of {sorted(DTYPE_BYTES)})")
        if not 0 < cfg.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {cfg.gpu_memory_utilization}")
        if cfg.weights not in ("load", "dummy"):
            raise ValueError(f"weights {cfg.weights!r}: want load or dummy")
        self.cfg = cfg
        self.hf = hf_config(cfg.model)
        self.model, self.device = cfg.model, cfg.device
        self._gpu_name = ""  # set by _gpu()
        if cfg.max_model_len < 1:  # vLLM's own derivation, which vLLM checks again when it builds
            cfg.max_model_len = sizing.model_max_len(self.hf, tokenizer_config(cfg.model))
        # Hello.weights (sdk/runner.py logs it at start).
        self.weights = weights_source(cfg.model, cfg.weights == "load")
        if cfg.device.startswith("cuda"):  # refused here, at the start, not once vLLM builds its sampler
            flashinfer_sampler_default(dict(os.environ), importable("flashinfer"))
        self.block_size, self.num_blocks, self.max_model_len = cfg.block_size, cfg.num_blocks, cfg.max_model_len
        # sizing.KVBudget: the runner's Hello carries it (control.proto KVBudget).
        self.kv_budget: sizing.KVBudget | None = None
        if cfg.num_blocks < 1:
            self.kv_budget = self._size_kv_cache()
            self.num_blocks = cfg.num_blocks = self.kv_budget.num_blocks
        elif cfg.device.startswith("cuda"):
            self.kv_budget = self._given_budget()
        # The largest FULL ring record this engine can publish (runner: checked against the ring).
        self.ring_record_bytes = 0
        if self.kv_budget is not None:
            from ..ring.layout import PAYLOAD_PER_ENTRY

            seqs, _ = self.batch_limits(self.kv_budget.gpu_total_bytes, self._gpu_name)
            self.ring_record_bytes = sizing.ring_record_bytes(
                max_num_seqs=seqs, max_model_len=self.max_model_len, block_size=self.block_size,
                kv_tokens=self.num_blocks * self.block_size, entry_bytes=PAYLOAD_PER_ENTRY)
        logging.getLogger(__name__).info("max_model_len %d, %s", self.max_model_len,
                                         self.kv_budget.line() if self.kv_budget else f"KV cache: {self.num_blocks} blocks (--num-blocks)")
        self._tokenizer = None
        self._gen_config: dict | None = None
        self._engine_core = False  # serve_engine_core(): cores without a detokenizer
        self._peer_death: Callable[[str], None] | None = None
        self._group_memory: Any = None  # tp.VllmGroupMemory of a tensor-parallel engine

    def _gpu(self) -> tuple[int, str]:
        """The GPU's memory and name, from NVML as vLLM reads them (no CUDA context)."""
        from vllm.platforms import current_platform

        dev = self.cfg.device
        index = int(dev.split(":", 1)[1]) if dev.startswith("cuda:") else 0
        total, self._gpu_name = int(current_platform.get_device_total_memory(index)), str(current_platform.get_device_name(index))
        return total, self._gpu_name

    def batch_limits(self, gpu_total: int, gpu_name: str) -> tuple[int, int]:
        """(max_num_seqs, max_num_batched_tokens) this engine runs with: the flags or
        --vllm-arg where given, else `vllm serve`'s defaults for this GPU."""
        seqs, tokens = sizing.serve_batch_defaults(gpu_total, gpu_name)
        seqs = self.cfg.overrides.get("max_num_seqs") or self.cfg.max_num_seqs or seqs
        tokens = self.cfg.overrides.get("max_num_batched_tokens") or self.cfg.max_num_batched_tokens or tokens
        return int(seqs), int(tokens)

    def block_bytes(self) -> int:
        """One KV block of every layer on one rank."""
        h, tp = self.hf, self.cfg.tensor_parallel_size
        heads = h["num_attention_heads"]
        return kv_cache_bytes(num_layers=h["num_hidden_layers"], num_blocks=1, block_size=self.block_size,
                              num_kv_heads=max(1, h.get("num_key_value_heads", heads) // tp),
                              head_size=h.get("head_dim") or h["hidden_size"] // heads,
                              dtype_bytes=DTYPE_BYTES[self.cfg.dtype])

    def _size_kv_cache(self, gpu: tuple[int, str] | None = None, env: Mapping[str, str] | None = None) -> "sizing.KVBudget":
        """The block count from --gpu-memory-utilization (sizing.size_kv), per rank.
        Both engines compute the same from the same configuration and GPU; the
        supervisor still launches every later engine with the active's count."""
        env = os.environ if env is None else env
        try:
            total, name = gpu or self._gpu()
        except Exception as e:  # noqa: BLE001 - NVML's or the platform's errors
            raise ValueError(f"--engine vllm: cannot read the GPU's memory to size the KV cache ({e}); "
                             "give --num-blocks") from None
        self._gpu_name = name
        seqs, tokens = self.batch_limits(total, name)
        tp = self.cfg.tensor_parallel_size
        weights = self._layout(1)[0].size
        report = sizing.MemoryReport(
            gpu_total=total, utilization=self.cfg.gpu_memory_utilization, weights=weights,
            activations=sizing.activation_bytes(self.hf, max_num_batched_tokens=tokens, max_num_seqs=seqs,
                                                dtype_bytes=DTYPE_BYTES[self.cfg.dtype], tp=tp),
            # The MPS server's context, where the engines run under MPS (the supervisor's client environment).
            mps=sizing.MPS_SERVER_BYTES if env.get("CUDA_MPS_PIPE_DIRECTORY") else 0)
        try:
            return sizing.size_kv(report, block_bytes=self.block_bytes(), layers=self.hf["num_hidden_layers"],
                                  min_blocks=-(-self.max_model_len // self.block_size) + 1,
                                  kv_pool_bytes=lambda n: self._layout(n)[1].size)
        except sizing.SizingError as exc:
            raise ValueError(f"--engine vllm: {exc}") from None

    def _given_budget(self) -> "sizing.KVBudget | None":
        """What --num-blocks gives, reported with the GPU's figures (None where NVML cannot say)."""
        try:
            total, _ = self._gpu()
        except Exception as e:  # noqa: BLE001 - a report only
            logging.getLogger(__name__).warning("the GPU's memory (NVML): %s", e)
            return None
        layout = self.pool_layout()
        return sizing.given_blocks(self.num_blocks, block_bytes=self.block_bytes(), weights=layout[0].size,
                                   kv_bytes=layout[1].size, gpu_total=total,
                                   utilization=self.cfg.gpu_memory_utilization)

    def _log_measured(self, device: Any) -> None:
        """The active, once built: the device's memory in use against the budget
        (MPS or not, cudaMemGetInfo counts every process on the GPU: here the
        active, its pools and the MPS server; the standby comes later)."""
        b = self.kv_budget
        if b is None:
            return
        try:
            import torch

            free, total = torch.cuda.mem_get_info(device)
        except Exception as e:  # noqa: BLE001 - a report only
            logging.getLogger(__name__).warning("device memory after the build: %s", e)
            return
        used = total - free
        est = b.weights_bytes + b.kv_bytes + (b.reserved_bytes - b.reserved.get("mps", 0)) // 2 + b.reserved.get("mps", 0)
        logging.getLogger(__name__).info(
            "device memory with the active built: %.2f GiB in use of %.2f GiB (the sizing counted %.2f GiB for "
            "the active, its pools and MPS; with the standby the deployment may use %.2f GiB)",
            used / sizing.GiB, total / sizing.GiB, est / sizing.GiB, b.budget_bytes / sizing.GiB)

    # engine_api.ProcessGroup: a tensor-parallel engine's ranks are vLLM's worker processes (tp.py).
    @property
    def workers_own_pools(self) -> bool:
        """Every rank builds its own pools in its worker: this process needs no memory
        backend of its own (cli.py passes memory.BackendName), and opens no device."""
        return self.cfg.tensor_parallel_size > 1

    def group_memory(self, local: Any) -> Any:
        if self.cfg.tensor_parallel_size == 1:
            return local
        from .tp import VllmGroupMemory

        local.close()  # rank 0 holds no pool memory (cli.py gives it a BackendName): the workers do
        self._group_memory = VllmGroupMemory(local.name, self.cfg.tensor_parallel_size)
        return self._group_memory

    def on_peer_death(self, fn: Callable[[str], None]) -> None:
        self._peer_death = fn

    def _worker_died(self) -> None:
        """vLLM's executor saw a worker process exit (its failure callback)."""
        if self._peer_death is not None:
            self._peer_death(self._dead_worker() or "a tensor-parallel worker of vLLM's executor died")

    def _dead_worker(self) -> str | None:
        """Which of vLLM's worker processes has exited, if one has. vLLM's executor
        shuts the others down once it saw one die (they exit 0 or by SIGTERM): a
        worker that died otherwise is the one to name."""
        executor = self._group_memory.executor if self._group_memory is not None else None
        dead = []
        for i, handle in enumerate(getattr(executor, "workers", None) or []):
            proc = getattr(handle, "proc", None)
            code = proc.exitcode if proc is not None else None
            if code is not None:
                dead.append((code in (0, -signal.SIGTERM), getattr(handle, "rank", i), proc.pid, code))
        if not dead:
            return None
        _, rank, pid, code = min(dead)  # a worker that died otherwise first, then by rank
        return rank_death(rank, f"vLLM worker pid {pid}", code)

    def dead_peer(self, wait_s: float) -> str | None:
        """engine_api.ProcessGroup: a step failed (vLLM's executor raises "Executor
        failed" once its monitor saw a worker die, before the failure callback runs):
        the dead worker, if one exits within wait_s seconds."""
        if self.cfg.tensor_parallel_size == 1:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            cause = self._dead_worker()
            if cause or time.monotonic() >= deadline:
                return cause
            time.sleep(0.01)

    def serve_engine_core(self) -> None:
        """engine_api.EngineCoreProtocol: the runner's core mode. Cores built from
        now on have no tokenizer of their own: vLLM's API server detokenizes and
        matches stop strings (a core that matched them would end requests behind
        the frontend's back), and requests arrive as token ids. vLLM's EngineCore
        keeps its tokenizer for structured outputs (the grammar compiler)."""
        self._engine_core = True

    def engine_core_server(self, core: VllmCore, input_address: str, output_address: str, **kw: Any) -> Any:
        """engine_api.EngineCoreProtocol: ``frontend.engine_server.EngineCoreServer`` over ``core``."""
        from .frontend.engine_server import EngineCoreServer

        return EngineCoreServer(core, input_address, output_address, **kw)

    def pool_layout(self):
        return self._layout(self.num_blocks)

    def _layout(self, num_blocks: int):
        h = self.hf
        heads = h["num_attention_heads"]
        layers = h["num_hidden_layers"]
        kv = kv_cache_bytes(
            num_layers=layers,
            num_blocks=num_blocks,
            block_size=self.block_size,
            # one rank's KV heads: vLLM divides them, or replicates one per rank when fewer
            num_kv_heads=max(1, cfg_field(h, "num_key_value_heads", heads) // self.cfg.tensor_parallel_size),
            head_size=cfg_field(h, "head_dim") or h["hidden_size"] // heads,
            dtype_bytes=DTYPE_BYTES[self.cfg.dtype],
        )
        allocations = self.compat.kv_cache_allocations(layers, kv // layers)
        # Diagnostic knob: room beyond the estimate (both engines read the same
        # environment, so their layouts still agree).
        slack = int(os.environ.get("FRMPS_VLLM_WEIGHTS_SLACK_MIB", "0") or 0) << 20
        tp = self.cfg.tensor_parallel_size
        one = pool_layout(weights_pool_bytes(h, self.cfg.dtype, tp) + slack, allocations)
        if tp == 1:
            return one
        # Every rank the same sizes, a pool's index its rank: weights then kv_cache of rank 0, then of rank 1, ...
        return [PoolSpec(s.tag, rank, s.size) for rank in range(tp) for s in one]

    def engine_args(self, load_weights: bool, gpu_memory_utilization: float | None = None) -> Any:
        from vllm.engine.arg_utils import EngineArgs

        from . import ASYNC_SCHEDULER_CLS

        return EngineArgs(
            model=self.cfg.model,
            dtype=self.cfg.dtype,
            max_model_len=self.cfg.max_model_len,
            block_size=self.cfg.block_size,
            num_gpu_blocks_override=self.cfg.num_blocks,
            load_format=self.load_format(load_weights),
            enable_sleep_mode=True,
            **self.compat.engine_args(SLEEP_BACKEND_NAME),
            # Replaced by scheduler_cls_for once vLLM has settled async_scheduling.
            scheduler_cls=ASYNC_SCHEDULER_CLS if self.cfg.async_scheduling else SCHEDULER_CLS,
            async_scheduling=self.cfg.async_scheduling,
            tensor_parallel_size=self.cfg.tensor_parallel_size,
            # One rank: the worker in this process. Several: vLLM's worker processes (tp.py); its custom
            # all-reduce (CUDA IPC buffers between the ranks) is off until it is checked inside MPS.
            distributed_executor_backend="uni" if self.cfg.tensor_parallel_size == 1 else "mp",
            # Its workers register frmps's plugin through a worker extension (tp_worker.py).
            **({} if self.cfg.tensor_parallel_size == 1 else {
                "disable_custom_all_reduce": True,
                "worker_extension_cls": TP_WORKER_EXTENSION}),
            # The KV cache is the kv_cache pool, allocated before vLLM starts:
            # vLLM must not size it from free memory (per rank with tensor parallelism).
            kv_cache_memory_bytes=self.pool_layout()[1].size,
            gpu_memory_utilization=gpu_memory_utilization or self.cfg.gpu_memory_utilization,
            seed=0,
            **{**{k: v for k, v in (("max_num_seqs", self.cfg.max_num_seqs),
                                    ("max_num_batched_tokens", self.cfg.max_num_batched_tokens)) if v},
               **self._structured_outputs_arg(), **self.cfg.overrides, **self._exact_compilation_arg()},
        )

    def _exact_compilation_arg(self) -> dict:
        """Under --exact (TORCHINDUCTOR_DETERMINISTIC=1 in the engines' environment):
        vLLM's compilation config, as --vllm-arg gives it, with Inductor's
        deterministic mode and no combo kernels (envpolicy.exact_compilation_config);
        nothing otherwise."""
        if not inductor_deterministic(os.environ):
            return {}
        return {"compilation_config": exact_compilation_config(self.cfg.overrides.get("compilation_config"))}

    def load_format(self, load_weights: bool) -> str:
        """vLLM's load_format: "safetensors" (its DefaultModelLoader, which reads
        the directory's *.safetensors into the parameters the loader patch placed
        in the weights pool, converting them to the engine's dtype) for the active
        of a model with weights; "dummy" for a standby (it never loads: its
        placeholder parameters are replaced by the active's pool when it maps it)
        and for dummy weights."""
        return "safetensors" if (load_weights and self.cfg.weights == "load") else "dummy"

    def _structured_outputs_arg(self) -> dict:
        if not self.cfg.structured_outputs:
            return {}
        from vllm.config import StructuredOutputsConfig

        return {"structured_outputs_config": StructuredOutputsConfig(**self.cfg.structured_outputs)}

    def create_core(self, pools: dict, load_weights: bool) -> VllmCore:
        """Build vLLM in this process on the given pools (GPU path; see VLLM.md).

        ``pools`` maps (tag, index) to the SDK's pool tensors (cuda-vmm: CUDA
        tensors over the interceptor's pools; a standby's are its scratch-backed
        reservations). They are wrapped in a PoolController with the allocation
        contexts of allocation.py, through which vLLM's model loader places the
        model in the weights pool and its worker the KV cache in the kv_cache
        pool. CPU pools are refused here, before vLLM is built.
        """
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.executor.abstract import Executor

        from .allocation import cuda_contexts
        from .plugin import register
        from .pools import PoolController, install_controller, set_context_factory

        register()
        import torch

        sampler_note = flashinfer_sampler_default(os.environ, importable("flashinfer"))
        if sampler_note:
            logging.getLogger(__name__).info("%s", sampler_note)
        ptxas = triton_ptxas_default(os.environ, os.path.dirname(torch.__file__))
        if ptxas:
            logging.getLogger(__name__).info("Triton's ptxas: %s (%s)", ptxas, TRITON_PTXAS_ENV)
        if pin_inductor_deterministic(os.environ):
            logging.getLogger(__name__).info(
                "Inductor's deterministic mode pinned on (%s=1, set by --exact): compiled reductions are chosen by "
                "heuristics, not timed, so every engine computes alike", INDUCTOR_DETERMINISTIC_ENV)
        if keep_aot_in_batch_invariant_mode(os.environ):
            logging.getLogger(__name__).warning(
                "%s=1: vLLM's AOT compile kept on in batch-invariant mode (an experiment: vLLM 0.26 turns it off "
                "there; whether the output stays batch-invariant is unproven)", BI_KEEP_AOT_ENV)
        if mega_aot_default(os.environ, torch.__version__):
            import vllm.envs

            triton_dir = triton_cache_default(os.environ, vllm.envs.VLLM_CACHE_ROOT)
            logging.getLogger(__name__).info(
                "torch.compile artifacts loaded whole (%s=1, frmps's default on torch %s; 0 turns it off); "
                "Triton's kernel cache: %s", MEGA_AOT_ENV, torch.__version__.split("+")[0], triton_dir)
        tp = self.cfg.tensor_parallel_size
        if tp == 1:
            controller = PoolController.external(pools, "active" if load_weights else "standby")
            contexts = cuda_contexts(controller)
            install_controller(controller)
            set_context_factory(contexts)
            free, total = torch.cuda.mem_get_info(controller.pool_device("kv_cache"))
            fraction = startup_memory_fraction(free, total, self.cfg.gpu_memory_utilization)
        else:
            fraction = self._tp_prepare(load_weights)
        from vllm.usage.usage_lib import UsageContext

        # `vllm serve`'s usage context: its batch defaults (EngineArgs.get_batch_defaults) where none is given.
        vllm_config = self.engine_args(load_weights, fraction).create_engine_config(
            usage_context=UsageContext.OPENAI_API_SERVER)
        self.compat.finish_config(vllm_config, SLEEP_BACKEND_NAME)
        vllm_config.scheduler_config.scheduler_cls = scheduler_cls_for(vllm_config)
        watch = watch_from_env()  # what Triton compiled during this build, and why (triton_watch.py)
        core = EngineCore(vllm_config, Executor.get_class(vllm_config), log_stats=False,
                          executor_fail_callback=self._worker_died if tp > 1 else None)
        if load_weights and tp == 1:
            self._log_measured(controller.pool_device("kv_cache"))
        if watch is not None and tp == 1:  # a tensor-parallel rank 0 compiles nothing: its ranks do (below)
            logging.getLogger(__name__).info("%s", watch.start_summary())
        if tp > 1:
            self._group_memory.attach(core.model_executor)
            try:
                for rank, line in enumerate(self._group_memory.rank_triton_summaries()):
                    logging.getLogger(__name__).info("rank %d: %s", rank, line)
            except Exception as e:  # noqa: BLE001 - diagnostics must not fail the build
                logging.getLogger(__name__).warning("the ranks' Triton summaries: %s", e)
            if load_weights:
                self._group_memory.collect()  # every rank's fds, which the runner exports
        return VllmCore(core, None if self._engine_core else self.tokenizer(), kv_reuse=self.cfg.kv_reuse)

    def _tp_prepare(self, load_weights: bool) -> float:
        """Before a tensor-parallel EngineCore (tp.py): tell vLLM's
        workers (through their inherited environment) this engine's role and every
        rank's pools; each builds its own after its device is up. Returns the
        startup-memory fraction: a rank's check (free >= fraction x total) runs
        before it allocates its pools, and frmps sized those itself, so only a
        nominal fraction is asked (vLLM does not size the KV cache from it:
        kv_cache_memory_bytes)."""
        from .tp import MULTIPROC_METHOD_ENV, POOLS_ENV, pools_env

        gm = self._group_memory
        if gm is None:
            raise ValueError("a tensor-parallel vLLM engine needs its group memory (the runner's ProcessGroup path)")
        if gm.name != "cuda-vmm":
            raise ValueError(f"--engine vllm needs --memory cuda-vmm (got {gm.name})")
        os.environ[POOLS_ENV] = pools_env(self.pool_layout(), "active" if load_weights else "standby", gm.name)
        # spawn, not vLLM's default fork: a forked worker would inherit every descriptor of this
        # process — its connection to the supervisor among them, which would then not close when
        # this process dies, and the supervisor would not see the death — and its gRPC threads' state.
        os.environ[MULTIPROC_METHOD_ENV] = "spawn"
        return min(self.cfg.gpu_memory_utilization, 0.01)

    def sampling_params(self, params: Any, seed: int) -> Any:
        """control_pb2.SamplingParams (validated by the SDK; ``seed`` resolved) -> vllm SamplingParams,
        with the model's end-of-sequence tokens as vLLM's own input processor sets them
        (v1/engine/input_processor.py: update_from_generation_config)."""
        # From its module: ``from vllm import`` goes through vllm's lazy __getattr__ and
        # import_module on every call (per request and per adopted request).
        from vllm.sampling_params import SamplingParams

        sp = SamplingParams(
            # vLLM requires max_tokens (vllm/v1/request.py:114); 0 on the wire means "up to the context".
            max_tokens=int(params.max_tokens) or self.max_model_len,
            temperature=float(params.temperature),
            top_p=float(params.top_p) if params.top_p else 1.0,
            top_k=int(params.top_k) if params.top_k else 0,
            stop=list(params.stop) or None,
            stop_token_ids=[int(t) for t in params.stop_token_ids] or None,
            ignore_eos=bool(params.ignore_eos),
            include_stop_str_in_output=bool(params.include_stop_str_in_output),
            seed=to_int64(seed),
            logprobs=int(params.logprobs) if params.HasField("logprobs") else None,
            logit_bias={int(t): float(b) for t, b in params.logit_bias.items()} or None,
            min_tokens=int(params.min_tokens),
            presence_penalty=float(params.presence_penalty),
            frequency_penalty=float(params.frequency_penalty),
            repetition_penalty=float(params.repetition_penalty) or 1.0,
            structured_outputs=_structured_outputs(params),
        )
        sp.update_from_generation_config(self._generation_config(), self.tokenizer().eos_token_id)
        return sp

    def _generation_config(self) -> dict:
        """The model directory's generation_config.json ({} without one), which vLLM
        reads for the end-of-sequence ids (ModelConfig.try_get_generation_config)."""
        if self._gen_config is None:
            path = os.path.join(self.cfg.model, "generation_config.json")
            try:
                with open(path) as f:
                    self._gen_config = dict(json.load(f))
            except FileNotFoundError:
                self._gen_config = {}
            except (OSError, ValueError, TypeError) as exc:
                raise ValueError(f"{path}: {exc}") from exc
        return self._gen_config

    def tokenizer(self) -> VllmTokenizer:
        if self._tokenizer is None:
            tok = take_tokenizer(self.cfg.model)  # a spare's (preload)
            if tok is None:
                from vllm.tokenizers.registry import get_tokenizer

                tok = get_tokenizer(self.cfg.model)
            self._tokenizer = VllmTokenizer(tok)
        return self._tokenizer


# EngineArgs fields that frmps sets itself: the shared pools are sized and
# placed from them (both engines must agree), or the engine's role depends on
# them. --vllm-arg refuses them, naming frmps's flag where there is one.
FRMPS_OWNED_ENGINE_ARGS = {
    "model": "--model", "max_model_len": "--max-model-len", "dtype": "frmps's dtype (bfloat16)",
    "block_size": "frmps's KV block size (16)", "num_gpu_blocks_override": "--num-blocks",
    "kv_cache_memory_bytes": "--num-blocks", "gpu_memory_utilization": "frmps's start-up memory fraction",
    "kv_cache_dtype": "frmps's KV pool layout", "quantization": "frmps's weights pool layout",
    "load_format": "--weights (the active loads the model directory's *.safetensors into the shared weights pool, "
                   "the standby maps it; dummy only where the directory has none)",
    "enable_sleep_mode": "frmps's standby",
    "scheduler_cls": "frmps's scheduler", "async_scheduling": "FRMPS_VLLM_ASYNC_SCHEDULING",
    "tensor_parallel_size": "--tensor-parallel-size",
    "pipeline_parallel_size": "one engine process", "data_parallel_size": "one engine process",
    "distributed_executor_backend": "one engine process", "seed": "frmps's seed rule",
    "sleep_mode_backend": "frmps's sleep backend", "worker_cls": "frmps's worker", "worker_extension_cls": "frmps's worker",
}


def vllm_overrides(argv: list[str]) -> dict:
    """The EngineArgs fields that ``--vllm-arg`` flags set, as vLLM parses them
    (its own ``EngineArgs.add_cli_args`` parser: the flags as ``vllm serve``
    spells them, e.g. ``--max-logprobs=50``, ``--enable-prefix-caching``,
    ``--structured-outputs-config '{"backend": "xgrammar"}'``). Only the flags
    given; frmps's own (FRMPS_OWNED_ENGINE_ARGS) are refused with ValueError,
    as is anything vLLM's parser refuses."""
    import argparse

    if not argv:
        return {}
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="--vllm-arg", add_help=False))
    for action in parser._actions:  # only what is given ends up in the namespace
        action.default, action.required = argparse.SUPPRESS, False
    try:
        given = vars(parser.parse_args(list(argv)))
    except SystemExit:  # argparse printed why (to the engine's log)
        raise ValueError(f"--vllm-arg: vLLM's engine arguments refuse {' '.join(argv)!r} (the reason is above)") from None
    owned = sorted(k for k in given if k in FRMPS_OWNED_ENGINE_ARGS)
    if owned:
        raise ValueError("--vllm-arg: frmps sets " + ", ".join(
            f"{k.replace('_', '-')} (use {FRMPS_OWNED_ENGINE_ARGS[k]})" for k in owned))
    return given


def make_adapter(args: Any) -> VllmAdapter:
    """Build the adapter from the CLI's parsed arguments (``serve --engine vllm``)."""
    from frmps_engine.sdk.adapters import AdapterError

    if getattr(args, "exact", None):
        raise AdapterError("--exact is the reference engine's scheduler mode; for vLLM use `frmps serve --exact`: "
                           "vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1 in every engine's environment, set "
                           "before vLLM is imported) with its Triton attention backend")
    tp = int(getattr(args, "tensor_parallel_size", 1) or 1)
    from ..modeldir import has_weights

    choice = getattr(args, "weights", None) or "auto"
    if choice not in ("auto", "dummy"):
        raise AdapterError(f"--weights {choice!r}: want auto or dummy")
    try:
        # Not a directory: VllmAdapter says so (no config.json).
        weights = "load" if choice == "auto" and os.path.isdir(args.model) and has_weights(args.model) else "dummy"
    except ValueError as exc:
        raise AdapterError(str(exc)) from exc
    try:
        async_scheduling = async_scheduling_from_env(os.environ)
        structured_outputs = structured_outputs_from_env(os.environ)
        overrides = vllm_overrides(list(getattr(args, "vllm_args", None) or ()))
    except ValueError as exc:
        raise AdapterError(str(exc)) from exc
    return VllmAdapter(
        VllmEngineConfig(
            model=args.model,
            device=getattr(args, "device", None) or "cuda",
            num_blocks=int(getattr(args, "num_blocks", 0) or 0),
            block_size=int(getattr(args, "block_size", 16) or 16),
            max_model_len=int(getattr(args, "max_model_len", 0) or 0),
            gpu_memory_utilization=float(getattr(args, "gpu_memory_utilization", None) or 0.9),
            dtype=getattr(args, "dtype", None) or "bfloat16",
            weights=weights,
            async_scheduling=async_scheduling,
            max_num_seqs=getattr(args, "max_num_seqs", None),
            max_num_batched_tokens=getattr(args, "max_num_batched_tokens", None),
            structured_outputs=structured_outputs,
            overrides=overrides,
            tensor_parallel_size=tp,
            kv_reuse=getattr(args, "kv_reuse", True) is not False,
        )
    )


make_adapter.preload = preload  # type: ignore[attr-defined]


def _structured_outputs(params: Any) -> Any:
    """The request's constraint (sdk/params.py) as vLLM's StructuredOutputsParams, or
    None. Its backend is chosen where vLLM's input processor chooses it, in the core
    (VllmCore: SamplingParams.verify against the engine's structured-outputs config)."""
    c = structured_constraint(params)
    if c is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    kind, value = c
    if kind == "json_schema":
        return StructuredOutputsParams(json=value)
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "choice":
        return StructuredOutputsParams(choice=json.loads(value))
    return StructuredOutputsParams(**{kind: value})
