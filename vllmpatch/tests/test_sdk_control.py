"""Control-socket client: framing, fds, handshake, dispatch."""

import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading

import pytest

from conftest import open_fds
from frmps_engine._proto.frmps.v1 import control_pb2
from frmps_engine.sdk import control
from frmps_engine.sdk.control import ControlConn


def _pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return ControlConn(a), ControlConn(b)


def _tmpfile(content: bytes) -> int:
    fd, path = tempfile.mkstemp()
    os.unlink(path)
    os.write(fd, content)
    return fd


def _read_fd(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 1 << 16)


def test_round_trip_with_fds(no_fd_leak):
    a, b = _pair()
    fds = [_tmpfile(b"pool-0"), _tmpfile(b"pool-1")]
    env = control_pb2.Envelope(id=7, pool_export=control_pb2.PoolExport(pools=[
        control_pb2.Pool(tag="weights", index=0, size=6, backend="host-shm"),
        control_pb2.Pool(tag="kv_cache", index=0, size=6, backend="host-shm")]))
    a.send(env, fds)
    got, got_fds = b.recv()
    assert got == env
    assert [_read_fd(fd) for fd in got_fds] == [b"pool-0", b"pool-1"]
    assert set(got_fds).isdisjoint(fds)  # the kernel gave us new descriptors
    import fcntl
    assert all(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC for fd in got_fds)
    for fd in fds + got_fds:
        os.close(fd)
    a.close()
    b.close()


_CHILD = r"""
import os, socket, sys, tempfile
from frmps_engine._proto.frmps.v1 import control_pb2
from frmps_engine.sdk.control import ControlConn
c = ControlConn.connect(sys.argv[1])
env, fds = c.recv()                      # Sleep with fds from the parent
data = [os.pread(fd, 64, 0) for fd in fds]
fd, p = tempfile.mkstemp(); os.unlink(p); os.write(fd, b"|".join(data) + b"|child")
c.send(control_pb2.Envelope(id=env.id, pool_export=control_pb2.PoolExport(pools=env.sleep.pools)), [fd])
c.close()
"""


