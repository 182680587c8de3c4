"""Generation API over a unix socket, against the SDK's engine loop driving the
fake core (TEST DOUBLE: frmps_engine.sdk.testing.fake_engine)."""

import os
import time
import stat
import threading

import grpc
import pytest

from e2e import require
from frmps_engine._proto.frmps.v1 import control_pb2, generation_pb2 as g, generation_pb2_grpc
from frmps_engine.sdk.adapters import EngineOptions
from frmps_engine.sdk.genapi import GenerationServer
from frmps_engine.sdk.loop import EngineBackend, EngineLoop
from frmps_engine.sdk.memory import get_backend
from frmps_engine.sdk.seeds import derive_seed

pytestmark = pytest.mark.torch
torch = require("torch")
from frmps_engine.sdk.testing.fake_engine import FakeAdapter, FakeParams, FakeTokenizer  # noqa: E402

TOK = FakeTokenizer()


def reference(prompt_ids, max_tokens, temperature=0.0, seed=0, stop_token_ids=()):
    """No-fault output of the fake engine, computed in this process."""
    adapter = FakeAdapter(EngineOptions("fake-tiny"))
    mem = get_backend("host-shm")
    pools = mem.allocate(adapter.pool_layout())
    core = adapter.create_core({p.spec.key: p.tensor for p in pools}, load_weights=True)
    core.add_request(1, list(prompt_ids), FakeParams(max_tokens, temperature, seed, list(stop_token_ids)))
    out = []
    while core.has_work():
        for o in core.step():
            out.extend(o.new_token_ids)
    del core, pools
    mem.close()
    return out


class Env:
    def __init__(self, path, delay_ms=0, serving=True):
        os.environ["FRMPS_FAKE_STEP_DELAY_MS"] = str(delay_ms)
        try:
            self.adapter = FakeAdapter(EngineOptions("fake-tiny"))
            self.mem = get_backend("host-shm")
            pools = self.mem.allocate(self.adapter.pool_layout())
            self.core = self.adapter.create_core({p.spec.key: p.tensor for p in pools}, load_weights=True)
        finally:
            os.environ.pop("FRMPS_FAKE_STEP_DELAY_MS")
        self.loop = EngineLoop(self.core, sync_every=1)
        self.loop.start()
        self.backend = EngineBackend(self.adapter, self.loop)
        self.backend.is_serving = serving
        self.server = GenerationServer(self.backend, path)
        self.server.start()
        self.channel = grpc.insecure_channel("unix://" + path)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def close(self):
        self.channel.close()
        self.server.stop(0)
        self.loop.stop()
        del self.core
        self.mem.close()


@pytest.fixture
def env(sockdir):
    e = Env(os.path.join(sockdir, "gen.sock"))
    yield e
    e.close()


@pytest.fixture
def slow_env(sockdir):
    e = Env(os.path.join(sockdir, "gen.sock"), delay_ms=30)
    yield e
    e.close()


def gen(key, prompt="hello", max_tokens=10, **params):
    return g.GenerateRequest(key=key, prompt=prompt, params=control_pb2.SamplingParams(max_tokens=max_tokens, **params))


def collect(chunks):
    chunks = list(chunks)
    toks = [t for c in chunks for t in c.token_ids]
    return chunks, toks, "".join(c.text for c in chunks)


def check_indices(chunks, start=0):
    idx = start
    for c in chunks:
        assert c.output_index == idx
        idx += len(c.token_ids)


