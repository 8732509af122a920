"""The KV store process: loads the model once, allocates every byte of shared
memory at start-up (weights, KV pages, GDN state slots) within a checked
capacity plan, exports it, and serves the control RPC (tandem.internal.v1.KVStore)
and gRPC health on one unix domain socket.

    python -m kvstore.server --model tiny-qwen3.5 --socket /tmp/kv.sock \\
        --kv-format rk4 --page-size 16 --max-context-tokens 65536 \\
        --live-slots 8 --snapshot-slots 32 --gpu-memory-budget 24GiB --device cuda \\
        --speculative mtp --draft-tokens 3

Exit status: 0 after SIGTERM/SIGINT (shared memory files unlinked, socket
removed); 2 when the plan is over budget (the plan on stderr) or a flag or
the model is wrong (one line on stderr).

Owns the process: flags, start-up order, signals, protobuf <-> dataclass
conversion and mapping ControlError to status codes. Ownership rules live in
kvstore/control.py, memory in kvstore/memory.py; this module never runs a
forward.
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import signal
import sys
import traceback
from dataclasses import asdict, dataclass, field

import grpc
import numpy as np
import torch

from engine.chunking import (AUTO_PREFILL_CHUNK, AUTO_PREFILL_CHUNK_CAP, AUTO_PREFILL_CHUNK_CPU,
                             parse_prefill_chunk)
from engine.config import ModelConfig, shape_names
from engine.cuda_context import trim_stack_reservation
from engine.errors import InvalidRequestError, TandemError
from engine.gdn_batched import fla_available
from engine.kv.formats import FORMATS, default_page_size
from engine.loader import default_dtype, keeps_quantized, load_model, plan_inputs
from engine.quant.workspace import planned_workspace_bytes
from engine.speculative import SpeculativeConfig
from kvstore.arena import ArenaHandle, Layout, new_store_id, sweep_orphaned_shm
from kvstore.control import (Allocation, ControlError, FailedPrecondition, InsertResult,
                             InvalidArgument, MatchResult, ResourceExhausted, StoreControl,
                             StoreStats)
from kvstore.memory import (EMBEDDING_PLACES, HOST_PREFIXES, KVFormatSpec, StoreArenas,
                            can_host_embeddings, config_to_json, create_arenas, model_on_arena)
from kvstore.plan import SERVICE_CUDA_PROCESSES, CapacityPlan, OverBudgetError, parse_bytes
from tandem.internal.v1 import kvstore_pb2 as pb
from tandem.internal.v1 import kvstore_pb2_grpc as pb_grpc
from tandem.wire import unpack_token_ids

SERVICE_NAME = "tandem.internal.v1.KVStore"
# Token lists of long prompts exceed gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
EXIT_BAD_START = 2


@dataclass(frozen=True)
class ServerOptions:
    """The store's flags, validated on creation."""

    socket: str
    model: str | None = None
    kv_format: str = "int8"  # not rk4 until rk4 meets its quality goal (BENCHMARKS.md)
    kv_options: dict = field(default_factory=dict, hash=False)
    page_size: int | None = None  # None: the format's (default_page_size)
    max_context_tokens: int = 65536
    live_slots: int = 8
    snapshot_slots: int = 32
    gpu_memory_budget: int | None = None
    device: str = "cpu"
    # the largest chunk prefill workers run, which sizes the activation
    # reserve; AUTO_PREFILL_CHUNK: the plan picks it (plan_for)
    prefill_chunk_tokens: int = AUTO_PREFILL_CHUNK
    seed: int = 0
    weights: str = "auto"  # engine/loader.py: auto, native, bf16, or a dummy-shape recipe
    # the decode workers' drafter: the store lays out its memory (MTP KV pools,
    # k spare GDN slots per live sequence) and tells every process
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # where an untied token table lives: auto = host memory for a CUDA store
    # (as llama.cpp keeps it), host, or device
    embeddings: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_format not in FORMATS:
            raise ValueError(f"--kv-format must be one of {', '.join(sorted(FORMATS))}, "
                             f"got {self.kv_format!r}")
        if self.page_size is None:
            object.__setattr__(self, "page_size", default_page_size(self.kv_format))
        for flag, value, least in (("--page-size", self.page_size, 1),
                                   ("--max-context-tokens", self.max_context_tokens, 1),
                                   ("--live-slots", self.live_slots, 1),
                                   ("--snapshot-slots", self.snapshot_slots, 0),
                                   ("--prefill-chunk-tokens", self.prefill_chunk_tokens, 0)):
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{flag} must be an integer >= {least}, got {value!r}")
        if self.gpu_memory_budget is not None and self.gpu_memory_budget <= 0:
            raise ValueError(f"--gpu-memory-budget must be positive, got {self.gpu_memory_budget}")
        if self.embeddings not in EMBEDDING_PLACES:
            raise ValueError(f"--embeddings must be one of {', '.join(EMBEDDING_PLACES)}, "
                             f"got {self.embeddings!r}")
        if not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError("speculative must be a SpeculativeConfig")
        if torch.device(self.device).type not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        # sockaddr_un.sun_path is 108 bytes including the NUL.
        if len(os.fsencode(self.socket)) > 107:
            raise ValueError(f"--socket path is {len(self.socket)} bytes; unix sockets allow 107")


