"""Reference engine core on CPU (tiny preset, float32): model, scheduler, sampling, text."""

from __future__ import annotations

import json
import math

import pytest

from e2e import require

torch = require("torch")
# one_torch_thread (conftest.py): one intra-op thread for the whole module.
pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]

import torch.nn.functional as F  # noqa: E402

from frmps_engine.refengine import (  # noqa: E402
    AdoptError,
    BlockError,
    BlockManager,
    ByteTokenizer,
    ConfigError,
    EngineConfig,
    RefCore,
    EngineError,
    IncrementalDetokenizer,
    SamplingParams,
    TextState,
    pool_layout,
    presets,
    weights_bytes,
)
from frmps_engine.refengine.sampling import gumbel_noise, row_key, sample  # noqa: E402

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def make_core(budget: int = 512, pools=None, load=True, **kw) -> RefCore:
    cfg = EngineConfig.from_preset("tiny", num_blocks=kw.pop("num_blocks", 96), max_num_batched_tokens=budget, **kw)
    return RefCore(cfg, pools if pools is not None else RefCore.allocate_pools(cfg), load)


def prompts(n: int, seed: int = 1, lengths=(5, 17, 33, 1, 16, 40, 3, 70)) -> dict[int, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return {k + 1: torch.randint(0, 256, (lengths[k % len(lengths)],), generator=g).tolist() for k in range(n)}


def record_logits(core: RefCore) -> list[torch.Tensor]:
    rec: list[torch.Tensor] = []
    orig = core.model.forward

    def fwd(batch):
        out = orig(batch)
        rec.append(out.clone())
        return out

    core.model.forward = fwd
    return rec


# ---- configuration -------------------------------------------------------


def test_presets_have_real_qwen_shapes():
    s = EngineConfig.from_preset("qwen2.5-0.5b").shape
    assert (s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.intermediate_size, s.vocab_size) == (
        896, 24, 14, 2, 4864, 151936)
    assert s.tie_word_embeddings and s.head_dim == 64 and s.rope_theta == 1e6
    # Parameter counts match the published models (0.49B and 7.62B).
    n05 = weights_bytes(EngineConfig.from_preset("qwen2.5-0.5b", dtype="bf16")) / 2
    n7 = weights_bytes(EngineConfig.from_preset("qwen2.5-7b", dtype="bf16")) / 2
    assert 0.49e9 < n05 < 0.50e9 and 7.6e9 < n7 < 7.7e9
    s14 = EngineConfig.from_preset("qwen2.5-14b").shape
    assert (s14.hidden_size, s14.num_layers, s14.num_heads, s14.num_kv_heads, s14.vocab_size) == (5120, 48, 40, 8, 152064)
    assert not s14.tie_word_embeddings
    assert {"qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b", "tiny"} <= set(presets())
    assert "tiny" in presets and "qwen9" not in presets and list(presets) == presets()


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError, match="unknown model 'qwen9'.*qwen2.5-0.5b.*tiny"):
        EngineConfig.from_preset("qwen9")


def test_model_dir_without_usable_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        EngineConfig.from_preset(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="read model config"):
        EngineConfig.from_preset(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64}))
    with pytest.raises(ConfigError, match="missing field 'num_attention_heads'"):
        EngineConfig.from_preset(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama4"}))
    with pytest.raises(ConfigError, match="not supported"):
        EngineConfig.from_preset(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="qwen2", hidden_size=64, num_attention_heads=5, num_key_value_heads=1, num_hidden_layers=1,
        intermediate_size=8, vocab_size=300)))
    with pytest.raises(ConfigError, match="not divisible"):
        EngineConfig.from_preset(str(tmp_path))


def test_bad_engine_settings():
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig.from_preset("tiny", block_size=12)
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig.from_preset("tiny", dtype="int3")
    with pytest.raises(ConfigError, match="max_model_len"):
        EngineConfig.from_preset("tiny", max_model_len=10**6)
    with pytest.raises(ConfigError, match="weights"):
        EngineConfig.from_preset("tiny", weights="/nonexistent/dir")


def test_pool_layout_deterministic_and_sized():
    cfg = EngineConfig.from_preset("tiny", num_blocks=50)
    a, b = pool_layout(cfg), pool_layout(EngineConfig.from_preset("tiny", num_blocks=50))
    assert a == b and [p.tag for p in a] == ["weights", "kv_cache"]
    s = cfg.shape
    assert a[1].size >= s.num_layers * 2 * 50 * 16 * s.num_kv_heads * s.head_dim * 4
    assert a[0].size >= weights_bytes(cfg) and all(p.size % (2 << 20) == 0 for p in a)
    assert pool_layout(EngineConfig.from_preset("tiny", num_blocks=51))[1].size >= a[1].size


def test_pools_checked():
    cfg = EngineConfig.from_preset("tiny", num_blocks=20)
    pools = RefCore.allocate_pools(cfg)
    with pytest.raises(ConfigError, match="missing"):
        RefCore(cfg, {("weights", 0): pools[("weights", 0)]}, True)
    small = dict(pools)
    small[("kv_cache", 0)] = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="layout needs"):
        RefCore(cfg, small, True)


