"""vLLM's own baselines for `frmps bench --engine vllm`, in the engine processes
the driver starts (baseline_engine's roles with --engine vllm): plain vLLM, with
none of frmps (no frmps scheduler, sleep backend or allocator), in process
(vLLM's EngineCore, tensor parallel 1, the uni executor), on the same model
directory, block count and context length as `frmps serve --engine vllm`:

  victim  serves the requests (inside its MPS server on the GPU) until the fault;
  sleep   vLLM's sleep mode level 1: built (weights, KV cache, compiled graphs),
          then EngineCore.sleep(level=1), which offloads the weights to pinned host
          memory and discards the KV cache; on the victim's death wake_up() brings
          both back and the requests are re-prefilled (prompt + the tokens the
          client already has) to their next token;
  cold    a new process that builds vLLM from a safetensors checkpoint of the real
          shapes on local disk (imports, CUDA context, weights, profiling, KV cache,
          torch.compile and CUDA graphs unless --warmup 0: enforce_eager), re-prefills
          and emits the next token.

``BaselineCore`` drives vLLM's EngineCore through the interface the bench's
roles drive the reference engine through (add_request, adopt_request without
KV = re-prefill, step -> outputs with key / output_index / new_token_ids /
finished, has_work), so the victim and the recovery are the same code for both
engines (engine_io). vLLM is imported lazily: this module loads without it.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass
from typing import Any

REQUEST_PREFIX = "bench-"


@dataclass
class Out:
    key: int
    new_token_ids: list[int]
    output_index: int
    finished: bool


@dataclass
class Adopted:
    reused_tokens: int
    prefill_tokens: int


def sampling(r: dict) -> Any:
    from vllm import SamplingParams

    seed = r.get("seed")
    return SamplingParams(max_tokens=int(r.get("max_tokens", 16)), temperature=float(r.get("temperature", 0.0)),
                          seed=None if seed is None else int(seed), ignore_eos=True)


class BaselineCore:
    """vLLM's EngineCore (or anything with add_request(Request), step(),
    abort_requests(ids), a scheduler and request_block_hasher) behind the
    reference engine's core interface."""

    def __init__(self, core: Any):
        self.core = core
        self.scheduler = core.scheduler
        self._tracks: dict[str, list[int]] = {}  # request id -> [key, outputs so far]

    def add_request(self, key: int, prompt: list[int], params: Any, first_index: int = 0) -> None:
        from vllm.v1.request import Request

        rid = f"{REQUEST_PREFIX}{int(key)}"
        if rid in self._tracks:
            raise ValueError(f"request {key} already exists")
        req = Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=params, pooling_params=None,
                      block_hasher=getattr(self.core, "request_block_hasher", None))
        self.core.add_request(req)
        self._tracks[rid] = [int(key), int(first_index)]

    def adopt_request(self, key: int, params: Any, token_ids: list[int], num_prompt: int, num_computed: int,
                      block_ids: list[int], seed: Any, delivered_token_ids: list[int]) -> Adopted:
        """A baseline has no KV to adopt: prompt + the delivered tokens become the
        prompt of a fresh request (one prefill), whose outputs continue at the
        delivered count."""
        if num_computed or block_ids:
            raise ValueError("a vLLM baseline adopts requests without KV only")
        delivered = list(delivered_token_ids)
        params = copy.deepcopy(params)
        if params.max_tokens is not None:
            params.max_tokens -= len(delivered)
            if params.max_tokens < 1:
                raise ValueError(f"request {key}: nothing left to generate after {len(delivered)} tokens")
        prompt = list(token_ids[:num_prompt]) + delivered
        self.add_request(key, prompt, params, first_index=len(delivered))
        return Adopted(reused_tokens=0, prefill_tokens=len(prompt))

    def step(self) -> list[Out]:
        outputs_by_client, _ = self.core.step()
        out: list[Out] = []
        for eco in outputs_by_client.values():
            for o in eco.outputs:
                tr = self._tracks.get(o.request_id)
                if tr is None:
                    continue
                new = list(o.new_token_ids)
                finished = o.finish_reason is not None
                out.append(Out(tr[0], new, tr[1], finished))
                tr[1] += len(new)
                if finished:
                    del self._tracks[o.request_id]
        return out

    def has_work(self) -> bool:
        return bool(self.scheduler.has_requests())

    def abort_all(self) -> None:
        """Abort every request and step until vLLM holds none (their blocks freed)."""
        ids = list(self._tracks)
        if ids:
            self.core.abort_requests(ids)
        self._tracks.clear()
        for _ in range(4):  # one step hands the finished ids to the model runner
            if not self.scheduler.has_requests():
                return
            self.core.step()
        if self.scheduler.has_requests():
            raise RuntimeError("vLLM still has requests after aborting them all")


