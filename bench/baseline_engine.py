"""Engine processes the bench driver starts itself (the reference engine, the same
model and weights as `frmps serve`):

  victim            the process that dies: an engine serving requests (inside MPS on the GPU)
  sleep             the sleep-only baseline: weights in pinned host memory, no GPU weight or KV
                    memory while asleep; on wake it re-creates the pools at the same addresses,
                    copies the weights back, re-prefills and emits the first token
  cold              the cold-restart baseline: a new process that loads the weights from a
                    safetensors checkpoint on local disk, re-prefills and emits the first token
  context           a bare CUDA context (torch initialised, one tiny allocation): the reference
                    for the standby's memory overhead
  write-checkpoint  writes the model's dummy weights as a sharded safetensors checkpoint
  sync-overhead     step time with the engine loop publishing to the ring every N steps, and
                    without, in one process (sync_overhead.py)

Protocol: JSON lines. Commands on stdin (victim, sleep); events on stdout, each
with "ev" and "t" (time.time() when the event happened in this process).
"""

from __future__ import annotations

import time

T_PROCESS = time.time()  # before the heavy imports: the cold restart's import cost is measured from here

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

from bench.engine_io import (decode_more, die_on_device_error, emit, recover,  # noqa: E402
                                          serve_sleep_commands, serve_victim, sync)

def make_cfg(args, **over):
    from frmps_engine.refengine import EngineConfig

    kw = {}
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        v = getattr(args, name, None)
        if v:
            kw[name] = v
    if args.role in ("victim", "sleep", "cold") and has_exact_mode():
        # The baselines recover with one re-prefill pass unless asked for exact mode.
        kw["exact"] = bool(args.exact)
    kw.update(over)
    return EngineConfig.from_preset(args.model, device=args.device, num_blocks=args.num_blocks or None,
                                    max_model_len=args.max_model_len or None, seed=args.seed, **kw)


def has_exact_mode() -> bool:
    import dataclasses

    from frmps_engine.refengine import EngineConfig

    return any(f.name == "exact" for f in dataclasses.fields(EngineConfig))


def sampling(r: dict):
    from frmps_engine.refengine import SamplingParams

    return SamplingParams(max_tokens=int(r.get("max_tokens", 16)), temperature=float(r.get("temperature", 0.0)),
                          seed=r.get("seed"), ignore_eos=True)


# ----------------------------------------------------------------------------- victim


def run_victim(args) -> int:
    if args.engine == "vllm":
        from .vllm_baseline import build, sampling as vllm_sampling

        try:
            core = build(args, load_format="dummy")
        except Exception as e:
            die_on_device_error(e)
            raise
        return serve_victim(core, vllm_sampling, args.t_process)
    from frmps_engine.refengine import RefCore

    try:
        cfg = make_cfg(args)
        core = RefCore(cfg, RefCore.allocate_pools(cfg), load_weights=True)
        if args.warmup:
            core.warmup()
        sync(args.device)
    except Exception as e:
        die_on_device_error(e)
        raise
    return serve_victim(core, sampling, args.t_process)


# ----------------------------------------------------------------------------- recovery (sleep, cold)


