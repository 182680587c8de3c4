"""Tensor parallelism for the reference engine: one process per rank.

Rank 0 is the engine process the supervisor sees (control socket, generation
API, scheduler, sampling, ring, heartbeats). At start-up it launches ranks
1..N-1 as its own children (``python -m frmps_engine.refengine.tp``), in its
process group, so the supervisor's fence (SIGKILL to the group) takes them all;
each worker asks the kernel to SIGKILL it when rank 0 dies
(``PR_SET_PDEATHSIG``), so no rank outlives rank 0. Rank 0 watches its workers:
when one dies, rank 0 reports the death and exits at once (``Group.on_death``),
without waiting on the communicator, and the supervisor fails over as for any
death: the death of any rank is the death of the group.

Between rank 0 and each worker runs a private unix socketpair: length-prefixed
JSON messages, with pool fds as SCM_RIGHTS. Per step rank 0 sends every worker
the pass (tokens, positions, KV slots, block tables: ``RefCore._plan``); every
rank runs its shard, the group sums the row-parallel outputs through
torch.distributed (gloo on the CPU, NCCL on GPUs), and rank 0 samples. KV block
ids are the group's, the same on every rank, so the ring is unchanged.

The communicator is created when the group starts and proven by one all-reduce
before the engine reports Ready, so a standby's exists before any takeover.
Its rendezvous is a FileStore in a fresh private (0700) directory, removed once
every rank has joined: no fixed port, and the active's and the standby's groups
never meet.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable, Sequence

from ..sdk.engine_api import rank_death
from ..sdk.fdchannel import recv_msg, send_msg
from .config import EngineConfig, ModelShape, PoolSpec, rank_pools

log = logging.getLogger(__name__)

# A worker's exit status when its own start-up or a command failed.
WORKER_EXIT_ERROR = 1
# How long ranks wait for each other to join the communicator.
JOIN_TIMEOUT = datetime.timedelta(seconds=300)
_PR_SET_PDEATHSIG = 1


class GroupError(Exception):
    """The tensor-parallel group could not start, or a rank refused a command."""


# ---- configuration --------------------------------------------------------------


def rank_device(device: str, rank: int) -> str:
    """The device of rank ``rank``: cuda:(k + rank) for rank 0 on cuda[:k]; the CPU for all on the CPU."""
    if device == "cpu":
        return "cpu"
    base = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


def config_to_json(cfg: EngineConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d.pop("extra", None)
    return d


def config_from_json(d: dict) -> EngineConfig:
    d = dict(d)
    d["shape"] = ModelShape(**d["shape"])
    cfg = EngineConfig(**d)
    cfg.validate()
    return cfg


# ---- the private channel ----------------------------------------------------------


# ---- the communicator -------------------------------------------------------------


class Comm:
    """This rank's membership of the group's torch.distributed process group."""

    def __init__(self, store_path: str, rank: int, size: int, device: str) -> None:
        import torch
        import torch.distributed as dist

        self._dist = dist
        dev = torch.device(device)
        if dev.type == "cuda":
            if dev.index is None:  # "cuda": the current device, named (NCCL's device_id needs an index)
                dev = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(dev)
            backend = "nccl"
        else:
            # gloo binds the address the host name resolves to unless told otherwise;
            # the group is one host's, so loopback is always right.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            backend = "gloo"
        store = dist.FileStore(store_path, size)
        kw: dict[str, Any] = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=JOIN_TIMEOUT, **kw)
        self.backend = backend
        # One collective now: NCCL builds its communicator lazily, at the first one.
        probe = torch.ones(1, device=dev)
        dist.all_reduce(probe)
        if int(probe.item()) != size:
            raise GroupError(f"communicator warm-up: all-reduce gave {probe.item()}, want {size}")

    def all_reduce(self, t) -> None:
        self._dist.all_reduce(t)

    def close(self) -> None:
        """Leave the group (torch.distributed has one default group per process)."""
        if self._dist.is_initialized():
            self._dist.destroy_process_group()


# ---- rank 0's side --------------------------------------------------------------


@dataclasses.dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen
    sock: socket.socket


class Group:
    """Rank 0's tensor-parallel group: starts the workers and the communicator,
    forwards pool commands, passes and warm-ups, and watches for deaths.

    on_death(cause) runs on a watcher thread when a worker exits while the group
    is open; it must end the process (the default logs and exits with
    EXIT_PEER_DIED). Set it before anything can go wrong that matters to the
    supervisor."""

    EXIT_PEER_DIED = 4

    def __init__(self, cfg: EngineConfig, python: str | None = None, log_level: str = "INFO") -> None:
        self.cfg = cfg
        self.size = cfg.tensor_parallel_size
        if self.size < 2:
            raise GroupError(f"a tensor-parallel group needs at least 2 ranks, got {self.size}")
        self.on_death: Callable[[str], None] = self._default_on_death
        self._reported = threading.Lock()  # held by the one report of a death
        self._died = threading.Event()  # a worker exited while the group was open
        self._death_cause = ""
        self._closing = False
        self._lock = threading.Lock()  # one command at a time on the channels
        self.workers: list[_Worker] = []
        self.comm: Comm | None = None
        rendezvous = tempfile.mkdtemp(prefix="frmps-tp-")
        try:
            store = os.path.join(rendezvous, "store")
            for rank in range(1, self.size):
                self.workers.append(self._launch(rank, python or sys.executable, store, log_level))
            for w in self.workers:
                threading.Thread(target=self._watch, args=(w,), name=f"frmps-tp-watch-{w.rank}", daemon=True).start()
            self.comm = Comm(store, 0, self.size, cfg.device)
            for w in self.workers:
                self._expect_ok(w, "join the communicator")
        except BaseException:
            self.close()
            raise
        finally:
            shutil.rmtree(rendezvous, ignore_errors=True)
        log.info("tensor-parallel group of %d ranks ready (%s; worker pids %s)", self.size, self.comm.backend,
                 [w.proc.pid for w in self.workers])

    def _launch(self, rank: int, python: str, store: str, log_level: str) -> _Worker:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # Same process group as rank 0 (no new session): the supervisor's fence kills it.
            proc = subprocess.Popen(
                [python, "-m", "frmps_engine.refengine.tp", "--fd", str(theirs.fileno()), "--log-level", log_level],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        w = _Worker(rank, proc, ours)
        send_msg(ours, dict(op="init", rank=rank, size=self.size, parent=os.getpid(), store=store,
                            config=config_to_json(self.cfg)))
        return w

    @staticmethod
    def _default_on_death(cause: str) -> None:
        log.critical("%s: exiting", cause)
        os._exit(Group.EXIT_PEER_DIED)

    def _watch(self, w: _Worker) -> None:
        code = w.proc.wait()
        if self._closing:
            return
        cause = rank_death(w.rank, f"pid {w.proc.pid}", code)
        # Report the first death once (on_death ends the process).
        if self._reported.acquire(blocking=False):
            self._death_cause = cause
            self._died.set()
            self.on_death(cause)

    def dead_peer(self, wait_s: float) -> str | None:
        """The first worker's death, if one died while the group was open or dies
        within wait_s seconds (engine_api.ProcessGroup.dead_peer): a collective on
        a dead peer raises (gloo) before the watcher has reaped it."""
        return self._death_cause if self._died.wait(wait_s) else None

    def _call(self, w: _Worker, msg: dict, fds: Sequence[int] = (), reply: bool = True) -> tuple[dict, list[int]]:
        send_msg(w.sock, msg, fds)
        if not reply:
            return {}, []
        out, got = recv_msg(w.sock)
        if not out.get("ok"):
            for fd in got:
                os.close(fd)
            raise GroupError(f"rank {w.rank}: {msg['op']}: {out.get('error', 'failed')}")
        return out, got

    def _expect_ok(self, w: _Worker, what: str) -> None:
        try:
            out, _ = recv_msg(w.sock)
        except (EOFError, OSError) as e:
            raise GroupError(f"rank {w.rank}: {what}: {e}") from e
        if not out.get("ok"):
            raise GroupError(f"rank {w.rank}: {what}: {out.get('error', 'failed')}")

    # -- what RefCore needs (engine.Workers) --------------------------------------
    def run_plan(self, plan: dict) -> None:
        with self._lock:
            for w in self.workers:
                send_msg(w.sock, dict(op="run", plan=plan))

    def warmup(self) -> None:
        with self._lock:
            for w in self.workers:
                send_msg(w.sock, dict(op="warmup"))

    def build(self, load_weights: bool) -> None:
        """Each worker builds its shard of the engine on its pools (and loads its
        weights when load_weights); returns when all have."""
        with self._lock:
            for w in self.workers:
                send_msg(w.sock, dict(op="build", load_weights=load_weights))
            for w in self.workers:
                self._expect_ok(w, "build")

    # -- pools of the workers (GroupMemory) ---------------------------------------
    def allocate(self, rank: int, memory: str) -> list[int]:
        """Rank ``rank`` allocates its pools with the memory backend named ``memory``; their fds."""
        with self._lock:
            _, fds = self._call(self.workers[rank - 1], dict(op="allocate", memory=memory))
        return fds

    def reserve(self, rank: int, memory: str) -> None:
        with self._lock:
            self._call(self.workers[rank - 1], dict(op="reserve", memory=memory))

    def map(self, rank: int, fds: Sequence[int], readonly: bool) -> None:
        with self._lock:
            self._call(self.workers[rank - 1], dict(op="map", readonly=readonly), fds)

    def set_access(self, tag: str, readonly: bool) -> None:
        with self._lock:
            for w in self.workers:
                self._call(w, dict(op="access", tag=tag, readonly=readonly))

    def close(self) -> None:
        """Stop the workers and leave the communicator (an orderly exit for tests and
        failed starts; in an engine, rank 0's death kills the workers anyway)."""
        self._closing = True
        for w in self.workers:
            try:
                w.sock.close()
            except OSError:
                pass
            try:
                w.proc.kill()
            except OSError:
                pass
        for w in self.workers:
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.error("tensor-parallel rank %d (pid %d) did not exit after SIGKILL", w.rank, w.proc.pid)
        if self.comm is not None:
            self.comm.close()
            self.comm = None


class GroupMemory:
    """The memory backend rank 0's runner sees: the pools of every rank, rank 0's
    in this process (``local``), the others' in the workers. Allocating gathers the
    workers' fds (rank 0 exports them all to the supervisor); mapping sends each
    worker the brokered fds of its own pools; access flips reach every rank.
    pools() lists this process's pools (their tensors are the ones here)."""

    def __init__(self, group: Group, local) -> None:
        from frmps_engine.sdk.memory import base

        self._base = base
        self.group = group
        self.local = local
        self.name = local.name
        self._remote: list = []  # Pools of the workers, with the fds rank 0 holds for export

    def _split(self, specs) -> tuple[list, dict[int, list]]:
        specs = [self._base.as_spec(s) for s in specs]
        mine = [s for s in specs if s.index == 0]
        theirs: dict[int, list] = {}
        for s in specs:
            if s.index != 0:
                theirs.setdefault(s.index, []).append(s)
        for rank, ss in theirs.items():
            want = [self._base.as_spec(p) for p in rank_pools(self.group.cfg, rank)]
            if ss != want:
                raise self._base.MemoryError_(f"rank {rank}: pools {ss} are not its layout {want}")
        return mine, theirs

    def _in_order(self, specs, local_pools, remote_pools) -> list:
        by_key = {p.spec.key: p for p in list(local_pools) + list(remote_pools)}
        return [by_key[self._base.as_spec(s).key] for s in specs]

    def allocate(self, specs) -> list:
        mine, theirs = self._split(specs)
        local = self.local.allocate(mine)
        remote = []
        for rank, ss in theirs.items():
            fds = self.group.allocate(rank, self.name)
            if len(fds) != len(ss):
                for fd in fds:
                    os.close(fd)
                raise self._base.MemoryError_(f"rank {rank} allocated {len(fds)} pools, layout has {len(ss)}")
            remote += [self._base.Pool(s, None, fd=fd) for s, fd in zip(ss, fds)]
        self._remote = remote
        return self._in_order(specs, local, remote)

    def reserve(self, specs) -> list:
        mine, theirs = self._split(specs)
        local = self.local.reserve(mine)
        remote = []
        for rank, ss in theirs.items():
            self.group.reserve(rank, self.name)
            remote += [self._base.Pool(s, None) for s in ss]
        return self._in_order(specs, local, remote)

    def map(self, specs, fds, readonly: bool) -> list:
        specs = [self._base.as_spec(s) for s in specs]
        fds = list(fds)
        if len(specs) != len(fds):
            for fd in fds:
                os.close(fd)
            raise self._base.SizeMismatch(f"map: {len(specs)} pools but {len(fds)} fds")
        by_rank: dict[int, list[tuple[PoolSpec, int]]] = {}
        for s, fd in zip(specs, fds):
            by_rank.setdefault(s.index, []).append((s, fd))
        try:
            self._split(specs)
        except self._base.MemoryError_ as e:
            for fd in fds:
                os.close(fd)
            raise self._base.SizeMismatch(str(e)) from e
        out = []
        for rank, pairs in sorted(by_rank.items()):
            ss, ff = [p[0] for p in pairs], [p[1] for p in pairs]
            if rank == 0:
                out += self.local.map(ss, ff, readonly)
                continue
            try:
                self.group.map(rank, ff, readonly)
            except GroupError as e:
                raise self._base.SizeMismatch(str(e)) from e
            finally:
                for fd in ff:  # the worker has its own copies now
                    os.close(fd)
            out += [self._base.Pool(s, None, readonly=readonly) for s in ss]
        return self._in_order(specs, [p for p in out if p.tensor is not None], [p for p in out if p.tensor is None])

    def pools(self) -> list:
        return self.local.pools()

    def make_writable(self, tag: str) -> None:
        self.group.set_access(tag, readonly=False)
        self.local.make_writable(tag)

    def make_readonly(self, tag: str) -> None:
        self.group.set_access(tag, readonly=True)
        self.local.make_readonly(tag)

    def close(self) -> None:
        for p in self._remote:
            if p.fd >= 0:
                os.close(p.fd)
                p.fd = -1
        self._remote = []
        self.local.close()


# ---- a worker (rank >= 1) ----------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the thread that started it (rank 0's main
    thread, which lives until rank 0 exits) ends; and exit now if rank 0 is
    already gone."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:
        os._exit(WORKER_EXIT_ERROR)


