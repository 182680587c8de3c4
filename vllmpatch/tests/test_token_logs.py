"""bench.token_logs: the engines' token logs compared across engines (synthetic logs, no engine)."""

from __future__ import annotations

import json
import tarfile

from bench import token_logs as tl
from test_proofcount import _load  # bench/gpu's scripts, loaded by path

P1, P2 = [1, 2, 3], [4, 5, 6, 7]
GOOD1, GOOD2 = [10, 11, 12, 13], [20, 21, 22, 23]


def write(d, pid, rows):
    with open(d / f"tokens-{pid}.jsonl", "w") as f:
        for t, prompt, out in rows:
            f.write(json.dumps({"t": t, "key": 1, "prompt": prompt, "output": out, "pid": pid,
                                "finish_reason": "length"}) + "\n")


def test_equal_outputs_across_engines_pass(tmp_path):
    write(tmp_path, 100, [(1.0, P1, GOOD1), (1.1, P2, GOOD2)])
    write(tmp_path, 200, [(2.0, P1, GOOD1), (2.1, P2, GOOD2), (3.0, P1, GOOD1)])
    assert tl.main([str(tmp_path)]) == 0
    rows = tl.compare(tl.read([str(tmp_path)]))
    assert [len(r["variants"]) for r in rows] == [1, 1]
    assert rows[0]["completions"] == 3 and rows[0]["engines"] == [100, 200]


def test_one_corrupted_token_is_found_with_its_position(tmp_path):
    # the negative control: one completion differs in one token, after the others
    write(tmp_path, 100, [(1.0, P1, GOOD1)])
    write(tmp_path, 200, [(2.0, P1, GOOD1[:2] + [99] + GOOD1[3:]), (3.0, P1, GOOD1)])
    assert tl.main([str(tmp_path)]) == 1
    (row,) = tl.compare(tl.read([str(tmp_path)]))
    assert [(v["count"], v["engines"], v["first_diff"]) for v in row["variants"]] == [(2, [100, 200], None), (1, [200], 2)]


def test_an_engine_that_computes_differently_shows_in_the_engine_summary(tmp_path):
    # the first engine is the odd one out: against the first output every later one differs,
    # against the majority only the first engine's
    write(tmp_path, 100, [(1.0, P1, [9, 9, 9, 9]), (1.1, P2, [8, 8, 8, 8])])
    write(tmp_path, 200, [(2.0, P1, GOOD1), (2.1, P2, GOOD2), (3.0, P1, GOOD1), (3.1, P2, GOOD2)])
    comps = tl.read([str(tmp_path)])
    first = tl.engine_summary(comps, "first")
    assert first[100]["differ"] == 0 and first[200]["differ"] == 4
    maj = tl.engine_summary(comps, "majority")
    assert maj[100]["differ"] == 2 and maj[200]["differ"] == 0


def test_a_shorter_output_differs_at_its_end_and_torn_lines_are_skipped(tmp_path, capsys):
    write(tmp_path, 100, [(1.0, P1, GOOD1), (2.0, P1, GOOD1[:3])])
    with open(tmp_path / "tokens-100.jsonl", "a") as f:
        f.write('{"t": 3.0, "prompt": [1, 2')          # cut by a SIGKILL mid-write
    (row,) = tl.compare(tl.read([str(tmp_path)]))
    assert [v["first_diff"] for v in row["variants"]] == [None, 3]
    assert "skipped" in capsys.readouterr().err


def test_reads_a_tar_gz_pack(tmp_path):
    d = tmp_path / "logs"
    d.mkdir()
    write(d, 100, [(1.0, P1, GOOD1)])
    write(d, 200, [(2.0, P1, GOOD1[:1] + [0, 0, 0])])
    pack = tmp_path / "tokens.tar.gz"
    with tarfile.open(pack, "w:gz") as tar:
        tar.add(d, arcname="tokens-run")
    out = tmp_path / "cmp.json"
    assert tl.main([str(pack), "--json", str(out)]) == 1
    assert json.loads(out.read_text())["prompts"][0]["variants"][1]["first_diff"] == 1


def test_the_failback_proof_reports_the_engines_token_logs(tmp_path):
    """The pattern the H200 showed at 14B (2026-11-30): the deployment's first engine gave
    the no-fault run, every later engine another output. Against the first output every
    later completion differs; against the majority only the first engine's do."""
    fb = _load("failback_proof")
    assert fb.engines_token_logs(str(tmp_path / "missing")) is None
    assert fb.engines_token_logs(str(tmp_path)) is None
    write(tmp_path, 100, [(1.0, P1, [9, 9, 9, 9]), (1.1, P2, GOOD2)])
    write(tmp_path, 200, [(2.0, P1, GOOD1), (2.1, P2, GOOD2), (3.0, P1, GOOD1)])
    r = fb.engines_token_logs(str(tmp_path))
    assert r["completions"] == 5 and r["prompts"] == 2
    assert r["first"]["prompts_with_several_outputs"] == 1
    assert r["first"]["engines"] == {"100": {"completions": 2, "differ": 0}, "200": {"completions": 3, "differ": 2}}
    assert r["majority"]["engines"] == {"100": {"completions": 2, "differ": 1}, "200": {"completions": 3, "differ": 0}}


