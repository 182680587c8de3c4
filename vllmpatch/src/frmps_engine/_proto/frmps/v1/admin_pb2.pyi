from frmps_engine._proto.frmps.v1 import control_pb2 as _control_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("role", "pid", "state", "in_mps", "restarts", "started_unix_nanos", "last_death_cause", "log_path", "engine", "device", "block_size", "num_blocks", "init_seconds", "steps", "running", "waiting", "from_spare", "kv_budget", "weights")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    IN_MPS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    LAST_DEATH_CAUSE_FIELD_NUMBER: _ClassVar[int]
    LOG_PATH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    FROM_SPARE_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    role: str
    pid: int
    state: str
    in_mps: bool
    restarts: int
    started_unix_nanos: int
    last_death_cause: str
    log_path: str
    engine: str
    device: str
    block_size: int
    num_blocks: int
    init_seconds: float
    steps: int
    running: int
    waiting: int
    from_spare: bool
    kv_budget: _control_pb2.KVBudget
    weights: str
    def __init__(self, role: _Optional[str] = ..., pid: _Optional[int] = ..., state: _Optional[str] = ..., in_mps: _Optional[bool] = ..., restarts: _Optional[int] = ..., started_unix_nanos: _Optional[int] = ..., last_death_cause: _Optional[str] = ..., log_path: _Optional[str] = ..., engine: _Optional[str] = ..., device: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., init_seconds: _Optional[float] = ..., steps: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., from_spare: _Optional[bool] = ..., kv_budget: _Optional[_Union[_control_pb2.KVBudget, _Mapping]] = ..., weights: _Optional[str] = ...) -> None: ...

class FailoverRecord(_message.Message):
    __slots__ = ("seq", "unix_nanos", "cause", "detail", "duration_seconds", "resumed_requests", "ok", "error", "reused_tokens", "prefilled_tokens", "first_token_seconds")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    unix_nanos: int
    cause: str
    detail: str
    duration_seconds: float
    resumed_requests: int
    ok: bool
    error: str
    reused_tokens: int
    prefilled_tokens: int
    first_token_seconds: float
    def __init__(self, seq: _Optional[int] = ..., unix_nanos: _Optional[int] = ..., cause: _Optional[str] = ..., detail: _Optional[str] = ..., duration_seconds: _Optional[float] = ..., resumed_requests: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., reused_tokens: _Optional[int] = ..., prefilled_tokens: _Optional[int] = ..., first_token_seconds: _Optional[float] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("state", "state_cause", "model", "engine", "sync_every", "engines", "failovers", "mps", "mps_state", "ring_lag_records", "ring_resyncs", "live_requests", "version", "crash_loop_open", "failback", "tensor_parallel_size", "spare", "frontend", "resolved")
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_CAUSE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    SYNC_EVERY_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    MPS_FIELD_NUMBER: _ClassVar[int]
    MPS_STATE_FIELD_NUMBER: _ClassVar[int]
    RING_LAG_RECORDS_FIELD_NUMBER: _ClassVar[int]
    RING_RESYNCS_FIELD_NUMBER: _ClassVar[int]
    LIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CRASH_LOOP_OPEN_FIELD_NUMBER: _ClassVar[int]
    FAILBACK_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_FIELD_NUMBER: _ClassVar[int]
    state: str
    state_cause: str
    model: str
    engine: str
    sync_every: int
    engines: _containers.RepeatedCompositeFieldContainer[EngineStatus]
    failovers: _containers.RepeatedCompositeFieldContainer[FailoverRecord]
    mps: bool
    mps_state: str
    ring_lag_records: int
    ring_resyncs: int
    live_requests: int
    version: str
    crash_loop_open: bool
    failback: Failback
    tensor_parallel_size: int
    spare: Spare
    frontend: FrontendStatus
    resolved: Resolved
    def __init__(self, state: _Optional[str] = ..., state_cause: _Optional[str] = ..., model: _Optional[str] = ..., engine: _Optional[str] = ..., sync_every: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[EngineStatus, _Mapping]]] = ..., failovers: _Optional[_Iterable[_Union[FailoverRecord, _Mapping]]] = ..., mps: _Optional[bool] = ..., mps_state: _Optional[str] = ..., ring_lag_records: _Optional[int] = ..., ring_resyncs: _Optional[int] = ..., live_requests: _Optional[int] = ..., version: _Optional[str] = ..., crash_loop_open: _Optional[bool] = ..., failback: _Optional[_Union[Failback, _Mapping]] = ..., tensor_parallel_size: _Optional[int] = ..., spare: _Optional[_Union[Spare, _Mapping]] = ..., frontend: _Optional[_Union[FrontendStatus, _Mapping]] = ..., resolved: _Optional[_Union[Resolved, _Mapping]] = ...) -> None: ...

