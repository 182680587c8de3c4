"""Tool calling through a real `frmps serve --enable-auto-tool-choice
--tool-call-parser hermes` (Go front door + reference engine on the CPU, the
byte tokenizer): the tools reach the chat template, a hermes call is read out
of the output, and a stream whose active engine is killed in the middle of the
call continues it on the standby. The model has random weights: a
structured-outputs regex makes it write the call, as bench/openai_matrix.py's
auto rows do."""

from __future__ import annotations

import json
import re

import pytest

from e2e import Killer, deployment, require

openai = require("openai")
pytestmark = [pytest.mark.torch, pytest.mark.timeout(600)]

TOOLS = [{"type": "function", "function": {"name": "f", "description": "A test tool.",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}]
TEXT = 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": "on the standby"}}\n</tool_call>'


@pytest.fixture(scope="module")
def dep():
    # The tools' preamble in the system turn is ~500 bytes: a context of 2048.
    with deployment(sync_every=4, env={"FRMPS_TEST_STEP_DELAY_MS": "4"},
                    extra_args=["--max-model-len=2048", "--max-restarts=1000",
                                "--enable-auto-tool-choice", "--tool-call-parser=hermes"]) as d:
        yield d


@pytest.fixture(scope="module")
def client(dep):
    return openai.OpenAI(base_url=f"{dep.base}/v1", api_key="none", max_retries=0, timeout=120)


def request(**kw):
    return dict(model="tiny", messages=[{"role": "user", "content": "call f"}], tools=TOOLS, tool_choice="auto",
                max_tokens=200, temperature=0, extra_body={"structured_outputs": {"regex": re.escape(TEXT)}}, **kw)


def test_tools_reach_the_template_and_the_call_is_read(client):
    with_tools = client.chat.completions.create(**request())
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "call f"}],
                                           max_tokens=1, temperature=0)
    # The tools are in the prompt (Qwen2.5's format: the system turn lists them).
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + len(json.dumps(TOOLS[0]))
    c = with_tools.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure. "
    assert len(c.message.tool_calls) == 1
    tc = c.message.tool_calls[0]
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", tc.id) and tc.type == "function"
    assert tc.function.name == "f" and tc.function.arguments == '{"a": "on the standby"}'


def consume(client, on_chunk=None):
    """A streamed answer as a client assembles it: content, calls, finish reason."""
    content, calls, finish, ids, n = "", {}, None, set(), 0
    for ch in client.chat.completions.create(**request(stream=True)):
        if not ch.choices:
            continue
        n += 1
        if on_chunk:
            on_chunk(n)
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.id:
                ids.add(tc.id)
                calls[tc.index] = [tc.function.name, ""]
            calls[tc.index][1] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content, calls, finish, ids


def test_a_call_streamed_across_sigkill_is_the_no_fault_one(dep, client):
    ref_content, ref_calls, ref_finish, ref_ids = consume(client)
    assert (ref_content, ref_calls, ref_finish) == ("Sure. ", {0: ["f", '{"a": "on the standby"}']}, "tool_calls")
    assert len(ref_ids) == 1
    # Chunk 1 is the role; then "Sure. " byte by byte, the call's first delta, its
    # arguments: the active dies with the call half streamed.
    killer = Killer(dep, after=12)
    content, calls, finish, ids = consume(client, killer.on_token)
    assert killer.fired.is_set()
    assert (content, calls, finish) == (ref_content, ref_calls, ref_finish) and len(ids) == 1
    dep.wait_state("serving_ready")
