"""EngineCore: requests, continuous batching with chunked prefill, sampling,
stop handling, committed-state views for the ring, and adoption on takeover."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from .block_manager import BlockError, BlockManager
from .config import NULL_BLOCK, EngineConfig, pool_layout
from .model import Batch, CudaGraphDecoder, Qwen2Model, SeqChunk
from .sampling import SamplingParams, default_seed, sample
from .tokenizer import TextState, Tokenizer, load_tokenizer
from .weights import check_pools, init_dummy, load_safetensors

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


class RequestView:
    """Committed state of one request (what the ring publishes), a snapshot taken in
    O(1): it keeps the request's own token and block lists with their lengths at the
    time of the view. The engine only ever appends to those lists in place (a
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
class _Request:
    key: int
    params: SamplingParams
    seed: int
    token_ids: list[int]
    num_prompt: int
    text: TextState
    arrival: int
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    no_chunk: bool = False  # adopted: compute the uncovered tail in one pass

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt


class EngineCore:
    def __init__(
        self,
        cfg: EngineConfig,
        pools: dict,
        load_weights: bool,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.cfg = cfg
        weights_pool, kv_pool = check_pools(cfg, pools)
        self.model = Qwen2Model(cfg, weights_pool, kv_pool)
        if load_weights:
            if cfg.weights == "dummy":
                init_dummy(cfg, self.model.params)
            else:
                load_safetensors(cfg, self.model.params, cfg.weights)
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model_dir)
        if self.tokenizer.vocab_size > cfg.shape.vocab_size:
            raise EngineError(
                f"tokenizer has {self.tokenizer.vocab_size} tokens, model vocabulary only {cfg.shape.vocab_size}"
            )
        self.blocks = BlockManager(cfg.num_blocks)
        self._reqs: dict[int, _Request] = {}
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._pending: list[RequestOutput] = []
        self._done_views: list[RequestView] = []
        self._arrivals = 0
        # Until someone reads request_views() no snapshot can name our blocks,
        # so released blocks may be reused at once.
        self._views_read = False
        self._graphs: CudaGraphDecoder | None = None
        self.counters: dict[str, int] = dict(
            steps=0, forward_passes=0, prefill_tokens_computed=0, decode_tokens=0, generated_tokens=0,
            adopted_requests=0, adopted_tokens_reused=0, preemptions=0, graph_steps=0,
            replayed_tokens=0, replay_mismatches=0,
        )
        # Device work is asynchronous (CUDA): step()'s on_launch runs after the enqueue.
        self._launch_async = self.model.device.type == "cuda"
        # All of the engine's device work (warm-up, graph capture, steps) goes to one
        # stream: torch gives each (cuBLAS handle, stream) pair its own workspace (32 MiB
        # on Hopper), and a standby keeps every one it ever used.
        self._stream = torch.cuda.Stream(self.model.device) if self._launch_async else None
        # Exact mode alternates decode and prefill steps when both are waiting.
        self._prefill_turn = False
        # Tokens the step in progress computes (engine_api: read by the heartbeat thread).
        self.scheduled_tokens = 0

    # ---- setup -----------------------------------------------------------
    @staticmethod
    def allocate_pools(cfg: EngineConfig) -> dict:
        """Zero-filled private pools (tests, benchmarks, single-process use)."""
        return {(p.tag, p.index): torch.zeros(p.size, dtype=torch.uint8, device=cfg.device) for p in pool_layout(cfg)}

    def _on_stream(self) -> contextlib.AbstractContextManager:
        """Run on the engine's stream, after whatever the caller queued before."""
        if self._stream is None:
            return contextlib.nullcontext()
        self._stream.wait_stream(torch.cuda.current_stream(self.model.device))
        return torch.cuda.stream(self._stream)

    def warmup(self, on_stage: Callable[[str], None] | None = None) -> None:
        """GPU: capture the decode CUDA graphs now rather than on the first decode
        step. Capture writes only the reserved null block (0) of the KV pool.
        on_stage(name), if given, runs after each stage (a memory probe measures there)."""
        with self._on_stream():
            self._warmup(on_stage)

    def _warmup(self, on_stage: Callable[[str], None] | None = None) -> None:
        stage = on_stage or (lambda _name: None)
        if self._static_decode() and self._graphs is None:
            b = min(self.cfg.max_num_seqs, 512)
            # Exact mode: one batch size, so a row's GEMMs never depend on its neighbours.
            g = CudaGraphDecoder(self.model, b, graphs=self.cfg.cuda_graphs, buckets=[b] if self.cfg.exact else None,
                                 stream=self._stream)
            g.capture()
            self._graphs = g
            stage("decode graph captured + launched")
        if self.model.device.type == "cuda":
            self._warm_prefill()
            stage("prefill shapes warmed")
            # Load the sampler's kernels now (lazy module loading): a standby's first
            # sampled token, right after a takeover, must not pay for it. Touches no pool.
            logits = torch.zeros((3, self.cfg.shape.vocab_size), dtype=torch.float32, device=self.model.device)
            sample(logits, [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
                            SamplingParams(temperature=0.8, top_p=0.9, top_k=50)], [1, 2, 3], [0, 0, 0])
            del logits  # else its 20 MiB segment outlives empty_cache() below
            stage("sampler warmed")
            torch.cuda.synchronize(self.model.device)
            # Hand back what the warm-up left in torch's cache: a standby keeps only
            # the CUDA context, the graphs' pool and its small static buffers.
            torch.cuda.empty_cache()
            stage("allocator cache emptied")

    @torch.inference_mode()
    def _warm_prefill(self) -> None:
        """Run the varlen forward once, with shapes like a takeover's catch-up (a fresh
        prompt, chunks at start_pos > 0, a decode row), so its kernels (SDPA, GEMMs at
        small M, the mixed-batch path) are loaded before a takeover needs them. Writes
        only the reserved null block, which padded decode rows write anyway."""
        bs = self.cfg.block_size
        dev = self.model.device
        seqs: list[SeqChunk] = []
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        for start, n in ((0, bs), (bs // 2, bs // 2), (max(0, bs - 3), min(3, bs)), (bs - 1, 1)):
            seqs.append(SeqChunk(len(ids), n, start, [NULL_BLOCK]))
            ids += [0] * n
            pos += list(range(start, start + n))
            slots += [NULL_BLOCK * bs + p for p in range(start, start + n)]
            rows.append(len(ids) - 1)
        t = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
        self.model.forward(Batch(t(ids), t(pos), t(slots), seqs, t(rows)))
        if self.model.pow2_prefill:
            # Exact mode pads prefill GEMMs to powers of two: run each size a chunk can
            # have once (one sequence from position 0), so none loads during a takeover.
            top = min(self.cfg.max_num_batched_tokens, self.cfg.max_model_len)
            m = 16
            while True:
                n = min(m, top)
                nb = -(-n // bs)
                self.model.forward(Batch(t([0] * n), t(list(range(n))), t([NULL_BLOCK * bs + p % bs for p in range(n)]),
                                         [SeqChunk(0, n, 0, [NULL_BLOCK] * nb)], t([n - 1])))
                if n == top:
                    break
                m *= 2

    def _static_decode(self) -> bool:
        """Decode-only steps go through the Triton kernel on static buffers (and
        CUDA graphs when enabled)."""
        return self.model._triton is not None

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
        if key in self._reqs:
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
        req = self._new_request(key, params, seed, prompt, len(prompt))
        self._waiting.append(req)

    def _new_request(self, key, params, seed, token_ids, num_prompt) -> _Request:
        self._arrivals += 1
        text = TextState(self.tokenizer, token_ids[:num_prompt], params.stop, params.include_stop_str_in_output)
        req = _Request(key, params, seed, list(token_ids), num_prompt, text, self._arrivals)
        self._reqs[key] = req
        return req

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
        tokens the client already has. Only tokens past num_computed are computed,
        in one pass; snapshot tokens the client lacks are emitted first.
        """
        if key in self._reqs:
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
        req = _Request(key, params, int(seed), full[:num_prompt], num_prompt,
                       TextState(self.tokenizer, full[:num_prompt], params.stop, params.include_stop_str_in_output),
                       self._arrivals + 1)
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
        self._reqs[key] = req
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
        if self.cfg.exact and reused < num_prompt:
            # Recompute the prompt from a chunk boundary, so every chunk has the
            # active's shape; tokens past the prompt are replayed by decode steps.
            reused -= reused % self.cfg.max_num_batched_tokens
        req.num_computed = reused
        req.block_ids = blocks
        req.no_chunk = not self.cfg.exact
        self.counters["adopted_tokens_reused"] += reused
        self._running.append(req)
        return AdoptResult(key, reused, len(full) - reused, len(pending), False)

    def abort(self, key: int) -> bool:
        req = self._reqs.get(key)
        if req is None:
            return False
        if req in self._waiting:
            self._waiting.remove(req)
        if req in self._running:
            self._running.remove(req)
        self._pending = [o for o in self._pending if o.key != key]
        self._retire(req, finished=False, aborted=True)
        return True

    def reset(self) -> None:
        """Forget every request and free every block, writing nothing to the device:
        a planned handover gave them (and the KV cache's contents) to another engine.
        The engine is then as a fresh standby's: empty, ready to adopt."""
        self.blocks = BlockManager(self.cfg.num_blocks)
        self._reqs.clear()
        self._waiting.clear()
        self._running.clear()
        self._pending = []
        self._done_views = []
        self._views_read = False
        self._prefill_turn = False

    def check_device(self) -> None:
        """Raise the device's sticky error, if any (a cheap synchronise; the engine loop
        calls it while idle). No-op on the CPU."""
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._pending)

    def num_running(self) -> int:
        return len(self._running)

    def num_waiting(self) -> int:
        return len(self._waiting)

    def request_views(self) -> list[RequestView]:
        """Committed state of every live request, plus each request that finished
        or was aborted since the previous call (reported once). Call it between
        steps and publish the result before the next step: blocks released by
        those requests become reusable only now."""
        views = [
            RequestView(r.key, r.seed, r.block_ids, r.token_ids, r.num_prompt, r.num_computed)
            for r in self._reqs.values()
        ]
        views += self._done_views
        self._done_views = []
        self._views_read = True
        self.blocks.release_quarantine()
        return views

    # ---- stepping --------------------------------------------------------
    # The engine loop may pass step(on_launch=...): see engine_api.EngineCore.
    launch_hook = True

    def step(self, on_launch: Callable[[], None] | None = None) -> list[RequestOutput]:
        """One scheduling step. on_launch, if given, runs once the pass is enqueued on
        the device and before the host waits for its result, with the committed state
        still that of the previous step (only blocks for this pass are allocated). It
        does not run when nothing is scheduled."""
        with self._on_stream():
            return self._step(on_launch)

    def _step(self, on_launch: Callable[[], None] | None) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        self.scheduled_tokens = 0
        sched = self._schedule()
        self.scheduled_tokens = sum(n for _, n in sched)
        self.counters["steps"] += 1
        if not sched:
            return outputs
        t0 = time.perf_counter()
        logits, rows = self._forward(sched, on_launch)
        if rows:
            # Each row samples the token at index r.num_computed: a new one, or in
            # exact mode one the request already has (a replayed token, checked).
            toks = sample(logits, [r.params for r, _ in rows], [r.seed for r, _ in rows],
                          [r.num_computed for r, _ in rows])
            for (req, expected), tok in zip(rows, toks):
                if expected is None:
                    outputs.append(self._append_token(req, tok))
                    continue
                self.counters["replayed_tokens"] += 1
                if tok != expected:
                    # The replay diverged from what the active produced (the client has
                    # those tokens: they stay). Exact mode should never get here.
                    self.counters["replay_mismatches"] += 1
                    if self.counters["replay_mismatches"] == 1:
                        log.warning("request %d: replayed token %d is %d, the active produced %d",
                                    req.key, req.num_computed, tok, expected)
        self._last_step_s = time.perf_counter() - t0
        return outputs

    def _row(self, req: _Request) -> tuple[_Request, int | None] | None:
        """After a pass that computed KV up to req.num_computed: the logits row it
        wants, as (req, expected token or None for a new one), or None."""
        e = req.num_computed
        if e == len(req.token_ids):
            return (req, None)
        if self.cfg.exact and e >= req.num_prompt:
            return (req, req.token_ids[e])
        return None

    def _schedule(self) -> list[tuple[_Request, int]]:
        if self.cfg.exact:
            return self._schedule_exact()
        cfg = self.cfg
        budget = cfg.max_num_batched_tokens
        sched: list[tuple[_Request, int]] = []
        # Decodes first (one token each, latency-bound), then prefill chunks.
        for req in sorted(self._running, key=lambda r: len(r.token_ids) - r.num_computed > 1):
            remaining = len(req.token_ids) - req.num_computed
            if budget <= 0 and not req.no_chunk:
                continue
            n = remaining if req.no_chunk else min(remaining, budget)
            n = self._fit_blocks(req, n)
            if n <= 0:
                continue
            sched.append((req, n))
            budget -= n
        while self._waiting and len(self._running) < cfg.max_num_seqs and budget > 0:
            req = self._waiting[0]
            remaining = len(req.token_ids) - req.num_computed
            n = self._fit_blocks(req, min(remaining, budget))
            if n <= 0:
                break
            self._waiting.popleft()
            self._running.append(req)
            sched.append((req, n))
            budget -= n
        if not sched and self._running and not self.blocks.num_quarantined:
            # Every running request needs a block and none is free: recompute the newest later.
            self._preempt(max(self._running, key=lambda r: r.arrival))
            return self._schedule() if self.blocks.num_free else []
        return sched

    def _schedule_exact(self) -> list[tuple[_Request, int]]:
        """Exact mode: a step is either a decode step of every request past its
        prompt (one token each, replays included) or one prefill chunk of one
        request, ending at the prompt's end or a multiple of max_num_batched_tokens.
        Each computed token thus sees the same shapes whatever else is running."""
        cfg = self.cfg
        decodes = [r for r in self._running if r.num_computed >= r.num_prompt]
        prefilling = [r for r in self._running if r.num_computed < r.num_prompt]
        admit = bool(self._waiting) and len(self._running) < cfg.max_num_seqs

        def decode_step():
            sched = [(r, 1) for r in decodes if self._fit_blocks(r, 1, whole=True) == 1]
            if sched:
                self._prefill_turn = True
            return sched

        def prefill_step():
            if not (prefilling or admit):
                return []
            req = prefilling[0] if prefilling else self._waiting[0]
            C = cfg.max_num_batched_tokens
            n = min(req.num_prompt - req.num_computed, C - req.num_computed % C)
            if self._fit_blocks(req, n, whole=True) != n:
                return []
            if not prefilling:
                self._waiting.popleft()
                self._running.append(req)
            self._prefill_turn = False
            return [(req, n)]

        order = (prefill_step, decode_step) if self._prefill_turn or not decodes else (decode_step, prefill_step)
        for fn in order:
            sched = fn()
            if sched:
                return sched
        if self._running and not self.blocks.num_quarantined:
            # Nothing fits: recompute the newest request later.
            self._preempt(max(self._running, key=lambda r: r.arrival))
            return self._schedule() if self.blocks.num_free else []
        return []

    def _fit_blocks(self, req: _Request, n: int, whole: bool = False) -> int:
        """Allocate blocks for n more tokens, shrinking a prefill chunk to what fits
        (unless whole: then all n or nothing)."""
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

    def _preempt(self, req: _Request) -> None:
        self._running.remove(req)
        self.blocks.release(req.block_ids, quarantine=self._views_read)
        req.block_ids = []
        req.num_computed = 0
        req.no_chunk = False
        self._waiting.appendleft(req)
        self.counters["preemptions"] += 1

    def _forward(self, sched: list[tuple[_Request, int]], on_launch: Callable[[], None] | None = None,
                 ) -> tuple[torch.Tensor, list[tuple[_Request, int | None]]]:
        """Run one pass; returns logits, one row per entry of the returned list (see _row).
        on_launch runs after the pass is enqueued on a GPU (before num_computed moves on),
        so that it overlaps the device's work. On the CPU the pass computes as it is
        "enqueued": there it runs first, lest the record wait for the whole pass."""
        if on_launch is not None and not self._launch_async:
            on_launch()
            on_launch = None
        bs = self.cfg.block_size
        for r, n in sched:
            if n == 1 and r.num_computed >= r.num_prompt:
                self.counters["decode_tokens"] += 1
            else:
                self.counters["prefill_tokens_computed"] += n
        self.counters["forward_passes"] += 1
        decode_only = all(n == 1 for _, n in sched)
        if decode_only and self._static_decode() and len(sched) <= min(self.cfg.max_num_seqs, 512):
            if self._graphs is None:
                self._warmup()
            ids = [r.token_ids[r.num_computed] for r, _ in sched]
            pos = [r.num_computed for r, _ in sched]
            slots = [r.block_ids[p // bs] * bs + p % bs for (r, _), p in zip(sched, pos)]
            logits = self._graphs.run(ids, pos, slots, [r.block_ids for r, _ in sched])
            if on_launch is not None:
                on_launch()
            if self._graphs.use_graphs:
                self.counters["graph_steps"] += 1
            for r, n in sched:
                r.num_computed += n
            rows = [self._row(r) for r, _ in sched]
            keep = [i for i, row in enumerate(rows) if row is not None]
            if len(keep) < len(rows):
                logits = logits[torch.tensor(keep, dtype=torch.int64, device=logits.device)]
            return logits, [rows[i] for i in keep]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        seqs: list[SeqChunk] = []
        rows: list[int] = []
        wanted: list[tuple[_Request, int | None]] = []
        for r, n in sched:
            start = r.num_computed
            seqs.append(SeqChunk(len(ids), n, start, list(r.block_ids)))
            ids += r.token_ids[start : start + n]
            for p in range(start, start + n):
                pos.append(p)
                slots.append(r.block_ids[p // bs] * bs + p % bs)
            r.num_computed += n
            row = self._row(r)
            r.num_computed -= n
            if row is not None:
                rows.append(len(ids) - 1)
                wanted.append(row)
        select = None
        if self.cfg.exact and all(n == 1 and r.num_computed >= r.num_prompt for r, n in sched):
            # A decode step without the fixed-size graphs: pad to the one decode batch
            # size with rows that write only the reserved null block, and take the
            # logits of every row (the LM head's GEMM keeps that size too).
            for _ in range(min(self.cfg.max_num_seqs, 512) - len(sched)):
                ids.append(0)
                pos.append(0)
                slots.append(NULL_BLOCK * bs)
            select, rows = rows, list(range(len(ids)))
        dev = self.model.device
        batch = Batch(
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.tensor(pos, dtype=torch.int64, device=dev),
            torch.tensor(slots, dtype=torch.int64, device=dev),
            seqs,
            torch.tensor(rows, dtype=torch.int64, device=dev),
        )
        logits = self.model.forward(batch)
        if select is not None:
            logits = logits[torch.tensor(select, dtype=torch.int64, device=logits.device)]
        if on_launch is not None:
            on_launch()
        for r, n in sched:
            r.num_computed += n
        return logits, wanted

    def _stop_after(self, req: _Request, tok: int) -> tuple[str, str | int | None] | None:
        """Finish reason after appending tok (already in req.token_ids), or None."""
        p = req.params
        stop_str = req.text.add(tok)
        if not p.ignore_eos and tok in self.tokenizer.eos_token_ids:
            return ("stop", None)
        if tok in p.stop_token_ids:
            return ("stop", tok)
        if stop_str is not None:
            return ("stop", stop_str)
        if req.num_output >= p.max_tokens or len(req.token_ids) >= self.cfg.max_model_len:
            return ("length", None)
        return None

    def _append_token(self, req: _Request, tok: int) -> RequestOutput:
        req.token_ids.append(tok)
        req.no_chunk = False
        self.counters["generated_tokens"] += 1
        fin = self._stop_after(req, tok)
        idx = req.num_output - 1
        if fin is None:
            return RequestOutput(req.key, [tok], idx, text=req.text.take(), num_prompt_tokens=req.num_prompt)
        text = req.text.finish()
        self._running.remove(req)
        self._retire(req, finished=True, aborted=False)
        return RequestOutput(req.key, [tok], idx, True, fin[0], fin[1], text, req.num_prompt)

    def _retire(self, req: _Request, finished: bool, aborted: bool, release: bool = True) -> None:
        if release and req.block_ids:
            self.blocks.release(req.block_ids, quarantine=self._views_read)
        self._done_views.append(RequestView(req.key, req.seed, req.block_ids, req.token_ids,
                                            req.num_prompt, req.num_computed, finished, aborted))
        req.block_ids = []
        del self._reqs[req.key]

    # ---- convenience -----------------------------------------------------
    def generate(self, prompts: Iterable[tuple[int, Sequence[int], SamplingParams]]) -> dict[int, list[int]]:
        """Run requests to completion (tests and scripts); returns output token ids per key."""
        out: dict[int, list[int]] = {}
        for key, ids, params in prompts:
            self.add_request(key, ids, params)
            out[key] = []
        while self.has_work():
            for o in self.step():
                out.setdefault(o.key, []).extend(o.new_token_ids)
        return out
