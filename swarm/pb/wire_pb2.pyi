from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT16: _ClassVar[DType]
    UINT8: _ClassVar[DType]

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    FP32: _ClassVar[Codec]
    FP16: _ClassVar[Codec]
    BF16: _ClassVar[Codec]
    INT8: _ClassVar[Codec]
    INT4: _ClassVar[Codec]
    INT4_ROT: _ClassVar[Codec]
    RAW: _ClassVar[Codec]
    INT3_ROT: _ClassVar[Codec]
    LOWRANK: _ClassVar[Codec]
    ECSQ: _ClassVar[Codec]

class Compression(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPRESSION_NONE: _ClassVar[Compression]
    ZSTD: _ClassVar[Compression]
    ZSTD_PLANES: _ClassVar[Compression]
    ROWS: _ClassVar[Compression]

class Cache(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_NONE: _ClassVar[Cache]
    CACHE_STORE: _ClassVar[Cache]
    CACHE_DELTA: _ClassVar[Cache]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
INT64: DType
INT32: DType
INT16: DType
UINT8: DType
CODEC_UNSPECIFIED: Codec
FP32: Codec
FP16: Codec
BF16: Codec
INT8: Codec
INT4: Codec
INT4_ROT: Codec
RAW: Codec
INT3_ROT: Codec
LOWRANK: Codec
ECSQ: Codec
COMPRESSION_NONE: Compression
ZSTD: Compression
ZSTD_PLANES: Compression
ROWS: Compression
CACHE_NONE: Cache
CACHE_STORE: Cache
CACHE_DELTA: Cache

class Tensor(_message.Message):
    __slots__ = ("shape", "dtype", "codec", "payload", "scales", "block_size", "seed", "compression", "scales_compression", "rank")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    SCALES_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    codec: Codec
    payload: bytes
    scales: bytes
    block_size: int
    seed: int
    compression: Compression
    scales_compression: Compression
    rank: int
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., codec: _Optional[_Union[Codec, str]] = ..., payload: _Optional[bytes] = ..., scales: _Optional[bytes] = ..., block_size: _Optional[int] = ..., seed: _Optional[int] = ..., compression: _Optional[_Union[Compression, str]] = ..., scales_compression: _Optional[_Union[Compression, str]] = ..., rank: _Optional[int] = ...) -> None: ...

class MicroBatch(_message.Message):
    __slots__ = ("id", "step", "index", "weight_version", "eval", "samples")
    ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    id: int
    step: int
    index: int
    weight_version: int
    eval: bool
    samples: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, id: _Optional[int] = ..., step: _Optional[int] = ..., index: _Optional[int] = ..., weight_version: _Optional[int] = ..., eval: _Optional[bool] = ..., samples: _Optional[_Iterable[int]] = ...) -> None: ...

class Activations(_message.Message):
    __slots__ = ("mb", "hidden", "targets", "cache")
    MB_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    mb: MicroBatch
    hidden: Tensor
    targets: Tensor
    cache: Cache
    def __init__(self, mb: _Optional[_Union[MicroBatch, _Mapping]] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., targets: _Optional[_Union[Tensor, _Mapping]] = ..., cache: _Optional[_Union[Cache, str]] = ...) -> None: ...

class Gradients(_message.Message):
    __slots__ = ("mb", "grad", "loss_sum", "tokens", "dropped")
    MB_FIELD_NUMBER: _ClassVar[int]
    GRAD_FIELD_NUMBER: _ClassVar[int]
    LOSS_SUM_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    mb: MicroBatch
    grad: Tensor
    loss_sum: float
    tokens: int
    dropped: bool
    def __init__(self, mb: _Optional[_Union[MicroBatch, _Mapping]] = ..., grad: _Optional[_Union[Tensor, _Mapping]] = ..., loss_sum: _Optional[float] = ..., tokens: _Optional[int] = ..., dropped: _Optional[bool] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("peer_id", "protocol_version", "stage", "run_id")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    protocol_version: int
    stage: int
    run_id: str
    def __init__(self, peer_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., stage: _Optional[int] = ..., run_id: _Optional[str] = ...) -> None: ...

class Refusal(_message.Message):
    __slots__ = ("mb_id", "reason")
    MB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    mb_id: int
    reason: str
    def __init__(self, mb_id: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class StepEnd(_message.Message):
    __slots__ = ("step", "count")
    STEP_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    step: int
    count: int
    def __init__(self, step: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class Packet(_message.Message):
    __slots__ = ("hello", "activations", "gradients", "refusal", "step_end")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    STEP_END_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    activations: Activations
    gradients: Gradients
    refusal: Refusal
    step_end: StepEnd
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., activations: _Optional[_Union[Activations, _Mapping]] = ..., gradients: _Optional[_Union[Gradients, _Mapping]] = ..., refusal: _Optional[_Union[Refusal, _Mapping]] = ..., step_end: _Optional[_Union[StepEnd, _Mapping]] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("packet_id", "data", "last", "total_size")
    PACKET_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    packet_id: int
    data: bytes
    last: bool
    total_size: int
    def __init__(self, packet_id: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., total_size: _Optional[int] = ...) -> None: ...

class Delta(_message.Message):
    __slots__ = ("name", "tensor")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensor: Tensor
    def __init__(self, name: _Optional[str] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class AverageRequest(_message.Message):
    __slots__ = ("run_id", "round", "layer_start", "layer_end", "deltas", "generation", "peer_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    layer_start: int
    layer_end: int
    deltas: _containers.RepeatedCompositeFieldContainer[Delta]
    generation: int
    peer_id: str
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., deltas: _Optional[_Iterable[_Union[Delta, _Mapping]]] = ..., generation: _Optional[int] = ..., peer_id: _Optional[str] = ...) -> None: ...

class AverageReply(_message.Message):
    __slots__ = ("round", "deltas", "contributors")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    round: int
    deltas: _containers.RepeatedCompositeFieldContainer[Delta]
    contributors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, round: _Optional[int] = ..., deltas: _Optional[_Iterable[_Union[Delta, _Mapping]]] = ..., contributors: _Optional[_Iterable[str]] = ...) -> None: ...