def test_standby_never_writes_pools():
    cfg = EngineConfig.from_preset("tiny", num_blocks=20)
    pools = {k: torch.full_like(v, 0xA5) for k, v in RefCore.allocate_pools(cfg).items()}
    before = {k: v.clone() for k, v in pools.items()}
    core = RefCore(cfg, pools, load_weights=False)
    core.request_views()
    assert all(torch.equal(pools[k], before[k]) for k in pools)
    # Weights are views into the pool: a write through the pool shows up in the model.
    pools[("weights", 0)][:4].copy_(torch.tensor([0, 0, 128, 63], dtype=torch.uint8))  # float32 1.0
    assert core.model.embed.view(-1)[0].item() == 1.0


# ---- model ---------------------------------------------------------------


def dense_forward(core: RefCore, ids: list[int]) -> torch.Tensor:
    """Plain causal forward with no cache (an independent reference): logits at every position."""
    cfg, p = core.cfg, core.model.params
    s = cfg.shape
    H, KVH, HD = s.num_heads, s.num_kv_heads, s.head_dim
    x = p["embed_tokens"][torch.tensor(ids)]
    T = len(ids)
    inv = 1.0 / (s.rope_theta ** (torch.arange(0, HD, 2).float() / HD))
    ang = torch.outer(torch.arange(T).float(), inv)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rot(t):
        return torch.cat([-t[..., HD // 2:], t[..., : HD // 2]], -1)

    def norm(t, w):
        return w * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + s.rms_norm_eps)

    for i in range(s.num_layers):
        pre = f"layers.{i}."
        h = norm(x, p[pre + "input_layernorm"])
        qkv = h @ p[pre + "qkv_proj.weight"].T + p[pre + "qkv_proj.bias"]
        q, k, v = qkv.split([s.q_size, s.kv_size, s.kv_size], -1)
        q = q.view(T, H, HD).transpose(0, 1)
        k = k.view(T, KVH, HD).transpose(0, 1).repeat_interleave(H // KVH, 0)
        v = v.view(T, KVH, HD).transpose(0, 1).repeat_interleave(H // KVH, 0)
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        att = (q @ k.transpose(1, 2)) / math.sqrt(HD)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        o = (att @ v).transpose(0, 1).reshape(T, s.q_size)
        x = x + o @ p[pre + "o_proj.weight"].T
        h = norm(x, p[pre + "post_attention_layernorm"])
        g, u = (h @ p[pre + "gate_up_proj.weight"].T).chunk(2, -1)
        x = x + (F.silu(g) * u) @ p[pre + "down_proj.weight"].T
    return norm(x, p["norm"]) @ core.model.lm_head.T


def test_paged_prefill_and_decode_match_dense_reference():
    core = make_core(budget=512)
    rec = record_logits(core)
    prompt = prompts(1, lengths=(37,))[1]
    out = core.generate([(1, prompt, SamplingParams(max_tokens=20, temperature=0))])[1]
    full = prompt + out
    ref = dense_forward(core, full[:-1])
    # Step 0 is the prefill (logits of the last prompt token), then one decode per token.
    assert len(rec) == 20
    for i, lg in enumerate(rec):
        torch.testing.assert_close(lg[0], ref[len(prompt) - 1 + i], rtol=1e-4, atol=1e-4)
    assert out == ref[len(prompt) - 1 :].argmax(-1).tolist()


def test_untied_model_matches_dense_reference():
    cfg = EngineConfig.from_preset("tiny-untied", num_blocks=32)
    core = RefCore(cfg, RefCore.allocate_pools(cfg), True)
    assert not core.model.lm_head.data_ptr() == core.model.embed.data_ptr()
    rec = record_logits(core)
    prompt = prompts(1, lengths=(21,))[1]
    out = core.generate([(1, prompt, SamplingParams(max_tokens=5, temperature=0))])[1]
    ref = dense_forward(core, prompt + out[:-1])
    torch.testing.assert_close(rec[-1][0], ref[-1], rtol=1e-4, atol=1e-4)


def test_dummy_weights_reproducible_from_seed():
    a, b, c = make_core(), make_core(), make_core(seed=1)
    assert torch.equal(a.model.params["layers.1.down_proj.weight"], b.model.params["layers.1.down_proj.weight"])
    assert not torch.equal(a.model.params["layers.1.down_proj.weight"], c.model.params["layers.1.down_proj.weight"])


def test_chunked_prefill_equals_one_shot_bitwise():
    ps = prompts(8)
    reqs = [(k, ps[k], GREEDY) for k in ps]
    one = make_core(budget=512)
    rec1 = record_logits(one)
    out1 = one.generate(reqs)
    for budget in (7, 16, 33):
        chunked = make_core(budget=budget)
        out2 = chunked.generate(reqs)
        assert out2 == out1, budget
        assert chunked.counters["forward_passes"] > one.counters["forward_passes"]
    # Request 8 alone, prefilled 5 tokens at a time: its logits are bit-identical
    # to those of the one-shot batched run.
    alone = make_core(budget=5)
    rec2 = record_logits(alone)
    assert alone.generate([(8, ps[8], GREEDY)])[8] == out1[8]
    batched_rows = [lg[i] for lg in rec1 for i in range(lg.shape[0])]
    rec2 = [lg for lg in rec2 if lg.shape[0]]
    assert len(rec2) == len(out1[8])
    for lg in rec2:
        assert any(torch.equal(lg[0], r) for r in batched_rows)


def test_batch_invariance_bitwise_logits():
    ps = prompts(8)
    alone = make_core()
    rec_a = record_logits(alone)
    out_a = alone.generate([(6, ps[6], GREEDY)])[6]
    mixed = make_core(budget=23)
    row_logits: list[torch.Tensor] = []
    orig = mixed.model.forward

    def fwd(batch):
        out = orig(batch)
        row_logits.append((batch, out.clone()))
        return out

    mixed.model.forward = fwd
    reqs = [(k, ps[k], GREEDY if k in (3, 6) else SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=k))
            for k in ps]
    out_m = mixed.generate(reqs)
    assert out_m[6] == out_a
    # Every logits vector produced for request 6 alone appears bit-identically in the mixed run.
    mixed_rows = [out[i] for _, out in row_logits for i in range(out.shape[0])]
    for lg in rec_a:
        assert any(torch.equal(lg[0], m) for m in mixed_rows)


def test_seeded_sampling_independent_of_batch():
    ps = prompts(8)
    for k in (2, 5):
        sp = SamplingParams(max_tokens=30, temperature=1.0, top_k=50, seed=1234 + k)
        alone = make_core().generate([(k, ps[k], sp)])[k]
        reqs = [(j, ps[j], sp if j == k else SamplingParams(max_tokens=10 + j, temperature=0.7, seed=j)) for j in ps]
        assert make_core(budget=19).generate(reqs)[k] == alone
    # Same seed, same tokens; another seed, other tokens.
    sp1 = SamplingParams(max_tokens=30, temperature=1.0, seed=1)
    sp2 = SamplingParams(max_tokens=30, temperature=1.0, seed=2)
    a = make_core().generate([(1, ps[1], sp1)])[1]
    assert make_core().generate([(9, ps[1], sp1)])[9] == a
    assert make_core().generate([(1, ps[1], sp2)])[1] != a


def run_logprobs(core: RefCore, reqs) -> dict[int, list]:
    """Run requests to completion: per key, (token, logprobs entry) per output token."""
    for key, ids, sp in reqs:
        core.add_request(key, ids, sp)
    out: dict[int, list] = {key: [] for key, _, _ in reqs}
    while core.has_work():
        for o in core.step():
            lps = o.logprobs if o.logprobs is not None else [None] * len(o.new_token_ids)
            out[o.key] += list(zip(o.new_token_ids, lps))
    return out


def test_logprobs_are_the_raw_distribution_and_do_not_change_sampling():
    ps = prompts(4)
    rec_core = make_core()
    logits = record_logits(rec_core)
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=5, logprobs=4)
    got = run_logprobs(rec_core, [(1, ps[1], sp)])[1]
    # The same tokens as without logprobs.
    plain = make_core().generate([(1, ps[1], SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=5))])[1]
    assert [t for t, _ in got] == plain
    # Each entry is log_softmax of the raw logits the token was sampled from (no temperature, no top-k).
    assert len(logits) == len(got)
    for (tok, (lp, rank, top_ids, top_lps)), lg in zip(got, logits):
        ref = torch.log_softmax(lg[-1].float(), dim=-1)
        assert lp == pytest.approx(ref[tok].item(), abs=1e-6)
        assert rank == int((ref > ref[tok]).sum()) + 1
        v, i = ref.topk(4)
        assert top_ids == i.tolist() and top_lps == pytest.approx(v.tolist(), abs=1e-6)
        if rank <= 4:
            assert top_ids[rank - 1] == tok
    # Greedy: the chosen token is the most likely; logprobs=0 gives its own only.
    greedy = run_logprobs(make_core(), [(2, ps[2], SamplingParams(max_tokens=8, temperature=0.0, logprobs=0))])[2]
    assert all(rank == 1 and top == [] for _, (_, rank, top, _) in greedy)
    # Batch-independent, as sampling is; a request without logprobs gets none.
    mixed = run_logprobs(make_core(budget=19), [(1, ps[1], sp), (3, ps[3], SamplingParams(max_tokens=5, temperature=0.0))])
    assert mixed[1] == got and all(lp is None for _, lp in mixed[3])


def test_logit_bias_and_min_tokens():
    ps = prompts(2)
    core = make_core()
    eos = min(core.tokenizer.eos_token_ids)
    # +100 on one token: greedy picks it every time.
    out = make_core().generate([(1, ps[1], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                            logit_bias={65: 100.0}))])[1]
    assert out == [65] * 10
    # An end of sequence forced by the bias: 1 token; with min_tokens=5, five others first.
    forced = {eos: 100.0}
    assert core.generate([(2, ps[2], SamplingParams(max_tokens=16, temperature=0.0, logit_bias=forced))])[2] == [eos]
    out = make_core().generate([(3, ps[2], SamplingParams(max_tokens=16, temperature=0.0, logit_bias=forced,
                                                            min_tokens=5))])[3]
    assert len(out) == 6 and out[-1] == eos and eos not in out[:5]


