#!/usr/bin/env python3
"""Feature matrix of an OpenAI-compatible server: the routes and request
parameters of vLLM's OpenAI server, each sent with the official ``openai``
client (``httpx`` for vLLM's own routes) and judged by what the response
means, not only by its status.

With dummy (random) weights the text is noise, so the checks judge structure
and semantics that hold for any weights: token counts, indices, that a stream
concatenates to the non-streamed greedy answer, that a stop string cuts the
greedy answer where it first occurs, that a +100 logit bias makes every token
that one token, that ``min_tokens`` holds back a forced end-of-sequence, that
structured output parses and validates against its JSON schema, that tool
calls parse. Rows that need the model's tokenizer to be Qwen2.5's (a tool
call in the ``hermes`` format, the end-of-sequence id) take it from flags.

    python bench/openai_matrix.py --base-url http://127.0.0.1:8000 --label "vllm serve" \\
        --out DIR/vllm.json
    python bench/openai_matrix.py --table DIR/vllm.json DIR/frmps.json > DIR/README-table.md

Outcomes: ``pass``; ``fail`` (answered, but the answer is wrong: the reason
says how); ``refused`` (an HTTP error: status and message); ``error`` (the
harness could not get an answer: connection, timeout). Exit status 0 when
every row ran, whatever the outcomes; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from typing import Any

import httpx
import jsonschema
import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from openai_matrix_base import (  # noqa: E402,F401  (the tests and openai_fault_proof read them here)
    MAX_TOKENS, Fail, Ctx, Row, Result, ROWS, row, check, greedy, token_ids, PROMPTS, pick_stop, chat_msgs, WEATHER_SCHEMA,
    TOOL_SCHEMA, TOOLS, HERMES_CALL, parse_json, brace_id, single_token_ids, JSON_WS, tokenize_via, no_ws_bias,
    regex_escape, tool_call_args)

# ------------------------------------------------------------------ rows: models, tokenizer routes

@row("models", "models", "GET /v1/models: the served model, with max_model_len")
def _models(ctx: Ctx) -> str:
    data = ctx.client.models.list().data
    ids = [m.id for m in data]
    check(ctx.model in ids, f"{ctx.model!r} not in {ids}")
    m = next(m for m in data if m.id == ctx.model)
    mml = (m.model_extra or {}).get("max_model_len")
    check(isinstance(mml, int) and mml > 0, f"max_model_len {mml!r}")
    return f"{ids}, max_model_len {mml}"


@row("tokenize", "tokenizer", "POST /tokenize {prompt}: count = len(tokens)")
def _tokenize(ctx: Ctx) -> str:
    r = ctx.http.post("/tokenize", json={"model": ctx.model, "prompt": "Hello, world"})
    r.raise_for_status()
    b = r.json()
    check(isinstance(b.get("tokens"), list) and b["tokens"], f"tokens {b.get('tokens')!r}")
    check(b.get("count") == len(b["tokens"]), f"count {b.get('count')} vs {len(b['tokens'])} tokens")
    ctx.cache["tokens"] = b["tokens"]
    return f"{b['count']} tokens"


@row("tokenize-chat", "tokenizer", "POST /tokenize {messages}: the chat template applied (more tokens than the text)")
def _tokenize_chat(ctx: Ctx) -> str:
    r = ctx.http.post("/tokenize", json={"model": ctx.model, "messages": chat_msgs("Hello, world"),
                                         "add_generation_prompt": True})
    r.raise_for_status()
    b = r.json()
    plain = ctx.http.post("/tokenize", json={"model": ctx.model, "prompt": "Hello, world"}).json()
    check(b.get("count") == len(b.get("tokens", [])), "count != len(tokens)")
    check(b["count"] > plain["count"], f"{b['count']} tokens with the template vs {plain['count']} without")
    return f"{b['count']} tokens (text alone {plain['count']})"


@row("detokenize", "tokenizer", "POST /detokenize of /tokenize's ids gives the text back")
def _detokenize(ctx: Ctx) -> str:
    r = ctx.http.post("/tokenize", json={"model": ctx.model, "prompt": "Hello, world"})
    r.raise_for_status()
    d = ctx.http.post("/detokenize", json={"model": ctx.model, "tokens": r.json()["tokens"]})
    d.raise_for_status()
    text = d.json().get("prompt")
    check(text == "Hello, world", f"round trip gave {text!r}")
    return "round trip exact"


# ------------------------------------------------------------------ rows: completions

@row("cmpl", "completions", "non-streaming, ignore_eos: max_tokens tokens, finish length, usage")
def _cmpl(ctx: Ctx) -> str:
    r = ctx.client.completions.create(model=ctx.model, prompt="Hello", max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
    check(r.object == "text_completion", f"object {r.object!r}")
    check(len(r.choices) == 1 and isinstance(r.choices[0].text, str), "one text choice")
    check(r.choices[0].finish_reason == "length", f"finish_reason {r.choices[0].finish_reason!r}")
    check(r.usage.completion_tokens == MAX_TOKENS, f"completion_tokens {r.usage.completion_tokens}")
    check(r.usage.total_tokens == r.usage.prompt_tokens + MAX_TOKENS, "total != prompt + completion")
    return f"prompt {r.usage.prompt_tokens} + {MAX_TOKENS} tokens"


@row("cmpl-stream-usage", "completions",
     "stream + stream_options.include_usage: one id, text = non-streamed greedy text, usage chunk last")
def _cmpl_stream(ctx: Ctx) -> str:
    full = greedy(ctx)
    chunks = list(ctx.client.completions.create(
        model=ctx.model, prompt="The quick brown fox", max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    check(len({c.id for c in chunks}) == 1, "several ids in one stream")
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    check(text == full.choices[0].text, f"stream {text!r} != non-stream {full.choices[0].text!r}")
    last = chunks[-1]
    check(last.usage is not None and last.usage.completion_tokens == 16, f"last chunk usage {last.usage}")
    check(all(c.usage is None for c in chunks[:-1]), "usage on a chunk before the last")
    return f"{len(chunks)} chunks"


@row("cmpl-token-ids-prompt", "completions",
     "prompt as token ids: usage counts them; same answer as the text prompt when the server says its ids")
def _cmpl_ids(ctx: Ctx) -> str:
    full = greedy(ctx)
    pids = (full.choices[0].model_extra or {}).get("prompt_token_ids") or (full.model_extra or {}).get("prompt_token_ids")
    if not pids:
        tk = ctx.http.post("/tokenize", json={"model": ctx.model, "prompt": "The quick brown fox"})
        pids = tk.json().get("tokens") if tk.status_code == 200 else None
    known = bool(pids)
    ids = pids or [100, 101, 102, 103]
    r = ctx.client.completions.create(model=ctx.model, prompt=ids, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
    check(r.usage.prompt_tokens == len(ids), f"prompt_tokens {r.usage.prompt_tokens} for {len(ids)} ids")
    check(r.usage.completion_tokens == 16, f"completion_tokens {r.usage.completion_tokens}")
    if known:
        check(r.choices[0].text == full.choices[0].text, "token-id prompt gave a different answer")
        return f"{len(ids)} ids, same answer"
    return f"{len(ids)} ids (the server gave no prompt ids to compare answers)"


@row("cmpl-batch", "completions", "prompt = [2 prompts]: 2 choices, index 0 and 1, each its own greedy answer")
def _cmpl_batch(ctx: Ctx) -> str:
    a = greedy(ctx, "The quick brown fox", 16)
    b = greedy(ctx, "Once upon a time", 16)
    r = ctx.client.completions.create(model=ctx.model, prompt=["The quick brown fox", "Once upon a time"],
                                      max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    check(sorted(c.index for c in r.choices) == [0, 1], f"indices {[c.index for c in r.choices]}")
    by = {c.index: c.text for c in r.choices}
    check(by[0] == a.choices[0].text and by[1] == b.choices[0].text, "a batched answer differs from its single one")
    check(r.usage.completion_tokens == 32, f"completion_tokens {r.usage.completion_tokens}")
    return "2 choices"


@row("cmpl-n", "completions", "n=3, temperature 1, seed: 3 choices, indices 0..2, usage 3 × max_tokens")
def _cmpl_n(ctx: Ctx) -> str:
    r = ctx.client.completions.create(model=ctx.model, prompt="Hello", max_tokens=MAX_TOKENS, n=3, temperature=1.0,
                                      seed=5, extra_body={"ignore_eos": True})
    check(sorted(c.index for c in r.choices) == [0, 1, 2], f"indices {[c.index for c in r.choices]}")
    check(r.usage.completion_tokens == 3 * MAX_TOKENS, f"completion_tokens {r.usage.completion_tokens}")
    return f"{len({c.text for c in r.choices})} distinct texts"


@row("cmpl-n-stream", "completions", "n=2 streamed: chunks of both indices, each ends with a finish_reason")
def _cmpl_n_stream(ctx: Ctx) -> str:
    chunks = list(ctx.client.completions.create(model=ctx.model, prompt="Hello", max_tokens=MAX_TOKENS, n=2,
                                                temperature=1.0, seed=5, stream=True,
                                                extra_body={"ignore_eos": True}))
    fins = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason}
    check(fins == {0: "length", 1: "length"}, f"finish reasons {fins}")
    return f"{len(chunks)} chunks"


@row("cmpl-logprobs", "completions", "logprobs=3: one entry per token, token_logprobs ≤ 0, ≥ 3 top_logprobs each")
def _cmpl_logprobs(ctx: Ctx) -> str:
    # Tokens as "token_id:N": with a random model distinct ids often decode to
    # the same text, which would merge their top_logprobs entries.
    r = ctx.client.completions.create(model=ctx.model, prompt="Hello", max_tokens=MAX_TOKENS, temperature=0,
                                      logprobs=3, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    check(lp is not None, "logprobs null")
    check(len(lp.tokens) == MAX_TOKENS and len(lp.token_logprobs) == MAX_TOKENS, f"{len(lp.tokens)} tokens")
    check(all(x <= 0 for x in lp.token_logprobs), "a logprob > 0")
    check(all(len(t) >= 3 for t in lp.top_logprobs), "fewer than 3 top_logprobs")
    # Greedy: the sampled token is the most likely one.
    check(all(abs(lp.token_logprobs[i] - max(lp.top_logprobs[i].values())) < 1e-3 for i in range(MAX_TOKENS)),
          "greedy token is not the top logprob")
    return "ok"


@row("cmpl-echo", "completions", "echo=true: the text starts with the prompt")
def _cmpl_echo(ctx: Ctx) -> str:
    r = ctx.client.completions.create(model=ctx.model, prompt="Hello there", max_tokens=4, temperature=0, echo=True,
                                      extra_body={"ignore_eos": True})
    check(r.choices[0].text.startswith("Hello there"), f"text {r.choices[0].text[:40]!r}")
    return "ok"


@row("cmpl-stop", "completions", "stop=[s], s taken from the greedy answer: text cut before s's first occurrence, finish stop")
def _cmpl_stop(ctx: Ctx) -> str:
    for prompt in PROMPTS:
        stop = pick_stop(greedy(ctx, prompt).choices[0].text)
        if stop:
            break
    check(stop is not None, "no greedy answer with text to pick a stop string from")
    text = greedy(ctx, prompt).choices[0].text
    want = text[: text.index(stop)]
    r = ctx.client.completions.create(model=ctx.model, prompt=prompt, max_tokens=16, temperature=0,
                                      stop=[stop], extra_body={"ignore_eos": True})
    c = r.choices[0]
    check(c.finish_reason == "stop", f"finish_reason {c.finish_reason!r}")
    check(c.text == want, f"text {c.text!r}, want {want!r}")
    return f"stop {stop!r}"


@row("cmpl-stop-token-ids", "completions", "stop_token_ids=[the greedy answer's 5th id]: stops there, finish stop")
def _cmpl_stop_ids(ctx: Ctx) -> str:
    ids = token_ids(greedy(ctx).choices[0])
    stop = ids[4]
    want = ids.index(stop) + 1
    r = ctx.client.completions.create(model=ctx.model, prompt="The quick brown fox", max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True, "stop_token_ids": [stop]})
    check(r.choices[0].finish_reason == "stop", f"finish_reason {r.choices[0].finish_reason!r}")
    check(r.usage.completion_tokens == want, f"{r.usage.completion_tokens} tokens, want {want}")
    return f"stopped after {want}"


@row("cmpl-seed", "completions", "seed: temperature 1 twice with one seed → same text; another seed → different ids")
def _cmpl_seed(ctx: Ctx) -> str:
    def go(seed: int) -> Any:
        return ctx.client.completions.create(model=ctx.model, prompt="Hello", max_tokens=16, temperature=1.0, seed=seed,
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
    a, b, c = go(7), go(7), go(8)
    check(token_ids(a.choices[0]) == token_ids(b.choices[0]), "same seed, different output")
    check(token_ids(a.choices[0]) != token_ids(c.choices[0]), "different seeds, same 16 tokens")
    return "ok"


@row("cmpl-logit-bias", "completions", "logit_bias {id: 100}, greedy: every token is that id")
def _cmpl_bias(ctx: Ctx) -> str:
    r = ctx.client.completions.create(model=ctx.model, prompt="Hello", max_tokens=MAX_TOKENS, temperature=0,
                                      logit_bias={str(ctx.bias_token_id): 100},
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = token_ids(r.choices[0])
    check(ids == [ctx.bias_token_id] * MAX_TOKENS, f"ids {ids}")
    return "ok"


@row("cmpl-min-tokens", "completions",
     "EOS forced by logit_bias: 1 token, finish stop; with min_tokens=5: 5 more tokens first (6, finish stop)")
def _cmpl_min_tokens(ctx: Ctx) -> str:
    def go(extra: dict) -> Any:
        return ctx.client.completions.create(model=ctx.model, prompt="Hello", max_tokens=16, temperature=0,
                                             logit_bias={str(ctx.eos_token_id): 100}, extra_body=extra)
    a = go({})
    check(a.choices[0].finish_reason == "stop" and a.usage.completion_tokens == 1,
          f"without min_tokens: {a.usage.completion_tokens} tokens, {a.choices[0].finish_reason} (EOS not forced)")
    b = go({"min_tokens": 5})
    check(b.choices[0].finish_reason == "stop" and b.usage.completion_tokens == 6,
          f"min_tokens=5: {b.usage.completion_tokens} tokens, finish {b.choices[0].finish_reason}")
    return "1 → 6 tokens"


@row("cmpl-penalties", "completions",
     "presence/frequency/repetition penalties: accepted; greedy output changes when the unpenalized one repeats a token")
def _cmpl_penalties(ctx: Ctx) -> str:
    base = token_ids(greedy(ctx).choices[0])
    r = ctx.client.completions.create(model=ctx.model, prompt="The quick brown fox", max_tokens=16, temperature=0,
                                      presence_penalty=2.0, frequency_penalty=2.0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True,
                                                  "repetition_penalty": 2.0})
    ids = token_ids(r.choices[0])
    check(len(ids) == 16, f"{len(ids)} tokens")
    if len(set(base)) < len(base):
        check(ids != base, "the unpenalized greedy answer repeats tokens and the penalized one is identical")
        return f"changed ({len(set(base))}/{len(base)} distinct → {len(set(ids))}/{len(ids)})"
    return "accepted (the unpenalized answer has no repeat: effect not judged)"


# ------------------------------------------------------------------ rows: chat

@row("chat", "chat", "non-streaming: assistant message, finish length, usage")
def _chat(ctx: Ctx) -> str:
    r = ctx.client.chat.completions.create(model=ctx.model, messages=chat_msgs(), max_tokens=MAX_TOKENS,
                                           temperature=0, extra_body={"ignore_eos": True})
    check(r.object == "chat.completion", f"object {r.object!r}")
    m = r.choices[0].message
    check(m.role == "assistant" and isinstance(m.content, str), f"message {m}")
    check(r.choices[0].finish_reason == "length", f"finish_reason {r.choices[0].finish_reason!r}")
    check(r.usage.completion_tokens == MAX_TOKENS, f"completion_tokens {r.usage.completion_tokens}")
    ctx.cache["chat"] = m.content
    return f"prompt {r.usage.prompt_tokens} tokens"


@row("chat-stream-usage", "chat", "stream + include_usage: role first, text = non-streamed greedy text, usage chunk with choices []")
def _chat_stream(ctx: Ctx) -> str:
    if "chat" not in ctx.cache:
        _chat(ctx)
    chunks = list(ctx.client.chat.completions.create(
        model=ctx.model, messages=chat_msgs(), max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    check(chunks[0].choices and chunks[0].choices[0].delta.role == "assistant", "first delta has no role")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check(text == ctx.cache["chat"], f"stream {text!r} != non-stream {ctx.cache['chat']!r}")
    check(chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS, "no final usage chunk")
    return f"{len(chunks)} chunks"


@row("chat-max-completion-tokens", "chat", "max_completion_tokens honoured")
def _chat_mct(ctx: Ctx) -> str:
    r = ctx.client.chat.completions.create(model=ctx.model, messages=chat_msgs(), max_completion_tokens=5,
                                           temperature=0, extra_body={"ignore_eos": True})
    check(r.usage.completion_tokens == 5, f"completion_tokens {r.usage.completion_tokens}")
    return "ok"


@row("chat-n", "chat", "n=2, seed: 2 choices, indices 0 and 1, usage 2 × max_tokens")
def _chat_n(ctx: Ctx) -> str:
    r = ctx.client.chat.completions.create(model=ctx.model, messages=chat_msgs(), max_tokens=MAX_TOKENS, n=2,
                                           temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    check(sorted(c.index for c in r.choices) == [0, 1], f"indices {[c.index for c in r.choices]}")
    check(r.usage.completion_tokens == 2 * MAX_TOKENS, f"completion_tokens {r.usage.completion_tokens}")
    return "ok"


@row("chat-logprobs", "chat", "logprobs + top_logprobs=2: one entry per token, 2 alternatives each, greedy = top")
def _chat_logprobs(ctx: Ctx) -> str:
    r = ctx.client.chat.completions.create(model=ctx.model, messages=chat_msgs(), max_tokens=MAX_TOKENS,
                                           temperature=0, logprobs=True, top_logprobs=2,
                                           extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    check(lp is not None and lp.content is not None, "logprobs null")
    check(len(lp.content) == MAX_TOKENS, f"{len(lp.content)} entries")
    for e in lp.content:
        check(len(e.top_logprobs) == 2, f"{len(e.top_logprobs)} top_logprobs")
        check(abs(e.logprob - max(t.logprob for t in e.top_logprobs)) < 1e-3, "greedy token is not the top logprob")
    return "ok"


@row("chat-stop", "chat", "stop=[s] from a seeded answer: the same answer cut before s's first occurrence, finish stop")
def _chat_stop(ctx: Ctx) -> str:
    # Seeded sampling, not greedy: a random model's greedy chat answer is
    # often a loop of ids that never decode to text.
    msgs = chat_msgs("Hello")
    for seed in range(1, 6):
        text = ctx.client.chat.completions.create(model=ctx.model, messages=msgs, max_tokens=16, temperature=1.0,
                                                  seed=seed, extra_body={"ignore_eos": True}
                                                  ).choices[0].message.content or ""
        stop = pick_stop(text)
        if stop:
            break
    check(stop is not None, "no seeded answer with text to pick a stop string from")
    r = ctx.client.chat.completions.create(model=ctx.model, messages=msgs, max_tokens=16, temperature=1.0, seed=seed,
                                           stop=[stop], extra_body={"ignore_eos": True})
    want = text[: text.index(stop)]
    check(r.choices[0].finish_reason == "stop", f"finish_reason {r.choices[0].finish_reason!r}")
    check(r.choices[0].message.content == want, f"content {r.choices[0].message.content!r}, want {want!r}")
    return f"seed {seed}, stop {stop!r}"


@row("chat-json-schema", "structured outputs",
     "response_format json_schema: the content parses and validates against the schema")
def _chat_json_schema(ctx: Ctx) -> str:
    r = ctx.client.chat.completions.create(
        model=ctx.model, messages=chat_msgs("Weather as JSON."), max_tokens=ctx.tool_max_tokens, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER_SCHEMA,
                                                                "strict": True}})
    content = r.choices[0].message.content or ""
    obj, note = parse_json(content, r.choices[0].finish_reason)
    try:
        jsonschema.validate(obj, WEATHER_SCHEMA)
    except jsonschema.ValidationError as e:
        raise Fail(f"does not validate: {e.message}") from None
    return json.dumps(obj) + note


@row("chat-json-object", "structured outputs",
     "response_format json_object, '}' and '{}' pushed by logit_bias +100: the content is a JSON object (without the grammar: '}}}…')")
def _chat_json_object(ctx: Ctx) -> str:
    # A random model inside a free JSON string rarely closes it; a '}' bias
    # ends the object at once where the grammar allows it, and shows the
    # grammar is applied (unconstrained, every token would be '}'). '{}' too,
    # where it is one token: else the first token may be '{"', which opens a
    # string where '}' is just text.
    bias = {str(brace_id(ctx)): 100}
    bias.update({str(i): 100 for i in single_token_ids(tokenize_via(ctx.http, ctx.model), ["{}"])})
    r = ctx.client.chat.completions.create(
        model=ctx.model, messages=chat_msgs("JSON please."), max_tokens=ctx.tool_max_tokens, temperature=0,
        response_format={"type": "json_object"}, logit_bias=bias)
    content = r.choices[0].message.content or ""
    obj, note = parse_json(content, r.choices[0].finish_reason)
    check(isinstance(obj, dict), f"a {type(obj).__name__}, not an object")
    return f"{content[:40]!r}{note}"


@row("cmpl-regex", "structured outputs", "completions with structured_outputs.regex: the text matches the regex")
def _cmpl_regex(ctx: Ctx) -> str:
    import re
    pat = r"[a-c]{3}-[0-9]{2}"
    r = ctx.client.completions.create(model=ctx.model, prompt="Code:", max_tokens=16, temperature=0,
                                      extra_body={"structured_outputs": {"regex": pat}})
    check(re.fullmatch(pat, r.choices[0].text) is not None, f"text {r.choices[0].text!r}")
    return r.choices[0].text


@row("chat-tools-named", "tools",
     "tools + tool_choice {function get_weather}, JSON whitespace biased out: one tool call whose arguments validate")
def _tools_named(ctx: Ctx) -> str:
    r = ctx.client.chat.completions.create(
        model=ctx.model, messages=chat_msgs("Weather in Paris?"), tools=TOOLS, max_tokens=ctx.tool_max_tokens,
        temperature=0, tool_choice={"type": "function", "function": {"name": "get_weather"}}, logit_bias=no_ws_bias(ctx))
    tcs = r.choices[0].message.tool_calls or []
    check(len(tcs) == 1, f"{len(tcs)} tool calls (finish {r.choices[0].finish_reason})")
    return json.dumps(tool_call_args(tcs[0]))


@row("chat-tools-required", "tools", "tools + tool_choice required, JSON whitespace biased out: ≥ 1 tool call, arguments validate")
def _tools_required(ctx: Ctx) -> str:
    r = ctx.client.chat.completions.create(
        model=ctx.model, messages=chat_msgs("Weather in Paris?"), tools=TOOLS, max_tokens=ctx.tool_max_tokens,
        temperature=0, tool_choice="required", logit_bias=no_ws_bias(ctx))
    tcs = r.choices[0].message.tool_calls or []
    check(len(tcs) >= 1, f"no tool call (finish {r.choices[0].finish_reason})")
    for tc in tcs:
        tool_call_args(tc)
    return f"{len(tcs)} call(s)"


@row("chat-tools-auto-parser", "tools",
     "tools + tool_choice auto, output in the hermes format (forced by a regex): the tool parser returns the call, finish tool_calls")
def _tools_auto(ctx: Ctx) -> str:
    r = ctx.client.chat.completions.create(
        model=ctx.model, messages=chat_msgs("Weather in Paris?"), tools=TOOLS, tool_choice="auto",
        max_tokens=ctx.tool_max_tokens, temperature=0,
        extra_body={"structured_outputs": {"regex": regex_escape(HERMES_CALL)}})
    c = r.choices[0]
    tcs = c.message.tool_calls or []
    check(len(tcs) == 1, f"{len(tcs)} tool calls; content {(c.message.content or '')[:80]!r}")
    args = tool_call_args(tcs[0])
    check(args == {"city": "Paris", "unit": "c"}, f"arguments {args}")
    check(c.finish_reason == "tool_calls", f"finish_reason {c.finish_reason!r}")
    return "parsed"


@row("chat-tools-auto-stream", "tools", "the same, streamed: tool-call deltas assemble to the call")
def _tools_auto_stream(ctx: Ctx) -> str:
    chunks = list(ctx.client.chat.completions.create(
        model=ctx.model, messages=chat_msgs("Weather in Paris?"), tools=TOOLS, tool_choice="auto",
        max_tokens=ctx.tool_max_tokens, temperature=0, stream=True,
        extra_body={"structured_outputs": {"regex": regex_escape(HERMES_CALL)}}))
    name, args, ids = "", "", set()
    for ch in chunks:
        for c in ch.choices:
            for tc in c.delta.tool_calls or []:
                if tc.id:
                    ids.add(tc.id)
                if tc.function and tc.function.name:
                    name += tc.function.name
                if tc.function and tc.function.arguments:
                    args += tc.function.arguments
    check(name == "get_weather", f"name {name!r}")
    try:
        got = json.loads(args)
    except json.JSONDecodeError:
        raise Fail(f"assembled arguments are not JSON: {args[:80]!r}") from None
    check(got == {"city": "Paris", "unit": "c"}, f"arguments {got}")
    check(len(ids) == 1, f"{len(ids)} tool-call ids")
    return f"{len(chunks)} chunks"


# ------------------------------------------------------------------ rows: responses

@row("responses", "responses", "POST /v1/responses: a completed/incomplete response with output text and usage")
def _responses(ctx: Ctx) -> str:
    r = ctx.client.responses.create(model=ctx.model, input="Say something.", max_output_tokens=MAX_TOKENS,
                                    temperature=0)
    check(r.object == "response", f"object {r.object!r}")
    check(r.status in ("completed", "incomplete"), f"status {r.status!r}")
    check(isinstance(r.output_text, str), "no output_text")
    check(r.usage is not None and 0 < r.usage.output_tokens <= MAX_TOKENS, f"usage {r.usage}")
    return f"{r.status}, {r.usage.output_tokens} tokens"


@row("responses-stream", "responses", "streamed /v1/responses: created → output_text deltas → completed, deltas = final text")
def _responses_stream(ctx: Ctx) -> str:
    events = list(ctx.client.responses.create(model=ctx.model, input="Say something.",
                                              max_output_tokens=MAX_TOKENS, temperature=0, stream=True))
    types = [e.type for e in events]
    check(types[0] == "response.created", f"first event {types[0]}")
    check(types[-1] in ("response.completed", "response.incomplete"), f"last event {types[-1]}")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response.output_text
    check(deltas == final, f"deltas {deltas!r} != final {final!r}")
    return f"{len(events)} events"


# ------------------------------------------------------------------ driver

def run_rows(ctx: Ctx, only: set[str] | None) -> list[Result]:
    out = []
    for r in ROWS:
        if only and r.id not in only:
            continue
        t0 = time.monotonic()
        try:
            outcome, detail = "pass", r.run(ctx)
        except Fail as e:
            outcome, detail = "fail", str(e)
        except openai.APIStatusError as e:
            outcome, detail = "refused", f"HTTP {e.status_code}: {_err_message(e)}"
        except httpx.HTTPStatusError as e:
            outcome, detail = "refused", f"HTTP {e.response.status_code}: {e.response.text[:200]}"
        except (openai.APIConnectionError, httpx.TransportError) as e:
            outcome, detail = "error", f"{type(e).__name__}: {e}"
        except Exception as e:  # a response the client could not even parse is a failure of the server
            outcome, detail = "fail", f"{type(e).__name__}: {e}"
        out.append(Result(r.id, r.group, r.what, outcome, detail[:300], round(time.monotonic() - t0, 3)))
        print(f"{outcome:8} {r.id:28} {detail[:120]}", file=sys.stderr)
    return out


def _err_message(e: openai.APIStatusError) -> str:
    body = e.body
    if isinstance(body, dict):
        msg = body.get("message") or (body.get("error") or {}).get("message") if isinstance(body.get("error"), dict) \
            else body.get("message")
        if msg:
            return str(msg)[:200]
    return str(e)[:200]


def server_version(http: httpx.Client) -> Any:
    try:
        r = http.get("/version", timeout=10)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def cell(text: str) -> str:
    """Text for one markdown table cell: one line, no column bars, control
    characters escaped."""
    text = " ".join(text.split())
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    return text.replace("|", "\\|")


def table(paths: list[str]) -> str:
    runs = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            runs.append(json.load(f))
    ids = [r["id"] for r in runs[0]["results"]]
    by = [{r["id"]: r for r in run["results"]} for run in runs]
    head = "| row | what | " + " | ".join(run["label"] for run in runs) + " |"
    lines = [head, "|" + " --- |" * (2 + len(runs))]
    for i in ids:
        first = by[0][i]
        cells = []
        for b in by:
            r = b.get(i)
            if r is None:
                cells.append("—")
            elif r["outcome"] == "pass":
                cells.append("pass")
            else:
                cells.append(f"**{r['outcome']}**: {cell(r['detail'][:140])}")
        lines.append(f"| `{i}` | {cell(first['what'])} | " + " | ".join(cells) + " |")
    totals = " | ".join(
        f"{sum(r['outcome'] == 'pass' for r in run['results'])}/{len(run['results'])} pass" for run in runs)
    lines.append(f"| | **total** | {totals} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", help="the server, e.g. http://127.0.0.1:8000 (without /v1)")
    ap.add_argument("--model", help="model name (default: the first of /v1/models)")
    ap.add_argument("--api-key", default="EMPTY")
    ap.add_argument("--label", default="server", help="column name in the table")
    ap.add_argument("--out", help="write the results here as JSON")
    ap.add_argument("--only", action="append", help="run only this row (repeatable)")
    ap.add_argument("--eos-token-id", type=int, default=151645, help="the model's end-of-sequence id (Qwen2.5: 151645)")
    ap.add_argument("--bias-token-id", type=int, default=100, help="token id for the logit_bias row")
    ap.add_argument("--close-brace-id", type=int, help="token id of '}' (default: asked from /tokenize)")
    ap.add_argument("--tool-max-tokens", type=int, default=96, help="max_tokens for structured-output and tool rows")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    ap.add_argument("--note", action="append", default=[], help="free text stored with the results (repeatable)")
    ap.add_argument("--table", nargs="+", metavar="RESULT_JSON", help="print a markdown table of these runs and exit")
    ap.add_argument("--list", action="store_true", help="list the rows and exit")
    a = ap.parse_args(argv)
    if a.list:
        for r in ROWS:
            print(f"{r.id:28} {r.group:18} {r.what}")
        return 0
    if a.table:
        sys.stdout.write(table(a.table))
        return 0
    if not a.base_url:
        ap.error("--base-url is required")
    known = {r.id for r in ROWS}
    if a.only and not set(a.only) <= known:
        ap.error(f"unknown rows {sorted(set(a.only) - known)}; --list shows them")
    base = a.base_url.rstrip("/")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=a.api_key, max_retries=0, timeout=a.timeout)
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {a.api_key}"}, timeout=a.timeout) as http:
        model = a.model
        if model is None:
            try:
                model = client.models.list().data[0].id
            except (openai.APIError, IndexError) as e:
                print(f"cannot list models at {base}/v1/models: {e}", file=sys.stderr)
                return 1
        ctx = Ctx(client, http, model, a.eos_token_id, a.bias_token_id, a.tool_max_tokens, a.close_brace_id)
        t0 = time.time()
        results = run_rows(ctx, set(a.only) if a.only else None)
        doc = {
            "label": a.label, "base_url": base, "model": model, "server_version": server_version(http),
            "started_unix": round(t0), "seconds": round(time.time() - t0, 1),
            "client": {"openai": openai.__version__, "python": platform.python_version()},
            "settings": {"eos_token_id": a.eos_token_id, "bias_token_id": a.bias_token_id,
                         "tool_max_tokens": a.tool_max_tokens, "max_tokens": MAX_TOKENS},
            "notes": a.note, "results": [asdict(r) for r in results],
        }
    passed = sum(r.outcome == "pass" for r in results)
    print(f"{passed}/{len(results)} pass", file=sys.stderr)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    else:
        json.dump(doc, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