# ---------------------------------------------------------------- start-up


@dataclass
class Store:
    """What the process owns once started."""

    options: ServerOptions
    plan: CapacityPlan
    model_id: str
    config_json: str
    dtype: torch.dtype
    kv_spec: KVFormatSpec
    arenas: StoreArenas
    control: StoreControl


def host_embeddings(options: ServerOptions, config: ModelConfig) -> bool:
    """Whether the store keeps the token table in host memory."""
    if options.embeddings == "host" and not can_host_embeddings(config):
        raise InvalidRequestError("--embeddings host: this model ties its token table to the "
                                  "lm_head, which reads it whole every step; use auto or device")
    if options.embeddings == "auto":
        return torch.device(options.device).type == "cuda" and can_host_embeddings(config)
    return options.embeddings == "host"


def plan_for(options: ServerOptions, config: ModelConfig, dtype: torch.dtype, weight_bytes: int,
             weight_format: str = "as stored", embedding_bytes: int = 0,
             packed_in_features: int = 0) -> CapacityPlan:
    """The plan for `config`; --speculative mtp on a model without an MTP head
    fails here (InvalidRequestError naming `tandem train-mtp`).
    packed_in_features: the longest row of a matrix held packed (0: none is),
    which sizes the prefill's dequantization workspace on a GPU."""
    spec = options.speculative
    spec.check_model(config)
    on_gpu = torch.device(options.device).type == "cuda"
    on_host = embedding_bytes if on_gpu and host_embeddings(options, config) else 0
    auto = options.prefill_chunk_tokens == AUTO_PREFILL_CHUNK
    chunk = options.prefill_chunk_tokens or AUTO_PREFILL_CHUNK_CAP   # auto: replaced below
    plan = CapacityPlan(
        config=config, kv_format=kv_spec_for(options, dtype), page_size=options.page_size,
        max_context_tokens=options.max_context_tokens, live_slots=options.live_slots,
        snapshot_slots=options.snapshot_slots, gpu_memory_budget=options.gpu_memory_budget,
        weight_bytes=weight_bytes, prefill_chunk_tokens=chunk,
        activation_bytes=dtype.itemsize, cuda_graphs=on_gpu,
        cuda_processes=SERVICE_CUDA_PROCESSES if on_gpu else 0, paged_attention_kernel=on_gpu,
        weight_format=weight_format, draft_slots_per_sequence=spec.spare_slots(config),
        draft_tokens=spec.num_draft_tokens if spec.enabled else 0,
        mtp_kv_layers=spec.mtp_kv_layers(config), host_weight_bytes=on_host,
        weight_workspace_bytes=planned_workspace_bytes(packed_in_features, dtype.itemsize)
        if on_gpu and packed_in_features else 0,
        gdn_prefill_kernel=on_gpu and fla_available())
    return plan.with_auto_chunk() if auto else plan


