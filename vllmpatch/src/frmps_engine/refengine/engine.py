"""RefCore: the reference engine's core, as the SDK drives it. The scheduler
(scheduler.py) decides what each pass computes and owns every request's state;
this class runs the passes on the model (the prefill path, the static/CUDA-graph
decode path, padding), samples, and hands the tokens back to the scheduler."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import torch

from frmps_engine.sdk.engine_api import throwaway_takeover

from .block_manager import BlockManager
from .config import NULL_BLOCK, EngineConfig, rank_pools
from .model import AllReduce, Batch, CudaGraphDecoder, Qwen2Model, SeqChunk
from .sampling import SamplingParams, adjust_logits, sample, token_logprobs
from .scheduler import AdoptResult, EngineError, Request, RequestOutput, RequestView, Scheduler, SchedulerOutput
from .tokenizer import Tokenizer, load_tokenizer
from .weights import check_pools, init_dummy, load_safetensors


class Workers(Protocol):
    """Rank 0's handle on the other ranks of its tensor-parallel group (tp.Group):
    each call returns once the request is sent; the group's collectives pair
    rank 0's work with theirs."""

    def run_plan(self, plan: dict) -> None: ...
    def warmup(self) -> None: ...


class RefCore:
    def __init__(
        self,
        cfg: EngineConfig,
        pools: dict,
        load_weights: bool,
        tokenizer: Tokenizer | None = None,
        *,
        rank: int = 0,
        comm: AllReduce | None = None,
        workers: Workers | None = None,
    ) -> None:
        """rank, comm: this process's place in a tensor-parallel group and the
        group's all-reduce (tp.py); workers (rank 0 only): the other ranks, which
        run every pass and warm-up that rank 0 runs."""
        if cfg.tensor_parallel_size > 1 and comm is None:
            raise EngineError(f"tensor_parallel_size {cfg.tensor_parallel_size} needs the group's communicator")
        self.cfg = cfg
        self.rank = rank
        weights_pool, kv_pool = check_pools(cfg, pools, rank)
        self.model = Qwen2Model(cfg, weights_pool, kv_pool, comm=comm, rank=rank)
        self._workers = workers
        if load_weights:
            if cfg.weights == "dummy":
                init_dummy(cfg, self.model.params, rank)
            else:
                load_safetensors(cfg, self.model.params, cfg.weights, rank)
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model_dir)
        if self.tokenizer.vocab_size > cfg.shape.vocab_size:
            raise EngineError(
                f"tokenizer has {self.tokenizer.vocab_size} tokens, model vocabulary only {cfg.shape.vocab_size}"
            )
        self._graphs: CudaGraphDecoder | None = None
        self.counters: dict[str, int] = dict(
            steps=0, forward_passes=0, prefill_tokens_computed=0, decode_tokens=0, generated_tokens=0,
            adopted_requests=0, adopted_tokens_reused=0, preemptions=0, graph_steps=0,
            replayed_tokens=0, replay_mismatches=0,
        )
        self.scheduler = Scheduler(cfg, self.tokenizer, counters=self.counters)
        # Device work is asynchronous (CUDA): step()'s on_launch runs after the enqueue.
        self._launch_async = self.model.device.type == "cuda"
        # All of the engine's device work (warm-up, graph capture, steps) goes to one
        # stream: torch gives each (cuBLAS handle, stream) pair its own workspace (32 MiB
        # on Hopper), and a standby keeps every one it ever used.
        self._stream = torch.cuda.Stream(self.model.device) if self._launch_async else None
        # Tokens the step in progress computes (engine_api: read by the heartbeat thread).
        self.scheduled_tokens = 0
        self._gate: Callable[[], None] | None = None  # engine_api.DeviceGate

    # ---- setup -----------------------------------------------------------
    @staticmethod
    def allocate_pools(cfg: EngineConfig, rank: int = 0) -> dict:
        """Zero-filled private pools of one rank (tests, benchmarks, single-process use)."""
        return {(p.tag, p.index): torch.zeros(p.size, dtype=torch.uint8, device=cfg.device)
                for p in rank_pools(cfg, rank)}

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
        if self._workers is not None:
            self._workers.warmup()
        with self._on_stream():
            self._warmup(on_stage)

    def _warmup(self, on_stage: Callable[[str], None] | None = None) -> None:
        stage = on_stage or (lambda _name: None)
        if self._static_decode() and self._graphs is None:
            b = min(self.cfg.max_num_seqs, 512)
            # A policy with one decode shape (exact) gets one graph of that size.
            rows = self.scheduler.policy.decode_rows
            g = CudaGraphDecoder(self.model, b, graphs=self.cfg.cuda_graphs, buckets=[rows] if rows else None,
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

    # ---- requests (the scheduler owns them) ----------------------------------
    @property
    def blocks(self) -> BlockManager:
        """The KV cache's block manager."""
        return self.scheduler.blocks

    @property
    def _reqs(self) -> dict[int, Request]:
        """The scheduler's requests by key (white-box tests look inside)."""
        return self.scheduler.requests

    def add_request(self, key: int, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.scheduler.add_request(key, prompt_token_ids, params)

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
        """Take over a request whose KV for token_ids[:num_computed] is in block_ids
        (Scheduler.adopt_request)."""
        return self.scheduler.adopt_request(key, params, token_ids, num_prompt, num_computed, block_ids, seed,
                                            delivered_token_ids)

    def abort(self, key: int) -> bool:
        return self.scheduler.abort(key)

    def reset(self) -> None:
        """Forget every request and free every block, writing nothing to the device:
        a planned handover gave them (and the KV cache's contents) to another engine.
        The engine is then as a fresh standby's: empty, ready to adopt."""
        self.scheduler.reset()

    def warm_takeover(self) -> None:
        """engine_api.TakeoverWarmup: two throwaway requests (greedy, and seeded with
        top-k/top-p) adopted on blocks 1-4, one step, reset. Only for a standby's own
        memory (before its pools are mapped): the step writes those blocks."""
        bs = self.cfg.block_size
        if self.cfg.num_blocks < 5 or self.cfg.max_model_len < bs + 2:
            return
        throwaway_takeover(self, (SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                                  SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, top_k=50, seed=1,
                                                 ignore_eos=True)), bs, self.counters)

    # ---- negative controls (engine_api.TakeoverFaultHooks; tests and benches only) ----
    def check_takeover_faults(self, cases: Sequence[str]) -> None:
        """Each rank of a tensor-parallel group holds a shard of the KV cache, which
        fault_kv writes only on rank 0: refused there."""
        kv = [c for c in cases if c != "sampler-offset"]
        if kv and self.cfg.tensor_parallel_size > 1:
            raise EngineError(f"{', '.join(kv)}: the KV-content negative controls support tensor_parallel_size 1 "
                              f"only (this engine has {self.cfg.tensor_parallel_size} ranks, each with a KV shard)")

    def fault_kv(self, op: str, block: int, other: int, slot: int) -> None:
        """Zero a block (or one slot of it) or swap two blocks, every layer, K and V."""
        kv = self.model.kv  # [L, 2, NB, BS, KVH, HD]
        with self._on_stream():
            if op == "zero":
                (kv[:, :, block] if slot < 0 else kv[:, :, block, slot]).zero_()
            elif op == "swap":
                tmp = kv[:, :, block].clone()
                kv[:, :, block].copy_(kv[:, :, other])
                kv[:, :, other].copy_(tmp)
            else:
                raise EngineError(f"fault_kv: unknown op {op!r}")

    def kv_token_digests(self, block_ids: Sequence[int], n: int) -> list[int]:
        """sdk/kv_digest.KvDigests over the model's one KV tensor [L, 2, NB, BS, KVH, HD]."""
        from ..sdk.kv_digest import torch_token_digests

        with self._on_stream():
            return torch_token_digests([(self.model.kv, 2, 3)], block_ids, n, int(self.model.kv.shape[3]))

    def shift_sampler(self, key: int, n: int) -> None:
        self.scheduler.requests[key].sample_offset += n

    def gate_device(self, wait: Callable[[], None]) -> bool:
        """engine_api.DeviceGate: the next pass calls wait() once its plan (the
        scheduling and the pass as lists, host work only) is made, before any
        tensor reaches the device or the other ranks."""
        self._gate = wait
        return True

    def check_device(self) -> None:
        """Raise the device's sticky error, if any (a cheap synchronise; the engine loop
        calls it while idle). No-op on the CPU."""
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def request_views(self) -> list[RequestView]:
        """Committed state of every live request, plus each request that finished
        or was aborted since the previous call (Scheduler.request_views)."""
        return self.scheduler.request_views()

    # ---- stepping --------------------------------------------------------
    # The engine loop may pass step(on_launch=...): see engine_api.LaunchHook.
    launch_hook = True

    def step(self, on_launch: Callable[[], None] | None = None) -> list[RequestOutput]:
        """One scheduling step. on_launch, if given, runs once the pass is enqueued on
        the device and before the host waits for its result, with the committed state
        still that of the previous step (only blocks for this pass are allocated). It
        does not run when nothing is scheduled."""
        with self._on_stream():
            return self._step(on_launch)

    def _step(self, on_launch: Callable[[], None] | None) -> list[RequestOutput]:
        self.scheduled_tokens = 0
        batch = self.scheduler.schedule()
        self.scheduled_tokens = batch.num_tokens
        self.counters["steps"] += 1
        if not batch:
            return self.scheduler.update_from_output(batch, [])
        logits = self._forward(batch, on_launch)
        rows = batch.sampled
        tokens: list[int] = []
        if rows:
            # Each row samples the token at its position: a new one, or (a replay) one
            # the request already has, which the scheduler checks.
            params = [r.request.params for r in rows]
            sampled = logits
            if any(p.adjusts for p in params):
                sampled = adjust_logits(logits, [(r.request.params, r.request.token_ids, r.request.num_prompt, r.position)
                                                 for r in rows], self.tokenizer.eos_token_ids)
            constrained = [(i, r.request.matcher) for i, r in enumerate(rows)
                           if r.request.matcher is not None and r.expected is None]
            if constrained:
                if sampled is logits:
                    sampled = logits.float().clone()
                self.scheduler.grammars.mask(sampled, constrained)
            tokens = sample(sampled, params, [r.request.seed for r in rows],
                            [r.position + r.request.sample_offset for r in rows])
            want = [i for i, r in enumerate(rows) if r.request.params.logprobs is not None and r.expected is None]
            if want:
                lps: list = [None] * len(rows)
                got = token_logprobs(logits[want], [tokens[i] for i in want], [rows[i].request.params.logprobs for i in want])
                for i, lp in zip(want, got):
                    lps[i] = lp
                return self.scheduler.update_from_output(batch, tokens, lps)
        return self.scheduler.update_from_output(batch, tokens)

    def _forward(self, batch: SchedulerOutput, on_launch: Callable[[], None] | None = None) -> torch.Tensor:
        """Run one pass; returns the logits of batch.sampled, in that order. on_launch
        runs after the pass is enqueued on a GPU (before the scheduler commits it), so
        that it overlaps the device's work. On the CPU the pass computes as it is
        "enqueued": there it runs first, lest the record wait for the whole pass."""
        if on_launch is not None and not self._launch_async:
            on_launch()
            on_launch = None
        for r, n in batch:
            if n == 1 and r.num_computed >= r.num_prompt:
                self.counters["decode_tokens"] += 1
            else:
                self.counters["prefill_tokens_computed"] += n
        self.counters["forward_passes"] += 1
        plan = self._plan(batch)
        if self._gate is not None:  # the pass's host work is done; its device work waits for the KV flip
            gate, self._gate = self._gate, None
            gate()
        if self._workers is not None:
            self._workers.run_plan(plan)  # the other ranks run the same pass on their shards
        logits = self._run_plan(plan)  # step() put us on the engine's stream already
        if on_launch is not None:
            on_launch()
        return logits

    def _plan(self, batch: SchedulerOutput) -> dict:
        """The pass as plain data (lists of ints): what every tensor-parallel rank
        needs to run it (run_plan). No scheduler state is needed to execute it."""
        bs = self.cfg.block_size
        decode_only = all(n == 1 for _, n in batch)
        if decode_only and self._static_decode() and len(batch) <= min(self.cfg.max_num_seqs, 512):
            pos = [r.num_computed for r, _ in batch]
            keep = [i for i, row in enumerate(batch.rows) if row is not None]
            return dict(
                kind="decode",
                ids=[r.token_ids[r.num_computed] for r, _ in batch],
                pos=pos,
                slots=[r.block_ids[p // bs] * bs + p % bs for (r, _), p in zip(batch, pos)],
                tables=[r.block_ids for r, _ in batch],  # run (or sent) before the scheduler changes them
                keep=keep if len(keep) < len(batch) else None,
            )
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        seqs: list[tuple[int, int, int, list[int]]] = []
        rows: list[int] = []
        for (r, n), row in zip(batch, batch.rows):
            start = r.num_computed
            seqs.append((len(ids), n, start, list(r.block_ids)))
            ids += r.token_ids[start : start + n]
            for p in range(start, start + n):
                pos.append(p)
                slots.append(r.block_ids[p // bs] * bs + p % bs)
            if row is not None:
                rows.append(len(ids) - 1)
        select = None
        if batch.pad_decode_to is not None:
            # A decode pass without the fixed-size graphs: pad to the one decode batch
            # size with rows that write only the reserved null block, and take the
            # logits of every row (the LM head's GEMM keeps that size too).
            for _ in range(batch.pad_decode_to - len(batch)):
                ids.append(0)
                pos.append(0)
                slots.append(NULL_BLOCK * bs)
            select, rows = rows, list(range(len(ids)))
        return dict(kind="varlen", ids=ids, pos=pos, slots=slots, seqs=seqs, rows=rows, select=select)

    def run_plan(self, plan: dict) -> torch.Tensor:
        """Execute a pass described by _plan on this rank's shard (a tensor-parallel
        worker's entry point); the logits of the sampled rows (empty on a worker,
        which does not sample)."""
        with self._on_stream():
            return self._run_plan(plan)

    def _run_plan(self, plan: dict) -> torch.Tensor:
        if plan["kind"] == "decode":
            if self._graphs is None:
                self._warmup()
            logits = self._graphs.run(plan["ids"], plan["pos"], plan["slots"], plan["tables"])
            if self._graphs.use_graphs:
                self.counters["graph_steps"] += 1
            keep = plan["keep"]
            if keep is not None:
                logits = logits[torch.tensor(keep, dtype=torch.int64, device=logits.device)]
            return logits
        dev = self.model.device
        t = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
        seqs = [SeqChunk(q0, n, start, blocks) for q0, n, start, blocks in plan["seqs"]]
        logits = self.model.forward(Batch(t(plan["ids"]), t(plan["pos"]), t(plan["slots"]), seqs, t(plan["rows"])))
        select = plan["select"]
        if select is not None:
            logits = logits[torch.tensor(select, dtype=torch.int64, device=logits.device)]
        return logits

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