def run_sleep(args) -> int:
    if args.engine == "vllm":
        from .vllm_baseline import run_sleep as run_vllm_sleep

        return run_vllm_sleep(args)
    import torch

    from frmps_engine.refengine import RefCore, pool_layout

    from .sleep_memory import make_sleep_pools

    t0 = time.perf_counter()
    try:
        cfg = make_cfg(args)
        specs = pool_layout(cfg)
        pools = make_sleep_pools(specs, args.device)
        pools.reserve()
        pools.wake()
        tensors = pools.tensors()
        # Built and warmed up (graphs captured) on the pools' addresses, which survive sleep.
        core = RefCore(cfg, tensors, load_weights=True)
        core.warmup()
        weights = tensors[("weights", 0)]
        kv = tensors[("kv_cache", 0)]
        host = torch.empty(weights.numel(), dtype=torch.uint8, pin_memory=args.device != "cpu")
        host.copy_(weights)
        sync(args.device)
        pools.sleep()
    except Exception as e:
        die_on_device_error(e)
        raise
    emit("ready", pid=os.getpid(), init_s=round(time.perf_counter() - t0, 3), host_copy_bytes=host.numel(),
         pinned=bool(host.is_pinned()) if args.device != "cpu" else False)
    def wake() -> dict:
        w0 = time.perf_counter()
        pools.wake()
        w1 = time.perf_counter()
        weights.copy_(host, non_blocking=True)
        sync(args.device)
        w2 = time.perf_counter()
        kv.zero_()  # fresh physical memory is undefined; masked attention rows must not meet NaNs
        sync(args.device)
        return {"map_s": round(w1 - w0, 6), "copy_weights_s": round(w2 - w1, 6),
                "zero_kv_s": round(time.perf_counter() - w2, 6), "weights_gib": round(weights.numel() / (1 << 30), 3)}

    def sleep() -> None:
        for k in list(core.scheduler.requests):
            core.abort(k)
        core.step()  # drain aborted outputs
        pools.sleep()

    return serve_sleep_commands(core, sampling, wake, sleep)


def run_cold(args) -> int:
    import torch

    t_import = time.time()
    raw = args.requests
    if raw.startswith("@"):
        with open(raw[1:]) as f:
            raw = f.read()
    requests = json.loads(raw)
    if args.engine == "vllm":
        from .vllm_baseline import run_cold as run_vllm_cold

        try:
            r = run_vllm_cold(args, requests, T_PROCESS, t_import)
            emit("recovered", **r["times"], steps=r["steps"])
            decode_more(r["core"], args.then_steps)
            emit("decoded")
        except Exception as e:
            die_on_device_error(e)
            raise
        return 0
    from frmps_engine.refengine import RefCore

    try:
        times = {"python_start_to_main_s": round(t_import - T_PROCESS, 4)}
        t = time.perf_counter()
        if args.device != "cpu":
            torch.cuda.init()
            torch.zeros(1, device=args.device)
            sync(args.device)
        times["cuda_context_s"] = round(time.perf_counter() - t, 4)
        cfg = make_cfg(args, weights=args.checkpoint)
        t = time.perf_counter()
        pools = RefCore.allocate_pools(cfg)
        sync(args.device)
        times["allocate_s"] = round(time.perf_counter() - t, 4)
        t = time.perf_counter()
        core = RefCore(cfg, pools, load_weights=True)
        sync(args.device)
        times["load_weights_s"] = round(time.perf_counter() - t, 4)
        t = time.perf_counter()
        if args.warmup:
            core.warmup()
            sync(args.device)
        times["warmup_s"] = round(time.perf_counter() - t, 4)
        t = time.perf_counter()
        rec = recover(core, requests, sampling)
        times["prefill_s"] = round(time.perf_counter() - t, 4)
        times["process_start_to_first_token_s"] = round(max(rec["first_token_unix"].values()) - T_PROCESS, 4)
        emit("recovered", **times, steps=rec["steps"])
        decode_more(core, args.then_steps)
        emit("decoded")
    except Exception as e:
        die_on_device_error(e)
        raise
    return 0


# ----------------------------------------------------------------------------- context, checkpoint


def run_context(args) -> int:
    import torch

    if args.device != "cpu":
        torch.cuda.init()
        x = torch.zeros(1, device=args.device)
        torch.cuda.synchronize()
    else:
        x = torch.zeros(1)
    emit("ready", pid=os.getpid(), numel=int(x.numel()))
    sys.stdin.read()  # until the driver closes stdin
    return 0


def hf_tensors(cfg, params):
    """(HF name, tensor view) of every checkpoint tensor, in a fixed order."""
    from frmps_engine.refengine.weights import _hf_targets

    for name, (pname, start, rows) in _hf_targets(cfg).items():
        yield name, params[pname].narrow(0, start, rows)


