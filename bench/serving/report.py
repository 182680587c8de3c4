"""The results directory: results.json (plans, servers, every trial, the
aggregate, the claims beyond the spread, the fault runs), README.md (markdown
tables) and the plots (throughput and p99 TPOT against request rate per
system; a timeline per fault run), rebuilt from the JSON-lines files the runs
append (plans.jsonl, servers.jsonl, trials.jsonl, faultruns.jsonl):

    python -m bench.serving report <results dir>
"""

from __future__ import annotations

import json
import os
import statistics

from . import plan as P
from . import results as R

COLORS = {P.VLLM: "#4d4d4d", P.VLLM_MPS: "#b2182b", P.VLLM_MPS_RESTART: "#b2182b", P.FRMPS: "#1b7837",
          P.FRMPS_VLLM_FE: "#2166ac"}
CPU_NOTE = "CPU check of the harness (reference engine, tiny model): not a measurement"


def read_jsonl(path: str) -> list[dict]:
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise R.ResultError(f"{path}:{n}: {e}") from e
    return out


def rate_key(label: str) -> float:
    return P.INF if label == "inf" else float(label)


def fmt(v, digits: int = 1) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def cell(c: dict, digits: int = 1, scale: float = 1.0) -> str:
    """median (min–max) of a Spread's JSON."""
    if not c or c.get("median") is None:
        return "–"
    m, lo, hi = (c[k] * scale for k in ("median", "min", "max"))
    if c["n"] == 1 or lo == hi:
        return fmt(m, digits)
    return f"{fmt(m, digits)} ({fmt(lo, digits)}–{fmt(hi, digits)})"


def build(out_dir: str) -> dict:
    """Rebuild results.json, README.md and the plots from the run files in out_dir."""
    plans = read_jsonl(os.path.join(out_dir, "plans.jsonl"))
    if not plans:
        raise R.ResultError(f"{out_dir}: no plans.jsonl: not a serving results directory")
    servers = read_jsonl(os.path.join(out_dir, "servers.jsonl"))
    trials = read_jsonl(os.path.join(out_dir, "trials.jsonl"))
    faultruns = read_jsonl(os.path.join(out_dir, "faultruns.jsonl"))
    agg = R.aggregate(trials)
    systems = {t["system"] for t in trials}
    doc = {"plans": plans, "servers": servers, "trials": trials, "aggregate": agg,
           "claims": {b: R.claims(agg, b) for b in (P.VLLM, P.VLLM_MPS) if b in systems},
           "paired": {b: R.paired(trials, b) for b in (P.VLLM_MPS, P.VLLM) if b in systems},
           # each frmps system after its failover drill against itself before it (the same requests)
           "paired_after_failover": [r for s in sorted(systems) if s.endswith(P.AFTER_FAILOVER)
                                     and s[:-len(P.AFTER_FAILOVER)] in systems
                                     for r in R.paired(trials, s[:-len(P.AFTER_FAILOVER)]) if r["system"] == s],
           "fault_runs": faultruns, "cpu_check": all(p.get("device") == "cpu" for p in plans)}
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(doc, f, indent=1)
    doc["plots"] = write_plots(out_dir, doc)
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write(markdown(doc))
    return doc


# ----------------------------------------------------------------------------- markdown


def _systems_in(agg_kv: dict) -> list[str]:
    order = P.SYSTEMS + [P.VLLM_MPS_RESTART]
    return [s for s in order if s in agg_kv] + sorted(s for s in agg_kv if s not in order)


