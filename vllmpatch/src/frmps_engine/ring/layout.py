"""Offsets and constants of the forward-state ring, version 1.

ringbuf/FORMAT.md is the specification; this module is the only place the
Python side spells out its layout (the Go side has ringbuf/layout.go).
"""

from __future__ import annotations

import struct

MAGIC = b"FRMPSRNG"
VERSION = 1
HEADER_SIZE = 4096
MIN_CAPACITY = 4096
MAX_CAPACITY = 1 << 34

# File header.
OFF_MAGIC = 0
OFF_VERSION = 8
OFF_HEADER_SIZE = 12
OFF_CAPACITY = 16
OFF_EPOCH = 24
OFF_FLAGS = 32
OFF_WRITE_CURSOR = 64
OFF_WRITE_SEQ = 72
OFF_RESYNC_REQUEST = 128
OFF_RESYNC_ACK = 136
OFF_READER_CURSOR = 192

# magic, version, header_size, capacity, epoch, flags
FILE_HEADER = struct.Struct("<8sIIQQI")

# Records.
RECORD_ALIGN = 32
RECORD_HEADER_SIZE = 32
TYPE_DELTA = 1
TYPE_FULL = 2
TYPE_PAD = 3
# length u32, type u16, flags u16, seq u64, epoch u64, payload_len u32, crc32c u32
RECORD_HEADER = struct.Struct("<IHHQQII")
# The same without the CRC field: the header bytes the CRC covers.
RECORD_HEADER_NO_CRC = struct.Struct("<IHHQQI")
REC_OFF_CRC = 28
REC_CRC_HEADER_BYTES = 28  # the CRC covers header bytes [0, 28) then the payload

# Payload of DELTA and FULL records (columnar): n u32, reserved u32, step u64,
# then keys u64*n, seeds u64*n, num_computed, num_prompt, flags, n_blocks,
# n_tokens u32*n, blocks u32*sum(n_blocks), tokens u32*sum(n_tokens).
PAYLOAD_HEADER = struct.Struct("<IIQ")
PAYLOAD_FIXED = 16
PAYLOAD_PER_ENTRY = 8 + 8 + 4 * 5

FLAG_RESET = 1 << 0
FLAG_FINISHED = 1 << 1
FLAG_ABORTED = 1 << 2
FLAGS_KNOWN = FLAG_RESET | FLAG_FINISHED | FLAG_ABORTED


def payload_len(n: int, sum_blocks: int, sum_tokens: int) -> int:
    return PAYLOAD_FIXED + PAYLOAD_PER_ENTRY * n + 4 * sum_blocks + 4 * sum_tokens


def ring_capacity_needed(record_bytes: int, header_bytes: int = 64) -> int:
    """The smallest power-of-two ring whose quarter (the largest record the
    tracker writes, ring/tracker.py) holds a payload of ``record_bytes``."""
    need = 4 * (record_bytes + header_bytes)
    return 1 << (need - 1).bit_length()


def align_up(n: int) -> int:
    return (n + RECORD_ALIGN - 1) & ~(RECORD_ALIGN - 1)


def valid_capacity(capacity: int) -> bool:
    return MIN_CAPACITY <= capacity <= MAX_CAPACITY and capacity & (capacity - 1) == 0
