"""The engines' KV digests, checked against the invariant token-exact takeovers rest on.

With FRMPS_DEBUG_KV_DIGESTS=<dir> (engine side: vllmpatch/src/frmps_engine/sdk/kv_digest.py)
every engine appends a JSON line per request it hands over (``handover-out``, after its last
publish), per request it adopts with KV (``adopt``, before its first step touches the KV) and
per request whose prompt it has computed or read from its prefix cache (``prompt``):
per block of tokens a chained hash of the tokens up to the block's end and a digest of the
block's KV. Under ``--exact`` a token's KV is a function of the tokens up to it, so two blocks
with the same chained token hash must have the same KV digest, whichever engine, event or
request holds them. A key with two digests is a violation: the lines that disagree with the
key's most frequent digest are listed, with their engine, event, request and block. The
last block of each line is also compared token by token (a line that covers fewer of its
tokens than another still meets it).

    python3 -m bench.kv_digests DIR_OR_TGZ [...] [--json OUT]

Exit status 1 when there is a violation, 2 when there is nothing to compare.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from bench import jsonl

MASK64 = (1 << 64) - 1


@dataclass
class Seen:
    digest: str
    event: str
    pid: int
    key: int
    block: int       # the block's index in the request
    block_id: int
    t: float


@dataclass
class Report:
    records: int = 0
    events: dict[str, int] = field(default_factory=dict)
    keys: int = 0                 # distinct (token prefix, count) keys seen
    compared: int = 0             # keys seen at least twice
    violations: list[dict] = field(default_factory=list)
    torn: int = 0                 # unreadable lines (a writer killed mid-line)

    @property
    def ok(self) -> bool:
        return not self.violations

    def line(self) -> str:
        ev = ", ".join(f"{k} {v}" for k, v in sorted(self.events.items()))
        head = (f"KV digests: {self.records} records ({ev}), {self.compared} of {self.keys} token-prefix keys seen "
                f"more than once, {len(self.violations)} with differing KV")
        return head + (f"; {self.torn} torn line(s) skipped" if self.torn else "")

    def as_dict(self) -> dict:
        return dict(ok=self.ok, records=self.records, events=self.events, keys=self.keys, compared=self.compared,
                    violations=self.violations, torn=self.torn, line=self.line())


def load(paths: Iterable[str]) -> tuple[list[dict], int]:
    """The records of every kv-*.jsonl under paths (folders, .tar.gz packs or files), and how
    many lines could not be read."""
    out, torn = [], 0
    for ln in (ln for _, lines in jsonl.files(paths, "kv-") for ln in lines):
        ln = ln.strip()
        if not ln:
            continue
        try:
            r = json.loads(ln)
            if not isinstance(r, dict) or "chain" not in r or "kv" not in r:
                raise ValueError("not a KV digest record")
        except ValueError:
            torn += 1
            continue
        out.append(r)
    return out, torn


def _observations(r: dict) -> Iterator[tuple[str, Seen]]:
    bs, n = int(r["block_size"]), int(r["n"])
    chain, kv, blocks = r["chain"], r["kv"], r.get("blocks", [])
    base = dict(event=r.get("event", "?"), pid=int(r.get("pid", 0)), key=int(r.get("key", 0)), t=float(r.get("t", 0)))
    for i, (c, d) in enumerate(zip(chain, kv)):
        yield c, Seen(d, block=i, block_id=int(blocks[i]) if i < len(blocks) else -1, **base)
    # the last block token by token: prefix sums of its per-token digests
    last = len(chain) - 1
    acc = 0
    for m, (c, d) in enumerate(zip(r.get("tail_chain", []), r.get("tail", []))):
        acc = (acc + int(d, 16)) & MASK64
        if m + 1 < n - last * bs:  # the whole last block is above already
            yield c, Seen(f"{acc:016x}", block=last, block_id=int(blocks[last]) if last < len(blocks) else -1, **base)


def check(records: list[dict], torn: int = 0, most: int = 20) -> Report:
    rep = Report(records=len(records), torn=torn)
    rep.events = dict(collections.Counter(r.get("event", "?") for r in records))
    seen: dict[str, list[Seen]] = collections.defaultdict(list)
    for r in sorted(records, key=lambda r: float(r.get("t", 0))):
        for k, s in _observations(r):
            seen[k].append(s)
    rep.keys = len(seen)
    rep.compared = sum(1 for v in seen.values() if len(v) > 1)
    for k, v in seen.items():
        counts = collections.Counter(s.digest for s in v)
        if len(counts) < 2:
            continue
        major, _ = counts.most_common(1)[0]
        first = v[0]
        rep.violations.append(dict(
            chain=k, digests=dict(counts), majority=major,
            first_seen=dict(event=first.event, pid=first.pid, key=first.key, block=first.block, t=first.t),
            differing=[dict(event=s.event, pid=s.pid, key=s.key, block=s.block, block_id=s.block_id, t=s.t)
                       for s in v if s.digest != major][:most]))
    rep.violations.sort(key=lambda x: min(d["t"] for d in x["differing"]))
    return rep


def differing_lines(rep: Report, most: int = 12) -> list[str]:
    """The first ``most`` differing blocks, each once (a block's whole-block key and its
    token-by-token keys name the same block), earliest first."""
    first: dict[tuple, tuple[dict, dict]] = {}  # (event, pid, request, block) -> its first (difference, violation)
    for v in rep.violations:
        for d in v["differing"]:
            first.setdefault((d["event"], d["pid"], d["key"], d["block"]), (d, v))
    return [f"  differs: {d['event']} pid {d['pid']} request {d['key']} block {d['block']} (id {d['block_id']}) "
            f"at {d['t']:.3f}; {len(v['digests'])} digests for this prefix, first seen {v['first_seen']}"
            for d, v in sorted(first.values(), key=lambda dv: dv[0]["t"])[:most]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="folders, .tar.gz packs or files of kv-*.jsonl")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    records, torn = load(args.paths)
    rep = check(records, torn)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rep.as_dict(), f, indent=1)
    print(rep.line())
    for line in differing_lines(rep):
        print(line)
    if not rep.compared:
        return 2
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
