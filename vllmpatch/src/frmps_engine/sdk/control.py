"""Control-socket client: the engine side of proto/frmps/v1/control.proto.

Framing: ``uint32 LE length N (1..16 MiB) | N bytes Envelope``. File
descriptors travel as SCM_RIGHTS on the sendmsg() that carries the first byte
of a frame, so the receiver collects every fd that arrives while it reads one
frame and hands them out with that frame.
"""

from __future__ import annotations

import array
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from frmps_engine._proto.frmps.v1 import control_pb2

log = logging.getLogger(__name__)

MAX_FRAME = 16 << 20
_HEADER = struct.Struct("<I")
# More fds than pools we could ever receive in one frame; extra ones are an error.
_MAX_FDS_PER_FRAME = 256


class ControlError(Exception):
    """Base class of control-protocol errors."""


class ConnectionClosed(ControlError):
    """The peer closed the connection (clean EOF or EOF inside a frame)."""


class ProtocolError(ControlError):
    """The byte stream is unusable (bad length, truncated fds): the connection must be closed."""


class FrameDecodeError(ControlError):
    """One frame could not be decoded; it was consumed (and its fds closed), the stream is still in sync."""


class WelcomeRefused(ControlError):
    """The supervisor refused this engine's Hello."""

    def __init__(self, reason: str):
        super().__init__(f"supervisor refused this engine: {reason or '(no reason given)'}")
        self.reason = reason


def encode_frame(env: control_pb2.Envelope) -> bytes:
    data = env.SerializeToString()
    if not 1 <= len(data) <= MAX_FRAME:
        raise ControlError(f"encode frame: envelope is {len(data)} bytes, must be 1..{MAX_FRAME}")
    return _HEADER.pack(len(data)) + data


_FD_ITEM = array.array("i").itemsize
_CMSG_SPACE = socket.CMSG_SPACE(_MAX_FDS_PER_FRAME * _FD_ITEM)


def _recv_with_fds(sock: socket.socket, n: int) -> tuple[bytes, list[int], int]:
    """recvmsg with MSG_CMSG_CLOEXEC (socket.recv_fds drops its flags argument on
    Python 3.11/3.12, which would leave received fds inheritable)."""
    data, ancdata, msg_flags, _ = sock.recvmsg(n, _CMSG_SPACE, socket.MSG_CMSG_CLOEXEC)
    fds = array.array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % _FD_ITEM])
    return data, list(fds), msg_flags


