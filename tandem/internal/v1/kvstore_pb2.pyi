from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AttachRequest(_message.Message):
    __slots__ = ("client_name",)
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    def __init__(self, client_name: _Optional[str] = ...) -> None: ...

class AttachEvent(_message.Message):
    __slots__ = ("attached",)
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    attached: Attached
    def __init__(self, attached: _Optional[_Union[Attached, _Mapping]] = ...) -> None: ...

class Attached(_message.Message):
    __slots__ = ("session_id", "model", "kv_format", "page_size", "num_pages", "num_state_slots", "weights", "kv", "state", "store_pid", "speculative", "host_weights", "num_staging_pages", "prefill_chunk_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_FORMAT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STORE_PID_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    HOST_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGING_PAGES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model: ModelInfo
    kv_format: KVFormatInfo
    page_size: int
    num_pages: int
    num_state_slots: int
    weights: ArenaInfo
    kv: ArenaInfo
    state: ArenaInfo
    store_pid: int
    speculative: SpeculativeInfo
    host_weights: ArenaInfo
    num_staging_pages: int
    prefill_chunk_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., kv_format: _Optional[_Union[KVFormatInfo, _Mapping]] = ..., page_size: _Optional[int] = ..., num_pages: _Optional[int] = ..., num_state_slots: _Optional[int] = ..., weights: _Optional[_Union[ArenaInfo, _Mapping]] = ..., kv: _Optional[_Union[ArenaInfo, _Mapping]] = ..., state: _Optional[_Union[ArenaInfo, _Mapping]] = ..., store_pid: _Optional[int] = ..., speculative: _Optional[_Union[SpeculativeInfo, _Mapping]] = ..., host_weights: _Optional[_Union[ArenaInfo, _Mapping]] = ..., num_staging_pages: _Optional[int] = ..., prefill_chunk_tokens: _Optional[int] = ...) -> None: ...

class SpeculativeInfo(_message.Message):
    __slots__ = ("method", "draft_tokens", "mtp_kv_layers")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MTP_KV_LAYERS_FIELD_NUMBER: _ClassVar[int]
    method: str
    draft_tokens: int
    mtp_kv_layers: int
    def __init__(self, method: _Optional[str] = ..., draft_tokens: _Optional[int] = ..., mtp_kv_layers: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "config_json", "dtype")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    config_json: str
    dtype: str
    def __init__(self, model_id: _Optional[str] = ..., config_json: _Optional[str] = ..., dtype: _Optional[str] = ...) -> None: ...

class KVFormatInfo(_message.Message):
    __slots__ = ("name", "options_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    options_json: str
    def __init__(self, name: _Optional[str] = ..., options_json: _Optional[str] = ...) -> None: ...

class ArenaInfo(_message.Message):
    __slots__ = ("layout", "handle", "canary")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    CANARY_FIELD_NUMBER: _ClassVar[int]
    layout: ArenaLayout
    handle: MemoryHandle
    canary: bytes
    def __init__(self, layout: _Optional[_Union[ArenaLayout, _Mapping]] = ..., handle: _Optional[_Union[MemoryHandle, _Mapping]] = ..., canary: _Optional[bytes] = ...) -> None: ...

class ArenaLayout(_message.Message):
    __slots__ = ("tensors", "total_bytes")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSlice]
    total_bytes: int
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSlice, _Mapping]]] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class TensorSlice(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ...) -> None: ...

class MemoryHandle(_message.Message):
    __slots__ = ("shm", "cuda")
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    shm: SharedMemoryFile
    cuda: CudaIpcHandle
    def __init__(self, shm: _Optional[_Union[SharedMemoryFile, _Mapping]] = ..., cuda: _Optional[_Union[CudaIpcHandle, _Mapping]] = ...) -> None: ...

