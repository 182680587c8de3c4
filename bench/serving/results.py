"""Reading `vllm bench serve` results (the JSON its --save-result writes, with
--save-detailed's per-request lists) and aggregating trials: the median with
min and max, and the rule by which the report claims a difference: only when
the ranges of the trials do not overlap.

The keys are vLLM 0.26.0's (vllm/benchmarks/serve.py, ``benchmark`` and
``main_async``): duration, completed, failed, total_input_tokens,
total_output_tokens, request_throughput, request_goodput, output_throughput,
total_token_throughput, mean_/median_/std_/p<N>_{ttft,tpot,itl,e2el}_ms; and
with --save-detailed input_lens, output_lens, ttfts, itls, start_times,
generated_texts, errors (times in seconds, start_times from the client's
time.perf_counter()). Standard library only.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass

# The metrics a trial reports, as (key in a trial record, what it is, higher is better).
METRICS = [
    ("output_throughput", "output tok/s", True),
    ("total_token_throughput", "total tok/s", True),
    ("request_throughput", "req/s", True),
    ("request_goodput", "goodput req/s", True),
    ("slo_attainment", "SLO attainment", True),
    ("p50_ttft_ms", "p50 TTFT ms", False),
    ("p99_ttft_ms", "p99 TTFT ms", False),
    ("p50_tpot_ms", "p50 TPOT ms", False),
    ("p99_tpot_ms", "p99 TPOT ms", False),
    ("p50_itl_ms", "p50 ITL ms", False),
    ("p99_itl_ms", "p99 ITL ms", False),
    ("failed", "failed", False),
]
HIGHER_IS_BETTER = {k: h for k, _, h in METRICS}
MIN_TRIALS_FOR_CLAIM = 3


class ResultError(ValueError):
    """A result file that is not what `vllm bench serve` writes."""


REQUIRED = ["duration", "completed", "output_throughput", "total_token_throughput", "request_throughput"]


def load_bench_json(path: str) -> dict:
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ResultError(f"{path}: {e}") from e
    if not isinstance(raw, dict):
        raise ResultError(f"{path}: not a JSON object")
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise ResultError(f"{path}: no {', '.join(missing)}: not a `vllm bench serve --save-result` file")
    return raw


def request_rows(raw: dict) -> list[dict]:
    """Per request (--save-detailed): start (client perf_counter s), ttft (s), itls
    (s), output and input lengths, success (vLLM counts a request as failed when
    error. vLLM counts a request as completed when it received a first chunk: its
    error is then empty and its ttft set (a failed one may have an empty reason)."""
    starts = raw.get("start_times")
    if starts is None:
        return []
    n = len(starts)
    ttfts, itls = raw.get("ttfts") or [0.0] * n, raw.get("itls") or [[]] * n
    errors = raw.get("errors") or [""] * n
    outs, ins = raw.get("output_lens") or [0] * n, raw.get("input_lens") or [0] * n
    if not all(len(x) == n for x in (ttfts, itls, errors, outs, ins)):
        raise ResultError("per-request lists of different lengths")
    rows = []
    for i in range(n):
        ok = not errors[i] and float(ttfts[i] or 0.0) > 0
        rows.append({"start": float(starts[i]), "ttft": float(ttfts[i] or 0.0), "itls": [float(x) for x in itls[i] or []],
                     "output_len": int(outs[i] or 0), "input_len": int(ins[i] or 0), "success": ok,
                     "error": (errors[i] or "")[-300:]})
    return rows


def tpot_s(row: dict) -> float:
    """vLLM's TPOT of one request: (latency - ttft) / (output_len - 1), latency being
    ttft + the inter-token gaps; 0 for a one-token output (vLLM's goodput rule)."""
    if row["output_len"] <= 1:
        return 0.0
    return sum(row["itls"]) / (row["output_len"] - 1)


def good(row: dict, slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
    """A request that met both SLOs (vLLM's goodput: completed, ttft and tpot within)."""
    return row["success"] and row["ttft"] * 1e3 <= slo_ttft_ms and tpot_s(row) * 1e3 <= slo_tpot_ms


def longest_gap_s(row: dict) -> float:
    """The longest wait the request's stream saw: its first token, or a gap between tokens."""
    return max([row["ttft"]] + row["itls"]) if (row["ttft"] or row["itls"]) else 0.0


def trial_record(raw: dict, slo_ttft_ms: float, slo_tpot_ms: float, min_output_len: int = 0) -> dict:
    """One trial's figures from its result. slo_attainment: the share of the
    requests sent that met both SLOs (failed requests count as missed);
    truncated: requests vLLM counts as completed whose output is shorter than
    the dataset's shortest (with --ignore-eos, a stream cut by an error event)."""
    rec = {k: raw.get(k) for k in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                                   "request_throughput", "request_goodput", "output_throughput",
                                   "total_token_throughput", "max_concurrent_requests", "num_prompts",
                                   "request_rate")}
    for m in ("ttft", "tpot", "itl", "e2el"):
        for p in ("mean", "median", "p50", "p99"):
            rec[f"{p}_{m}_ms"] = raw.get(f"{p}_{m}_ms")
    rows = request_rows(raw)
    sent = len(rows) or int(raw.get("num_prompts") or 0) or (int(raw.get("completed") or 0) + int(raw.get("failed") or 0))
    rec["sent"] = sent
    if rows:
        n_good = sum(good(r, slo_ttft_ms, slo_tpot_ms) for r in rows)
        rec["good"] = n_good
        rec["slo_attainment"] = n_good / sent if sent else None
        rec["longest_gap_ms"] = round(max((longest_gap_s(r) for r in rows), default=0.0) * 1e3, 3)
        rec["truncated"] = sum(1 for r in rows if r["success"] and r["output_len"] < min_output_len)
        if rec.get("failed") is None:
            rec["failed"] = sum(1 for r in rows if not r["success"])
    elif raw.get("request_goodput") is not None and sent:
        rec["good"] = round(raw["request_goodput"] * raw["duration"])
        rec["slo_attainment"] = rec["good"] / sent
    else:
        rec["slo_attainment"] = None
    return rec


# ----------------------------------------------------------------------------- aggregation


@dataclass
class Spread:
    median: float | None
    lo: float | None
    hi: float | None
    n: int

    def to_json(self) -> dict:
        return {"median": self.median, "min": self.lo, "max": self.hi, "n": self.n}


def spread(values) -> Spread:
    v = [float(x) for x in values if x is not None]
    if not v:
        return Spread(None, None, None, 0)
    return Spread(statistics.median(v), min(v), max(v), len(v))


def compare(a: Spread, b: Spread, higher_is_better: bool) -> str:
    """a against b: 'better' or 'worse' only when their min–max ranges do not
    overlap and each has at least MIN_TRIALS_FOR_CLAIM trials; 'within spread'
    when they overlap; 'too few trials' otherwise."""
    if a.n < MIN_TRIALS_FOR_CLAIM or b.n < MIN_TRIALS_FOR_CLAIM:
        return "too few trials"
    if a.lo > b.hi:
        return "better" if higher_is_better else "worse"
    if a.hi < b.lo:
        return "worse" if higher_is_better else "better"
    return "within spread"


def aggregate(trials: list[dict]) -> dict:
    """Trials (records with system, kv_mode, rate and the metrics) grouped by
    (kv_mode, system, rate): a Spread per metric."""
    groups: dict[tuple, list[dict]] = {}
    for t in trials:
        if t.get("error"):
            continue
        groups.setdefault((t["kv_mode"], t["system"], t["rate"]), []).append(t)
    out: dict = {}
    for (kv, system, rate), ts in groups.items():
        cell = {k: spread(t.get(k) for t in ts).to_json() for k, _, _ in METRICS}
        cell["trials"] = len(ts)
        out.setdefault(kv, {}).setdefault(system, {})[rate] = cell
    return out


# The metrics of the paired table (report.py): what the targets name.
PAIRED_METRICS = ["output_throughput", "p50_tpot_ms", "p99_ttft_ms", "p50_itl_ms"]


def paired(trials: list[dict], baseline: str, metrics: list[str] = PAIRED_METRICS) -> list[dict]:
    """Each system against the baseline trial by trial: trial *i* of every system
    sends the same requests (the same seed), so the per-trial relative difference
    (system / baseline − 1) leaves out what the trials' different request sets do
    to both, which the min–max of each system's own trials includes. Per kv mode,
    rate, system and metric: the differences' spread, and ``sign``: "+" or "−"
    when every pair (at least MIN_TRIALS_FOR_CLAIM of them) differs the same way,
    else "". Pairs whose seeds disagree are not formed, nor any with a record
    that has no trial index."""
    groups: dict[tuple, dict[int, dict]] = {}  # (kv mode, system, rate) -> trial index -> record
    for t in trials:
        if not t.get("error") and t.get("trial") is not None:  # a record without its trial index pairs with none
            groups.setdefault((t["kv_mode"], t["system"], t["rate"]), {})[t["trial"]] = t
    out = []
    for (kv, system, rate), by_trial in sorted(groups.items(), key=lambda g: g[0]):
        base = groups.get((kv, baseline, rate))
        if system == baseline or not base:
            continue
        pairs = [(t, base[i]) for i, t in by_trial.items() if i in base and base[i].get("seed") == t.get("seed")]
        row: dict = {"kv_mode": kv, "system": system, "baseline": baseline, "rate": rate, "metrics": {}}
        for m in metrics:
            sp = spread(float(t[m]) / float(b[m]) - 1.0 for t, b in pairs if t.get(m) is not None and b.get(m))
            sign = ""
            if sp.n >= MIN_TRIALS_FOR_CLAIM and (sp.lo > 0 or sp.hi < 0):
                sign = "+" if sp.lo > 0 else "−"
            row["metrics"][m] = {**sp.to_json(), "sign": sign}
        if any(v["n"] for v in row["metrics"].values()):
            out.append(row)
    return out


def as_spread(cell: dict) -> Spread:
    return Spread(cell["median"], cell["min"], cell["max"], cell["n"])


def claims(agg: dict, baseline: str) -> list[dict]:
    """Every difference beyond the spread between a system and the baseline, per
    kv mode, rate and metric."""
    out = []
    for kv, systems in agg.items():
        base = systems.get(baseline)
        if not base:
            continue
        for system, rates in systems.items():
            if system == baseline:
                continue
            for rate, cell in rates.items():
                if rate not in base:
                    continue
                for key, _, hib in METRICS:
                    verdict = compare(as_spread(cell[key]), as_spread(base[rate][key]), hib)
                    if verdict in ("better", "worse"):
                        out.append({"kv_mode": kv, "system": system, "baseline": baseline, "rate": rate, "metric": key,
                                    "verdict": verdict, "system_median": cell[key]["median"],
                                    "baseline_median": base[rate][key]["median"]})
    return out