def sweep_table(agg_kv: dict) -> str:
    cols = [("output_throughput", "output tok/s", 0, 1), ("total_token_throughput", "total tok/s", 0, 1),
            ("p50_ttft_ms", "TTFT p50 ms", 1, 1), ("p99_ttft_ms", "TTFT p99 ms", 1, 1),
            ("p50_tpot_ms", "TPOT p50 ms", 2, 1), ("p99_tpot_ms", "TPOT p99 ms", 2, 1),
            ("p50_itl_ms", "ITL p50 ms", 2, 1), ("p99_itl_ms", "ITL p99 ms", 2, 1),
            ("request_goodput", "goodput req/s", 2, 1), ("slo_attainment", "SLO met %", 1, 100.0),
            ("failed", "failed", 0, 1)]
    lines = ["| rate (req/s) | system | trials | " + " | ".join(c[1] for c in cols) + " |",
             "|---|---|---|" + "---|" * len(cols)]
    rates = sorted({r for s in agg_kv.values() for r in s}, key=rate_key)
    for rate in rates:
        for system in _systems_in(agg_kv):
            c = agg_kv[system].get(rate)
            if not c:
                continue
            lines.append(f"| {rate} | {P.SYSTEM_LABELS.get(system, system)} | {c['trials']} | "
                         + " | ".join(cell(c[k], d, sc) for k, _, d, sc in cols) + " |")
    return "\n".join(lines)


def kv_table(servers: list[dict]) -> str:
    lines = ["| kv mode | system | KV blocks | source | start to serving (s) | compiled model | error |",
             "|---|---|---|---|---|---|---|"]
    for s in servers:
        kv = s.get("kv") or {}
        err = (s.get("error") or "").splitlines()[0][:120] if s.get("error") else ""
        comp = s.get("compile") or "–"
        if s.get("compile_after_failover"):
            drill = s.get("failover_drill") or {}
            comp += f"; after a failover ({fmt(drill.get('drill_s'))} s with its failback): {s['compile_after_failover']}"
        lines.append(f"| {s.get('kv_mode', '')} | {P.SYSTEM_LABELS.get(s['system'], s['system'])} | "
                     f"{fmt(kv.get('num_blocks'))} | {kv.get('source', '')} | {fmt(s.get('start_s'))} | {comp} | {err} |")
    return "\n".join(lines)


def cpu_table(trials: list[dict], servers: list[dict]) -> str:
    """Per system, at its highest rate: the host CPU of its processes (median over
    the trials; cores = CPU seconds / the trial's wall time), and the py-spy
    profile run's busiest engine threads where one was taken."""
    lines = ["| system | rate | process | cores | CPU ms per output token |", "|---|---|---|---|---|"]
    by_sys: dict[str, list[dict]] = {}
    for t in trials:
        if t.get("cpu") and not t.get("error"):
            by_sys.setdefault(t["system"], []).append(t)
    for system in _systems_in(by_sys):
        top = max((t["rate"] for t in by_sys[system]), key=rate_key)
        rows: dict[str, dict[str, list[float]]] = {}
        for t in by_sys[system]:
            if t["rate"] != top:
                continue
            for p in t["cpu"].get("processes") or []:
                r = rows.setdefault(p.get("role") or p.get("name", "?"), {"cores": [], "ms": []})
                if p.get("cores") is not None:
                    r["cores"].append(p["cores"])
                if p.get("cpu_ms_per_token") is not None:
                    r["ms"].append(p["cpu_ms_per_token"])
        for name, r in sorted(rows.items(), key=lambda kv: -statistics.median(kv[1]["cores"] or [0])):
            if not r["cores"] or statistics.median(r["cores"]) < 0.01:
                continue
            lines.append(f"| {P.SYSTEM_LABELS.get(system, system)} | {top} | {name} | {fmt(statistics.median(r['cores']), 2)} | "
                         f"{fmt(statistics.median(r['ms']), 3) if r['ms'] else '–'} |")
    if len(lines) == 2:
        return ""
    out = [*lines]
    for s in servers:
        runs = s.get("py_spy") or []
        for ps in ([runs] if isinstance(runs, dict) else runs):  # a dict: one cpu view (before --py-spy-views)
            th = ps.get("threads") or {}
            label = P.SYSTEM_LABELS.get(s["system"], s["system"])
            if "error" in th or "error" in ps:
                out += ["", f"- {label}: py-spy failed: {str(th.get('error') or ps.get('error'))[:200]}"]
                continue
            out += ["", f"- {label}, py-spy ({ps.get('view', 'cpu')} view) of pid {ps.get('pid')} "
                    f"(`{ps.get('stacks')}`), busiest threads:"]
            for name, t in list(th.items())[:3]:
                leaf = ", ".join(f"{f} {n}" for f, n in t["leaf"][:4])
                out += [f"  - {name}: {t['samples']} samples; hottest frames: {leaf}"]
    return "\n".join(out)


