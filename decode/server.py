"""The decode worker process: maps the store's memory once and serves
tandem.internal.v1.DecodeService. One thread runs the continuous-batching step
loop; each Decode call is an asyncio stream fed from that thread.

    python -m decode.server --store DIR/kvstore.sock --socket DIR/decode.sock

Pages for a request's whole output are reserved by the router before the
call, so a step never waits on the store; cancelling the call aborts the
request at the next step."""
from __future__ import annotations

import asyncio
import queue
import sys
import threading
import traceback
from dataclasses import dataclass

import torch

from decode.scheduler import DecodeScheduler, DecodeSequence, TokenOut
from decode.warmup import warm_up
from engine.compiles import CompileWatch, describe, watch_compiles
from engine.cuda_context import ReserveWatch
from engine.errors import InvalidRequestError, TandemError
from engine.stopping import FinishReason
from engine.streams import WorkerStream
from kvstore.client import StoreClient
from tandem.internal.v1 import workers_pb2 as pb
from tandem.internal.v1 import workers_pb2_grpc as pb_grpc
from tandem.serving import (TRANSFER_SERVICE, abort_with, attach_worker, log, run_server,
                            serve, transfer_group_config, worker_arguments)
from tandem.wire import generated_token_pb, sampling_from_pb, token_ids_from_pb

PROCESS = "decode"
_FINISH_PB = {FinishReason.STOP: pb.DECODE_FINISH_STOP, FinishReason.LENGTH: pb.DECODE_FINISH_LENGTH,
              FinishReason.ABORT: pb.DECODE_FINISH_ABORT}


class ReservedPagesOnly:
    """The router reserves every page a request may need; asking for more is a
    bug upstream, reported as an abort of that request only."""

    def allocate_pages(self, count: int) -> list[int]:
        raise TandemError("the request outgrew the pages the router reserved")


@dataclass
class _Subscriber:
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue


class StepLoop:
    """Owns the scheduler; every other thread talks to it through `commands`."""

    def __init__(self, scheduler: DecodeScheduler, compiles: CompileWatch | None = None) -> None:
        self.scheduler = scheduler
        self.compiles = compiles  # None: nobody watches (off CUDA nothing compiles)
        self.commands: queue.Queue = queue.Queue()
        self.subscribers: dict[str, _Subscriber] = {}
        self.stopping = threading.Event()
        # set, under the lock, once the loop has ended: a request submitted
        # later is answered at once instead of waiting for a loop that is gone
        self.ended = False
        self._ending = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="decode-steps", daemon=True)
        # one stream for the warm-up and the steps: the caching allocator
        # reuses a block only on the stream it was allocated on
        self.stream = WorkerStream(scheduler.cache.device, high_priority=True)
        self.reserve = ReserveWatch(scheduler.cache.device, lambda line: log(PROCESS, line))

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.commands.put(("wake", None))
        self.thread.join(timeout=5)

    def submit(self, seq: DecodeSequence, subscriber: _Subscriber) -> None:
        with self._ending:
            if not self.ended:
                self.commands.put(("add", (seq, subscriber)))
                return
        _deliver(subscriber, _ended_event("the decode step loop is not running"))

    def abort(self, request_id: str) -> None:
        self.commands.put(("abort", (request_id, None)))

    def abort_and_wait(self, request_id: str, timeout: float = 10.0) -> bool | None:
        """Abort, and return once the step loop has let go of the request (no
        step that could write its KV is running any more): whether it had it;
        None when the loop did not answer within `timeout`."""
        done = threading.Event()
        found: list[bool] = []
        self.commands.put(("abort", (request_id, (done, found))))
        if not done.wait(timeout):
            return None
        return bool(found and found[0])

    @torch.inference_mode()
    def warm_up(self, store: StoreClient) -> None:
        """Before start(): one short request through the scheduler on scratch
        pages (decode/warmup.py), so that the first request's steps replay a
        captured graph; a failure costs only the warm-up."""
        try:
            with self.stream.active():
                done = warm_up(store, self.scheduler,
                               after_prefill=lambda: self.reserve.check("the warm-up's prefill"))
        except (TandemError, RuntimeError) as e:
            log(PROCESS, f"warm-up failed, the first requests will compile and capture: {e!r}")
            return
        compiled = self.compiles.take() if self.compiles is not None else []
        log(PROCESS, f"warmed up in {done.seconds:.1f} s ({done.tokens} tokens, {done.drafted} "
                     f"drafts verified, {len(compiled)} kernels compiled or loaded)")
        self.reserve.check("the warm-up")

    @torch.inference_mode()
    def _run(self) -> None:
        with self.stream.active():
            try:
                self._loop()
            finally:  # stopped, or killed by what no handler catches: no stream may wait on
                self._close()

    def _loop(self) -> None:
        while not self.stopping.is_set():
            try:
                self._turn()
            except Exception as e:  # noqa: BLE001 - a bug outside a step (a command, publishing)
                # must neither kill the thread (every stream would wait for ever)
                # nor pass quietly: every request the loop holds ends with it
                log(PROCESS, f"the step loop failed: {e!r}\n{traceback.format_exc().rstrip()}")
                self._end_every_stream(f"the decode step loop failed: {e!r}")

    def _turn(self) -> None:
        """Commands, then one step and what it produced."""
        self._drain_commands(block=not self.scheduler.has_work)
        if not self.scheduler.has_work:
            return
        try:
            outs, finished = self.scheduler.step()
        except Exception as e:  # noqa: BLE001 - a bug must not wedge every stream
            log(PROCESS, f"step failed: {e!r}\n{traceback.format_exc().rstrip()}")
            self._end_failed_step(e)
            return
        self._report_compiles(len(outs))
        self._publish_tokens(outs)
        for seq in finished:
            self._publish_finished(seq)
            self.reserve.check(f"the end of {seq.request_id}")

    def _end_failed_step(self, error: Exception) -> None:
        """A step raised: end every sequence it held, also those it had
        already taken out of the batch (scheduler.progress).

        DECISION: a sequence that finished by a stop rule or its length
        earlier in the failed step is complete (StepProgress.completed): it
        gets its last tokens and its real finish, as if the step had not
        failed; the router caches and reports it like any other. A sequence
        the step dropped for want of pages keeps that ABORT and its reason.
        Every other one (still running, or waiting) ends with ABORT and the
        step's error: its tokens of this step are not sent, and the router,
        which never asked for that abort, fails the request with the detail."""
        progress = self.scheduler.progress
        complete = progress.completed()
        ids = {seq.request_id for seq in complete}
        self._publish_tokens([out for out in progress.tokens if out.request_id in ids])
        for seq in complete:
            self._publish_finished(seq)
        self._end_every_stream(f"decode step failed: {error!r}")

    def _end_every_stream(self, detail: str) -> None:
        """Ends every request the loop still streams to with ABORT and
        `detail`: the latest step's leavers not yet told (a dropped one keeps
        its own reason), the running and the waiting; then any subscriber
        left without a sequence gets a bare end, so no Decode call waits."""
        left = [s for s in self.scheduler.progress.left if s.request_id in self.subscribers]
        for seq in [*left, *self.scheduler.running, *self.scheduler.waiting]:
            self.scheduler.abort(seq.request_id)  # a no-op for one that left
            if not (seq.finish_reason is FinishReason.ABORT and seq.finish_detail):
                seq.finish_detail = detail
            seq.finish_reason = FinishReason.ABORT
            self._publish_finished(seq)
        for request_id in list(self.subscribers):
            self._send(request_id, _ended_event(detail), last=True)

    def _close(self) -> None:
        """The loop is over: refuse what comes later, and end every request
        still queued or running with an error, so that no stream hangs."""
        with self._ending:
            self.ended = True
        try:
            while True:
                command, arg = self.commands.get_nowait()
                if command == "add":
                    seq, subscriber = arg
                    self.subscribers[seq.request_id] = subscriber
                # an abort left unanswered reads as "still running" (None):
                # the router keeps the request's pages, which is always safe
        except queue.Empty:
            pass
        try:
            self._end_every_stream("the decode step loop stopped")
        except Exception as e:  # noqa: BLE001 - the last words of the loop
            log(PROCESS, f"could not end every stream: {e!r}")

    def _report_compiles(self, batch: int) -> None:
        """Logs a step that waited for Triton compiles (see engine/compiles.py)."""
        compiles = self.compiles.take() if self.compiles is not None else []
        if compiles:
            log(PROCESS, f"a decode step ({batch} sequences) waited for {describe(compiles)}")

    def _drain_commands(self, block: bool) -> None:
        try:
            command, arg = self.commands.get(timeout=0.5) if block else self.commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if command == "add":
                self._join(*arg)
            elif command == "abort":
                request_id, ack = arg
                seq = self.scheduler.abort(request_id)
                try:
                    if seq is not None:
                        self._publish_finished(seq)
                finally:  # answered even so: between steps nothing of it runs now
                    if ack is not None:
                        ack[1].append(seq is not None)
                        ack[0].set()
            try:
                command, arg = self.commands.get_nowait()
            except queue.Empty:
                return

    def _join(self, seq: DecodeSequence, subscriber: _Subscriber) -> None:
        """A new request joins the batch; one the scheduler cannot take ends
        at once with the reason, the others run on."""
        self.subscribers[seq.request_id] = subscriber
        try:
            self.scheduler.add(seq)
        except Exception as e:  # noqa: BLE001 - this request's failure, not the loop's
            log(PROCESS, f"{seq.request_id} could not join the batch: {e!r}\n"
                         f"{traceback.format_exc().rstrip()}")
            seq.finish_reason = FinishReason.ABORT
            seq.finish_detail = f"could not join the decode batch: {e!r}"
            self._publish_finished(seq)

    def _send(self, request_id: str, event, last: bool = False) -> None:
        sub = self.subscribers.pop(request_id, None) if last else self.subscribers.get(request_id)
        if sub is not None:
            _deliver(sub, event)

    def _publish_tokens(self, outs: list[TokenOut]) -> None:
        """One event per request per step: a speculative step emits several
        tokens at once, with the step's draft counts."""
        events: dict[str, pb.DecodeTokens] = {}
        for out in outs:
            event = events.setdefault(out.request_id, pb.DecodeTokens())
            event.tokens.append(generated_token_pb(out.token_id, out.logprob, out.top_logprobs))
            event.drafted += out.drafted
            event.accepted += out.accepted
        for request_id, event in events.items():
            self._send(request_id, pb.DecodeEvent(tokens=event))

    def _publish_finished(self, seq: DecodeSequence) -> None:
        try:
            final = self.scheduler.settle(seq)
        except Exception as e:  # nothing of its KV goes to the prefix cache then
            log(PROCESS, f"could not settle {seq.request_id}'s KV: {e!r}")
            final = 0
        try:
            finished = pb.DecodeFinished(reason=_FINISH_PB[seq.finish_reason],
                                         detail=seq.finish_detail, pages=seq.pages,
                                         boundary_tokens=seq.boundary_tokens, final_tokens=final)
            event = pb.DecodeEvent(finished=finished)
        except Exception as e:  # noqa: BLE001 - its stream must end all the same
            log(PROCESS, f"could not describe the end of {seq.request_id}: {e!r}")
            event = _ended_event(f"{seq.finish_detail or 'ended'}; its end could not be "
                                 f"described: {e!r}")
        self._send(seq.request_id, event, last=True)