def _close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class ControlConn:
    """One framed connection. Safe for one reader plus concurrent senders."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._send_lock = threading.Lock()
        self._closed = False

    @classmethod
    def connect(cls, path: str, timeout: float = 10.0) -> "ControlConn":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.settimeout(None)
        except OSError as e:
            sock.close()
            raise ControlError(f"connect control socket {path}: {e}") from e
        return cls(sock)

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self, env: control_pb2.Envelope, fds: Sequence[int] = (), *, nonblocking: bool = False) -> None:
        """Send one frame. ``fds`` are duplicated by the kernel; the caller keeps its copies."""
        frame = encode_frame(env)
        flags = socket.MSG_DONTWAIT if nonblocking else 0
        with self._send_lock:
            if self._closed:
                raise ConnectionClosed("send: connection closed")
            try:
                if fds:
                    sent = socket.send_fds(self._sock, [frame], list(fds), flags)
                else:
                    sent = self._sock.send(frame, flags)
                view = memoryview(frame)[sent:]
                while view:
                    n = self._sock.send(view, flags)
                    view = view[n:]
            except (BrokenPipeError, ConnectionResetError) as e:
                raise ConnectionClosed(f"send: {e}") from e
            except OSError as e:
                raise ControlError(f"send: {e}") from e

    def _read_exact(self, n: int, fds: list[int], what: str, allow_eof: bool) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            try:
                data, got, msg_flags = _recv_with_fds(self._sock, n - len(buf))
            except (ConnectionResetError, BrokenPipeError) as e:
                raise ConnectionClosed(f"recv {what}: {e}") from e
            except OSError as e:
                raise ControlError(f"recv {what}: {e}") from e
            fds.extend(got)
            if msg_flags & socket.MSG_CTRUNC:
                raise ProtocolError(f"recv {what}: ancillary data truncated (too many fds)")
            if not data:
                if allow_eof and not buf and not fds:
                    raise ConnectionClosed("peer closed the connection")
                raise ConnectionClosed(f"recv {what}: EOF after {len(buf)} of {n} bytes")
            buf += data
        return bytes(buf)

    def recv(self) -> tuple[control_pb2.Envelope, list[int]]:
        """Read one frame. Received fds are owned by the caller (O_CLOEXEC set).

        Raises ConnectionClosed on EOF, ProtocolError when the stream cannot be
        resynchronised, FrameDecodeError for one undecodable frame (its fds are closed).
        """
        fds: list[int] = []
        try:
            header = self._read_exact(_HEADER.size, fds, "frame header", allow_eof=True)
            (n,) = _HEADER.unpack(header)
            if not 1 <= n <= MAX_FRAME:
                raise ProtocolError(f"recv: frame length {n} out of range 1..{MAX_FRAME}")
            body = self._read_exact(n, fds, "frame body", allow_eof=False)
        except BaseException:
            _close_fds(fds)
            raise
        env = control_pb2.Envelope()
        try:
            env.ParseFromString(body)
        except Exception as e:  # protobuf raises DecodeError; be broad for other runtimes
            _close_fds(fds)
            raise FrameDecodeError(f"recv: undecodable envelope ({n} bytes): {e}") from e
        if env.WhichOneof("msg") is None:
            _close_fds(fds)
            raise FrameDecodeError(f"recv: envelope ({n} bytes) carries no known message")
        return env, fds

    def close(self) -> None:
        with self._send_lock:
            self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


class CommandHandler(Protocol):
    """What the receive loop dispatches to. Each returns an optional Reply (None: no Reply sent)."""

    def on_sleep(self, env_id: int, msg: control_pb2.Sleep, fds: list[int]) -> control_pb2.Reply | None: ...
    def on_resume(self, env_id: int, msg: control_pb2.Resume) -> control_pb2.Reply | None: ...
    def on_shutdown(self, env_id: int, msg: control_pb2.Shutdown) -> control_pb2.Reply | None: ...
    def on_handoff(self, env_id: int, msg: control_pb2.Handoff) -> control_pb2.Reply | None: ...
    def on_disconnect(self, err: Exception) -> None: ...


@dataclass
class HelloInfo:
    role: int
    model: str
    engine: str
    engine_version: str
    pools: list[control_pb2.Pool]
    generation_endpoint: str
    device: str
    block_size: int
    num_blocks: int
    weights: str = ""  # "loaded:<model dir>" or "dummy" ("": the adapter does not say)
    pid: int = field(default_factory=os.getpid)
    kv_budget: control_pb2.KVBudget | None = None  # an engine that sized its KV cache says how
    ring_record_bytes: int = 0  # its largest FULL ring record (0: unknown); the supervisor may grow the ring for it


class ControlClient:
    """The engine's side of the control protocol on top of a ControlConn."""

    def __init__(self, conn: ControlConn):
        self.conn = conn
        self._next_id = 1
        self._id_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @classmethod
    def connect(cls, path: str, timeout: float = 10.0) -> "ControlClient":
        return cls(ControlConn.connect(path, timeout))

    def _id(self) -> int:
        with self._id_lock:
            i = self._next_id
            self._next_id += 1
            return i

    def send(self, env: control_pb2.Envelope, fds: Sequence[int] = (), **kw) -> None:
        if env.id == 0:
            env.id = self._id()
        self.conn.send(env, fds, **kw)

    def handshake(self, info: HelloInfo, timeout: float = 30.0) -> control_pb2.Welcome:
        """Send Hello and wait for Welcome. Raises WelcomeRefused when refused."""
        hello = control_pb2.Hello(
            protocol_version=control_pb2.PROTOCOL_VERSION_1,
            role=info.role,
            pid=info.pid,
            model=info.model,
            engine=info.engine,
            engine_version=info.engine_version,
            pools=info.pools,
            generation_endpoint=info.generation_endpoint,
            device=info.device,
            block_size=info.block_size,
            num_blocks=info.num_blocks,
            kv_budget=info.kv_budget,
            ring_record_bytes=info.ring_record_bytes,
            weights=info.weights,
        )
        self.send(control_pb2.Envelope(hello=hello))
        self.conn._sock.settimeout(timeout)
        try:
            env, fds = self.conn.recv()
        except (socket.timeout, TimeoutError) as e:
            raise ControlError(f"handshake: no Welcome within {timeout:.0f}s") from e
        finally:
            self.conn._sock.settimeout(None)
        if fds:
            _close_fds(fds)
            raise ProtocolError(f"handshake: Welcome came with {len(fds)} unexpected fds")
        kind = env.WhichOneof("msg")
        if kind != "welcome":
            raise ProtocolError(f"handshake: expected Welcome, got {kind}")
        w = env.welcome
        if not w.accepted:
            raise WelcomeRefused(w.reason)
        if w.protocol_version != control_pb2.PROTOCOL_VERSION_1:
            raise ProtocolError(f"handshake: supervisor speaks protocol version {w.protocol_version}, engine speaks 1")
        return w

    def export_pools(self, pools: Sequence[control_pb2.Pool], fds: Sequence[int]) -> None:
        if len(pools) != len(fds):
            raise ControlError(f"export pools: {len(pools)} pools but {len(fds)} fds")
        self.send(control_pb2.Envelope(pool_export=control_pb2.PoolExport(pools=pools)), fds)

    def ready(self, role: int, init_ns: int) -> None:
        self.send(control_pb2.Envelope(ready=control_pb2.Ready(role=role, init_ns=init_ns)))

    def heartbeat(self, step: int, running: int, waiting: int, *, interval_ms: int = 0, step_age_ns: int = 0,
                  step_expected_ns: int = 0, step_tokens: int = 0) -> None:
        self.send(control_pb2.Envelope(heartbeat=control_pb2.Heartbeat(
            step=step, running=running, waiting=waiting, interval_ms=interval_ms, step_age_ns=step_age_ns,
            step_expected_ns=step_expected_ns, step_tokens=step_tokens)))

    def reply(self, env_id: int, reply: control_pb2.Reply) -> None:
        self.send(control_pb2.Envelope(id=env_id, reply=reply))

    def fault(self, cause: str, detail: str = "") -> None:
        """Best effort, never blocks: the engine is about to exit."""
        env = control_pb2.Envelope(fault=control_pb2.Fault(cause=cause, detail=detail[:4096], unix_nanos=time.time_ns()))
        self.send(env, nonblocking=True)

    def start(self, handler: CommandHandler) -> threading.Thread:
        """Run the receive loop on a daemon thread, dispatching commands to ``handler``."""
        t = threading.Thread(target=self._recv_loop, args=(handler,), name="frmps-control", daemon=True)
        self._thread = t
        t.start()
        return t

    def _recv_loop(self, handler: CommandHandler) -> None:
        while True:
            try:
                env, fds = self.conn.recv()
            except FrameDecodeError as e:
                log.warning("control: dropped a frame: %s", e)
                continue
            except Exception as e:  # EOF, protocol error, closed socket: the connection is over
                handler.on_disconnect(e)
                return
            kind = env.WhichOneof("msg")
            if kind != "sleep" and fds:
                log.warning("control: %s came with %d unexpected fds; closed them", kind, len(fds))
                _close_fds(fds)
                fds = []
            start = time.perf_counter_ns()
            try:
                if kind == "sleep":
                    reply = handler.on_sleep(env.id, env.sleep, fds)
                elif kind == "resume":
                    reply = handler.on_resume(env.id, env.resume)
                elif kind == "shutdown":
                    reply = handler.on_shutdown(env.id, env.shutdown)
                elif kind == "handoff":
                    reply = handler.on_handoff(env.id, env.handoff)
                elif kind == "ping":
                    reply = control_pb2.Reply(ok=True)
                else:
                    reply = control_pb2.Reply(ok=False, error=f"engine does not accept {kind} messages")
            except Exception as e:
                log.exception("control: handling %s failed", kind)
                reply = control_pb2.Reply(ok=False, error=f"{kind}: {e}")
            if reply is None:
                continue
            if not reply.took_ns:
                reply.took_ns = time.perf_counter_ns() - start
            try:
                self.reply(env.id, reply)
            except ControlError as e:
                handler.on_disconnect(e)
                return

    def close(self) -> None:
        self.conn.close()
