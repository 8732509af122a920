"""The prefill worker process: maps the store's weights and KV memory once and
serves tandem.internal.v1.PrefillService over a unix socket.

    python -m prefill.server --store DIR/kvstore.sock --socket DIR/prefill.sock

One prefill runs at a time, on a worker thread, in bounded chunks; between
chunks it checks whether the router cancelled the call (and, on a GPU, gives
the decode worker's higher-priority stream its turn)."""
from __future__ import annotations

import asyncio
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from engine.errors import InvalidRequestError, TandemError
from engine.streams import worker_stream, yield_to_decode
from kvstore.client import StoreClient, wait_for_store
from prefill.runner import PrefillJob, run_prefill
from tandem.internal.v1 import workers_pb2 as pb
from tandem.internal.v1 import workers_pb2_grpc as pb_grpc
from tandem.serving import (abort_with, log, run_server, serve, share_cpu_with_the_other_worker,
                            worker_arguments)
from tandem.wire import generated_token_pb, sampling_from_pb

PROCESS = "prefill"


class Cancelled(TandemError):
    """The router gave up on the request mid-prefill."""


def job_from_pb(r: pb.PrefillRequest) -> PrefillJob:
    return PrefillJob(
        request_id=r.request_id, tokens=tuple(r.tokens), start=r.start, pages=tuple(r.pages),
        state_slot=r.state_slot, restore_slot=r.restore_slot,
        snapshots=tuple((s.tokens, s.slot) for s in r.snapshots),
        params=sampling_from_pb(r.sampling))


class _Work:
    """A prefill the worker has accepted: how to stop it and when it is over."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.finished = threading.Event()


class PrefillService(pb_grpc.PrefillServiceServicer):
    def __init__(self, store: StoreClient, chunk: int) -> None:
        self.store = store
        self.chunk = chunk
        self.gpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill")
        self.work: dict[str, _Work] = {}

    async def Prefill(self, request, context):
        try:
            job = job_from_pb(request)
        except InvalidRequestError as e:
            await abort_with(context, e)
        work = self.work[job.request_id] = _Work()
        context.add_done_callback(lambda _ctx: work.cancelled.set())

        def between_chunks() -> None:
            yield_to_decode(self.store.cache.device)
            if work.cancelled.is_set():
                raise Cancelled(f"request {job.request_id} was cancelled during prefill")

        def run():
            try:
                between_chunks()  # it may have been cancelled while queued
                with worker_stream(self.store.cache.device, high_priority=False):
                    return run_prefill(self.store.model, self.store.cache, job, self.chunk,
                                       between_chunks)
            finally:
                # forgotten only here, by the thread: until the chunk in flight
                # is done, Abort must find the work and wait for it
                if self.work.get(job.request_id) is work:
                    del self.work[job.request_id]
                work.finished.set()

        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(self.gpu, run)
        except InvalidRequestError as e:
            await abort_with(context, e)
        except Cancelled:
            return pb.PrefillResponse()  # nobody is listening
        return pb.PrefillResponse(first=generated_token_pb(result.token_ids[0], result.logprobs[0],
                                                           result.top_logprobs[0]),
                                  prefilled_tokens=len(job.tokens) - job.start)

    async def Abort(self, request, context):
        """Returns once the request's chunk in flight (if any) has finished."""
        work = self.work.get(request.request_id)
        if work is None:
            return pb.AbortWorkReply(found=False)
        work.cancelled.set()
        await asyncio.to_thread(work.finished.wait, 30.0)
        return pb.AbortWorkReply(found=True)


async def _main(args) -> None:
    share_cpu_with_the_other_worker()
    wait_for_store(args.store, timeout=args.store_timeout)
    store = StoreClient.connect(args.store, name=PROCESS)
    log(PROCESS, f"mapped the store's memory ({store.info.model_id})")
    service = PrefillService(store, args.chunk)

    async def on_stop() -> None:
        service.gpu.shutdown(wait=False, cancel_futures=True)
        store.close()

    await serve(PROCESS, args.socket, lambda s: pb_grpc.add_PrefillServiceServicer_to_server(service, s),
                ("tandem.internal.v1.PrefillService",), on_stop)


def main(argv: list[str] | None = None) -> int:
    p = worker_arguments("python -m prefill.server", __doc__.splitlines()[0])
    p.add_argument("--chunk", type=int, default=512, help="tokens per prefill forward")
    args = p.parse_args(argv)
    return run_server(PROCESS, lambda: _main(args))


if __name__ == "__main__":
    sys.exit(main())
