"""TEST PEER (not the engine SDK): a minimal Python engine side of the
control protocol, written from the .proto spec with only the standard
library and the generated messages. The Go interop test runs it to prove
that frames and SCM_RIGHTS fds cross the language boundary both ways.

usage: py_peer.py SOCKET_PATH
"""
import os
import socket
import struct
import sys

from frmps_engine._proto.frmps.v1 import control_pb2 as pb

MAX_FRAME = 16 << 20


def send(sock, env, fds=()):
    body = env.SerializeToString()
    frame = struct.pack("<I", len(body)) + body
    # fds ride on the first sendmsg of the frame, as the spec says.
    sent = socket.send_fds(sock, [frame], list(fds)) if fds else sock.send(frame)
    if sent < len(frame):
        sock.sendall(frame[sent:])


def recv_exact(sock, n, fds_acc):
    buf = b""
    while len(buf) < n:
        data, fds, _flags, _addr = socket.recv_fds(sock, n - len(buf), 16)
        fds_acc.extend(fds)
        if not data:
            raise EOFError("control socket closed")
        buf += data
    return buf


def recv(sock):
    fds = []
    (n,) = struct.unpack("<I", recv_exact(sock, 4, fds))
    if not 1 <= n <= MAX_FRAME:
        raise ValueError(f"bad frame length {n}")
    env = pb.Envelope()
    env.ParseFromString(recv_exact(sock, n, fds))
    return env, fds


def main(path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    pool = pb.Pool(tag="kv_cache", index=0, size=4096, backend="host-shm")
    send(sock, pb.Envelope(hello=pb.Hello(
        protocol_version=pb.PROTOCOL_VERSION_1, role=pb.ROLE_ACTIVE, pid=os.getpid(),
        model="py-peer", engine="py-peer", pools=[pool])))
    env, _ = recv(sock)
    assert env.WhichOneof("msg") == "welcome" and env.welcome.accepted, env

    fd = os.memfd_create("py-peer-pool")
    os.ftruncate(fd, 4096)
    os.pwrite(fd, b"from python", 0)
    send(sock, pb.Envelope(pool_export=pb.PoolExport(pools=[pool])), [fd])

    env, fds = recv(sock)
    assert env.WhichOneof("msg") == "sleep" and len(fds) == 1, (env, fds)
    got_py = os.pread(fds[0], 11, 0)
    got_go = os.pread(fds[0], 13, 100)
    ok = got_py == b"from python" and got_go == b"go wrote this"
    send(sock, pb.Envelope(id=env.id, reply=pb.Reply(ok=ok, error="" if ok else f"{got_py!r} {got_go!r}")))
    for f in fds + [fd]:
        os.close(f)
    sock.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
