from splitserve.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchLoadRequest(_message.Message):
    __slots__ = ("min_interval_seconds",)
    MIN_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    min_interval_seconds: float
    def __init__(self, min_interval_seconds: _Optional[float] = ...) -> None: ...
