"""The result store of `frmps bench`: one append-only, fsynced JSONL file per
experiment, a point identified by its key, resumable (done points are skipped,
failed ones retried up to a limit). Standard library only.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Iterable

SCHEMA = 1


def key_id(key: dict) -> str:
    """The canonical id of a point's key (sorted JSON)."""
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


class ResultFile:
    """``<out>/<experiment>.jsonl``: one JSON object per measured point, appended
    (and flushed to disk) as soon as it is measured. A point is identified by its
    key (a dict such as ``{"model": ..., "system": ..., "trial": 0}``); a re-run
    skips keys that already have an ok record and retries failed ones up to
    ``max_attempts`` in all. Every attempt stays in the file: a failure is never
    dropped, a later success just supersedes it in the summaries."""

    def __init__(self, out_dir: str, experiment: str, run_id: str, max_attempts: int = 2):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, f"{experiment}.jsonl")
        self.experiment = experiment
        self.run_id = run_id
        self.max_attempts = max(1, int(max_attempts))
        self._lock = threading.Lock()
        self.new_records: list[dict] = []

    def records(self) -> list[dict]:
        return load_records(self.path)

    def _by_key(self) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for r in self.records():
            out.setdefault(key_id(r["key"]), []).append(r)
        return out

    def status(self, key: dict) -> str:
        """"done" (an ok record exists), "failed" (attempts used up), "unsupported" (the
        newest record says the engine cannot run it) or "pending"."""
        return self._status(self._by_key().get(key_id(key), []))

    def _status(self, recs: list[dict]) -> str:
        if any(r.get("ok") for r in recs):
            return "done"
        tried = [r for r in recs if not r.get("unsupported")]
        if len(tried) >= self.max_attempts:
            return "failed"
        if recs and recs[-1].get("unsupported"):
            return "unsupported"
        return "pending"

    def attempts(self, key: dict) -> int:
        return sum(1 for r in self._by_key().get(key_id(key), []) if not r.get("unsupported"))

    def pending(self, keys: Iterable[dict]) -> list[dict]:
        """Keys to measure in this run: not done, attempts left. Unsupported ones are
        included (the capability is checked again, which is cheap)."""
        by = self._by_key()
        return [k for k in keys if self._status(by.get(key_id(k), [])) in ("pending", "unsupported")]

    def add(self, key: dict, data: dict | None, error: str | None, elapsed_s: float, unsupported: bool = False) -> dict:
        rec = {"schema": SCHEMA, "experiment": self.experiment, "key": key, "ok": error is None, "error": error,
               "run_id": self.run_id, "t": round(time.time(), 3), "elapsed_s": round(elapsed_s, 3), "data": data or {}}
        if unsupported:
            rec["unsupported"] = True
        line = json.dumps(rec, sort_keys=True, default=_json_default)
        with self._lock:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.new_records.append(rec)
        return rec


def _json_default(o: Any):
    if isinstance(o, (set, tuple)):
        return list(o)
    if hasattr(o, "item"):  # numpy scalars
        return o.item()
    return str(o)


def load_records(path: str) -> list[dict]:
    """Every record of a JSONL result file; a torn last line (a run killed while
    writing) is skipped, not fatal."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        pass
    return out


def latest_ok(records: list[dict]) -> list[dict]:
    """Per key, the newest ok record, else the newest record (an error), in file order of first appearance."""
    order: list[str] = []
    best: dict[str, dict] = {}
    for r in records:
        k = key_id(r["key"])
        if k not in best:
            order.append(k)
            best[k] = r
        elif r.get("ok") or not best[k].get("ok"):
            best[k] = r
    return [best[k] for k in order]


def write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)