def test_adjust_logits_by_hand():
    """Each adjustment on a row small enough to work out by hand: prompt [0, 1],
    output so far [1, 3], sampling position 4."""
    from frmps_engine.refengine.sampling import adjust_logits

    sp = SamplingParams(max_tokens=8, logit_bias={4: 1.0}, min_tokens=3, repetition_penalty=2.0, presence_penalty=0.5,
                        frequency_penalty=0.25)
    lg = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0], [2.0, -1.0, 0.5, 3.0, 0.0]])
    out = adjust_logits(lg, [(sp, [0, 1, 1, 3], 2, 4), (SamplingParams(max_tokens=8), [0, 1, 1, 3], 2, 4)], frozenset({2}))
    # bias: 0 + 1 on token 4; min_tokens: 2 outputs < 3, the end of sequence (2) masked;
    # repetition on tokens seen in prompt or output (0, 1, 3); then frequency and presence on the output's (1, 3).
    assert out[0].tolist() == [1.0, -2.0 - 0.25 - 0.5, float("-inf"), 1.5 - 0.25 - 0.5, 1.0]
    assert out[1].tolist() == lg[1].tolist() and lg[0].tolist() == [2.0, -1.0, 0.5, 3.0, 0.0]  # untouched


def test_penalties_follow_vllms_definition():
    """Greedy with the three penalties equals argmax of the recorded raw logits
    adjusted by the definitions, written out here token by token."""
    ps = prompts(3)
    prompt = ps[3]
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.7,
                        repetition_penalty=1.8)
    core = make_core()
    logits = record_logits(core)
    out = core.generate([(1, prompt, sp)])[1]
    assert len(logits) == len(out)
    for i, lg in enumerate(logits):
        row = lg[-1].double().tolist()
        context, generated = prompt + out[:i], out[:i]
        for t in set(context):
            row[t] = row[t] / 1.8 if row[t] > 0 else row[t] * 1.8
        for t in set(generated):
            row[t] -= 0.7 * generated.count(t) + 0.5
        assert out[i] == max(range(len(row)), key=row.__getitem__), i
    plain = make_core().generate([(1, prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))])[1]
    assert out != plain


