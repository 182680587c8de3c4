"""The ring writer: the active engine publishes its forward state here.

Follows ringbuf/FORMAT.md ("Writer algorithm"). A record is assembled in a
private scratch buffer, checksummed, copied into the ring, and committed by
one aligned 8-byte store of ``write_cursor`` through ``ctypes.c_uint64``. On
x86-64 (TSO) that store is ordered after every byte of the record, which is
the only guarantee the reader relies on; the writer refuses other
architectures rather than publish records a reader could see torn.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
from array import array
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from numpy.typing import ArrayLike

from . import _crc32c
from .layout import (
    FILE_HEADER,
    FLAG_ABORTED,
    FLAG_FINISHED,
    FLAG_RESET,
    HEADER_SIZE,
    MAGIC,
    OFF_EPOCH,
    OFF_RESYNC_ACK,
    OFF_RESYNC_REQUEST,
    OFF_WRITE_CURSOR,
    OFF_WRITE_SEQ,
    PAYLOAD_FIXED,
    PAYLOAD_HEADER,
    RECORD_HEADER,
    RECORD_HEADER_NO_CRC,
    RECORD_HEADER_SIZE,
    TYPE_DELTA,
    TYPE_FULL,
    TYPE_PAD,
    VERSION,
    align_up,
    payload_len,
    valid_capacity,
)

_SUPPORTED_MACHINES = {"x86_64", "amd64"}
# Zero bytes kept in front of the scratch record so the numpy CRC can start
# its 64-byte chunks before the message (leading zeros do not change a CRC).
_FRONT = 64


class RingError(Exception):
    """Bad ring file, refused record or unsupported platform."""


def _check_platform() -> None:
    m = platform.machine().lower()
    if m not in _SUPPORTED_MACHINES:
        raise RingError(
            f"the ring writer needs x86-64 (its commit relies on total store order); this machine is {m!r}"
        )


def create_ring(path: str, capacity: int) -> None:
    """Create a ring file (O_CREAT|O_EXCL, mode 0600) with an initialised header."""
    if not valid_capacity(capacity):
        raise RingError(f"create ring: capacity {capacity} is not a power of two in [4096, 2^34]")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    ok = False
    try:
        os.ftruncate(fd, HEADER_SIZE + capacity)
        hdr = bytearray(HEADER_SIZE)
        FILE_HEADER.pack_into(hdr, 0, MAGIC, VERSION, HEADER_SIZE, capacity, 0, 0)
        os.pwrite(fd, bytes(hdr), 0)
        ok = True
    finally:
        os.close(fd)
        if not ok:
            os.unlink(path)


def validate_header(buf, size: int) -> int:
    """Check a ring file header; returns the capacity or raises RingError."""
    if size < HEADER_SIZE:
        raise RingError(f"ring file of {size} bytes is smaller than the {HEADER_SIZE}-byte header")
    magic, version, header_size, capacity, _epoch, _flags = FILE_HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise RingError(f"bad magic {magic!r}")
    if version != VERSION:
        raise RingError(f"unsupported ring version {version} (want {VERSION})")
    if header_size != HEADER_SIZE:
        raise RingError(f"unsupported header_size {header_size} (want {HEADER_SIZE})")
    if not valid_capacity(capacity):
        raise RingError(f"bad capacity {capacity}")
    if size != HEADER_SIZE + capacity:
        raise RingError(f"capacity {capacity} does not match file size {size}")
    return capacity


@dataclass(slots=True)
class RequestDelta:
    """One request's entry in a record (see FORMAT.md, entry semantics)."""

    key: int
    seed: int
    num_computed: int
    num_prompt: int = 0
    reset: bool = False
    finished: bool = False
    aborted: bool = False
    blocks: Sequence[int] = field(default=())
    tokens: Sequence[int] = field(default=())


