"""Engine process entry point: ``python -m frmps_engine.cli serve ...``.

The supervisor launches this for both roles; see sdk/runner.py for the lifecycle.
Exit codes: 0 shutdown, 1 engine error / supervisor gone, 2 refused at start, 3 device error.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys


def _positive(v: str) -> int:
    n = int(v)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="frmps-engine", description="frmps engine process")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run an engine (active or standby) under the frmps supervisor")
    s.add_argument("--engine", default="ref", help="ref, or module:Factory for another adapter")
    s.add_argument("--role", required=True, choices=["active", "standby"])
    s.add_argument("--model", required=True, help="model preset name or model directory")
    s.add_argument("--control-socket", required=True)
    s.add_argument("--generation-socket", required=True)
    s.add_argument("--memory", default="host-shm", choices=["host-shm", "cuda-vmm"])
    s.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    s.add_argument("--num-blocks", type=_positive)
    s.add_argument("--max-model-len", type=_positive)
    s.add_argument("--seed", type=int, default=0, help="seed of dummy weights")
    s.add_argument("--max-num-seqs", type=_positive, help="most requests in one batch")
    s.add_argument("--max-num-batched-tokens", type=_positive,
                   help="token budget of one step (prefill chunk size)")
    s.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                   help="exact mode: a resumed request reproduces the no-fault output token for token "
                        "(fixed decode batch, aligned per-request prefill; default on for GPUs)")
    s.add_argument("--no-kv-reuse", dest="kv_reuse", action="store_false",
                   help="ablation: a standby recomputes every adopted token instead of reusing the shared KV")
    s.add_argument("--ring-module", default="frmps_engine.ring", help=argparse.SUPPRESS)
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def serve(args: argparse.Namespace) -> int:
    from frmps_engine.sdk import adapters, memory, runner

    log = logging.getLogger("frmps_engine")
    if args.memory == "host-shm" and args.device != "cpu":
        log.error("engine cannot start: host-shm pools live in host memory; use --device cpu, or --memory cuda-vmm on a GPU")
        return runner.EXIT_REFUSED
    try:
        adapter = adapters.load_adapter(
            args.engine,
            adapters.EngineOptions(model=args.model, device=args.device, num_blocks=args.num_blocks,
                                   max_model_len=args.max_model_len, seed=args.seed,
                                   max_num_seqs=args.max_num_seqs,
                                   max_num_batched_tokens=args.max_num_batched_tokens,
                                   exact=args.exact, kv_reuse=args.kv_reuse),
        )
        mem = memory.get_backend(args.memory, args.device)
        r = runner.Runner(
            runner.RunnerConfig(role=args.role, control_socket=args.control_socket,
                                generation_socket=args.generation_socket, ring_module=args.ring_module),
            adapter, mem,
        )
    except (adapters.AdapterError, memory.MemoryError_, runner.StartupError) as e:
        log.error("engine cannot start: %s", e)
        return runner.EXIT_REFUSED
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: r.request_shutdown())
    if os.environ.get("FRMPS_DEBUG_FAULT_SIGNAL") == "1":
        # Test hook for failover drills of an engine outside MPS (sdk/debug_fault.py).
        signal.signal(signal.SIGUSR1, lambda *_: r.inject_fault())
    if os.environ.get("FRMPS_DEBUG_HANG_SIGNAL") == "1":
        # Test hook for hang detection: the next step never finishes (sdk/debug_hang.py).
        signal.signal(signal.SIGUSR2, lambda *_: r.inject_hang())
    return r.run()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    code = serve(args)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gRPC and engine threads are stopped already, and
    # joining anything else there could hang the exit the supervisor waits for.
    os._exit(code)


if __name__ == "__main__":
    main()
