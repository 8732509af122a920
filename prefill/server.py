"""The prefill worker process: maps the store's weights and KV memory once and
serves tandem.internal.v1.PrefillService over a unix socket.

    python -m prefill.server --store DIR/kvstore.sock --socket DIR/prefill.sock

One prefill runs at a time, on a worker thread, in bounded chunks; between
chunks it checks whether the router cancelled the call (and, on a GPU, gives
the decode worker's higher-priority stream its turn)."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Iterator

import grpc

from engine.compiles import CompileWatch, describe, watch_compiles
from engine.cuda_context import ReserveWatch, grow_segments_in_place
from engine.errors import InvalidRequestError, TandemError
from engine.profiling import Timeline, profiled
from engine.streams import WorkerStream, yield_to_decode
from kvstore.client import StoreClient, wait_for_store
from prefill.runner import PrefillJob, run_prefill
from prefill.warmup import warm_up
from tandem.internal.v1 import workers_pb2 as pb
from tandem.internal.v1 import workers_pb2_grpc as pb_grpc
from tandem.serving import (TRANSFER_SERVICE, abort_with, attach_worker, log, run_server,
                            serve, transfer_group_config, worker_arguments)
from transfer.outbox import Link, OutgoingTransfer
from transfer.protocol import TransferError, TransferSpec
from tandem.wire import generated_token_pb, sampling_from_pb, token_ids_from_pb

PROCESS = "prefill"
# how long Abort waits for the chunk in flight: under the router's own timeout
# (router.server.STOP_TIMEOUT_S), so that it hears "still running", not silence
STOP_WAIT_S = 25.0
# `tandem serve` passes its environment on, so this turns profiling on there:
# TANDEM_PROFILE_PREFILL=N profiles every N-th request
PROFILE_ENV = "TANDEM_PROFILE_PREFILL"


class Cancelled(TandemError):
    """The router gave up on the request mid-prefill."""


def job_from_pb(r: pb.PrefillRequest) -> PrefillJob:
    """The request as the runner takes it; its tokens stay a view of the
    request's packed bytes (a malformed field is an InvalidRequestError)."""
    return PrefillJob(
        request_id=r.request_id, tokens=token_ids_from_pb(r.tokens_le32, "tokens_le32"),
        start=r.start, pages=tuple(r.pages),
        state_slot=r.state_slot, restore_slot=r.restore_slot,
        snapshots=tuple((s.tokens, s.slot) for s in r.snapshots),
        params=sampling_from_pb(r.sampling), open_pages=tuple(r.open_pages))


def transfer_from_pb(t: pb.KVTransfer) -> TransferSpec:
    try:
        return TransferSpec(t.transfer_id, t.decode_worker, t.first_page, tuple(t.dest_pages),
                            t.dest_state_slot, t.snapshot_slot, t.dest_snapshot_slot)
    except ValueError as e:
        raise InvalidRequestError(f"bad transfer: {e}") from e


