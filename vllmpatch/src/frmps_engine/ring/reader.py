"""A Python ring reader, for tests and supervisor-less tools.

The supervisor's reader is the Go one (ringbuf/); this one follows the same
algorithm (FORMAT.md, "Reader algorithm") so the test vectors written by the
Go writer can be decoded here, and so tools can inspect a ring.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass, field

import numpy as np

from ._crc32c import crc32c
from .layout import (
    FLAG_ABORTED,
    FLAG_FINISHED,
    FLAG_RESET,
    FLAGS_KNOWN,
    HEADER_SIZE,
    OFF_READER_CURSOR,
    OFF_RESYNC_REQUEST,
    OFF_WRITE_CURSOR,
    OFF_WRITE_SEQ,
    PAYLOAD_FIXED,
    PAYLOAD_HEADER,
    RECORD_ALIGN,
    RECORD_HEADER,
    RECORD_HEADER_SIZE,
    REC_CRC_HEADER_BYTES,
    TYPE_DELTA,
    TYPE_FULL,
    TYPE_PAD,
    payload_len,
)
from .writer import RingError, validate_header


class ResyncNeeded(RingError):
    """The reader asked the writer for full state (overrun, corrupt or
    inconsistent record). Not fatal: keep polling."""


@dataclass
class Entry:
    key: int
    seed: int
    num_computed: int
    num_prompt: int
    flags: int
    blocks: list[int]
    tokens: list[int]


@dataclass
class Record:
    seq: int
    type: int
    epoch: int
    step: int = 0
    entries: list[Entry] = field(default_factory=list)


@dataclass
class State:
    key: int
    seed: int
    num_prompt: int
    num_computed: int
    blocks: list[int]
    tokens: list[int]
    step: int


def decode_payload(p: bytes, full: bool) -> tuple[int, list[Entry]]:
    """Decode and check a DELTA/FULL payload; returns (step, entries)."""
    if len(p) < PAYLOAD_FIXED:
        raise RingError(f"corrupt record: payload of {len(p)} bytes")
    n, reserved, step = PAYLOAD_HEADER.unpack_from(p, 0)
    if reserved:
        raise RingError("corrupt record: reserved payload word is not 0")
    if payload_len(n, 0, 0) > len(p):
        raise RingError(f"corrupt record: {n} entries do not fit in {len(p)} bytes")
    o = PAYLOAD_FIXED
    u64 = np.frombuffer(p, dtype="<u8", count=2 * n, offset=o)
    u32 = np.frombuffer(p, dtype="<u4", count=5 * n, offset=o + 16 * n)
    keys, seeds = u64[:n], u64[n:]
    nc, npr, fl, nb, nt = (u32[i * n : (i + 1) * n] for i in range(5))
    sb, st = int(nb.sum(dtype=np.uint64)), int(nt.sum(dtype=np.uint64))
    if payload_len(n, sb, st) != len(p):
        raise RingError(f"corrupt record: payload_len {len(p)}, columns need {payload_len(n, sb, st)}")
    if np.any(fl & ~np.uint32(FLAGS_KNOWN)):
        raise RingError("corrupt record: unknown entry flags")
    if full and n and not np.all(fl & FLAG_RESET):
        raise RingError("corrupt record: FULL entry without RESET")
    tail = np.frombuffer(p, dtype="<u4", count=sb + st, offset=o + 36 * n)
    blocks, tokens = tail[:sb].tolist(), tail[sb:].tolist()
    out = []
    bo = to = 0
    for i in range(n):
        b, t = int(nb[i]), int(nt[i])
        out.append(
            Entry(int(keys[i]), int(seeds[i]), int(nc[i]), int(npr[i]), int(fl[i]), blocks[bo : bo + b], tokens[to : to + t])
        )
        bo += b
        to += t
    return step, out


class RingReader:
    """Reads a ring into ``self.snapshot`` (key -> State).

    ``start=None`` starts like the supervisor: at the current write position,
    requesting a resync. ``start=<pos>`` reads from a known record boundary
    (test vectors).
    """

    def __init__(self, path: str, start: int | None = None) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            self.capacity = validate_header(os.pread(fd, HEADER_SIZE, 0), size)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.snapshot: dict[int, State] = {}
        self.stale = True
        self.epoch = 0
        self.next_seq = 0
        self.seq_epoch = 0
        self.resyncs = 0
        self.records: list[Record] = []  # every record read (PAD included), for tests
        if start is None:
            self._request_resync()
        else:
            self.pos = start

    def _u64(self, off: int) -> int:
        # One aligned 8-byte load, like the Go reader's atomic load (x86-64).
        return ctypes.c_uint64.from_buffer(self._mm, off).value

    def _request_resync(self) -> None:
        req = self._u64(OFF_RESYNC_REQUEST) + 1
        self._mm[OFF_RESYNC_REQUEST : OFF_RESYNC_REQUEST + 8] = req.to_bytes(8, "little")
        self.resyncs += 1
        self.pos = self._u64(OFF_WRITE_CURSOR)
        self.next_seq = 0
        self.stale = True

    def write_seq(self) -> int:
        return self._u64(OFF_WRITE_SEQ)

    def _resync(self, why: str) -> ResyncNeeded:
        self._request_resync()
        return ResyncNeeded(why)

    def poll(self) -> int:
        """Consume every committed record; returns the number applied.
        Raises ResyncNeeded after requesting a resync."""
        cap = self.capacity
        applied = 0
        try:
            while True:
                wc = self._u64(OFF_WRITE_CURSOR)
                if wc == self.pos:
                    return applied
                if wc < self.pos or wc - self.pos > cap:
                    raise self._resync(f"overrun: write cursor {wc}, reader at {self.pos}")
                if self.pos % RECORD_ALIGN:
                    raise self._resync(f"corrupt: misaligned position {self.pos}")
                off = self.pos % cap
                base = HEADER_SIZE + off
                hdr = bytes(self._mm[base : base + RECORD_HEADER_SIZE])
                length, typ, flags, seq, epoch, plen, crc = RECORD_HEADER.unpack(hdr)
                err = _framing_error(length, typ, flags, seq, plen, off, wc - self.pos, cap)
                payload = b"" if err else bytes(self._mm[base + RECORD_HEADER_SIZE : base + RECORD_HEADER_SIZE + plen])
                wc2 = self._u64(OFF_WRITE_CURSOR)
                if wc2 < self.pos or wc2 - self.pos > cap // 2:
                    raise self._resync(f"overrun: writer lapped the reader while it copied seq {seq}")
                if err:
                    raise self._resync(f"corrupt record at {self.pos}: {err}")
                if crc32c(hdr[:REC_CRC_HEADER_BYTES] + payload) != crc:
                    raise self._resync(f"corrupt record at {self.pos}: crc mismatch (seq {seq})")
                # seq is contiguous within an epoch; a new writer may skip ahead.
                if self.next_seq and seq != self.next_seq and (epoch <= self.seq_epoch or seq < self.next_seq):
                    raise self._resync(f"corrupt record at {self.pos}: seq {seq}, expected {self.next_seq}")
                rec = Record(seq, typ, epoch)
                if typ != TYPE_PAD:
                    if epoch < self.epoch:
                        raise self._resync(f"corrupt: seq {seq} from epoch {epoch} after epoch {self.epoch}")
                    new_epoch = self.epoch != 0 and epoch > self.epoch
                    self.epoch = epoch
                    if new_epoch and typ == TYPE_DELTA and not self.stale:
                        raise self._resync(f"inconsistent: epoch {epoch} starts with a DELTA")
                    try:
                        rec.step, rec.entries = decode_payload(payload, typ == TYPE_FULL)
                        if self._apply(rec):
                            applied += 1
                    except ResyncNeeded:
                        raise
                    except RingError as e:
                        raise self._resync(f"seq {seq}: {e}") from None
                self.records.append(rec)
                self.pos += length
                self.next_seq = seq + 1
                self.seq_epoch = epoch
        finally:
            self._mm[OFF_READER_CURSOR : OFF_READER_CURSOR + 8] = self.pos.to_bytes(8, "little")

    def _apply(self, rec: Record) -> bool:
        if rec.type == TYPE_FULL:
            table: dict[int, State] = {}
            for e in rec.entries:
                if e.key in table:
                    raise RingError(f"inconsistent: key {e.key} twice in a FULL record")
                s = _reset_state(e, rec.step)
                if not e.flags & (FLAG_FINISHED | FLAG_ABORTED):
                    table[e.key] = s
            self.snapshot = table
            self.stale = False
            return True
        if self.stale:
            return False
        for e in rec.entries:
            if e.flags & FLAG_RESET:
                self.snapshot[e.key] = _reset_state(e, rec.step)
            else:
                s = self.snapshot.get(e.key)
                if s is None:
                    raise RingError(f"inconsistent: delta for unknown key {e.key}")
                if e.num_prompt or e.num_computed > len(s.tokens) + len(e.tokens):
                    raise RingError(f"inconsistent: key {e.key}: bad delta counts")
                s.blocks.extend(e.blocks)
                s.tokens.extend(e.tokens)
                s.num_computed = e.num_computed
                s.seed = e.seed
                s.step = rec.step
            if e.flags & (FLAG_FINISHED | FLAG_ABORTED):
                self.snapshot.pop(e.key, None)
        return True

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None


def _reset_state(e: Entry, step: int) -> State:
    if e.num_prompt > len(e.tokens) or e.num_computed > len(e.tokens):
        raise RingError(f"inconsistent: key {e.key}: num_prompt/num_computed exceed {len(e.tokens)} tokens")
    return State(e.key, e.seed, e.num_prompt, e.num_computed, list(e.blocks), list(e.tokens), step)


def _framing_error(length, typ, flags, seq, plen, off, avail, cap) -> str:
    if length < RECORD_HEADER_SIZE or length % RECORD_ALIGN:
        return f"length {length} is not a positive multiple of {RECORD_ALIGN}"
    if length > avail:
        return f"length {length} exceeds the {avail} committed bytes"
    if length > cap // 2:
        return f"length {length} exceeds capacity/2"
    if off + length > cap:
        return f"length {length} at offset {off} crosses the end of the data region"
    if plen > length - RECORD_HEADER_SIZE:
        return f"payload_len {plen} does not fit in length {length}"
    if flags:
        return f"record flags {flags:#x}"
    if seq == 0:
        return "seq 0"
    if typ in (TYPE_DELTA, TYPE_FULL):
        if plen < PAYLOAD_FIXED:
            return f"payload_len {plen} is shorter than the payload header"
    elif typ == TYPE_PAD:
        if plen or off + length != cap:
            return "PAD does not end the data region"
    else:
        return f"unknown record type {typ}"
    return ""
