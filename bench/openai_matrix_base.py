"""What the rows of the OpenAI feature matrix (openai_matrix.py) are made of: the
row registry and its result types, the context a row runs in, and the helpers
rows share (greedy requests, token ids, stop strings, JSON and tool-call
schemas, tokenizer routes)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import jsonschema
import openai

MAX_TOKENS = 8


class Fail(Exception):
    """The server answered, and the answer is wrong."""


@dataclass
class Ctx:
    client: openai.OpenAI
    http: httpx.Client
    model: str
    eos_token_id: int
    bias_token_id: int
    tool_max_tokens: int
    close_brace_id: int | None = None
    cache: dict[str, Any] = field(default_factory=dict)


@dataclass
class Row:
    id: str
    group: str
    what: str
    run: Callable[[Ctx], str]


@dataclass
class Result:
    id: str
    group: str
    what: str
    outcome: str
    detail: str
    seconds: float


ROWS: list[Row] = []


def row(id_: str, group: str, what: str):
    def deco(fn: Callable[[Ctx], str]) -> Callable[[Ctx], str]:
        ROWS.append(Row(id_, group, what, fn))
        return fn
    return deco


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise Fail(msg)


# ------------------------------------------------------------------ helpers

def greedy(ctx: Ctx, prompt: str = "The quick brown fox", n: int = 16) -> Any:
    """A greedy completion of ``n`` tokens with token ids (cached: several
    rows compare against it)."""
    key = f"greedy:{prompt}:{n}"
    if key not in ctx.cache:
        ctx.cache[key] = ctx.client.completions.create(
            model=ctx.model, prompt=prompt, max_tokens=n, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True})
    return ctx.cache[key]


def token_ids(choice: Any) -> list[int]:
    ids = getattr(choice, "token_ids", None)
    if ids is None and getattr(choice, "model_extra", None):
        ids = choice.model_extra.get("token_ids")
    check(isinstance(ids, list), "no token_ids in the choice (return_token_ids ignored)")
    return ids


PROMPTS = ("The quick brown fox", "Say something.", "Hello", "Tell me a story.", "Count to ten.")


def pick_stop(text: str) -> str | None:
    """Two characters of ``text`` after its first, to use as a stop string.
    A random model's text is often bytes that are not UTF-8 (U+FFFD once
    decoded) or decodes to nothing; a stop string is matched on the engine's
    own incremental text, where such bytes are not yet characters, so it is
    taken from the well-formed part only."""
    for i in range(1, len(text) - 1):
        w = text[i:i + 2]
        if "\ufffd" not in w:
            return w
    return None


def chat_msgs(text: str = "Say something.") -> list[dict]:
    return [{"role": "user", "content": text}]


WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
# The tools' city is letters only: a structured-output grammar admits raw control
# characters inside a JSON string, a random model samples them, and vLLM's tool
# parsers read the call with strict json.loads, which refuses them (seen with the
# hermes parser on the GPU: "Invalid control character").
TOOL_SCHEMA = {**WEATHER_SCHEMA, "properties": {**WEATHER_SCHEMA["properties"],
                                                "city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"}}}
TOOLS = [{
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather in a city.", "parameters": TOOL_SCHEMA},
}]
# A hermes-format tool call (Qwen2.5's) that the model is made to write by a
# structured-output regex, so the server's tool parser, not a grammar, finds it.
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


def parse_json(content: str, finish: str | None) -> tuple[Any, str]:
    """Parse structured output. Strict JSON first; then allowing raw control
    characters inside strings (a random model samples them, and the JSON
    grammars of the structured-output backends admit them), said in the note."""
    try:
        return json.loads(content), ""
    except json.JSONDecodeError:
        pass
    try:
        return json.loads(content, strict=False), " (raw control characters inside strings)"
    except json.JSONDecodeError:
        raise Fail(f"not JSON (finish {finish}): {content[:80]!r}") from None


def brace_id(ctx: Ctx) -> int:
    """The id of the token '}' (from --close-brace-id, else /tokenize)."""
    if ctx.close_brace_id is not None:
        return ctx.close_brace_id
    r = ctx.http.post("/tokenize", json={"model": ctx.model, "prompt": "}", "add_special_tokens": False})
    if r.status_code != 200:
        raise Fail(f"no /tokenize (HTTP {r.status_code}) to find the id of '}}': pass --close-brace-id")
    toks = r.json().get("tokens")
    check(isinstance(toks, list) and len(toks) == 1, f"'}}' tokenizes to {toks}")
    ctx.close_brace_id = toks[0]
    return toks[0]


def single_token_ids(tokenize: Callable[[str], list], texts: list[str]) -> list[int]:
    """The ids of those texts that are one token each (tokenize: text -> ids)."""
    out = []
    for t in texts:
        ids = tokenize(t)
        if isinstance(ids, list) and len(ids) == 1 and ids[0] not in out:
            out.append(ids[0])
    return out


# JSON's whitespace as single tokens: every string of one or two of its four
# characters, and runs of spaces or newlines (a vocabulary's long ones).
JSON_WS = ([a for a in " \t\n\r"] + [a + b for a in " \t\n\r" for b in " \t\n\r"]
           + [" " * k for k in range(3, 33)] + ["\n" * k for k in range(3, 33)])


def tokenize_via(http: httpx.Client, model: str) -> Callable[[str], list]:
    def tok(text: str) -> list:
        r = http.post("/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False})
        return r.json().get("tokens") if r.status_code == 200 else []
    return tok


def no_ws_bias(ctx: Ctx) -> dict[str, int]:
    """logit_bias that keeps JSON whitespace out. A grammar admits whitespace
    between JSON tokens; a random model's greedy choice there is often a
    whitespace token, and then again at the next step, so the call never ends
    (seen with vLLM's tool-call grammars, which do not take the server's
    disable_any_whitespace). The same bias goes to every server compared."""
    if "ws" not in ctx.cache:
        ids = single_token_ids(tokenize_via(ctx.http, ctx.model), JSON_WS)
        check(bool(ids), "no /tokenize to find whitespace token ids")
        ctx.cache["ws"] = {str(i): -100 for i in ids}
    return ctx.cache["ws"]


def regex_escape(s: str) -> str:
    import re
    return re.escape(s)


def tool_call_args(tc: Any) -> dict:
    check(tc.type == "function", f"tool call type {tc.type!r}")
    check(tc.function.name == "get_weather", f"tool name {tc.function.name!r}")
    try:
        args = json.loads(tc.function.arguments)
    except json.JSONDecodeError as e:
        raise Fail(f"arguments are not JSON: {tc.function.arguments[:80]!r} ({e})") from None
    try:
        jsonschema.validate(args, TOOL_SCHEMA)
    except jsonschema.ValidationError as e:
        raise Fail(f"arguments do not validate: {e.message}") from None
    return args
