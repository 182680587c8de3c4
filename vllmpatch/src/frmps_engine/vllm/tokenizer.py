"""The SDK's Tokenizer protocol over the tokenizer vLLM loads for a model."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence


def _backend_decoder(tok: Any) -> Callable[..., str] | None:
    """The Rust decode under a Hugging Face fast tokenizer, where it gives the same
    text as tok.decode: transformers' decode of a fast tokenizer is the backend's
    decode followed by an optional clean-up (`clean_up_tokenization_spaces`), and
    vLLM wraps it in a borrow from its tokenizer pool. Per call that is several times
    the backend's own cost, paid for every token a resumed stream replays (its
    delivered output, in the first step after a takeover). Checked on a sample at
    load (every special token and a spread of the vocabulary, alone and in pairs);
    None (use tok.decode) if any differs or the tokenizer has no such backend."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or getattr(tok, "clean_up_tokenization_spaces", True) is not False:
        return None
    decode = getattr(backend, "decode", None)
    try:
        n = int(backend.get_vocab_size(with_added_tokens=True))
        special = [int(i) for i in (getattr(tok, "all_special_ids", None) or [])][:64]
        spread = list(range(0, n, max(1, n // 512)))[:512] + list(range(max(0, n - 64), n))
        sample = [[i] for i in special + spread] + [[a, b] for a, b in zip(spread, reversed(spread))]
        sample += [special + spread[:8], spread[:32]]
        for ids in sample:
            if decode(ids, skip_special_tokens=True) != tok.decode(ids, skip_special_tokens=True):
                return None
    except Exception:  # any surprise: the tokenizer's own decode
        return None
    return decode


class VllmTokenizer:
    """The SDK's Tokenizer protocol over vLLM's tokenizer (HF fast tokenizer + chat template)."""

    def __init__(self, tok: Any):
        if tok is None:
            raise ValueError("vLLM was configured without a tokenizer (skip_tokenizer_init)")
        self._tok = tok
        self.eos_token_id = tok.eos_token_id
        self._backend = _backend_decoder(tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode_backend(self) -> Any:
        """The ``tokenizers.Tokenizer`` whose decode this one's is, where it is (detok
        builds its byte table from it); else None."""
        return self._tok.backend_tokenizer if self._backend is not None else None

    def decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend(list(ids), skip_special_tokens=True)
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The model's chat template (Hugging Face's apply_chat_template, as vLLM's
        renderer calls it), with the request's tools (rendered by the template:
        Qwen2.5's lists them in the system turn)."""
        ids = self._tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                            tokenize=True)
        if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding (a Mapping, not a dict)
            ids = ids["input_ids"]
        return list(ids)
