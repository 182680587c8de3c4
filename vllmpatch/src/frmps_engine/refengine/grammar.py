"""Structured outputs for the reference engine, with xgrammar (the library vLLM
uses by default, installed with it): a request's constraint compiles to a
grammar, a matcher per request masks the logits of each token it samples and
accepts the token sampled. A matcher's state is a function of the output
tokens it accepted, so a standby that adopts a request replays the delivered
tokens through a fresh matcher (the scheduler's stop checks do) and continues
exactly where the active stood.

A constraint is ``(kind, value)``: ``("json_schema", schema JSON)``,
``("json_object", "")``, ``("regex", pattern)``, ``("choice", JSON list of
strings)``, ``("grammar", EBNF)``, as vLLM's StructuredOutputsParams.
"""

from __future__ import annotations

import json
import re
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class GrammarError(ValueError):
    pass


class Grammars:
    """Compiles constraints for one tokenizer and model vocabulary (compiled
    grammars are cached by xgrammar's compiler) and makes matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler: Any = None

    def _xgr(self) -> Any:
        try:
            import xgrammar
        except ImportError as e:  # pragma: no cover - installed with vLLM
            raise GrammarError("structured outputs need the xgrammar package (installed with vLLM)") from e
        return xgrammar

    def compiler(self) -> Any:
        if self._compiler is None:
            xgr = self._xgr()
            vocab, kind = self._tokenizer.grammar_vocab()
            info = xgr.TokenizerInfo(vocab, getattr(xgr.VocabType, kind), vocab_size=self._vocab_size,
                                     stop_token_ids=sorted(self._tokenizer.eos_token_ids))
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler

    def matcher(self, constraint: tuple[str, str]) -> Any:
        kind, value = constraint
        c = self.compiler()
        try:
            if kind == "json_schema":
                g = c.compile_json_schema(value)
            elif kind == "json_object":
                g = c.compile_json_schema('{"type": "object"}')  # an object, not any JSON value: as vLLM
            elif kind == "regex":
                g = c.compile_regex(value)
            elif kind == "choice":
                g = c.compile_regex("|".join(re.escape(s) for s in json.loads(value)))
            elif kind == "grammar":
                g = c.compile_grammar(value)
            else:
                raise GrammarError(f"unknown structured output kind {kind!r} (one of {', '.join(KINDS)})")
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with the reason
            raise GrammarError(f"structured outputs ({kind}): {e}") from None
        return self._xgr().GrammarMatcher(g)

    def mask(self, logits: Any, rows: list[tuple[int, Any]]) -> None:
        """Mask, in place, the logits rows of these (row, matcher) pairs to the
        tokens their grammars allow next."""
        xgr = self._xgr()
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], self._vocab_size)
        for r, m in rows:
            m.fill_next_token_bitmask(bitmask, r)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self._vocab_size,
                                        indices=[r for r, _ in rows])


def check_constraint(constraint: tuple[str, str] | None) -> tuple[str, str] | None:
    """Validate a constraint's shape (not its grammar: compiling does that)."""
    if constraint is None:
        return None
    if not (isinstance(constraint, tuple) and len(constraint) == 2 and constraint[0] in KINDS
            and isinstance(constraint[1], str)):
        raise ValueError(f"structured must be None or (kind, value) with kind one of {KINDS}, got {constraint!r}")
    if constraint[0] == "choice":
        values = json.loads(constraint[1])
        if not (isinstance(values, list) and values and all(isinstance(v, str) for v in values)):
            raise ValueError("a choice constraint is a JSON list of strings")
    return constraint
