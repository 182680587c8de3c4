"""bench/openai_matrix.py, the OpenAI feature matrix: its helpers, and a run
against a real `frmps serve` (Go front door + reference engine on the CPU),
where the features the front door serves must pass and the ones it does not
must be reported as gaps, not crash the harness or pass by accident."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from e2e import deployment, require

openai = require("openai")
require("jsonschema")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("openai_matrix", os.path.join(REPO, "bench", "openai_matrix.py"))
matrix = importlib.util.module_from_spec(_spec)
sys.modules["openai_matrix"] = matrix  # dataclasses look their module up there
_spec.loader.exec_module(matrix)


def test_pick_stop_skips_replacement_characters_and_the_first_character():
    assert matrix.pick_stop("abcd") == "bc"
    assert matrix.pick_stop("a\ufffd\ufffdxy") == "xy"
    assert matrix.pick_stop("\ufffd\ufffd\ufffd") is None
    assert matrix.pick_stop("ab") is None


def test_parse_json_strict_then_lenient_then_fail():
    assert matrix.parse_json('{"a": 1}', "stop") == ({"a": 1}, "")
    obj, note = matrix.parse_json('{"a": "x\x00y"}', "stop")
    assert obj == {"a": "x\x00y"} and "control characters" in note
    with pytest.raises(matrix.Fail, match="not JSON"):
        matrix.parse_json('{"a": "unterminated', "length")


def test_table_cells_are_one_line_and_escape_bars(tmp_path):
    runs = []
    for label, outcome, detail in (("a", "pass", "ok"), ("b", "fail", "x | y\nz\x00")):
        p = tmp_path / f"{label}.json"
        p.write_text(json.dumps({"label": label, "results": [
            {"id": "r1", "group": "g", "what": "w", "outcome": outcome, "detail": detail, "seconds": 0.1}]}))
        runs.append(str(p))
    out = matrix.table(runs)
    row = next(line for line in out.splitlines() if line.startswith("| `r1`"))
    assert row == "| `r1` | w | pass | **fail**: x \\| y z\\x00 |"
    assert out.splitlines()[-1] == "| | **total** | 1/1 pass | 0/1 pass |"


def test_unknown_row_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        matrix.main(["--base-url", "http://127.0.0.1:1", "--only", "no-such-row"])
    assert e.value.code == 2
    assert "unknown rows" in capsys.readouterr().err


@pytest.mark.torch
@pytest.mark.timeout(300)
def test_matrix_against_frmps_front_door(tmp_path):
    out = tmp_path / "frmps.json"
    # The tools' system turn is ~770 byte tokens: a context of 2048.
    with deployment(extra_args=["--max-model-len=2048", "--enable-auto-tool-choice", "--tool-call-parser=hermes"]) as dep:
        # The reference engine's byte tokenizer: '}' is byte 125, <|im_end|> is 258.
        rc = matrix.main(["--base-url", dep.base, "--label", "frmps", "--out", str(out),
                          "--eos-token-id", "258", "--close-brace-id", "125"])
    assert rc == 0
    got = {r["id"]: r for r in json.loads(out.read_text())["results"]}
    assert set(got) == {r.id for r in matrix.ROWS}
    served = ["models", "tokenize", "tokenize-chat", "detokenize", "cmpl", "cmpl-stream-usage", "cmpl-token-ids-prompt",
              "cmpl-batch", "cmpl-n", "cmpl-n-stream", "cmpl-logprobs", "cmpl-echo", "cmpl-stop", "cmpl-stop-token-ids",
              "cmpl-seed", "cmpl-logit-bias", "cmpl-min-tokens", "cmpl-penalties", "cmpl-regex", "chat",
              "chat-stream-usage", "chat-max-completion-tokens", "chat-n", "chat-logprobs", "chat-stop", "chat-json-object",
              "responses", "responses-stream", "chat-tools-named", "chat-tools-required", "chat-tools-auto-parser",
              "chat-tools-auto-stream"]
    for rid in served:
        assert got[rid]["outcome"] == "pass", (rid, got[rid]["detail"])
    # ...and parameters the front door drops without a word are caught by
    # their semantic checks, not passed because the request succeeded.
    # (chat-json-schema: the grammar holds, but a random model wanders in the whitespace it allows
    # until max_tokens, as vllm serve's does without disable_any_whitespace.)
    assert got["chat-json-schema"]["outcome"] == "fail", got["chat-json-schema"]
