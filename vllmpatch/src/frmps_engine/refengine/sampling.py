"""Sampling parameters and a stateless, batch-independent sampler.

A token is drawn by Gumbel-max: argmax(logits / T + g) where the noise g for
vocabulary entry v is a counter-based hash of (seed, position, v). Nothing is
carried between steps and no random state is shared between requests, so the
token depends only on the request's seed, the position being sampled and the
logits: a request resumed on another engine, or batched differently, samples
exactly what it would have.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from frmps_engine.sdk.seeds import derive_seed, splitmix64

from .grammar import check_constraint

M32 = 0xFFFFFFFF
M64 = 0xFFFFFFFFFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: none; k: the token's own and the k most likely tokens'
    # vLLM's logits adjustments (adjust_logits): a bias per token id, and penalties
    # over the tokens before the position sampled.
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Structured outputs: (kind, value), refengine/grammar.py; None: unconstrained.
    structured: tuple[str, str] | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k!r}")
        if self.seed is not None and not (0 <= int(self.seed) <= M64):
            raise ValueError(f"seed must fit in 64 unsigned bits, got {self.seed!r}")
        if any(not isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be a list of strings")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        check_constraint(self.structured)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def adjusts(self) -> bool:
        """Whether adjust_logits changes anything for this request."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


def default_seed(key: int) -> int:
    """The seed given to a request that brought none (the engine side's one rule,
    sdk/seeds.py): derived from its key, so a standby that adopts the request
    before any sync still knows it."""
    return derive_seed(key)


def row_key(seed: int, position: int) -> int:
    """32-bit stream key of one (seed, position)."""
    return splitmix64(splitmix64(int(seed) & M64) ^ (int(position) & M64)) & M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    # Multipliers below 2**31 keep every product of a 32-bit value inside int64,
    # so the arithmetic is exact (no overflow) on every backend.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & M32
    x = x ^ (x >> 16)
    x = (x * 0x297A2D39) & M32
    return x ^ (x >> 15)


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] int64 stream keys -> [B, vocab] float32 standard Gumbel noise."""
    idx = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    h = _hash32((keys[:, None] ^ _hash32(idx * 0x3C6EF372 & M32)[None, :]) & M32)
    h = _hash32(h ^ (keys[:, None] >> 7))
    # 24 random bits -> u in (0, 1), exactly representable in float32.
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)
    return -torch.log(-torch.log(u))


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]) -> list[int]:
    """One token per row. Every operation is row-wise, so a row's result does not
    depend on the other rows of the batch."""
    logits = logits.float()
    n = logits.shape[0]
    out = [0] * n
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if greedy_rows:
        if len(greedy_rows) == n:
            return logits.argmax(dim=-1).tolist()
        g = logits[greedy_rows].argmax(dim=-1).tolist()
        for i, t in zip(greedy_rows, g):
            out[i] = t
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    lg = logits[rows]
    temps = torch.tensor([params[i].temperature for i in rows], dtype=torch.float32, device=lg.device)
    lg = lg / temps[:, None]
    ks = [params[i].top_k for i in rows]
    ps = [params[i].top_p for i in rows]
    vocab = lg.shape[-1]
    if any(0 < k < vocab for k in ks) or any(p < 1.0 for p in ps):
        lg = _filter_top_k_top_p(lg, ks, ps)
    keys = torch.tensor([row_key(seeds[i], positions[i]) for i in rows], dtype=torch.int64, device=lg.device)
    toks = (lg + gumbel_noise(keys, vocab)).argmax(dim=-1).tolist()
    for i, t in zip(rows, toks):
        out[i] = t
    return out


def adjust_logits(logits: torch.Tensor, rows: list[tuple[SamplingParams, list[int], int, int]],
                  eos_ids: frozenset[int]) -> torch.Tensor:
    """The logits to sample from, as vLLM's sampler adjusts them, one row at a time
    (so batch-independent): rows[i] is (params, the request's tokens, its prompt
    length, the position sampled), the tokens before that position being its
    context. In vLLM's order: the logit bias and min_tokens (end-of-sequence and
    stop tokens masked while the output is shorter), then the penalties —
    repetition on the prompt's and the output's tokens (a positive logit divided
    by it, a negative one multiplied), frequency and presence on the output's."""
    out = logits.float().clone()
    vocab = out.shape[-1]
    for i, (p, tokens, num_prompt, position) in enumerate(rows):
        if not p.adjusts:
            continue
        row = out[i]
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias if t < vocab], dtype=torch.int64, device=out.device)
            row[ids] += torch.tensor([b for t, b in p.logit_bias if t < vocab], dtype=row.dtype, device=out.device)
        if position - num_prompt < p.min_tokens:
            stops = sorted(t for t in set(p.stop_token_ids) | eos_ids if t < vocab)
            row[torch.tensor(stops, dtype=torch.int64, device=out.device)] = float("-inf")
        if p.repetition_penalty != 1.0 and position > 0:
            seen = torch.tensor(sorted(set(tokens[:position])), dtype=torch.int64, device=out.device)
            v = row[seen]
            row[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and position > num_prompt:
            counts = torch.bincount(torch.tensor(tokens[num_prompt:position], dtype=torch.int64), minlength=vocab)[:vocab]
            counts = counts.to(device=out.device, dtype=row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return out


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[tuple[float, int, list[int], list[float]]]:
    """Per row: the log probability of tokens[i], its rank (1 = the most likely),
    and the ks[i] most likely tokens with theirs, from the raw logits (before
    temperature and filtering, as vLLM's default logprobs mode). Row-wise, so
    batch-independent as sample() is."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    tok = torch.tensor(tokens, dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, tok[:, None])[:, 0]
    ranks = ((lp > chosen[:, None]).sum(dim=-1) + 1).tolist()
    kmax = min(max(ks, default=0), lp.shape[-1])
    top_v, top_i = (lp.topk(kmax, dim=-1) if kmax else (lp[:, :0], lp[:, :0].long()))
    top_v, top_i, chosen = top_v.tolist(), top_i.tolist(), chosen.tolist()
    return [(chosen[r], ranks[r], top_i[r][: ks[r]], top_v[r][: ks[r]]) for r in range(len(tokens))]


def _filter_top_k_top_p(lg: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    vocab = lg.shape[-1]
    sorted_lg, order = torch.sort(lg, dim=-1, descending=True)
    k = torch.tensor([k if 0 < k < vocab else vocab for k in ks], device=lg.device)
    pos = torch.arange(vocab, device=lg.device)[None, :]
    drop = pos >= k[:, None]
    sorted_lg = sorted_lg.masked_fill(drop, float("-inf"))
    p = torch.tensor(ps, dtype=torch.float32, device=lg.device)
    probs = torch.softmax(sorted_lg, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    before = torch.cumsum(probs, dim=-1) - probs
    drop = drop | (before >= p[:, None])
    sorted_lg = sorted_lg.masked_fill(drop, float("-inf"))
    return torch.full_like(lg, float("-inf")).scatter(-1, order, sorted_lg)
