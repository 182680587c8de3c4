"""CRC-32C (Castagnoli) for the ring writer.

The compiled ``crc32c`` package (hardware CRC instruction) is used when it is
importable. Otherwise a numpy implementation that needs no compiler: CRC is
linear over GF(2), so the CRC of a message is the XOR of one table entry per
byte, looked up by (distance to the end of its chunk, byte value). That is one
vectorised gather and one XOR-reduction per chunk of ``_CHUNK`` bytes, then the
per-chunk values are folded in groups of ``_GROUP`` with tables for "append
S zero bytes" (S = chunk size at that level), level after level.

Both paths compute the standard CRC-32C (init and final XOR 0xFFFFFFFF); the
test suite checks them against a bitwise reference.
"""

from __future__ import annotations

import threading

import numpy as np

try:  # pragma: no cover - depends on the environment
    import crc32c as _hw  # type: ignore[import-not-found]

    _hw_crc = _hw.crc32c
except ImportError:  # pragma: no cover
    _hw_crc = None

POLY = 0x82F63B78  # reflected Castagnoli polynomial
_CHUNK = 64
_GROUP = 16


def _byte_table() -> np.ndarray:
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ np.uint32(POLY), t >> 1).astype(np.uint32)
    return t


_T = _byte_table()


def _shift_bytes(v: np.ndarray, nbytes: int) -> np.ndarray:
    """Register values v followed by nbytes zero bytes (linear part)."""
    for _ in range(nbytes):
        v = _T[v & 0xFF] ^ (v >> 8)
    return v


def _mat_of_shift(nbytes: int) -> np.ndarray:
    """The 32x32 GF(2) matrix of 'append nbytes zero bytes', as 32 column words."""
    cols = np.array([1 << i for i in range(32)], dtype=np.uint32)
    return _shift_bytes(cols, nbytes)


def _mat_apply(m: np.ndarray, v: np.ndarray) -> np.ndarray:
    out = np.zeros_like(v)
    for i in range(32):
        out ^= np.where((v >> np.uint32(i)) & 1, m[i], np.uint32(0)).astype(np.uint32)
    return out


def _mat_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The matrix of 'a after b' (b's columns mapped through a)."""
    return _mat_apply(a, b)


# Level 1: entry (d, b) = CRC contribution of byte b followed by d zero bytes.
_F = np.empty((_CHUNK, 256), dtype=np.uint32)
_F[0] = _T
for _d in range(1, _CHUNK):
    _F[_d] = _T[_F[_d - 1] & 0xFF] ^ (_F[_d - 1] >> 8)
_F_FLAT = _F.ravel()


class _Level:
    """Folds groups of _GROUP values, each the CRC of a chunk of `span` bytes.
    `shift` is the matrix of appending `span` zero bytes."""

    def __init__(self, span: int, shift: np.ndarray) -> None:
        self.span = span
        self.shift = shift
        # Value i of a group is followed by (_GROUP-1-i) chunks; byte j of a
        # register value is the low byte of (v >> 8j).
        tabs = np.empty((_GROUP, 4, 256), dtype=np.uint32)
        vals = np.arange(256, dtype=np.uint32)
        m = np.array([1 << i for i in range(32)], dtype=np.uint32)  # identity
        for i in range(_GROUP - 1, -1, -1):
            for j in range(4):
                tabs[i, j] = _mat_apply(m, vals << np.uint32(8 * j))
            m = _mat_mul(shift, m)
        self.flat = tabs.ravel()
        self.base = np.arange(_GROUP * 4, dtype=np.intp) * 256
        self.next_shift = m  # _GROUP chunks of zeros: the next level's span


_levels: list[_Level] = []
_levels_lock = threading.Lock()
_idx_cache: dict[int, np.ndarray] = {}
_SLICE_CHUNKS = 1 << 12  # level-1 work per numpy call: 256 KiB of message


def _level(i: int) -> _Level:
    if i < len(_levels):
        return _levels[i]
    with _levels_lock:
        while len(_levels) <= i:
            if not _levels:
                _levels.append(_Level(_CHUNK, _mat_of_shift(_CHUNK)))
            else:
                prev = _levels[-1]
                _levels.append(_Level(prev.span * _GROUP, prev.next_shift))
        return _levels[i]


def _base1(k: int) -> np.ndarray:
    """Level-1 index bases for k chunks (cached by power-of-two size)."""
    size = 1 << max(k - 1, 0).bit_length()
    b = _idx_cache.get(size)
    if b is None:
        b = np.tile(np.arange(_CHUNK - 1, -1, -1, dtype=np.intp) * 256, size)
        _idx_cache[size] = b
    return b[: k * _CHUNK]


def crc32c_linear_np(window: np.ndarray) -> int:
    """Linear (zero-init, no final XOR) CRC-32C of a uint8 array whose length is
    a multiple of _CHUNK. Leading zero bytes do not change the result."""
    k = window.size // _CHUNK
    if k <= _SLICE_CHUNKS:
        vals = np.take(_F_FLAT, _base1(k) + window)
        r = np.bitwise_xor.reduce(vals.reshape(k, _CHUNK), axis=1)
    else:  # bound the temporary index arrays for large records
        r = np.empty(k, dtype=np.uint32)
        base = _base1(_SLICE_CHUNKS)
        for c0 in range(0, k, _SLICE_CHUNKS):
            c1 = min(k, c0 + _SLICE_CHUNKS)
            part = window[c0 * _CHUNK : c1 * _CHUNK]
            vals = np.take(_F_FLAT, base[: part.size] + part)
            r[c0:c1] = np.bitwise_xor.reduce(vals.reshape(c1 - c0, _CHUNK), axis=1)
    lvl = 0
    while r.size > 1:
        L = _level(lvl)
        if r.size <= _GROUP:  # one partial group: use the tail of the table
            by = r.view(np.uint8)
            return int(np.bitwise_xor.reduce(np.take(L.flat, L.base[(_GROUP - r.size) * 4 :] + by)))
        g = -(-r.size // _GROUP)
        if g * _GROUP != r.size:  # leading zero chunks keep the value
            r = np.concatenate((np.zeros(g * _GROUP - r.size, dtype=np.uint32), r))
        by = r.view(np.uint8).reshape(g, _GROUP * 4)
        v = np.take(L.flat, L.base + by)
        r = np.bitwise_xor.reduce(v, axis=1)
        lvl += 1
    return int(r[0])


def crc32c_np(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """Standard CRC-32C of data with the numpy path."""
    a = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8).ravel()
    n = a.size
    if n < 4:
        return crc32c_ref(a.tobytes())
    k = -(-n // _CHUNK)
    buf = np.zeros(k * _CHUNK, dtype=np.uint8)
    buf[buf.size - n :] = a
    # Starting from 0xFFFFFFFF equals XOR-ing it into the first four message
    # bytes and starting from 0.
    buf[buf.size - n : buf.size - n + 4] ^= 0xFF
    return crc32c_linear_np(buf) ^ 0xFFFFFFFF


def crc32c_ref(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """Bitwise reference (slow), for tests."""
    crc ^= 0xFFFFFFFF
    for x in bytes(data):
        crc ^= x
        for _ in range(8):
            crc = (crc >> 1) ^ (POLY if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


HAVE_HW = _hw_crc is not None


def crc32c(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    if _hw_crc is not None:
        return _hw_crc(data)
    return crc32c_np(data)