def model_dir(model: str) -> str:
    """A preset's model directory (frmps model init), or the directory given."""
    if os.path.isdir(model):
        return model
    from frmps_engine import modeldir

    return modeldir.write(model, modeldir.default_dir(model))


def kv_bytes(cfg: dict, num_blocks: int, block_size: int, dtype: str) -> int:
    from frmps_engine.vllm.pools import kv_cache_bytes

    heads = cfg["num_attention_heads"]
    return kv_cache_bytes(num_layers=cfg["num_hidden_layers"], num_blocks=num_blocks, block_size=block_size,
                          num_kv_heads=cfg.get("num_key_value_heads", heads),
                          head_size=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                          dtype_bytes={"bfloat16": 2, "float16": 2, "float32": 4}[dtype])


def engine_args(args, model: str, *, load_format: str, sleep: bool = False, eager: bool = False,
                gpu_memory_utilization: float = 0.9) -> Any:
    """The EngineArgs of a baseline engine: the deployment's block count and context
    (num_gpu_blocks_override, and kv_cache_memory_bytes so vLLM sizes nothing from
    free memory), dtype bfloat16, block size 16, TP 1, in process."""
    import json

    from vllm.engine.arg_utils import EngineArgs

    if not args.num_blocks:
        raise ValueError("--num-blocks is required with --engine vllm (the deployment's KV block count)")
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    kw: dict[str, Any] = {}
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    return EngineArgs(model=model, dtype="bfloat16", max_model_len=args.max_model_len or 4096, block_size=16,
                      num_gpu_blocks_override=args.num_blocks,
                      kv_cache_memory_bytes=kv_bytes(cfg, args.num_blocks, 16, "bfloat16"),
                      gpu_memory_utilization=gpu_memory_utilization, load_format=load_format,
                      enable_sleep_mode=sleep, enforce_eager=eager, tensor_parallel_size=1,
                      distributed_executor_backend="uni", seed=args.seed, **kw)


def build(args, *, load_format: str, model: str | None = None, sleep: bool = False, eager: bool = False
          ) -> BaselineCore:
    """vLLM's EngineCore in this process (the GPU path)."""
    import torch
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.abstract import Executor

    from frmps_engine.vllm.engine import startup_memory_fraction

    if args.device == "cpu":
        raise ValueError("the vLLM baselines need a GPU (vLLM builds no engine on the CPU here)")
    free, total = torch.cuda.mem_get_info()
    ea = engine_args(args, model or model_dir(args.model), load_format=load_format, sleep=sleep, eager=eager,
                     gpu_memory_utilization=startup_memory_fraction(free, total, 0.9))
    config = ea.create_engine_config()
    return BaselineCore(EngineCore(config, Executor.get_class(config), log_stats=False))


def run_sleep(args) -> int:
    """vLLM's sleep mode level 1 as the standby: built, asleep; wake on command."""
    from .engine_io import die_on_device_error, emit, serve_sleep_commands

    t0 = time.perf_counter()
    try:
        core = build(args, load_format="dummy", sleep=True)
        t_built = time.perf_counter()
        core.core.sleep(level=1)
    except Exception as e:
        die_on_device_error(e)
        raise
    emit("ready", pid=os.getpid(), init_s=round(time.perf_counter() - t0, 3),
         sleep_s=round(time.perf_counter() - t_built, 3), sleep_mode="vLLM level 1")

    def wake() -> dict:
        w0 = time.perf_counter()
        core.core.wake_up()
        return {"wake_up_s": round(time.perf_counter() - w0, 6)}

    def sleep() -> None:
        core.abort_all()
        core.core.sleep(level=1)

    return serve_sleep_commands(core, sampling, wake, sleep)


def run_cold(args, requests: list[dict], t_process: float, t_import: float) -> dict:
    """A new vLLM engine from the checkpoint on disk, then the recovery."""
    from .engine_io import recover, sync

    times = {"python_start_to_main_s": round(t_import - t_process, 4)}
    t = time.perf_counter()
    import vllm.v1.engine.core  # noqa: F401  (timed apart from building the engine)

    times["import_vllm_s"] = round(time.perf_counter() - t, 4)
    t = time.perf_counter()
    core = build(args, load_format="safetensors", model=args.checkpoint, eager=not args.warmup)
    sync(args.device)
    times["engine_init_s"] = round(time.perf_counter() - t, 4)
    t = time.perf_counter()
    rec = recover(core, requests, sampling)
    times["prefill_s"] = round(time.perf_counter() - t, 4)
    times["process_start_to_first_token_s"] = round(max(rec["first_token_unix"].values()) - t_process, 4)
    return {"core": core, "times": times, "steps": rec["steps"]}