def make_room(root: str, need: int, keep: str) -> list[str]:
    """Delete other cached checkpoints under root (oldest first) until `need` bytes are free."""
    import shutil

    os.makedirs(root, exist_ok=True)
    evicted = []
    cands = []
    for name in os.listdir(root):
        d = os.path.join(root, name)
        if ".tmp-" in name and not os.path.exists(f"/proc/{name.rsplit('.tmp-', 1)[1]}"):
            shutil.rmtree(d, ignore_errors=True)  # left by a writer that was killed
            continue
        marker = os.path.join(d, "frmps-checkpoint.json")
        if os.path.abspath(d) != os.path.abspath(keep) and os.path.isfile(marker):
            cands.append((os.path.getmtime(marker), d))
    for _, d in sorted(cands):
        if shutil.disk_usage(root).free >= need:
            break
        shutil.rmtree(d, ignore_errors=True)
        evicted.append(os.path.basename(d))
    if shutil.disk_usage(root).free < need:
        raise RuntimeError(f"not enough disk for the checkpoint: {need / (1 << 30):.1f} GiB needed, "
                           f"{shutil.disk_usage(root).free / (1 << 30):.1f} GiB free in {root}")
    return evicted


# 2: a model directory (config.json, tokenizer) besides the shards, which vLLM loads too.
CHECKPOINT_FORMAT = 2


def write_model_files(model: str, cfg, out: str) -> list[str]:
    """The checkpoint's model directory files: a preset's (frmps model init: Qwen2.5's
    config.json and the local tokenizer, what `frmps serve --engine vllm` reads), or
    for other reference shapes (the tiny test model) a Qwen2 config.json of that shape."""
    from frmps_engine import modeldir

    try:
        modeldir.config_json(model)
    except ValueError:
        s = cfg.shape
        os.makedirs(out, exist_ok=True)
        conf = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
                "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size,
                "num_hidden_layers": s.num_layers, "num_attention_heads": s.num_heads,
                "num_key_value_heads": s.num_kv_heads, "vocab_size": s.vocab_size,
                "max_position_embeddings": s.max_position_embeddings, "rms_norm_eps": s.rms_norm_eps,
                "rope_theta": s.rope_theta, "tie_word_embeddings": s.tie_word_embeddings,
                "torch_dtype": cfg.dtype, "use_sliding_window": False}
        if s.head_dim:
            conf["head_dim"] = s.head_dim
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(conf, f, indent=2, sort_keys=True)
        return ["config.json"]
    modeldir.write(model, out)
    return sorted(os.listdir(out))


def run_write_checkpoint(args) -> int:
    import torch
    from safetensors.torch import save_file

    from frmps_engine.refengine import pool_layout
    from frmps_engine.refengine.weights import init_dummy, param_views

    from frmps_engine.refengine import weights_bytes

    t0 = time.perf_counter()
    cfg = make_cfg(args)
    evicted = make_room(os.path.dirname(os.path.abspath(args.out)), weights_bytes(cfg) + (2 << 30), keep=args.out)
    wspec = pool_layout(cfg)[0]
    pool = torch.zeros(wspec.size, dtype=torch.uint8, device=cfg.device)
    params = param_views(cfg, pool)
    init_dummy(cfg, params)  # the same seeded weights the engines generate
    sync(cfg.device)
    tmp = args.out.rstrip("/") + f".tmp-{os.getpid()}"
    model_files = write_model_files(args.model, cfg, tmp)
    shard: dict = {}
    shard_bytes = 0
    files: list[str] = []
    total = 0

    def flush():
        nonlocal shard, shard_bytes
        if not shard:
            return
        path = os.path.join(tmp, f"model-{len(files) + 1:05d}.safetensors")
        save_file(shard, path, metadata={"format": "pt"})
        with open(path, "rb") as f:
            os.fsync(f.fileno())  # clean pages: dropping them from the page cache later works
        files.append(os.path.basename(path))
        weight_map.update({name: files[-1] for name in shard})
        shard, shard_bytes = {}, 0

    weight_map: dict[str, str] = {}
    for name, t in hf_tensors(cfg, params):
        c = t.to("cpu").contiguous()
        shard[name] = c
        shard_bytes += c.numel() * c.element_size()
        total += c.numel() * c.element_size()
        if shard_bytes >= args.shard_bytes:
            flush()
    flush()
    # The shards' index, as Hugging Face writes it: loaders (vLLM's, transformers') read it.
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1, sort_keys=True)
    meta = {"format": CHECKPOINT_FORMAT, "model_files": model_files,
            "model": args.model, "seed": args.seed, "dtype": cfg.dtype, "device_kind": "cpu" if cfg.device == "cpu" else "cuda",
            "bytes": total, "files": files, "evicted": evicted, "written_unix": time.time(), "write_s": round(time.perf_counter() - t0, 2)}
    with open(os.path.join(tmp, "frmps-checkpoint.json"), "w") as f:
        json.dump(meta, f, indent=1)
    if os.path.exists(args.out):
        import shutil

        shutil.rmtree(args.out)
    os.replace(tmp, args.out)
    emit("done", **meta)
    return 0