def test_unseeded_request_gets_key_derived_seed():
    core = make_core()
    ps = prompts(1)
    core.add_request(77, ps[1], SamplingParams(max_tokens=5))
    (v,) = core.request_views()
    core2 = make_core()
    core2.add_request(77, ps[1], SamplingParams(max_tokens=5))
    assert v.seed == core2.request_views()[0].seed and v.seed != 0
    assert core.generate([])[77] == core2.generate([])[77]


def test_sampler_rows_independent_and_filters():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g) * 3
    params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in
              [(0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.5), (1.0, 1, 1.0), (1.0, 0, 1e-6)]]
    seeds, pos = [11, 12, 13, 14, 15, 16], [3, 9, 27, 81, 243, 729]
    batched = sample(logits, params, seeds, pos)
    for i in range(6):
        assert sample(logits[i : i + 1], [params[i]], [seeds[i]], [pos[i]]) == [batched[i]]
    am = logits.argmax(-1).tolist()
    assert batched[0] == am[0] and batched[4] == am[4] and batched[5] == am[5]
    assert batched[2] in torch.topk(logits[2], 5).indices.tolist()


def test_sampling_follows_softmax():
    n = 4000
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(n, 4)
    toks = sample(logits, [SamplingParams(temperature=1.0)] * n, [42] * n, list(range(n)))
    counts = [toks.count(i) for i in range(4)]
    probs = logits[0].softmax(-1).tolist()
    for c, p in zip(counts, probs):
        assert abs(c / n - p) < 0.03, (counts, probs)
    # The noise depends on (seed, position) only.
    k = torch.tensor([row_key(5, 9)])
    assert torch.equal(gumbel_noise(k, 50), gumbel_noise(k, 50))
    assert not torch.equal(gumbel_noise(k, 50), gumbel_noise(torch.tensor([row_key(5, 10)]), 50))


def test_structured_outputs_constrain_the_output():
    """The tiny model's byte tokenizer through xgrammar: each kind of constraint
    holds, greedy and sampled, and the output ends where the grammar does."""
    import re

    ps = prompts(2)
    cases = [(("regex", "[a-c]{3}-[0-9]{2}"), lambda t: re.fullmatch("[a-c]{3}-[0-9]{2}", t)),
             (("choice", json.dumps(["yes", "no", "maybe"])), lambda t: t in ("yes", "no", "maybe")),
             (("grammar", 'root ::= "x" [0-9] [0-9] "y"'), lambda t: re.fullmatch("x[0-9][0-9]y", t))]
    for (kind, value), ok in cases:
        for sp in (SamplingParams(max_tokens=24, temperature=0.0, structured=(kind, value)),
                   SamplingParams(max_tokens=24, temperature=1.0, seed=4, structured=(kind, value))):
            core = make_core()
            out = core.generate([(1, ps[1], sp)])[1]
            text = bytes(t for t in out if t < 256).decode()
            assert ok(text), (kind, text)
    # A JSON object, its braces pushed by the bias (a random model in a JSON string rarely closes it).
    sp = SamplingParams(max_tokens=40, temperature=0.0, structured=("json_object", ""),
                        logit_bias={ord("{"): 30.0, ord("}"): 30.0})
    out = make_core().generate([(2, ps[2], sp)])[2]
    assert isinstance(json.loads(bytes(t for t in out if t < 256)), dict)
    # An object, not any JSON value: a '[' pushed harder still opens an object.
    sp = SamplingParams(max_tokens=40, temperature=0.0, structured=("json_object", ""),
                        logit_bias={ord("["): 60.0, ord("{"): 30.0, ord("}"): 30.0})
    out = make_core().generate([(4, ps[2], sp)])[4]
    assert isinstance(json.loads(bytes(t for t in out if t < 256)), dict)
    # Unconstrained, the same request is not JSON: the check can fail.
    plain = make_core().generate([(2, ps[2], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))])[2]
    assert not re.fullmatch("[a-c]{3}-[0-9]{2}", bytes(t for t in plain if t < 256).decode(errors="replace"))
    with pytest.raises(EngineError, match="structured outputs"):
        make_core().add_request(3, ps[1], SamplingParams(max_tokens=4, structured=("regex", "(")))
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=4, structured=("xml", "x"))