def _ended_event(detail: str) -> pb.DecodeEvent:
    """An ABORT end with nothing for the prefix cache (no final tokens), for a
    request whose sequence is gone or could not be described."""
    return pb.DecodeEvent(finished=pb.DecodeFinished(reason=pb.DECODE_FINISH_ABORT, detail=detail))


def _deliver(subscriber: _Subscriber, event) -> None:
    """Hands `event` to the subscriber's stream on its own event loop; a loop
    already closed (its server stopped) has nobody listening."""
    try:
        subscriber.loop.call_soon_threadsafe(subscriber.events.put_nowait, event)
    except RuntimeError:
        pass


def sequence_from_pb(r: pb.DecodeRequest, eos_token_ids, cache) -> DecodeSequence:
    """The request as the scheduler runs it; its open pages (a format that
    quantizes whole pages) resume where the prefill left them."""
    prompt = token_ids_from_pb(r.prompt_le32, "prompt_le32").tolist()
    if not prompt:
        raise InvalidRequestError("a decode request needs its prompt")
    check_pool_ids(r, cache)
    open_pages = cache.open_pages_for(list(r.open_pages), list(r.pages), list(r.open_held),
                                      committed=len(prompt))
    return DecodeSequence(
        request_id=r.request_id, prompt=prompt, output=[r.first_token],
        params=sampling_from_pb(r.sampling), pages=list(r.pages), state_slot=r.state_slot,
        eos_token_ids=eos_token_ids, boundary_slot=r.boundary_slot,
        spare_slots=list(r.spare_slots), open_pages=open_pages)


def check_pool_ids(r: pb.DecodeRequest, cache) -> None:
    """Every page and GDN state slot id of the request names one of the
    store's: the step's kernels index the pools with them unchecked (on a GPU
    a bad id reads or writes another allocation's memory; a negative slot is
    the last one, another request's). Open page ids are checked with the open
    pages (cache.open_pages_for)."""
    cache.check_page_ids(r.pages)
    if not cache.config.is_hybrid:  # no GDN state: the slot fields are never read
        return
    cache.check_state_slot(r.state_slot, "state_slot")
    cache.check_state_slot(r.boundary_slot, "boundary_slot", optional=True)
    for slot in r.spare_slots:
        cache.check_state_slot(slot, "spare slot")
    slots = [s for s in (r.state_slot, r.boundary_slot, *r.spare_slots) if s >= 0]
    if len(set(slots)) != len(slots):  # one would overwrite another's state each step
        raise InvalidRequestError(f"a state slot is named twice among state_slot, boundary_slot "
                                  f"and spare_slots: {slots}")


