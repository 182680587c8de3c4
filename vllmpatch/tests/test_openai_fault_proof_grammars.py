"""The OpenAI fault proof's regex cases keep xgrammar to its word with the project's
Qwen2.5 tokenizer: every token xgrammar's bitmask allows, its matcher accepts.

vLLM masks the logits with the bitmask, samples, then advances the matcher with the
sampled token; a token the matcher refuses makes its scheduler abort the request
("grammar rejected tokens"). Under a character class such as [a-z]{300}, xgrammar
(0.2.7, vLLM 0.26's, and 0.2.8, vLLM 0.33's) allows tokens of a letter and a lone
byte (0xC1, 0xE0 or 0xF0: 'bà') that it then refuses: the negative control below. A seeded
model that favours one of them fails such a case before any fault, so the proof
uses grammars without that disagreement (openai_fault_proof.auto_parser_regex)."""

from __future__ import annotations

import os
import random

import pytest

from e2e import require
from frmps_engine import modeldir
from test_proofcount import _load  # bench/gpu's scripts, loaded by path

xgr = require("xgrammar")
transformers = require("transformers")
torch = require("torch")
pytestmark = pytest.mark.torch

ofp = _load("openai_fault_proof")


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    d = os.path.join(str(tmp_path_factory.mktemp("qwen")), "qwen2.5-0.5b")
    modeldir.write("qwen2.5-0.5b", d)  # config and tokenizer, no weights
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(d)
    vocab = modeldir.config_json("qwen2.5-0.5b")["vocab_size"]
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)  # as vLLM builds it
    return xgr.GrammarCompiler(info), vocab, tok


def disagreements(compiler, regex: str, steps: int = 24, seed: int = 0) -> list[str]:
    """The tokens the bitmask allows and the matcher refuses, along a walk of
    ``steps`` tokens each picked at random among the allowed ones."""
    comp, vocab, tok = compiler
    g = comp.compile_regex(regex)
    m = xgr.GrammarMatcher(g)
    rnd = random.Random(seed)
    bad: list[str] = []
    for _ in range(steps):
        if m.is_terminated():
            break
        bm = xgr.allocate_token_bitmask(1, vocab)
        m.fill_next_token_bitmask(bm)
        bits = ((bm[0].unsqueeze(1) >> torch.arange(32, dtype=bm.dtype)) & 1).flatten()[:vocab]
        allowed = [i for i in bits.nonzero().flatten().tolist() if i < len(tok)]
        assert allowed, f"nothing allowed under {regex!r}"
        for i in allowed:
            if m.accept_token(i):
                m.rollback(1)
            else:
                bad.append(tok.convert_ids_to_tokens(i))
        assert m.accept_token(rnd.choice(allowed))
    return bad


def regex_cases() -> list[tuple[str, str]]:
    out = []
    for c in ofp.cases(600):  # the proof's default --max-tokens: xgrammar's disagreement shows at long repeats
        so = (c["body"].get("extra_body") or {}).get("structured_outputs") or {}
        if "regex" in so:
            out.append((c["id"], so["regex"]))
    return out


def test_the_proof_has_regex_cases():
    assert {cid for cid, _ in regex_cases()} >= {"cmpl-regex", "chat-tools-auto-parser-stream"}


@pytest.mark.parametrize("cid,regex", regex_cases())
def test_every_token_the_bitmask_allows_is_accepted(compiler, cid, regex):
    assert disagreements(compiler, regex) == [], cid


def test_the_check_sees_xgrammars_disagreement_under_a_character_class(compiler):
    # negative control: the auto-parser case's earlier regex
    bad = disagreements(compiler, "[a-z]{300}\\n" + ofp.regex_literal(ofp.HERMES_CALL), steps=2)
    assert "bà" in bad and len(bad) >= 78


def test_regex_literal_matches_its_text_alone(compiler):
    import re
    for s in (ofp.HERMES_CALL, "a.b*c(d)[e]{f}|g^h$i?j+k\\l\nm"):
        assert re.fullmatch(ofp.regex_literal(s), s)
        assert not re.fullmatch(ofp.regex_literal(s), s + "x")
    g = compiler[0].compile_regex(ofp.regex_literal(ofp.HERMES_CALL))
    m = xgr.GrammarMatcher(g)
    assert m.accept_string(ofp.HERMES_CALL)  # xgrammar reads it as the same text
    assert not m.accept_string("x")
