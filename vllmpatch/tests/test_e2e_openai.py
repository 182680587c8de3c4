"""The OpenAI endpoint of a real `frmps serve` (Go supervisor + reference
engine on the CPU), driven by the official `openai` client and by curl."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading

import pytest

from e2e import Killer, deployment, http_json, require

openai = require("openai")
pytestmark = [pytest.mark.torch, pytest.mark.timeout(600)]

API_KEY = "sk-test-frmps"
MAX_CONCURRENT = 2


@pytest.fixture(scope="module")
def dep():
    with deployment(sync_every=4, env={"FRMPS_API_KEY": API_KEY, "FRMPS_TEST_STEP_DELAY_MS": "4"},
                    extra_args=[f"--max-concurrent={MAX_CONCURRENT}", "--max-queue=-1",
                                "--max-model-len=512", "--max-restarts=1000"]) as d:
        yield d


@pytest.fixture(scope="module")
def client(dep):
    return openai.OpenAI(base_url=f"{dep.base}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_models(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny"]


def test_chat_non_streaming(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                       max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_streaming_with_usage_matches_non_streaming(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "tell me"}], max_tokens=20, seed=3,
              temperature=0.8, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert {c.id for c in chunks} == {chunks[0].id}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_completions_streaming_without_usage(client):
    chunks = list(client.completions.create(model="tiny", prompt="abc", max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    full = client.completions.create(model="tiny", prompt="abc", max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert full.object == "text_completion" and full.usage.completion_tokens == 10


def test_stream_across_sigkill_equals_no_fault_run(dep, client):
    """The text, and the logprobs: the standby computes the same distribution."""
    # Tokens as ids: the tiny model's byte tokens often share a text, which would merge top entries.
    kw = dict(model="tiny", prompt="The standby takes over", max_tokens=150, temperature=0.7, seed=11, logprobs=2,
              stream=True, stream_options={"include_usage": True},
              extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})

    def consume(on_token=None):
        text, usage, ids, n, lps = [], None, set(), 0, []
        for c in client.completions.create(**kw):
            ids.add(c.id)
            if c.choices:
                text.append(c.choices[0].text)
                lp = c.choices[0].logprobs
                if lp is not None:
                    lps += list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
                n += 1
                if on_token:
                    on_token(n)
            if c.usage:
                usage = c.usage
        return "".join(text), usage.completion_tokens, ids, lps

    ref_text, ref_n, _, ref_lps = consume()
    killer = Killer(dep, after=30)
    text, n, ids, lps = consume(killer.on_token)
    assert killer.fired.is_set()
    assert len(ids) == 1
    assert text == ref_text and n == ref_n == 150
    assert len(ref_lps) == 150 and all(len(top) in (2, 3) for _, _, top in ref_lps)
    assert lps == ref_lps
    dep.wait_state("serving_ready")


def test_responses_stream_across_sigkill_equals_no_fault_run(dep, client):
    """/v1/responses runs the chat path: its stream resumes on the standby, the
    same events, deltas and final response as without the fault."""
    kw = dict(model="tiny", instructions="Answer at length.", input="The standby takes over", max_output_tokens=120,
              temperature=0.7, stream=True, extra_body={"ignore_eos": True, "seed": 5})

    def consume(on_delta=None):
        events = []
        for e in client.responses.create(**kw):
            events.append(e)
            if e.type == "response.output_text.delta" and on_delta:
                on_delta(sum(x.type == "response.output_text.delta" for x in events))
        return events

    def kinds(events):  # the event types, a run of deltas as one (chunks may group tokens differently)
        out = []
        for e in events:
            if not out or out[-1] != e.type or e.type != "response.output_text.delta":
                out.append(e.type)
        return out

    ref = consume()
    killer = Killer(dep, after=10)  # deltas: ~28 of them (a chunk without text sends none)
    got = consume(killer.on_token)
    assert killer.fired.is_set()
    assert kinds(got) == kinds(ref) and kinds(got)[-1] == "response.completed"
    assert [e.sequence_number for e in got] == list(range(len(got)))
    deltas = "".join(e.delta for e in got if e.type == "response.output_text.delta")
    assert deltas == "".join(e.delta for e in ref if e.type == "response.output_text.delta")
    final, ref_final = got[-1].response, ref[-1].response
    assert final.output_text == deltas == ref_final.output_text
    assert final.id == got[0].response.id and final.status == ref_final.status == "incomplete"
    assert final.usage.output_tokens == ref_final.usage.output_tokens == 120
    dep.wait_state("serving_ready")


def test_choices_are_the_single_requests(client):
    """n and a batch of prompts: choice i of a prompt is that prompt alone under
    seed + i (the reference engine on the CPU is batch-invariant), numbered
    prompt by prompt; streamed, the same texts per index."""
    kw = dict(model="tiny", max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    prompts = ["Hello there", "Once upon a time"]
    r = client.completions.create(prompt=prompts, n=2, seed=11, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    singles = [client.completions.create(prompt=p, seed=11 + i, **kw).choices[0].text for p in prompts for i in (0, 1)]
    assert [c.text for c in r.choices] == singles
    assert singles[0] != singles[1]
    assert r.usage.completion_tokens == 32
    streamed = {}
    for c in client.completions.create(prompt=prompts, n=2, seed=11, stream=True, **kw):
        for ch in c.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
    assert [streamed[i] for i in range(4)] == singles
    echo = client.completions.create(prompt="Hello there", echo=True, seed=11, **kw)
    assert echo.choices[0].text == "Hello there" + singles[0]


def test_tokenizer_routes_are_the_engines(dep, client):
    """/tokenize counts what a completion counts as its prompt, /detokenize gives the
    text back, and the echo of a prompt given as those ids is that text."""
    auth = {"authorization": f"Bearer {API_KEY}"}
    text = "Hello there, world"
    code, _, tk = http_json("POST", f"{dep.base}/tokenize", {"model": "tiny", "prompt": text}, headers=auth)
    assert code == 200 and tk["count"] == len(tk["tokens"]) and tk["max_model_len"] == 512
    r = client.completions.create(model="tiny", prompt=text, max_tokens=2)
    assert r.usage.prompt_tokens == tk["count"]
    code, _, dt = http_json("POST", f"{dep.base}/detokenize", {"model": "tiny", "tokens": tk["tokens"]}, headers=auth)
    assert code == 200 and dt["prompt"] == text
    code, _, chat = http_json("POST", f"{dep.base}/tokenize",
                              {"model": "tiny", "messages": [{"role": "user", "content": text}]}, headers=auth)
    assert code == 200 and chat["count"] > tk["count"]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=2)
    assert r.usage.prompt_tokens == chat["count"]
    echo = client.completions.create(model="tiny", prompt=tk["tokens"], echo=True, max_tokens=2)
    assert echo.choices[0].text.startswith(text)
    assert http_json("POST", f"{dep.base}/tokenize", {"model": "tiny", "prompt": text})[0] == 401


def test_errors(dep, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found" or "gpt-4" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x" * 2000, max_tokens=4)   # > --max-model-len 512
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", n=0)
    bad = openai.OpenAI(base_url=f"{dep.base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    auth = {"authorization": f"Bearer {API_KEY}"}
    code, _, body = http_json("POST", f"{dep.base}/v1/completions", None, headers=auth)
    assert code == 400 and body["error"]["type"] == "invalid_request_error"
    code, _, body = http_json("POST", f"{dep.base}/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "x"}]}, headers=auth)
    assert code == 400 and "model" in body["error"]["message"]


def test_oversize_body_is_413_the_client_reads(client):
    # Over the default 4 MiB body limit: the client gets the error, not a reset connection.
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="tiny", prompt="x" * (5 << 20), max_tokens=4)
    assert e.value.status_code == 413
    assert e.value.body["code"] == "request_too_large" and e.value.body["type"] == "invalid_request_error"
    ok = client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 2


def test_bad_json(dep):
    import urllib.error
    import urllib.request
    req = urllib.request.Request(f"{dep.base}/v1/completions", data=b'{"model": "tiny", "prompt": ',
                                 headers={"authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400
    assert json.loads(e.value.read())["error"]["type"] == "invalid_request_error"


def test_queue_full_is_429(dep, client):
    started = threading.Barrier(MAX_CONCURRENT + 1)
    results = []

    def hold():
        stream = client.completions.create(model="tiny", prompt="hold", max_tokens=400, stream=True,
                                           extra_body={"ignore_eos": True})
        it = iter(stream)
        next(it)
        started.wait()
        results.append(sum(1 for _ in it))

    threads = [threading.Thread(target=hold) for _ in range(MAX_CONCURRENT)]
    for t in threads:
        t.start()
    started.wait(timeout=60)
    try:
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="tiny", prompt="one too many", max_tokens=2)
        assert e.value.response.headers.get("retry-after")
    finally:
        for t in threads:
            t.join(timeout=120)
    assert len(results) == MAX_CONCURRENT


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_streaming_and_request_id(dep):
    out = subprocess.run(
        ["curl", "-sS", "-N", "-D", "-", f"{dep.base}/v1/chat/completions",
         "-H", f"Authorization: Bearer {API_KEY}", "-H", "Content-Type: application/json",
         "-H", "x-request-id: curl-test-1",
         "-d", json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 5, "stream": True, "ignore_eos": True})],
        capture_output=True, text=True, timeout=60, check=True).stdout
    head, _, body = out.partition("\n\n")  # text mode turned CRLF into LF
    assert "x-request-id: curl-test-1" in head.lower(), out
    assert "text/event-stream" in head
    events = [ln[6:] for ln in body.splitlines() if ln.startswith("data: ")]
    assert events and events[-1] == "[DONE]", out
    first = json.loads(events[0])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"