def test_structured_outputs_with_a_model_directorys_tokenizer(tmp_path):
    """Qwen2.5's byte-level BPE tokenizer (a `frmps model init` directory) as
    xgrammar reads it: a grammar accepts the tokens of its text and the end of
    sequence, and refuses others; a special token is never text."""
    from frmps_engine import modeldir
    from frmps_engine.refengine.grammar import Grammars
    from frmps_engine.refengine.tokenizer import HFTokenizer

    tok = HFTokenizer(modeldir.write("qwen2.5-0.5b", str(tmp_path / "m")))
    vocab, kind = tok.grammar_vocab()
    assert kind == "BYTE_LEVEL" and vocab[min(tok.eos_token_ids)] == ""
    grammars = Grammars(tok, EngineConfig.from_preset("qwen2.5-0.5b").shape.vocab_size)
    m = grammars.matcher(("json_schema", json.dumps({"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"], "additionalProperties": False})))
    assert all(m.accept_token(t) for t in tok.encode('{"city": "Oslo"}'))
    assert m.accept_token(tok.eos_token_id) and m.is_terminated()
    m = grammars.matcher(("regex", "[a-c]{3}"))
    assert not m.accept_token(tok.encode("x")[0])
    assert not m.accept_token(tok.eos_token_id)  # the end of sequence only where the grammar ends


def test_bad_adjustments():
    for kw in ({"min_tokens": 17}, {"min_tokens": -1}, {"presence_penalty": 2.5}, {"frequency_penalty": -3.0},
               {"repetition_penalty": 0.0}):
        with pytest.raises(ValueError):
            SamplingParams(max_tokens=16, **kw)


def test_bad_sampling_params():
    for kw in (dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-5),
               dict(seed=-1), dict(stop=[3])):
        with pytest.raises(ValueError):
            SamplingParams(**kw)


# ---- stopping -------------------------------------------------------------


def greedy_run(max_tokens=30, **kw):
    core = make_core()
    ps = prompts(1, lengths=(12,))
    outs = []
    core.add_request(1, ps[1], SamplingParams(max_tokens=max_tokens, temperature=0, **kw))
    while core.has_work():
        outs += core.step()
    return outs


def test_max_tokens_and_length_finish():
    outs = greedy_run(max_tokens=7)
    assert [o.output_index for o in outs] == list(range(7))
    assert outs[-1].finished and outs[-1].finish_reason == "length" and not any(o.finished for o in outs[:-1])


def test_stop_token_ids():
    base = [o.new_token_ids[0] for o in greedy_run()]
    stop_tok = base[4]
    first = base.index(stop_tok)
    outs = greedy_run(stop_token_ids=(stop_tok,))
    toks = [o.new_token_ids[0] for o in outs]
    assert toks == base[: first + 1]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop_tok


class EosTokenizer(ByteTokenizer):
    def __init__(self, eos: int) -> None:
        super().__init__()
        self.eos_token_id = eos
        self.eos_token_ids = frozenset({eos})


def test_eos_and_ignore_eos():
    base = [o.new_token_ids[0] for o in greedy_run()]
    eos = base[3]
    cfg = EngineConfig.from_preset("tiny", num_blocks=96)
    ps = prompts(1, lengths=(12,))
    core = RefCore(cfg, RefCore.allocate_pools(cfg), True, tokenizer=EosTokenizer(eos))
    out = core.generate([(1, ps[1], SamplingParams(max_tokens=30, temperature=0))])[1]
    assert out == base[: base.index(eos) + 1]
    out = core.generate([(2, ps[1], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))])[2]
    assert out == base


def test_stop_strings_cut_text():
    tok = ByteTokenizer()
    st = TextState(tok, [], stop=("o w",))
    emitted, stop = "", None
    for b in "hello world".encode():
        stop = st.add(b)
        emitted += st.take()
        if stop:
            break
    emitted += st.finish()
    assert stop == "o w" and emitted == "hell"
    st = TextState(tok, [], stop=("o w",), include_stop_str_in_output=True)
    out = ""
    for b in "hello world".encode():
        s = st.add(b)
        out += st.take()
        if s:
            break
    assert out + st.finish() == "hello w"
    # Never emits a partial stop string that later does not match: all text arrives.
    st = TextState(tok, [], stop=("xyz",))
    out = "".join(st.take() for b in "axybxyc".encode() if st.add(b) is None or True)
    assert out + st.finish() == "axybxyc"


