from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeFinish(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECODE_FINISH_UNSPECIFIED: _ClassVar[DecodeFinish]
    DECODE_FINISH_STOP: _ClassVar[DecodeFinish]
    DECODE_FINISH_LENGTH: _ClassVar[DecodeFinish]
    DECODE_FINISH_ABORT: _ClassVar[DecodeFinish]
DECODE_FINISH_UNSPECIFIED: DecodeFinish
DECODE_FINISH_STOP: DecodeFinish
DECODE_FINISH_LENGTH: DecodeFinish
DECODE_FINISH_ABORT: DecodeFinish

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "max_new_tokens", "stop_token_ids", "ignore_eos", "logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class GeneratedToken(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class SnapshotPoint(_message.Message):
    __slots__ = ("tokens", "slot")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    slot: int
    def __init__(self, tokens: _Optional[int] = ..., slot: _Optional[int] = ...) -> None: ...

class AbortWork(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortWorkReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "tokens_le32", "start", "pages", "state_slot", "restore_slot", "snapshots", "sampling", "transfer", "open_pages")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_LE32_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    RESTORE_SLOT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    OPEN_PAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens_le32: bytes
    start: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    state_slot: int
    restore_slot: int
    snapshots: _containers.RepeatedCompositeFieldContainer[SnapshotPoint]
    sampling: Sampling
    transfer: KVTransfer
    open_pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., tokens_le32: _Optional[bytes] = ..., start: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ..., state_slot: _Optional[int] = ..., restore_slot: _Optional[int] = ..., snapshots: _Optional[_Iterable[_Union[SnapshotPoint, _Mapping]]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., transfer: _Optional[_Union[KVTransfer, _Mapping]] = ..., open_pages: _Optional[_Iterable[int]] = ...) -> None: ...

class KVTransfer(_message.Message):
    __slots__ = ("transfer_id", "decode_worker", "first_page", "dest_pages", "dest_state_slot", "snapshot_slot", "dest_snapshot_slot")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    DEST_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEST_STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_SLOT_FIELD_NUMBER: _ClassVar[int]
    DEST_SNAPSHOT_SLOT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    decode_worker: int
    first_page: int
    dest_pages: _containers.RepeatedScalarFieldContainer[int]
    dest_state_slot: int
    snapshot_slot: int
    dest_snapshot_slot: int
    def __init__(self, transfer_id: _Optional[int] = ..., decode_worker: _Optional[int] = ..., first_page: _Optional[int] = ..., dest_pages: _Optional[_Iterable[int]] = ..., dest_state_slot: _Optional[int] = ..., snapshot_slot: _Optional[int] = ..., dest_snapshot_slot: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first", "prefilled_tokens", "transferred_pages", "transferred_bytes", "open_held")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERRED_PAGES_FIELD_NUMBER: _ClassVar[int]
    TRANSFERRED_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPEN_HELD_FIELD_NUMBER: _ClassVar[int]
    first: GeneratedToken
    prefilled_tokens: int
    transferred_pages: int
    transferred_bytes: int
    open_held: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, first: _Optional[_Union[GeneratedToken, _Mapping]] = ..., prefilled_tokens: _Optional[int] = ..., transferred_pages: _Optional[int] = ..., transferred_bytes: _Optional[int] = ..., open_held: _Optional[_Iterable[int]] = ...) -> None: ...

class ReceiveRequest(_message.Message):
    __slots__ = ("request_id", "transfer_id", "prefill_worker", "dest_pages", "dest_state_slot", "dest_snapshot_slot")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DEST_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEST_STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    DEST_SNAPSHOT_SLOT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: int
    prefill_worker: int
    dest_pages: _containers.RepeatedScalarFieldContainer[int]
    dest_state_slot: int
    dest_snapshot_slot: int
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[int] = ..., prefill_worker: _Optional[int] = ..., dest_pages: _Optional[_Iterable[int]] = ..., dest_state_slot: _Optional[int] = ..., dest_snapshot_slot: _Optional[int] = ...) -> None: ...

class ReceiveEvent(_message.Message):
    __slots__ = ("registered", "done")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    registered: ReceiveRegistered
    done: ReceiveDone
    def __init__(self, registered: _Optional[_Union[ReceiveRegistered, _Mapping]] = ..., done: _Optional[_Union[ReceiveDone, _Mapping]] = ...) -> None: ...

class ReceiveRegistered(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReceiveDone(_message.Message):
    __slots__ = ("pages", "bytes", "seconds")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    pages: int
    bytes: int
    seconds: float
    def __init__(self, pages: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "lease", "prompt_le32", "first_token", "sampling", "pages", "state_slot", "boundary_slot", "spare_slots", "open_pages", "open_held")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LE32_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_SLOT_FIELD_NUMBER: _ClassVar[int]
    SPARE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    OPEN_PAGES_FIELD_NUMBER: _ClassVar[int]
    OPEN_HELD_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease: str
    prompt_le32: bytes
    first_token: int
    sampling: Sampling
    pages: _containers.RepeatedScalarFieldContainer[int]
    state_slot: int
    boundary_slot: int
    spare_slots: _containers.RepeatedScalarFieldContainer[int]
    open_pages: _containers.RepeatedScalarFieldContainer[int]
    open_held: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., lease: _Optional[str] = ..., prompt_le32: _Optional[bytes] = ..., first_token: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., pages: _Optional[_Iterable[int]] = ..., state_slot: _Optional[int] = ..., boundary_slot: _Optional[int] = ..., spare_slots: _Optional[_Iterable[int]] = ..., open_pages: _Optional[_Iterable[int]] = ..., open_held: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeTokens(_message.Message):
    __slots__ = ("tokens", "drafted", "accepted")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[GeneratedToken]
    drafted: int
    accepted: int
    def __init__(self, tokens: _Optional[_Iterable[_Union[GeneratedToken, _Mapping]]] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ...) -> None: ...

class DecodeFinished(_message.Message):
    __slots__ = ("reason", "detail", "pages", "boundary_tokens", "final_tokens")
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    reason: DecodeFinish
    detail: str
    pages: _containers.RepeatedScalarFieldContainer[int]
    boundary_tokens: int
    final_tokens: int
    def __init__(self, reason: _Optional[_Union[DecodeFinish, str]] = ..., detail: _Optional[str] = ..., pages: _Optional[_Iterable[int]] = ..., boundary_tokens: _Optional[int] = ..., final_tokens: _Optional[int] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("tokens", "finished")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    tokens: DecodeTokens
    finished: DecodeFinished
    def __init__(self, tokens: _Optional[_Union[DecodeTokens, _Mapping]] = ..., finished: _Optional[_Union[DecodeFinished, _Mapping]] = ...) -> None: ...
