"""What the SDK needs from an engine. The reference engine's EngineCore fits
``EngineCore`` as is; the vLLM adapter implements the same two protocols.

The runner talks to an ``EngineAdapter`` (one per engine kind): it derives the
pool layout, builds the core on given pools and converts sampling params. The
engine loop drives the ``EngineCore`` from one thread only.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence, runtime_checkable

from frmps_engine._proto.frmps.v1 import control_pb2


@runtime_checkable
class Tokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]: ...


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
    Optionally ``parts()`` (see ring.tracker.RequestView) to skip copying the lists."""

    key: int
    seed: int
    block_ids: list[int]
    token_ids: list[int]
    num_prompt: int
    num_computed: int
    finished: bool
    aborted: bool


@runtime_checkable
class EngineCore(Protocol):
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


# Optional capabilities of an EngineCore: declared here, checked with isinstance.


@runtime_checkable
class LaunchHook(Protocol):
    """step(on_launch=fn): the core calls fn once per step after the step's device
    work is enqueued and before the host waits for it, while request_views() still
    describes the previous step (blocks allocated for this step may be included).
    The loop publishes the ring record there, so the publish runs while the device
    computes instead of between steps. fn is not called if nothing is scheduled;
    the loop then publishes after step() returns. ``launch_hook`` must be True."""

    launch_hook: bool

    def step(self, on_launch: Callable[[], None] | None = None) -> list[RequestOutput]: ...


@runtime_checkable
class StepSize(Protocol):
    """``scheduled_tokens``: the tokens (prefill + decode) the step in progress
    computes, set when step() has scheduled them and kept until the next step. Read
    from the heartbeat thread; the loop sizes its hang estimate with it (a core
    without it gets no estimate: the supervisor's default bound applies)."""

    scheduled_tokens: int


@runtime_checkable
class LoadReport(Protocol):
    """The core's own request counts, for heartbeats and Health (else the SDK counts streams)."""

    def num_running(self) -> int: ...
    def num_waiting(self) -> int: ...


@runtime_checkable
class DeviceCheck(Protocol):
    """check_device() raises the device's sticky error; the loop calls it while idle."""

    def check_device(self) -> None: ...


@runtime_checkable
class Resettable(Protocol):
    """reset() forgets every request and frees every KV block without writing the
    device: a planned handover gave them to another engine, which owns the KV
    cache's contents now. Needed to hand over (failback); a core without it
    refuses Handoff and keeps serving."""

    def reset(self) -> None: ...


def has_launch_hook(core: object) -> bool:
    return isinstance(core, LaunchHook) and bool(getattr(core, "launch_hook", False))


@runtime_checkable
class EngineAdapter(Protocol):
    """One engine kind, configured from the command line."""

    name: str  # Hello.engine: "ref", "vllm", ...
    version: str
    model: str
    device: str
    block_size: int
    num_blocks: int
    max_model_len: int

    def pool_layout(self) -> list[Any]:
        """PoolSpec-likes (.tag .index .size), deterministic from the configuration."""

    def create_core(self, pools: dict[tuple[str, int], Any], load_weights: bool) -> EngineCore:
        """Build the core with its weights and KV cache as views into ``pools``.
        load_weights=False (standby) must never write the pools."""

    def sampling_params(self, params: control_pb2.SamplingParams, seed: int) -> Any:
        """Convert wire params (already validated; ``seed`` resolved) to the engine's own type."""

    def tokenizer(self) -> Tokenizer:
        """The engine's tokenizer, available before the core exists (prompts are checked early)."""
