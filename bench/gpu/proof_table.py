#!/usr/bin/env python3
"""Markdown table from failover_proof.py JSON files: one row per failover."""

import json
import sys


def ms(x):
    return f"{x * 1000:.0f}" if isinstance(x, (int, float)) else "-"


def main(paths):
    print("| model | fault (trigger) | # | death cause (classified) | streams open / resumed | fault→detect ms | "
          "detect→resume ack ms | detect→first resumed token ms | tokens reused / recomputed | KV writable ms | "
          "re-arm s (detect→standby ready) | re-armed standby map ms | token ids = no-fault run |")
    print("|" + "---|" * 13)
    for p in paths:
        d = json.load(open(p))
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
                      f"{ph.get('rearm_s_from_detect')} | {ra.get('map_ms', '-')} | {xi.get('ids_equal')}/{xi.get('requests')} |")


if __name__ == "__main__":
    main(sys.argv[1:])