def kv_spec_for(options: ServerOptions, dtype: torch.dtype) -> KVFormatSpec:
    kv_options = dict(options.kv_options)
    if options.kv_format == "bf16":
        # "bf16" stores K/V as computed: the model's dtype (fp32 on the CPU).
        kv_options.setdefault("dtype", dtype)
    if getattr(FORMATS.get(options.kv_format), "uses_staging", False):
        kv_options.setdefault("page_size", options.page_size)  # its K scales are per page
    return KVFormatSpec(options.kv_format, kv_options)


def start_store(options: ServerOptions) -> Store:
    """Plan (refusing over budget before touching memory), load, allocate once."""
    device = torch.device(options.device)
    dtype = default_dtype(device)
    # plan before loading (from configs and tensor tables): an over-budget store loads nothing
    inputs = plan_inputs(options.model, options.weights, device)
    config, weight_format, packed_k = inputs.config, inputs.label, inputs.packed_in_features
    plan = None
    if not (options.speculative.uses_mtp and options.model not in shape_names()):
        # (with --speculative mtp, whether a model file has an MTP head, its own
        # mtp.* tensors or a trained head file beside it, is known once loaded)
        plan = _checked_plan(options, config, dtype, inputs.weight_bytes, weight_format,
                             inputs.embedding_bytes, packed_k)
    store_id = new_store_id()
    trim_stack_reservation(device)  # before the arenas: the context's share is planned
    for path in sweep_orphaned_shm():  # CPU arenas, and any store's host arena
        print(f"kvstore: removed {path}, left by a store that was killed", file=sys.stderr)
    if options.model in shape_names():
        loaded, arenas = _dummy_in_arena(options, config, plan, dtype, device, store_id)
    else:
        # Loaded on the CPU and copied into the arena once, so a GPU never holds two copies.
        # Whether low-bit weights stay packed follows the store's device, not the CPU's.
        weights = "native" if keeps_quantized(options.weights, device) else "bf16"
        loaded = load_model(options.model, "cpu", dtype=dtype, progress=False, seed=options.seed,
                            weights=weights)
        if plan is None:
            sizes = {name: t.numel() * t.element_size()
                     for name, t in loaded.model.state_dict().items()}
            table = sum(b for name, b in sizes.items() if name.startswith(HOST_PREFIXES))
            plan = _checked_plan(options, loaded.config, dtype, sum(sizes.values()),
                                 weight_format, table, packed_k)
        arenas = create_arenas(loaded.model, loaded.config, plan.cache_shape, plan.kv_format.build(),
                               device, store_id,
                               host_embeddings=host_embeddings(options, loaded.config))
    kv_spec = plan.kv_format
    atexit.register(arenas.close)
    control = StoreControl(plan.num_pages, plan.num_state_slots, plan.page_size,
                           loaded.config.is_hybrid, loaded.config.vocab_size,
                           namespace_prefix=f"{loaded.source}|{kv_spec.describe()}",
                           staging_pages=plan.cache_shape.staging_pages)
    return Store(options, plan, loaded.source, config_to_json(loaded.config), dtype, kv_spec,
                 arenas, control)


def _dummy_in_arena(options, config, plan, dtype, device, store_id):
    """Random weights drawn straight into the arena on the device: a 27B shape
    never exists on the CPU, and the values equal load_model(shape, device)'s
    (but for a token table kept in host memory, drawn from a CPU generator)."""
    from engine.loader import LoadedModel
    from engine.model import CausalLM
    from engine.tokenizer import ByteTokenizer
    from engine.weights.dummy import randomize

    from engine.quant.recipes import randomize_quantized, swap_in_meta

    recipe = "bf16" if options.weights == "auto" else options.weights
    with torch.device("meta"):
        layout_model = CausalLM(config).to(dtype)
    formats = swap_in_meta(layout_model, recipe, dtype)
    arenas = create_arenas(layout_model, config, plan.cache_shape, plan.kv_format.build(), device,
                           store_id, copy_weights=False,
                           host_embeddings=host_embeddings(options, config))
    model = model_on_arena(config, arenas, dtype, f"dummy:{options.model}")
    randomize(model, options.seed)
    randomize_quantized(model, formats, options.seed)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return LoadedModel(config, model, ByteTokenizer(config.vocab_size), f"dummy:{options.model}",
                       device, dtype), arenas


