from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_INT32: _ClassVar[Dtype]
    DTYPE_INT64: _ClassVar[Dtype]
    DTYPE_FLOAT32: _ClassVar[Dtype]
    DTYPE_FLOAT64: _ClassVar[Dtype]
    DTYPE_UINT8: _ClassVar[Dtype]
    DTYPE_BFLOAT16: _ClassVar[Dtype]
    DTYPE_FLOAT16: _ClassVar[Dtype]

class LogprobPositions(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOGPROB_POSITIONS_UNSPECIFIED: _ClassVar[LogprobPositions]
    LOGPROB_POSITIONS_ALL: _ClassVar[LogprobPositions]
    LOGPROB_POSITIONS_MASKED: _ClassVar[LogprobPositions]

class WeightNames(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_NAMES_UNSPECIFIED: _ClassVar[WeightNames]
    WEIGHT_NAMES_HF: _ClassVar[WeightNames]
    WEIGHT_NAMES_MEGATRON: _ClassVar[WeightNames]
    WEIGHT_NAMES_PEFT: _ClassVar[WeightNames]
DTYPE_UNSPECIFIED: Dtype
DTYPE_INT32: Dtype
DTYPE_INT64: Dtype
DTYPE_FLOAT32: Dtype
DTYPE_FLOAT64: Dtype
DTYPE_UINT8: Dtype
DTYPE_BFLOAT16: Dtype
DTYPE_FLOAT16: Dtype
LOGPROB_POSITIONS_UNSPECIFIED: LogprobPositions
LOGPROB_POSITIONS_ALL: LogprobPositions
LOGPROB_POSITIONS_MASKED: LogprobPositions
WEIGHT_NAMES_UNSPECIFIED: WeightNames
WEIGHT_NAMES_HF: WeightNames
WEIGHT_NAMES_MEGATRON: WeightNames
WEIGHT_NAMES_PEFT: WeightNames

class Array(_message.Message):
    __slots__ = ("dtype", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: Dtype
    data: bytes
    def __init__(self, dtype: _Optional[_Union[Dtype, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ScoreOptions(_message.Message):
    __slots__ = ("return_logprobs", "top_k", "losses", "return_moe_metrics", "return_mtp_metrics", "temperature", "return_routing", "return_entropy", "mismatch_ratio_cap", "return_importance_weights", "weights_version", "logprob_positions", "return_token_ranks", "return_next_token", "model", "reference")
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    LOSSES_FIELD_NUMBER: _ClassVar[int]
    RETURN_MOE_METRICS_FIELD_NUMBER: _ClassVar[int]
    RETURN_MTP_METRICS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    RETURN_ROUTING_FIELD_NUMBER: _ClassVar[int]
    RETURN_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_RATIO_CAP_FIELD_NUMBER: _ClassVar[int]
    RETURN_IMPORTANCE_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_RANKS_FIELD_NUMBER: _ClassVar[int]
    RETURN_NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    return_logprobs: bool
    top_k: int
    losses: _containers.RepeatedScalarFieldContainer[str]
    return_moe_metrics: bool
    return_mtp_metrics: bool
    temperature: float
    return_routing: bool
    return_entropy: bool
    mismatch_ratio_cap: float
    return_importance_weights: bool
    weights_version: str
    logprob_positions: LogprobPositions
    return_token_ranks: bool
    return_next_token: bool
    model: str
    reference: str
    def __init__(self, return_logprobs: bool = ..., top_k: _Optional[int] = ..., losses: _Optional[_Iterable[str]] = ..., return_moe_metrics: bool = ..., return_mtp_metrics: bool = ..., temperature: _Optional[float] = ..., return_routing: bool = ..., return_entropy: bool = ..., mismatch_ratio_cap: _Optional[float] = ..., return_importance_weights: bool = ..., weights_version: _Optional[str] = ..., logprob_positions: _Optional[_Union[LogprobPositions, str]] = ..., return_token_ranks: bool = ..., return_next_token: bool = ..., model: _Optional[str] = ..., reference: _Optional[str] = ...) -> None: ...

class SequenceGroups(_message.Message):
    __slots__ = ("sizes", "prompt_lengths")
    SIZES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    sizes: Array
    prompt_lengths: Array
    def __init__(self, sizes: _Optional[_Union[Array, _Mapping]] = ..., prompt_lengths: _Optional[_Union[Array, _Mapping]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "lengths", "loss_mask", "options", "routing", "target_ids", "rollout_logprobs", "groups", "score_from")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    TARGET_IDS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FROM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: Array
    lengths: Array
    loss_mask: Array
    options: ScoreOptions
    routing: Array
    target_ids: Array
    rollout_logprobs: Array
    groups: SequenceGroups
    score_from: Array
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Union[Array, _Mapping]] = ..., lengths: _Optional[_Union[Array, _Mapping]] = ..., loss_mask: _Optional[_Union[Array, _Mapping]] = ..., options: _Optional[_Union[ScoreOptions, _Mapping]] = ..., routing: _Optional[_Union[Array, _Mapping]] = ..., target_ids: _Optional[_Union[Array, _Mapping]] = ..., rollout_logprobs: _Optional[_Union[Array, _Mapping]] = ..., groups: _Optional[_Union[SequenceGroups, _Mapping]] = ..., score_from: _Optional[_Union[Array, _Mapping]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_ms", "compute_ms", "total_ms", "num_steps")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    compute_ms: float
    total_ms: float
    num_steps: int
    def __init__(self, queue_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., num_steps: _Optional[int] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("request_id", "lengths", "token_logprobs", "top_k_ids", "top_k_logprobs", "top_k", "sequence_losses", "num_loss_tokens", "moe_metrics", "mtp_metrics", "weights_version", "timings", "routing", "routing_num_moe_layers", "routing_topk", "entropy", "target_logprobs", "num_target_ids", "mismatch", "importance_weights", "token_ranks", "next_token_ids", "next_token_logprobs", "next_top_k", "cached_tokens", "reference_logprobs", "kl_k1", "kl_k2", "kl_k3", "kl", "reference_weights_version")
    class SequenceLossesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Array
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Array, _Mapping]] = ...) -> None: ...
    class MoeMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class MtpMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class MismatchEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Array
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Array, _Mapping]] = ...) -> None: ...
    class KlEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Array
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Array, _Mapping]] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_LOSSES_FIELD_NUMBER: _ClassVar[int]
    NUM_LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MOE_METRICS_FIELD_NUMBER: _ClassVar[int]
    MTP_METRICS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    ROUTING_NUM_MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_TOPK_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    TARGET_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_TARGET_IDS_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_FIELD_NUMBER: _ClassVar[int]
    IMPORTANCE_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_RANKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOP_K_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KL_K1_FIELD_NUMBER: _ClassVar[int]
    KL_K2_FIELD_NUMBER: _ClassVar[int]
    KL_K3_FIELD_NUMBER: _ClassVar[int]
    KL_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lengths: Array
    token_logprobs: Array
    top_k_ids: Array
    top_k_logprobs: Array
    top_k: int
    sequence_losses: _containers.MessageMap[str, Array]
    num_loss_tokens: Array
    moe_metrics: _containers.ScalarMap[str, float]
    mtp_metrics: _containers.ScalarMap[str, float]
    weights_version: str
    timings: Timings
    routing: Array
    routing_num_moe_layers: int
    routing_topk: int
    entropy: Array
    target_logprobs: Array
    num_target_ids: int
    mismatch: _containers.MessageMap[str, Array]
    importance_weights: Array
    token_ranks: Array
    next_token_ids: Array
    next_token_logprobs: Array
    next_top_k: int
    cached_tokens: Array
    reference_logprobs: Array
    kl_k1: Array
    kl_k2: Array
    kl_k3: Array
    kl: _containers.MessageMap[str, Array]
    reference_weights_version: str
    def __init__(self, request_id: _Optional[str] = ..., lengths: _Optional[_Union[Array, _Mapping]] = ..., token_logprobs: _Optional[_Union[Array, _Mapping]] = ..., top_k_ids: _Optional[_Union[Array, _Mapping]] = ..., top_k_logprobs: _Optional[_Union[Array, _Mapping]] = ..., top_k: _Optional[int] = ..., sequence_losses: _Optional[_Mapping[str, Array]] = ..., num_loss_tokens: _Optional[_Union[Array, _Mapping]] = ..., moe_metrics: _Optional[_Mapping[str, float]] = ..., mtp_metrics: _Optional[_Mapping[str, float]] = ..., weights_version: _Optional[str] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., routing: _Optional[_Union[Array, _Mapping]] = ..., routing_num_moe_layers: _Optional[int] = ..., routing_topk: _Optional[int] = ..., entropy: _Optional[_Union[Array, _Mapping]] = ..., target_logprobs: _Optional[_Union[Array, _Mapping]] = ..., num_target_ids: _Optional[int] = ..., mismatch: _Optional[_Mapping[str, Array]] = ..., importance_weights: _Optional[_Union[Array, _Mapping]] = ..., token_ranks: _Optional[_Union[Array, _Mapping]] = ..., next_token_ids: _Optional[_Union[Array, _Mapping]] = ..., next_token_logprobs: _Optional[_Union[Array, _Mapping]] = ..., next_top_k: _Optional[int] = ..., cached_tokens: _Optional[_Union[Array, _Mapping]] = ..., reference_logprobs: _Optional[_Union[Array, _Mapping]] = ..., kl_k1: _Optional[_Union[Array, _Mapping]] = ..., kl_k2: _Optional[_Union[Array, _Mapping]] = ..., kl_k3: _Optional[_Union[Array, _Mapping]] = ..., kl: _Optional[_Mapping[str, Array]] = ..., reference_weights_version: _Optional[str] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("texts", "add_special_tokens")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    add_special_tokens: bool
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., add_special_tokens: bool = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "lengths")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    token_ids: Array
    lengths: Array
    def __init__(self, token_ids: _Optional[_Union[Array, _Mapping]] = ..., lengths: _Optional[_Union[Array, _Mapping]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "lengths", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: Array
    lengths: Array
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Union[Array, _Mapping]] = ..., lengths: _Optional[_Union[Array, _Mapping]] = ..., skip_special_tokens: bool = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("texts", "tokens")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ParallelLayout(_message.Message):
    __slots__ = ("world_size", "tensor_model_parallel_size", "context_parallel_size", "expert_model_parallel_size", "pipeline_model_parallel_size")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_MODEL_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXPERT_MODEL_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_MODEL_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    tensor_model_parallel_size: int
    context_parallel_size: int
    expert_model_parallel_size: int
    pipeline_model_parallel_size: int
    def __init__(self, world_size: _Optional[int] = ..., tensor_model_parallel_size: _Optional[int] = ..., context_parallel_size: _Optional[int] = ..., expert_model_parallel_size: _Optional[int] = ..., pipeline_model_parallel_size: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "architecture", "num_parameters", "vocab_size", "max_sequence_length", "dtype", "parallel", "attention_backend", "checkpoint_path", "weights_version", "has_tokenizer", "max_top_k", "max_request_tokens", "loss_names", "moe_metric_names", "mtp_metric_names", "max_tokens_per_batch", "max_message_bytes", "max_target_ids", "accepts_sequence_groups", "models", "accepts_tensor_chunks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOSS_NAMES_FIELD_NUMBER: _ClassVar[int]
    MOE_METRIC_NAMES_FIELD_NUMBER: _ClassVar[int]
    MTP_METRIC_NAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TARGET_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_SEQUENCE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_TENSOR_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture: str
    num_parameters: int
    vocab_size: int
    max_sequence_length: int
    dtype: str
    parallel: ParallelLayout
    attention_backend: str
    checkpoint_path: str
    weights_version: str
    has_tokenizer: bool
    max_top_k: int
    max_request_tokens: int
    loss_names: _containers.RepeatedScalarFieldContainer[str]
    moe_metric_names: _containers.RepeatedScalarFieldContainer[str]
    mtp_metric_names: _containers.RepeatedScalarFieldContainer[str]
    max_tokens_per_batch: int
    max_message_bytes: int
    max_target_ids: int
    accepts_sequence_groups: bool
    models: _containers.RepeatedCompositeFieldContainer[ServedModel]
    accepts_tensor_chunks: bool
    def __init__(self, name: _Optional[str] = ..., architecture: _Optional[str] = ..., num_parameters: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_sequence_length: _Optional[int] = ..., dtype: _Optional[str] = ..., parallel: _Optional[_Union[ParallelLayout, _Mapping]] = ..., attention_backend: _Optional[str] = ..., checkpoint_path: _Optional[str] = ..., weights_version: _Optional[str] = ..., has_tokenizer: bool = ..., max_top_k: _Optional[int] = ..., max_request_tokens: _Optional[int] = ..., loss_names: _Optional[_Iterable[str]] = ..., moe_metric_names: _Optional[_Iterable[str]] = ..., mtp_metric_names: _Optional[_Iterable[str]] = ..., max_tokens_per_batch: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_target_ids: _Optional[int] = ..., accepts_sequence_groups: bool = ..., models: _Optional[_Iterable[_Union[ServedModel, _Mapping]]] = ..., accepts_tensor_chunks: bool = ...) -> None: ...

class ServedModel(_message.Message):
    __slots__ = ("name", "weights_version", "base")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    name: str
    weights_version: str
    base: str
    def __init__(self, name: _Optional[str] = ..., weights_version: _Optional[str] = ..., base: _Optional[str] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("model", "weights_version", "weight_set", "adapter")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SET_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    model: str
    weights_version: str
    weight_set: str
    adapter: str
    def __init__(self, model: _Optional[str] = ..., weights_version: _Optional[str] = ..., weight_set: _Optional[str] = ..., adapter: _Optional[str] = ...) -> None: ...

class LoadWeightsResponse(_message.Message):
    __slots__ = ("weights_version", "previous_weights_version", "load_ms")
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOAD_MS_FIELD_NUMBER: _ClassVar[int]
    weights_version: str
    previous_weights_version: str
    load_ms: float
    def __init__(self, weights_version: _Optional[str] = ..., previous_weights_version: _Optional[str] = ..., load_ms: _Optional[float] = ...) -> None: ...

class UpdateWeightsBegin(_message.Message):
    __slots__ = ("names", "base_weights_version", "keep", "weight_set", "adapter", "adapter_config")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    BASE_WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SET_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CONFIG_FIELD_NUMBER: _ClassVar[int]
    names: WeightNames
    base_weights_version: str
    keep: bool
    weight_set: str
    adapter: str
    adapter_config: str
    def __init__(self, names: _Optional[_Union[WeightNames, str]] = ..., base_weights_version: _Optional[str] = ..., keep: bool = ..., weight_set: _Optional[str] = ..., adapter: _Optional[str] = ..., adapter_config: _Optional[str] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("name", "shape", "data", "offset", "indices")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: Array
    offset: int
    indices: Array
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[_Union[Array, _Mapping]] = ..., offset: _Optional[int] = ..., indices: _Optional[_Union[Array, _Mapping]] = ...) -> None: ...

class TensorChunks(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ...) -> None: ...

class UpdateWeightsCommit(_message.Message):
    __slots__ = ("weights_version", "partial", "prepare", "prepare_timeout_s")
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    PREPARE_FIELD_NUMBER: _ClassVar[int]
    PREPARE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    weights_version: str
    partial: bool
    prepare: bool
    prepare_timeout_s: float
    def __init__(self, weights_version: _Optional[str] = ..., partial: bool = ..., prepare: bool = ..., prepare_timeout_s: _Optional[float] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("begin", "chunk", "commit", "chunks")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    begin: UpdateWeightsBegin
    chunk: TensorChunk
    commit: UpdateWeightsCommit
    chunks: TensorChunks
    def __init__(self, begin: _Optional[_Union[UpdateWeightsBegin, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., commit: _Optional[_Union[UpdateWeightsCommit, _Mapping]] = ..., chunks: _Optional[_Union[TensorChunks, _Mapping]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("weights_version", "previous_weights_version", "num_tensors", "num_bytes", "stream_ms", "swap_ms", "prepared", "push_id")
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAM_MS_FIELD_NUMBER: _ClassVar[int]
    SWAP_MS_FIELD_NUMBER: _ClassVar[int]
    PREPARED_FIELD_NUMBER: _ClassVar[int]
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    weights_version: str
    previous_weights_version: str
    num_tensors: int
    num_bytes: int
    stream_ms: float
    swap_ms: float
    prepared: bool
    push_id: str
    def __init__(self, weights_version: _Optional[str] = ..., previous_weights_version: _Optional[str] = ..., num_tensors: _Optional[int] = ..., num_bytes: _Optional[int] = ..., stream_ms: _Optional[float] = ..., swap_ms: _Optional[float] = ..., prepared: bool = ..., push_id: _Optional[str] = ...) -> None: ...

class FinishWeightUpdateRequest(_message.Message):
    __slots__ = ("push_id", "commit")
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    push_id: str
    commit: bool
    def __init__(self, push_id: _Optional[str] = ..., commit: bool = ...) -> None: ...
