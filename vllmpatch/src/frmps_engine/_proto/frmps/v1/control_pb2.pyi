from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_VERSION_UNSPECIFIED: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_1: _ClassVar[ProtocolVersion]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_ACTIVE: _ClassVar[Role]
    ROLE_STANDBY: _ClassVar[Role]
PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_VERSION_1: ProtocolVersion
ROLE_UNSPECIFIED: Role
ROLE_ACTIVE: Role
ROLE_STANDBY: Role

class Pool(_message.Message):
    __slots__ = ("tag", "index", "size", "backend")
    TAG_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    tag: str
    index: int
    size: int
    backend: str
    def __init__(self, tag: _Optional[str] = ..., index: _Optional[int] = ..., size: _Optional[int] = ..., backend: _Optional[str] = ...) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("id", "hello", "pool_export", "ready", "reply", "fault", "heartbeat", "welcome", "sleep", "resume", "shutdown", "ping", "handoff")
    ID_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    POOL_EXPORT_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    SLEEP_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    id: int
    hello: Hello
    pool_export: PoolExport
    ready: Ready
    reply: Reply
    fault: Fault
    heartbeat: Heartbeat
    welcome: Welcome
    sleep: Sleep
    resume: Resume
    shutdown: Shutdown
    ping: Ping
    handoff: Handoff
    def __init__(self, id: _Optional[int] = ..., hello: _Optional[_Union[Hello, _Mapping]] = ..., pool_export: _Optional[_Union[PoolExport, _Mapping]] = ..., ready: _Optional[_Union[Ready, _Mapping]] = ..., reply: _Optional[_Union[Reply, _Mapping]] = ..., fault: _Optional[_Union[Fault, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., welcome: _Optional[_Union[Welcome, _Mapping]] = ..., sleep: _Optional[_Union[Sleep, _Mapping]] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., ping: _Optional[_Union[Ping, _Mapping]] = ..., handoff: _Optional[_Union[Handoff, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("protocol_version", "role", "pid", "model", "engine", "engine_version", "pools", "generation_endpoint", "device", "block_size", "num_blocks", "weights", "kv_budget", "ring_record_bytes")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_FIELD_NUMBER: _ClassVar[int]
    RING_RECORD_BYTES_FIELD_NUMBER: _ClassVar[int]
    protocol_version: ProtocolVersion
    role: Role
    pid: int
    model: str
    engine: str
    engine_version: str
    pools: _containers.RepeatedCompositeFieldContainer[Pool]
    generation_endpoint: str
    device: str
    block_size: int
    num_blocks: int
    weights: str
    kv_budget: KVBudget
    ring_record_bytes: int
    def __init__(self, protocol_version: _Optional[_Union[ProtocolVersion, str]] = ..., role: _Optional[_Union[Role, str]] = ..., pid: _Optional[int] = ..., model: _Optional[str] = ..., engine: _Optional[str] = ..., engine_version: _Optional[str] = ..., pools: _Optional[_Iterable[_Union[Pool, _Mapping]]] = ..., generation_endpoint: _Optional[str] = ..., device: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., weights: _Optional[str] = ..., kv_budget: _Optional[_Union[KVBudget, _Mapping]] = ..., ring_record_bytes: _Optional[int] = ...) -> None: ...

class KVBudget(_message.Message):
    __slots__ = ("gpu_total_bytes", "utilization", "budget_bytes", "weights_bytes", "kv_bytes", "num_blocks", "block_bytes", "reserved_bytes", "reserved", "source")
    class ReservedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    GPU_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    gpu_total_bytes: int
    utilization: float
    budget_bytes: int
    weights_bytes: int
    kv_bytes: int
    num_blocks: int
    block_bytes: int
    reserved_bytes: int
    reserved: _containers.ScalarMap[str, int]
    source: str
    def __init__(self, gpu_total_bytes: _Optional[int] = ..., utilization: _Optional[float] = ..., budget_bytes: _Optional[int] = ..., weights_bytes: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., reserved: _Optional[_Mapping[str, int]] = ..., source: _Optional[str] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("accepted", "reason", "protocol_version", "ring_path", "sync_every", "deployment_id", "heartbeat_interval_ms")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RING_PATH_FIELD_NUMBER: _ClassVar[int]
    SYNC_EVERY_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    protocol_version: ProtocolVersion
    ring_path: str
    sync_every: int
    deployment_id: str
    heartbeat_interval_ms: int
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., protocol_version: _Optional[_Union[ProtocolVersion, str]] = ..., ring_path: _Optional[str] = ..., sync_every: _Optional[int] = ..., deployment_id: _Optional[str] = ..., heartbeat_interval_ms: _Optional[int] = ...) -> None: ...

class PoolExport(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[Pool]
    def __init__(self, pools: _Optional[_Iterable[_Union[Pool, _Mapping]]] = ...) -> None: ...

class Ready(_message.Message):
    __slots__ = ("role", "init_ns")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INIT_NS_FIELD_NUMBER: _ClassVar[int]
    role: Role
    init_ns: int
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., init_ns: _Optional[int] = ...) -> None: ...

class Reply(_message.Message):
    __slots__ = ("ok", "error", "took_ns", "resumed")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TOOK_NS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    took_ns: int
    resumed: _containers.RepeatedCompositeFieldContainer[ResumeOutcome]
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., took_ns: _Optional[int] = ..., resumed: _Optional[_Iterable[_Union[ResumeOutcome, _Mapping]]] = ...) -> None: ...

class ResumeOutcome(_message.Message):
    __slots__ = ("key", "ok", "error", "reused_tokens", "prefilled_tokens")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    key: int
    ok: bool
    error: str
    reused_tokens: int
    prefilled_tokens: int
    def __init__(self, key: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., reused_tokens: _Optional[int] = ..., prefilled_tokens: _Optional[int] = ...) -> None: ...

class Fault(_message.Message):
    __slots__ = ("cause", "detail", "unix_nanos")
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    cause: str
    detail: str
    unix_nanos: int
    def __init__(self, cause: _Optional[str] = ..., detail: _Optional[str] = ..., unix_nanos: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("step", "running", "waiting", "interval_ms", "step_age_ns", "step_expected_ns", "step_tokens")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_AGE_NS_FIELD_NUMBER: _ClassVar[int]
    STEP_EXPECTED_NS_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    step: int
    running: int
    waiting: int
    interval_ms: int
    step_age_ns: int
    step_expected_ns: int
    step_tokens: int
    def __init__(self, step: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., interval_ms: _Optional[int] = ..., step_age_ns: _Optional[int] = ..., step_expected_ns: _Optional[int] = ..., step_tokens: _Optional[int] = ...) -> None: ...

class Ping(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Sleep(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[Pool]
    def __init__(self, pools: _Optional[_Iterable[_Union[Pool, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "logprobs", "logit_bias", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "structured_outputs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    structured_outputs: StructuredOutputs
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("key", "request_id", "prompt", "prompt_token_ids", "messages", "params", "delivered_token_ids", "snapshot", "engine_request", "tools_json")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_REQUEST_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    key: int
    request_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    params: SamplingParams
    delivered_token_ids: _containers.RepeatedScalarFieldContainer[int]
    snapshot: RequestSnapshot
    engine_request: bytes
    tools_json: str
    def __init__(self, key: _Optional[int] = ..., request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., delivered_token_ids: _Optional[_Iterable[int]] = ..., snapshot: _Optional[_Union[RequestSnapshot, _Mapping]] = ..., engine_request: _Optional[bytes] = ..., tools_json: _Optional[str] = ...) -> None: ...

class RequestSnapshot(_message.Message):
    __slots__ = ("block_ids", "token_ids", "num_prompt_tokens", "num_computed_tokens", "seed", "step", "output_token_ids")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    seed: int
    step: int
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., step: _Optional[int] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Resume(_message.Message):
    __slots__ = ("requests", "ring_path", "sync_every")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RING_PATH_FIELD_NUMBER: _ClassVar[int]
    SYNC_EVERY_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[ResumeRequest]
    ring_path: str
    sync_every: int
    def __init__(self, requests: _Optional[_Iterable[_Union[ResumeRequest, _Mapping]]] = ..., ring_path: _Optional[str] = ..., sync_every: _Optional[int] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("grace_ms",)
    GRACE_MS_FIELD_NUMBER: _ClassVar[int]
    grace_ms: int
    def __init__(self, grace_ms: _Optional[int] = ...) -> None: ...

class Handoff(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_call_id", "tool_calls_json", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_call_id: str
    tool_calls_json: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., tool_calls_json: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...
