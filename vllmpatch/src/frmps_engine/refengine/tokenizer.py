"""Tokenizers, incremental detokenization, stop strings and the chat template.

`load_tokenizer(model_dir)` uses the `tokenizers` library on `tokenizer.json`;
without a model directory a byte-level tokenizer stands in (ids 0-255 are
bytes, then a few ChatML specials), which fits every preset's vocabulary.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from frmps_engine.sdk.detok import window_decoder


class TokenizerError(ValueError):
    pass


class Tokenizer(Protocol):
    eos_token_id: int
    eos_token_ids: frozenset[int]
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def apply_chat_template(self, messages: Iterable[Any], add_generation_prompt: bool = True,
                            tools: Sequence[Any] | None = None) -> list[int]: ...


def _field(m: Any, name: str) -> Any:
    return m.get(name) if isinstance(m, Mapping) else getattr(m, name, None)


def _role_content(m: Any) -> tuple[str, str]:
    role, content = _field(m, "role"), _field(m, "content")
    if not isinstance(role, str) or not role:
        raise TokenizerError(f"chat message without a role: {m!r}")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise TokenizerError(f"chat message content must be text, got {type(content).__name__}")
    return role, content


class ByteTokenizer:
    """Byte-level tokenizer: ids 0-255 are raw bytes; 256.. are specials."""

    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

    def __init__(self) -> None:
        self.endoftext_id = 256
        self.im_start_id = 257
        self.im_end_id = 258
        self.vocab_size = 256 + len(self.SPECIALS)
        # Chat models end a turn with <|im_end|>; base models with <|endoftext|>.
        self.eos_token_id = self.im_end_id
        self.eos_token_ids = frozenset({self.im_end_id, self.endoftext_id})

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def grammar_vocab(self) -> tuple[list[bytes], str]:
        """Each id's bytes for xgrammar (grammar.py): the specials as empty tokens,
        which a grammar never allows (the end of sequence ends it)."""
        return [bytes([i]) for i in range(256)] + [b""] * len(self.SPECIALS), "RAW"

    def apply_chat_template(self, messages: Iterable[Any], add_generation_prompt: bool = True,
                            tools: Sequence[Any] | None = None) -> list[int]:
        # The turn markers are the special ids; text is bytes, so a message that
        # holds "<|im_start|>" cannot open a turn.
        out: list[int] = []
        for special, part in chatml_parts(messages, add_generation_prompt, tools):
            out += [self.im_start_id if part == IM_START else self.im_end_id] if special else self.encode(part)
        return out


class HFTokenizer:
    """A Hugging Face `tokenizer.json` through the `tokenizers` library, ChatML template."""

    def __init__(self, model_dir: str) -> None:
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError as e:  # pragma: no cover - dependency missing
            raise TokenizerError("the 'tokenizers' package is needed for tokenizer.json") from e
        path = os.path.join(model_dir, "tokenizer.json")
        try:
            self._tok = _Tok.from_file(path)
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise TokenizerError(f"load tokenizer {path!r}: {e}") from e
        self._path = path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        ids = set()
        for tok in _eos_candidates(model_dir):
            if isinstance(tok, int):
                ids.add(tok)
            elif isinstance(tok, str):
                t = self._tok.token_to_id(tok)
                if t is not None:
                    ids.add(t)
        im_end = self._tok.token_to_id("<|im_end|>")
        eot = self._tok.token_to_id("<|endoftext|>")
        if not ids:
            ids = {t for t in (im_end, eot) if t is not None}
        if not ids:
            raise TokenizerError(f"tokenizer {path!r}: no end-of-sequence token found")
        self.eos_token_ids = frozenset(ids)
        self.eos_token_id = im_end if im_end in ids else min(ids)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def grammar_vocab(self) -> tuple[list[str], str]:
        """Each id's token string for xgrammar (grammar.py), special tokens as empty
        ones, and how the strings encode bytes (tokenizer.json's decoder)."""
        vocab = [""] * self.vocab_size
        for tok, i in self._tok.get_vocab(with_added_tokens=True).items():
            if 0 <= i < len(vocab):
                vocab[i] = tok
        for i, added in self._tok.get_added_tokens_decoder().items():
            if added.special and 0 <= i < len(vocab):
                vocab[i] = ""
        with open(self._path, encoding="utf-8") as f:
            decoder = json.dumps(json.load(f).get("decoder"))
        kind = "BYTE_LEVEL" if '"ByteLevel"' in decoder else "BYTE_FALLBACK" if '"ByteFallback"' in decoder else "RAW"
        return vocab, kind

    def decode_backend(self) -> Any:
        """The ``tokenizers.Tokenizer`` decode uses (detok builds its byte table from it)."""
        return self._tok

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: Iterable[Any], add_generation_prompt: bool = True,
                            tools: Sequence[Any] | None = None) -> list[int]:
        return self.encode(chatml(messages, add_generation_prompt, tools))


def _eos_candidates(model_dir: str) -> list[Any]:
    out: list[Any] = []
    for fname, key in (("generation_config.json", "eos_token_id"), ("tokenizer_config.json", "eos_token")):
        try:
            with open(os.path.join(model_dir, fname), encoding="utf-8") as f:
                v = json.load(f).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(v, dict):  # {"content": "<|im_end|>", ...}
            v = v.get("content")
        out += v if isinstance(v, list) else [v]
    return out


IM_START, IM_END = "<|im_start|>", "<|im_end|>"

# Qwen2.5's tool preamble (modeldir.CHAT_TEMPLATE's, which a model directory carries).
_TOOLS_HEAD = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
               "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
               "<args-json-object>}\n</tool_call>")


