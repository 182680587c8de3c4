"""How long a takeover waited for the MPS server, per kind of fault, over the soaks in bench/results.

Every failover waits for the MPS server to tear the faulted client down before the standby may
write the KV cache (its KV flip, or with the device gate its first step's device work). The soaks
(bench/gpu/failback_proof.py, tp_proof.py) fault the active with the seven bench/faults triggers
in turn and record, per fault, the KV flip (`takeover.kv_writable_ms`), the server's own teardown
(`mps_teardown.teardown_ms`: "to be torn down" -> the client's exit, in the server's log) and the
detection -> first resumed token. This groups them by the trigger's program. A soak's first fault
is left out (and counted apart): on a GPU that has not faulted since the machine started it takes
the server ~330 ms whatever the kind (bench/results/2026-11-27-h200x2-fault-path/).

    python3 bench/teardown_by_fault.py                       # every soak under bench/results
    python3 bench/teardown_by_fault.py --dirs '*h100*' --json out.json
    python3 bench/teardown_by_fault.py soak.json [...]       # these soak files only

Standard library only.
"""
from __future__ import annotations

import argparse
import fnmatch
import glob
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def soak_faults(path: str) -> list[dict]:
    """The per-fault records of one soak file (none if it is not a soak's JSON)."""
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return []
    faults = d.get("faults") if isinstance(d, dict) else None
    if not isinstance(faults, list):
        return []
    return [c for c in faults if isinstance(c, dict) and c.get("fault") and c.get("n")]


BASE = "shared_oob"  # the paired comparison's reference kind: the fastest teardown, in every soak that has it


def collect(results: str, dirs: list[str], paths: list[str] | None = None
            ) -> tuple[dict[str, dict[str, list[float]]], int, list[str]]:
    """{kind: {"flip_ms": [...], "teardown_ms": [...], "first_token_ms": [...], "paired_ms": [...]}},
    first faults left out, and the files read. "paired_ms": per soak, the kind's median detection
    -> first resumed token minus the same soak's median for shared_oob faults (same model, engine,
    code and machine), one value per soak that has both."""
    by: dict[str, dict[str, list[float]]] = {}
    firsts, files = 0, []
    for path in paths or sorted(glob.glob(os.path.join(results, "*", "*.json"))):
        d = os.path.basename(os.path.dirname(os.path.abspath(path)))
        if dirs and not any(fnmatch.fnmatch(d, pat) for pat in dirs):
            continue
        faults = soak_faults(path)
        if not faults:
            continue
        files.append(os.path.relpath(path, results))
        per_soak: dict[str, list[float]] = {}
        for c in faults:
            if c["n"] == 1:
                firsts += 1
                continue
            kind = str(c["fault"]).partition(":")[0]
            row = by.setdefault(kind, {"flip_ms": [], "teardown_ms": [], "first_token_ms": [], "paired_ms": []})
            flip = (c.get("takeover") or {}).get("kv_writable_ms")
            td = (c.get("mps_teardown") or {}).get("teardown_ms")
            ft = c.get("detect_to_first_resumed_token_s")
            if flip is not None:
                row["flip_ms"].append(float(flip))
            if td is not None:
                row["teardown_ms"].append(float(td))
            if ft is not None:
                row["first_token_ms"].append(float(ft) * 1000)
                per_soak.setdefault(kind, []).append(float(ft) * 1000)
        if BASE in per_soak:
            base = statistics.median(per_soak[BASE])
            for kind, xs in per_soak.items():
                if kind != BASE:
                    by[kind]["paired_ms"].append(statistics.median(xs) - base)
    return by, firsts, files


def summarize(by: dict[str, dict[str, list[float]]]) -> dict[str, dict]:
    out = {}
    for kind, row in by.items():
        s: dict = {}
        for name, xs in row.items():
            if xs:
                s[name] = {"n": len(xs), "median": round(statistics.median(xs), 1), "p10": round(quantile(xs, 0.1), 1),
                           "p90": round(quantile(xs, 0.9), 1), "over_20ms": round(sum(x > 20 for x in xs) / len(xs), 2)}
        out[kind] = s
    return dict(sorted(out.items(), key=lambda kv: -(kv[1].get("flip_ms") or {}).get("median", 0)))


def table(s: dict[str, dict]) -> str:
    def cell(v: dict | None) -> str:
        return f"{v['median']} ({v['p10']}–{v['p90']}), n {v['n']}" if v else "–"

    out = ["| fault (program) | KV flip, ms: median (p10–p90), n | share of flips > 20 ms | MPS teardown, ms | "
           f"detection → first resumed token, ms | the same, minus the soak's `{BASE}` median, ms (n soaks) |",
           "|---|---|---|---|---|---|"]
    for kind, v in s.items():
        out.append(f"| `{kind}` | {cell(v.get('flip_ms'))} | {(v.get('flip_ms') or {}).get('over_20ms', '–')} | "
                   f"{cell(v.get('teardown_ms'))} | {cell(v.get('first_token_ms'))} | {cell(v.get('paired_ms'))} |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=os.path.join(HERE, "results"))
    p.add_argument("--dirs", action="append", default=[], help="only result folders matching this glob (repeatable)")
    p.add_argument("--json", default="", help="also write the summary here")
    p.add_argument("files", nargs="*", help="soak JSON files (default: every one under --results)")
    a = p.parse_args()
    by, firsts, files = collect(a.results, a.dirs, a.files)
    if not by:
        print("no soak with per-fault records found", file=sys.stderr)
        return 1
    s = summarize(by)
    print(table(s))
    print(f"\n{len(files)} soak files; {firsts} first faults of a soak left out.")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"dirs": a.dirs, "files": files, "first_faults_left_out": firsts, "by_fault": s}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
