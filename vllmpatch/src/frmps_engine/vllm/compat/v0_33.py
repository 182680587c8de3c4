"""vLLM 0.33.0: what this version needs that 0.26.0 does not (file:line are
inside the 0.33.0 wheel's ``vllm`` package; VLLM.md has the rest)."""

from __future__ import annotations

from typing import Any

from ..patches import TP_WORKER_POOLS, Patch, loader_weights_pool, worker_pool_context

VERSION = "0.33.0"

# The worker's kv_cache tag is entered by the runners only around the one KV
# backing allocation (v1/worker/gpu_model_runner.py:6934, v1/worker/gpu/attn_utils.py:409).
WORKER_PLACES_KV = True


def engine_args(sleep_backend: str) -> dict[str, Any]:
    # EngineArgs carries the backend name to ModelConfig (engine/arg_utils.py:800, 2050).
    return {"sleep_mode_backend": sleep_backend}


def finish_config(vllm_config: Any, sleep_backend: str) -> None:
    if vllm_config.model_config.sleep_mode_backend != sleep_backend:
        raise ValueError(f"vLLM config has sleep_mode_backend {vllm_config.model_config.sleep_mode_backend!r}")


def kv_cache_allocations(num_layers: int, layer_bytes: int) -> list[int]:
    # One backing allocation for every layer (v1/worker/utils.py:564-596: torch.zeros(buf_size)).
    return [num_layers * layer_bytes]


def kv_cache_planner():
    from vllm.v1.core.kv_cache_planning import get_kv_cache_configs

    return get_kv_cache_configs


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="worker-pool-context",
        target="vllm.v1.worker.gpu_worker:Worker._maybe_get_memory_pool_context",
        why=(
            "A sleep-mode backend controls only suspend/resume/discard; allocation of the tagged pools "
            "still goes to get_mem_allocator_instance(), i.e. CuMemAllocator (gpu_worker.py:396-417), "
            "whose VMM memory has no exportable handle. The kv_cache pool must come from frmps' "
            "exportable pool instead, and frmps offloads nothing, so no other tag needs CuMemAllocator."
        ),
        how=(
            "When model_config.sleep_mode_backend == 'frmps': 'kv_cache' returns the PoolController's "
            "allocation context (allocation.PoolContexts: the interceptor's region + a MemPool over "
            "frmps_malloc); 'weights' returns PoolController.weights_phase(), which only checks that the "
            "loader patch placed the model; every other tag returns nullcontext() (private memory, and no "
            "CuMemAllocator MemPool around the KV one: nested use_mem_pool contexts routed allocations to "
            "the outer pool in torch releases without the fix for pytorch/pytorch#161193). Every other "
            "backend calls the original."
        ),
        removable_when=(
            "vLLM lets a SleepModeBackend provide the memory-pool context for a tag (the RFC #34303 "
            "backend interface grows an allocation hook), or CuMemAllocator can create exportable handles."
        ),
        make=worker_pool_context(places_kv=True),
    ),
    Patch(
        name="loader-weights-pool",
        target="vllm.model_executor.model_loader.base_loader:BaseModelLoader.load_model",
        why=(
            "vLLM's 'weights' phase is the runner's whole load_model (gpu_worker.py:594-601), and the V2 "
            "runner builds mutable per-request state there after the model (gpu/model_runner.py:435-536: "
            "PenaltiesState.output_bin_counts, StructuredOutputsWorker.grammar_bitmask). In the shared "
            "weights pool that state would be read-only on a standby and shared with the active; only "
            "the model (parameters and buffers) may go there."
        ),
        how=(
            "When vllm_config.model_config.sleep_mode_backend == 'frmps': run the original (model "
            "creation, weight loading, post-processing: base_loader.py:62-116) inside the PoolController's "
            "'weights' allocation context, then check that every parameter and buffer on the pool's "
            "device lies in the weights pool and log a placement digest. Otherwise call the original. "
            "Loaders that override load_model (tensorizer, modelexpress) bypass it, and the worker's "
            "weights phase then refuses to start."
        ),
        removable_when=(
            "vLLM scopes the 'weights' memory-pool tag to the model loader (or gives model state its own "
            "tag), so that the worker-level context places exactly the model."
        ),
        make=loader_weights_pool,
    ),
    TP_WORKER_POOLS,
)


