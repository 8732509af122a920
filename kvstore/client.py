"""A worker's handle on the KV store: attach over the unix socket, map the
store's memory once, and call the control RPC with plain dataclasses.

    client = StoreClient.connect("/tmp/kv.sock", name="decode-0")
    client.model   # CausalLM whose parameters are views of the shared weights
    client.cache   # PagedKVCache over the shared KV pages and GDN state slots
    m = client.match(prompt, lock=True)
    a = client.allocate(pages=3, slots=1)
    ...
    client.close() # or just exit: the store frees what the session held

The session is the Attach stream, consumed by a background thread so that the
store sees this process go away (close, crash, SIGKILL) and cleans up, and so
that this process sees the store go away (`connected` turns False).

Owns the client side of the RPC; protobuf never leaves this module. Must not
know ownership rules (the store enforces them) or scheduling.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.cache import CacheShape, PagedKVCache
from engine.kv.open_pages import open_staging_per_sequence, sink_pages
from engine.config import ModelConfig
from engine.errors import TandemError
from engine.model import CausalLM
from engine.speculative import SpeculativeConfig
from kvstore.arena import ArenaHandle, CudaIpcHandle, Layout, TensorSpec, dtype_from_name
from kvstore.control import Allocation, InsertResult, MatchResult, StoreStats
from kvstore.memory import (KVFormatSpec, StoreArenas, cache_on_arenas, config_from_json,
                            model_on_arena, open_arenas)
from tandem.internal.v1 import kvstore_pb2 as pb
from tandem.internal.v1 import kvstore_pb2_grpc as pb_grpc
from tandem.wire import pack_token_ids

MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
SERVICE_NAME = "tandem.internal.v1.KVStore"


class StoreError(TandemError):
    """The store refused a request or could not be reached; `code` is the gRPC
    status name (INVALID_ARGUMENT, FAILED_PRECONDITION, ...)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.details = message


@dataclass(frozen=True)
class ScratchSequence:
    """What StoreClient.scratch_sequence lends: a page table (sink pages
    first), the staging ids of its open pages, and state slots."""

    pages: tuple[int, ...]
    open_pages: tuple[int, ...]
    slots: tuple[int, ...]


class StoreCapacityError(StoreError):
    """RESOURCE_EXHAUSTED: not enough pages or slots even after eviction."""


class StoreUnavailable(StoreError):
    """The store is not serving (not started yet, stopped, wrong socket)."""


@dataclass(frozen=True)
class StoreInfo:
    """The store's description from Attach, as plain data."""

    session_id: str
    model_id: str
    config: ModelConfig
    dtype: torch.dtype
    kv_format: KVFormatSpec
    page_size: int
    num_pages: int
    num_state_slots: int
    store_pid: int
    arenas: dict[str, ArenaHandle]
    # the service's drafter, which the store laid out memory for
    speculative: SpeculativeConfig = SpeculativeConfig()
    mtp_kv_layers: int = 0  # MTP layers with KV page pools in the kv arena
    num_staging_pages: int = 0  # bf16 staging pages, ids num_pages ..
    # the largest prefill chunk the store's plan sized activations for
    prefill_chunk_tokens: int = 0

    @property
    def sink_pages_per_sequence(self) -> int:
        """Leading pages of every page table that must be staging pages (rk4p's
        exact sinks): allocated as staging, or shared from the prefix cache."""
        return sink_pages(self.kv_format.build())

    @property
    def open_pages_per_sequence(self) -> int:
        """Staging pages a running sequence holds for its open pages (rk4p)."""
        return open_staging_per_sequence(self.kv_format.build())

    @property
    def cache_shape(self) -> CacheShape:
        """The shape the store laid its kv and state arenas out for."""
        return CacheShape(self.num_pages, self.page_size, self.num_state_slots,
                          self.mtp_kv_layers, self.num_staging_pages)

    @property
    def spare_slots_per_sequence(self) -> int:
        """GDN slots a running sequence holds for speculative verify."""
        return self.speculative.spare_slots(self.config)


