"""Process plumbing the worker and router servers share: a grpc.aio server on
a unix socket or TCP address with gRPC health, shutdown on SIGTERM/SIGINT,
and the mapping from our errors to gRPC status codes."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.errors import InvalidRequestError, TandemError

MAX_MESSAGE_BYTES = 64 << 20  # token lists of long prompts exceed the 4 MiB default
GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


def unix_target(path: str) -> str:
    return f"unix:{path}"


def share_cpu_with_the_other_worker() -> None:
    """On the CPU, prefill and decode run at once in two processes: give each
    half the cores, or their thread pools fight over every core (seen here:
    100x slower steps on 2 cores). No effect on a GPU's work."""
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))


def worker_arguments(prog: str, description: str):
    """The flags every worker shares: where the store is and where to serve."""
    import argparse

    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--store", required=True, help="the kvstore's unix socket")
    p.add_argument("--socket", required=True, help="unix socket to serve on")
    p.add_argument("--device", default=None, help="ignored: the store's memory decides")
    p.add_argument("--store-timeout", type=float, default=60.0)
    return p


def log(process: str, message: str) -> None:
    print(f"{process}: {message}", file=sys.stderr, flush=True)


def status_of(error: Exception) -> grpc.StatusCode:
    """The gRPC status for an error we raised on purpose."""
    from kvstore.client import StoreCapacityError, StoreUnavailable

    if isinstance(error, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, StoreCapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, StoreUnavailable):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


async def abort_with(context, error: TandemError) -> None:
    await context.abort(status_of(error), str(error))


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
                on_stop: Callable[[], Awaitable[None]] | None = None) -> None:
    """Serve on `address` (a unix socket path, or host:port) until SIGTERM/SIGINT."""
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
    log(process, f"serving on {address}")
    try:
        await stop.wait()
    finally:
        await health_service.enter_graceful_shutdown()
        if on_stop is not None:
            await on_stop()
        await server.stop(grace=1.0)
        if is_unix and os.path.exists(address):
            os.unlink(address)


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