def paired_table(rows: list[dict]) -> str:
    """The per-trial relative differences against one baseline: median (min–max)
    in %, in bold where every pair differs the same way."""
    names = {"output_throughput": "output tok/s", "p50_tpot_ms": "TPOT p50", "p99_ttft_ms": "TTFT p99",
             "p50_itl_ms": "ITL p50"}
    ms = R.PAIRED_METRICS
    lines = ["| kv mode | rate (req/s) | system | pairs | " + " | ".join(names.get(m, m) for m in ms) + " |",
             "|---|---|---|---|" + "---|" * len(ms)]

    def pct(c: dict) -> str:
        if not c.get("n"):
            return "–"
        m, lo, hi = (100.0 * c[k] for k in ("median", "min", "max"))
        txt = f"{m:+.1f} %" if c["n"] == 1 or lo == hi else f"{m:+.1f} % ({lo:+.1f} … {hi:+.1f})"
        return f"**{txt}**" if c.get("sign") else txt

    order = {s: i for i, s in enumerate(P.SYSTEMS)}
    for r in sorted(rows, key=lambda r: (r["kv_mode"], rate_key(r["rate"]), order.get(r["system"], 99), r["system"])):
        n = max(c.get("n") or 0 for c in r["metrics"].values())
        lines.append(f"| {r['kv_mode']} | {r['rate']} | {P.SYSTEM_LABELS.get(r['system'], r['system'])} | {n} | "
                     + " | ".join(pct(r["metrics"][m]) for m in ms) + " |")
    return "\n".join(lines)


def claims_md(claims: dict) -> str:
    out = []
    for base, cs in claims.items():
        if not cs:
            out.append(f"- against {P.SYSTEM_LABELS[base]}: no difference beyond the spread of the trials.")
            continue
        for c in cs:
            out.append(f"- {c['kv_mode']}, rate {c['rate']}: {P.SYSTEM_LABELS.get(c['system'], c['system'])} "
                       f"**{c['verdict']}** than {P.SYSTEM_LABELS[base]} on {c['metric']} "
                       f"(median {fmt(c['system_median'], 2)} vs {fmt(c['baseline_median'], 2)}; ranges disjoint)")
    return "\n".join(out)


def _phases_cell(ph: dict | None) -> str:
    """'before (n) / rest (n)' SLO attainment in %, the run's own no-fault reference."""
    if not ph:
        return "–"

    def one(p: dict) -> str:
        a = p.get("slo_attainment")
        return f"{fmt(None if a is None else 100 * a, 1)} ({p.get('sent', 0)})"

    return f"{one(ph['before'])} / {one(ph['from_fault'])}"


