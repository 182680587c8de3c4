"""PNG plots from the result files (matplotlib; `make bench-plots RESULTS=<dir>`).

    python -m bench.plots <results dir>
"""

from __future__ import annotations

import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from . import report  # noqa: E402
from .results import latest_ok, load_records  # noqa: E402

COLORS = {"frmps": "#1b7837", "frmps-n1": "#1b7837", "frmps-n16": "#5aae61", "frmps-no-kv": "#9970ab",
          "sleep-only": "#e08214", "cold (dropped)": "#b2182b", "cold (warm)": "#ef8a62", "context": "#999999"}


def _cpu_note(out_dir: str, exp: str) -> str:
    runs = [r for r in report.load_runs(out_dir) if r.get("experiment") == exp]
    return "CPU check of the harness, not a measurement" if runs and all(r.get("cpu_check") for r in runs) else ""


def _save(fig, out_dir: str, name: str, note: str) -> str:
    if note:
        fig.text(0.99, 0.01, note, ha="right", va="bottom", fontsize=8, color="#b2182b")
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_recovery(out_dir: str, s: dict) -> str | None:
    models = list(s["models"])
    if not models:
        return None
    systems = ["frmps", "sleep-only", "cold (dropped)", "cold (warm)"]
    systems = [x for x in systems if any(x in s["models"][m] for m in models)]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(models)), 4.2))
    w = 0.8 / max(1, len(systems))
    for i, name in enumerate(systems):
        ys = [((s["models"][m].get(name) or {}).get("recovery_s") or float("nan")) * 1e3 for m in models]
        xs = [j + (i - (len(systems) - 1) / 2) * w for j in range(len(models))]
        ax.bar(xs, ys, w, label=name, color=COLORS.get(name))
    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi * 8)  # room for the labels
    for j, m in enumerate(models):
        r = s["models"][m]
        label = " / ".join(f"{report.times(r.get(k))}" for k in ("speedup_vs_sleep_only", "speedup_vs_cold") if r.get(k))
        if label:
            ax.annotate(label, (j, 0.97), xycoords=("data", "axes fraction"), ha="center", va="top", fontsize=8)
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("death → first token (ms, log)")
    ax.set_title("Recovery (labels: frmps × faster than sleep-only / cold)", fontsize=10)
    ax.legend(fontsize=8, loc="center left")
    return _save(fig, out_dir, "recovery", _cpu_note(out_dir, "recovery"))


def plot_series(out_dir: str, s: dict, name: str, xlabel: str, logx: bool) -> str | None:
    if not s["series"]:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for sname, ser in s["series"].items():
        xs = [int(x) for x in ser]
        ys = [(p["recovery_s"] or float("nan")) * 1e3 for p in ser.values()]
        ax.plot(xs, ys, "o-", label=sname, color=COLORS.get(sname))
    if logx:
        ax.set_xscale("log", base=2)
        allx = sorted({int(x) for ser in s["series"].values() for x in ser})
        ax.set_xticks(allx, [str(x) for x in allx])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("death → first resumed token (ms)")
    ax.set_title(f"{report.TITLES[name][3:]} ({s.get('model')})", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, out_dir, name, _cpu_note(out_dir, name))


def plot_sync(out_dir: str, s: dict) -> str | None:
    if not s["models"]:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for m, r in s["models"].items():
        ns = sorted(int(n) for n in r["per_n"] if n != "0" and not n.endswith("i"))
        line = ax.plot(ns, [r["per_n"][str(n)]["overhead_pct"] for n in ns], "o-", label=f"{m} (batch {r['batch']})")
        inl = sorted(int(n[:-1]) for n in r["per_n"] if n.endswith("i"))
        if inl:  # published between steps (no overlap): hollow markers
            ax.plot(inl, [r["per_n"][f"{n}i"]["overhead_pct"] for n in inl], "o", mfc="none",
                    color=line[0].get_color(), label=f"{m}, between steps")
    ax.axhline(0.5, ls="--", color="#b2182b", lw=1, label="target 0.5%")
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xscale("log", base=2)
    allns = sorted({int(n.rstrip("i")) for r in s["models"].values() for n in r["per_n"] if n != "0"})
    ax.set_xticks(allns, [str(n) for n in allns])
    ax.set_xlabel("publish every N steps")
    ax.set_ylabel("step time lost vs no publishing (%)")
    ax.set_title("Sync overhead at a saturating batch")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, out_dir, "sync-overhead", _cpu_note(out_dir, "sync-overhead"))


