"""Length-prefixed JSON messages with file descriptors over a Unix stream socket:
the private channel between an engine's rank 0 and its other ranks
(refengine/tp.py's workers, vllm/tp.py's fd exchange with vLLM's workers)."""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import Sequence

_HEADER = struct.Struct("<I")
_MAX_FDS = 16


def send_msg(sock: socket.socket, obj: dict, fds: Sequence[int] = ()) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    buf = _HEADER.pack(len(data)) + data
    # The fds ride on the first bytes; a stream socket may take the rest in parts.
    sent = socket.send_fds(sock, [buf], list(fds)) if fds else sock.send(buf)
    if sent < len(buf):
        sock.sendall(buf[sent:])


def recv_msg(sock: socket.socket) -> tuple[dict, list[int]]:
    """One message and the fds that came with it; EOFError when the peer is gone."""
    head, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, _MAX_FDS)
    if not head:
        for fd in fds:
            os.close(fd)
        raise EOFError("the peer closed the channel")
    head += _recv_exact(sock, _HEADER.size - len(head))
    (n,) = _HEADER.unpack(head)
    return json.loads(_recv_exact(sock, n)), fds


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("the peer closed the channel")
        buf += chunk
    return bytes(buf)
