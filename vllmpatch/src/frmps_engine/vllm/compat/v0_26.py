"""vLLM 0.26.0: what this version needs that 0.33.0 does not (file:line are
inside the 0.26.0 wheel's ``vllm`` package; VLLM.md has the rest).

The two differences that matter:
- EngineArgs has no ``sleep_mode_backend`` (ModelConfig has it:
  config/model.py:309), so the backend is set on the built config;
- the worker's ``kv_cache`` memory-pool tag wraps the runner's whole
  ``initialize_kv_cache`` (v1/worker/gpu_worker.py:731-732), which also builds
  the block tables and attention metadata (v1/worker/gpu/model_runner.py:411-504),
  and the KV cache is one allocation per layer
  (v1/core/kv_cache_utils.py:1408-1420; v1/worker/gpu/attn_utils.py:172-195).
  So the worker tag only arms the placement, and the two KV allocation
  functions (V2 and V1 model runner) are patched to place what they allocate.
"""

from __future__ import annotations

from typing import Any

from ..patches import TP_WORKER_POOLS, Patch, kv_allocation, loader_weights_pool, worker_pool_context

VERSION = "0.26.0"

WORKER_PLACES_KV = False


def engine_args(sleep_backend: str) -> dict[str, Any]:
    return {}  # no EngineArgs field for the backend: see finish_config


def finish_config(vllm_config: Any, sleep_backend: str) -> None:
    # Read lazily by the worker (v1/worker/gpu_worker.py:181-190) and by the
    # patches, never while the config is built, so setting it afterwards is enough.
    vllm_config.model_config.sleep_mode_backend = sleep_backend


def kv_cache_allocations(num_layers: int, layer_bytes: int) -> list[int]:
    # One torch.zeros per layer: KVCacheTensor(size=page_size * num_blocks) per
    # layer (v1/core/kv_cache_utils.py:1408-1420), allocated in order by
    # v1/worker/gpu/attn_utils.py:172-195 (V2) or gpu_model_runner.py:7238-7270 (V1).
    return [layer_bytes] * num_layers


def kv_cache_planner():
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    return get_kv_cache_configs


_KV_WHY = (
    "The worker's kv_cache memory-pool tag covers the runner's whole initialize_kv_cache "
    "(gpu_worker.py:731-732): the block tables, attention metadata builders and CUDA-graph buffers it "
    "creates (gpu/model_runner.py:411-504) are mutable per-process state that must stay private; only "
    "the KV tensors may go to the shared pool."
)
_KV_HOW = (
    "While the worker's kv_cache phase is armed (worker-pool-context, PoolController.kv_phase), run the "
    "original inside the kv_cache pool's allocation context, check that every layer's tensor lies in the "
    "pool and log a placement digest (equal in the active and the standby). Otherwise call the original."
)
_KV_REMOVABLE = "vLLM enters the kv_cache memory-pool tag only around the KV allocation (as 0.33 does)."

