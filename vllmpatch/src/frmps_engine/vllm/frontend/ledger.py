"""The resume ledger of vLLM's API server under frmps (``OPENAI.md``, design (a)).

The API server is the frontend; an engine process is the unit of failover. The
frontend therefore keeps, per request it sent to an engine, everything a standby
needs to continue it exactly where the frontend stopped: the request as sent, the
output token ids the frontend received, and the request's ring key and seed.

Plain logic over duck-typed vLLM objects (attributes used: ``EngineCoreRequest``'s
``request_id``, ``prompt_token_ids``, ``sampling_params`` (``seed``, ``n``,
``extra_args``); ``EngineCoreOutput``'s ``request_id``, ``new_token_ids``,
``finish_reason``), so it is tested without vLLM and holds for 0.26.0 and 0.33.0
alike.

- **Ids.** vLLM's frontend names requests itself; an engine under frmps names
  them ``frmps-<key>`` (``state.request_id_for_key``), the key being the
  request's ring key. ``admit`` renames each request on its way to the engine and
  ``record`` renames outputs back on their way in, so the rest of the frontend
  never sees the engine's names.
- **Seeds.** A request without a seed gets ``seeds.derive_seed(key)``: vLLM
  leaves it ``None`` (children of an unseeded ``n > 1`` request too), and the
  V2 runner would then pick a random one that no standby could know.
- **Delivered.** What the frontend received is what ``record`` saw: every
  output passes through it before vLLM's output processor, so the resume point
  of a request is exactly the frontend's, whatever the engine had computed.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable

from ...sdk.seeds import derive_seed, to_int64, to_uint64
from ..state import key_for_request_id, request_id_for_key

EXTRA_ARGS_KEY = "frmps_key"


class LedgerError(ValueError):
    """A request or output the ledger cannot account for."""


@dataclass
class Entry:
    """One open request: what a standby needs to continue it."""

    key: int
    frontend_id: str          # vLLM's own request id (the frontend's name)
    request: Any              # the EngineCoreRequest as sent (engine id, seed fixed)
    prompt_token_ids: list[int]
    seed: int                 # uint64 wire value (sdk/seeds.py)
    delivered: list[int] = field(default_factory=list)
    # Not sent yet: admitted while no engine was connected (client.py).
    held: bool = False

    @property
    def engine_id(self) -> str:
        return request_id_for_key(self.key)


class ResumeLedger:
    """Open requests and the output tokens the frontend has received for each.

    Thread-safe: vLLM's client calls ``admit`` from request handlers and
    ``record`` from its output task; the supervisor reads ``open_entries`` from
    another thread."""

    def __init__(self, first_key: int = 1):
        if first_key < 1:
            raise ValueError("ring keys start at 1")
        self._next_key = int(first_key)
        self._by_frontend: dict[str, Entry] = {}
        self._by_key: dict[int, Entry] = {}
        self._lock = threading.Lock()

    def admit(self, request: Any) -> Entry:
        """Give ``request`` a ring key, its engine id and a seed; record it.
        Mutates ``request`` (it is the object that is then sent)."""
        sp = request.sampling_params
        if sp is None:
            raise LedgerError(f"request {request.request_id}: frmps serves generation only (no sampling params)")
        if request.prompt_token_ids is None:
            raise LedgerError(f"request {request.request_id}: no prompt token ids (prompt embeddings cannot be resumed)")
        frontend_id = str(request.request_id)
        with self._lock:
            if frontend_id in self._by_frontend:
                raise LedgerError(f"request {frontend_id} is already open")
            key = self._next_key
            self._next_key += 1
            # A copy: vLLM shares one SamplingParams among the children of an
            # unseeded n > 1 request (parallel_sampling.py), and each child
            # needs its own seed.
            sp = copy.copy(sp)
            request.sampling_params = sp
            if sp.seed is None:
                sp.seed = to_int64(derive_seed(key))  # vLLM keeps seeds as int64
            extra = dict(sp.extra_args or {})
            extra[EXTRA_ARGS_KEY] = key
            sp.extra_args = extra
            entry = Entry(key=key, frontend_id=frontend_id, request=request,
                          prompt_token_ids=[int(t) for t in request.prompt_token_ids], seed=to_uint64(sp.seed))
            request.request_id = entry.engine_id
            self._by_frontend[frontend_id] = entry
            self._by_key[key] = entry
        return entry

    def record(self, outputs: Iterable[Any]) -> None:
        """Account for engine outputs as they reach the frontend: append their
        tokens, forget finished requests, and rename them to the frontend's ids.
        Outputs of requests the ledger does not know (already aborted) keep their
        name; vLLM's output processor ignores unknown ids."""
        with self._lock:
            for out in outputs:
                key = key_for_request_id(str(out.request_id))
                entry = self._by_key.get(key) if key is not None else None
                if entry is None:
                    continue
                entry.delivered.extend(int(t) for t in out.new_token_ids)
                out.request_id = entry.frontend_id
                if out.finish_reason is not None:
                    self._forget(entry)

    def abort(self, frontend_ids: Iterable[str]) -> list[str]:
        """Forget aborted requests; returns their engine ids, in order (unknown
        ids, e.g. requests that finished meanwhile, are skipped)."""
        out = []
        with self._lock:
            for fid in frontend_ids:
                entry = self._by_frontend.get(str(fid))
                if entry is not None:
                    out.append(entry.engine_id)
                    self._forget(entry)
        return out

    def open_entries(self) -> list[Entry]:
        """Every request sent and not finished or aborted, by key; the lists are
        copies (safe to read while outputs keep arriving)."""
        with self._lock:
            return [Entry(e.key, e.frontend_id, e.request, list(e.prompt_token_ids), e.seed, list(e.delivered), e.held)
                    for e in sorted(self._by_key.values(), key=lambda e: e.key)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_key)

    def _forget(self, entry: Entry) -> None:
        del self._by_key[entry.key]
        del self._by_frontend[entry.frontend_id]