def wait_for_store(socket_path: str, timeout: float = 30.0) -> None:
    """Block until the store on `socket_path` reports SERVING on gRPC health."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"unix:{socket_path}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                   timeout=max(0.1, min(1.0, deadline - time.monotonic())))
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise StoreUnavailable("UNAVAILABLE", f"no KV store serving on {socket_path} "
                                       f"after {timeout:.0f} s")
            time.sleep(0.05)


class StoreClient:
    """One session with the store; see the module docstring."""

    def __init__(self, channel: grpc.Channel, stream, info: StoreInfo, timeout: float,
                 map_memory: bool):
        self._channel = channel
        self._stub = pb_grpc.KVStoreStub(channel)
        self._stream = stream
        self.info = info
        self.session_id = info.session_id
        self.timeout = timeout
        self._closing = False
        self._ended = threading.Event()
        self.end_reason: str | None = None
        self.arenas: StoreArenas | None = None
        self.model: CausalLM | None = None
        self.cache: PagedKVCache | None = None
        if map_memory:
            self._map_memory()
        self._watcher = threading.Thread(target=self._watch_session, daemon=True,
                                         name=f"kvstore-session-{info.session_id}")
        self._watcher.start()

    @classmethod
    def connect(cls, socket_path: str, name: str = "", timeout: float = 30.0,
                map_memory: bool = True) -> "StoreClient":
        """Attach to the store on `socket_path`; with map_memory, map its arenas
        and build `model` and `cache` on them (raises ArenaMapError, never copies)."""
        channel = grpc.insecure_channel(f"unix:{socket_path}", options=CHANNEL_OPTIONS)
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
            stream = pb_grpc.KVStoreStub(channel).Attach(pb.AttachRequest(client_name=name))
            first = next(stream)
        except grpc.FutureTimeoutError:
            channel.close()
            raise StoreUnavailable("UNAVAILABLE", f"no KV store answers on {socket_path}") from None
        except grpc.RpcError as e:
            channel.close()
            raise _store_error(e) from None
        return cls(channel, stream, _info_from_pb(first.attached), timeout, map_memory)

    # ----------------------------------------------------------- session

    @property
    def connected(self) -> bool:
        """False once the session stream ended (store stopped or we closed)."""
        return not self._ended.is_set()

    def close(self) -> None:
        """End the session: the store frees what it held. Mappings stay valid
        while this process keeps references to them."""
        self._closing = True
        self._stream.cancel()
        self._channel.close()
        self._watcher.join(timeout=2.0)

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _watch_session(self) -> None:
        try:
            for _event in self._stream:
                pass  # no events after `attached` yet; reading keeps the session observed
            self.end_reason = "the store ended the session"
        except grpc.RpcError as e:
            self.end_reason = None if self._closing else f"session lost: {e.code().name}"
        finally:
            self._ended.set()

    def _map_memory(self) -> None:
        info = self.info
        self.arenas = open_arenas(info.arenas, info.store_pid)
        self.model = model_on_arena(info.config, self.arenas, info.dtype, info.model_id)
        self.cache = cache_on_arenas(info.config, info.cache_shape, info.kv_format.build(),
                                     self.arenas)

    # ----------------------------------------------------------- control

    @property
    def device(self) -> torch.device:
        """Where the mapped weights (and so this worker's compute) live."""
        return self.arenas.weights.buffer.device

    def match(self, tokens: Sequence[int] | bytes, cache_salt: str = "",
              lock: bool = False) -> MatchResult:
        """The longest cached prefix of `tokens` (ids, or their pack_token_ids
        bytes: a caller that sends one prompt several times packs it once)."""
        r = self._call(self._stub.Match, pb.MatchRequest(
            session_id=self.session_id, cache_salt=cache_salt, tokens_le32=_packed(tokens),
            lock=lock))
        slot = r.snapshot_slot if r.HasField("snapshot_slot") else None
        return MatchResult(r.num_tokens, tuple(r.pages), slot, r.node_id, r.locked)

    def allocate(self, pages: int = 0, slots: int = 0, staging: int = 0) -> Allocation:
        r = self._call(self._stub.Allocate, pb.AllocateRequest(
            session_id=self.session_id, num_pages=pages, num_slots=slots, num_staging=staging))
        return Allocation(tuple(r.pages), tuple(r.slots), tuple(r.staging))

    def insert(self, tokens: Sequence[int] | bytes, pages: Sequence[int],
               snapshot_slot: int | None = None, cache_salt: str = "",
               lock: bool = False) -> InsertResult:
        """Hand the whole pages of `tokens` (ids, or their pack_token_ids bytes)
        and a snapshot slot to the cache. Afterwards the session holds none of
        `pages`: read the prefix through the returned `pages`, locked
        (lock=True) for as long as you read it."""
        r = self._call(self._stub.Insert, pb.InsertRequest(
            session_id=self.session_id, cache_salt=cache_salt, tokens_le32=_packed(tokens),
            pages=_ints(pages), snapshot_slot=snapshot_slot, lock=lock))
        return InsertResult(r.node_id, r.num_tokens, tuple(r.pages), r.new_pages,
                            r.freed_duplicate_pages, r.snapshot_taken, r.locked)

    def lock(self, node_ids: Iterable[int]) -> None:
        self._call(self._stub.Lock, pb.LockRequest(session_id=self.session_id,
                                                   node_ids=_ints(node_ids)))

    def unlock(self, node_ids: Iterable[int]) -> None:
        self._call(self._stub.Unlock, pb.UnlockRequest(session_id=self.session_id,
                                                       node_ids=_ints(node_ids)))

    @contextmanager
    def scratch_sequence(self, tokens: int, slots: int,
                         wait_s: float = 0.0) -> Iterator["ScratchSequence"]:
        """Pages for a made-up sequence of `tokens` tokens, laid out as the
        router lays out a request's (its leading sink pages and its open pages
        staging ones, for a format that quantizes whole pages), and `slots`
        state slots; all given back on exit, whatever happens (the workers'
        warm-ups). wait_s: how long to retry while the store is out of
        capacity, then its StoreCapacityError."""
        info = self.info
        total = -(-tokens // info.page_size)
        sinks = min(info.sink_pages_per_sequence, total)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                grant = self.allocate(total - sinks, slots, sinks + info.open_pages_per_sequence)
                break
            except StoreCapacityError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.25)
        try:
            yield ScratchSequence((*grant.staging[:sinks], *grant.pages),
                                  tuple(grant.staging[sinks:]), grant.slots)
        finally:
            self.release([*grant.pages, *grant.staging], grant.slots)

    def release(self, pages: Iterable[int] = (), slots: Iterable[int] = ()) -> None:
        self._call(self._stub.Release, pb.ReleaseRequest(
            session_id=self.session_id, pages=_ints(pages), slots=_ints(slots)))

    def stats(self) -> StoreStats:
        r = self._call(self._stub.Stats, pb.StatsRequest())
        return StoreStats(**{name: getattr(r, name) for name in StoreStats.__dataclass_fields__})

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise _store_error(e) from None


# ------------------------------------------------------------------ helpers


def _ints(values: Iterable[int]) -> Iterable[int]:
    """Ids for a repeated int field: a list or tuple goes as it is (protobuf
    checks each is an int in C; copying in Python cost ~9 ms per 100K ids
    when prompts went this way), anything else (numpy, a generator) as ints."""
    if isinstance(values, (list, tuple)):
        return values
    return [int(v) for v in values]


def _packed(tokens: Sequence[int] | bytes) -> bytes:
    """A tokens_le32 field: bytes are taken as packed already; ids that cannot
    be packed are refused here as the store would refuse them."""
    if isinstance(tokens, bytes):
        return tokens
    try:
        return pack_token_ids(tokens)
    except ValueError as e:
        raise StoreError("INVALID_ARGUMENT", str(e)) from None


def _store_error(e: grpc.RpcError) -> StoreError:
    code = e.code()
    kind = {grpc.StatusCode.RESOURCE_EXHAUSTED: StoreCapacityError,
            grpc.StatusCode.UNAVAILABLE: StoreUnavailable}.get(code, StoreError)
    return kind(code.name, e.details() or "")


def _layout_from_pb(layout: pb.ArenaLayout) -> Layout:
    return Layout(tuple(TensorSpec(t.name, dtype_from_name(t.dtype), tuple(t.shape), t.offset)
                        for t in layout.tensors), layout.total_bytes)


def _arena_from_pb(arena: pb.ArenaInfo) -> ArenaHandle:
    layout = _layout_from_pb(arena.layout)
    if arena.handle.WhichOneof("kind") == "cuda":
        c = arena.handle.cuda
        cuda = CudaIpcHandle(c.device, c.handle, c.storage_size_bytes, c.storage_offset_bytes,
                             c.ref_counter_handle, c.ref_counter_offset, c.event_handle,
                             c.event_sync_required)
        return ArenaHandle(layout, arena.canary, cuda=cuda)
    return ArenaHandle(layout, arena.canary, shm_path=arena.handle.shm.path)


def _info_from_pb(a: pb.Attached) -> StoreInfo:
    return StoreInfo(
        session_id=a.session_id, model_id=a.model.model_id,
        config=config_from_json(a.model.config_json), dtype=dtype_from_name(a.model.dtype),
        kv_format=KVFormatSpec.from_json(a.kv_format.name, a.kv_format.options_json),
        page_size=a.page_size, num_pages=a.num_pages, num_state_slots=a.num_state_slots,
        store_pid=a.store_pid, speculative=_speculative_from_pb(a.speculative),
        mtp_kv_layers=a.speculative.mtp_kv_layers, num_staging_pages=a.num_staging_pages,
        prefill_chunk_tokens=a.prefill_chunk_tokens,
        arenas={"weights": _arena_from_pb(a.weights), "kv": _arena_from_pb(a.kv),
                "state": _arena_from_pb(a.state), "host": _arena_from_pb(a.host_weights)})


def _speculative_from_pb(s: pb.SpeculativeInfo) -> SpeculativeConfig:
    if s.method in ("", "none"):  # proto3 leaves an unset method empty
        return SpeculativeConfig()
    return SpeculativeConfig(s.method, s.draft_tokens)