class _Work:
    """A prefill the worker has accepted: how to stop it and when it is over."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.finished = threading.Event()


class PrefillService(pb_grpc.PrefillServiceServicer):
    def __init__(self, store: StoreClient, chunk: int, link: Link | None = None,
                 compiles: CompileWatch | None = None, profile_every: int = 0) -> None:
        self.store = store
        self.compiles = compiles  # None: nobody watches (off CUDA nothing compiles)
        # log where every n-th request's prefill time went (0: none); the
        # others keep their speed, so a bench's figures stay clean
        self.profile_every = profile_every
        self.requests = 0
        self.chunk = chunk
        self.link = link  # disaggregated topology: how pages reach decode stores
        self.gpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill")
        self.stream = WorkerStream(store.cache.device, high_priority=False)
        self.reserve = ReserveWatch(store.cache.device, lambda line: log(PROCESS, line))
        self.work: dict[str, _Work] = {}

    async def Prefill(self, request, context):
        arrived = time.perf_counter()
        try:
            job = job_from_pb(request)
            # here, not only in the runner: a bad id is refused at once, not
            # after waiting behind another prefill
            job.check_ids(self.store.cache)
            spec = self._transfer_spec(request)
        except InvalidRequestError as e:
            await abort_with(context, e)
        work = self.work[job.request_id] = _Work()
        context.add_done_callback(lambda _ctx: work.cancelled.set())

        def between_chunks() -> None:
            yield_to_decode(self.store.cache.device)
            if work.cancelled.is_set():
                raise Cancelled(f"request {job.request_id} was cancelled during prefill")

        def run():
            out = None
            try:
                open_pages = self.store.cache.open_pages_for(job.open_pages, job.pages)
                if spec is not None and open_pages is not None:
                    raise InvalidRequestError(
                        f"KV format {self.store.cache.kv_format.name} keeps open pages in "
                        "staging, which KV transfers do not carry: serve it in the shared "
                        "topology")
                if spec is not None:
                    out = OutgoingTransfer(spec, self.link, job.pages, self.store.cache.page_size,
                                           len(job.tokens),
                                           len(self.store.info.config.attention_layers))
                between_chunks()  # it may have been cancelled while queued
                with self.stream.active():
                    sent_before = self.link.bytes_sent if out else 0
                    # layer by layer: each KV write's finished pages leave at once
                    self.store.cache.kv_written = out.layer_written if out else None
                    started = time.perf_counter()
                    with self._profiled(job, started - arrived) as timeline:
                        steps = between_chunks if timeline is None else \
                            timeline.marking(between_chunks)
                        result = run_prefill(self.store.model, self.store.cache, job, self.chunk,
                                             steps, out.chunk_starts if out else None,
                                             open_pages)
                    self._report_compiles(job, time.perf_counter() - started)
                    self.reserve.check(f"the prefill of {job.request_id}")
                    held = open_pages.held if open_pages is not None else []
                    if out is None:
                        return result, 0, 0, held
                    pages = out.finish(job.state_slot)
                    return result, pages, self.link.bytes_sent - sent_before, held
            finally:
                self.store.cache.kv_written = None
                if out is not None:
                    try:
                        out.abort()  # a no-op after finish: the decode side stops waiting
                    except TransferError as e:
                        log(PROCESS, f"could not tell the decode side of the abort: {e}")
                # forgotten only here, by the thread: until the chunk in flight
                # is done, Abort must find the work and wait for it
                self._forget(job.request_id, work)

        queued = self.gpu.submit(run)
        # a call cancelled while its job waits behind another prefill cancels
        # the job, and `run` never runs: forget it here, or Abort waits its
        # full 30 s for it (the router holding the request's pages meanwhile)
        queued.add_done_callback(lambda f: f.cancelled() and self._forget(job.request_id, work))
        try:
            result, pages, sent, held = await asyncio.wrap_future(queued)
        except InvalidRequestError as e:
            await abort_with(context, e)
        except TransferError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {e}")
        except Cancelled:
            return pb.PrefillResponse()  # nobody is listening
        return pb.PrefillResponse(first=generated_token_pb(result.token_ids[0], result.logprobs[0],
                                                           result.top_logprobs[0]),
                                  prefilled_tokens=len(job.tokens) - job.start,
                                  transferred_pages=pages, transferred_bytes=sent,
                                  open_held=held)

    def _forget(self, request_id: str, work: _Work) -> None:
        """`work` is over: Abort no longer finds it, and one waiting for it returns."""
        if self.work.get(request_id) is work:
            del self.work[request_id]
        work.finished.set()

    @contextmanager
    def _profiled(self, job: PrefillJob, waited: float) -> Iterator[Timeline | None]:
        """With profiling on, logs where each request's prefill went: its
        chunks' wall times, the garbage collector's pauses and the SM clock
        (engine.profiling.Timeline) for every request, and for every n-th
        the kernels (CPU: aten ops) by kind under torch.profiler, which slows
        that request; and what came before (parsing, queueing behind another
        prefill)."""
        self.requests += 1
        if not self.profile_every:
            yield None
            return
        deep = self.requests % self.profile_every == 0
        device = self.store.cache.device
        with Timeline(device) as timeline, \
                (profiled(device) if deep else nullcontext()) as profile:
            yield timeline

        def report() -> None:
            line = (f"request {job.request_id} ({len(job.tokens) - job.start} new tokens after "
                    f"{job.start}): {1e3 * waited:.1f} ms from arrival to its prefill; prefill "
                    f"{timeline.describe()}")
            if profile is not None:
                line += f"; profiled: {profile.describe()}"
            log(PROCESS, line)
        # reading the trace takes longer than a turn's prefill on the 27B: it
        # runs on the worker's thread after this request, not before its reply
        self.gpu.submit(report)

    def _report_compiles(self, job: PrefillJob, seconds: float) -> None:
        """Logs a request that waited for Triton compiles (see engine/compiles.py)."""
        compiles = self.compiles.take() if self.compiles is not None else []
        if compiles:
            log(PROCESS, f"request {job.request_id} ({len(job.tokens) - job.start} new tokens "
                         f"after {job.start}, {seconds:.2f} s) waited for {describe(compiles)}")

    def _transfer_spec(self, request) -> TransferSpec | None:
        if not request.HasField("transfer"):
            return None
        if self.link is None:
            raise InvalidRequestError("this prefill worker runs in the shared topology: it "
                                      "cannot send a transfer")
        return transfer_from_pb(request.transfer)

    async def Abort(self, request, context):
        """Returns once the request's chunk in flight (if any) has finished; a
        chunk still running after STOP_WAIT_S is DEADLINE_EXCEEDED, so that the
        router keeps the pages it may still write."""
        work = self.work.get(request.request_id)
        if work is None:
            return pb.AbortWorkReply(found=False)
        work.cancelled.set()
        # polled, not waited for on a thread: many aborts at once would fill
        # the default pool, which the store calls share
        deadline = time.monotonic() + STOP_WAIT_S
        while not work.finished.is_set():
            if time.monotonic() >= deadline:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"the prefill of {request.request_id!r} is still running")
            await asyncio.sleep(0.005)
        return pb.AbortWorkReply(found=True)


def chunk_for(asked: int, planned: int) -> int:
    """The worker's prefill chunk: the store's planned one unless a smaller
    one is asked (0: none is). A larger one would pass the activation
    reserve of the store's memory plan, so it is refused."""
    if asked < 0:
        raise TandemError(f"--chunk must be a number of tokens >= 1 (0: the store's), got {asked}")
    if asked > planned:
        raise TandemError(f"--chunk {asked} is larger than the {planned}-token prefill chunk "
                          "the store's memory plan reserved activations for: give the store "
                          f"--prefill-chunk-tokens {asked} (tandem serve --prefill-chunk) or "
                          "leave --chunk out to run the store's")
    return asked or planned