def test_appended_outputs_are_read_back_as_the_engines_logs_are(tmp_path):
    """session.sh engine-repeat: margin_bound.py --token-log appends each process's outputs
    (bench.token_logs.append, the engines' format), compared across processes by read()."""
    import inspect
    import os

    tl.append(str(tmp_path), [P1, P2], [GOOD1, GOOD2])
    tl.append(str(tmp_path), [tuple(P1)], [tuple(GOOD1[:3] + [0])])   # the same process, later: another output
    (f,) = list(tmp_path.iterdir())
    assert f.name == f"tokens-{os.getpid()}.jsonl"
    rows = tl.compare(tl.read([str(tmp_path)]))
    assert [[v["first_diff"] for v in r["variants"]] for r in rows] == [[None, 3], [None]]
    assert "token_logs.append(args.token_log," in inspect.getsource(_load("margin_bound").main)


def test_the_reference_cross_check_compares_the_no_fault_runs_of_two_deployments(tmp_path):
    """The controls' deployment ran the same prompts with fewer tokens: its outputs must be a
    prefix of the run's no-fault outputs. On the H200 (2026-11-30) the run's first engine gave
    other outputs: this check would have stopped the proof after its first round."""
    fb = _load("failback_proof")
    ctl, run = tmp_path / "ctl", tmp_path / "run"
    ctl.mkdir()
    run.mkdir()
    assert fb.reference_cross_check(str(ctl), str(run)) is None          # no logs: controls off
    write(ctl, 100, [(1.0, P1, GOOD1[:2]), (1.1, P2, GOOD2[:2]), (1.2, [7, 7], [1, 2])])
    write(ctl, 101, [(2.0, P1, [5, 5])])                                   # a later, corrupted case: not the reference
    write(run, 200, [(3.0, P1, GOOD1), (3.1, P2, GOOD2)])
    cc = fb.reference_cross_check(str(ctl), str(run))
    assert (cc["prompts_compared"], cc["differ"]) == (2, 0), cc
    # the negative control: the run's first engine computed one token differently
    write(run, 300, [(0.5, P2, GOOD2[:1] + [0] + GOOD2[2:])])             # earlier: the run's no-fault output
    cc = fb.reference_cross_check(str(ctl), str(run))
    assert cc["differ"] == 1 and cc["diffs"] == [{"prompt_tokens": len(P2), "first_diff": 1, "compared_tokens": 2,
                                                  "controls_engine": 100, "run_engine": 300}], cc
    assert "computed different outputs" in cc["summary"]


def test_the_reference_cross_check_on_the_h200_logs(tmp_path):
    """The committed 14B logs of 2026-11-30, each lane's controls' deployment against its run:
    on GPU 0, whose run's first engine computed differently, 5 of the 6 shared prompts differ
    (the 6th agrees over the controls' 128 tokens: it first differs at token 137); on GPU 1 none."""
    import os
    import tarfile

    fb = _load("failback_proof")
    res = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "bench", "results", "2026-11-30-h200x2-vllm-exact-14b")
    got = {}
    for lane in ("gpu0", "gpu1"):
        for part in ("", "-controls"):
            with tarfile.open(os.path.join(res, f"tokens-14b-{lane}{part}.tar.gz")) as tar:
                tar.extractall(tmp_path / f"{lane}{part}", filter="data")
        cc = fb.reference_cross_check(str(tmp_path / f"{lane}-controls"), str(tmp_path / lane))
        got[lane] = (cc["prompts_compared"], cc["differ"])
    assert got == {"gpu0": (6, 5), "gpu1": (6, 0)}, got


def test_a_deployment_starts_with_no_token_logs_of_an_earlier_run(tmp_path):
    """A reused workdir: an earlier run's token logs would be read as this deployment's first
    completions (the no-fault reference) by the cross-check and the comparisons."""
    import argparse

    fb = _load("failback_proof")
    old = tmp_path / "tokens-d"
    old.mkdir()
    write(old, 1, [(0.1, P1, GOOD1)])
    (old / "notes.txt").write_text("kept")
    args = argparse.Namespace(frmps="frmps", python="python3", model="tiny", device="cpu", memory="host-shm", cpu=True,
                              sync_every=1, num_blocks=0, max_model_len=0, engine="ref", engine_arg=[], serve_arg=[],
                              port=0, mps_control="", env={})
    dep = fb.Deployment(args, "d", str(tmp_path))
    assert sorted(p.name for p in old.iterdir()) == ["notes.txt"] and dep.token_dir == str(old)