def _checked_plan(options, config, dtype, weight_bytes, weight_format="as stored",
                  embedding_bytes=0, packed_in_features=0) -> CapacityPlan:
    plan = plan_for(options, config, dtype, weight_bytes, weight_format, embedding_bytes,
                    packed_in_features)
    plan.check()
    print(plan.table(), flush=True)
    return plan


# ----------------------------------------------------------------- protobuf


def layout_to_pb(layout: Layout) -> pb.ArenaLayout:
    return pb.ArenaLayout(
        tensors=[pb.TensorSlice(name=s["name"], dtype=s["dtype"], shape=s["shape"],
                                offset=s["offset"]) for s in layout.to_dict()["tensors"]],
        total_bytes=layout.total_bytes)


def arena_to_pb(handle: ArenaHandle) -> pb.ArenaInfo:
    if handle.cuda is not None:
        c = handle.cuda
        memory = pb.MemoryHandle(cuda=pb.CudaIpcHandle(
            device=c.device, handle=c.handle, storage_size_bytes=c.storage_size_bytes,
            storage_offset_bytes=c.storage_offset_bytes, ref_counter_handle=c.ref_counter_handle,
            ref_counter_offset=c.ref_counter_offset, event_handle=c.event_handle,
            event_sync_required=c.event_sync_required))
    else:
        memory = pb.MemoryHandle(shm=pb.SharedMemoryFile(path=handle.shm_path))
    return pb.ArenaInfo(layout=layout_to_pb(handle.layout), handle=memory, canary=handle.canary)


def attached_to_pb(store: Store, session_id: str) -> pb.Attached:
    handles = store.arenas.handles()
    spec = store.options.speculative
    return pb.Attached(
        session_id=session_id,
        model=pb.ModelInfo(model_id=store.model_id, config_json=store.config_json,
                           dtype=str(store.dtype).removeprefix("torch.")),
        kv_format=pb.KVFormatInfo(name=store.kv_spec.name, options_json=store.kv_spec.to_json()),
        page_size=store.plan.page_size, num_pages=store.plan.num_pages,
        num_state_slots=store.plan.num_state_slots,
        num_staging_pages=store.plan.cache_shape.staging_pages,
        prefill_chunk_tokens=store.plan.prefill_chunk_tokens,
        weights=arena_to_pb(handles["weights"]), kv=arena_to_pb(handles["kv"]),
        state=arena_to_pb(handles["state"]), host_weights=arena_to_pb(handles["host"]),
        store_pid=os.getpid(),
        speculative=pb.SpeculativeInfo(method=spec.method, draft_tokens=spec.num_draft_tokens,
                                       mtp_kv_layers=store.plan.mtp_kv_layers))


def match_to_pb(m: MatchResult) -> pb.MatchReply:
    return pb.MatchReply(num_tokens=m.num_tokens, pages=m.pages, snapshot_slot=m.snapshot_slot,
                         node_id=m.node_id, locked=m.locked)


def insert_to_pb(r: InsertResult) -> pb.InsertReply:
    return pb.InsertReply(node_id=r.node_id, num_tokens=r.num_tokens, pages=r.pages,
                          new_pages=r.new_pages, freed_duplicate_pages=r.freed_duplicate_pages,
                          snapshot_taken=r.snapshot_taken, locked=r.locked)


def stats_to_pb(s: StoreStats) -> pb.StatsReply:
    return pb.StatsReply(**asdict(s))


def _optional(message, name: str) -> int | None:
    return getattr(message, name) if message.HasField(name) else None


def tokens_from_pb(request) -> np.ndarray:
    """A Match or Insert request's tokens_le32 as a uint32 array viewing the
    request's bytes; a malformed field is InvalidArgument naming it."""
    try:
        return unpack_token_ids(request.tokens_le32)
    except ValueError as e:
        raise InvalidArgument(f"tokens_le32: {e}") from None


# ----------------------------------------------------------------- service