def test_generate_streams_tokens_text_and_usage(env):
    chunks, toks, text = collect(env.stub.Generate(gen(1, "hello", 12)))
    assert not chunks[0].token_ids and chunks[0].usage.prompt_tokens == 5 and chunks[0].usage.completion_tokens == 0
    # The prompt's ids, in the first chunk only: the front door resumes with them.
    assert list(chunks[0].prompt_token_ids) == TOK.encode("hello") and not any(c.prompt_token_ids for c in chunks[1:])
    assert toks == reference(TOK.encode("hello"), 12)
    assert text == TOK.decode(toks)
    check_indices(chunks)
    assert chunks[-1].finish_reason == g.FINISH_REASON_LENGTH
    assert all(c.finish_reason == g.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == 5


def test_generate_token_ids_and_chat(env):
    ids = [104, 105, 106]
    _, toks, _ = collect(env.stub.Generate(g.GenerateRequest(
        key=2, prompt_token_ids=g.TokenIds(ids=ids), params=control_pb2.SamplingParams(max_tokens=6))))
    assert toks == reference(ids, 6)
    msgs = [control_pb2.ChatMessage(role="user", content="hi")]
    chunks, toks, _ = collect(env.stub.Generate(g.GenerateRequest(
        key=3, messages=g.ChatMessages(messages=msgs), params=control_pb2.SamplingParams(max_tokens=4))))
    templ = TOK.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert chunks[0].usage.prompt_tokens == len(templ) and list(chunks[0].prompt_token_ids) == list(templ)
    assert toks == reference(templ, 4)


# Short: the fake model's context is 128 bytes. The SDK passes what it is given.
TOOLS_JSON = '[{"f":1}]'


def tool_chat():
    """A chat with tools as the front door sends it, and as the template must get it."""
    msgs = [control_pb2.ChatMessage(role="user", content="W"),
            control_pb2.ChatMessage(role="assistant", tool_calls_json='[{"a":{"c":1}}]'),
            control_pb2.ChatMessage(role="tool", tool_call_id="c", name="f", content="1")]
    want = [{"role": "user", "content": "W"},
            {"role": "assistant", "content": "", "tool_calls": [{"a": {"c": 1}}]},
            {"role": "tool", "content": "1", "tool_call_id": "c", "name": "f"}]
    return msgs, want


def test_tools_and_tool_messages_reach_the_chat_template(env):
    """A request's tools_json and its messages' tool calls, call ids and names go to
    the tokenizer's apply_chat_template (tools=…), for Generate and Tokenize alike."""
    import json

    msgs, want = tool_chat()
    templ = TOK.apply_chat_template(want, add_generation_prompt=True, tools=json.loads(TOOLS_JSON))
    assert templ != TOK.apply_chat_template(want, add_generation_prompt=True)
    ids = env.stub.Tokenize(g.TokenizeRequest(messages=g.ChatMessages(messages=msgs), add_generation_prompt=True,
                                              tools_json=TOOLS_JSON)).ids
    assert list(ids) == templ
    chunks, toks, _ = collect(env.stub.Generate(g.GenerateRequest(
        key=60, messages=g.ChatMessages(messages=msgs), add_generation_prompt=True, tools_json=TOOLS_JSON,
        params=control_pb2.SamplingParams(max_tokens=4))))
    assert list(chunks[0].prompt_token_ids) == templ and toks == reference(templ, 4)
    # Without tools the template gets none (and the tokenizer no tools argument).
    ids = env.stub.Tokenize(g.TokenizeRequest(messages=g.ChatMessages(messages=msgs), add_generation_prompt=True)).ids
    assert list(ids) == TOK.apply_chat_template(want, add_generation_prompt=True)
    for bad in ("{oops", '{"not": "a list"}'):
        with pytest.raises(grpc.RpcError) as e:
            env.stub.Tokenize(g.TokenizeRequest(messages=g.ChatMessages(messages=msgs), tools_json=bad))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tools_json" in e.value.details()


def test_tokenize_and_detokenize_as_generate_does(env):
    assert list(env.stub.Tokenize(g.TokenizeRequest(prompt="hello")).ids) == TOK.encode("hello")
    msgs = [control_pb2.ChatMessage(role="user", content="hi")]
    for agp in (True, False):
        ids = env.stub.Tokenize(g.TokenizeRequest(messages=g.ChatMessages(messages=msgs), add_generation_prompt=agp)).ids
        # The generation prompt is added also when not asked: the last message is not the assistant's (chat_to_ids).
        assert list(ids) == TOK.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
        first = next(iter(env.stub.Generate(g.GenerateRequest(key=40 + agp, messages=g.ChatMessages(messages=msgs),
                                                              add_generation_prompt=agp,
                                                              params=control_pb2.SamplingParams(max_tokens=1)))))
        assert list(first.prompt_token_ids) == list(ids)
    assert env.stub.Detokenize(g.TokenIds(ids=TOK.encode("héllo"))).text == "héllo"
    with pytest.raises(grpc.RpcError) as e:
        env.stub.Detokenize(g.TokenIds(ids=[65, 300]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "300" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        env.stub.Tokenize(g.TokenizeRequest())
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_seeded_and_unseeded_sampling_use_the_recorded_seed(env):
    _, toks, _ = collect(env.stub.Generate(gen(4, "abc", 8, temperature=1.0, seed=5)))
    assert toks == reference(TOK.encode("abc"), 8, 1.0, 5)
    _, toks, _ = collect(env.stub.Generate(gen(5, "abc", 8, temperature=1.0)))
    assert toks == reference(TOK.encode("abc"), 8, 1.0, derive_seed(5))
    assert toks != reference(TOK.encode("abc"), 8, 1.0, 5)


def test_stop_string_and_stop_token(env):
    ref = reference(TOK.encode("hello"), 30)
    text = TOK.decode(ref)
    stop = text[6:8]
    cut = text.find(stop)
    chunks, toks, got = collect(env.stub.Generate(gen(6, "hello", 30, stop=[stop])))
    assert got == text[:cut]
    assert toks == ref[: cut + len(stop)]
    assert chunks[-1].finish_reason == g.FINISH_REASON_STOP and chunks[-1].stop_reason == stop
    chunks, toks, _ = collect(env.stub.Generate(gen(7, "hello", 30, stop_token_ids=[ref[4]])))
    first = ref.index(ref[4])
    assert toks == ref[: first + 1]
    assert chunks[-1].finish_reason == g.FINISH_REASON_STOP and chunks[-1].stop_reason == str(ref[4])


def test_resume_at_index_after_finish(env):
    _, full, text = collect(env.stub.Generate(gen(8, "hello", 10)))
    chunks, toks, rest = collect(env.stub.Resume(g.ResumeStreamRequest(key=8, delivered=3)))
    assert toks == full[3:] and rest == text[3:]
    check_indices(chunks, 3)
    assert chunks[-1].finish_reason == g.FINISH_REASON_LENGTH
    with pytest.raises(grpc.RpcError) as ei:
        list(env.stub.Resume(g.ResumeStreamRequest(key=8, delivered=11)))
    assert ei.value.code() == grpc.StatusCode.OUT_OF_RANGE


def test_resume_with_the_detokenizer_state_continues_the_text_without_a_replay(env, monkeypatch):
    """Each chunk carries its detokenizer's offsets; a Resume that passes them back
    continues the text exactly as a replay of the delivered tokens would, and does
    not replay them (the first step after a takeover no longer pays per delivered
    token). A Resume without them, or with offsets that do not fit, replays."""
    import frmps_engine.sdk.detok as detok

    chunks, full, text = collect(env.stub.Generate(gen(10, "hello", 40)))
    primes = []
    real_prime = detok.TextStream.prime
    monkeypatch.setattr(detok.TextStream, "prime", lambda self, ids: (primes.append(len(ids)), real_prime(self, ids))[1])
    sent, done = "", 0
    for c in chunks[:-1]:
        sent += c.text
        done += len(c.token_ids)
        if not c.token_ids:
            continue
        assert c.HasField("detok") and 0 <= c.detok.prefix <= c.detok.read <= done
        _, toks, rest = collect(env.stub.Resume(g.ResumeStreamRequest(key=10, delivered=done, detok=c.detok)))
        assert toks == full[done:] and sent + rest == text, done
    assert primes == []
    _, _, rest = collect(env.stub.Resume(g.ResumeStreamRequest(key=10, delivered=done)))
    assert sent + rest == text and primes == [done]
    bad = g.DetokState(prefix=0, read=done + 5)  # past the delivered tokens: ignored, replayed
    _, _, rest = collect(env.stub.Resume(g.ResumeStreamRequest(key=10, delivered=done, detok=bad)))
    assert sent + rest == text and primes == [done, done]


def test_streams_with_stop_strings_send_no_detokenizer_state(env):
    """Text held back for a stop string is not in the offsets: such a stream
    sends none, and its resume replays."""
    chunks, _, _ = collect(env.stub.Generate(gen(11, "hello", 20, stop=["\x00never"])))
    assert not any(c.HasField("detok") for c in chunks)


def test_resume_while_running(slow_env):
    it = slow_env.stub.Generate(gen(9, "hello", 12))
    first = [next(it), next(it), next(it)]  # usage chunk + 2 tokens
    delivered = [t for c in first for t in c.token_ids]
    chunks, toks, _ = collect(slow_env.stub.Resume(g.ResumeStreamRequest(key=9, delivered=len(delivered))))
    check_indices(chunks, len(delivered))
    assert delivered + toks == reference(TOK.encode("hello"), 12)
    it.cancel()


def test_abort(slow_env):
    it = slow_env.stub.Generate(gen(10, "hello", 100))
    next(it), next(it)
    assert slow_env.stub.Abort(g.AbortRequest(key=10)).found
    rest = list(it)
    assert rest[-1].finish_reason == g.FINISH_REASON_ABORT
    assert slow_env.loop.call(lambda: slow_env.core.has_work()) is False


def test_unknown_request_is_not_found(env):
    for call in (lambda: env.stub.Abort(g.AbortRequest(key=999)),
                 lambda: list(env.stub.Resume(g.ResumeStreamRequest(key=999, delivered=0)))):
        with pytest.raises(grpc.RpcError) as ei:
            call()
        assert ei.value.code() == grpc.StatusCode.NOT_FOUND and "no request with key 999" in ei.value.details()


@pytest.mark.parametrize("req, msg", [
    (gen(20, "x" * 128, 5), "prompt has 128 tokens; this model's max_model_len is 128"),
    (g.GenerateRequest(key=21), "request has no input"),
    (gen(22, "", 5), "prompt is empty"),
    (gen(23, "hi", 5, temperature=-1.0), "temperature must be >= 0"),
    (gen(24, "hi", 5, top_p=1.5), "top_p must be in (0, 1]"),
    (g.GenerateRequest(key=25, prompt_token_ids=g.TokenIds(ids=[1, 300])), "outside the vocabulary"),
    (gen(26, "hi", 5, presence_penalty=2.5), "presence_penalty and frequency_penalty must be in [-2, 2]"),
    (gen(27, "hi", 5, repetition_penalty=-1.0), "repetition_penalty must be > 0"),
    (gen(28, "hi", 5, min_tokens=6), "min_tokens 6 is more than max_tokens 5"),
    (gen(29, "hi", 5, logit_bias={300: 1.0}), "logit_bias token ids [300] outside the vocabulary"),
])
def test_invalid_requests(env, req, msg):
    with pytest.raises(grpc.RpcError) as ei:
        list(env.stub.Generate(req))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert msg in ei.value.details()


def test_duplicate_running_key(slow_env):
    it = slow_env.stub.Generate(gen(30, "hello", 50))
    next(it)
    with pytest.raises(grpc.RpcError) as ei:
        list(slow_env.stub.Generate(gen(30, "hello", 5)))
    assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS
    slow_env.stub.Abort(g.AbortRequest(key=30))
    list(it)


def test_health_and_socket_mode(env):
    h = env.stub.Health(g.HealthRequest())
    assert h.serving and h.model == "fake-tiny" and h.max_model_len == 128
    assert stat.S_IMODE(os.stat(env.server.path).st_mode) == 0o600


def test_not_serving_is_unavailable(sockdir):
    e = Env(os.path.join(sockdir, "gen.sock"), serving=False)
    try:
        with pytest.raises(grpc.RpcError) as ei:
            list(e.stub.Generate(gen(1)))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not e.stub.Health(g.HealthRequest()).serving
    finally:
        e.close()


def test_concurrent_streams(env):
    results = {}

    def run(k):
        results[k] = collect(env.stub.Generate(gen(100 + k, f"p{k}", 5 + k)))[1]

    ts = [threading.Thread(target=run, args=(k,)) for k in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for k in range(8):
        assert results[k] == reference(TOK.encode(f"p{k}"), 5 + k)


# -- Stream: many requests on one stream ---------------------------------------------


class StreamClient:
    """One Stream; operations go in through a queue, chunks are gathered per key."""

    def __init__(self, stub):
        import queue

        self._q = queue.Queue()
        self._it = stub.Stream(iter(self._q.get, None))
        self.by_key: dict[int, list] = {}
        self.messages = 0
        self._done = threading.Event()
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self):
        try:
            for resp in self._it:
                self.messages += 1
                for ch in resp.chunks:
                    self.by_key.setdefault(ch.key, []).append(ch)
        except grpc.RpcError:
            pass
        self._done.set()

    def send(self, **op):
        self._q.put(g.StreamRequest(**op))

    def ended(self, key):
        chs = self.by_key.get(key, [])
        return bool(chs) and (chs[-1].status_code != 0 or chs[-1].response.finish_reason != g.FINISH_REASON_UNSPECIFIED)

    def wait(self, keys, timeout=20.0):
        import time

        deadline = time.monotonic() + timeout
        while not all(self.ended(k) for k in keys):
            assert time.monotonic() < deadline, {k: len(self.by_key.get(k, [])) for k in keys}
            time.sleep(0.005)

    def tokens(self, key):
        return [t for ch in self.by_key[key] for t in ch.response.token_ids]

    def close(self):
        self._q.put(None)
        self._done.wait(10)


def test_stream_carries_many_requests_exactly(slow_env):
    sc = StreamClient(slow_env.stub)
    keys = list(range(200, 216))
    for k in keys:
        sc.send(generate=gen(k, f"q{k}", 12))
    sc.wait(keys)
    for k in keys:
        chs = sc.by_key[k]
        assert chs[0].response.usage.prompt_tokens == len(TOK.encode(f"q{k}")) and not chs[0].response.token_ids
        assert list(chs[0].response.prompt_token_ids) == TOK.encode(f"q{k}")
        check_indices([c.response for c in chs])
        assert sc.tokens(k) == reference(TOK.encode(f"q{k}"), 12)
        assert "".join(c.response.text for c in chs) == TOK.decode(sc.tokens(k))
        assert chs[-1].response.finish_reason == g.FINISH_REASON_LENGTH
    # One message per engine step carries every request's token: far fewer messages than chunks.
    assert sc.messages < sum(len(v) for v in sc.by_key.values()) / 4
    sc.close()


def test_an_idle_stream_does_not_hold_the_server_stop(sockdir):
    """The supervisor keeps its Stream open between requests: once every request on
    it has finished, stopping the server (an engine's shutdown) must not wait out the
    whole grace for it. Without the stop ending idle streams, stop(grace) returns only
    after grace."""
    e = Env(os.path.join(sockdir, "gen.sock"))
    try:
        sc = StreamClient(e.stub)
        sc.send(generate=gen(300, "q", 4))
        sc.wait([300])
        t0 = time.monotonic()
        e.server.stop(30)
        took = time.monotonic() - t0
        assert took < 15, f"stop waited {took:.1f} s for an idle stream (grace 30 s)"
        sc.close()
    finally:
        e.channel.close()
        e.loop.stop()
        del e.core
        e.mem.close()


def test_stream_errors_resume_and_detach(slow_env):
    sc = StreamClient(slow_env.stub)
    sc.send(generate=gen(300, "", 5))  # refused: its own error chunk, the stream goes on
    sc.send(resume=g.ResumeStreamRequest(key=999, delivered=0))
    sc.send(generate=gen(301, "hello", 40))
    sc.wait([300, 999])
    assert sc.by_key[300][-1].status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert sc.by_key[999][-1].status_code == grpc.StatusCode.NOT_FOUND.value[0]
    # A second reader of 301 from index 3, on another stream, gets the same tail.
    other = StreamClient(slow_env.stub)
    import time

    while len(sc.tokens(301) if 301 in sc.by_key else []) < 3:
        time.sleep(0.005)
    other.send(resume=g.ResumeStreamRequest(key=301, delivered=3))
    sc.wait([301])
    other.wait([301])
    assert other.tokens(301) == sc.tokens(301)[3:]
    check_indices([c.response for c in other.by_key[301]], 3)
    # Detach: the engine stops sending that request on this stream; the request itself runs on.
    sc.send(generate=gen(302, "hello", 100))
    while 302 not in sc.by_key or len(sc.by_key[302]) < 3:
        time.sleep(0.005)
    sc.send(detach=g.AbortRequest(key=302))
    time.sleep(0.3)
    n = len(sc.by_key[302])
    time.sleep(0.3)
    assert len(sc.by_key[302]) == n and not sc.ended(302)
    assert slow_env.stub.Abort(g.AbortRequest(key=302)).found
    sc.close()
    other.close()