# ----------------------------------------------------------------------------- sync overhead


def run_sync_overhead(args) -> int:
    from .sync_overhead import run

    if not args.memory:
        args.memory = "host-shm" if args.device == "cpu" else "cuda-vmm"
    return run(args)


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.baseline_engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", choices=["victim", "sleep", "cold", "context", "write-checkpoint", "sync-overhead"])
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0, help="seed of the dummy weights")
    p.add_argument("--num-blocks", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="capture decode graphs before serving (1) or not (0)")
    p.add_argument("--exact", type=int, default=0, help="victim/sleep/cold: the engine's exact mode (1) or not (0)")
    p.add_argument("--checkpoint", default="", help="cold: the safetensors directory")
    p.add_argument("--requests", default="[]", help="cold: JSON list of requests to recover, or @file")
    p.add_argument("--then-steps", type=int, default=0, help="cold: decode steps after the first token")
    p.add_argument("--out", default="", help="write-checkpoint: target directory")
    p.add_argument("--shard-bytes", type=int, default=4 << 30)
    p.add_argument("--engine", default="ref", choices=["ref", "vllm"],
                   help="victim, sleep, cold, sync-overhead: the reference engine or vLLM (vllm_baseline.py)")
    p.add_argument("--memory", default="", help="sync-overhead: the pools' memory backend (default host-shm on the "
                                                 "CPU, cuda-vmm on a GPU, as frmps serve)")
    p.add_argument("--workdir", default="", help="sync-overhead: scratch files")
    p.add_argument("--timeout", type=float, default=600, help="sync-overhead: bound of the prefill and of one trial")
    p.add_argument("--sync-list", default="0,1,2,4,8,16,32,64")
    p.add_argument("--between-steps", default="1",
                   help="sync-overhead: N values also measured with the publish between steps where the engine "
                        "overlaps it with the device (the launch hook), in the same run ('' for none)")
    p.add_argument("--steps-per-trial", type=int, default=128)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--warmup-steps", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=0, help="sync-overhead: batch (0: as large as memory allows, up to --max-batch)")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--reserve-gib", type=float, default=8.0)
    p.add_argument("--ring-dir", default="/dev/shm")
    p.add_argument("--ring-capacity", type=int, default=8 << 20)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.t_process = T_PROCESS
    # The same cuBLAS workspace as the served reference engine (a bare context has none; vLLM
    # keeps its own defaults).
    if args.role != "context" and not (args.engine == "vllm" and args.role in ("victim", "sleep", "cold")):
        from frmps_engine.refengine.config import apply_cuda_env

        apply_cuda_env(args.device)
    run = {"victim": run_victim, "sleep": run_sleep, "cold": run_cold, "context": run_context,
           "write-checkpoint": run_write_checkpoint, "sync-overhead": run_sync_overhead}[args.role]
    try:
        code = run(args)
    except Exception as e:
        emit("error", error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-3000:])
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown (CUDA state, daemon threads)


if __name__ == "__main__":
    main()
