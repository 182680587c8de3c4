"""Generate the ring test vectors (ringbuf/testdata/).

    python -m frmps_engine.ring.vectors ringbuf/testdata

writes ``scenario.json`` (the operations to perform and what a reader must
decode) and ``py_writer.ring`` (the ring the Python writer produces from it).
The Go tests write ``go_writer.ring`` from the same scenario
(``go test ./ringbuf -run TestVectors -update``); both rings must be byte-
identical and each language decodes the other's.

The expectations (record framing, seqs, PADs, final snapshot) are computed
here from FORMAT.md's rules, independently of the writer and reader code.
"""

from __future__ import annotations

import json
import os
import random
import sys

from .layout import (
    FLAG_ABORTED,
    FLAG_FINISHED,
    FLAG_RESET,
    RECORD_HEADER_SIZE,
    TYPE_DELTA,
    TYPE_FULL,
    TYPE_PAD,
    align_up,
    payload_len,
)
from .writer import RingWriter, create_ring

CAPACITY = 4096


def _build(seed: int, pre_steps: int, post_steps: int) -> dict:
    rnd = random.Random(seed)
    ops: list[dict] = []
    live: dict[int, dict] = {}
    next_block = [100]

    def new_blocks(n):
        b = list(range(next_block[0], next_block[0] + n))
        next_block[0] += n
        return b

    def full_entries():
        return [
            {"key": k, "seed": r["seed"], "num_computed": r["num_computed"], "num_prompt": r["num_prompt"],
             "flags": FLAG_RESET, "blocks": list(r["blocks"]), "tokens": list(r["tokens"])}
            for k, r in sorted(live.items())
        ]  # fmt: skip

    def delta_step():
        entries = []
        for _ in range(2):
            if len(live) >= 5 or rnd.random() < 0.4:
                break
            key = rnd.choice([7, 2**40 + 3, 2**64 - 1, 12345]) if not live else max(live) + rnd.randint(1, 9)
            if key in live or key >= 2**64:
                continue
            toks = [rnd.randrange(2**32) for _ in range(rnd.randint(1, 12))]
            r = {"seed": rnd.getrandbits(64), "num_prompt": len(toks), "num_computed": len(toks),
                 "blocks": new_blocks(1 + len(toks) // 16), "tokens": toks}  # fmt: skip
            live[key] = r
            entries.append({"key": key, "seed": r["seed"], "num_computed": r["num_computed"],
                            "num_prompt": r["num_prompt"], "flags": FLAG_RESET,
                            "blocks": list(r["blocks"]), "tokens": list(toks)})  # fmt: skip
        for key in sorted(live):
            if any(e["key"] == key for e in entries):
                continue
            r = live[key]
            x = rnd.random()
            if x < 0.55:
                add = [rnd.randrange(2**32) for _ in range(rnd.randint(1, 3))]
                nb = new_blocks(1) if rnd.random() < 0.3 else []
                r["tokens"] += add
                r["blocks"] += nb
                r["num_computed"] = len(r["tokens"]) - rnd.randint(0, 1)
                entries.append({"key": key, "seed": r["seed"], "num_computed": r["num_computed"], "num_prompt": 0,
                                "flags": 0, "blocks": nb, "tokens": add})  # fmt: skip
            elif x < 0.63:
                r["blocks"] = new_blocks(len(r["blocks"]))
                r["num_computed"] = rnd.randint(0, len(r["tokens"]))
                entries.append({"key": key, "seed": r["seed"], "num_computed": r["num_computed"],
                                "num_prompt": r["num_prompt"], "flags": FLAG_RESET,
                                "blocks": list(r["blocks"]), "tokens": list(r["tokens"])})  # fmt: skip
            elif x < 0.7:
                flag = FLAG_FINISHED if rnd.random() < 0.5 else FLAG_ABORTED
                add = [rnd.randrange(2**32)]
                r["tokens"] += add
                entries.append({"key": key, "seed": r["seed"], "num_computed": len(r["tokens"]), "num_prompt": 0,
                                "flags": flag, "blocks": [], "tokens": add})  # fmt: skip
                del live[key]
        return entries

    ops.append({"op": "attach"})
    ops.append({"op": "publish", "step": 0, "full": True, "entries": []})
    for step in range(1, pre_steps + 1):
        ops.append({"op": "publish", "step": step, "full": False, "entries": delta_step()})
    # A new writer (the standby took over): epoch 2, FULL first. Readers of the
    # vector start here.
    ops.append({"op": "attach"})
    ops.append({"op": "publish", "step": 1000, "full": True, "entries": full_entries(), "reader_starts_here": True})
    for step in range(1001, 1001 + post_steps):
        ops.append({"op": "publish", "step": step, "full": False, "entries": delta_step()})
    final = {str(k): {"seed": r["seed"], "num_prompt": r["num_prompt"], "num_computed": r["num_computed"],
                      "blocks": r["blocks"], "tokens": r["tokens"]} for k, r in live.items()}  # fmt: skip
    sc = {"capacity": CAPACITY, "ops": ops, "final": final}
    _frame(sc)
    return sc


def build_scenario(seed: int = 20261121) -> dict:
    """The first (deterministic) scenario whose tail wraps with a PAD while
    still fitting in the ring."""
    for pre in range(20, 80):
        for post in range(6, 16):
            try:
                return _build(seed, pre, post)
            except AssertionError:
                continue
    raise AssertionError("no scenario fits")


def _frame(sc: dict) -> None:
    """Work out positions, seqs and PAD records from FORMAT.md's rules."""
    cap = sc["capacity"]
    cursor = seq = epoch = 0
    start = None
    records = []
    for op in sc["ops"]:
        if op["op"] == "attach":
            epoch += 1
            continue
        es = op["entries"]
        plen = payload_len(len(es), sum(len(e["blocks"]) for e in es), sum(len(e["tokens"]) for e in es))
        length = align_up(RECORD_HEADER_SIZE + plen)
        assert length <= cap // 2
        if cap - cursor % cap < length:
            seq += 1
            if start is not None:
                records.append({"seq": seq, "type": TYPE_PAD, "epoch": epoch, "step": 0})
            cursor += cap - cursor % cap
        if op.get("reader_starts_here"):
            start = cursor
        seq += 1
        if start is not None:
            records.append({"seq": seq, "type": TYPE_FULL if op["full"] else TYPE_DELTA, "epoch": epoch, "step": op["step"]})
        cursor += length
    # A reader trusts a copy only within capacity/2 of the write cursor (FORMAT.md).
    assert start is not None and cursor - start <= cap // 2, "the records after the start must be readable"
    assert any(r["type"] == TYPE_PAD for r in records), "the vector must wrap after the start"
    sc.update(start=start, end_cursor=cursor, end_seq=seq, end_epoch=epoch, records=records)


def write_ring(sc: dict, path: str) -> None:
    """Perform the scenario with the Python writer."""
    create_ring(path, sc["capacity"])
    w = None
    try:
        for op in sc["ops"]:
            if op["op"] == "attach":
                if w is not None:
                    w.close()
                w = RingWriter.attach(path)
                continue
            cols = [[e[k] for e in op["entries"]] for k in ("key", "seed", "num_computed", "num_prompt", "flags")]
            nb = [len(e["blocks"]) for e in op["entries"]]
            nt = [len(e["tokens"]) for e in op["entries"]]
            blocks = [b for e in op["entries"] for b in e["blocks"]]
            tokens = [t for e in op["entries"] for t in e["tokens"]]
            w.publish_columns(op["step"], *cols, nb, nt, blocks, tokens, full=op["full"])
    finally:
        if w is not None:
            w.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m frmps_engine.ring.vectors OUTDIR", file=sys.stderr)
        return 2
    out = argv[0]
    sc = build_scenario()
    with open(os.path.join(out, "scenario.json"), "w") as f:
        json.dump(sc, f, indent=1)
        f.write("\n")
    ring = os.path.join(out, "py_writer.ring")
    if os.path.exists(ring):
        os.unlink(ring)
    write_ring(sc, ring)
    return 0


if __name__ == "__main__":
    sys.exit(main())