class DecodeService(pb_grpc.DecodeServiceServicer):
    def __init__(self, steps: StepLoop, inbox=None) -> None:
        self.steps = steps
        self.inbox = inbox  # disaggregated topology over the group: incoming transfers

    async def Abort(self, request, context):
        # the transfer first: once cancel returns nothing of it is written any more
        receiving = (self.inbox is not None
                     and await asyncio.to_thread(self.inbox.cancel, request.request_id))
        found = await asyncio.to_thread(self.steps.abort_and_wait, request.request_id)
        if found is None:  # the router keeps the pages a step may still write
            import grpc
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"the decode step loop has not let go of "
                                f"{request.request_id!r} yet")
        return pb.AbortWorkReply(found=found or receiving)

    async def Receive(self, request, context):
        import grpc

        from transfer.protocol import TransferError

        if self.inbox is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this decode worker receives no transfers over a process group "
                                "(shared topology or peer copies)")
        try:
            incoming = self.inbox.register(
                request.request_id, request.transfer_id,
                self.inbox.group.config.rank_of_prefill(request.prefill_worker),
                request.dest_pages, request.dest_state_slot, request.dest_snapshot_slot)
        except (TransferError, ValueError) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        try:
            yield pb.ReceiveEvent(registered=pb.ReceiveRegistered())
            while not await asyncio.to_thread(incoming.done.wait, 1.0):
                pass
        finally:
            if not incoming.done.is_set():  # the router went away: stop writing
                self.inbox.cancel(request.request_id)
        if incoming.error is not None:
            code = (grpc.StatusCode.CANCELLED if incoming.error == "cancelled"
                    else grpc.StatusCode.ABORTED if "stopped" in incoming.error
                    else grpc.StatusCode.UNAVAILABLE)
            await context.abort(code, incoming.error)
        seconds = (incoming.finished or incoming.started) - (incoming.first_byte or incoming.started)
        yield pb.ReceiveEvent(done=pb.ReceiveDone(pages=incoming.pages, bytes=incoming.bytes,
                                                  seconds=seconds))

    async def Decode(self, request, context):
        try:
            # stop ids arrive resolved (EOS included unless ignore_eos)
            seq = sequence_from_pb(request, eos_token_ids=(), cache=self.steps.scheduler.cache)
        except InvalidRequestError as e:
            await abort_with(context, e)
        subscriber = _Subscriber(asyncio.get_running_loop(), asyncio.Queue())
        self.steps.submit(seq, subscriber)
        done = False
        try:
            while not done:
                event = await subscriber.events.get()
                done = event.HasField("finished")
                yield event
        finally:
            if not done:  # the router cancelled or went away
                self.steps.abort(seq.request_id)


async def _main(args) -> None:
    store = attach_worker(PROCESS, args)
    spec = store.info.speculative  # the store laid out its memory (MTP KV, spare slots)
    scheduler = DecodeScheduler(store.model, store.cache, ReservedPagesOnly(), max_batch=args.max_batch,
                                cuda_graphs=False if args.no_cuda_graphs else None,
                                speculative=spec)
    if spec.enabled:
        log(PROCESS, f"speculative decoding: {spec.method}, {spec.num_draft_tokens} draft tokens")
    steps = StepLoop(scheduler, watch_compiles(store.device))
    if steps.compiles is not None:  # a GPU: kernels to load and graphs to capture
        steps.warm_up(store)
    steps.start()
    inbox, ready, close_inbox = _transfer_inbox(args, store)

    async def on_stop() -> None:
        steps.stop()
        close_inbox()
        store.close()

    deferred = {TRANSFER_SERVICE: ready} if ready is not None else None
    await serve(PROCESS, args.socket, lambda s: pb_grpc.add_DecodeServiceServicer_to_server(
        DecodeService(steps, inbox), s), ("tandem.internal.v1.DecodeService",), on_stop,
        deferred=deferred)


def _transfer_inbox(args, store: StoreClient):
    """(inbox, readiness coroutine, close) in the disaggregated topology."""
    config = transfer_group_config(args)
    if config is None:
        return None, None, lambda: None
    if args.transfer_method == "peer":  # the prefill workers copy into our store

        async def ready_now() -> None:
            return None
        return None, ready_now, lambda: None
    from transfer.group import TransferGroup
    from transfer.inbox import Inbox
    from transfer.pages import StoreBuffers

    group = TransferGroup.joining(config, store.cache.device)
    inbox = Inbox(group, StoreBuffers.of_arenas(store.arenas), range(config.num_prefill))

    async def ready() -> None:
        await group.joined_async()
        inbox.start()

    def close() -> None:
        inbox.stop()
        group.close()
    log(PROCESS, group.describe())
    return inbox, ready, close


def main(argv: list[str] | None = None) -> int:
    p = worker_arguments("python -m decode.server", __doc__.splitlines()[0])
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="run every decode step eagerly (graphs are on by default on CUDA)")
    args = p.parse_args(argv)
    return run_server(PROCESS, lambda: _main(args))


if __name__ == "__main__":
    sys.exit(main())
