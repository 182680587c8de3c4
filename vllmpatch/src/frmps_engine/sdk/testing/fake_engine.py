"""TEST DOUBLE: a fake engine core with real shared-memory behaviour.

It writes one int32 "KV value" per token into the kv_cache pool (paged, block
size 4) and derives every next token from the KV values it reads back and
from the weights pool, so a standby that takes over continues correctly only
if the shared pools really carried the active's weights and KV. Sampling
depends only on (seed, position, KV): a resumed request samples as before.

Env knobs (tests only): FRMPS_FAKE_STEP_DELAY_MS slows each step;
FRMPS_FAKE_FAULT_AT_STEP=N raises a CUDA-like error at step N.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from frmps_engine.sdk.adapters import AdapterError, EngineOptions
from frmps_engine.sdk.memory.base import PoolSpec

BLOCK_SIZE = 4
WEIGHTS_SIZE = 4096
VOCAB = 256


class FakeTokenizer:
    """Byte-level tokenizer (token id = byte)."""

    eos_token_id = None
    vocab_size = VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tools=None) -> list[int]:
        # Tools, and a message's tool calls, call id and name, as JSON in the text.
        text = f"<tools>{json.dumps(tools)}\n" if tools else ""
        for m in messages:
            extra = "".join(f" {k}={json.dumps(m[k])}" for k in ("tool_calls", "tool_call_id", "name") if k in m)
            text += f"<{m['role']}{extra}>{m['content']}\n"
        if add_generation_prompt:
            text += "<assistant>"
        return self.encode(text)


@dataclass
class FakeParams:
    max_tokens: int
    temperature: float
    seed: int
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass
class FakeOutput:
    key: int
    new_token_ids: list[int]
    output_index: int
    finished: bool
    finish_reason: str | None
    stop_reason: object = None


@dataclass
class FakeAdopt:
    reused_tokens: int
    prefill_tokens: int


@dataclass
class _Req:
    key: int
    params: FakeParams
    tokens: list[int]
    num_prompt: int
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    finished: bool = False
    aborted: bool = False

    # RequestView protocol
    @property
    def seed(self) -> int:
        return self.params.seed

    @property
    def block_ids(self) -> list[int]:
        return list(self.blocks)

    @property
    def token_ids(self) -> list[int]:
        return list(self.tokens)


def kv_value(token: int, pos: int) -> int:
    return token * 1000 + pos + 1


class FakeCore:
    def __init__(self, num_blocks: int, max_model_len: int, pools, load_weights: bool):
        import torch

        self._torch = torch
        self.tokenizer = FakeTokenizer()
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.weights = pools[("weights", 0)]
        self.kv = pools[("kv_cache", 0)].view(torch.int32)
        if load_weights:
            self.weights.copy_(torch.arange(WEIGHTS_SIZE, dtype=torch.int64).mul(7).add(3).remainder(256).to(torch.uint8))
        self._free = list(range(num_blocks))
        self._reqs: dict[int, _Req] = {}
        self._done: list[_Req] = []  # finished/aborted, reported in the next request_views()
        self.counters = {"prefill_tokens_computed": 0, "decode_tokens": 0, "adopted_tokens_reused": 0, "steps": 0}
        self._delay = float(os.environ.get("FRMPS_FAKE_STEP_DELAY_MS", "0")) / 1000
        self._fault_at = int(os.environ.get("FRMPS_FAKE_FAULT_AT_STEP", "0"))
        self.scheduled_tokens = 0  # engine_api: tokens of the step in progress

    # -- requests ---------------------------------------------------------------
    def add_request(self, key, prompt_token_ids, params: FakeParams) -> None:
        if key in self._reqs:
            raise ValueError(f"fake core: key {key} exists")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError("fake core: prompt too long")
        self._reqs[key] = _Req(key, params, list(prompt_token_ids), len(prompt_token_ids))

    def adopt_request(self, key, params, token_ids, num_prompt, num_computed, block_ids, seed, delivered_token_ids):
        out = list(token_ids[num_prompt:])
        delivered = list(delivered_token_ids)
        common = min(len(out), len(delivered))
        if out[:common] != delivered[:common]:
            raise ValueError(f"fake core: request {key}: snapshot output differs from delivered tokens")
        tokens = list(token_ids[:num_prompt]) + (delivered if len(delivered) >= len(out) else out)
        num_computed = min(num_computed, len(tokens))
        need = -(-num_computed // BLOCK_SIZE)
        if len(block_ids) < need:
            raise ValueError(f"fake core: request {key}: {len(block_ids)} blocks cannot hold {num_computed} tokens")
        for b in block_ids:
            if b not in self._free:
                raise ValueError(f"fake core: block {b} is not free")
        for b in block_ids:
            self._free.remove(b)
        r = _Req(key, FakeParams(params.max_tokens, params.temperature, seed, params.stop_token_ids), tokens,
                 num_prompt, num_computed, list(block_ids))
        for i in range(num_computed):  # the shared KV must hold exactly what the active computed
            got = int(self.kv[self._slot(r, i)])
            if got != kv_value(tokens[i], i):
                raise ValueError(f"fake core: request {key}: KV of token {i} is {got}, expected {kv_value(tokens[i], i)}")
        self._reqs[key] = r
        self.counters["adopted_tokens_reused"] += num_computed
        return FakeAdopt(num_computed, len(tokens) - num_computed)

    def abort(self, key) -> bool:
        r = self._reqs.pop(key, None)
        if r is None:
            return False
        r.aborted = True
        self._release(r)
        return True

    def _release(self, r: _Req) -> None:
        self._free.extend(r.blocks)
        self._done.append(r)

    def reset(self) -> None:
        """Forget every request and free every block (a planned handover)."""
        self._free = list(range(self.num_blocks))
        self._reqs.clear()
        self._done = []

    def has_work(self) -> bool:
        return bool(self._reqs)

    def request_views(self):
        views = list(self._reqs.values()) + self._done
        self._done = []
        return views

    # -- compute ------------------------------------------------------------------
    def _slot(self, r: _Req, pos: int) -> int:
        return r.blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE

    # step(on_launch=...) as the reference engine has it (engine_api.LaunchHook);
    # a test may set it False on the instance to get the publish-between-steps path.
    launch_hook = True

    def step(self, on_launch=None) -> list[FakeOutput]:
        self.counters["steps"] += 1
        if self._fault_at and self.counters["steps"] >= self._fault_at:
            raise RuntimeError("CUDA error: misaligned address")
        if self._delay:
            time.sleep(self._delay)
        torch = self._torch
        outs = []
        reqs = list(self._reqs.values())
        self.scheduled_tokens = sum(len(r.tokens) - r.num_computed for r in reqs)
        for r in reqs:
            while len(r.blocks) * BLOCK_SIZE < len(r.tokens):
                if not self._free:
                    raise RuntimeError("fake core: out of KV blocks")
                r.blocks.append(self._free.pop(0))
        if on_launch is not None and reqs:
            on_launch()  # "enqueued": nothing computed yet
        for r in reqs:
            n = len(r.tokens)
            todo = n - r.num_computed
            for i in range(r.num_computed, n):
                self.kv[self._slot(r, i)] = kv_value(r.tokens[i], i)
            self.counters["decode_tokens" if todo == 1 and n > r.num_prompt else "prefill_tokens_computed"] += todo
            r.num_computed = n
            slots = torch.tensor([self._slot(r, i) for i in range(n)], dtype=torch.int64)
            acc = int((self.kv[slots].to(torch.int64) * torch.arange(1, n + 1)).sum())
            acc += int(self.weights[n % WEIGHTS_SIZE])
            if r.params.temperature > 0:
                acc += (r.params.seed * 2654435761 + n * 40503) % 1000003
            tok = 97 + acc % 26
            r.tokens.append(tok)
            out_len = n + 1 - r.num_prompt
            reason = stop = None
            if tok in r.params.stop_token_ids:
                reason, stop = "stop", tok
            elif out_len >= r.params.max_tokens or n + 1 >= self.max_model_len:
                reason = "length"
            outs.append(FakeOutput(r.key, [tok], out_len - 1, reason is not None, reason, stop))
            if reason is not None:
                r.finished = True
                del self._reqs[r.key]
                self._release(r)
        return outs


class FakeAdapter:
    """EngineAdapter for the fake core. Model "fake-tiny" only (others: unknown preset)."""

    name = "fake"
    version = "0-test"

    def __init__(self, opts: EngineOptions):
        if opts.model != "fake-tiny":
            raise AdapterError(f"unknown model preset {opts.model!r} (the fake engine knows fake-tiny)")
        self.model = opts.model
        self.device = opts.device
        self.block_size = BLOCK_SIZE
        self.num_blocks = opts.num_blocks or 64
        self.max_model_len = opts.max_model_len or 128
        self.core: FakeCore | None = None

    def pool_layout(self):
        return [PoolSpec("weights", 0, WEIGHTS_SIZE), PoolSpec("kv_cache", 0, self.num_blocks * BLOCK_SIZE * 4)]

    def create_core(self, pools, load_weights: bool):
        self.core = FakeCore(self.num_blocks, self.max_model_len, pools, load_weights)
        return self.core

    def tokenizer(self):
        return FakeTokenizer()

    def sampling_params(self, p, seed: int):
        return FakeParams(p.max_tokens, p.temperature, seed, list(p.stop_token_ids))
