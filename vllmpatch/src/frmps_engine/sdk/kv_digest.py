"""KV digests: what the KV cache held for each handed-over or adopted request, per
token, so that a run can be checked for the one invariant token-exact takeovers
rest on: **a token's KV is a function of the tokens up to it** (under ``--exact``:
batch-invariant kernels compute it alike in any batch, any chunk, any engine).

``FRMPS_DEBUG_KV_DIGESTS=<dir>`` (a diagnostic, off by default; the SDK README's
table): every engine appends one JSON line to ``<dir>/kv-<pid>.jsonl``

- ``handover-out``: a planned handover's active, for each request it hands over,
  right after its last publish (the KV the next engine will adopt, as it left it);
- ``adopt``: a takeover's engine (after a fault or a handover), for each request
  it adopted with KV, once the KV flip is done and the negative controls (if any)
  have been applied, before its first step touches the KV cache;
- ``prompt``: any engine, for each request it serves, after the step that
  completes (commits) the request's prompt KV, whether computed there or read from
  the prefix cache: the engine that computed a prefix and every engine that reads
  it again each leave a line, so a prefix-cache block that holds another KV than
  its tokens give is found where it is read.

A line holds the request's key, the number of tokens whose KV it covers, and per
block of ``block_size`` tokens a chained hash of the block's tokens (the prefix up
to the block's end, as vLLM's prefix cache hashes it, with the block's token count)
and a digest of the block's KV (every layer, K and V); the last block also per
token. ``bench/kv_digests.py`` compares them across every line of a run: two
blocks with the same chained token hash must have the same KV digest. A violation
names the request, the engine and the event where the KV differed: a block
overwritten between a handover and the adoption, an adopted block holding another
prefix's KV, or a computation that depends on its batch.

The digest per token is the engine's (``engine_api.KvDigests``): an int64 sum of
the KV's bytes, each weighted by a fixed pseudo-random factor, over every layer;
equal contents give equal digests, and a change of one byte changes it except with
probability ~2^-64. Costs a gather of the blocks and a reduction on the device at
each takeover and handover: the figures of a run with it are not the product's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import time
from typing import Any, Callable, Iterable, Protocol, Sequence, runtime_checkable

log = logging.getLogger(__name__)

ENV = "FRMPS_DEBUG_KV_DIGESTS"
MASK64 = (1 << 64) - 1


@runtime_checkable
class KvDigests(Protocol):
    """``kv_token_digests(block_ids, n)``: one int64 per token for the first ``n``
    tokens stored in ``block_ids`` (in order, ``block_size`` tokens a block), each
    a digest of that token's KV in every layer, K and V. Runs on the loop's thread
    (or before the loop starts); may synchronise the device."""

    def kv_token_digests(self, block_ids: Sequence[int], n: int) -> list[int]: ...


def _link(prev: bytes, tokens: Sequence[int]) -> bytes:
    """One link of the chain: a hash of the previous link, the tokens and their count."""
    h = hashlib.blake2b(prev, digest_size=8)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    h.update(struct.pack("<q", len(tokens)))
    return h.digest()


def token_chain(token_ids: Sequence[int], n: int, block_size: int) -> list[str]:
    """Per block of the first ``n`` tokens: a hash of every token up to the block's
    end and of the block's token count (so a partial block never matches a full
    one), chained as vLLM's prefix-cache hashes are. 16 hex digits each."""
    out: list[str] = []
    prev = b""
    for start in range(0, n, block_size):
        prev = _link(prev, token_ids[start:min(n, start + block_size)])
        out.append(prev.hex())
    return out


