"""python -m openai_api --router HOST:PORT [--host 127.0.0.1] [--port 8000] [--api-key KEY]

Waits for the router (GetModelInfo answers), then serves the OpenAI HTTP API
until SIGTERM/SIGINT. The key may also come from the environment
(TANDEM_API_KEY), which keeps it out of the process list; `tandem serve`
passes it that way. Errors of ours print one line and exit with status 2."""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

import grpc

PROCESS = "openai_api"
API_KEY_ENV = "TANDEM_API_KEY"


def log(message: str) -> None:
    print(f"{PROCESS}: {message}", file=sys.stderr, flush=True)


class StartError(Exception):
    """Start-up failed for a reason the message states."""


async def _model_info(stub, timeout_s: float):
    """The router's ModelInfo, waiting for the router to come up."""
    from tandem.v1 import generation_pb2 as pb

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            return await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=2.0)
        except grpc.aio.AioRpcError as e:
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise StartError(f"the router answered GetModelInfo with {e.code().name}: "
                                 f"{e.details()}") from None
            if loop.time() > deadline:
                raise StartError(f"no router answered within {timeout_s:g} s") from None
            await asyncio.sleep(0.2)


async def serve(args) -> None:
    from aiohttp import web

    from openai_api.app import Gateway
    from tandem.v1 import generation_pb2_grpc as pb_grpc

    channel = grpc.aio.insecure_channel(args.router, options=[
        ("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)])
    try:
        stub = pb_grpc.GenerationServiceStub(channel)
        info = await _model_info(stub, args.router_timeout)
        api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
        gateway = Gateway(stub, info, api_key, args.model_name)
        # handler_cancellation: a client that disconnects cancels its handler,
        # whose finally cancels the gRPC call (the router then frees the pages)
        runner = web.AppRunner(gateway.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, args.host, args.port).start()
        except OSError as e:
            raise StartError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log(f"serving {gateway.model_name} on http://{args.host}:{args.port}/v1 "
            f"(API key {'required' if api_key else 'off'})")
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
    finally:
        await channel.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m openai_api",
                                description="OpenAI-compatible HTTP API in front of a tandem router")
    p.add_argument("--router", required=True, help="the router's gRPC address, e.g. 127.0.0.1:50051")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, else none)")
    p.add_argument("--model-name", default=None,
                   help="the model id clients send (default: the served model's file name "
                        "without .gguf; the router's full model name is accepted too)")
    p.add_argument("--router-timeout", type=float, default=60.0,
                   help="seconds to wait for the router at start-up")
    args = p.parse_args(argv)
    if not 0 < args.port < 65536:
        p.error(f"--port must be in 1..65535, got {args.port}")
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(serve(args))
    except StartError as e:
        log(f"error: {e}")
        return 2
    except ImportError as e:
        log(f"error: {e.name} is not installed (pip install aiohttp)")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
