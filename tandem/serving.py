"""Process plumbing the worker and router servers share: a grpc.aio server on
a unix socket or TCP address with gRPC health, shutdown on SIGTERM/SIGINT,
and the mapping from our errors to gRPC status codes."""
from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import sys
import time
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.errors import InvalidRequestError, TandemError

MAX_MESSAGE_BYTES = 64 << 20  # token lists of long prompts exceed the 4 MiB default
GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
# The router's channels to the workers, which the supervisor restarts: by
# default a channel's reconnect backoff grows to 120 s while the worker is
# down, and every call fails at once (UNAVAILABLE) until the next attempt, so
# a worker that took minutes to come back was refused for up to two minutes
# more after it served again. Connecting to a unix socket costs nothing.
WORKER_RECONNECT_MS = 1000
WORKER_CHANNEL_OPTIONS = GRPC_OPTIONS + [("grpc.initial_reconnect_backoff_ms", 100),
                                         ("grpc.min_reconnect_backoff_ms", 100),
                                         ("grpc.max_reconnect_backoff_ms", WORKER_RECONNECT_MS)]


def unix_target(path: str) -> str:
    return f"unix:{path}"


def worker_channel(path: str) -> grpc.aio.Channel:
    """A channel to the worker serving on the unix socket `path`, which tries
    to reconnect at least every WORKER_RECONNECT_MS while the worker is down."""
    return grpc.aio.insecure_channel(unix_target(path), options=WORKER_CHANNEL_OPTIONS)


def share_cpu_with_the_other_worker() -> None:
    """On the CPU, prefill and decode run at once in two processes: give each
    half the cores, or their thread pools fight over every core (seen here:
    100x slower steps on 2 cores). No effect on a GPU's work."""
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))


def attach_worker(process: str, args):
    """A worker process's start: its CPU share, then a session with its store
    (args.store) with the store's memory mapped. Returns the StoreClient."""
    from engine.cuda_context import trim_stack_reservation
    from kvstore.client import StoreClient, wait_for_store

    share_cpu_with_the_other_worker()
    wait_for_store(args.store, timeout=args.store_timeout)
    store = StoreClient.connect(args.store, name=process)
    # a process-wide setting, so the process's main makes it: every service
    # process's CUDA context is planned with the trimmed stack (kvstore/plan.py)
    trim_stack_reservation(store.device)
    log(process, f"mapped the store's memory ({store.info.model_id})")
    return store


def worker_arguments(prog: str, description: str):
    """The flags every worker shares: where the store is and where to serve."""
    import argparse

    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--store", required=True, help="the kvstore's unix socket")
    p.add_argument("--socket", required=True, help="unix socket to serve on")
    p.add_argument("--device", default=None, help="ignored: the store's memory decides")
    p.add_argument("--store-timeout", type=float, default=60.0)
    g = p.add_argument_group("disaggregated topology (transfer/)")
    g.add_argument("--transfer-rank", type=int, default=None,
                   help="this worker's rank in the transfer group (unset: shared topology)")
    g.add_argument("--transfer-world", type=int, default=0, help="ranks in the transfer group")
    g.add_argument("--transfer-prefill", type=int, default=0,
                   help="how many ranks are prefill workers (ranks 0..N-1)")
    g.add_argument("--transfer-addr", default="127.0.0.1:29500",
                   help="host:port of rank 0's rendezvous")
    g.add_argument("--transfer-method", choices=["dist", "peer"], default="dist",
                   help="dist: torch.distributed send/recv (gloo on CPU, NCCL on CUDA); peer: "
                        "map the decode stores and copy into them (shm / CUDA IPC, one host)")
    g.add_argument("--peer-stores", default="",
                   help="prefill workers with --transfer-method peer: the decode workers' store "
                        "sockets, comma-separated, in decode worker order")
    return p


TRANSFER_SERVICE = "tandem.internal.v1.KVTransfer"  # SERVING once the transfer path is ready


def transfer_group_config(args):
    """The GroupConfig the worker flags describe, or None in the shared topology."""
    if args.transfer_rank is None:
        return None
    from transfer.group import GroupConfig

    try:
        return GroupConfig(args.transfer_rank, args.transfer_world, args.transfer_addr,
                           args.transfer_prefill)
    except ValueError as e:
        raise TandemError(str(e)) from e


# a collection pausing a process at least this long gets a log line
GC_PAUSE_REPORT_S = 0.01


def settle_the_heap(process: str) -> None:
    """Move everything start-up made (torch, the model's modules, the warm-up's
    objects) out of the garbage collector's reach, and log collections that
    still pause the process. A full collection walks every tracked object:
    with torch imported that is hundreds of thousands, tens of milliseconds
    that land inside whatever request is running (the 27B agent turns' TTFT
    spread 0.30-0.73 s on the H200, 2026-12-02 13:57). gc.freeze() keeps them
    out of every later collection; new objects are collected as before."""
    gc.collect()
    gc.freeze()
    if any(getattr(c, "reports_pauses_of", None) for c in gc.callbacks):
        return  # a second server in this process (tests): one report is enough
    began = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
            return
        paused = time.perf_counter() - began[0]
        if paused >= GC_PAUSE_REPORT_S:
            log(process, f"garbage collection (generation {info['generation']}) paused the "
                         f"process {paused * 1e3:.0f} ms, {info['collected']} objects freed")

    timed.reports_pauses_of = process
    gc.callbacks.append(timed)