def _tojson(v: Any) -> str:
    """Hugging Face's tojson filter in chat templates."""
    return json.dumps(v, ensure_ascii=False)


def chatml_parts(messages: Iterable[Any], add_generation_prompt: bool = True,
                 tools: Sequence[Any] | None = None) -> list[tuple[bool, str]]:
    """A chat in ChatML as (special, text) parts, the turn markers special: what
    modeldir.CHAT_TEMPLATE renders (Qwen2.5's format) for the messages, the tools
    (listed in the system turn), an assistant's tool_calls (<tool_call> blocks) and
    tool results (<tool_response> blocks in a user turn). A role the template does
    not know is rendered as a plain turn."""
    msgs = [(m, *_role_content(m)) for m in messages]
    out: list[tuple[bool, str]] = []

    def turn(role: str, content: str) -> None:
        out.extend([(True, IM_START), (False, f"{role}\n{content}"), (True, IM_END), (False, "\n")])

    if tools:
        system = msgs[0][2] if msgs and msgs[0][1] == "system" else "You are a helpful assistant."
        listed = "".join("\n" + _tojson(t) for t in tools)
        turn("system", system + _TOOLS_HEAD + listed + _TOOLS_TAIL)
    for i, (m, role, content) in enumerate(msgs):
        calls = _field(m, "tool_calls") if role == "assistant" else None
        if role == "system" and i == 0 and tools:
            continue  # in the tools' system turn
        if role == "assistant" and calls:
            text = "assistant" + ("\n" + content if content else "")
            for c in calls:
                f = c.get("function", c) if isinstance(c, Mapping) else c
                args = f.get("arguments")
                text += ('\n<tool_call>\n{"name": "' + str(f.get("name")) + '", "arguments": '
                         + (args if isinstance(args, str) else _tojson(args)) + "}\n</tool_call>")
            out.extend([(True, IM_START), (False, text), (True, IM_END), (False, "\n")])
        elif role == "tool":
            if i == 0 or msgs[i - 1][1] != "tool":
                out.extend([(True, IM_START), (False, "user")])
            out.append((False, "\n<tool_response>\n" + content + "\n</tool_response>"))
            if i == len(msgs) - 1 or msgs[i + 1][1] != "tool":
                out.extend([(True, IM_END), (False, "\n")])
        else:
            turn(role, content)
    if add_generation_prompt:
        out.extend([(True, IM_START), (False, "assistant\n")])
    return out


def chatml(messages: Iterable[Any], add_generation_prompt: bool = True, tools: Sequence[Any] | None = None) -> str:
    return "".join(text for _, text in chatml_parts(messages, add_generation_prompt, tools))


def load_tokenizer(model_dir: str | None) -> Tokenizer:
    if model_dir and os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        return HFTokenizer(model_dir)
    return ByteTokenizer()


class IncrementalDetokenizer:
    """Turns a growing token list into stable text.

    Text is released only when it no longer ends in an incomplete UTF-8
    sequence (U+FFFD), decoding a small window of recent tokens so that the cost
    per token is constant (the scheme vLLM and TGI use).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self._window = window_decoder(tokenizer)
        # A few prompt tokens give the first output tokens their left context
        # (sentencepiece-style leading spaces).
        self._ids: list[int] = list(prompt_ids[-4:])
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        ids = self._ids
        ids.append(int(token_id))
        prefix_text = self._window(ids, self._prefix, self._read)
        new_text = self._window(ids, self._prefix, len(ids))
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self._ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Release whatever is held back (at the end of a sequence)."""
        prefix_text = self._window(self._ids, self._prefix, self._read)
        new_text = self._window(self._ids, self._prefix, len(self._ids))
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta


class NoText:
    """TextState's stand-in for a request whose text nobody reads (the engine's
    text outputs are off and it has no stop strings): no decoding at all."""

    stopped_by = None

    def add(self, token_id: int) -> None:
        return None

    def take(self) -> str:
        return ""

    def finish(self) -> str:
        return ""


def text_state(tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = (),
               include_stop_str_in_output: bool = False, text_outputs: bool = True) -> "TextState | NoText":
    """The request's text state: a TextState where its text or stop strings are needed."""
    if not text_outputs and not any(stop):
        return NoText()
    return TextState(tokenizer, prompt_ids, stop, include_stop_str_in_output)


class TextState:
    """Output text of one request: detokenization, stop strings and what was emitted.

    The emitted prefix is a pure function of the tokens processed so far, so a
    standby that replays the delivered tokens knows exactly which text the
    client already has.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stop = [s for s in stop if s]
        self._include = include_stop_str_in_output
        # Hold back enough text that a stop string is never partly emitted.
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # final output text so far (may run ahead of what was emitted)
        self.emitted = 0
        self.stopped_by: str | None = None

    def add(self, token_id: int) -> str | None:
        """Process one token; returns the matched stop string, if any."""
        delta = self._detok.add(token_id)
        return self._append(delta)

    def finish(self) -> str:
        """Flush at the end of the sequence; returns the text not yet emitted."""
        if self.stopped_by is None:
            self._append(self._detok.flush())
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out

    def take(self) -> str:
        """Text that may be emitted now."""
        limit = len(self.text) if self.stopped_by is not None else len(self.text) - self._hold
        if limit <= self.emitted:
            return ""
        out = self.text[self.emitted : limit]
        self.emitted = limit
        return out

    def _append(self, delta: str) -> str | None:
        if not delta or self.stopped_by is not None:
            return self.stopped_by
        start = max(0, len(self.text) - self._hold)
        self.text += delta
        best = None
        for s in self._stop:
            i = self.text.find(s, max(0, start - 0))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.text = self.text[: i + len(s)] if self._include else self.text[:i]
            self.stopped_by = s
        return self.stopped_by
