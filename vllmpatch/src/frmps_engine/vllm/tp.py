"""Tensor parallelism for the vLLM engine (``frmps serve --engine vllm
--tensor-parallel-size N``). On the CPU its tests check it in its parts (the
per-rank layout, the fd exchange, the group memory over a labelled executor
double). The plan: vllmpatch/VLLM.md ("Tensor parallelism with vLLM").

The engine process the supervisor launched is rank 0 as far as frmps's contract
goes; vLLM's MultiprocExecutor starts one worker process per rank. Each worker
loads frmps's plugin, and a patch after vLLM's ``Worker.init_device``
(``worker_setup``) builds that rank's pools before its model load — allocated
(active) or reserved on scratch (standby) through the interceptor on the
worker's GPU, with the rank's PoolController installed, so that the single-GPU
placement patches put the rank's shard in the rank's pools. The rank-0 side is
``VllmGroupMemory``, the memory backend the SDK runner sees: after the engine is
built it gathers every rank's fds (the runner exports them: pool index = rank),
at Sleep it hands each rank its brokered fds, and the access flips reach every
rank — each through ``collective_rpc`` with a callable that runs in the workers
(vLLM cloudpickles it), the fds over a Unix socket (``FdExchange``) since vLLM's
message queue cannot carry them.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
from typing import Any, Callable, Mapping, Sequence

from ..sdk.fdchannel import recv_msg, send_msg
from ..sdk.memory.base import MemoryError_, Pool, PoolSpec, SizeMismatch, as_spec

log = logging.getLogger(__name__)

WORKER_EXTENSION = "frmps_engine.vllm.tp_worker.FrmpsTpWorker"  # vLLM's worker_extension_cls (tp_worker.py)
MULTIPROC_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"  # rank 0 sets spawn (engine._tp_prepare)
POOLS_ENV = "FRMPS_VLLM_TP_POOLS"  # set by rank 0 for its workers: role, memory backend, every rank's pools
_TIMEOUT_S = 120.0


def rank_specs(specs: Sequence[Any], rank: int) -> list[PoolSpec]:
    """The pools of one rank (a pool's index is its rank), in layout order."""
    return [as_spec(s) for s in specs if int(s.index) == rank]


def pools_env(specs: Sequence[Any], role: str, memory: str) -> str:
    if role not in ("active", "standby"):
        raise ValueError(f"role must be active or standby, got {role!r}")
    return json.dumps({"role": role, "memory": memory,
                       "pools": [[s.tag, int(s.index), int(s.size)] for s in map(as_spec, specs)]})


def parse_pools_env(raw: str) -> tuple[str, str, list[PoolSpec]]:
    """(role, memory backend, every rank's pools) from POOLS_ENV; ValueError when malformed."""
    try:
        d = json.loads(raw)
        role, memory = d["role"], d["memory"]
        specs = [PoolSpec(str(t), int(i), int(n)) for t, i, n in d["pools"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{POOLS_ENV} is not frmps's pool description: {e}") from e
    if role not in ("active", "standby") or not specs:
        raise ValueError(f"{POOLS_ENV}: role {role!r}, {len(specs)} pools")
    return role, memory, specs


# ---- rank 0: fds from and to the ranks ------------------------------------------------


class FdExchange:
    """A Unix socket (0600, in a private 0700 folder) with a one-time token. ``run``
    accepts one connection per rank on a thread while ``rpc()`` — a collective_rpc
    whose callable connects from every rank — runs; ``handle(rank, msg, fds)`` answers
    each (a reply message and the fds that go with it, or None for a plain ok).
    One exchange per operation; the folder is removed on close."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="frmps-tp-")
        os.chmod(self.dir, 0o700)
        self.path = os.path.join(self.dir, "x.sock")
        self.token = secrets.token_hex(16)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        os.chmod(self.path, 0o600)
        self._sock.listen(64)

    def __enter__(self) -> "FdExchange":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def run(self, ranks: int, handle: Callable[[int, dict, list[int]], tuple[dict, Sequence[int]] | None],
            rpc: Callable[[], Any], timeout: float = _TIMEOUT_S) -> Any:
        errors: list[BaseException] = []
        seen: set[int] = set()

        def serve() -> None:
            self._sock.settimeout(timeout)
            try:
                for _ in range(ranks):
                    conn, _ = self._sock.accept()
                    with conn:
                        conn.settimeout(timeout)
                        msg, fds = recv_msg(conn)
                        rank = msg.get("rank")
                        if msg.get("token") != self.token or not isinstance(rank, int) or rank in seen:
                            for fd in fds:
                                os.close(fd)
                            raise MemoryError_(f"tensor-parallel fd exchange: unexpected peer (rank {rank!r})")
                        seen.add(rank)
                        reply = handle(rank, msg, fds)
                        out, out_fds = reply if reply is not None else ({"ok": True}, ())
                        send_msg(conn, out, out_fds)
            except BaseException as e:  # re-raised on the caller's thread
                errors.append(e)

        t = threading.Thread(target=serve, name="frmps-tp-exchange", daemon=True)
        t.start()
        try:
            result = rpc()
        except BaseException:
            self._stop()  # a rank failed before connecting: end the accept loop now
            t.join(5)
            raise
        t.join(timeout)
        if t.is_alive():
            self._stop()
            t.join(5)
            raise MemoryError_(f"tensor-parallel fd exchange: {ranks - len(seen)} of {ranks} ranks did not connect")
        if errors:
            raise errors[0]
        return result

    def _stop(self) -> None:
        """Wake a thread blocked in accept (closing the socket alone does not on Linux)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def close(self) -> None:
        self._stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def _call_rank_zero(path: str, token: str, rank: int, msg: dict, fds: Sequence[int] = ()) -> tuple[dict, list[int]]:
    """A worker's side of the exchange: connect, say who it is, send, read the reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(_TIMEOUT_S)
        s.connect(path)
        send_msg(s, {**msg, "token": token, "rank": rank}, fds)
        return recv_msg(s)


# ---- the workers (collective_rpc callables; ``worker`` is vLLM's Worker) ------------------


def worker_setup(worker: Any, env: Mapping[str, str] = os.environ) -> bool:
    """After vLLM's ``Worker.init_device`` (patch ``tp-worker-pools``): in a worker of
    a frmps tensor-parallel engine (POOLS_ENV set), allocate or reserve this rank's
    pools on its GPU and install its PoolController and allocation contexts, before
    vLLM loads the rank's shard. Returns whether it did (False: not such a worker)."""
    raw = env.get(POOLS_ENV, "")
    if not raw:
        return False
    from ..sdk.memory import get_backend
    from .allocation import cuda_contexts
    from .pools import PoolController, install_controller, set_context_factory

    role, memory, specs = parse_pools_env(raw)
    rank = int(worker.rank)
    mine = rank_specs(specs, rank)
    if not mine:
        raise MemoryError_(f"tensor-parallel rank {rank}: no pools for it in {POOLS_ENV}")
    controller = PoolController(get_backend(memory, device=str(worker.device)), mine, role)
    controller.setup()
    install_controller(controller)
    set_context_factory(cuda_contexts(controller))
    log.info("tensor-parallel rank %d: %s pools %s on %s", rank, "allocated" if role == "active" else "reserved",
             ", ".join(f"{s.tag}[{s.index}] {s.size}" for s in mine), worker.device)
    return True


def rank_send_pools(worker: Any, path: str, token: str) -> int:
    """An active's rank: send its pools' fds to rank 0 (which exports them)."""
    from .pools import get_controller

    c = get_controller()
    _call_rank_zero(path, token, int(worker.rank), {"op": "pools", "specs": [[s.tag, s.index, s.size] for s in c.specs]},
                    c.fds())
    return len(c.specs)


def rank_map_brokered(worker: Any, path: str, token: str) -> int:
    """A standby's rank at Sleep: take its brokered fds from rank 0 and map them in
    place of its reservations, read-only."""
    from .pools import get_controller

    c = get_controller()
    _reply, fds = _call_rank_zero(path, token, int(worker.rank), {"op": "take"})
    c.provide_brokered(fds)
    c.suspend()
    return len(fds)


def rank_set_access(worker: Any, tag: str, readonly: bool) -> str:
    """Resume's KV flip to writable, Handoff's back to read-only, on this rank."""
    from .pools import get_controller

    backend = get_controller().backend
    (backend.make_readonly if readonly else backend.make_writable)(tag)
    return tag


def rank_triton_summary(worker: Any) -> str:
    """This rank's Triton compile watch's start line (tp_worker installs the watch)."""
    from . import triton_watch

    w = triton_watch.PROCESS_WATCH
    return w.start_summary() if w is not None else "no Triton compile watch in this rank"


# ---- rank 0's memory backend --------------------------------------------------------------


class VllmGroupMemory:
    """What the SDK runner sees as its memory backend in a tensor-parallel vLLM
    engine (module doc). allocate/reserve return the layout's pools without memory
    in this process; after the engine is built, ``attach(executor)`` and (active)
    ``collect()`` fill in the fds every rank allocated, which the runner exports."""

    def __init__(self, name: str, ranks: int):
        self.name = name
        self.ranks = ranks
        self.role = ""
        self._pools: list[Pool] = []
        self._executor: Any = None

    def _layout(self, specs: Sequence[Any], role: str) -> list[Pool]:
        specs = [as_spec(s) for s in specs]
        got = sorted({s.index for s in specs})
        if got != list(range(self.ranks)):
            raise MemoryError_(f"tensor-parallel layout has pools for ranks {got}, the group has {self.ranks}")
        self.role = role
        self._pools = [Pool(s, None) for s in specs]
        return list(self._pools)

    def allocate(self, specs: Sequence[Any]) -> list[Pool]:
        return self._layout(specs, "active")

    def reserve(self, specs: Sequence[Any]) -> list[Pool]:
        return self._layout(specs, "standby")

    def attach(self, executor: Any) -> None:
        self._executor = executor

    @property
    def executor(self) -> Any:
        """vLLM's executor of the group's workers (None before ``attach``)."""
        return self._executor

    def _rpc(self, fn: Callable, *args: Any) -> Any:
        if self._executor is None:
            raise MemoryError_("tensor-parallel pools: the engine's workers are not up yet")
        return self._executor.collective_rpc(fn, args=args)

    def collect(self) -> None:
        """Every rank's fds, into this backend's pools (an active, after the build)."""
        by_key = {p.spec.key: p for p in self._pools}

        def handle(rank: int, msg: dict, fds: list[int]) -> None:
            specs = [PoolSpec(str(t), int(i), int(n)) for t, i, n in msg.get("specs", [])]
            want = [p.spec for p in self._pools if p.spec.index == rank]
            if specs != want or len(fds) != len(specs):
                for fd in fds:
                    os.close(fd)
                raise MemoryError_(f"rank {rank} sent pools {specs} with {len(fds)} fds; its layout is {want}")
            for s, fd in zip(specs, fds):
                by_key[s.key].fd = fd

        try:
            with FdExchange() as x:
                x.run(self.ranks, handle, lambda: self._rpc(rank_send_pools, x.path, x.token))
        except BaseException:
            self.close()  # what some ranks sent before another failed is not kept
            raise

    def map(self, specs: Sequence[Any], fds: Sequence[int], readonly: bool) -> list[Pool]:
        specs, fds = [as_spec(s) for s in specs], list(fds)
        try:
            if not readonly:
                raise SizeMismatch("a standby maps the brokered pools read-only")
            if specs != [p.spec for p in self._pools] or len(fds) != len(specs):
                raise SizeMismatch(f"brokered pools {specs} ({len(fds)} fds) are not this group's layout "
                                   f"{[p.spec for p in self._pools]}")
            by_rank: dict[int, list[int]] = {}
            for s, fd in zip(specs, fds):
                by_rank.setdefault(s.index, []).append(fd)
            with FdExchange() as x:
                x.run(self.ranks, lambda rank, _msg, _fds: ({"ok": True}, by_rank[rank]),
                      lambda: self._rpc(rank_map_brokered, x.path, x.token))
        finally:
            for fd in fds:  # the ranks hold their own copies now (or nothing was mapped)
                os.close(fd)
        for p in self._pools:
            p.readonly = True
        return list(self._pools)

    def rank_triton_summaries(self) -> list[str]:
        """Each rank's "Triton during the start" line, in rank order."""
        return list(self._rpc(rank_triton_summary))

    def pools(self) -> list[Pool]:
        return []  # no pool memory in this process (the checksum diagnostics have nothing to read here)

    def make_writable(self, tag: str) -> None:
        self._rpc(rank_set_access, tag, False)

    def make_readonly(self, tag: str) -> None:
        self._rpc(rank_set_access, tag, True)

    def close(self) -> None:
        for p in self._pools:
            if p.fd >= 0:
                os.close(p.fd)
                p.fd = -1
