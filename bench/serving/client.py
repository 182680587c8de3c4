"""vLLM's serving benchmark client, one process for a whole run.

`vllm bench serve` spends about 25 s of every invocation importing vLLM and its
command line before it sends a request (seen on an H200 host: 35-41 s per 8 s
trial). Run as a module, this file is that client kept alive: it imports
`vllm.benchmarks.serve` once, then reads one JSON list per line on stdin, the
arguments a `vllm bench serve` command line has after `bench serve`, parses
them with vLLM's own parser and runs vLLM's own `main` with them, exactly what
the command does, and prints ``DONE <status>`` after each run.

`Client` is the driver's side: it starts the process once, sends each run, copies
its output to the run's log and stops it however the run ends. A run that
overstays its timeout kills the process; the next run starts a fresh one.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Callable

DONE = "frmps-bench-client: DONE"
READY = "frmps-bench-client: ready"
MAIN_RUN = "Starting main benchmark run"  # vLLM's line before the timed run
CLI_PREFIX = ("-m", "vllm.entrypoints.cli.main", "bench", "serve")


def bench_argv(cmd: list[str]) -> list[str]:
    """The arguments after `bench serve` of a `python -m vllm.entrypoints.cli.main
    bench serve ...` command line (plan.bench_cmd)."""
    n = len(CLI_PREFIX)
    for i in range(len(cmd) - n + 1):
        if tuple(cmd[i:i + n]) == CLI_PREFIX:
            return list(cmd[i + n:])
    raise ValueError(f"not a `vllm bench serve` command line: {cmd[:6]}")


class ClientError(RuntimeError):
    """The client process died, or a run overstayed its timeout."""


class Client:
    """One long-lived benchmark client process for python (the interpreter of
    `vllm bench serve`). add_proc registers the process for the harness's
    cleanup; kill_group(p) ends it and its children."""

    def __init__(self, python: str, add_proc: Callable[[subprocess.Popen], None],
                 kill_group: Callable[[subprocess.Popen], None], start_timeout_s: float = 300.0):
        self.python, self.add_proc, self.kill_group = python, add_proc, kill_group
        self.start_timeout_s = start_timeout_s
        self.p: subprocess.Popen | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()

    def _start(self) -> None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds bench/
        path = os.environ.get("PYTHONPATH", "")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": root + (os.pathsep + path if path else "")}
        self.p = subprocess.Popen([self.python, "-m", "bench.serving.client"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                                  start_new_session=True)
        self.add_proc(self.p)
        self.lines = queue.Queue()
        p, lines = self.p, self.lines

        def pump():
            for line in p.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def _read(self, deadline: float, log) -> str:
        """The next line, copied to log; ClientError when the process ended or the
        deadline passed."""
        try:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise ClientError("timed out") from None
        if line is None:
            raise ClientError(f"the client process exited ({self.p.wait()})")
        log.write(line)
        log.flush()
        return line

    def run(self, cmd: list[str], log_path: str, timeout_s: float, on_start=None) -> int:
        """Runs one `vllm bench serve` command line in the process (started on first
        use, its start not counted in timeout_s): its exit status. ClientError
        (the process killed) when it dies or overstays timeout_s."""
        argv = bench_argv(cmd)
        with open(log_path, "a") as log:
            log.write("$ " + " ".join(cmd) + "   (in the long-lived client, bench/serving/client.py)\n")
            log.flush()
            try:
                if self.p is None or self.p.poll() is not None:
                    self._start()
                    deadline = time.monotonic() + self.start_timeout_s
                    while not self._read(deadline, log).startswith(READY):
                        pass
                self.p.stdin.write(json.dumps(argv) + "\n")
                self.p.stdin.flush()
                deadline = time.monotonic() + timeout_s
                while True:
                    line = self._read(deadline, log)
                    if on_start is not None and MAIN_RUN in line:
                        on_start(time.perf_counter())
                    if line.startswith(DONE):
                        return int(line.split()[-1])
            except (ClientError, OSError) as e:
                self.close()
                raise ClientError(f"{e}") from None

    def close(self) -> None:
        if self.p is not None:
            if self.p.poll() is None:
                self.kill_group(self.p)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                pass
            for f in (self.p.stdin, self.p.stdout):
                try:
                    f.close()
                except OSError:
                    pass
            self.p = None


def main() -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    print(READY, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        parser = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(parser)
        try:
            bench_main(parser.parse_args(json.loads(line)))
            rc = 0
        except SystemExit as e:  # argparse's refusal, or the benchmark's own exit
            rc = e.code if isinstance(e.code, int) else 1
        except Exception:  # noqa: BLE001 (the run failed; the next may not)
            import traceback

            traceback.print_exc()
            rc = 1
        print(f"{DONE} {rc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