def log(process: str, message: str) -> None:
    print(f"{process}: {message}", file=sys.stderr, flush=True)


class WorkerUnavailable(TandemError):
    """A worker stopped serving a request part-way (a prefill ended before its
    first token, a KV transfer that never finished): UNAVAILABLE, and a retry
    may succeed. The store's own outages are kvstore's StoreUnavailable."""


def status_of(error: Exception) -> grpc.StatusCode:
    """The gRPC status for an error we raised on purpose."""
    from kvstore.client import StoreCapacityError, StoreUnavailable

    if isinstance(error, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, StoreCapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, (StoreUnavailable, WorkerUnavailable)):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


async def abort_with(context, error: TandemError) -> None:
    await context.abort(status_of(error), str(error))


class _Undecodable:
    """A request whose bytes are no valid message of its type (invalid UTF-8 in
    a string, a torn field): the handler refuses it. Left to grpc, a parse
    failure is UNKNOWN, a status that blames the server."""

    def __init__(self, message: str) -> None:
        self.message = message


def _lenient(parse, type_name: str):
    from google.protobuf.message import DecodeError

    def deserialize(data: bytes):
        try:
            return parse(data)
        except DecodeError as e:
            return _Undecodable(f"the request does not decode as a {type_name} ({e}): send "
                                "the message its .proto defines, with UTF-8 strings")
    return deserialize


def _refusing_undecodable(behavior, streaming: bool):
    if streaming:
        async def stream(request, context):
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for response in behavior(request, context):
                yield response
        return stream

    async def unary(request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behavior(request, context)
    return unary


def add_refusing_undecodable(add_servicer, servicer, server: grpc.aio.Server) -> None:
    """`add_servicer(servicer, server)` (a generated add_*Servicer_to_server),
    with every request that does not decode answered INVALID_ARGUMENT: the
    public API's promise for bad input. Unary-unary and unary-stream methods."""
    registered: list[str] = []

    class Registering:
        def add_generic_rpc_handlers(self, handlers) -> None:
            pass  # the registered handlers below say the same

        def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
            wrapped = {name: _lenient_handler(handler) for name, handler in handlers.items()}
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service,
                                                                                  wrapped),))
            server.add_registered_method_handlers(service, wrapped)
            registered.append(service)

    add_servicer(servicer, Registering())
    if not registered:  # generated code of a grpcio that registers otherwise
        raise RuntimeError(f"{add_servicer.__name__} registered no method handlers to wrap: "
                           "regenerate the stubs with this grpcio (scripts/gen_protos.sh)")


def _lenient_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    if handler.request_streaming or handler.stream_stream or handler.stream_unary:
        raise ValueError("add_refusing_undecodable takes unary-request methods only")
    parse = handler.request_deserializer
    type_name = getattr(parse, "__self__", None)
    type_name = type_name.DESCRIPTOR.full_name if type_name is not None else "request"
    streaming = handler.unary_stream is not None
    behavior = handler.unary_stream if streaming else handler.unary_unary
    return handler._replace(request_deserializer=_lenient(parse, type_name),
                            **{"unary_stream" if streaming else "unary_unary":
                               _refusing_undecodable(behavior, streaming)})


def claim_socket_path(path: str) -> None:
    """Remove a stale socket file; refuse when a live process listens there."""
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # left over from a killed process
        return
    finally:
        probe.close()
    raise TandemError(f"another process is serving on {path}; stop it or pick another socket")


async def serve(process: str, address: str, register: Callable[[grpc.aio.Server], None],
                services: tuple[str, ...] = (),
                on_stop: Callable[[], Awaitable[None]] | None = None,
                deferred: dict[str, Callable[[], Awaitable[None]]] | None = None) -> None:
    """Serve on `address` (a unix socket path, or host:port) until SIGTERM/SIGINT.
    Each `deferred` health service turns SERVING once its coroutine returns
    (NOT_SERVING, logged, if it raises): readiness that needs other processes."""
    is_unix = "/" in address and ":" not in address
    if is_unix:
        claim_socket_path(address)
    server = grpc.aio.server(options=GRPC_OPTIONS)
    register(server)
    health_service = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    port = server.add_insecure_port(unix_target(address) if is_unix else address)
    if not is_unix and port == 0:
        raise TandemError(f"cannot listen on {address}: is the port in use?")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    for name in ("", *services):
        await health_service.set(name, health_pb2.HealthCheckResponse.SERVING)
    pending = [asyncio.ensure_future(_when_ready(process, health_service, name, ready))
               for name, ready in (deferred or {}).items()]
    settle_the_heap(process)
    log(process, f"serving on {address}")
    try:
        await stop.wait()
    finally:
        for task in pending:
            task.cancel()
        await health_service.enter_graceful_shutdown()
        if on_stop is not None:
            await on_stop()
        await server.stop(grace=1.0)
        if is_unix and os.path.exists(address):
            os.unlink(address)


async def _when_ready(process: str, health_service, name: str, ready) -> None:
    await health_service.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        await ready()
    except Exception as e:
        log(process, f"{name} is not available: {e}")
        return
    await health_service.set(name, health_pb2.HealthCheckResponse.SERVING)
    log(process, f"{name} ready")


def run_server(process: str, main: Callable[[], Awaitable[None]]) -> int:
    """asyncio (uvloop where installed) around `main`; our errors become one line
    on stderr and exit status 2."""
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(main())
    except TandemError as e:
        log(process, f"error: {e}")
        return 2
    return 0