# -- the engine-core protocol (frontend/engine_server.py) -----------------------

def ready_response(vllm_config: Any, engine_index: int) -> bytes:
    """The ready message an engine sends on its DEALER when it connects: an
    ``EngineCoreReadyResponse`` (v1/engine/__init__.py:74-111, 28 fields, 17 of
    them required) encoded with msgspec, as EngineCoreProc._make_ready_response
    fills it (v1/engine/core.py:1883-1931, sent at :1973-1979). The client syncs
    ``max_model_len`` and block sizes and adds ``num_gpu_blocks`` to its config
    (core_client.py:851-900). No KV events, weight transfer or coordinator."""
    import msgspec
    from vllm.v1.engine import EngineCoreReadyResponse
    from vllm.version import __version__

    cc, pc, sc = vllm_config.cache_config, vllm_config.parallel_config, vllm_config.scheduler_config
    lora = vllm_config.lora_config
    return msgspec.msgpack.encode(EngineCoreReadyResponse(
        max_model_len=vllm_config.model_config.max_model_len,
        num_gpu_blocks=cc.num_gpu_blocks or 0,
        block_size=cc.block_size,
        mamba_block_size=cc.mamba_block_size,
        effective_attention_block_size=cc.effective_attention_block_size,
        dp_stats_address=None,
        dtype=str(vllm_config.model_config.dtype).removeprefix("torch."),
        vllm_version=__version__,
        world_size=pc.world_size,
        data_parallel_size=pc.data_parallel_size,
        kv_cache_size_tokens=cc.kv_cache_size_tokens,
        kv_cache_max_concurrency=cc.kv_cache_max_concurrency,
        tensor_parallel_size=pc.tensor_parallel_size,
        pipeline_parallel_size=pc.pipeline_parallel_size,
        decode_context_parallel_size=pc.decode_context_parallel_size,
        data_parallel_rank=int(engine_index),
        max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        instance_id=vllm_config.instance_id,
        supports_lora=lora is not None,
        max_loras=lora.max_loras if lora is not None else 0,
        enable_sleep_mode=vllm_config.model_config.enable_sleep_mode,
    ))


def error_output(request_id: str, message: str) -> Any:
    """An output that ends ``request_id`` with ``FinishReason.ERROR`` and a
    ``RequestError`` carrying ``message`` (v1/engine/__init__.py:247; vllm/outputs.py:23-35),
    as EngineCoreProc._send_finish_outputs_to_client does (v1/engine/core.py:2246-2268)."""
    from vllm.outputs import RequestError
    from vllm.v1.engine import EngineCoreOutput, FinishReason

    return EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR,
                            error=RequestError(code="frmps_refused", message=message))


def api_server() -> Any:
    """The pieces of ``vllm serve`` that frmps's frontend process runs
    (frontend/server.py): the serve argument parser and its validation
    (entrypoints/common/cli_args.py:431, 531), the CLI's environment set-up
    (entrypoints/common/startup.py:131), the listening socket
    (entrypoints/launchers/launcher.py:365) and one API-server worker with
    externally managed engines (``run_server_worker(listen_address, sock, args,
    client_config)``, entrypoints/launchers/api_server/entry.py:179-201: builds
    the AsyncLLM with ``client_addresses=client_config``, :94-103, then vLLM's
    FastAPI app, ``build_app`` + ``init_app_state``, under uvicorn through
    ``serve_http``, :115-161)."""
    from types import SimpleNamespace

    from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.common.startup import cli_env_setup
    from vllm.entrypoints.launchers.api_server.entry import run_server_worker
    from vllm.entrypoints.launchers.launcher import setup_server

    return SimpleNamespace(make_arg_parser=make_arg_parser, validate_parsed_serve_args=validate_parsed_serve_args,
                           cli_env_setup=cli_env_setup, setup_server=setup_server,
                           run_server_worker=run_server_worker)
