import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusResponse(_message.Message):
    __slots__ = ("vertexes", "statuses", "logs", "warnings")
    VERTEXES_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    LOGS_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    vertexes: _containers.RepeatedCompositeFieldContainer[Vertex]
    statuses: _containers.RepeatedCompositeFieldContainer[VertexStatus]
    logs: _containers.RepeatedCompositeFieldContainer[VertexLog]
    warnings: _containers.RepeatedCompositeFieldContainer[VertexWarning]
    def __init__(self, vertexes: _Optional[_Iterable[_Union[Vertex, _Mapping]]] = ..., statuses: _Optional[_Iterable[_Union[VertexStatus, _Mapping]]] = ..., logs: _Optional[_Iterable[_Union[VertexLog, _Mapping]]] = ..., warnings: _Optional[_Iterable[_Union[VertexWarning, _Mapping]]] = ...) -> None: ...

class Vertex(_message.Message):
    __slots__ = ("digest", "inputs", "name", "cached", "started", "completed", "error")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    digest: str
    inputs: _containers.RepeatedScalarFieldContainer[str]
    name: str
    cached: bool
    started: _timestamp_pb2.Timestamp
    completed: _timestamp_pb2.Timestamp
    error: str
    def __init__(self, digest: _Optional[str] = ..., inputs: _Optional[_Iterable[str]] = ..., name: _Optional[str] = ..., cached: _Optional[bool] = ..., started: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., completed: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., error: _Optional[str] = ...) -> None: ...

class VertexStatus(_message.Message):
    __slots__ = ("ID", "vertex", "name", "current", "total", "timestamp", "started", "completed")
    ID_FIELD_NUMBER: _ClassVar[int]
    VERTEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    ID: str
    vertex: str
    name: str
    current: int
    total: int
    timestamp: _timestamp_pb2.Timestamp
    started: _timestamp_pb2.Timestamp
    completed: _timestamp_pb2.Timestamp
    def __init__(self, ID: _Optional[str] = ..., vertex: _Optional[str] = ..., name: _Optional[str] = ..., current: _Optional[int] = ..., total: _Optional[int] = ..., timestamp: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., started: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., completed: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class VertexLog(_message.Message):
    __slots__ = ("vertex", "timestamp", "stream", "msg")
    VERTEX_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    MSG_FIELD_NUMBER: _ClassVar[int]
    vertex: str
    timestamp: _timestamp_pb2.Timestamp
    stream: int
    msg: bytes
    def __init__(self, vertex: _Optional[str] = ..., timestamp: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., stream: _Optional[int] = ..., msg: _Optional[bytes] = ...) -> None: ...

class VertexWarning(_message.Message):
    __slots__ = ("vertex", "level", "short", "detail", "url")
    VERTEX_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    SHORT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    vertex: str
    level: int
    short: bytes
    detail: _containers.RepeatedScalarFieldContainer[bytes]
    url: str
    def __init__(self, vertex: _Optional[str] = ..., level: _Optional[int] = ..., short: _Optional[bytes] = ..., detail: _Optional[_Iterable[bytes]] = ..., url: _Optional[str] = ...) -> None: ...
