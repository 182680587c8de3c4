"""What the SDK needs from an engine (proto/frmps/v1/ENGINE.md is the whole
contract; this is its Python half). The reference engine's ``RefCore`` and the
vLLM adapter's ``VllmCore`` both implement ``Core``.

The runner talks to an ``EngineAdapter`` (one per engine kind): it derives the
pool layout, builds the core on given pools and converts sampling params. The
engine loop drives the ``Core`` from one thread only.

Optional capabilities are declared below as runtime-checkable protocols and
probed with ``isinstance`` (the engine loop probes its core once, when it gets
it); a core without one gets the fallback its docstring names.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, MutableMapping, Protocol, Sequence, runtime_checkable

from frmps_engine._proto.frmps.v1 import control_pb2


@runtime_checkable
class Tokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    # Takes tools=[…] too (keyword, only given when the request has tools: a list of
    # OpenAI tool objects, rendered as Hugging Face's apply_chat_template(tools=…)
    # renders them); messages may carry tool_calls, tool_call_id and name.
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]: ...


@runtime_checkable
class VocabSize(Protocol):
    """A tokenizer that knows its vocabulary size: prompt token ids and stop token
    ids at or above it are refused with INVALID_ARGUMENT before they reach the
    engine (without it the engine itself refuses what it cannot take)."""

    vocab_size: int


class RequestOutput(Protocol):
    key: int
    new_token_ids: Sequence[int]
    output_index: int  # index in the output of new_token_ids[0]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    stop_reason: Any  # matched stop string (str) or stop token (int), else None


@runtime_checkable
class AdoptResult(Protocol):
    reused_tokens: int  # tokens whose KV came from the shared cache
    prefill_tokens: int  # tokens the first pass computes (after the last sync)


class RequestView(Protocol):
    """Committed forward state of one request, as the ring's DeltaTracker wants it.
    Optionally ``parts()`` (ring.tracker.ViewParts) to skip copying the lists."""

    key: int
    seed: int
    block_ids: list[int]
    token_ids: list[int]
    num_prompt: int
    num_computed: int
    finished: bool
    aborted: bool


@runtime_checkable
class Core(Protocol):
    """What the engine loop drives: requests in, one step at a time, outputs out."""

    tokenizer: Tokenizer
    counters: Mapping[str, int]

    # Bad requests raise ValueError (INVALID_ARGUMENT for the client); device errors are fatal.
    def add_request(self, key: int, prompt_token_ids: list[int], params: Any) -> None: ...
    def adopt_request(
        self,
        key: int,
        params: Any,
        token_ids: list[int],
        num_prompt: int,
        num_computed: int,
        block_ids: list[int],
        seed: int,
        delivered_token_ids: list[int],
    ) -> AdoptResult: ...
    def abort(self, key: int) -> bool: ...
    def step(self) -> list[RequestOutput]: ...
    def has_work(self) -> bool: ...
    def request_views(self) -> Iterable[RequestView]: ...


# Optional capabilities of a Core.


@runtime_checkable
class LaunchHook(Protocol):
    """step(on_launch=fn): the core calls fn once per step after the step's device
    work is enqueued and before the host waits for it, while request_views() still
    describes the previous step (blocks allocated for this step may be included).
    The loop publishes the ring record there, so the publish runs while the device
    computes instead of between steps. fn is not called if nothing is scheduled;
    the loop then publishes after step() returns. ``launch_hook`` must be True
    (False turns the overlap off for that instance). Without it: the loop
    publishes between steps."""

    launch_hook: bool

    def step(self, on_launch: Callable[[], None] | None = None) -> list[RequestOutput]: ...


@runtime_checkable
class Pipelined(Protocol):
    """The core keeps device work in flight between step() calls (vLLM's async
    scheduling: step N+1 is launched before step N's outputs are processed).
    finish_in_flight() completes that work without starting more and returns its
    outputs; the loop calls it before a planned handover publishes its FULL
    record, so the record and the streams hold every token computed and the device
    is idle before the pools are handed over. Without it: nothing is in flight
    between steps."""

    def finish_in_flight(self) -> list[RequestOutput]: ...


@runtime_checkable
class StepSize(Protocol):
    """``scheduled_tokens``: the tokens (prefill + decode) the step in progress
    computes, set when step() has scheduled them and kept until the next step. Read
    from the heartbeat thread; the loop sizes its hang estimate with it. Without
    it: no estimate, so the supervisor's default step bound applies."""

    scheduled_tokens: int


@runtime_checkable
class LoadReport(Protocol):
    """The core's own running and waiting counts, for heartbeats and Health.
    Without it: the SDK counts the streams it has open."""

    def num_running(self) -> int: ...
    def num_waiting(self) -> int: ...


@runtime_checkable
class DeviceCheck(Protocol):
    """check_device() raises the device's sticky error; the loop calls it while
    idle, so an idle engine in a context another MPS client broke dies (and is
    replaced) at once. Without it: the error surfaces at the next step."""

    def check_device(self) -> None: ...


@runtime_checkable
class TakeoverWarmup(Protocol):
    """warm_takeover(): run a takeover's host path once (adopt two small requests,
    one step, reset) on a standby's own memory before it sleeps, then forget it
    all, counters included. A fresh engine's first takeover otherwise pays for
    code run for the first time (lazy imports, first calls, first-use caches) in
    its first step's host time. throwaway_takeover() is the body."""

    def warm_takeover(self) -> None: ...


@runtime_checkable
class DeviceGate(Protocol):
    """gate_device(wait): make the next step call ``wait()`` (once) right before
    its first device work that touches the KV cache, after the step's host
    work (scheduling, the requests' states, the input buffers: work on the
    engine's own memory); True when the core installed the gate. A takeover starts
    the loop with the gate in place as soon as the requests are adopted, so the
    first resumed step's host work runs while the KV flip waits for the MPS
    server to tear the dead client down, and only its device work waits for the
    flip; ``wait()`` raises the flip's error (a device error: the engine is lost).
    Before ``wait()`` returns the step must not touch the KV cache (a dead
    client's last kernels may still be writing it) nor write any pool. False, or
    without it: the loop starts after the flip."""

    def gate_device(self, wait: Callable[[], None]) -> bool: ...


@runtime_checkable
class TakeoverFaultHooks(Protocol):
    """Test and bench only: what the negative controls of takeover exactness
    (``FRMPS_TEST_TAKEOVER_FAULT``, sdk/takeover_fault.py) need from a core.
    ``check_takeover_faults(cases)`` raises ValueError (the engine refuses to
    start) when the core cannot apply one of ``cases``.
    ``fault_kv(op, block, other, slot)`` writes the KV cache, every layer, K and
    V: op ``zero`` zeroes ``block`` (only its ``slot`` when ``slot >= 0``), op
    ``swap`` swaps the contents of ``block`` and ``other``; called on the loop's
    thread at the device gate (or after the KV flip without one), before the
    first resumed step's device work. ``shift_sampler(key, n)``: request ``key``
    (adopted) samples from now on with the noise of the position ``n`` further on.
    Without it: the engine refuses to start with a case that needs it."""

    def check_takeover_faults(self, cases: Sequence[str]) -> None: ...
    def fault_kv(self, op: str, block: int, other: int, slot: int) -> None: ...
    def shift_sampler(self, key: int, n: int) -> None: ...


# Request keys of throwaway_takeover()'s requests (never a client's: keys count up from 1).
WARM_KEY = (1 << 63) - 1


def throwaway_takeover(core: Any, params: Sequence[Any], block_size: int, counters: MutableMapping[str, int]) -> None:
    """TakeoverWarmup's body for a Resettable core: adopt one request per entry of
    params (engine sampling parameters) on blocks 1+2i and 2+2i (block_size + 1
    computed tokens, one delivered output), step until each has a token (at most
    4 steps: with async scheduling the first only queues its batch), reset, and
    put counters back as they were. Only on a standby's own memory, before its
    pools are mapped: the steps write those blocks."""
    saved = dict(counters)
    toks = [1] * (block_size + 2)
    try:
        for i, p in enumerate(params):
            core.adopt_request(WARM_KEY - i, p, toks, block_size + 1, block_size + 1, [1 + 2 * i, 2 + 2 * i], 1 + i,
                               toks[block_size + 1:])
        got = 0
        for _ in range(4):
            got += sum(len(o.new_token_ids) for o in core.step())
            if got >= len(params):
                break
    finally:
        core.reset()
        counters.clear()
        counters.update(saved)


@runtime_checkable
class Resettable(Protocol):
    """reset() forgets every request and frees every KV block without writing the
    KV cache: a planned handover gave them to another engine, which owns the KV
    cache's contents now. It may launch device work of its own (vLLM's runs a step
    that computes no token, to hand the model runner the finished request ids), so
    the runner calls it while the pools are still writable and the next engine
    still waits: before the read-only flips and the reply (after them, vLLM's reset
    step would write read-only memory: an illegal address). Without it: the engine
    refuses Handoff and keeps serving (no failback to it)."""

    def reset(self) -> None: ...


def rank_death(rank: int, who: str, code: int) -> str:
    """How a ProcessGroup names the death of one of its ranks (``on_peer_death``'s
    and ``dead_peer``'s cause): ``code`` is the process's exit code, negative for
    a signal (subprocess and multiprocessing alike); ``who`` names the process."""
    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    return f"tensor-parallel rank {rank} ({who}) died: {how}"


@runtime_checkable
class ProcessGroup(Protocol):
    """An engine that may run as several processes (tensor parallelism): the
    process the supervisor launched is rank 0 and starts the others itself. The
    runner wraps its memory backend with ``group_memory`` (the pools of every
    rank are allocated, exported and mapped through rank 0; a group of one
    returns the backend unchanged) and calls ``on_peer_death(fn)`` before the
    handshake: ``fn(cause)`` runs when another rank dies, reports the death and
    ends this process, whose exit the supervisor treats as the engine's death.
    ``dead_peer(wait_s)`` is asked when a step fails with an error that is not a
    device error (a collective on a dead peer raises before the death is seen):
    the cause if another rank has died or dies within ``wait_s`` seconds, else
    None; the runner then reports the death, not the symptom, and the requests
    stay open for the standby to resume instead of failing. Without it: one
    process."""

    def group_memory(self, local: Any) -> Any: ...
    def on_peer_death(self, fn: Callable[[str], None]) -> None: ...
    def dead_peer(self, wait_s: float) -> str | None: ...


@runtime_checkable
class EngineCoreProtocol(Protocol):
    """An adapter whose engine can serve vLLM's engine-core protocol to vLLM's own
    API server (vllmpatch/OPENAI.md, design (a)) instead of frmps's generation API:
    the runner's core mode (``--core-input``/``--core-output``). Without it the
    runner refuses that mode at start.

    ``serve_engine_core()`` is called once, before any core is built: cores built
    afterwards leave stop strings and detokenization to the frontend.
    ``engine_core_server(core, input_address, output_address, *, engine_index,
    sync_every, on_fatal, on_error, step_delay_s)`` returns a server over ``core`` with its
    own EngineLoop (``.loop``), not connected yet: ``adopt_resume(requests)``
    (control ResumeRequests carrying ``engine_request``) before ``start()``
    (connect, ready message, loop start); ``hand_over()`` (planned handover:
    publish, forget, disconnect without ending the frontend's requests);
    ``stop_input()``, ``close()``."""

    def serve_engine_core(self) -> None: ...
    def engine_core_server(self, core: Any, input_address: str, output_address: str, **kw: Any) -> Any: ...


def has_launch_hook(core: object) -> bool:
    return isinstance(core, LaunchHook) and bool(core.launch_hook)


def vocab_size(tok: object) -> int | None:
    """The tokenizer's vocabulary size, or None when it does not say (VocabSize).
    An attribute lookup, not ``isinstance(tok, VocabSize)``: a runtime protocol
    check walks the protocol's members each time, paid per request and twice per
    request a takeover adopts."""
    try:
        n = tok.vocab_size  # type: ignore[attr-defined]
    except AttributeError:
        return None
    return int(n)


@runtime_checkable
class EngineAdapter(Protocol):
    """One engine kind, configured from the command line (built by the factory
    that ``--engine`` names: sdk/adapters.py)."""

    name: str  # Hello.engine: "ref", "vllm", ...
    version: str
    model: str
    device: str
    block_size: int
    num_blocks: int
    max_model_len: int

    def pool_layout(self) -> list[Any]:
        """PoolSpec-likes (.tag .index .size), deterministic from the configuration."""

    def create_core(self, pools: dict[tuple[str, int], Any], load_weights: bool) -> Core:
        """Build the core with its weights and KV cache as views into ``pools``.
        load_weights=False (standby) must never write the pools."""

    def sampling_params(self, params: control_pb2.SamplingParams, seed: int) -> Any:
        """Convert wire params (already validated; ``seed`` resolved) to the engine's own type."""

    def tokenizer(self) -> Tokenizer:
        """The engine's tokenizer, available before the core exists (prompts are checked early)."""