def fault_table(runs: list[dict]) -> str:
    lines = ["| spacing (s) | system | faults fired | requests | failed | truncated | goodput req/s | SLO met % | "
             "SLO met %: ended before the first fault / the rest | "
             "TTFT p99 ms | TPOT p99 ms | longest gap ms | server restarts / failovers |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (-(r.get("spacing_s") or 0), r.get("system", ""))):
        s = r.get("summary") or {}
        if r.get("error") and not s:
            lines.append(f"| {fmt(r.get('spacing_s'), 0)} | {P.SYSTEM_LABELS.get(r['system'], r['system'])} | "
                         f"ERROR: {r['error'].splitlines()[0][:150]} |" + " |" * 11)
            continue
        recov = s.get("restarts") if r["system"] == P.VLLM_MPS_RESTART else s.get("failovers")
        lines.append(f"| {fmt(r.get('spacing_s'), 0)} | {P.SYSTEM_LABELS.get(r['system'], r['system'])} | "
                     f"{len(r.get('faults') or [])} | {fmt(s.get('sent'))} | {fmt(s.get('failed'))} | "
                     f"{fmt(s.get('truncated'))} | {fmt(s.get('goodput_rps'), 2)} | "
                     f"{fmt(None if s.get('slo_attainment') is None else 100 * s['slo_attainment'], 1)} | "
                     f"{_phases_cell(s.get('phases'))} | "
                     f"{fmt(s.get('p99_ttft_ms'))} | {fmt(s.get('p99_tpot_ms'), 2)} | {fmt(s.get('longest_gap_ms'))} | "
                     f"{fmt(recov)} |")
    return "\n".join(lines)


def markdown(doc: dict) -> str:
    plans = doc["plans"]
    p0 = plans[0]
    st, al = p0["stream"], p0["alike"]
    out = ["# Serving performance beside `vllm serve`, with and without faults", ""]
    if doc.get("cpu_check"):
        out += [f"**{CPU_NOTE}.**", ""]
    out += ["Client: vLLM's own serving benchmark, `vllm bench serve` (module `vllm.benchmarks.serve`), "
            "its `openai` backend streaming `/v1/completions`, per-request detail saved (`--save-detailed`).",
            "",
            "Request stream: vLLM's `random` dataset (no dataset can be downloaded on the GPU machine): "
            f"input {st['input_len']} tokens and output {st['output_len']} tokens, each drawn uniformly in "
            f"[len × (1 − {st['range_ratio']}), len × (1 + {st['range_ratio']})] (`--random-range-ratio "
            f"{st['range_ratio']}`), random token ids from the model's tokenizer, seeded: trial *i* uses seed "
            f"{st['seed']} + *i* for every system, so each system gets the same requests in the same trial; "
            f"`--ignore-eos` (every request runs to its drawn output length), temperature {st['temperature']}. "
            f"Arrivals: Poisson (`--burstiness 1`) at each rate for about {st['trial_s']} s "
            f"(rate × {st['trial_s']} requests, at least {st['min_prompts']}); `inf` sends "
            f"{P.Stream(**st).num_prompts(P.INF, al['max_num_seqs'])} requests "
            + (f"with at most {st['inf_concurrency']} in flight (`--max-concurrency`: a steady state at saturation)."
               if st.get("inf_concurrency") else "at once."),
            "",
            f"Configured alike: {P.Alike(**al).describe()}; every system loads the same "
            f"model directory (`{p0['model']}`). KV cache: each system at its own default memory fraction "
            "(`default-kv`), and where an `equal-kv-N` run is listed, N blocks for every system "
            "(`--num-gpu-blocks-override N` for vllm serve, `--num-blocks N` for frmps).",
            "",
            f"Goodput (`--goodput ttft:{p0['slo_ttft_ms']:g} tpot:{p0['slo_tpot_ms']:g}`): requests per second that "
            f"completed with TTFT ≤ {p0['slo_ttft_ms']:g} ms and TPOT ≤ {p0['slo_tpot_ms']:g} ms; SLO met %: "
            "the share of the requests sent that did (a failed request misses). Cells: median (min–max) over the "
            f"trials; a difference is claimed only where the min–max ranges of two systems do not overlap "
            f"(with at least {R.MIN_TRIALS_FOR_CLAIM} trials each).",
            "",
            "Each system's server is started once; its trials are repeated client runs, trial by trial over every "
            "rate (so a drift over the run touches every rate alike), after an untimed warm-up run.", ""]
    if doc["servers"]:
        out += ["## KV cache and start-up", "",
                "*compiled model*: how the serving engine got its compiled model, from its log: `compiled` (traced and "
                "compiled in this start) or `loaded` (vLLM's AOT-compiled artifact from its cache, as every engine "
                "after the first loads it, a promoted or restored one included).", "", kv_table(doc["servers"]), ""]
    for kv, agg_kv in sorted(doc["aggregate"].items()):
        out += [f"## Sweep ({kv})", "", sweep_table(agg_kv), ""]
        for name in ("sweep-" + kv + ".png",):
            if name in (doc.get("plots") or []):
                out += [f"![throughput and p99 TPOT against rate]({name})", ""]
    cpu = cpu_table(doc["trials"], doc["servers"])
    if cpu:
        out += ["## Host CPU at the highest rate", "",
                "Every process of each server, read from /proc before and after each trial (nothing paused); "
                "cores: CPU seconds over the trial's wall time.", "", cpu, ""]
    if doc["aggregate"]:
        out += ["## Differences beyond the spread", "", claims_md(doc["claims"]) or "- (no baseline in this run)", ""]
    if doc.get("paired_after_failover"):
        out += ["## After a failover against before it, trial by trial", "",
                "Each frmps system's trials again after a failover drill and its failback (`--after-failover`), "
                "against the same trials before it (the same requests): median (min–max) of (after / before − 1); "
                "**bold** where every pair differs the same way.", "", paired_table(doc["paired_after_failover"]), ""]
    for base, rows in (doc.get("paired") or {}).items():
        if rows:
            out += [f"## Paired against {P.SYSTEM_LABELS[base]}, trial by trial", "",
                    f"Trial *i* of every system sends the same requests (seed {st['seed']} + *i*): each cell is the "
                    f"median (min–max) over the trials of (system / {P.SYSTEM_LABELS[base]} − 1) for the same trial, "
                    "which leaves out how the trials' request sets differ from each other (the spread of the table "
                    "above includes it). **Bold**: every pair (at least "
                    f"{R.MIN_TRIALS_FOR_CLAIM}) differs the same way. Throughput: + is more; the latencies: + is "
                    "slower.", "", paired_table(rows), ""]
    errs = [t for t in doc["trials"] if t.get("error")]
    if errs:
        out += ["## Trials that failed", ""]
        out += [f"- {t['system']} {t['kv_mode']} rate {t['rate']} trial {t['trial']}: "
                f"{t['error'].splitlines()[0][:200]}" for t in errs]
        out += [""]
    if doc["fault_runs"]:
        fr = doc["fault_runs"][0]
        late = [f["t_rel"] - f["planned_rel"] for f in fr.get("faults") or [] if "t_rel" in f and "planned_rel" in f]
        how = ("SIGKILL of frmps's active engine (the CPU check's fault; no MPS on the CPU), each once a standby is "
               f"ready (at most {max(late, default=0):.1f} s past its time)" if fr.get("device") == "cpu"
               else f"rotating the SM-fault kinds ({', '.join(fr.get('kinds') or [])})")
        out += ["## Fault mode", "",
                f"The same client at {fr.get('rate')} req/s for {fr.get('window_s')} s per system while a co-located "
                f"MPS client faults every *spacing* seconds; fault: {how}. "
                "Baseline: `vllm serve` as a client of an MPS daemon under a supervisor loop that restarts it when it "
                "exits or its /health fails (every fault is a cold restart). frmps: the trigger joins frmps's own "
                "MPS daemon, whose client is the active engine. *failed*: requests vLLM's client counts as failed; "
                "*truncated*: counted as completed but shorter than the shortest output the dataset asks for (a "
                "stream ended by an error event); *longest gap*: the longest wait for a first token or between two "
                "chunks that any completed request saw; *ended before the first fault / the rest*: the SLO "
                "attainment of the requests that completed before the first fault (the run's own no-fault "
                "reference, same load) and of every other request (in flight at a fault or sent after one), with "
                "their counts.", "", fault_table(doc["fault_runs"]), ""]
        for name in sorted(p for p in doc.get("plots") or [] if p.startswith("timeline-")):
            out += [f"![{name}]({name})", ""]
    out += ["## Commands", ""]
    for s in doc["servers"]:
        out += [f"- {s['system']} ({s.get('kv_mode', '')}): `{P.shell(s.get('command') or [])}`"]
    for fr in doc["fault_runs"]:
        out += [f"- fault run {fr['system']} (spacing {fr.get('spacing_s')} s): `{P.shell(fr.get('command') or [])}`"]
    if doc["trials"]:
        out += ["", "Client, per trial: see `trials.jsonl` and the `raw/` result files; the command line of each "
                "is in `work/client-*.log`."]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- plots


def write_plots(out_dir: str, doc: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    note = CPU_NOTE if doc.get("cpu_check") else ""
    for kv, agg_kv in doc["aggregate"].items():
        names.append(plot_sweep(plt, out_dir, kv, agg_kv, note))
    for fr in doc["fault_runs"]:
        if fr.get("timeline"):
            names.append(plot_timeline(plt, out_dir, fr, note))
    return names


def plot_sweep(plt, out_dir: str, kv: str, agg_kv: dict, note: str) -> str:
    rates = sorted({r for s in agg_kv.values() for r in s}, key=rate_key)
    xs = {r: i for i, r in enumerate(rates)}  # 'inf' as the last category
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for system in _systems_in(agg_kv):
        pts = [(xs[r], agg_kv[system][r]) for r in rates if r in agg_kv[system]]
        for ax, key in zip(axes, ("output_throughput", "p99_tpot_ms")):
            p = [(x, c[key]) for x, c in pts if c[key]["median"] is not None]
            if not p:
                continue
            x = [a for a, _ in p]
            m = [c["median"] for _, c in p]
            err = [[c["median"] - c["min"] for _, c in p], [c["max"] - c["median"] for _, c in p]]
            ax.errorbar(x, m, yerr=err, marker="o", capsize=3, label=P.SYSTEM_LABELS.get(system, system),
                        color=COLORS.get(system))
    for ax, title in zip(axes, ("output throughput (tok/s)", "p99 TPOT (ms)")):
        ax.set_xticks(range(len(rates)), rates)
        ax.set_xlabel("request rate (req/s, Poisson; inf: all at once)")
        ax.set_title(title + ": median, bars min–max", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    name = f"sweep-{kv}.png"
    _save(plt, fig, os.path.join(out_dir, name), note)
    return name


def plot_timeline(plt, out_dir: str, fr: dict, note: str) -> str:
    tl = fr["timeline"]
    fig, ax = plt.subplots(figsize=(11, 3.8))
    ax.plot(tl["t"], tl["tokens_per_s"], color=COLORS.get(fr["system"], "#333333"), label="output tokens/s")
    fails = tl.get("failed_starts") or []
    if fails:
        ax.scatter(fails, [0] * len(fails), marker="x", color="#d6604d", label="failed request (start)", zorder=3)
    for i, f in enumerate(fr.get("faults") or []):
        ax.axvline(f["t_rel"], color="#b2182b", ls="--", lw=1, label="fault" if i == 0 else None)
    end = tl["t"][-1] if tl.get("t") else 0.0
    for i, e in enumerate(tl.get("down") or []):
        # A span still open when the run ended (the server not back yet) runs to the plot's end.
        ax.axvspan(e[0], e[1] if e[1] is not None else max(end, e[0]), color="#fddbc7", alpha=0.6, label="server restarting" if i == 0 else None)
    ax.set_xlabel("time since the client's main run started (s)")
    ax.set_ylabel("output tokens/s (1 s bins)")
    ax.set_title(f"{P.SYSTEM_LABELS.get(fr['system'], fr['system'])}: {fr.get('rate')} req/s, a fault every "
                 f"{fr.get('spacing_s')} s", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)
    name = f"timeline-{fr['system']}-{fr.get('spacing_s'):g}s.png"
    _save(plt, fig, os.path.join(out_dir, name), note)
    return name


def _save(plt, fig, path: str, note: str) -> None:
    if note:
        fig.text(0.99, 0.01, note, ha="right", va="bottom", fontsize=8, color="#b2182b")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
