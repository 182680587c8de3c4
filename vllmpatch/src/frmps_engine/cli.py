"""Engine process entry point: ``python -m frmps_engine.cli serve ...``; and
``python -m frmps_engine.cli frontend --engine-input ipc://… --engine-output
ipc://… --control-socket PATH [vllm serve arguments]``: vLLM's own API server as
the frontend of ``--engine vllm`` (frmps_engine/vllm/frontend/server.py).

The supervisor launches this for both roles; see sdk/runner.py for the lifecycle.
Exit codes: 0 shutdown, 1 engine error / supervisor gone, 2 refused at start, 3 device error.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys


# The engine's log lines (the supervisor files them in the engine's log); a vLLM
# tensor-parallel worker uses the same (vllm/tp_worker.py).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _positive(v: str) -> int:
    n = int(v)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {n}")
    return n


def _fraction(v: str) -> float:
    x = float(v)
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {v}")
    return x


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="frmps-engine", description="frmps engine process")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run an engine (active or standby) under the frmps supervisor")
    s.add_argument("--engine", default="ref",
                   help="ref, vllm, or package.module:Factory for another adapter (proto/frmps/v1/ENGINE.md)")
    s.add_argument("--role", required=True, choices=["active", "standby"])
    s.add_argument("--model", required=True, help="model preset name or model directory")
    s.add_argument("--control-socket", required=True)
    s.add_argument("--generation-socket", help="serve frmps's generation API here (the Go front door's engine API)")
    s.add_argument("--core-input", metavar="ADDR",
                   help="core mode (--engine vllm; vllmpatch/OPENAI.md, design (a)): serve vLLM's engine-core "
                        "protocol to vLLM's API server instead of the generation API; its input socket (a ROUTER "
                        "the frontend binds, e.g. ipc://RUN_DIR/core-in.sock). Needs --core-output")
    s.add_argument("--core-output", metavar="ADDR", help="core mode: the frontend's output socket (a PULL it binds)")
    s.add_argument("--memory", default="host-shm", choices=["host-shm", "cuda-vmm"])
    s.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    s.add_argument("--num-blocks", type=_positive)
    s.add_argument("--max-model-len", type=_positive)
    s.add_argument("--gpu-memory-utilization", type=_fraction, metavar="U",
                   help="--engine vllm without --num-blocks: the fraction of the GPU the whole deployment may use "
                        "(both engines, the shared pools, MPS's server); the KV cache gets the rest (default 0.9). "
                        "The reference engine sizes its cache from --max-model-len and ignores it")
    s.add_argument("--seed", type=int, default=0, help="seed of dummy weights")
    s.add_argument("--weights", default="auto", choices=["auto", "dummy"],
                   help="auto: a model directory's *.safetensors checkpoint (the active loads it into the shared "
                        "weights pool; the standby maps that pool), dummy weights only where the directory has none; "
                        "dummy: random weights whatever the directory holds")
    s.add_argument("--max-num-seqs", type=_positive, help="most requests in one batch")
    s.add_argument("--max-num-batched-tokens", type=_positive,
                   help="token budget of one step (prefill chunk size)")
    s.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="with --engine vllm: one of vLLM's engine flags as `vllm serve` spells it (repeatable), "
                        "e.g. --vllm-arg=--max-logprobs=50; the flags frmps sets itself are refused")
    s.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                   help="exact mode: a resumed request reproduces the no-fault output token for token "
                        "(fixed decode batch, aligned per-request prefill; default on for GPUs)")
    s.add_argument("--no-kv-reuse", dest="kv_reuse", action="store_false",
                   help="ablation: a standby recomputes every adopted token instead of reusing the shared KV")
    s.add_argument("--tensor-parallel-size", type=_positive, default=1,
                   help="shard the model over this many ranks, one process and device each (reference engine); "
                        "this process is rank 0 and starts the others")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sp = sub.add_parser("spare", help="start ahead of need: preload an engine's imports, then serve the "
                                      "command line the supervisor sends on stdin (sdk/spare.py)")
    sp.add_argument("--engine", default="ref", help="the engine whose imports to preload")
    sp.add_argument("--modules", help="file of module names a served engine had loaded (optional; read if present)")
    sp.add_argument("--model", help="the model the engines serve (the engine's preload may read its tokenizer)")
    sp.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    c = sub.add_parser("check-engine", help="check that an --engine name loads; print its factory")
    c.add_argument("engine", help="ref, vllm, or package.module:Factory")
    sub.add_parser("frontend", add_help=False,
                   help="vLLM's OpenAI API server as the frontend of --engine vllm: --engine-input ipc://... "
                        "--engine-output ipc://... --control-socket PATH, then vllm serve's arguments "
                        "(frmps_engine/vllm/frontend/server.py)")
    pf = sub.add_parser("prime-fault", help="fault once in a throwaway CUDA context (run inside frmps's private MPS "
                        "daemon before the active starts: a GPU's first fault is the slow one; sdk/primefault.py)")
    pf.add_argument("--device", type=int, default=0, help="device index as this process sees the GPUs")
    m = sub.add_parser("model-dir", help="write (or find) a preset's Hugging Face model directory for dummy-weight runs")
    m.add_argument("preset", help="qwen2.5-0.5b, -1.5b, -3b, -7b or -14b (or a test preset: tiny, ...)")
    m.add_argument("--out", help="directory to write (default: the model cache, see frmps_engine.modeldir.default_dir)")
    m.add_argument("--force", action="store_true", help="rewrite the directory if it exists")
    m.add_argument("--weights", default="none", choices=["none", "seeded"],
                   help="seeded: also write a seeded checkpoint scaled like a trained model's "
                        "(frmps_engine/seeded_weights.py); none: config and tokenizer only")
    m.add_argument("--seed", type=int, default=0, help="seed of --weights seeded")
    return p


def model_dir(args: argparse.Namespace) -> int:
    """Print the preset's model directory, writing it first unless it exists."""
    import time

    from frmps_engine import modeldir

    if args.seed < 0:
        print(f"frmps model-dir: --seed must be >= 0, got {args.seed}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    log = (lambda msg: print(f"frmps model-dir: {msg}", file=sys.stderr, flush=True)) if args.weights != "none" else None
    try:
        path = modeldir.write(args.preset, args.out or modeldir.default_dir(args.preset, args.weights, args.seed),
                              force=args.force, weights=args.weights, seed=args.seed, log=log)
    except (ValueError, OSError) as e:
        print(f"frmps model-dir: {e}", file=sys.stderr)
        return 2
    if log:
        log(f"{path} ready in {time.monotonic() - t0:.1f} s")
    print(path)
    return 0


def check_engine(args: argparse.Namespace) -> int:
    """Resolve an --engine name (frmps serve runs this once before it starts the
    engines): print the factory it names, or say why not and return 2."""
    from frmps_engine.sdk import adapters

    try:
        target, _ = adapters.resolve(args.engine)
    except adapters.AdapterError as e:
        print(f"frmps-engine: {e}", file=sys.stderr)
        return 2
    print(target)
    return 0


def engine_options(args: argparse.Namespace):
    """The adapter's options from serve's arguments: every engine flag, --vllm-arg too."""
    from frmps_engine.sdk import adapters

    return adapters.EngineOptions(model=args.model, device=args.device, num_blocks=args.num_blocks,
                                  max_model_len=args.max_model_len, seed=args.seed,
                                  gpu_memory_utilization=args.gpu_memory_utilization,
                                  max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  exact=args.exact, kv_reuse=args.kv_reuse,
                                  tensor_parallel_size=args.tensor_parallel_size,
                                  vllm_args=tuple(args.vllm_arg), weights=args.weights)


def serve(args: argparse.Namespace) -> int:
    from frmps_engine.sdk import adapters, memory, runner
    from frmps_engine.sdk.loop import is_device_error

    log = logging.getLogger("frmps_engine")
    core_mode = bool(args.core_input or args.core_output)
    if core_mode and args.engine == "ref":
        log.error("engine cannot start: --core-input/--core-output serve vLLM's engine-core protocol, which the "
                  "reference engine does not speak (use --engine vllm, or --generation-socket)")
        return runner.EXIT_REFUSED
    if not core_mode and not args.generation_socket:
        log.error("engine cannot start: give --generation-socket, or --core-input and --core-output (core mode)")
        return runner.EXIT_REFUSED
    if args.memory == "host-shm" and args.device != "cpu":
        log.error("engine cannot start: host-shm pools live in host memory; use --device cpu, or --memory cuda-vmm on a GPU")
        return runner.EXIT_REFUSED
    try:
        adapter = adapters.load_adapter(args.engine, engine_options(args))
        if getattr(adapter, "workers_own_pools", False):  # the ranks are other processes (ProcessGroup)
            mem = memory.BackendName(args.memory)
        else:
            mem = memory.get_backend(args.memory, args.device)
        r = runner.Runner(
            runner.RunnerConfig(role=args.role, control_socket=args.control_socket,
                                generation_socket=args.generation_socket or "",
                                core_input=args.core_input or "", core_output=args.core_output or ""),
            adapter, mem,
        )
    except (adapters.AdapterError, memory.MemoryError_, runner.StartupError, ValueError) as e:
        # An engine's constructor refuses options it cannot work with by raising
        # ValueError (vLLM's config checks, the reference engine's): a refusal,
        # whose exit code tells the supervisor not to restart it unchanged.
        if is_device_error(e):  # e.g. a tensor-parallel group whose CUDA init failed
            log.error("engine cannot start: device error: %s", e)
            return runner.EXIT_DEVICE
        log.error("engine cannot start: %s", e)
        return runner.EXIT_REFUSED
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: r.request_shutdown())
    if os.environ.get("FRMPS_DEBUG_FAULT_SIGNAL") == "1":
        # Test hook for failover drills of an engine outside MPS (sdk/debug_fault.py).
        signal.signal(signal.SIGUSR1, lambda *_: r.inject_fault())
    from frmps_engine.sdk import debug_fault

    if os.environ.get(debug_fault.CHECKSUM_ENV) == "1":
        signal.signal(debug_fault.checksum_signal(), lambda *_: r.checksum_pools())
    if os.environ.get("FRMPS_DEBUG_HANG_SIGNAL") == "1":
        # Test hook for hang detection: the next step never finishes (sdk/debug_hang.py).
        signal.signal(signal.SIGUSR2, lambda *_: r.inject_hang())
    return r.run()


