#!/usr/bin/env python3
"""The OpenAI surface of `frmps serve --engine vllm` across real faults, through
either front door (--frontend: vLLM's own API server, or frmps's).

The feature matrix (bench/openai_matrix.py) shows which features work; this
shows that they keep working when the active engine dies mid-request. One
deployment (active in MPS, standby outside, the front door --frontend names). A set of requests that covers the matrix's features (completions and
chat, streamed and not, n > 1, batched prompts, logprobs/top_logprobs, echo,
penalties, logit_bias, stop strings, min_tokens, a JSON-schema response_format,
a structured-output regex, named/required/auto tool calls through the hermes
tool parser, the Responses API), each long enough to be in flight for seconds,
runs once without a fault (the reference) and then once per fault, all at the
same time: when every streamed request has received a few chunks, a co-located
MPS client faults (bench/faults triggers, rotating), the active dies, the
standby takes over, and every request must finish with no client error and the
same result as the reference: the same text and token ids per choice, the same
finish reasons, the same sampled tokens in logprobs (their values compared with
a tolerance and reported), the same tool calls and usage. For structured output
and tool calls the parsed result is reported as well. Between faults the proof
waits for the placement to be restored (failback), so every fault hits an
active inside MPS.

    python3 bench/gpu/openai_fault_proof.py --frmps bin/frmps --model <dir> --faults 3 --out fault-matrix.json

--cpu: the same sequence on the CPU with the labelled test doubles of the
--frontend vllm tests (engines `frmps_engine.vllm.testing:cpu_engine`, vLLM's CPU
platform in the frontend, the MPS control daemon's double, SIGKILL as the
fault): a check of this script, not of GPU faults. Needs the `openai` package.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from failback_proof import (FAKE_MPS, FAULTS, add_count_args, apply_prefill_chunk, engines, restored,  # noqa: E402
                            run_controls, spare_state, started)
from proof_load import wait_endpoint  # noqa: E402
from failover_proof import (Deployment, failover_after, failover_seq, get, mps_trigger,  # noqa: E402
                            stop_on_sigterm)

from bench import proofcount  # noqa: E402  (standard library only)

LOGPROB_TOL = 0.05  # |Δ logprob| reported above this (the tokens themselves must be equal)

WEATHER = {
    "type": "object",
    # city: letters only (a tool parser's strict json.loads refuses the raw control characters a
    # random model writes into a free string; see openai_matrix.TOOL_SCHEMA)
    "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"}, "unit": {"type": "string", "enum": ["c", "f"]},
                   # long enough to be in flight when the fault comes
                   "readings": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                                "minItems": 120, "maxItems": 120}},
    "required": ["city", "unit", "readings"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "Weather readings of a city.", "parameters": WEATHER}}]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c", "readings": [1, 2]}}\n</tool_call>'


def msgs(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def cases(n_tokens: int) -> list[dict]:
    """The requests: id, API, whether streamed, the body (the model is added later);
    real_model: needs a real model's logits (logprobs, grammar-constrained
    sampling), which the CPU check's stand-in model does not produce."""
    L, ie = n_tokens, {"ignore_eos": True}
    ids = {"return_token_ids": True}
    return [
        {"id": "cmpl-greedy-stream", "api": "cmpl", "stream": True,
         "body": dict(prompt="The quick brown fox", max_tokens=L, temperature=0, extra_body={**ie, **ids})},
        {"id": "cmpl-seeded-stream", "api": "cmpl", "stream": True,
         "body": dict(prompt="Once upon a time", max_tokens=L, temperature=1.0, seed=1234, extra_body={**ie, **ids})},
        {"id": "cmpl-n2-logprobs", "real_model": True, "api": "cmpl", "stream": False,
         "body": dict(prompt="Hello", max_tokens=L, temperature=0.9, seed=7, n=2, logprobs=2, extra_body={**ie, **ids})},
        {"id": "cmpl-n2-stream-unseeded", "api": "cmpl", "stream": True, "unseeded": True,
         "body": dict(prompt="Hello there", max_tokens=L, temperature=0.9, n=2, extra_body={**ie, **ids})},
        {"id": "cmpl-batch-greedy", "api": "cmpl", "stream": False,
         "body": dict(prompt=["Tell me a story.", "Count to ten."], max_tokens=L, temperature=0, extra_body={**ie, **ids})},
        {"id": "cmpl-echo-penalties-bias", "api": "cmpl", "stream": True,
         "body": dict(prompt="Repeat after me", max_tokens=L, temperature=0.7, seed=99, echo=True,
                      presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"100": 5},
                      extra_body={**ie, **ids, "repetition_penalty": 1.1, "min_tokens": 8})},
        {"id": "cmpl-stop-min-tokens", "api": "cmpl", "stream": True,
         "body": dict(prompt="A list:", max_tokens=L, temperature=0.8, seed=5, stop=["\n\n\n\n"],
                      extra_body={**ids, "min_tokens": L // 2})},
        # The prompt as token ids (filled in by prepare_cases from /tokenize); stop_token_ids: an id
        # the no-fault answer first produces past its middle (found by a request before the runs).
        # Seeded, not greedy: a greedy model with random weights loops, and a loop has no new id
        # past its middle (the H100 run of a62ee9e found none).
        {"id": "cmpl-token-ids-prompt-stop-ids", "api": "cmpl", "stream": True, "prompt_ids": "In the beginning",
         "stop_from": "ids", "body": dict(max_tokens=L, temperature=1.0, seed=31, extra_body={**ids})},
        {"id": "cmpl-regex", "real_model": True, "api": "cmpl", "stream": True,
         "body": dict(prompt="Code:", max_tokens=L, temperature=0,
                      extra_body={**ids, "structured_outputs": {"regex": "([a-c]{3}-[0-9]{2} ){%d}" % max(1, L // 8)}})},
        {"id": "chat-greedy-stream-usage", "api": "chat", "stream": True,
         "body": dict(messages=msgs("Say something."), max_completion_tokens=L, temperature=0,
                      stream_options={"include_usage": True}, extra_body=ie)},
        {"id": "chat-n2-seeded-logprobs-stream", "real_model": True, "api": "chat", "stream": True,
         "body": dict(messages=msgs("Tell me more."), max_tokens=L, temperature=1.0, seed=42, n=2, logprobs=True,
                      top_logprobs=3, extra_body=ie)},
        # stop: a string of the no-fault answer first seen past its middle (prepare_cases).
        {"id": "chat-stop-seeded-stream", "api": "chat", "stream": True, "stop_from": "text",
         "body": dict(messages=msgs("Write a long poem."), max_tokens=L, temperature=1.0, seed=2024)},
        {"id": "chat-json-object", "real_model": True, "api": "chat", "stream": False, "parse": "content",
         "body": dict(messages=msgs("Any JSON object."), max_tokens=L, temperature=0,
                      response_format={"type": "json_object"})},
        {"id": "chat-json-schema", "real_model": True, "api": "chat", "stream": True, "parse": "content",
         "body": dict(messages=msgs("Weather as JSON."), max_tokens=L, temperature=0,
                      response_format={"type": "json_schema",
                                       "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}})},
        {"id": "chat-tools-named", "real_model": True, "api": "chat", "stream": False, "parse": "tools",
         "body": dict(messages=msgs("Weather in Paris?"), tools=TOOLS, max_tokens=L, temperature=0,
                      tool_choice={"type": "function", "function": {"name": "get_weather"}})},
        {"id": "chat-tools-required-stream", "real_model": True, "api": "chat", "stream": True, "parse": "tools",
         "body": dict(messages=msgs("Weather in Paris?"), tools=TOOLS, max_tokens=L, temperature=0,
                      tool_choice="required")},
        {"id": "chat-tools-auto-parser-stream", "real_model": True, "api": "chat", "stream": True, "parse": "tools",
         "body": dict(messages=msgs("Weather in Paris?"), tools=TOOLS, tool_choice="auto", max_tokens=L,
                      temperature=0, extra_body={"structured_outputs": {"regex": auto_parser_regex(L)}})},
        {"id": "responses", "api": "responses", "stream": False,
         "body": dict(input="Say something.", max_output_tokens=L, temperature=0)},
        {"id": "responses-stream", "api": "responses", "stream": True,
         "body": dict(input="Say something else.", max_output_tokens=L, temperature=0)},
    ]


def prepare_cases(base: str, api_key: str, model: str, cs: list[dict]) -> dict:
    """Fill in what a case takes from the server before the runs. The tool-call
    cases get the matrix's logit_bias against JSON whitespace (see
    openai_matrix.no_ws_bias): with random weights a tool-call grammar's
    whitespace otherwise goes on to max_tokens. prompt_ids: the prompt as
    /tokenize's ids. stop_from ("ids": stop_token_ids = an id of a no-fault
    answer whose first occurrence is past the answer's middle; "text": stop = 4
    characters first seen there), so the stop comes after the fault. Returns
    the stops chosen, per case (None where the answer had no such id or text)."""
    import httpx
    import openai
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import openai_matrix as om
    chosen: dict = {}
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0, timeout=600)
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {api_key}"}, timeout=60) as http:
        tok = om.tokenize_via(http, model)
        ws = om.single_token_ids(tok, om.JSON_WS)
        for c in cs:
            if c.get("parse") == "tools" and "regex" not in json.dumps(c["body"].get("extra_body", {})):
                c["body"]["logit_bias"] = {str(i): -100 for i in ws}
            if c.get("prompt_ids"):
                c["body"]["prompt"] = tok(c.pop("prompt_ids"))
            how = c.get("stop_from")
            if not how:
                continue
            body = dict(c["body"], model=model)
            if c["api"] == "cmpl":
                r = client.completions.create(**body).model_dump()
                got = r["choices"][0].get("token_ids") or []
            else:
                got = client.chat.completions.create(**body).choices[0].message.content or ""
            pick = stop_after_middle(got, 1 if how == "ids" else 4)
            chosen[c["id"]] = pick
            if pick is None:
                print(f"warning: {c['id']}: the no-fault answer has no {how} first seen past its middle; "
                      "the case runs without its stop", flush=True)
            if pick is not None and how == "ids":
                c["body"].setdefault("extra_body", {})["stop_token_ids"] = [pick]
            elif pick is not None:
                c["body"]["stop"] = [pick]
    return chosen


def stop_after_middle(seq, width: int):
    """The first piece of seq (width items, a token id when width is 1) that starts
    past the middle and does not occur earlier; None when there is none."""
    for i in range(len(seq) // 2, len(seq) - width + 1):
        piece = seq[i] if width == 1 else seq[i:i + width]
        if width == 1 and piece not in seq[:i]:
            return piece
        if width > 1 and piece.strip() and piece not in seq[:i + width - 1]:
            return piece
    return None


def regex_literal(s: str) -> str:
    """A regex matching s alone: its metacharacters escaped, a newline written \\n.
    (re.escape also escapes spaces and puts a backslash before a raw newline, which
    xgrammar's regex reader warns of.)"""
    return "".join("\\n" if ch == "\n" else "\\" + ch if ch in "\\.^$|?*+()[]{}" else ch for ch in s)


def auto_parser_regex(max_tokens: int) -> str:
    """chat-tools-auto-parser-stream's regex: a third of max_tokens or so of words the
    model picks among (its choice depends on the KV cache; the stream is in flight
    when the fault comes), then the hermes call. Words, not a character class:
    under [a-z]{n} xgrammar (0.2.7, vLLM 0.26's; 0.2.8 too) puts in its bitmask 78
    tokens of the project's tokenizer (a letter and a lone byte: 0xC1, 0xE0, 0xF0)
    that its matcher then refuses, and vLLM's scheduler aborts the request
    ("grammar rejected tokens") before any fault.
    vllmpatch/tests/test_openai_fault_proof_grammars.py walks every regex case."""
    return "((Paris|Lyon|Nice) ){%d}\\n" % max(1, max_tokens // 6) + regex_literal(HERMES_CALL)


class Call(threading.Thread):
    """One request through the official openai client (no retries: a retry would
    hide a failure), its result normalised: per choice index the text, token ids,
    finish reason, logprobs' tokens and values, tool calls; usage; chunk times."""

    def __init__(self, base: str, api_key: str, model: str, case: dict):
        super().__init__(daemon=True)
        self.base, self.api_key, self.model, self.case = base, api_key, model, case
        self.choices: dict[int, dict] = {}
        self.usage: dict | None = None
        self.times: list[float] = []
        self.token_times: list[float] = []  # the chunks that carried output (text, token ids, tool calls)
        self._got = False
        self.t_start = self.t_end = 0.0
        self.error: str | None = None

    def ch(self, i: int) -> dict:
        return self.choices.setdefault(int(i or 0), {"text": "", "token_ids": [], "finish": None, "lp_tokens": [],
                                                     "lp_values": [], "top": [], "top_values": [], "tools": {}})

    def run(self) -> None:
        import openai
        c = self.case
        client = openai.OpenAI(base_url=f"{self.base}/v1", api_key=self.api_key, max_retries=0, timeout=600)
        body = dict(c["body"], model=self.model)
        self.t_start = time.time()
        try:
            if c["api"] == "cmpl":
                r = client.completions.create(stream=c["stream"], **body)
            elif c["api"] == "chat":
                r = client.chat.completions.create(stream=c["stream"], **body)
            else:
                r = client.responses.create(stream=c["stream"], **body)
            if c["stream"]:
                for ev in r:
                    t = time.time()
                    self.times.append(t)
                    self._got = False
                    self.take(ev.model_dump())
                    if self._got:
                        self.token_times.append(t)
            else:
                self.take(r.model_dump())
        except Exception as e:  # reported per case
            self.error = f"{type(e).__name__}: {e}"[:400]
        self.t_end = time.time()

    def take(self, d: dict) -> None:
        api = self.case["api"]
        if api == "responses":
            t = d.get("type")
            if t == "response.output_text.delta":
                self.ch(0)["text"] += d.get("delta") or ""
                self._got = self._got or bool(d.get("delta"))
            resp = d.get("response") if t else d
            if resp and (not t or t in ("response.completed", "response.incomplete")):
                self.ch(0)["final_text"] = "".join(
                    part.get("text") or "" for item in resp.get("output") or [] if item.get("type") == "message"
                    for part in item.get("content") or [])
                self.ch(0)["finish"] = resp.get("status")
                self.usage = {k: (resp.get("usage") or {}).get(k) for k in ("input_tokens", "output_tokens")}
                if not t:
                    self.ch(0)["text"] = self.ch(0)["final_text"]
            return
        if d.get("usage"):
            self.usage = {k: d["usage"].get(k) for k in ("prompt_tokens", "completion_tokens")}
        for c in d.get("choices") or []:
            o = self.ch(c.get("index"))
            if c.get("finish_reason"):
                o["finish"] = c["finish_reason"]
            o["token_ids"] += c.get("token_ids") or []
            self._got = self._got or bool(c.get("token_ids") or c.get("text")
                                          or (c.get("delta") or {}).get("content") or (c.get("delta") or {}).get("tool_calls"))
            if api == "cmpl":
                o["text"] += c.get("text") or ""
                lp = c.get("logprobs") or {}
                o["lp_tokens"] += lp.get("tokens") or []
                o["lp_values"] += [v for v in lp.get("token_logprobs") or []]
                for t in lp.get("top_logprobs") or []:
                    items = sorted((t or {}).items())
                    o["top"].append([k for k, _ in items])
                    o["top_values"].append([v for _, v in items])
                continue
            m = c.get("delta") or c.get("message") or {}
            o["text"] += m.get("content") or ""
            for k, tc in enumerate(m.get("tool_calls") or []):
                t = o["tools"].setdefault(int(tc.get("index", k) if tc.get("index") is not None else k),
                                          {"name": "", "arguments": ""})
                f = tc.get("function") or {}
                t["name"] += f.get("name") or ""
                t["arguments"] += f.get("arguments") or ""
            for e in (c.get("logprobs") or {}).get("content") or []:
                o["lp_tokens"].append(e.get("token"))
                o["lp_values"].append(e.get("logprob"))
                o["top"].append([t.get("token") for t in e.get("top_logprobs") or []])
                o["top_values"].append([t.get("logprob") for t in e.get("top_logprobs") or []])

    def result(self) -> dict:
        return {"choices": {str(k): v for k, v in sorted(self.choices.items())}, "usage": self.usage,
                "error": self.error, "chunks": len(self.times)}


def parsed(case: dict, res: dict) -> Any:
    """The parsed structured output / tool calls of choice 0 (None where it does not parse)."""
    o = res["choices"].get("0") or {}
    try:
        if case.get("parse") == "content":
            return json.loads(o.get("text") or "", strict=False)
        if case.get("parse") == "tools":
            return [{"name": t["name"], "arguments": json.loads(t["arguments"], strict=False)}
                    for _, t in sorted(o.get("tools", {}).items())] or None  # no call: nothing parsed
    except (json.JSONDecodeError, TypeError):
        return None
    return None


FIELDS = ("text", "token_ids", "finish", "lp_tokens", "top", "tools", "final_text")


def unstable_fields(ref: dict, ref2: dict) -> list[str]:
    """The fields of a case that already differ between two runs without a fault
    (e.g. how vLLM's streamed chat splits logprob entries over chunks depends on
    timing): they say nothing about a failover and are reported, not judged."""
    out = []
    for k, r in ref["choices"].items():
        r2 = ref2["choices"].get(k) or {}
        out += [f for f in FIELDS if r.get(f) != r2.get(f) and f not in out]
    return out


def top_tie(a: list, av: list, b: list, bv: list) -> bool:
    """Whether two top_logprobs entries of one position differ only by a tie: the
    same values, the alternatives both have with the same value in each, and every
    alternative only one of them has at that entry's lowest value, which the other
    also ends with. Which of two equally likely tokens makes the top k is not
    defined (vLLM takes torch.topk's, whose order among equal values depends on
    the kernel and the batch's shape; bf16 logits tie often), so such a difference
    says nothing about the KV cache."""
    if len(a) != len(b) or len(av) != len(a) or len(bv) != len(b) or not a:
        return False
    if any(v is None for v in (*av, *bv)) or sorted(av) != sorted(bv):
        return False
    da, db = dict(zip(a, av)), dict(zip(b, bv))
    if len(da) != len(a) or len(db) != len(b):
        return False
    lo = min(av)
    if any(da[t] != db[t] for t in da.keys() & db.keys()):
        return False
    return all(da[t] == lo for t in da.keys() - db.keys()) and all(db[t] == lo for t in db.keys() - da.keys())


def top_ties(r: dict, g: dict) -> list[int] | None:
    """The positions where two choices' top_logprobs differ, when every such
    difference is a tie (top_tie); None when one is not (or a list's length differs)."""
    a, b = r.get("top") or [], g.get("top") or []
    av, bv = r.get("top_values") or [], g.get("top_values") or []
    if len(a) != len(b) or len(av) != len(a) or len(bv) != len(b):
        return None
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            if not top_tie(x, av[i], y, bv[i]):
                return None
            out.append(i)
    return out


def compare(case: dict, ref: dict, got: dict, skip: list[str] = ()) -> dict:
    """Equal what must be equal (but the fields in skip); the largest logprob
    difference reported. verdict: "exact" or "inexact" (token ids judged by
    proofcount.verdict, the proofs' one definition); an unseeded case has no
    reference (each run samples its own seed): "completed" when every choice
    finished, else "failed", and never exact."""
    diffs, max_lp, ties = [], 0.0, []
    if case.get("unseeded"):
        ok = not got["error"] and all(o["finish"] for o in got["choices"].values()) and \
            len(got["choices"]) == len(ref["choices"])
        why = [f"error: {got['error']}"] if got["error"] else [] if ok else ["unfinished choice"]
        return {"exact": False, "verdict": "completed" if ok else "failed", "completed": ok, "diffs": why,
                "max_logprob_diff": None, "note": "unseeded: checked complete, not compared"}
    if got["error"]:
        return {"exact": False, "verdict": "inexact", "diffs": [f"error: {got['error']}"], "max_logprob_diff": None}
    if set(ref["choices"]) != set(got["choices"]):
        diffs.append(f"choices {sorted(got['choices'])} != {sorted(ref['choices'])}")
    for k, r in ref["choices"].items():
        g = got["choices"].get(k)
        if g is None:
            continue
        for f in FIELDS:
            same = (proofcount.verdict(r.get(f) or [], g.get(f) or []) == "exact" if f == "token_ids"
                    else r.get(f) == g.get(f))
            if f == "top" and not same and f not in skip:
                tied = top_ties(r, g)
                if tied is not None:  # only ties: reported, not a difference
                    same = True
                    ties += [f"choice {k} at {i}" for i in tied]
            if f not in skip and not same:
                a, b = r.get(f), g.get(f)
                if isinstance(a, (str, list)) and isinstance(b, (str, list)):
                    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    diffs.append(f"choice {k} {f}: first difference at {n} (len {len(b)} vs {len(a)})")
                else:
                    diffs.append(f"choice {k} {f}: {str(b)[:120]} != {str(a)[:120]}")
        for x, y in zip(r.get("lp_values") or [], g.get("lp_values") or []):
            if x is not None and y is not None:
                max_lp = max(max_lp, abs(float(x) - float(y)))
    if ref["usage"] != got["usage"]:
        diffs.append(f"usage {got['usage']} != {ref['usage']}")
    out = {"exact": not diffs, "verdict": "exact" if not diffs else "inexact", "diffs": diffs[:6],
           "max_logprob_diff": round(max_lp, 5)}
    if skip:
        out["not_judged"] = list(skip)
    if ties:
        out["top_ties"] = ties
    if case.get("parse"):
        p = parsed(case, got)
        out["parsed"] = p is not None
        out["parsed_equal"] = p is not None and p == parsed(case, ref)
    return out


def run_all(base: str, model: str, api_key: str, cs: list[dict], fire=None, min_chunks: int = 3) -> tuple[dict, dict]:
    """Every case at once; fire() (if given) when each streamed one has min_chunks
    chunks (or after 60 s). Returns results by case id and what fire() returned.
    The streamed Responses case does not gate the fault: vLLM's Responses stream
    sends its lifecycle events first and may hold the text deltas back."""
    calls = [Call(base, api_key, model, c) for c in cs]
    for c in calls:
        c.start()
    info: dict = {}
    if fire is not None:
        deadline = time.time() + 60
        while time.time() < deadline and not all(
                len(c.times) >= min_chunks or not c.is_alive() for c in calls if c.case["stream"] and c.case["api"] != "responses"):
            time.sleep(0.002)
        info = fire()
    for c in calls:
        c.join(900)
    out = {}
    for c in calls:
        r = c.result()
        r["seconds"], r["t_start"], r["t_end"] = round(c.t_end - c.t_start, 3), c.t_start, c.t_end
        r["token_times"] = list(c.token_times)
        r["chunk_s"] = [round(t - c.t_start, 3) for t in c.times[:min_chunks]]
        out[c.case["id"]] = r
    return out, info


def classify_case(case: dict, r: dict, t_fault: float | None, detect: float | None) -> dict:
    """A case's stream at the fault (proofcount): in flight from the injection to
    the detected death, its phase (unknown for a request answered in one piece)."""
    ev = [("fault", min(t_fault, detect), max(t_fault, detect))] if t_fault and detect else []
    return proofcount.classify(r["t_start"], r.get("token_times") or [], r.get("t_end") or r["t_start"], ev,
                               failed=bool(r.get("error")), streamed=bool(case["stream"]))


def against(args, report: dict, save, cs: list[dict], name: str) -> int:
    """--against: the no-fault run twice on a server of its own. 0 when every case
    completed both times with no error."""
    base, key = args.against.rstrip("/"), args.api_key or "EMPTY"
    report.update(against=args.against, runs=[])
    try:
        wait_endpoint(base, 300)
        report["prepared"] = prepare_cases(base, key, name, cs)
        runs = [run_all(base, name, key, cs)[0] for _ in range(2)]
    except Exception as ex:  # keep what was measured
        report["error"] = f"{type(ex).__name__}: {ex}"
        save()
        print("error:", report["error"], flush=True)
        return 1
    for i, run in enumerate(runs):
        report["runs"].append({k: {"error": r["error"], "finish": sorted({str(o.get("finish")) for o in r["choices"].values()})}
                               for k, r in run.items()})
    report["errors"] = {f"run {i + 1}: {k}": r["error"] for i, run in enumerate(runs) for k, r in run.items() if r["error"]}
    unstable = {c["id"]: unstable_fields(runs[0][c["id"]], runs[1][c["id"]]) for c in cs if not c.get("unseeded")}
    report["unstable_without_fault"] = {k: v for k, v in unstable.items() if v}
    report["reference"] = runs[0]
    save()
    for k, e in report["errors"].items():
        print(f"failed {k}: {e}", flush=True)
    print(f"against {args.against}: {len(cs)} cases x 2 runs, {len(report['errors'])} failed; differing between the "
          f"runs: {report['unstable_without_fault'] or 'nothing'}", flush=True)
    return 1 if report["errors"] else 0


def main() -> int:
    stop_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frmps", default="bin/frmps")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--model", required=True, help="a model directory (frmps model-dir writes one)")
    ap.add_argument("--served-model-name", default="")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--memory", default="cuda-vmm")
    ap.add_argument("--sync-every", type=int, default=1, help="frmps serve's default")
    ap.add_argument("--num-blocks", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=600, help="tokens per request (long enough to span the fault)")
    ap.add_argument("--faults", type=int, default=3)
    ap.add_argument("--fault-kinds", default=",".join(FAULTS))
    ap.add_argument("--faults-dir", default="bench/build/faults")
    ap.add_argument("--structured-outputs-config", default='{"backend": "xgrammar", "disable_any_whitespace": true}')
    ap.add_argument("--tool-call-parser", default="hermes")
    ap.add_argument("--frontend", choices=("vllm", "frmps"), default="vllm",
                    help="the OpenAI endpoint: vLLM's own API server (frmps serve --frontend vllm) or frmps's front door")
    ap.add_argument("--api-key", default="", help="serve with --api-key and send it")
    ap.add_argument("--workdir", default="/tmp/frmps-openai-faults")
    ap.add_argument("--out", default="openai_fault_proof.json")
    ap.add_argument("--engine-arg", action="append", default=[],
                    help="more engine flags (default --max-num-seqs=32: the cases run 18 sequences at once)")
    ap.add_argument("--serve-arg", action="append", default=[], help="more frmps serve flags")
    ap.add_argument("--cases", default="", help="comma list of case ids (default: all)")
    ap.add_argument("--against", default="",
                    help="no deployment, no controls, no faults: the cases' no-fault run, twice, against the OpenAI "
                         "server at this URL (e.g. `vllm serve` with the deployment's flags): does the server alone "
                         "complete every case, and which fields differ between two runs")
    ap.add_argument("--cpu", action="store_true", help="CPU check of this script (labelled test doubles, SIGKILL faults); "
                    "leaves out the cases that need a real model's logits (logprobs, grammars)")
    add_count_args(ap)
    ap.set_defaults(prefill_chunk=0, burst=0)  # the cases keep the engines' own chunk; controls: failback_proof's load
    args = ap.parse_args()
    apply_prefill_chunk(args)
    args.engine, args.port, args.mps_control, args.env = "vllm", 0, "", {}
    if not any(a.startswith("--max-num-seqs") for a in args.engine_arg):
        args.engine_arg.append("--max-num-seqs=32")
    name = args.served_model_name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    # The structured-outputs config as a user gives it: --vllm-arg reaches the API server and the engines.
    # The tool-calling flags as vllm serve's, which frmps serve takes for either front door.
    args.serve_arg = [*args.serve_arg, f"--frontend={args.frontend}", f"--served-model-name={name}",
                      "--enable-auto-tool-choice", f"--tool-call-parser={args.tool_call_parser}",
                      f"--vllm-arg=--structured-outputs-config={args.structured_outputs_config}"]
    if args.api_key:
        args.serve_arg.append(f"--api-key={args.api_key}")
    cs = [c for c in cases(args.max_tokens) if not (args.cpu and c.get("real_model"))]
    if args.cases:
        cs = [c for c in cs if c["id"] in set(args.cases.split(","))]
    if args.cpu:
        args.engine, args.device, args.memory, args.mps_control = "frmps_engine.vllm.testing:cpu_engine", "cpu", "host-shm", FAKE_MPS
        # --heartbeat-timeout: this checks the script; on a 2-core machine under a parallel test run, the
        # idle active's heartbeat thread was once held off its GIL for over the default second while
        # its standby imported vLLM, with no CPU wait to excuse it (the hang tests cover the default).
        args.serve_arg += ["--mps-control", FAKE_MPS, "--spare=on", "--max-restarts=1000", "--heartbeat-timeout=10s"]
        args.env["FRMPS_TEST_VLLM_CPU_PLATFORM"] = "1"
        args.seed_every_request = True  # the controls' requests too (see below)
        # The stand-in model samples seeded_token(seed, position) whatever the temperature:
        # a request without a seed gets a random one, so every compared case gets a seed.
        for i, c in enumerate(cs):
            if c["api"] == "responses":  # the SDK has no seed argument; vLLM's request takes one
                c["body"].setdefault("extra_body", {})["seed"] = 1000 + i
            elif not c.get("unseeded"):
                c["body"].setdefault("seed", 1000 + i)
    os.makedirs(args.workdir, exist_ok=True)
    t_begin = time.time()
    report: dict = {"model": args.model, "served_model_name": name, "device": args.device, "max_tokens": args.max_tokens,
                    "frontend": args.frontend,
                    "cpu_check": args.cpu, "cases": [], "faults": []}
    kinds = [k for k in args.fault_kinds.split(",") if k]
    def record_cases() -> None:
        report["cases"] = [{"id": c["id"], "api": c["api"], "stream": c["stream"],
                            "body": {k: v for k, v in c["body"].items() if k not in ("messages", "tools")}} for c in cs]

    record_cases()

    def save() -> None:
        report["elapsed_s"] = round(time.time() - t_begin, 1)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)

    if args.against:
        return against(args, report, save, cs, name)
    if not run_controls(args, report, save, kinds[0]):
        save()
        print(f"error: {report['error']}", flush=True)
        return 1
    dep = Deployment(args, "openai-faults", args.workdir)
    key = args.api_key or "EMPTY"
    try:
        dep.start()
        st, _ = dep.wait(lambda s: started(dep, s), 900, "active serving + standby ready")
        wait_endpoint(dep.base, 300)
        report["prepared"] = prepare_cases(dep.base, key, name, cs)
        record_cases()
        ref, _ = run_all(dep.base, name, key, cs)
        report["reference"] = ref
        save()
        bad = {k: r["error"] for k, r in ref.items() if r["error"]}
        if bad:  # nothing to compare them with: the other cases go on, and the proof fails (passed)
            report["failed_without_fault"] = bad
            print(f"the no-fault run failed {len(bad)} case(s), left out of the comparison: {bad}", flush=True)
            cs = [c for c in cs if c["id"] not in bad]
            if not cs:
                raise RuntimeError(f"the no-fault run failed every case: {bad}")
            record_cases()
        # A second run without a fault: what differs between the two is not the failover's doing.
        ref2, _ = run_all(dep.base, name, key, cs)
        unstable = {c["id"]: unstable_fields(ref[c["id"]], ref2[c["id"]]) for c in cs if not c.get("unseeded")}
        report["unstable_without_fault"] = {k: v for k, v in unstable.items() if v}
        report["reference_again"] = {k: ref2[k] for k, v in unstable.items() if v}
        for n in range(1, args.faults + 1):
            spec = kinds[(n - 1) % len(kinds)]
            rec: dict = {"n": n, "fault": spec}
            report["faults"].append(rec)
            st, _ = dep.wait(lambda s: restored(s, n - 1), 300, f"placement restored before fault {n}")
            if spare_state(st) not in ("", "ready") and not spare_state(st).startswith("off"):
                st, _ = dep.wait(lambda s: spare_state(s) == "ready" or spare_state(s).startswith("off"), 180,
                                 f"a ready spare before fault {n}")
            act = engines(st)["active"]
            rec["active_in_mps_before"] = bool(get(act, "in_mps"))
            n_fo = failover_seq(st)
            prepare, inject = mps_trigger(args, spec)(dep, act)
            prepare()
            got, inj = run_all(dep.base, name, key, cs, fire=inject)
            rec["inject"] = {k: v for k, v in inj.items() if k != "t_fault"}
            rec["inject"]["s_after_start"] = round(inj["t_fault"] - min(r["t_start"] for r in got.values()), 3)
            st, _ = dep.wait(lambda s: failover_after(s, n_fo), 120, "the failover record")
            fo = (get(st, "failovers") or [])[0]
            rec["failover"] = {k: get(fo, k) for k in ("cause", "ok", "duration_seconds", "resumed_requests")}
            detect = int(get(fo, "unix_nanos", default=0) or 0) / 1e9 or None
            rec["fault_to_detect_s"] = round(detect - inj["t_fault"], 4) if detect else None
            rec["cases"] = {}
            for c in cs:
                r = got[c["id"]]
                cl = classify_case(c, r, inj.get("t_fault"), detect)
                v = compare(c, ref[c["id"]], r, unstable.get(c["id"], []))
                rec["cases"][c["id"]] = {**v, "in_flight_at_fault": cl["in_flight"], "phase": cl["phase"],
                                         "max_abs_dlogprob": v.get("max_logprob_diff"),
                                         "seconds": r["seconds"], "chunks": r["chunks"],
                                         "first_chunks_s": r["chunk_s"]}
            rec["inexact_results"] = {k: got[k] for k, v in rec["cases"].items() if v["verdict"] in ("inexact", "failed")}
            rec["stream_count"] = proofcount.tally(
                [{"in_flight": v["in_flight_at_fault"], **v} for v in rec["cases"].values()])
            rec["headline"] = proofcount.headline(rec["stream_count"])
            print(f"fault {n} {spec}: in_mps={rec['active_in_mps_before']} failover={rec['failover']} "
                  f"{rec['headline']}", flush=True)
            for cid, v in rec["cases"].items():
                if v["verdict"] != "exact" or not v["in_flight_at_fault"]:
                    print(f"  {cid}: {v['verdict']} in_flight={v['in_flight_at_fault']} phase={v['phase']} {v['diffs']}",
                          flush=True)
            save()
    except Exception as ex:  # keep what was measured
        report["error"] = f"{type(ex).__name__}: {ex}"
        print("error:", report["error"], flush=True)
    finally:
        dep.stop()
        report["stream_count"] = proofcount.tally(
            [{"in_flight": v["in_flight_at_fault"], **v} for f in report["faults"] for v in (f.get("cases") or {}).values()])
        report["headline"] = proofcount.headline(report["stream_count"])
        save()
    print(table(report))
    print(report["headline"] + ("" if args.controls else " [controls OFF]"), flush=True)
    if report.get("failed_without_fault"):
        print(f"failed without a fault (not compared): {report['failed_without_fault']}", flush=True)
    return 0 if passed(report) else 1


def passed(report: dict) -> bool:
    """No error, no case that failed without a fault, at least one fault, every compared
    case exact and every unseeded one completed."""
    return bool(not report.get("error") and not report.get("failed_without_fault") and report["faults"] and all(
        v.get("verdict", "exact" if v["exact"] else "inexact") in ("exact", "completed")
        for f in report["faults"] for v in f.get("cases", {}).values()))


def table(report: dict) -> str:
    """Markdown: one row per case, one column per fault (exact / in flight)."""
    fs = report.get("faults") or []
    head = "| case | " + " | ".join(f"fault {f['n']} ({f['fault']})" for f in fs) + " |"
    lines = [head, "|" + "---|" * (len(fs) + 1)]
    for c in report.get("cases") or []:
        cells = []
        for f in fs:
            v = (f.get("cases") or {}).get(c["id"])
            if v is None:
                cells.append("–")
                continue
            verdict = v.get("verdict", "exact" if v["exact"] else "inexact")
            s = {"exact": "exact", "completed": "completed (unseeded)", "failed": "**failed** (unseeded)"}.get(
                verdict, "**differs**")
            if v.get("parse") is not None or "parsed_equal" in v:
                s += ", parsed equal" if v.get("parsed_equal") else (", not parsed" if not v.get("parsed") else ", parsed differs")
            if not v["in_flight_at_fault"]:
                s += " (not in flight)"
            if v.get("not_judged"):
                s += f" (not judged: {', '.join(v['not_judged'])}, unstable without a fault)"
            if v.get("top_ties"):
                s += f" (top_logprobs: {len(v['top_ties'])} tie(s) ordered otherwise)"
            if v.get("max_logprob_diff"):
                s += f", max Δlogprob {v['max_logprob_diff']}"
            cells.append(s)
        lines.append(f"| {c['id']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
