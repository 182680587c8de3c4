"""The reference engine's scheduler: what runs in each pass, and every request's
state from arrival to retirement. It never touches the model or the device.

The engine drives it as vLLM's engine core drives its scheduler
(vllm/v1/core/sched/interface.py):

    batch = scheduler.schedule()                        # what the next pass computes
    logits = <run the model on batch>                   # the engine (engine.py)
    tokens = <sample batch.rows from logits>
    outputs = scheduler.update_from_output(batch, tokens)

``schedule()`` returns a ``SchedulerOutput``: the (request, tokens) chunks of the
pass, the logits rows it must sample and whether a decode pass is padded to a fixed
row count. ``update_from_output`` commits the pass (its KV is written: each chunk's
``num_computed`` moves on), appends the sampled tokens, applies the stop rules and
retires finished requests. Until then the committed state (``request_views()``)
is the previous pass's, which is what lets the engine publish the ring while the
device computes.

What runs is a ``SchedulingPolicy``: ``DefaultPolicy`` (continuous batching,
decodes first, chunked prefill under a token budget) or ``ExactPolicy`` (every
computed token sees the same pass shape whatever else runs, so a request resumed
on another engine reproduces its output bit for bit). Both share the rest:
admission, KV blocks (``BlockManager``), preemption, adoption, the ring views.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .block_manager import BlockError, BlockManager
from .config import EngineConfig
from .grammar import GrammarError, Grammars
from .sampling import SamplingParams, default_seed
from .tokenizer import NoText, TextState, Tokenizer, text_state

log = logging.getLogger(__name__)


class EngineError(ValueError):
    """A request or command the engine refuses; the engine itself stays usable."""


class AdoptError(EngineError):
    pass


@dataclass
class RequestOutput:
    key: int
    new_token_ids: list[int]
    output_index: int  # index in the output of new_token_ids[0]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that matched
    text: str = ""  # detokenized delta (stop strings already cut)
    num_prompt_tokens: int = 0
    logprobs: list | None = None  # per new token, when the request asked (sampling.token_logprobs)


class RequestView:
    """Committed state of one request (what the ring publishes), a snapshot taken in
    O(1): it keeps the request's own token and block lists with their lengths at the
    time of the view. The scheduler only ever appends to those lists in place (a
    preempted or retired request gets new ones), so the first n entries stay what
    they were. ``block_ids`` / ``token_ids`` return copies; the ring's DeltaTracker
    reads the live lists through ``parts()`` and copies only what changed."""

    __slots__ = ("key", "seed", "num_prompt", "num_computed", "finished", "aborted", "_b", "_nb", "_t", "_nt")

    def __init__(self, key: int, seed: int, block_ids: list[int], token_ids: list[int], num_prompt: int,
                 num_computed: int, finished: bool = False, aborted: bool = False):
        self.key, self.seed, self.num_prompt, self.num_computed = key, seed, num_prompt, num_computed
        self.finished, self.aborted = finished, aborted
        self._b, self._nb, self._t, self._nt = block_ids, len(block_ids), token_ids, len(token_ids)

    @property
    def block_ids(self) -> list[int]:
        return self._b[: self._nb]

    @property
    def token_ids(self) -> list[int]:  # prompt + output
        return self._t[: self._nt]

    def parts(self) -> tuple[list[int], int, list[int], int]:
        """(blocks, n_blocks, tokens, n_tokens): the live lists, valid up to those lengths."""
        return self._b, self._nb, self._t, self._nt

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RequestView):
            return NotImplemented
        return (self.key, self.seed, self.block_ids, self.token_ids, self.num_prompt, self.num_computed,
                self.finished, self.aborted) == (other.key, other.seed, other.block_ids, other.token_ids,
                                                 other.num_prompt, other.num_computed, other.finished, other.aborted)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"RequestView(key={self.key}, seed={self.seed}, blocks={self._nb}, tokens={self._nt}, "
                f"num_prompt={self.num_prompt}, num_computed={self.num_computed}, finished={self.finished}, "
                f"aborted={self.aborted})")


@dataclass(frozen=True)
class AdoptResult:
    key: int
    reused_tokens: int  # KV taken over from the snapshot, not recomputed
    prefill_tokens: int  # tokens the first pass will compute
    pending_tokens: int  # snapshot tokens the client had not received; emitted first
    finished: bool  # the request had already finished (a final output is emitted)


@dataclass
class Request:
    key: int
    params: SamplingParams
    seed: int
    token_ids: list[int]  # prompt then output
    num_prompt: int
    text: TextState | NoText
    arrival: int
    num_computed: int = 0  # tokens whose KV is written
    block_ids: list[int] = field(default_factory=list)
    no_chunk: bool = False  # adopted (default policy): compute the uncovered tail in one pass
    # Added to the position whose noise the sampler draws: 0, except under the
    # sampler-offset negative control (sdk/takeover_fault.py).
    sample_offset: int = 0
    # Structured outputs: the grammar's matcher (grammar.py), advanced by every
    # output token; None: unconstrained.
    matcher: Any = None

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt


@dataclass(frozen=True)
class SampleRow:
    """A logits row the pass must sample: the token at ``position`` of ``request``."""

    request: Request
    position: int  # index in token_ids of the sampled token (= num_computed after the pass)
    expected: int | None  # None: a new token; else the known token a replay must reproduce


@dataclass
class SchedulerOutput:
    """One pass, as the scheduler decided it. Iterating it yields the chunks as
    (request, tokens) pairs: the pass computes ``request.token_ids[num_computed :
    num_computed + tokens]`` for each."""

    chunks: list[tuple[Request, int]] = field(default_factory=list)
    # Per chunk, in order: the row it samples, or None (a prefill chunk short of the
    # last known token).
    rows: list[SampleRow | None] = field(default_factory=list)
    # A decode pass padded to this many rows (ExactPolicy: one decode shape); None: as is.
    pad_decode_to: int | None = None
    # Outputs due without a pass (an adopted request's tokens the client lacks).
    ready: list[RequestOutput] = field(default_factory=list)

    def __iter__(self) -> Iterator[tuple[Request, int]]:
        return iter(self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def sampled(self) -> list[SampleRow]:
        """The rows to sample, in the order the pass's logits hold them."""
        return [r for r in self.rows if r is not None]