def spare(args: argparse.Namespace) -> int:
    """A spare engine process: preload, then serve what the supervisor sends."""
    from frmps_engine.sdk import spare as spare_mod

    code, argv = spare_mod.run(args.engine, args.modules, model=args.model)
    if argv is None:
        return code
    served = build_parser().parse_args(argv)  # the same command line a cold start gets
    logging.getLogger().setLevel(served.log_level.upper())
    return serve(served)


def prime_fault(args) -> int:
    from frmps_engine.sdk import primefault

    return primefault.main(args.device)


def frontend(argv: list[str]) -> int:
    """vLLM's API server with frmps's engine-core client (its own arguments, then vllm serve's)."""
    from frmps_engine.vllm.frontend import server

    return server.main(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["frontend"]:
        # vllm serve's arguments are parsed by vLLM's own parser (server.py).
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format=LOG_FORMAT)
        code = frontend(argv[1:])
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        # argparse said why on stderr. A command line it refuses is a refusal of
        # the engine's options (argparse's own code is 2 as well; say so here).
        if e.code in (0, None):
            raise
        from frmps_engine.sdk import runner

        sys.stderr.flush()
        os._exit(runner.EXIT_REFUSED)
    logging.basicConfig(
        level=getattr(args, "log_level", "info").upper(), stream=sys.stderr,
        format=LOG_FORMAT,
    )
    code = {"serve": serve, "spare": spare, "check-engine": check_engine, "model-dir": model_dir,
            "prime-fault": prime_fault}[args.cmd](args)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gRPC and engine threads are stopped already, and
    # joining anything else there could hang the exit the supervisor waits for.
    os._exit(code)


if __name__ == "__main__":
    main()