class SharedMemoryFile(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("session_id", "cache_salt", "tokens_le32", "lock")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_LE32_FIELD_NUMBER: _ClassVar[int]
    LOCK_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    cache_salt: str
    tokens_le32: bytes
    lock: bool
    def __init__(self, session_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., tokens_le32: _Optional[bytes] = ..., lock: _Optional[bool] = ...) -> None: ...

class MatchReply(_message.Message):
    __slots__ = ("num_tokens", "pages", "snapshot_slot", "node_id", "locked")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_SLOT_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LOCKED_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    snapshot_slot: int
    node_id: int
    locked: bool
    def __init__(self, num_tokens: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ..., snapshot_slot: _Optional[int] = ..., node_id: _Optional[int] = ..., locked: _Optional[bool] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("session_id", "num_pages", "num_slots", "num_staging")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_pages: int
    num_slots: int
    num_staging: int
    def __init__(self, session_id: _Optional[str] = ..., num_pages: _Optional[int] = ..., num_slots: _Optional[int] = ..., num_staging: _Optional[int] = ...) -> None: ...

class AllocateReply(_message.Message):
    __slots__ = ("pages", "slots", "staging")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    STAGING_FIELD_NUMBER: _ClassVar[int]
    pages: _containers.RepeatedScalarFieldContainer[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    staging: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pages: _Optional[_Iterable[int]] = ..., slots: _Optional[_Iterable[int]] = ..., staging: _Optional[_Iterable[int]] = ...) -> None: ...

class InsertRequest(_message.Message):
    __slots__ = ("session_id", "cache_salt", "tokens_le32", "pages", "snapshot_slot", "lock")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_LE32_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_SLOT_FIELD_NUMBER: _ClassVar[int]
    LOCK_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    cache_salt: str
    tokens_le32: bytes
    pages: _containers.RepeatedScalarFieldContainer[int]
    snapshot_slot: int
    lock: bool
    def __init__(self, session_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., tokens_le32: _Optional[bytes] = ..., pages: _Optional[_Iterable[int]] = ..., snapshot_slot: _Optional[int] = ..., lock: _Optional[bool] = ...) -> None: ...

class InsertReply(_message.Message):
    __slots__ = ("node_id", "num_tokens", "pages", "new_pages", "freed_duplicate_pages", "snapshot_taken", "locked")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    NEW_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREED_DUPLICATE_PAGES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_TAKEN_FIELD_NUMBER: _ClassVar[int]
    LOCKED_FIELD_NUMBER: _ClassVar[int]
    node_id: int
    num_tokens: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    new_pages: int
    freed_duplicate_pages: int
    snapshot_taken: bool
    locked: bool
    def __init__(self, node_id: _Optional[int] = ..., num_tokens: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ..., new_pages: _Optional[int] = ..., freed_duplicate_pages: _Optional[int] = ..., snapshot_taken: _Optional[bool] = ..., locked: _Optional[bool] = ...) -> None: ...

class LockRequest(_message.Message):
    __slots__ = ("session_id", "node_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    node_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., node_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LockReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnlockRequest(_message.Message):
    __slots__ = ("session_id", "node_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    node_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., node_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class UnlockReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "pages", "slots")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    pages: _containers.RepeatedScalarFieldContainer[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., pages: _Optional[_Iterable[int]] = ..., slots: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("total_pages", "free_pages", "total_slots", "free_slots", "cached_pages", "evictable_pages", "locked_pages", "snapshots", "sessions", "held_pages", "held_slots", "cache_queries", "cache_hits", "queried_tokens", "hit_tokens", "total_staging", "free_staging")
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_PAGES_FIELD_NUMBER: _ClassVar[int]
    LOCKED_PAGES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    HELD_PAGES_FIELD_NUMBER: _ClassVar[int]
    HELD_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STAGING_FIELD_NUMBER: _ClassVar[int]
    FREE_STAGING_FIELD_NUMBER: _ClassVar[int]
    total_pages: int
    free_pages: int
    total_slots: int
    free_slots: int
    cached_pages: int
    evictable_pages: int
    locked_pages: int
    snapshots: int
    sessions: int
    held_pages: int
    held_slots: int
    cache_queries: int
    cache_hits: int
    queried_tokens: int
    hit_tokens: int
    total_staging: int
    free_staging: int
    def __init__(self, total_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., total_slots: _Optional[int] = ..., free_slots: _Optional[int] = ..., cached_pages: _Optional[int] = ..., evictable_pages: _Optional[int] = ..., locked_pages: _Optional[int] = ..., snapshots: _Optional[int] = ..., sessions: _Optional[int] = ..., held_pages: _Optional[int] = ..., held_slots: _Optional[int] = ..., cache_queries: _Optional[int] = ..., cache_hits: _Optional[int] = ..., queried_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., total_staging: _Optional[int] = ..., free_staging: _Optional[int] = ...) -> None: ...