class RingWriter:
    """The single writer of a ring. Not thread-safe."""

    def __init__(self, path: str, fd: int, mm: mmap.mmap, capacity: int) -> None:
        self.path = path
        self._fd = fd
        self._mm = mm
        self.capacity = capacity
        self._max_record = capacity // 2
        self._cursor_w = ctypes.c_uint64.from_buffer(mm, OFF_WRITE_CURSOR)
        self._seq_w = ctypes.c_uint64.from_buffer(mm, OFF_WRITE_SEQ)
        self._epoch_w = ctypes.c_uint64.from_buffer(mm, OFF_EPOCH)
        self._req_w = ctypes.c_uint64.from_buffer(mm, OFF_RESYNC_REQUEST)
        self._ack_w = ctypes.c_uint64.from_buffer(mm, OFF_RESYNC_ACK)
        # The data area as a memoryview: a slice assignment into it is a memcpy that
        # keeps the GIL. numpy's copy of a record of a few KiB releases it, and the
        # engine loop's thread then waits for the gRPC threads to hand it back (up to
        # the interpreter's switch interval, 5 ms): 0.7 ms per record on average at
        # 64 sequences (bench/serving_overhead.py).
        self._data = memoryview(mm)[HEADER_SIZE : HEADER_SIZE + capacity]
        self._cursor = self._cursor_w.value
        self._seq = self._seq_w.value
        self.epoch = self._epoch_w.value + 1
        self._epoch_w.value = self.epoch
        self._saw_full = False
        self._scratch = np.zeros(0, dtype=np.uint8)
        self._hw = _crc32c.HAVE_HW

    @classmethod
    def attach(cls, path: str) -> "RingWriter":
        """Validate the ring's header and take it over (epoch += 1). The caller
        must publish a FULL record first."""
        _check_platform()
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            hdr = os.pread(fd, HEADER_SIZE, 0)
            if len(hdr) < HEADER_SIZE:
                raise RingError(f"attach {path}: ring file of {len(hdr)} bytes is smaller than the header")
            capacity = validate_header(hdr, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            # The file may have changed between the check and the mapping.
            validate_header(mm, len(mm))
        except RingError as e:
            os.close(fd)
            raise RingError(f"attach {path}: {e}") from None
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, mm, capacity)

    # ------------------------------------------------------------------ state
    @property
    def max_record(self) -> int:
        """The largest record this ring takes (bytes, header included): capacity/2."""
        return self._max_record

    @property
    def seq(self) -> int:
        """seq of the last committed record."""
        return self._seq

    @property
    def cursor(self) -> int:
        return self._cursor

    def resync_requested(self) -> bool:
        return self._req_w.value != self._ack_w.value

    # ---------------------------------------------------------------- publish
    def publish(self, step: int, entries: Sequence[RequestDelta], full: bool = False) -> int:
        """Publish one DELTA (or FULL) record; returns its seq."""
        ks = array("Q")  # row-major: key, seed
        cols = array("I")  # row-major: num_computed, num_prompt, flags, n_blocks, n_tokens
        blocks = array("I")
        tokens = array("I")
        ks_extend, cols_extend = ks.extend, cols.extend
        for e in entries:
            ks_extend((e.key, e.seed))
            flags = (FLAG_RESET if e.reset else 0) | (FLAG_FINISHED if e.finished else 0) | (FLAG_ABORTED if e.aborted else 0)
            cols_extend((e.num_computed, e.num_prompt, flags, len(e.blocks), len(e.tokens)))
            if e.blocks:
                blocks.extend(e.blocks)
            if e.tokens:
                tokens.extend(e.tokens)
        k = np.frombuffer(ks, dtype=np.uint64).reshape(-1, 2)
        c = np.frombuffer(cols, dtype=np.uint32).reshape(-1, 5)
        return self.publish_columns(
            step, k[:, 0], k[:, 1], c[:, 0], c[:, 1], c[:, 2], c[:, 3], c[:, 4],
            np.frombuffer(blocks, dtype=np.uint32), np.frombuffer(tokens, dtype=np.uint32), full=full,
        )  # fmt: skip

    def publish_columns(
        self,
        step: int,
        keys: ArrayLike,
        seeds: ArrayLike,
        num_computed: ArrayLike,
        num_prompt: ArrayLike,
        flags: ArrayLike,
        n_blocks: ArrayLike,
        n_tokens: ArrayLike,
        blocks: ArrayLike,
        tokens: ArrayLike,
        full: bool = False,
    ) -> int:
        """Publish one record from columns (array-likes; the numpy fast path).
        ``blocks``/``tokens`` are the concatenation over entries, in entry order."""
        if self._mm is None:
            raise RingError("publish: ring writer is closed")
        if not full and not self._saw_full:
            raise RingError("publish: the first record after attach must be FULL")
        n = len(keys)
        blocks = np.asarray(blocks, dtype=np.uint32).ravel()
        tokens = np.asarray(tokens, dtype=np.uint32).ravel()
        n_blocks = np.asarray(n_blocks, dtype=np.uint32)
        n_tokens = np.asarray(n_tokens, dtype=np.uint32)
        flags = np.asarray(flags, dtype=np.uint32)
        for name, col in (("seeds", seeds), ("num_computed", num_computed), ("num_prompt", num_prompt),
                          ("flags", flags), ("n_blocks", n_blocks), ("n_tokens", n_tokens)):  # fmt: skip
            if len(col) != n:
                raise RingError(f"publish: column {name} has {len(col)} entries, keys has {n}")
        sb, st = blocks.size, tokens.size
        if n and (int(n_blocks.sum(dtype=np.uint64)) != sb or int(n_tokens.sum(dtype=np.uint64)) != st):
            raise RingError("publish: n_blocks/n_tokens do not add up to the blocks/tokens columns")
        if full and n and not np.all(flags & FLAG_RESET):
            raise RingError("publish: every entry of a FULL record must have RESET")
        plen = payload_len(n, sb, st)
        length = align_up(RECORD_HEADER_SIZE + plen)
        if length > self._max_record:
            raise RingError(f"publish: record of {length} bytes exceeds capacity/2 ({self._max_record})")

        ack = self._req_w.value if full else 0
        s = self._scratch_for(plen)
        p = _FRONT + RECORD_HEADER_SIZE  # payload start in the scratch, 8-aligned
        PAYLOAD_HEADER.pack_into(s, p, n, 0, step)
        o = p + PAYLOAD_FIXED
        s64 = s.view(np.uint64)
        s32 = s.view(np.uint32)
        q = o // 8
        s64[q : q + n] = keys
        s64[q + n : q + 2 * n] = seeds
        w = (o + 16 * n) // 4
        s32[w : w + n] = num_computed
        s32[w + n : w + 2 * n] = num_prompt
        s32[w + 2 * n : w + 3 * n] = flags
        s32[w + 3 * n : w + 4 * n] = n_blocks
        s32[w + 4 * n : w + 5 * n] = n_tokens
        w += 5 * n
        s32[w : w + sb] = blocks
        s32[w + sb : w + sb + st] = tokens
        seq = self._commit(s, TYPE_FULL if full else TYPE_DELTA, length, plen)
        if full:
            self._saw_full = True
            self._ack_w.value = ack
        return seq

    def _scratch_for(self, plen: int) -> np.ndarray:
        need = _FRONT + RECORD_HEADER_SIZE + plen + 8
        if self._scratch.size < need:
            # Whole 8-byte words: publish_columns views the scratch as uint64.
            size = -(-max(need, 2 * self._scratch.size, 1 << 16) // 8) * 8
            self._scratch = np.zeros(size, dtype=np.uint8)
        return self._scratch

    def _crc(self, s: np.ndarray, length: int, typ: int, seq: int, plen: int) -> int:
        """CRC of header[0:28] + payload, with the header packed into the
        scratch just before the payload so the message is contiguous."""
        start = _FRONT + 4
        end = _FRONT + RECORD_HEADER_SIZE + plen
        if self._hw:
            RECORD_HEADER_NO_CRC.pack_into(s, start, length, typ, 0, seq, self.epoch, plen)
            return _crc32c.crc32c(memoryview(s)[start:end])
        # Numpy path: starting the CRC at 0xFFFFFFFF equals XOR-ing it into the
        # first four message bytes and starting at 0.
        RECORD_HEADER_NO_CRC.pack_into(s, start, length ^ 0xFFFFFFFF, typ, 0, seq, self.epoch, plen)
        k = -(-(end - start) // 64)
        return _crc32c.crc32c_linear_np(s[end - 64 * k : end]) ^ 0xFFFFFFFF

    def _commit(self, s: np.ndarray, typ: int, length: int, plen: int) -> int:
        cap = self.capacity
        off = self._cursor % cap
        if cap - off < length:
            self._pad(off)
            off = 0
        seq = self._seq + 1
        crc = self._crc(s, length, typ, seq, plen)
        base = HEADER_SIZE + off
        if plen:
            p = _FRONT + RECORD_HEADER_SIZE
            self._data[off + RECORD_HEADER_SIZE : off + RECORD_HEADER_SIZE + plen] = s.data[p : p + plen]
        RECORD_HEADER.pack_into(self._mm, base, length, typ, 0, seq, self.epoch, plen, crc)
        self._cursor += length
        self._seq = seq
        # write_seq first: a writer killed between the two stores leaves it one
        # ahead, so the next writer skips a seq (allowed at an epoch change)
        # instead of reusing one.
        self._seq_w.value = seq
        self._cursor_w.value = self._cursor  # the commit point: one aligned 8-byte store
        return seq

    def _pad(self, off: int) -> None:
        length = self.capacity - off
        seq = self._seq + 1
        # PAD has no payload; its CRC covers the 28 header bytes only.
        hdr = bytearray(_FRONT + RECORD_HEADER_SIZE)
        crc = self._crc(np.frombuffer(hdr, dtype=np.uint8), length, TYPE_PAD, seq, 0)
        RECORD_HEADER.pack_into(self._mm, HEADER_SIZE + off, length, TYPE_PAD, 0, seq, self.epoch, 0, crc)
        self._cursor += length
        self._seq = seq
        self._seq_w.value = seq
        self._cursor_w.value = self._cursor

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Unmap the ring (the file stays; the supervisor owns it)."""
        if self._mm is None:
            return
        # ctypes views and the memoryview export the mmap's buffer; drop them first.
        del self._cursor_w, self._seq_w, self._epoch_w, self._req_w, self._ack_w
        self._data.release()
        self._data = None
        self._mm.close()
        self._mm = None
        os.close(self._fd)

    def __enter__(self) -> "RingWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