def tail_chain(token_ids: Sequence[int], n: int, block_size: int, prev: str = "") -> list[str]:
    """token_chain's hash of the last block for each of its first m tokens, m = 1..
    (so that a record whose last block holds fewer tokens can be compared with it)."""
    nb = -(-n // block_size)
    if not nb:
        return []
    start, p = (nb - 1) * block_size, bytes.fromhex(prev)
    return [_link(p, token_ids[start:end]).hex() for end in range(start + 1, n + 1)]


def block_digests(token_digests: Sequence[int], block_size: int) -> list[str]:
    """Per block: the sum (mod 2^64) of its tokens' digests, 16 hex digits."""
    out = []
    for start in range(0, len(token_digests), block_size):
        out.append(f"{sum(token_digests[start:start + block_size]) & MASK64:016x}")
    return out


def record(key: int, token_ids: Sequence[int], n: int, block_ids: Sequence[int], token_digests: Sequence[int],
           block_size: int, **extra: Any) -> dict:
    """One line's content (module docstring)."""
    if len(token_digests) != n:
        raise ValueError(f"{len(token_digests)} token digests for {n} tokens")
    nb = -(-n // block_size)
    tail = token_digests[(nb - 1) * block_size:] if nb else []
    chain = token_chain(token_ids, n, block_size)
    return dict(key=int(key), n=int(n), block_size=int(block_size), blocks=[int(b) for b in block_ids[:nb]],
                chain=chain, kv=block_digests(token_digests, block_size),
                tail_chain=tail_chain(token_ids, n, block_size, chain[-2] if nb > 1 else ""),
                tail=[f"{d & MASK64:016x}" for d in tail], **extra)


class Recorder:
    """Writes the lines of one engine process (``from_env``)."""

    def __init__(self, directory: str, block_size: int):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"kv-{os.getpid()}.jsonl")
        self.block_size = int(block_size)
        self._lock = threading.Lock()

    def write(self, core: Any, event: str, entries: Iterable[tuple[int, Sequence[int], int, Sequence[int]]],
              **extra: Any) -> int:
        """One line per (key, token_ids, n, block_ids) with n > 0; returns how many.
        A diagnostic: it never fails the handover or takeover that calls it, but for
        a device error (the engine is lost); a core without ``KvDigests``, or any other
        failure, writes nothing and says so in the log."""
        if not isinstance(core, KvDigests):
            log.warning("%s: the engine's core cannot digest its KV cache; nothing recorded", ENV)
            return 0
        bs, t = self.block_size, time.time()
        lines = []
        try:
            for key, token_ids, n, block_ids in entries:
                n = min(int(n), len(token_ids), len(block_ids) * bs)
                if n <= 0:
                    continue
                nb = -(-n // bs)
                digests = core.kv_token_digests(list(block_ids[:nb]), n)
                lines.append(json.dumps(record(key, token_ids, n, block_ids, digests, bs, event=event, pid=os.getpid(),
                                               t=t, **extra), separators=(",", ":")))
            if lines:
                with self._lock, open(self.path, "a", encoding="utf-8") as f:
                    f.write("\n".join(lines) + "\n")
        except Exception as e:  # noqa: BLE001 - a diagnostic must not cost the engine its handover or takeover
            from .loop import is_device_error

            if is_device_error(e):
                raise
            log.warning("%s: the %s KV digests failed: %s", ENV, event, e)
            return 0
        return len(lines)

    def prompts(self, core: Any) -> Callable[[], None]:
        """The ``prompt`` event (module docstring), as a hook for after each step on the
        loop's thread: each request once, when its committed tokens first cover its
        prompt. Remembers only the keys still in the core's views."""
        done: set[int] = set()

        def after_step() -> None:
            entries, live = [], set()
            for v in core.request_views():
                live.add(v.key)
                if v.key in done or v.finished or v.num_computed < v.num_prompt:
                    continue
                done.add(v.key)
                entries.append((v.key, v.token_ids, v.num_prompt, v.block_ids))
            done.intersection_update(live)
            if entries:
                self.write(core, "prompt", entries)

        return after_step


def from_env(block_size: int, env: dict | None = None) -> Recorder | None:
    d = (os.environ if env is None else env).get(ENV, "")
    return Recorder(d, block_size) if d else None


_WEIGHTS: dict[tuple[int, str], Any] = {}


def _weights(size: int, device: Any) -> Any:
    """The fixed pseudo-random byte weights (in [1, 2^31)), the same in every process."""
    import torch

    k = (size, str(device))
    w = _WEIGHTS.get(k)
    if w is None:
        g = torch.Generator().manual_seed(0x6B76)  # "kv"
        w = _WEIGHTS[k] = torch.randint(1, 1 << 31, (size,), generator=g, dtype=torch.int64).to(device)
    return w


def torch_token_digests(caches: Sequence[tuple[Any, int, int]], block_ids: Sequence[int], n: int,
                        block_size: int, chunk: int = 64) -> list[int]:
    """``KvDigests`` for tensors: ``caches`` are (tensor, block dim, slot dim) for every
    KV tensor of the engine (one per layer, or one for all); the digest of a token
    folds, tensor by tensor, the weighted sum of its slot's bytes. Blocks go through
    ``chunk`` at a time, so the scratch memory stays small."""
    import torch

    nb = -(-n // block_size)
    ids = [int(b) for b in block_ids[:nb]]
    if len(ids) < nb:
        raise ValueError(f"{n} tokens need {nb} blocks of {block_size}, got {len(ids)}")
    if not ids:
        return []
    out = []
    if caches[0][0].is_cuda:  # whatever wrote the KV on another stream is done
        torch.cuda.synchronize(caches[0][0].device)
    with torch.no_grad():
        for c0 in range(0, nb, chunk):
            part = ids[c0:c0 + chunk]
            idx: dict[Any, Any] = {}  # the chunk's block ids, once per device
            acc = None
            for t, bdim, sdim in caches:
                if t.device not in idx:
                    idx[t.device] = torch.tensor(part, dtype=torch.long, device=t.device)
                a = t.index_select(bdim, idx[t.device])
                a = a.movedim((bdim, sdim), (0, 1))
                a = a.contiguous().reshape(len(part), block_size, -1).view(torch.uint8).to(torch.int64)
                s = (a * _weights(a.shape[-1], a.device)).sum(-1)  # < 2^51 for any KV slot of today's models
                acc = s if acc is None else acc * 1_000_003 + s
            out.extend(acc.reshape(-1).tolist())
    return out[:n]