class LetterTokenizer(ByteTokenizer):
    """Test double: every token id renders as one letter, so random output is readable text."""

    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


class CountingLetters(LetterTokenizer):
    """LetterTokenizer that counts decode calls (test double)."""

    calls = 0

    def decode(self, ids):
        CountingLetters.calls += 1
        return super().decode(ids)


def letter_run(text_outputs=True, tokenizer=None, **kw):
    cfg = EngineConfig.from_preset("tiny", num_blocks=32, text_outputs=text_outputs)
    core = RefCore(cfg, RefCore.allocate_pools(cfg), True, tokenizer=tokenizer or LetterTokenizer())
    core.add_request(1, prompts(1, lengths=(12,))[1], SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True, **kw))
    outs = []
    while core.has_work():
        outs += core.step()
    return outs


def test_stop_string_in_engine():
    base = letter_run()
    text = "".join(o.text for o in base)
    assert len(text) == 40
    stop = text[20:23]  # spans three tokens
    cut = text.index(stop)
    outs = letter_run(stop=(stop, "never"))
    assert "".join(o.text for o in outs) == text[:cut]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    assert len(outs) == cut + 3  # the token completing the stop string is still reported
    outs = letter_run(stop=(stop,), include_stop_str_in_output=True)
    assert "".join(o.text for o in outs) == text[: cut + 3]


def test_without_text_outputs_only_stop_strings_are_decoded():
    """Under the SDK (text_outputs off: the generation service detokenizes) a
    request without stop strings is never decoded, and adopting one replays no
    text; stop strings still end a request at the same token."""
    base = letter_run()
    CountingLetters.calls = 0
    plain = letter_run(text_outputs=False, tokenizer=CountingLetters())
    assert CountingLetters.calls == 0
    assert [o.new_token_ids for o in plain] == [o.new_token_ids for o in base] and not any(o.text for o in plain)
    stop = "".join(o.text for o in base)[20:23]
    want = letter_run(stop=(stop,))
    got = letter_run(text_outputs=False, tokenizer=CountingLetters(), stop=(stop,))
    assert CountingLetters.calls > 0
    assert [o.new_token_ids for o in got] == [o.new_token_ids for o in want] and got[-1].stop_reason == stop
    cfg = EngineConfig.from_preset("tiny", num_blocks=32, text_outputs=False)
    core = RefCore(cfg, RefCore.allocate_pools(cfg), False, tokenizer=CountingLetters())
    ids = prompts(1, lengths=(12,))[1]
    out = [o.new_token_ids[0] for o in base]
    CountingLetters.calls = 0
    core.adopt_request(5, SamplingParams(max_tokens=40, ignore_eos=True), ids + out[:30], 12, 12 + 29, [1, 2, 3], 3,
                       out[:30])
    assert CountingLetters.calls == 0


def test_incremental_detokenizer_utf8_boundaries():
    tok = ByteTokenizer()
    text = "héllo € 😀 done"
    d = IncrementalDetokenizer(tok, tok.encode("prompt "))
    deltas = [d.add(b) for b in text.encode()]
    assert "".join(deltas) + d.flush() == text
    assert all("\ufffd" not in x for x in deltas)


def test_chat_template():
    tok = ByteTokenizer()
    ids = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    rendered = "".join(
        {tok.im_start_id: "<|im_start|>", tok.im_end_id: "<|im_end|>"}.get(i, chr(i)) for i in ids)
    assert rendered == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.vocab_size <= EngineConfig.from_preset("tiny").shape.vocab_size
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "x"}])