class SchedulingPolicy(ABC):
    """What runs next. ``plan`` picks the chunks of one pass from the scheduler's
    running and waiting requests, admitting and allocating blocks through it; the
    scheduler handles a plan that fits nothing (preemption)."""

    # Decode passes run at exactly this many rows (padded), or None.
    decode_rows: int | None = None
    # A pass that reaches a position whose token is already known (past the
    # prompt) samples it again and checks it, instead of skipping its logits.
    replays_known_tokens: bool = False

    @abstractmethod
    def plan(self, s: Scheduler) -> tuple[list[tuple[Request, int]], bool]:
        """(chunks, decode): the pass's chunks, and whether it is a decode pass
        (pads to ``decode_rows``). Empty when nothing fits."""

    @abstractmethod
    def adopt(self, reused: int, num_prompt: int) -> tuple[int, bool]:
        """An adopted request whose snapshot covers ``reused`` tokens: (the tokens to
        keep as computed, whether the rest is computed in one unchunked pass)."""

    def reset(self) -> None:
        """Forget any state carried between passes."""


class DefaultPolicy(SchedulingPolicy):
    """Continuous batching under a token budget (max_num_batched_tokens): running
    decodes first (one token each, latency-bound), then running prefills, chunked to
    the budget, then waiting requests admitted up to max_num_seqs. An adopted
    request computes its uncovered tail in one pass, whatever the budget."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg

    def plan(self, s: Scheduler) -> tuple[list[tuple[Request, int]], bool]:
        budget = self.cfg.max_num_batched_tokens
        chunks: list[tuple[Request, int]] = []
        for req in sorted(s.running, key=lambda r: len(r.token_ids) - r.num_computed > 1):
            remaining = len(req.token_ids) - req.num_computed
            if budget <= 0 and not req.no_chunk:
                continue
            n = remaining if req.no_chunk else min(remaining, budget)
            n = s.fit_blocks(req, n)
            if n <= 0:
                continue
            chunks.append((req, n))
            budget -= n
        while s.waiting and len(s.running) < self.cfg.max_num_seqs and budget > 0:
            req = s.waiting[0]
            remaining = len(req.token_ids) - req.num_computed
            n = s.fit_blocks(req, min(remaining, budget))
            if n <= 0:
                break
            s.admit()
            chunks.append((req, n))
            budget -= n
        return chunks, False

    def adopt(self, reused: int, num_prompt: int) -> tuple[int, bool]:
        return reused, True


class ExactPolicy(SchedulingPolicy):
    """Every computed token sees a pass shape that depends on its own request only
    (bf16 GEMMs on a GPU are not batch-invariant; refengine/README.md, Exactness).
    A pass is either a decode pass of every request past its prompt (one token each,
    replays included, padded to ``max_num_seqs`` rows) or one prefill chunk of one
    request, ending at the prompt's end or at a multiple of max_num_batched_tokens.
    Decode and prefill passes alternate when both wait. An adopted request recomputes
    its prompt from a chunk boundary and replays the tokens after its last sync by
    decode passes, each replayed sample checked against the known token."""

    replays_known_tokens = True

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.decode_rows = min(cfg.max_num_seqs, 512)
        self._prefill_turn = False

    def plan(self, s: Scheduler) -> tuple[list[tuple[Request, int]], bool]:
        decodes = [r for r in s.running if r.num_computed >= r.num_prompt]
        if self._prefill_turn or not decodes:
            chunks = self._prefill(s)
            if chunks:
                return chunks, False
            return self._decode(s, decodes), True
        chunks = self._decode(s, decodes)
        if chunks:
            return chunks, True
        return self._prefill(s), False

    def _decode(self, s: Scheduler, decodes: list[Request]) -> list[tuple[Request, int]]:
        chunks = [(r, 1) for r in decodes if s.fit_blocks(r, 1, whole=True) == 1]
        if chunks:
            self._prefill_turn = True
        return chunks

    def _prefill(self, s: Scheduler) -> list[tuple[Request, int]]:
        prefilling = [r for r in s.running if r.num_computed < r.num_prompt]
        admit = bool(s.waiting) and len(s.running) < self.cfg.max_num_seqs
        if not (prefilling or admit):
            return []
        req = prefilling[0] if prefilling else s.waiting[0]
        C = self.cfg.max_num_batched_tokens
        n = min(req.num_prompt - req.num_computed, C - req.num_computed % C)
        if s.fit_blocks(req, n, whole=True) != n:
            return []
        if not prefilling:
            s.admit()
        self._prefill_turn = False
        return [(req, n)]

    def adopt(self, reused: int, num_prompt: int) -> tuple[int, bool]:
        if reused < num_prompt:
            # Recompute the prompt from a chunk boundary, so every chunk has the
            # active's shape; tokens past the prompt are replayed by decode passes.
            reused -= reused % self.cfg.max_num_batched_tokens
        return reused, False

    def reset(self) -> None:
        self._prefill_turn = False


def make_policy(cfg: EngineConfig) -> SchedulingPolicy:
    return ExactPolicy(cfg) if cfg.exact else DefaultPolicy(cfg)


class Scheduler:
    """Requests, their KV blocks and the passes that compute them (see the module
    docstring). ``counters`` is the engine's counter dict, shared so that one
    mapping reports both halves."""

    def __init__(self, cfg: EngineConfig, tokenizer: Tokenizer, policy: SchedulingPolicy | None = None,
                 counters: MutableMapping[str, int] | None = None) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.policy = policy if policy is not None else make_policy(cfg)
        self.counters = counters if counters is not None else {}
        for name in ("generated_tokens", "adopted_requests", "adopted_tokens_reused", "preemptions",
                     "replayed_tokens", "replay_mismatches"):
            self.counters.setdefault(name, 0)
        self.blocks = BlockManager(cfg.num_blocks)
        self.requests: dict[int, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._pending: list[RequestOutput] = []
        self._done_views: list[RequestView] = []
        self._arrivals = 0
        # Until someone reads request_views() no snapshot can name our blocks,
        # so released blocks may be reused at once.
        self._views_read = False
        self.grammars = Grammars(tokenizer, cfg.shape.vocab_size)

    # ---- requests --------------------------------------------------------
    def _check_tokens(self, ids: Sequence[int], what: str) -> list[int]:
        out = []
        V = self.cfg.shape.vocab_size
        for t in ids:
            t = int(t)
            if not 0 <= t < V:
                raise EngineError(f"{what}: token id {t} outside the vocabulary (0..{V - 1})")
            out.append(t)
        return out

    def add_request(self, key: int, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        if key in self.requests:
            raise EngineError(f"request {key} already exists")
        if not isinstance(params, SamplingParams):
            raise EngineError("params must be a SamplingParams")
        prompt = self._check_tokens(prompt_token_ids, f"request {key}")
        if not prompt:
            raise EngineError(f"request {key}: empty prompt")
        if len(prompt) >= self.cfg.max_model_len:
            raise EngineError(
                f"request {key}: prompt of {len(prompt)} tokens leaves no room (max_model_len {self.cfg.max_model_len})"
            )
        longest = min(len(prompt) + params.max_tokens, self.cfg.max_model_len)
        if -(-longest // self.cfg.block_size) > self.cfg.num_blocks - 1:
            raise EngineError(
                f"request {key}: up to {longest} tokens need more KV blocks than the cache has ({self.cfg.num_blocks - 1})"
            )
        seed = params.seed if params.seed is not None else default_seed(key)
        self._arrivals += 1
        text = text_state(self.tokenizer, prompt, params.stop, params.include_stop_str_in_output, self.cfg.text_outputs)
        req = Request(key, params, seed, list(prompt), len(prompt), text, self._arrivals)
        if params.structured is not None:
            try:
                req.matcher = self.grammars.matcher(params.structured)
            except GrammarError as e:
                self._arrivals -= 1
                raise EngineError(f"request {key}: {e}") from None
        self.requests[key] = req
        self.waiting.append(req)

    def adopt_request(
        self,
        key: int,
        params: SamplingParams,
        token_ids: Sequence[int],
        num_prompt: int,
        num_computed: int,
        block_ids: Sequence[int],
        seed: int | None,
        delivered_token_ids: Sequence[int] = (),
    ) -> AdoptResult:
        """Take over a request whose KV for token_ids[:num_computed] is in block_ids.

        token_ids is prompt + output as of the last sync (just the prompt, with no
        blocks, when it never reached one); delivered_token_ids are the output
        tokens the client already has. Only tokens past num_computed are computed
        (from where the policy says); snapshot tokens the client lacks are emitted first.
        """
        if key in self.requests:
            raise AdoptError(f"adopt {key}: request already exists")
        if not isinstance(params, SamplingParams):
            raise AdoptError(f"adopt {key}: params must be a SamplingParams")
        toks = self._check_tokens(token_ids, f"adopt {key}")
        delivered = self._check_tokens(delivered_token_ids, f"adopt {key} delivered")
        if not 1 <= num_prompt <= len(toks):
            raise AdoptError(f"adopt {key}: num_prompt {num_prompt} out of range (1..{len(toks)})")
        if not 0 <= num_computed <= len(toks):
            raise AdoptError(f"adopt {key}: num_computed {num_computed} exceeds the {len(toks)} known tokens")
        blocks = list(block_ids)
        bs = self.cfg.block_size
        if -(-num_computed // bs) > len(blocks):
            raise AdoptError(
                f"adopt {key}: {len(blocks)} blocks cannot hold {num_computed} computed tokens (block size {bs})"
            )
        snap_out = toks[num_prompt:]
        common = min(len(snap_out), len(delivered))
        for i in range(common):
            if snap_out[i] != delivered[i]:
                raise AdoptError(f"adopt {key}: delivered token {i} ({delivered[i]}) differs from the snapshot ({snap_out[i]})")
        if len(delivered) >= len(snap_out):
            full, pending = toks[:num_prompt] + delivered, []
        else:
            full, pending = toks, snap_out[len(delivered) :]
        if len(full) > self.cfg.max_model_len:
            raise AdoptError(f"adopt {key}: {len(full)} tokens exceed max_model_len {self.cfg.max_model_len}")
        if seed is None:
            seed = params.seed if params.seed is not None else default_seed(key)

        # Replay the output through the stop checks: the client's text state is a
        # pure function of the tokens it received.
        req = Request(key, params, int(seed), full[:num_prompt], num_prompt,
                      text_state(self.tokenizer, full[:num_prompt], params.stop, params.include_stop_str_in_output,
                                 self.cfg.text_outputs),
                      self._arrivals + 1)
        if params.structured is not None:
            try:
                req.matcher = self.grammars.matcher(params.structured)
            except GrammarError as e:
                raise AdoptError(f"adopt {key}: {e}") from None
        outputs = full[num_prompt:]
        finish: tuple[str, str | int | None] | None = None
        for i, t in enumerate(outputs):
            if finish is not None:
                raise AdoptError(f"adopt {key}: output continues after it finished at index {i - 1}")
            req.token_ids.append(t)
            finish = self._stop_after(req, t)
            if i < len(delivered):
                req.text.take()
        emit_from = len(delivered)
        if finish is None:
            # Validate and pin the blocks before committing anything.
            try:
                self.blocks.pin(blocks)
            except BlockError as e:
                raise AdoptError(f"adopt {key}: {e}") from None
        self._arrivals += 1
        self.requests[key] = req
        self.counters["adopted_requests"] += 1
        if finish is not None:
            text = req.text.finish()
            self._pending.append(RequestOutput(key, outputs[emit_from:], emit_from, True, finish[0], finish[1], text,
                                               num_prompt))
            self._retire(req, finished=True, aborted=False, release=False)
            return AdoptResult(key, 0, 0, len(outputs) - emit_from, True)
        if pending:
            self._pending.append(RequestOutput(key, list(pending), emit_from, text=req.text.take(),
                                               num_prompt_tokens=num_prompt))
        # The last token needs a forward pass for its logits; if the snapshot
        # already holds its KV it is computed again (same values, same slot).
        reused = min(num_computed, len(full) - 1) if self.cfg.kv_reuse else 0
        reused, req.no_chunk = self.policy.adopt(reused, num_prompt)
        req.num_computed = reused
        req.block_ids = blocks
        self.counters["adopted_tokens_reused"] += reused
        self.running.append(req)
        return AdoptResult(key, reused, len(full) - reused, len(pending), False)

    def abort(self, key: int) -> bool:
        req = self.requests.get(key)
        if req is None:
            return False
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self._pending = [o for o in self._pending if o.key != key]
        self._retire(req, finished=False, aborted=True)
        return True

    def reset(self) -> None:
        """Forget every request and free every block (nothing is written anywhere):
        as a fresh standby's scheduler, empty and ready to adopt."""
        self.blocks = BlockManager(self.cfg.num_blocks)
        self.requests.clear()
        self.waiting.clear()
        self.running.clear()
        self._pending = []
        self._done_views = []
        self._views_read = False
        self.policy.reset()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending)

    def request_views(self) -> list[RequestView]:
        """Committed state of every live request, plus each request that finished
        or was aborted since the previous call (reported once). Call it between
        passes and publish the result before the next one: blocks released by
        those requests become reusable only now."""
        views = [
            RequestView(r.key, r.seed, r.block_ids, r.token_ids, r.num_prompt, r.num_computed)
            for r in self.requests.values()
        ]
        views += self._done_views
        self._done_views = []
        self._views_read = True
        self.blocks.release_quarantine()
        return views

    # ---- passes ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next pass. When the policy fits nothing while requests run (every
        one needs a block and none is free), the newest running request is
        preempted (recomputed later) and the policy asked again."""
        out = SchedulerOutput(ready=self._pending)
        self._pending = []
        while True:
            chunks, decode = self.policy.plan(self)
            if chunks or not self.running or self.blocks.num_quarantined:
                break
            self._preempt(max(self.running, key=lambda r: r.arrival))
            if not self.blocks.num_free:
                break
        if not chunks:
            return out
        out.chunks = chunks
        out.rows = [self._row(r, r.num_computed + n) for r, n in chunks]
        if decode:
            out.pad_decode_to = self.policy.decode_rows
        return out

    def _row(self, req: Request, end: int) -> SampleRow | None:
        """The row a chunk computing KV up to ``end`` samples, or None."""
        if end == len(req.token_ids):
            return SampleRow(req, end, None)
        if self.policy.replays_known_tokens and end >= req.num_prompt:
            return SampleRow(req, end, req.token_ids[end])
        return None

    def update_from_output(self, out: SchedulerOutput, sampled: Sequence[int],
                           logprobs: Sequence | None = None) -> list[RequestOutput]:
        """Commit a pass that ran: its KV is written, ``sampled`` holds one token per
        row of ``out.sampled`` (and ``logprobs`` its logprobs, where asked). Returns
        the outputs of the step (``out.ready`` first)."""
        rows = out.sampled
        if len(sampled) != len(rows):
            raise ValueError(f"update_from_output: {len(sampled)} sampled tokens for {len(rows)} rows")
        for req, n in out.chunks:
            req.num_computed += n
        outputs = out.ready
        for i, (row, tok) in enumerate(zip(rows, sampled)):
            req = row.request
            if row.expected is None:
                o = self._append_token(req, int(tok))
                if logprobs is not None and logprobs[i] is not None:
                    o.logprobs = [logprobs[i]]
                outputs.append(o)
                continue
            self.counters["replayed_tokens"] += 1
            if tok != row.expected:
                # The replay diverged from what the active produced (the client has
                # those tokens: they stay). The exact policy should never get here.
                self.counters["replay_mismatches"] += 1
                if self.counters["replay_mismatches"] == 1:
                    log.warning("request %d: replayed token %d is %d, the active produced %d",
                                req.key, row.position, tok, row.expected)
        return outputs

    # ---- helpers for policies ------------------------------------------------
    def admit(self) -> Request:
        """Move the first waiting request to running."""
        req = self.waiting.popleft()
        self.running.append(req)
        return req

    def fit_blocks(self, req: Request, n: int, whole: bool = False) -> int:
        """Allocate blocks for n more tokens of req, shrinking a prefill chunk to what
        fits (unless whole, or the request is unchunked: then all n or nothing).
        Returns the tokens that fit."""
        bs = self.cfg.block_size
        have = len(req.block_ids)
        need = -(-(req.num_computed + n) // bs) - have
        if need > self.blocks.num_free:
            if req.no_chunk or whole:
                return 0
            n = (have + self.blocks.num_free) * bs - req.num_computed
            if n <= 0:
                return 0
            need = self.blocks.num_free
        if need > 0:
            req.block_ids += self.blocks.allocate(need)
        return n

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.release(req.block_ids, quarantine=self._views_read)
        req.block_ids = []
        req.num_computed = 0
        req.no_chunk = False
        self.waiting.appendleft(req)
        self.counters["preemptions"] += 1

    # ---- lifecycle ---------------------------------------------------------
    def _stop_after(self, req: Request, tok: int) -> tuple[str, str | int | None] | None:
        """Finish reason after appending tok (already in req.token_ids), or None."""
        p = req.params
        if req.matcher is not None and not req.matcher.accept_token(tok):
            raise EngineError(f"request {req.key}: token {tok} does not fit its structured-output grammar")
        stop_str = req.text.add(tok)
        if not p.ignore_eos and tok in self.tokenizer.eos_token_ids:
            return ("stop", None)
        if tok in p.stop_token_ids:
            return ("stop", tok)
        if stop_str is not None:
            return ("stop", stop_str)
        if req.matcher is not None and req.matcher.is_terminated():
            return ("stop", None)
        if req.num_output >= p.max_tokens or len(req.token_ids) >= self.cfg.max_model_len:
            return ("length", None)
        return None

    def _append_token(self, req: Request, tok: int) -> RequestOutput:
        req.token_ids.append(tok)
        req.no_chunk = False
        self.counters["generated_tokens"] += 1
        fin = self._stop_after(req, tok)
        idx = req.num_output - 1
        if fin is None:
            return RequestOutput(req.key, [tok], idx, text=req.text.take(), num_prompt_tokens=req.num_prompt)
        text = req.text.finish()
        self.running.remove(req)
        self._retire(req, finished=True, aborted=False)
        return RequestOutput(req.key, [tok], idx, True, fin[0], fin[1], text, req.num_prompt)

    def _retire(self, req: Request, finished: bool, aborted: bool, release: bool = True) -> None:
        if release and req.block_ids:
            self.blocks.release(req.block_ids, quarantine=self._views_read)
        self._done_views.append(RequestView(req.key, req.seed, req.block_ids, req.token_ids,
                                            req.num_prompt, req.num_computed, finished, aborted))
        req.block_ids = []
        del self.requests[req.key]
