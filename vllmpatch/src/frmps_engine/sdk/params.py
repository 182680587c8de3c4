"""Validation and normalisation of wire sampling params, shared by Generate and takeover."""

from __future__ import annotations

import json
import math

from frmps_engine._proto.frmps.v1 import control_pb2

from .seeds import derive_seed

class InvalidRequest(ValueError):
    """Bad client input: maps to INVALID_ARGUMENT."""


def normalize(p: control_pb2.SamplingParams, key: int, prompt_len: int, max_model_len: int, vocab_size: int | None = None) -> control_pb2.SamplingParams:
    """Return a copy with defaults filled in (max_tokens, top_p, seed); raise InvalidRequest on bad values."""
    out = control_pb2.SamplingParams()
    out.CopyFrom(p)
    if math.isnan(p.temperature) or p.temperature < 0:
        raise InvalidRequest(f"temperature must be >= 0, got {p.temperature}")
    if p.top_p == 0:
        out.top_p = 1.0
    elif math.isnan(p.top_p) or not 0 < p.top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1], got {p.top_p}")
    if p.top_k == -1:
        out.top_k = 0
    elif p.top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0 (0 = disabled), got {p.top_k}")
    room = max_model_len - prompt_len
    out.max_tokens = room if p.max_tokens == 0 else min(p.max_tokens, room)
    if any(s == "" for s in p.stop):
        raise InvalidRequest("stop strings must not be empty")
    if vocab_size is not None:
        bad = [t for t in p.stop_token_ids if t >= vocab_size]
        if bad:
            raise InvalidRequest(f"stop_token_ids {bad[:5]} outside the vocabulary (size {vocab_size})")
    if not -2.0 <= p.presence_penalty <= 2.0 or not -2.0 <= p.frequency_penalty <= 2.0:
        raise InvalidRequest("presence_penalty and frequency_penalty must be in [-2, 2]")
    if math.isnan(p.repetition_penalty) or p.repetition_penalty < 0 or math.isinf(p.repetition_penalty):
        raise InvalidRequest(f"repetition_penalty must be > 0 (0: none), got {p.repetition_penalty}")
    if p.min_tokens > out.max_tokens:
        raise InvalidRequest(f"min_tokens {p.min_tokens} is more than max_tokens {out.max_tokens}")
    if vocab_size is not None:
        bad = [t for t in p.logit_bias if t >= vocab_size]
        if bad:
            raise InvalidRequest(f"logit_bias token ids {sorted(bad)[:5]} outside the vocabulary (size {vocab_size})")
    if p.HasField("structured_outputs") and p.structured_outputs.WhichOneof("kind") == "choice" \
            and not p.structured_outputs.choice.values:
        raise InvalidRequest("structured_outputs.choice must not be empty")
    if not p.HasField("seed"):
        out.seed = derive_seed(key)
    return out


def structured_constraint(p: control_pb2.SamplingParams) -> tuple[str, str] | None:
    """The request's structured-output constraint as (kind, value) (refengine/grammar.py),
    or None: json_schema (the schema's JSON), json_object (""), regex, choice (a JSON
    list of the strings), grammar."""
    if not p.HasField("structured_outputs"):
        return None
    so = p.structured_outputs
    kind = so.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        return ("json_object", "")
    if kind == "choice":
        return ("choice", json.dumps(list(so.choice.values)))
    return (kind, getattr(so, kind))