def plot_outage(out_dir: str, s: dict) -> str | None:
    recs = latest_ok(load_records(os.path.join(out_dir, "outage.jsonl")))
    recs = [r for r in recs if r.get("ok") and r["data"].get("tokens_per_s")]
    if not recs:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.2))
    seen = set()
    for r in recs:
        sname = r["key"]["system"]
        if sname in seen:
            continue
        seen.add(sname)
        d = r["data"]
        b = d["bin_s"]
        xs = [i * b - d["fault_rel_t0_s"] for i in range(len(d["tokens_per_s"]))]
        label = f"{sname}: outage {report.ms(d.get('outage_s'))}" + (" (in process)" if sname == "sleep-only" else "")
        ax.step(xs, d["tokens_per_s"], where="post", label=label, color=COLORS.get(sname))
    ax.axvline(0, color="black", ls=":", lw=1)
    ax.set_xlabel("time from the fault (s)")
    ax.set_ylabel("tokens/s delivered")
    ax.set_title(f"Throughput around the fault ({s.get('model')})")
    ax.legend(fontsize=8)
    return _save(fig, out_dir, "outage", _cpu_note(out_dir, "outage"))


def plot_memory(out_dir: str, s: dict) -> str | None:
    models = list(s["models"])
    if not models:
        return None
    fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(models)), 4.2))
    series = [("standby_mib", "frmps standby", "frmps"), ("context_mib", "bare CUDA context", "context"),
              ("sleep_only_standby_mib", "sleep-only standby (asleep)", "sleep-only")]
    w = 0.8 / len(series)
    for i, (f, label, c) in enumerate(series):
        ys = [s["models"][m].get(f) or float("nan") for m in models]
        ax.bar([j + (i - 1) * w for j in range(len(models))], ys, w, label=label, color=COLORS.get(c))
    ctx = [s["models"][m].get("context_mib") for m in models]
    ax.plot(range(len(models)), [(c or float("nan")) + 64 for c in ctx], "k--", lw=1, label="context + 64 MiB (target)")
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel(next(iter(s["models"].values())).get("unit") or "MiB")
    ax.set_title("Standby memory")
    ax.legend(fontsize=8)
    return _save(fig, out_dir, "standby-memory", _cpu_note(out_dir, "standby-memory"))


def plot_correctness(out_dir: str, s: dict) -> str | None:
    if not s["ks"]:
        return None
    ks = list(s["ks"])
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, (f, label) in enumerate((("greedy_equal", "greedy"), ("seeded_equal", "seeded"))):
        ys = [100 * v[f] / v["runs"] for v in s["ks"].values()]
        ax.bar([j + (i - 0.5) * 0.4 for j in range(len(ks))], ys, 0.4, label=label)
    ax.set_xticks(range(len(ks)), ks)
    ax.set_ylim(0, 105)
    ax.set_xlabel("K (tokens before the kill)")
    ax.set_ylabel("requests equal to no-fault (%)")
    ax.set_title(f"Token-exact after recovery ({s.get('model')}; exact mode: {', '.join(s['exact_modes']) or '–'})", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, out_dir, "correctness", _cpu_note(out_dir, "correctness"))


def draw_all(out_dir: str, summ: dict[str, dict] | None = None) -> list[str]:
    if summ is None:
        summ = {n: report.SUMMARIZE[n](load_records(os.path.join(out_dir, f"{n}.jsonl"))) for n in report.ORDER
                if os.path.exists(os.path.join(out_dir, f"{n}.jsonl"))}
    fns = {"recovery": plot_recovery, "prompt-length": lambda d, s: plot_series(d, s, "prompt-length", "prompt tokens", False),
           "since-sync": lambda d, s: plot_series(d, s, "since-sync", "K: tokens generated before the kill", True),
           "sync-overhead": plot_sync, "outage": plot_outage, "standby-memory": plot_memory, "correctness": plot_correctness}
    out = []
    for name, s in summ.items():
        p = fns[name](out_dir, s)
        if p:
            out.append(p)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m bench.plots <results dir>", file=sys.stderr)
        return 2
    for p in report.write_all(os.path.abspath(argv[0]), plots=True):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