_STATUS = {InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
           FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
           ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED}


class KVStoreService(pb_grpc.KVStoreServicer):
    """gRPC face of a Store. Handlers run on one event loop and never await in
    the middle of a state change, so the control state needs no lock."""

    def __init__(self, store: Store):
        self.store = store
        self.control = store.control
        self.closing = asyncio.Event()  # set on shutdown: ends every Attach stream

    async def Attach(self, request, context):
        session = self.control.open_session(request.client_name)
        # Either path ends the session: the done callback fires when the RPC
        # ends for any reason (client gone, cancelled, server stopping); the
        # finally covers the generator being closed first. close is idempotent.
        context.add_done_callback(lambda _ctx: self._end_session(session.id))
        _log(f"session {session.id} attached ({request.client_name or 'unnamed'})")
        try:
            yield pb.AttachEvent(attached=attached_to_pb(self.store, session.id))
            await self.closing.wait()
        finally:
            self._end_session(session.id)

    def _end_session(self, session_id: str) -> None:
        if session_id in self.control.sessions:
            self.control.close_session(session_id)
            _log(f"session {session_id} ended; its pages, slots and locks are released")

    async def Match(self, request, context):
        return await _answer(context, lambda: match_to_pb(self.control.match(
            request.session_id, request.cache_salt, tokens_from_pb(request), request.lock)))

    async def Allocate(self, request, context):
        def allocate():
            a: Allocation = self.control.allocate(request.session_id, request.num_pages,
                                                  request.num_slots, request.num_staging)
            return pb.AllocateReply(pages=a.pages, slots=a.slots, staging=a.staging)
        return await _answer(context, allocate)

    async def Insert(self, request, context):
        return await _answer(context, lambda: insert_to_pb(self.control.insert(
            request.session_id, request.cache_salt, tokens_from_pb(request), request.pages,
            _optional(request, "snapshot_slot"), request.lock)))

    async def Lock(self, request, context):
        def lock():
            self.control.lock(request.session_id, request.node_ids)
            return pb.LockReply()
        return await _answer(context, lock)

    async def Unlock(self, request, context):
        def unlock():
            self.control.unlock(request.session_id, request.node_ids)
            return pb.UnlockReply()
        return await _answer(context, unlock)

    async def Release(self, request, context):
        def release():
            self.control.release(request.session_id, request.pages, request.slots)
            return pb.ReleaseReply()
        return await _answer(context, release)

    async def Stats(self, request, context):
        return await _answer(context, lambda: stats_to_pb(self.control.stats()))


async def _answer(context, handle):
    """Run one request; a ControlError becomes its status code with the message.

    Anything else is a bug in the store, not in the request: it is logged with
    its traceback and answered INTERNAL with what went wrong (left to grpc it
    is UNKNOWN with no message). The store keeps serving with the state the
    handler left; the control checks a request in full before changing
    anything, so a failure inside the change is the only way to leave it half
    done (the session's close gives back what it holds)."""
    try:
        return handle()
    except ControlError as e:
        await context.abort(_STATUS.get(type(e), grpc.StatusCode.INVALID_ARGUMENT), str(e))
    except Exception as e:  # noqa: BLE001 - reported, never swallowed
        _log(f"internal error answering a request: {e!r}\n{traceback.format_exc().rstrip()}")
        await context.abort(grpc.StatusCode.INTERNAL,
                            f"the KV store failed on this request: {type(e).__name__}: {e} "
                            "(a bug; the store logged the traceback and keeps serving)")


# ------------------------------------------------------------------ serving


async def serve(store: Store) -> None:
    """Serve until SIGTERM or SIGINT, then stop cleanly."""
    from tandem.serving import serve as serve_grpc

    service = KVStoreService(store)

    async def on_stop() -> None:
        service.closing.set()

    await serve_grpc("kvstore", store.options.socket,
                     lambda server: pb_grpc.add_KVStoreServicer_to_server(service, server),
                     (SERVICE_NAME,), on_stop)


# ---------------------------------------------------------------------- cli