def test_fds_between_processes(sockdir, no_fd_leak):
    path = os.path.join(sockdir, "c.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    child = subprocess.Popen([sys.executable, "-c", _CHILD, path], env={**os.environ})
    try:
        s, _ = srv.accept()
        conn = ControlConn(s)
        fds = [_tmpfile(b"alpha"), _tmpfile(b"beta")]
        conn.send(control_pb2.Envelope(id=3, sleep=control_pb2.Sleep(pools=[
            control_pb2.Pool(tag="weights", index=0, size=5), control_pb2.Pool(tag="kv_cache", index=0, size=4)])), fds)
        env, got = conn.recv()
        assert env.id == 3 and env.WhichOneof("msg") == "pool_export" and len(env.pool_export.pools) == 2
        assert len(got) == 1 and _read_fd(got[0]) == b"alpha|beta|child"
        for fd in fds + got:
            os.close(fd)
        with pytest.raises(control.ConnectionClosed):
            conn.recv()
        conn.close()
    finally:
        assert child.wait(10) == 0
        srv.close()


def test_partial_reads_one_byte_at_a_time(no_fd_leak):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = ControlConn(b)
    env = control_pb2.Envelope(id=9, heartbeat=control_pb2.Heartbeat(step=123456, running=3, waiting=1))
    frame = control.encode_frame(env)
    fd = _tmpfile(b"x")

    def writer():
        socket.send_fds(a, [frame[:1]], [fd])  # fds ride on the first byte only
        for i in range(1, len(frame)):
            a.send(frame[i:i + 1])

    t = threading.Thread(target=writer)
    t.start()
    got, fds = conn.recv()
    t.join()
    assert got == env and len(fds) == 1 and _read_fd(fds[0]) == b"x"
    for f in (fd, *fds):
        os.close(f)
    a.close()
    conn.close()


def test_large_frame_near_limit():
    a, b = _pair()
    env = control_pb2.Envelope(fault=control_pb2.Fault(cause="x", detail="d" * (control.MAX_FRAME - 64)))
    t = threading.Thread(target=a.send, args=(env,))
    t.start()
    got, _ = b.recv()
    t.join()
    assert got.fault.detail == env.fault.detail
    with pytest.raises(control.ControlError, match="must be 1.."):
        control.encode_frame(control_pb2.Envelope(fault=control_pb2.Fault(detail="d" * control.MAX_FRAME)))
    a.close()
    b.close()


@pytest.mark.parametrize("length", [0, control.MAX_FRAME + 1, 0xFFFFFFFF])
def test_bad_length_is_a_protocol_error(length, no_fd_leak):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = ControlConn(b)
    fd = _tmpfile(b"x")
    socket.send_fds(a, [struct.pack("<I", length) + b"junk"], [fd])
    os.close(fd)
    with pytest.raises(control.ProtocolError, match="out of range"):
        conn.recv()
    a.close()
    conn.close()


def test_undecodable_frame_is_dropped_and_its_fds_closed():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = ControlConn(b)
    before = open_fds()
    fd = _tmpfile(b"x")
    garbage = b"\xff\xff\xff\xff\x0f"  # a truncated varint: not an Envelope
    socket.send_fds(a, [struct.pack("<I", len(garbage)) + garbage], [fd])
    os.close(fd)
    with pytest.raises(control.FrameDecodeError, match="undecodable"):
        conn.recv()
    assert open_fds() - before == set()  # the fd that came with the frame was closed
    # The stream is still in sync: the next frame decodes.
    good = control_pb2.Envelope(id=1, ping=control_pb2.Ping())
    a.sendall(control.encode_frame(good))
    assert conn.recv()[0] == good
    # An envelope with no message set is refused the same way.
    a.sendall(control.encode_frame(control_pb2.Envelope(id=5)))
    with pytest.raises(control.FrameDecodeError, match="no known message"):
        conn.recv()
    a.close()
    conn.close()


def test_eof_mid_frame_and_clean_eof():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = ControlConn(b)
    a.sendall(struct.pack("<I", 100) + b"short")
    a.close()
    with pytest.raises(control.ConnectionClosed, match="EOF after 5 of 100"):
        conn.recv()
    conn.close()
    a, b = _pair()
    a.close()
    with pytest.raises(control.ConnectionClosed, match="peer closed"):
        b.recv()
    b.close()


def _fake_supervisor(conn: ControlConn, welcome: control_pb2.Welcome, seen: list):
    env, fds = conn.recv()
    seen.append(env)
    conn.send(control_pb2.Envelope(welcome=welcome))


def _hello():
    return control.HelloInfo(role=control_pb2.ROLE_ACTIVE, model="m", engine="fake", engine_version="1",
                             pools=[control_pb2.Pool(tag="kv_cache", index=0, size=64)], generation_endpoint="unix:///x",
                             device="cpu", block_size=16, num_blocks=4, ring_record_bytes=3 << 20)


def test_handshake_accepted():
    a, b = _pair()
    seen = []
    t = threading.Thread(target=_fake_supervisor, args=(a, control_pb2.Welcome(
        accepted=True, protocol_version=control_pb2.PROTOCOL_VERSION_1, ring_path="/dev/shm/r", sync_every=16), seen))
    t.start()
    w = control.ControlClient(b).handshake(_hello())
    t.join()
    assert w.ring_path == "/dev/shm/r" and w.sync_every == 16
    h = seen[0].hello
    assert h.pid == os.getpid() and h.protocol_version == control_pb2.PROTOCOL_VERSION_1
    assert h.pools[0].size == 64 and h.role == control_pb2.ROLE_ACTIVE
    assert h.ring_record_bytes == 3 << 20  # the supervisor grows the ring for it
    a.close()
    b.close()


def test_welcome_refused_raises_with_reason():
    a, b = _pair()
    t = threading.Thread(target=_fake_supervisor, args=(a, control_pb2.Welcome(
        accepted=False, reason="pool layout differs from the broker's"), []))
    t.start()
    with pytest.raises(control.WelcomeRefused, match="pool layout differs from the broker's") as ei:
        control.ControlClient(b).handshake(_hello())
    assert ei.value.reason == "pool layout differs from the broker's"
    t.join()
    a.close()
    b.close()


def test_handshake_wrong_first_message():
    a, b = _pair()
    a.send(control_pb2.Envelope(ping=control_pb2.Ping()))
    with pytest.raises(control.ProtocolError, match="expected Welcome, got ping"):
        control.ControlClient(b).handshake(_hello())
    a.close()
    b.close()


class _Handler:
    def __init__(self):
        self.disconnected = threading.Event()
        self.err = None
        self.sleep_fds = None

    def on_sleep(self, env_id, msg, fds):
        self.sleep_fds = fds
        return control_pb2.Reply(ok=True)

    def on_resume(self, env_id, msg):
        raise RuntimeError("boom")

    def on_shutdown(self, env_id, msg):
        return control_pb2.Reply(ok=True, error=f"grace {msg.grace_ms}")

    def on_disconnect(self, err):
        self.err = err
        self.disconnected.set()


def test_receive_loop_dispatch(no_fd_leak):
    sup, eng = _pair()
    client = control.ControlClient(eng)
    h = _Handler()
    client.start(h)

    def cmd(env, fds=()):
        sup.send(env, fds)
        r, _ = sup.recv()
        assert r.id == env.id and r.WhichOneof("msg") == "reply"
        return r.reply

    assert cmd(control_pb2.Envelope(id=1, ping=control_pb2.Ping())).ok
    r = cmd(control_pb2.Envelope(id=2, resume=control_pb2.Resume()))
    assert not r.ok and "boom" in r.error
    r = cmd(control_pb2.Envelope(id=3, hello=control_pb2.Hello()))
    assert not r.ok and "does not accept hello" in r.error
    fd = _tmpfile(b"s")
    assert cmd(control_pb2.Envelope(id=4, sleep=control_pb2.Sleep()), [fd]).ok
    os.close(fd)
    assert len(h.sleep_fds) == 1
    os.close(h.sleep_fds[0])
    # Unexpected fds on another command are closed, not leaked.
    fd = _tmpfile(b"t")
    assert cmd(control_pb2.Envelope(id=5, ping=control_pb2.Ping()), [fd]).ok
    os.close(fd)
    assert cmd(control_pb2.Envelope(id=6, shutdown=control_pb2.Shutdown(grace_ms=250))).error == "grace 250"
    # Garbage does not stop the loop.
    sup._sock.sendall(struct.pack("<I", 2) + b"\xff\xff")
    assert cmd(control_pb2.Envelope(id=7, ping=control_pb2.Ping())).ok
    sup.close()
    assert h.disconnected.wait(5)
    assert isinstance(h.err, control.ConnectionClosed)
    client._thread.join(5)
    client.close()


def test_fault_is_nonblocking_and_connect_error():
    a, b = _pair()
    client = control.ControlClient(b)
    client.fault("misaligned address", "trace")
    env, _ = a.recv()
    assert env.fault.cause == "misaligned address" and env.fault.unix_nanos > 0
    a.close()
    b.close()
    with pytest.raises(control.ControlError, match="connect control socket /nonexistent/x.sock"):
        control.ControlClient.connect("/nonexistent/x.sock")