def test_chat_template_with_tools():
    """The byte tokenizer renders tools and tool messages as chatml does (the text
    of modeldir.CHAT_TEMPLATE, Qwen2.5's: test_modeldir compares the two), the turn
    markers as its special ids only: a message that holds "<|im_start|>" stays bytes."""
    from frmps_engine.refengine.tokenizer import chatml

    tok = ByteTokenizer()
    tools = [{"type": "function", "function": {"name": "f", "description": None, "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "x <|im_start|>"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
            {"role": "tool", "content": "2"}]
    ids = tok.apply_chat_template(msgs, tools=tools)
    special = {tok.im_start_id: "<|im_start|>", tok.im_end_id: "<|im_end|>"}
    assert "".join(special.get(i, chr(i)) for i in ids) == chatml(msgs, True, tools)
    assert sum(i in special for i in ids) == 2 * 4 + 1  # system (tools), user, assistant, tool (as user); prompt
    text = chatml(msgs, True, tools)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert '\n{"type": "function", "function": {"name": "f", "description": null, "parameters": {"type": "object"}}}\n</tools>' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><|im_end|>\n' in text
    assert "<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    # Without tools nothing changes.
    assert tok.apply_chat_template(msgs[:1]) == tok.apply_chat_template(msgs[:1], tools=None) == tok.apply_chat_template(msgs[:1], tools=[])


# ---- bad input ------------------------------------------------------------


def test_block_manager_bad_inputs():
    bm = BlockManager(8)
    with pytest.raises(BlockError, match="out of range"):
        bm.pin([8])
    with pytest.raises(BlockError, match="out of range"):
        bm.pin([0])  # the reserved null block
    with pytest.raises(BlockError, match="twice"):
        bm.pin([3, 3])
    got = bm.allocate(2)
    with pytest.raises(BlockError, match="already in use"):
        bm.pin([5, got[0]])
    assert bm.refcount(5) == 0  # nothing pinned on failure
    with pytest.raises(BlockError, match="out of KV blocks"):
        bm.allocate(6)
    bm.release(got, quarantine=True)
    assert bm.num_free == 5 and bm.num_quarantined == 2
    with pytest.raises(BlockError, match="released twice"):
        bm.release(got[:1], quarantine=False)
    bm.release_quarantine()
    bm.check()
    assert bm.num_free == 7


def test_engine_bad_requests_keep_engine_usable():
    core = make_core()
    with pytest.raises(EngineError, match="empty prompt"):
        core.add_request(1, [], GREEDY)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        core.add_request(1, [1, 99999], GREEDY)
    with pytest.raises(EngineError, match="no room"):
        core.add_request(1, [1] * core.cfg.max_model_len, GREEDY)
    with pytest.raises(EngineError, match="more KV blocks than the cache has"):
        core.add_request(1, [1] * 100, SamplingParams(max_tokens=2000))
    core.add_request(1, [1, 2, 3], GREEDY)
    with pytest.raises(EngineError, match="already exists"):
        core.add_request(1, [1, 2, 3], GREEDY)
    assert core.abort(12345) is False
    assert core.abort(1) is True
    views = core.request_views()
    assert [(v.key, v.aborted) for v in views] == [(1, True)]
    assert core.request_views() == []
    assert core.generate([(2, [5, 6, 7], SamplingParams(max_tokens=3, temperature=0))])[2]


def test_adopt_bad_inputs():
    core = make_core(num_blocks=10)
    sp = GREEDY
    with pytest.raises(AdoptError, match="exceeds"):
        core.adopt_request(1, sp, [1, 2, 3], 3, 4, [1], 5)
    with pytest.raises(AdoptError, match="out of range"):
        core.adopt_request(1, sp, [1, 2, 3], 3, 2, [10], 5)
    with pytest.raises(AdoptError, match="cannot hold"):
        core.adopt_request(1, sp, list(range(40)), 40, 33, [1, 2], 5)
    with pytest.raises(AdoptError, match="differs from the snapshot"):
        core.adopt_request(1, sp, [1, 2, 3, 4], 3, 3, [1], 5, delivered_token_ids=[9])
    with pytest.raises(AdoptError, match="num_prompt"):
        core.adopt_request(1, sp, [1, 2, 3], 0, 0, [], 5)
    core.adopt_request(1, sp, [1, 2, 3], 3, 2, [4], 5)
    with pytest.raises(AdoptError, match="already in use"):
        core.adopt_request(2, sp, [1, 2, 3], 3, 2, [4], 5)
    with pytest.raises(AdoptError, match="already exists"):
        core.adopt_request(1, sp, [1, 2, 3], 3, 2, [5], 5)
    core.blocks.check()
    assert core.generate([])[1]  # the valid adoption still runs


def test_preemption_when_blocks_run_out():
    # 9 usable blocks of 16 tokens; three requests of 40 + 30 tokens need 15.
    ps = prompts(3, lengths=(40, 40, 40))
    sp = SamplingParams(max_tokens=30, temperature=0)
    small = make_core(num_blocks=10)
    out = small.generate([(k, ps[k], sp) for k in ps])
    assert small.counters["preemptions"] > 0
    small.blocks.check()
    assert small.blocks.num_free == 9
    big = make_core(num_blocks=64)
    assert big.generate([(k, ps[k], sp) for k in ps]) == out


def test_gpu_prefill_attention_math_on_cpu():
    # The SDPA path the GPU uses for prefill chunks agrees with the CPU path.
    from frmps_engine.refengine.model import SeqChunk

    core = make_core(num_blocks=32)
    m = core.model
    m.kv.normal_(generator=torch.Generator().manual_seed(0))
    for start, n in [(0, 37), (20, 13), (31, 1)]:
        sq = SeqChunk(0, n, start, [5, 9, 3, 7])
        q = torch.randn(n, m.H, m.HD)
        ks = m._key_slots(sq)
        torch.testing.assert_close(m._attn_sdpa(q, m.kv[0, 0], m.kv[0, 1], sq, ks),
                                   m._attn_grouped(q, m.kv[0, 0], m.kv[0, 1], sq, ks), rtol=1e-5, atol=1e-5)


def test_freed_blocks_wait_for_the_next_sync():
    # Once a ring consumer reads views, blocks of a finished request stay out of
    # reach until the next views call: the consumer's snapshot still names them.
    core = make_core(num_blocks=12)
    core.add_request(1, list(range(40)), SamplingParams(max_tokens=2, temperature=0))
    core.step()
    (v1,) = core.request_views()
    while core.has_work():
        core.step()
    assert core.blocks.num_quarantined == len(v1.block_ids) == 3
    core.add_request(2, list(range(100, 140)), SamplingParams(max_tokens=2, temperature=0))
    core.step()
    v2 = [v for v in core.request_views() if v.key == 2][0]
    assert not set(v2.block_ids) & set(v1.block_ids)
    assert core.blocks.num_quarantined == 0  # released by that views call
    core.blocks.check()


def test_results_do_not_depend_on_thread_count():
    # Active and standby may run with different intra-op thread counts.
    cfg = EngineConfig.from_preset("small", num_blocks=16, max_model_len=256)
    core = RefCore(cfg, RefCore.allocate_pools(cfg), True)
    rec = record_logits(core)
    ids = list(range(3, 60))
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(core.generate([(n, ids, SamplingParams(max_tokens=3, temperature=0))])[n])
    finally:
        torch.set_num_threads(1)
    assert outs[0] == outs[1]
    assert all(torch.equal(a, b) for a, b in zip(rec[:3], rec[3:]))


def test_views_are_snapshots():
    # request_views() is O(1) per request (it keeps the live lists and their lengths);
    # a view must still read as it was when taken.
    core = make_core()
    core.add_request(1, [1, 2, 3], SamplingParams(max_tokens=40, temperature=0))
    core.step()
    (v,) = core.request_views()
    toks, blocks, nc = v.token_ids, v.block_ids, v.num_computed
    for _ in range(30):
        core.step()
    assert len(core._reqs[1].token_ids) > len(toks) and len(core._reqs[1].block_ids) > len(blocks)  # noqa: SLF001
    assert (v.token_ids, v.block_ids, v.num_computed) == (toks, blocks, nc)
    b, nb, t, nt = v.parts()
    assert (b[:nb], t[:nt]) == (blocks, toks)
    assert v == v and v != core.request_views()[0]


def _committed(views) -> list[tuple]:
    return sorted((v.key, tuple(v.token_ids), v.num_prompt, v.num_computed, v.finished, v.aborted) for v in views)


@pytest.mark.parametrize("after_enqueue", [True, False], ids=["gpu-placement", "cpu-placement"])
@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
def test_on_launch_sees_the_previous_steps_committed_state(exact, after_enqueue):
    # The engine loop publishes the ring record from inside the next step, once its
    # pass is enqueued (so the publish overlaps the device's work; on the CPU before
    # the pass, which computes synchronously). There the views must equal those right
    # after the previous step, and the hook must not change what the engine computes.
    a, b = make_core(exact=exact, max_num_seqs=8), make_core(exact=exact, max_num_seqs=8)
    a._launch_async = after_enqueue  # noqa: SLF001  (the GPU's placement, run on the CPU)
    ps = prompts(6)
    sp = {k: SamplingParams(max_tokens=10 + k, temperature=0.0 if k % 2 else 0.8, seed=k) for k in ps}
    outs_a: dict[int, list[int]] = {}
    outs_b: dict[int, list[int]] = {}
    hooked = 0
    for step in range(80):
        for k in ps:
            if step == (0 if k <= 3 else k):
                a.add_request(k, ps[k], sp[k])
                b.add_request(k, ps[k], sp[k])
        if step == 5:
            assert a.abort(3) and b.abort(3)
        before = _committed(b.request_views())  # b: the state right after the previous step
        seen = []

        def hook():
            views = a.request_views()
            seen.append(_committed(views))
            bs = a.cfg.block_size
            for v in views:
                if not (v.finished or v.aborted):
                    assert len(v.block_ids) >= -(-v.num_computed // bs)

        for o in a.step(on_launch=hook):
            outs_a.setdefault(o.key, []).extend(o.new_token_ids)
        for o in b.step():
            outs_b.setdefault(o.key, []).extend(o.new_token_ids)
        assert len(seen) <= 1
        if seen:
            hooked += 1
            assert seen[0] == before, f"step {step}"
        if not (a.has_work() or b.has_work()) and step > 6:
            break
    assert outs_a == outs_b and hooked > 20


def test_reset_forgets_requests_frees_blocks_and_writes_nothing():
    """A planned handover's reset: every request and block gone, the KV pool
    untouched (its contents belong to the next engine), and the engine then
    adopts those requests back as a standby would and finishes them exactly."""
    ps = prompts(3)
    ref = make_core().generate((k, p, SamplingParams(max_tokens=12, temperature=0.8, seed=k)) for k, p in ps.items())
    core = make_core()
    for k, p in ps.items():
        core.add_request(k, p, SamplingParams(max_tokens=12, temperature=0.8, seed=k))
    out = {k: [] for k in ps}
    for _ in range(4):
        for o in core.step():
            out[o.key] += o.new_token_ids
    views = {v.key: v for v in core.request_views()}
    kv = core.model.kv.clone()
    core.reset()
    assert not core.has_work() and core.request_views() == []
    assert core.blocks.num_free == core.cfg.num_blocks - 1
    core.blocks.check()
    assert torch.equal(core.model.kv, kv)
    for k, v in views.items():
        core.adopt_request(k, SamplingParams(max_tokens=12, temperature=0.8, seed=k), list(v.token_ids), v.num_prompt,
                           v.num_computed, list(v.block_ids), v.seed, out[k])
    while core.has_work():
        for o in core.step():
            out[o.key] += o.new_token_ids
    assert out == ref