def parse_args(argv: list[str] | None = None) -> ServerOptions:
    p = argparse.ArgumentParser(prog="python -m kvstore.server",
                                description="The tandem KV store: shared weights, KV pages, GDN "
                                            "state slots and the prefix cache of one model.")
    p.add_argument("--model", default=None,
                   help="GGUF file, Hugging Face directory or dummy shape (default: embedded)")
    p.add_argument("--socket", required=True, help="unix socket path to serve on")
    p.add_argument("--kv-format", default="int8", help="bf16, int8, rk4 or rk4p (default int8)")
    p.add_argument("--kv-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a KV format option, e.g. block=32 or scale_format=e8m0 (repeatable)")
    p.add_argument("--page-size", type=int, default=None,
                   help="tokens per KV page (default 16; 32 for rk4p)")
    p.add_argument("--max-context-tokens", type=int, default=65536,
                   help="tokens the page pool holds in all (sequences and prefix cache)")
    p.add_argument("--live-slots", type=int, default=8, help="GDN state slots for running sequences")
    p.add_argument("--snapshot-slots", type=int, default=32,
                   help="GDN state slots for prefix-cache snapshots (same pool as live slots)")
    p.add_argument("--gpu-memory-budget", default=None,
                   help="e.g. 24GiB; refuse to start when the plan needs more (default: no limit)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prefill-chunk-tokens", type=parse_prefill_chunk, default="auto",
                   help="largest prefill chunk workers run, which sizes the activation reserve; "
                        f"auto (default): on a GPU the largest up to {AUTO_PREFILL_CHUNK_CAP} "
                        f"the budget fits, on the CPU {AUTO_PREFILL_CHUNK_CPU}")
    p.add_argument("--seed", type=int, default=0, help="seed of dummy weights")
    p.add_argument("--weights", default="auto",
                   help="auto (low-bit files stay packed on CUDA), native, bf16, or for a dummy "
                        "shape a recipe: int4, q4_k_m, q4_k_s, q8_0, gptq-int4")
    p.add_argument("--speculative", default="none",
                   help="the decode workers' drafter: none (default), mtp (lays out MTP KV "
                        "pools) or ngram")
    p.add_argument("--embeddings", default="auto", choices=EMBEDDING_PLACES,
                   help="where an untied token table lives: auto (host memory on a GPU, where a "
                        "27B's table would take 0.7-2.4 GiB of the card), host or device")
    p.add_argument("--draft-tokens", type=int, default=3,
                   help="draft tokens per step, 1..4: hybrid models get that many spare GDN "
                        "slots per live sequence")
    a = p.parse_args(argv)
    budget = None if a.gpu_memory_budget is None else parse_bytes(a.gpu_memory_budget)
    return ServerOptions(
        socket=a.socket, model=a.model, kv_format=a.kv_format,
        kv_options=_parse_kv_options(a.kv_option), page_size=a.page_size,
        max_context_tokens=a.max_context_tokens, live_slots=a.live_slots,
        snapshot_slots=a.snapshot_slots, gpu_memory_budget=budget, device=a.device,
        prefill_chunk_tokens=a.prefill_chunk_tokens, seed=a.seed, weights=a.weights,
        speculative=SpeculativeConfig(a.speculative, a.draft_tokens), embeddings=a.embeddings)


def _parse_kv_options(items: list[str]) -> dict:
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--kv-option wants KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)  # numbers and true/false
        except json.JSONDecodeError:
            options[key] = value
    return options


def _exit_on_signal(signum, _frame) -> None:
    # Before the event loop runs (while loading), turn SIGTERM into SystemExit
    # so atexit still unlinks any shared memory already created.
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        options = parse_args(argv)
        store = start_store(options)
    except OverBudgetError as e:
        print(e, file=sys.stderr, flush=True)
        return EXIT_BAD_START
    except (TandemError, ValueError) as e:
        print(f"kvstore: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_START
    try:
        asyncio.run(serve(store))
    except TandemError as e:
        print(f"kvstore: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_START
    finally:
        store.arenas.close()
    _log("stopped; shared memory unlinked")
    return 0


def _log(message: str) -> None:
    print(f"kvstore: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