class Resolved(_message.Message):
    __slots__ = ("device", "memory", "engine", "model", "reason")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    device: str
    memory: str
    engine: str
    model: str
    reason: str
    def __init__(self, device: _Optional[str] = ..., memory: _Optional[str] = ..., engine: _Optional[str] = ..., model: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class FrontendStatus(_message.Message):
    __slots__ = ("kind", "pid", "state", "engine_connected", "open_requests", "vllm_version", "engine_lost", "engine_back", "last_error")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    OPEN_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    VLLM_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_LOST_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BACK_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    kind: str
    pid: int
    state: str
    engine_connected: bool
    open_requests: int
    vllm_version: str
    engine_lost: int
    engine_back: int
    last_error: str
    def __init__(self, kind: _Optional[str] = ..., pid: _Optional[int] = ..., state: _Optional[str] = ..., engine_connected: _Optional[bool] = ..., open_requests: _Optional[int] = ..., vllm_version: _Optional[str] = ..., engine_lost: _Optional[int] = ..., engine_back: _Optional[int] = ..., last_error: _Optional[str] = ...) -> None: ...

class Spare(_message.Message):
    __slots__ = ("enabled", "state", "pid", "activations", "cold_starts", "last_ready_seconds", "size", "ready_count", "rss_bytes")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    COLD_STARTS_FIELD_NUMBER: _ClassVar[int]
    LAST_READY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    READY_COUNT_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    state: str
    pid: int
    activations: int
    cold_starts: int
    last_ready_seconds: float
    size: int
    ready_count: int
    rss_bytes: int
    def __init__(self, enabled: _Optional[bool] = ..., state: _Optional[str] = ..., pid: _Optional[int] = ..., activations: _Optional[int] = ..., cold_starts: _Optional[int] = ..., last_ready_seconds: _Optional[float] = ..., size: _Optional[int] = ..., ready_count: _Optional[int] = ..., rss_bytes: _Optional[int] = ...) -> None: ...

class Failback(_message.Message):
    __slots__ = ("enabled", "state", "placement_ok", "succeeded", "failed", "consecutive_failures", "next_attempt_unix_nanos", "last_error", "last_duration_seconds", "last_first_token_seconds", "last_unix_nanos")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_OK_FIELD_NUMBER: _ClassVar[int]
    SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    CONSECUTIVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    NEXT_ATTEMPT_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    state: str
    placement_ok: bool
    succeeded: int
    failed: int
    consecutive_failures: int
    next_attempt_unix_nanos: int
    last_error: str
    last_duration_seconds: float
    last_first_token_seconds: float
    last_unix_nanos: int
    def __init__(self, enabled: _Optional[bool] = ..., state: _Optional[str] = ..., placement_ok: _Optional[bool] = ..., succeeded: _Optional[int] = ..., failed: _Optional[int] = ..., consecutive_failures: _Optional[int] = ..., next_attempt_unix_nanos: _Optional[int] = ..., last_error: _Optional[str] = ..., last_duration_seconds: _Optional[float] = ..., last_first_token_seconds: _Optional[float] = ..., last_unix_nanos: _Optional[int] = ...) -> None: ...

class TriggerFailoverRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class TriggerFailoverResponse(_message.Message):
    __slots__ = ("accepted", "error")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    error: str
    def __init__(self, accepted: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...