class Worker:
    """Rank r >= 1: serves rank 0's commands until the channel closes."""

    def __init__(self, sock: socket.socket, init: dict) -> None:
        self.sock = sock
        self.rank = int(init["rank"])
        cfg = config_from_json(init["config"])
        self.cfg = cfg.replace(device=rank_device(cfg.device, self.rank))
        self.specs = rank_pools(self.cfg, self.rank)
        self.memory = None  # the backend rank 0's runner uses, named with allocate/reserve
        self.comm = Comm(init["store"], self.rank, int(init["size"]), self.cfg.device)
        self.tensors: dict = {}
        self.core = None

    def serve(self) -> None:
        send_msg(self.sock, dict(ok=True))
        while True:
            try:
                msg, fds = recv_msg(self.sock)
            except EOFError:
                return
            op = msg.get("op")
            if op == "run":
                self.core.run_plan(msg["plan"])
            elif op == "warmup":
                self.core.warmup()
            else:
                self._command(op, msg, fds)

    def _command(self, op: str, msg: dict, fds: list[int]) -> None:
        from frmps_engine.sdk import memory

        out_fds: list[int] = []
        try:
            if op in ("allocate", "reserve"):
                if self.memory is not None:
                    raise GroupError(f"{op}: this rank has its pools already")
                self.memory = memory.get_backend(msg["memory"], self.cfg.device)
            if op == "allocate":
                pools = self.memory.allocate(self.specs)
                self.tensors = {p.spec.key: p.tensor for p in pools}
                out_fds = [p.fd for p in pools]
            elif op == "reserve":
                self.tensors = {p.spec.key: p.tensor for p in self.memory.reserve(self.specs)}
            elif op == "build":
                from .engine import RefCore

                self.core = RefCore(self.cfg, self.tensors, load_weights=bool(msg["load_weights"]),
                                    rank=self.rank, comm=self.comm)
            elif op == "map":
                self.memory.map(self.specs, fds, readonly=bool(msg["readonly"]))
                fds = []  # the backend owns them now
            elif op == "access":
                if msg["readonly"]:
                    self.memory.make_readonly(msg["tag"])
                else:
                    self.memory.make_writable(msg["tag"])
            else:
                raise GroupError(f"unknown command {op!r}")
        except Exception as e:  # a refused command; rank 0 decides (the engine refuses to start)
            log.warning("%s refused: %s", op, e)
            for fd in fds:
                os.close(fd)
            send_msg(self.sock, dict(ok=False, error=str(e)))
            return
        send_msg(self.sock, dict(ok=True), out_fds)


def worker_main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="frmps-engine-tp-worker")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    code = WORKER_EXIT_ERROR
    try:
        init, _ = recv_msg(sock)
        logging.basicConfig(level=str(args.log_level).upper(), stream=sys.stderr,
                            format=f"%(asctime)s %(levelname)s %(name)s[rank {init.get('rank')}]: %(message)s")
        _die_with_parent(int(init["parent"]))
        from .config import apply_cuda_env

        apply_cuda_env(init["config"]["device"])
        Worker(sock, init).serve()
        code = 0
    except Exception:
        log.exception("tensor-parallel worker failed")
    finally:
        logging.shutdown()
        sys.stderr.flush()
        # No interpreter teardown: the communicator may hold threads on a dead peer.
        os._exit(code)


if __name__ == "__main__":
    worker_main()
