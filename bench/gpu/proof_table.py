#!/usr/bin/env python3
"""Markdown table from failover_proof.py JSON files: one row per failover; then,
for every file that has them (failover, failback/soak, tp and OpenAI fault
proofs), the stream count's headline and the negative controls."""

import json
import sys


def ms(x):
    return f"{x * 1000:.0f}" if isinstance(x, (int, float)) else "-"


def in_flight(t):
    """A tally's in-flight figures: "exact/compared (+unseeded completed), not in flight"."""
    if not t:
        return "-"
    f = t["in_flight"]
    s = f"{f['exact']}/{f['streams']}"
    if f.get("margin-bounded"):
        s += f" ({f['margin-bounded']} margin-bounded)"
    if f.get("completed"):
        s += f" +{f['completed']} unseeded completed"
    return s + f", {t['not_in_flight']} not in flight"


def controls(d):
    mode = d.get("controls_mode")
    if mode is None:
        return "not recorded"
    if mode == "off":
        return "**OFF**"
    return ", ".join(f"{c['case']} {'detected' if c['detected'] else '**NOT detected**'} "
                     f"({c['streams_affected']}/{c['streams_in_flight']} in flight affected)"
                     for c in d.get("controls") or []) or mode


def main(paths):
    print("| model | fault (trigger) | # | death cause (classified) | streams open / resumed | fault→detect ms | "
          "detect→resume ack ms | detect→first resumed token ms | tokens reused / recomputed | KV writable ms | "
          "re-arm s (detect→standby ready) | re-armed standby map ms | token ids = no-fault run | "
          "streams in flight at the fault exact |")
    print("|" + "---|" * 14)
    docs = []
    for p in paths:
        d = json.load(open(p))
        docs.append((p, d))
        for e in d["faults"]:
            for n, ph in (("1", e.get("first")), ("2", e.get("second"))):
                if not ph or "record" not in ph:
                    continue
                r, inj = ph["record"], ph.get("inject") or {}
                tk, ra, xi = ph.get("takeover_log") or {}, ph.get("rearmed_standby") or {}, ph.get("exact_ids") or {}
                fault = e["fault"] if n == "1" else "debug hook (own context)"
                print(f"| {d['model']} | {fault} | {n} | {r.get('cause')} | {inj.get('streams_alive_at_inject', '-')} / "
                      f"{r.get('resumed_requests')} | {ms(ph.get('fault_to_detect_s'))} | {ms(r.get('duration_seconds'))} | "
                      f"{ms(r.get('first_token_seconds') or ph.get('detect_to_first_resumed_token_s'))} | "
                      f"{r.get('reused_tokens')} / {r.get('prefilled_tokens')} | {tk.get('kv_writable_ms', '-')} | "
                      f"{ph.get('rearm_s_from_detect')} | {ra.get('map_ms', '-')} | {xi.get('ids_equal')}/{xi.get('requests')} | "
                      f"{in_flight(ph.get('stream_count'))} |")
    print()
    for p, d in docs:
        if d.get("headline"):
            print(f"- {p} ({d.get('model')}): {d['headline']}; controls: {controls(d)}")


if __name__ == "__main__":
    main(sys.argv[1:])