async def _main(args) -> None:
    store = attach_worker(PROCESS, args)
    chunk = chunk_for(args.chunk, store.info.prefill_chunk_tokens)
    log(PROCESS, f"prefill chunks of up to {chunk} tokens")
    link, ready, close_link = _transfer_link(args, store)
    compiles = watch_compiles(store.device)
    service = PrefillService(store, chunk, link, compiles, args.profile_every)
    if compiles is not None:
        _warm_up(service, compiles)

    async def on_stop() -> None:
        service.gpu.shutdown(wait=False, cancel_futures=True)
        close_link()
        store.close()

    await serve(PROCESS, args.socket, lambda s: pb_grpc.add_PrefillServiceServicer_to_server(service, s),
                ("tandem.internal.v1.PrefillService",), on_stop,
                deferred={TRANSFER_SERVICE: ready} if link is not None else None)


def _warm_up(service: PrefillService, compiles: CompileWatch) -> None:
    """Compiles what a request's prefill runs before serving (prefill/warmup.py);
    a failure costs only the warm-up, the first requests then compile."""
    try:
        with service.stream.active():
            seconds = warm_up(service.store, service.chunk)
    except (TandemError, RuntimeError) as e:
        log(PROCESS, f"warm-up failed, requests will compile what they need: {e!r}")
        return
    done = compiles.take()
    log(PROCESS, f"warmed up in {seconds:.1f} s ({len(done)} kernels compiled or loaded)")
    service.reserve.check("the warm-up")
    # fla-core's first calls autotune through Triton's benchmark, whose 256
    # MiB L2-flush buffer would stay in the reserve for good; what requests
    # need is allocated again (and reported) as they run
    service.reserve.release("the warm-up's cached blocks going back")


def _transfer_link(args, store: StoreClient):
    """(link, readiness coroutine, close) for the disaggregated topology, or Nones."""
    config = transfer_group_config(args)
    if config is None:
        return None, None, lambda: None
    from transfer.pages import StoreBuffers

    local = StoreBuffers.of_arenas(store.arenas)
    if args.transfer_method == "peer":
        from transfer.outbox import PeerLink

        peers, clients = _map_peer_stores(args)
        link = PeerLink(local, peers)

        async def ready() -> None:
            return None

        def close() -> None:
            for c in clients:
                c.close()
        log(PROCESS, f"peer copies into {len(peers)} decode stores")
        return link, ready, close
    from transfer.group import TransferGroup
    from transfer.outbox import DistLink

    group = TransferGroup.joining(config, store.cache.device)
    link = DistLink(local, group)

    def close() -> None:
        link.close()
        group.close()
    log(PROCESS, group.describe())
    return link, group.joined_async, close


def _map_peer_stores(args):
    """Attach to each decode store and map its kv and state arenas (never the weights)."""
    from kvstore.arena import Arena
    from transfer.pages import StoreBuffers

    sockets = [s for s in args.peer_stores.split(",") if s]
    if not sockets:
        raise TandemError("--transfer-method peer needs --peer-stores")
    peers, clients = [], []
    for sock in sockets:
        wait_for_store(sock, timeout=args.store_timeout)
        client = StoreClient.connect(sock, name=f"{PROCESS}-peer", map_memory=False)
        info = client.info
        kv = Arena.open("kv", info.arenas["kv"], info.store_pid)
        state = Arena.open("state", info.arenas["state"], info.store_pid)
        peers.append(StoreBuffers(kv.tensors("kv."), state.tensors()))
        clients.append(client)
    return peers, clients


def _request_count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"a request count (0 = none) is needed, got {text!r} "
                                         f"(--profile-every or ${PROFILE_ENV})")
    return int(text)


def parser():
    p = worker_arguments("python -m prefill.server", __doc__.splitlines()[0])
    p.add_argument("--chunk", type=int, default=0,
                   help="tokens per prefill forward, at most the store's planned chunk "
                        "(default 0: the store's)")
    # argparse runs a string default through `type` too: a bad variable is a usage error
    p.add_argument("--profile-every", type=_request_count, default=os.environ.get(PROFILE_ENV) or "0",
                   metavar="N", help="log where every N-th request's prefill time goes "
                                     "(torch.profiler, which slows that prefill a little; "
                                     f"default ${PROFILE_ENV}, else 0: none)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    grow_segments_in_place()  # before the store's memory is mapped: the first CUDA call
    return run_server(PROCESS, lambda: _main(args))


if __name__ == "__main__":
    sys.exit(main())