PATCHES: tuple[Patch, ...] = (
    Patch(
        name="worker-pool-context",
        target="vllm.v1.worker.gpu_worker:Worker._maybe_get_memory_pool_context",
        why=(
            "A sleep-mode backend controls only suspend/resume (device_allocator/sleep_mode_backend.py:37-107); "
            "allocation of the tagged pools still goes to get_mem_allocator_instance(), i.e. CuMemAllocator "
            "(gpu_worker.py:249-269), whose VMM memory has no exportable handle."
        ),
        how=(
            "When model_config.sleep_mode_backend == 'frmps': 'kv_cache' returns PoolController.kv_phase(), "
            "which arms the two KV allocation patches below and checks that they placed the cache; 'weights' "
            "returns PoolController.weights_phase(), which checks that the loader patch placed the model; "
            "every other tag returns nullcontext() (private memory). Every other backend calls the original."
        ),
        removable_when=(
            "vLLM lets a SleepModeBackend provide the memory-pool context for a tag, or CuMemAllocator can "
            "create exportable handles."
        ),
        make=worker_pool_context(places_kv=False),
    ),
    Patch(
        name="loader-weights-pool",
        target="vllm.model_executor.model_loader.base_loader:BaseModelLoader.load_model",
        why=(
            "vLLM's 'weights' phase is the runner's whole load_model (gpu_worker.py:423-431), and the V2 runner "
            "builds mutable state there after the model (gpu/model_runner.py:316-330: model state, samplers). "
            "Only the model (parameters and buffers) may go to the shared weights pool."
        ),
        how=(
            "When vllm_config.model_config.sleep_mode_backend == 'frmps': run the original (model creation, "
            "weight loading, post-processing: base_loader.py:43-82) inside the 'weights' allocation context, "
            "check that every parameter and buffer on the pool's device lies in the pool and log a placement "
            "digest. Otherwise call the original."
        ),
        removable_when="vLLM scopes the 'weights' memory-pool tag to the model loader.",
        make=loader_weights_pool,
    ),
    Patch(
        name="kv-alloc-v2",
        target="vllm.v1.worker.gpu.attn_utils:_allocate_kv_cache",
        why=_KV_WHY + " This is the V2 model runner's KV allocation (attn_utils.py:172-195, called at 531).",
        how=_KV_HOW,
        removable_when=_KV_REMOVABLE,
        make=kv_allocation,
    ),
    Patch(
        name="kv-alloc-v1",
        target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._allocate_kv_cache_tensors",
        why=_KV_WHY + " This is the V1 model runner's KV allocation (gpu_model_runner.py:7238-7270, called at 7511).",
        how=_KV_HOW,
        removable_when=_KV_REMOVABLE,
        make=kv_allocation,
    ),
    TP_WORKER_POOLS,
)


# -- the engine-core protocol (frontend/engine_server.py) -----------------------

def ready_response(vllm_config: Any, engine_index: int) -> bytes:
    """The ready message an engine sends on its DEALER when it connects: an
    ``EngineCoreReadyResponse`` (v1/engine/__init__.py:68-86, 10 fields) encoded
    with msgspec, as EngineCoreProc.process_input_sockets builds it
    (v1/engine/core.py:1624-1645). The client syncs ``max_model_len`` and adds
    ``num_gpu_blocks`` to its config (core_client.py:714-740)."""
    import msgspec
    from vllm.v1.engine import EngineCoreReadyResponse
    from vllm.version import __version__

    cc, pc = vllm_config.cache_config, vllm_config.parallel_config
    return msgspec.msgpack.encode(EngineCoreReadyResponse(
        max_model_len=vllm_config.model_config.max_model_len,
        num_gpu_blocks=cc.num_gpu_blocks or 0,
        block_size=cc.block_size,
        dp_stats_address=None,
        dtype=str(vllm_config.model_config.dtype).removeprefix("torch."),
        vllm_version=__version__,
        world_size=pc.world_size,
        data_parallel_size=pc.data_parallel_size,
        kv_cache_size_tokens=getattr(cc, "kv_cache_size_tokens", None),
        kv_cache_max_concurrency=getattr(cc, "kv_cache_max_concurrency", None),
    ))


def error_output(request_id: str, message: str) -> Any:
    """An output that ends ``request_id`` with ``FinishReason.ERROR``, as
    EngineCoreProc._send_error_outputs_to_client does (v1/engine/core.py:1813-1831).
    0.26's EngineCoreOutput has no ``error`` field: the message is only logged."""
    from vllm.v1.engine import EngineCoreOutput, FinishReason

    return EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR)


def api_server() -> Any:
    """The pieces of ``vllm serve`` that frmps's frontend process runs
    (frontend/server.py): the serve argument parser and its validation
    (entrypoints/openai/cli_args.py:339, 386), the CLI's environment set-up
    (entrypoints/serve/utils/api_utils.py:149), the listening socket
    (entrypoints/openai/api_server.py:616) and one API-server worker with
    externally managed engines (``run_server_worker(listen_address, sock, args,
    client_config)``, entrypoints/openai/api_server.py:762-781: builds the
    AsyncLLM with ``client_addresses=client_config``, :175-184, then vLLM's
    FastAPI app, ``build_app`` + ``init_app_state``, under uvicorn through
    ``serve_http``, :653-698)."""
    from types import SimpleNamespace

    from vllm.entrypoints.openai.api_server import run_server_worker, setup_server
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    return SimpleNamespace(make_arg_parser=make_arg_parser, validate_parsed_serve_args=validate_parsed_serve_args,
                           cli_env_setup=cli_env_setup, setup_server=setup_server,
                           run_server_worker=run_server_worker)
