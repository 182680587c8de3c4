from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineLostRequest(_message.Message):
    __slots__ = ("drain_timeout_ms",)
    DRAIN_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    drain_timeout_ms: int
    def __init__(self, drain_timeout_ms: _Optional[int] = ...) -> None: ...

class ResumeEntry(_message.Message):
    __slots__ = ("key", "engine_request", "delivered_token_ids", "seed")
    KEY_FIELD_NUMBER: _ClassVar[int]
    ENGINE_REQUEST_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    key: int
    engine_request: bytes
    delivered_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    def __init__(self, key: _Optional[int] = ..., engine_request: _Optional[bytes] = ..., delivered_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ...) -> None: ...

class ResumeSet(_message.Message):
    __slots__ = ("entries", "held_requests")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    HELD_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[ResumeEntry]
    held_requests: int
    def __init__(self, entries: _Optional[_Iterable[_Union[ResumeEntry, _Mapping]]] = ..., held_requests: _Optional[int] = ...) -> None: ...

class EngineBackRequest(_message.Message):
    __slots__ = ("timeout_ms",)
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    timeout_ms: int
    def __init__(self, timeout_ms: _Optional[int] = ...) -> None: ...

class EngineBackResponse(_message.Message):
    __slots__ = ("sent_held",)
    SENT_HELD_FIELD_NUMBER: _ClassVar[int]
    sent_held: int
    def __init__(self, sent_held: _Optional[int] = ...) -> None: ...

class FrontendHealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FrontendHealthResponse(_message.Message):
    __slots__ = ("engine_connected", "open_requests", "vllm_version")
    ENGINE_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    OPEN_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    VLLM_VERSION_FIELD_NUMBER: _ClassVar[int]
    engine_connected: bool
    open_requests: int
    vllm_version: str
    def __init__(self, engine_connected: _Optional[bool] = ..., open_requests: _Optional[int] = ..., vllm_version: _Optional[str] = ...) -> None: ...
