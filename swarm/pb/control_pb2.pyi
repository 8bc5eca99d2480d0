from . import wire_pb2 as _wire_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelConfig(_message.Message):
    __slots__ = ("n_layers", "d_model", "n_heads", "vocab_size", "context", "seed")
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    D_MODEL_FIELD_NUMBER: _ClassVar[int]
    N_HEADS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    context: int
    seed: int
    def __init__(self, n_layers: _Optional[int] = ..., d_model: _Optional[int] = ..., n_heads: _Optional[int] = ..., vocab_size: _Optional[int] = ..., context: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class TrainConfig(_message.Message):
    __slots__ = ("micro_batches", "micro_batch_size", "lr", "weight_decay", "data_seed", "data", "eval_every", "eval_batches", "schedule", "wire_forward", "wire_backward", "warmup_steps", "grad_clip", "max_staleness", "max_in_flight", "checkpoint_every", "average_every", "average_codec", "outer_lr", "outer_momentum", "average_timeout", "error_feedback_backward", "wire_forward_auto", "wire_backward_auto", "wire_zstd", "sync_steps", "wire_rank", "error_feedback_backward_auto", "lr_decay_steps", "train_samples", "wire_forward_delta", "delta_cache_bytes", "delta_spill_bytes")
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    DATA_SEED_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    EVAL_EVERY_FIELD_NUMBER: _ClassVar[int]
    EVAL_BATCHES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    WIRE_FORWARD_FIELD_NUMBER: _ClassVar[int]
    WIRE_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    AVERAGE_EVERY_FIELD_NUMBER: _ClassVar[int]
    AVERAGE_CODEC_FIELD_NUMBER: _ClassVar[int]
    OUTER_LR_FIELD_NUMBER: _ClassVar[int]
    OUTER_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    AVERAGE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FEEDBACK_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    WIRE_FORWARD_AUTO_FIELD_NUMBER: _ClassVar[int]
    WIRE_BACKWARD_AUTO_FIELD_NUMBER: _ClassVar[int]
    WIRE_ZSTD_FIELD_NUMBER: _ClassVar[int]
    SYNC_STEPS_FIELD_NUMBER: _ClassVar[int]
    WIRE_RANK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FEEDBACK_BACKWARD_AUTO_FIELD_NUMBER: _ClassVar[int]
    LR_DECAY_STEPS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    WIRE_FORWARD_DELTA_FIELD_NUMBER: _ClassVar[int]
    DELTA_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELTA_SPILL_BYTES_FIELD_NUMBER: _ClassVar[int]
    micro_batches: int
    micro_batch_size: int
    lr: float
    weight_decay: float
    data_seed: int
    data: str
    eval_every: int
    eval_batches: int
    schedule: str
    wire_forward: _wire_pb2.Codec
    wire_backward: _wire_pb2.Codec
    warmup_steps: float
    grad_clip: float
    max_staleness: int
    max_in_flight: int
    checkpoint_every: int
    average_every: int
    average_codec: _wire_pb2.Codec
    outer_lr: float
    outer_momentum: float
    average_timeout: float
    error_feedback_backward: bool
    wire_forward_auto: bool
    wire_backward_auto: bool
    wire_zstd: bool
    sync_steps: int
    wire_rank: int
    error_feedback_backward_auto: bool
    lr_decay_steps: int
    train_samples: int
    wire_forward_delta: str
    delta_cache_bytes: int
    delta_spill_bytes: int
    def __init__(self, micro_batches: _Optional[int] = ..., micro_batch_size: _Optional[int] = ..., lr: _Optional[float] = ..., weight_decay: _Optional[float] = ..., data_seed: _Optional[int] = ..., data: _Optional[str] = ..., eval_every: _Optional[int] = ..., eval_batches: _Optional[int] = ..., schedule: _Optional[str] = ..., wire_forward: _Optional[_Union[_wire_pb2.Codec, str]] = ..., wire_backward: _Optional[_Union[_wire_pb2.Codec, str]] = ..., warmup_steps: _Optional[float] = ..., grad_clip: _Optional[float] = ..., max_staleness: _Optional[int] = ..., max_in_flight: _Optional[int] = ..., checkpoint_every: _Optional[int] = ..., average_every: _Optional[int] = ..., average_codec: _Optional[_Union[_wire_pb2.Codec, str]] = ..., outer_lr: _Optional[float] = ..., outer_momentum: _Optional[float] = ..., average_timeout: _Optional[float] = ..., error_feedback_backward: _Optional[bool] = ..., wire_forward_auto: _Optional[bool] = ..., wire_backward_auto: _Optional[bool] = ..., wire_zstd: _Optional[bool] = ..., sync_steps: _Optional[int] = ..., wire_rank: _Optional[int] = ..., error_feedback_backward_auto: _Optional[bool] = ..., lr_decay_steps: _Optional[int] = ..., train_samples: _Optional[int] = ..., wire_forward_delta: _Optional[str] = ..., delta_cache_bytes: _Optional[int] = ..., delta_spill_bytes: _Optional[int] = ...) -> None: ...

class HFConfig(_message.Message):
    __slots__ = ("path", "dtype", "lora_rank", "lora_alpha", "lora_targets", "config_sha256", "quant", "activation_checkpointing")
    PATH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    LORA_ALPHA_FIELD_NUMBER: _ClassVar[int]
    LORA_TARGETS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_SHA256_FIELD_NUMBER: _ClassVar[int]
    QUANT_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_CHECKPOINTING_FIELD_NUMBER: _ClassVar[int]
    path: str
    dtype: str
    lora_rank: int
    lora_alpha: float
    lora_targets: _containers.RepeatedScalarFieldContainer[str]
    config_sha256: str
    quant: str
    activation_checkpointing: bool
    def __init__(self, path: _Optional[str] = ..., dtype: _Optional[str] = ..., lora_rank: _Optional[int] = ..., lora_alpha: _Optional[float] = ..., lora_targets: _Optional[_Iterable[str]] = ..., config_sha256: _Optional[str] = ..., quant: _Optional[str] = ..., activation_checkpointing: _Optional[bool] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("peer_id", "endpoint", "protocol_version", "device", "free_memory", "software_version")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    FREE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    endpoint: str
    protocol_version: int
    device: str
    free_memory: int
    software_version: str
    def __init__(self, peer_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., protocol_version: _Optional[int] = ..., device: _Optional[str] = ..., free_memory: _Optional[int] = ..., software_version: _Optional[str] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("run_id", "model", "train", "hf", "restore_version", "epoch", "plan")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    HF_FIELD_NUMBER: _ClassVar[int]
    RESTORE_VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    model: ModelConfig
    train: TrainConfig
    hf: HFConfig
    restore_version: int
    epoch: int
    plan: SignedPlan
    def __init__(self, run_id: _Optional[str] = ..., model: _Optional[_Union[ModelConfig, _Mapping]] = ..., train: _Optional[_Union[TrainConfig, _Mapping]] = ..., hf: _Optional[_Union[HFConfig, _Mapping]] = ..., restore_version: _Optional[int] = ..., epoch: _Optional[int] = ..., plan: _Optional[_Union[SignedPlan, _Mapping]] = ...) -> None: ...

class SignedPlan(_message.Message):
    __slots__ = ("body", "sig")
    BODY_FIELD_NUMBER: _ClassVar[int]
    SIG_FIELD_NUMBER: _ClassVar[int]
    body: str
    sig: str
    def __init__(self, body: _Optional[str] = ..., sig: _Optional[str] = ...) -> None: ...

class Neighbour(_message.Message):
    __slots__ = ("peer_id", "endpoint")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    endpoint: str
    def __init__(self, peer_id: _Optional[str] = ..., endpoint: _Optional[str] = ...) -> None: ...

class Start(_message.Message):
    __slots__ = ("first_step", "num_steps")
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    first_step: int
    num_steps: int
    def __init__(self, first_step: _Optional[int] = ..., num_steps: _Optional[int] = ...) -> None: ...

class CollectState(_message.Message):
    __slots__ = ("checkpoint",)
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    checkpoint: bool
    def __init__(self, checkpoint: _Optional[bool] = ...) -> None: ...

class StopTraining(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("assign", "start", "collect_state", "shutdown", "stop_training", "update")
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    COLLECT_STATE_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    STOP_TRAINING_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    assign: Assignment
    start: Start
    collect_state: CollectState
    shutdown: Shutdown
    stop_training: StopTraining
    update: Assignment
    def __init__(self, assign: _Optional[_Union[Assignment, _Mapping]] = ..., start: _Optional[_Union[Start, _Mapping]] = ..., collect_state: _Optional[_Union[CollectState, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., stop_training: _Optional[_Union[StopTraining, _Mapping]] = ..., update: _Optional[_Union[Assignment, _Mapping]] = ...) -> None: ...

class StageStats(_message.Message):
    __slots__ = ("forward_micro_batches", "backward_micro_batches", "bytes_sent", "bytes_received", "compute_seconds", "weight_version", "refused", "dropped", "staleness_counts", "idle_seconds", "wall_seconds", "kept_weights_bytes_peak", "in_flight_peak", "average_rounds", "average_bytes", "anchor_digest", "lost_micro_batches", "rejected", "rejected_by_sender", "memory", "sent_codecs", "delta_rows", "delta_rows_spilled", "held_gradient_bytes_peak")
    class RejectedBySenderEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class SentCodecsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    FORWARD_MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    STALENESS_COUNTS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KEPT_WEIGHTS_BYTES_PEAK_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_PEAK_FIELD_NUMBER: _ClassVar[int]
    AVERAGE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    AVERAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LOST_MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_BY_SENDER_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    SENT_CODECS_FIELD_NUMBER: _ClassVar[int]
    DELTA_ROWS_FIELD_NUMBER: _ClassVar[int]
    DELTA_ROWS_SPILLED_FIELD_NUMBER: _ClassVar[int]
    HELD_GRADIENT_BYTES_PEAK_FIELD_NUMBER: _ClassVar[int]
    forward_micro_batches: int
    backward_micro_batches: int
    bytes_sent: int
    bytes_received: int
    compute_seconds: float
    weight_version: int
    refused: int
    dropped: int
    staleness_counts: _containers.RepeatedScalarFieldContainer[int]
    idle_seconds: float
    wall_seconds: float
    kept_weights_bytes_peak: int
    in_flight_peak: int
    average_rounds: int
    average_bytes: int
    anchor_digest: str
    lost_micro_batches: int
    rejected: int
    rejected_by_sender: _containers.ScalarMap[str, int]
    memory: StageMemory
    sent_codecs: _containers.ScalarMap[str, int]
    delta_rows: int
    delta_rows_spilled: int
    held_gradient_bytes_peak: int
    def __init__(self, forward_micro_batches: _Optional[int] = ..., backward_micro_batches: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., weight_version: _Optional[int] = ..., refused: _Optional[int] = ..., dropped: _Optional[int] = ..., staleness_counts: _Optional[_Iterable[int]] = ..., idle_seconds: _Optional[float] = ..., wall_seconds: _Optional[float] = ..., kept_weights_bytes_peak: _Optional[int] = ..., in_flight_peak: _Optional[int] = ..., average_rounds: _Optional[int] = ..., average_bytes: _Optional[int] = ..., anchor_digest: _Optional[str] = ..., lost_micro_batches: _Optional[int] = ..., rejected: _Optional[int] = ..., rejected_by_sender: _Optional[_Mapping[str, int]] = ..., memory: _Optional[_Union[StageMemory, _Mapping]] = ..., sent_codecs: _Optional[_Mapping[str, int]] = ..., delta_rows: _Optional[int] = ..., delta_rows_spilled: _Optional[int] = ..., held_gradient_bytes_peak: _Optional[int] = ...) -> None: ...

class StageMemory(_message.Message):
    __slots__ = ("rss_before", "anon_before", "load_peak", "resident_after_build", "anon_after_build", "train_peak", "cuda_before", "cuda_load_peak", "cuda_train_peak", "block_bytes", "largest_tensor_bytes", "hwm_reset", "allocator")
    RSS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    ANON_BEFORE_FIELD_NUMBER: _ClassVar[int]
    LOAD_PEAK_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_AFTER_BUILD_FIELD_NUMBER: _ClassVar[int]
    ANON_AFTER_BUILD_FIELD_NUMBER: _ClassVar[int]
    TRAIN_PEAK_FIELD_NUMBER: _ClassVar[int]
    CUDA_BEFORE_FIELD_NUMBER: _ClassVar[int]
    CUDA_LOAD_PEAK_FIELD_NUMBER: _ClassVar[int]
    CUDA_TRAIN_PEAK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LARGEST_TENSOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    HWM_RESET_FIELD_NUMBER: _ClassVar[int]
    ALLOCATOR_FIELD_NUMBER: _ClassVar[int]
    rss_before: int
    anon_before: int
    load_peak: int
    resident_after_build: int
    anon_after_build: int
    train_peak: int
    cuda_before: int
    cuda_load_peak: int
    cuda_train_peak: int
    block_bytes: int
    largest_tensor_bytes: int
    hwm_reset: bool
    allocator: str
    def __init__(self, rss_before: _Optional[int] = ..., anon_before: _Optional[int] = ..., load_peak: _Optional[int] = ..., resident_after_build: _Optional[int] = ..., anon_after_build: _Optional[int] = ..., train_peak: _Optional[int] = ..., cuda_before: _Optional[int] = ..., cuda_load_peak: _Optional[int] = ..., cuda_train_peak: _Optional[int] = ..., block_bytes: _Optional[int] = ..., largest_tensor_bytes: _Optional[int] = ..., hwm_reset: _Optional[bool] = ..., allocator: _Optional[str] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step", "loss", "tokens", "seconds")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    loss: float
    tokens: int
    seconds: float
    def __init__(self, step: _Optional[int] = ..., loss: _Optional[float] = ..., tokens: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class EvalResult(_message.Message):
    __slots__ = ("step", "loss", "tokens")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    step: int
    loss: float
    tokens: int
    def __init__(self, step: _Optional[int] = ..., loss: _Optional[float] = ..., tokens: _Optional[int] = ...) -> None: ...

class StatusReport(_message.Message):
    __slots__ = ("peer_id", "ready", "stats", "steps", "evals", "finished", "error", "leaving", "error_epoch", "quarantined")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    EVALS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    ERROR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    ready: bool
    stats: StageStats
    steps: _containers.RepeatedCompositeFieldContainer[StepResult]
    evals: _containers.RepeatedCompositeFieldContainer[EvalResult]
    finished: bool
    error: str
    leaving: bool
    error_epoch: int
    quarantined: _containers.RepeatedCompositeFieldContainer[Quarantined]
    def __init__(self, peer_id: _Optional[str] = ..., ready: _Optional[bool] = ..., stats: _Optional[_Union[StageStats, _Mapping]] = ..., steps: _Optional[_Iterable[_Union[StepResult, _Mapping]]] = ..., evals: _Optional[_Iterable[_Union[EvalResult, _Mapping]]] = ..., finished: _Optional[bool] = ..., error: _Optional[str] = ..., leaving: _Optional[bool] = ..., error_epoch: _Optional[int] = ..., quarantined: _Optional[_Iterable[_Union[Quarantined, _Mapping]]] = ...) -> None: ...

class Quarantined(_message.Message):
    __slots__ = ("peer_id", "reason")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    reason: str
    def __init__(self, peer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReportReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NamedTensor(_message.Message):
    __slots__ = ("name", "tensor")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensor: _wire_pb2.Tensor
    def __init__(self, name: _Optional[str] = ..., tensor: _Optional[_Union[_wire_pb2.Tensor, _Mapping]] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("peer_id", "stage", "tensors", "version", "layer_start", "layer_end", "optimizer", "periodic", "epoch")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    PERIODIC_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    stage: int
    tensors: _containers.RepeatedCompositeFieldContainer[NamedTensor]
    version: int
    layer_start: int
    layer_end: int
    optimizer: _containers.RepeatedCompositeFieldContainer[NamedTensor]
    periodic: bool
    epoch: int
    def __init__(self, peer_id: _Optional[str] = ..., stage: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[NamedTensor, _Mapping]]] = ..., version: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., optimizer: _Optional[_Iterable[_Union[NamedTensor, _Mapping]]] = ..., periodic: _Optional[bool] = ..., epoch: _Optional[int] = ...) -> None: ...

class FetchStateRequest(_message.Message):
    __slots__ = ("peer_id", "version", "names")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    version: int
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, peer_id: _Optional[str] = ..., version: _Optional[int] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class UploadReply(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: int
    def __init__(self, tensors: _Optional[int] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("payload", "reply_bytes")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    REPLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    reply_bytes: int
    def __init__(self, payload: _Optional[bytes] = ..., reply_bytes: _Optional[int] = ...) -> None: ...

class ProbeReply(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class DialBackRequest(_message.Message):
    __slots__ = ("endpoint",)
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    def __init__(self, endpoint: _Optional[str] = ...) -> None: ...

class DialBackReply(_message.Message):
    __slots__ = ("reachable", "detail")
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    reachable: bool
    detail: str
    def __init__(self, reachable: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("status_json",)
    STATUS_JSON_FIELD_NUMBER: _ClassVar[int]
    status_json: str
    def __init__(self, status_json: _Optional[str] = ...) -> None: ...
