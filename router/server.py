"""The router process: the public tandem.v1.GenerationService (grpc.aio on
uvloop), tokenization and chat templates, and the orchestration of each
request through the store, the prefill worker and the decode worker.

    python -m router.server --store DIR/kvstore.sock --prefill DIR/prefill.sock \\
        --decode DIR/decode.sock --host 127.0.0.1 --port 50051 --metrics-port 9464

One request: validate -> match the prompt in the prefix cache (locking it) ->
reserve pages for prompt and output and GDN slots -> Prefill the uncached
suffix (taking page-aligned snapshots) -> insert the prompt into the cache ->
Decode, streaming text back -> insert prompt+output -> release the rest.
Everything the request holds is given back in `finally`, whatever happened.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
from grpc_reflection.v1alpha import reflection

from engine.chunking import snapshot_points
from engine.errors import InvalidRequestError, TandemError
from engine.loader import load_tokenizer
from kvstore.client import StoreCapacityError, StoreClient, StoreError, wait_for_store
from kvstore.control import Allocation
from router.metrics import RouterMetrics
from router.requests import GenerationRequest, chat_prompt, request_from_pb
from router.text import TextStream
from tandem.internal.v1 import workers_pb2 as wpb
from tandem.internal.v1 import workers_pb2_grpc as wpb_grpc
from tandem.serving import (WorkerUnavailable, add_refusing_undecodable, log, run_server, serve,
                            status_of, worker_channel)
from tandem.wire import pack_token_ids, packed_prefix, sampling_to_pb
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc as pb_grpc

PROCESS = "router"
SERVICE = "tandem.v1.GenerationService"
# requests tokenized (or chats rendered) at once, off the event loop
TOKENIZER_THREADS = 4
# how long a worker may take to stop a request (it finishes the chunk or step
# in flight), and how often one that did not is asked again
STOP_TIMEOUT_S = 30.0
STOP_RETRY_S = 10.0
_FINISH = {wpb.DECODE_FINISH_STOP: pb.FINISH_REASON_STOP,
           wpb.DECODE_FINISH_LENGTH: pb.FINISH_REASON_LENGTH,
           wpb.DECODE_FINISH_ABORT: pb.FINISH_REASON_ABORT}
_FINISH_NAME = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                pb.FINISH_REASON_ABORT: "abort"}


@dataclass(frozen=True)
class RouterConfig:
    snapshot_every: int = 0  # extra GDN snapshots every N prompt tokens (0 = prompt end only)
    model_name: str = ""

    def __post_init__(self) -> None:
        if self.snapshot_every < 0:
            raise ValueError("snapshot_every must be >= 0")

    def check_page_size(self, page_size: int) -> None:
        """Snapshots sit on page boundaries: an interval that is not whole pages
        would fail every hybrid request (engine.chunking.snapshot_points), so the
        router refuses it when it learns the store's page size, at start-up."""
        if self.snapshot_every % page_size:
            raise ValueError(f"snapshot_every {self.snapshot_every} is not a multiple of the "
                             f"store's page size {page_size}: use 0 or a multiple of {page_size}")


@dataclass
class Held:
    """What one request holds in the store; given back in `finally`."""

    pages: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)
    # store calls that take locks or pages, which record what they took here
    # when they finish (Router._acquire); awaited before giving back
    pending: list = field(default_factory=list)


@dataclass
class Running:
    """A live request, as Abort sees it."""

    request_id: str
    # the id the workers know the request by: the client's id made unique per
    # admission, so a give-back still stopping an ended request's work (its
    # Abort retried in the background) never stops a new request that reuses
    # the client's id
    worker_id: str = ""
    aborted: bool = False
    decode_call: object = None
    # the worker that may still be writing this request's KV ("prefill",
    # "decode", or "transfer" = both); asked to stop, and waited for, before
    # the pages are given back
    busy_in: str | None = None
    # disaggregated topology: the workers and decode store picked for it
    prefill_stub: object = None
    decode_stub: object = None
    decode_store: object = None
    prefill_held: object = None  # Held in the prefill worker's store
    prefill_store: object = None
    route: object = None  # router.disagg.Route
    counted: list = field(default_factory=list)  # workers whose in-flight count it raised
    # what tandem_requests metrics report when it ends, however it ends
    finish: str | None = None  # the finish reason's name, once it finished (not failed)
    generated: int = 0  # tokens sent to the client
    cached_tokens: int = 0

    def __post_init__(self) -> None:
        self.worker_id = self.worker_id or self.request_id


@dataclass
class Plan:
    """Where a request's prompt and output go."""

    cached: int  # prompt tokens restored from the cache
    pages: list[int]  # the whole page table: cached prefix + reserved
    state_slot: int = -1
    restore_slot: int = -1
    boundary_slot: int = -1
    spare_slots: list[int] = field(default_factory=list)  # speculative verify on hybrid models
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # (tokens, slot)
    # a KV format that quantizes whole pages (rk4p): the staging pages for the
    # sequence's open pages, and which logical page each holds after prefill
    open_pages: list[int] = field(default_factory=list)
    open_held: list[int] = field(default_factory=list)


class Router(pb_grpc.GenerationServiceServicer):
    def __init__(self, store: StoreClient, prefill, decode, tokenizer, metrics: RouterMetrics,
                 config: RouterConfig) -> None:
        self.store = store
        self.prefill = prefill
        self.decode = decode
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.config = config
        info = store.info
        self.model_config = info.config
        self.page_size = info.page_size
        self.hybrid = info.config.is_hybrid
        self.speculative = info.speculative
        self.spare_slots = info.spare_slots_per_sequence
        self.sink_pages = info.sink_pages_per_sequence
        self.open_pages = info.open_pages_per_sequence
        self.max_context = min(info.config.max_position_embeddings, info.num_pages * info.page_size)
        config.check_page_size(self.page_size)
        self.running: dict[str, Running] = {}
        self._admissions = itertools.count(1)  # makes Running.worker_id unique
        # the tokenizer releases the GIL: a long text tokenizes on these while
        # the event loop streams every other request's tokens (on the loop, 24
        # MB of text held every stream for 25 s); its own pool, so that the
        # store calls on the default one never wait behind a tokenization
        self.tokenizing = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
        # give-backs waiting for a worker that has not yet stopped their request
        self.stopping: set[asyncio.Task] = set()

    # --- public RPCs ------------------------------------------------------
    async def Generate(self, request, context):
        started = time.perf_counter()
        try:
            req = await self._off_loop(request_from_pb, request, self.tokenizer, self.max_context,
                                       self.model_config.vocab_size)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.metrics.ttft_phase("tokenize", time.perf_counter() - started)
        if req.request_id in self.running:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request_id {req.request_id!r} is already running; use a new id")
        handle = self.running[req.request_id] = Running(
            req.request_id, worker_id=f"{req.request_id}#{next(self._admissions)}")
        self.metrics.request_started()
        held = Held()
        ending = "error"  # how it ended, unless it finished
        try:
            async for response in self._generate(req, handle, held, context, started):
                yield response
        except (asyncio.CancelledError, GeneratorExit):
            ending = "cancelled"  # the client went away
            raise
        except (StoreError, TandemError) as e:
            await context.abort(status_of(e), str(e))
        except grpc.aio.AioRpcError as e:
            await context.abort(*_worker_failure(e, handle.busy_in))
        finally:
            self._count_finished(req, handle, ending, started)
            self.running.pop(req.request_id, None)
            await self._give_back(held, handle)

    def _count_finished(self, req: GenerationRequest, handle: Running, ending: str,
                        started: float) -> None:
        """request_finished, exactly once per admitted request: its finish
        reason when it finished (also if the client left while the last
        message went out), else how it ended ("error", "cancelled")."""
        self.metrics.request_finished(handle.finish or ending, len(req.prompt), handle.generated,
                                      handle.cached_tokens, time.perf_counter() - started)

    async def Abort(self, request, context):
        handle = self.running.get(request.request_id)
        if handle is None:
            return pb.AbortResponse(found=False)
        handle.aborted = True
        if handle.decode_call is not None:
            handle.decode_call.cancel()
        return pb.AbortResponse(found=True)

    async def Tokenize(self, request, context):
        try:
            kind = request.WhichOneof("input")
            if kind == "chat":
                ids = await self._off_loop(chat_prompt, request.chat, self.tokenizer)
            elif kind == "text":
                ids = await self._off_loop(self.tokenizer.encode, request.text)
            else:
                raise InvalidRequestError("set one of text or chat")
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        text = await self._off_loop(self.tokenizer.decode, ids)
        return pb.TokenizeResponse(token_ids=ids, prompt_text=text)

    async def GetModelInfo(self, request, context):
        info = self.store.info
        return pb.ModelInfo(model=self.config.model_name or info.model_id,
                            architecture=self.model_config.arch, max_context_tokens=self.max_context,
                            vocab_size=self.model_config.vocab_size, kv_format=info.kv_format.name,
                            page_size=self.page_size, speculative=_describe(self.speculative))

    async def _off_loop(self, work, *args):
        """`work(*args)` (tokenizing, rendering a chat) on the tokenizer threads."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, work, *args)

    # --- one request --------------------------------------------------------
    async def _generate(self, req: GenerationRequest, handle: Running, held: Held, context, started):
        stop_ids = _stop_ids(req, self.tokenizer)
        sampling = sampling_to_pb(req.params, stop_ids)
        plan, first = await self._admit(req, handle, held, sampling, context)
        handle.cached_tokens = plan.cached
        text = TextStream(self.tokenizer, req.params.stop, stop_ids)
        output = [first.token_id]
        handle.generated = 1
        self.metrics.first_token(time.perf_counter() - started)
        with_logprobs = req.params.logprobs is not None
        yield _chunk(req.request_id, first, text.push(first.token_id), self.tokenizer,
                     with_logprobs)
        finish, boundary = self._finish_of_first(req, first.token_id, text, stop_ids)
        final = None  # tokens whose KV is final in the pages, as decode reports it
        failure = None  # why decode gave the request up on its own, if it did
        await self._before_decode(req, plan, handle, held, context)
        last = time.perf_counter()
        if finish is None and not handle.aborted:
            handle.busy_in = "decode"
            call = handle.decode_call = (handle.decode_stub or self.decode).Decode(
                self._decode_request(req, handle.worker_id, plan, first.token_id, sampling),
                timeout=context.time_remaining())
            try:
                async for event in call:
                    if event.HasField("finished"):  # decode has let go of it
                        handle.busy_in = None
                        finish, failure = decode_finish(event.finished, handle.aborted)
                        boundary = event.finished.boundary_tokens
                        final = event.finished.final_tokens
                        break
                    emitted = 0
                    for token in event.tokens.tokens:
                        emitted += 1
                        now = time.perf_counter()
                        self.metrics.token(now - last)
                        last = now
                        output.append(token.token_id)
                        handle.generated = len(output)
                        yield _chunk(req.request_id, token, text.push(token.token_id), self.tokenizer,
                                     with_logprobs)
                        if text.stopped:  # a speculative step's later tokens are past the stop
                            break
                    if event.tokens.drafted:
                        self.metrics.spec_decode(event.tokens.drafted,
                                                 _accepted_emitted(event.tokens, emitted))
                    if text.stopped:  # a stop string: the router ends what decode cannot see
                        call.cancel()
                        await self._stop_worker(handle)  # unconfirmed: _give_back waits
                        finish = pb.FINISH_REASON_STOP
                        break
            except asyncio.CancelledError:
                # the call's own cancel (Abort) reads as CancelledError too;
                # this task's cancellation (the client went away) goes on
                if not handle.aborted or _being_cancelled():
                    raise
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.CANCELLED or not handle.aborted:
                    raise
        if handle.aborted and finish is None:
            await self._stop_worker(handle)  # unconfirmed: _give_back waits
            finish = pb.FINISH_REASON_ABORT
        tail = text.finish()
        if tail:
            yield pb.GenerateResponse(request_id=req.request_id, chunk=pb.Chunk(text=tail))
        await self._cache_output(req, plan, held, output, boundary, handle.decode_store, final)
        if failure is not None:  # an error status, not a successful finish
            raise TandemError(f"the decode worker stopped the request after {len(output)} "
                              f"tokens: {failure}")
        handle.finish = _FINISH_NAME[finish]
        usage = pb.Usage(prompt_tokens=len(req.prompt), completion_tokens=len(output),
                         cached_tokens=plan.cached)
        yield pb.GenerateResponse(request_id=req.request_id,
                                  complete=pb.Complete(finish_reason=finish, usage=usage))

    async def _admit(self, req: GenerationRequest, handle: Running, held: Held,
                     sampling: wpb.Sampling, context):
        """Reserve and prefill the prompt: (plan, first token)."""
        with self._phase("reserve"):
            plan = await self._reserve(req, held)
        self.metrics.cache_query(len(req.prompt), plan.cached)
        handle.busy_in = "prefill"
        with self._phase("prefill"):
            first = await self._run_prefill(req, handle, plan, sampling, context)
        handle.busy_in = None
        return plan, first

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Times one phase of the time to first token (tandem_ttft_phase_seconds)."""
        started = time.perf_counter()
        yield
        self.metrics.ttft_phase(name, time.perf_counter() - started)

    async def _before_decode(self, req, plan, handle: Running, held: Held, context) -> None:
        """After the first token went out: the prompt's pages go to the prefix
        cache (which may hand back its own copies for decode to read). Not
        before: at 100K tokens the insert took 26-63 ms of the H200 agent
        loop's time to first token (BENCHMARKS.md, 2026-12-02)."""
        with self._phase("cache"):
            await self._cache_prompt(req, plan, held)

    @staticmethod
    def _finish_of_first(req, token: int, text: TextStream, stop_ids):
        if token in stop_ids or text.stopped:
            return pb.FINISH_REASON_STOP, 0
        if req.params.max_new_tokens <= 1:
            return pb.FINISH_REASON_LENGTH, 0
        return None, 0

    async def _acquire(self, held: Held, call, *args, taken=None):
        """A store call that takes locks or pages, recorded into `held` when it
        finishes, also if this request is cancelled meanwhile (the call runs on
        in its thread; _give_back waits for it), so nothing it took leaks.
        `taken(result)`, if given, runs then too (an insert's pages leave `held`)."""
        future = asyncio.ensure_future(asyncio.to_thread(call, *args))
        future.add_done_callback(lambda f: _record(held, f, taken))
        held.pending.append(future)
        return await asyncio.shield(future)

    async def _reserve(self, req: GenerationRequest, held: Held) -> Plan:
        """Match and lock the cached prefix; reserve pages for the rest of the
        prompt and the whole output, and the GDN slots, or RESOURCE_EXHAUSTED."""
        prompt = req.prompt
        match = await self._acquire(held, self.store.match, req.packed_prompt, req.cache_salt,
                                    True)
        total_pages = -(-(len(prompt) + req.params.max_new_tokens) // self.page_size)
        points = (snapshot_points(match.num_tokens, len(prompt), self.page_size,
                                  self.config.snapshot_every) if self.hybrid else [])
        slots = 2 + self.spare_slots + len(points) if self.hybrid else 0
        # sink pages the match does not cover are staging pages of the request's own
        sinks = max(0, min(self.sink_pages, total_pages) - len(match.pages))
        try:
            grant = await self._acquire(held, self.store.allocate,
                                        total_pages - len(match.pages) - sinks, slots,
                                        sinks + self.open_pages)
        except StoreCapacityError as e:
            raise StoreCapacityError(
                e.code, f"no KV capacity now for a {len(prompt)}-token prompt plus "
                        f"{req.params.max_new_tokens} new tokens: retry when running requests "
                        f"finish, or ask for fewer new tokens (the store: {e.details})") from None
        plan = Plan(cached=match.num_tokens,
                    pages=[*match.pages, *grant.staging[:sinks], *grant.pages],
                    open_pages=list(grant.staging[sinks:]))
        if self.hybrid:
            plan.state_slot, plan.boundary_slot = grant.slots[0], grant.slots[1]
            plan.restore_slot = match.snapshot_slot if match.num_tokens else -1
            spare_end = 2 + self.spare_slots
            plan.spare_slots = list(grant.slots[2:spare_end])
            plan.snapshots = list(zip(points, grant.slots[spare_end:]))
        return plan

    async def _run_prefill(self, req: GenerationRequest, handle: Running, plan: Plan,
                           sampling: wpb.Sampling, context) -> wpb.GeneratedToken:
        reply = await self.prefill.Prefill(wpb.PrefillRequest(
            request_id=handle.worker_id, tokens_le32=req.packed_prompt, start=plan.cached,
            pages=plan.pages, state_slot=plan.state_slot, restore_slot=plan.restore_slot,
            snapshots=[wpb.SnapshotPoint(tokens=t, slot=s) for t, s in plan.snapshots],
            sampling=sampling, open_pages=plan.open_pages), timeout=context.time_remaining())
        plan.open_held = list(reply.open_held)
        return first_token_of(reply, "the prefill worker")

    async def _cache_prompt(self, req: GenerationRequest, plan: Plan, held: Held,
                            store: StoreClient | None = None) -> None:
        """Hand the prompt's whole pages (with its snapshots) to the prefix cache,
        locked while this request reads them; the cache may answer with its own
        copies of pages another request wrote first, which we then read instead."""
        if self.hybrid:
            inserts = plan.snapshots
        else:
            end = len(req.prompt) // self.page_size * self.page_size
            inserts = [(end, None)] if end > plan.cached else []
        for end, slot in inserts:
            await self._insert(store or self.store, req, end, plan, held, slot, lock=True)

    async def _insert(self, store: StoreClient, req: GenerationRequest, end: int, plan: Plan,
                      held: Held, slot: int | None, lock: bool,
                      packed: bytes | None = None) -> None:
        """The first `end` tokens (whole pages) of the request's prompt, or of
        `packed` (pack_token_ids of prompt and output), into `store`'s cache
        with the pages they fill: those pages then belong to the cache (they
        leave `held`; with `lock`, the lock joins it), also if the request is
        cancelled meanwhile, and the request reads the cache's pages from
        then on."""
        n = end // self.page_size
        given = plan.pages[:n]
        result = await self._acquire(
            held, store.insert, packed_prefix(packed or req.packed_prompt, end), given, slot,
            req.cache_salt, lock,
            taken=lambda _r: self._forget(held, given, [] if slot is None else [slot]))
        plan.pages[:n] = result.pages

    async def _cache_output(self, req: GenerationRequest, plan: Plan, held: Held, output: list[int],
                            boundary: int, store: StoreClient | None = None,
                            final: int | None = None) -> None:
        """Insert prompt + output up to the last page boundary whose state (and
        KV) exists and is final (`final`: as the decode reported it), so the
        next turn of a conversation starts from it."""
        length = len(req.prompt) + len(output)
        # the last sampled token never ran: its KV does not exist
        final = length - 1 if final is None else min(final, length - 1)
        if self.hybrid:
            end, slot = boundary, plan.boundary_slot
        else:
            end, slot = final // self.page_size * self.page_size, None
        if end > final:  # a failed decode step left the pages unfinished
            return
        if end <= max(plan.cached, len(req.prompt) // self.page_size * self.page_size):
            return
        await self._insert(store or self.store, req, end, plan, held, slot, lock=False,
                           packed=req.packed_prompt + pack_token_ids(output))

    @staticmethod
    def _forget(held: Held, pages, slots) -> None:
        gone_pages, gone_slots = set(pages), set(slots)
        held.pages = [p for p in held.pages if p not in gone_pages]
        held.slots = [s for s in held.slots if s not in gone_slots]

    async def _give_back(self, held: Held, handle: Running) -> None:
        """Runs even when the request's task is being cancelled: shielded. A
        worker still busy with the request is stopped first, so no step of it
        writes into pages another request already got."""
        async def release() -> None:
            if not await self._stop_worker(handle):
                # the worker neither confirmed the stop nor died: a chunk of this
                # request may still be writing into its pages, so they stay held
                # (a leak, not another request's corruption) until it does,
                # asked again in the background; the call itself ends now
                task = asyncio.ensure_future(self._release_once_stopped(held, handle))
                self.stopping.add(task)
                task.add_done_callback(self.stopping.discard)
                return
            await self._release_all(held, handle)

        await asyncio.shield(asyncio.ensure_future(release()))

    async def _release_all(self, held: Held, handle: Running) -> None:
        if handle.prefill_held is not None:
            await self._release(handle.prefill_held, handle.prefill_store)
        await self._release(held, handle.decode_store or self.store)

    async def _release_once_stopped(self, held: Held, handle: Running) -> None:
        self.metrics.awaiting_worker_stop(+1)
        try:
            worker = handle.busy_in
            while True:
                await asyncio.sleep(STOP_RETRY_S)
                if await self._stop_worker(handle):
                    log(PROCESS, f"{worker} stopped {handle.request_id}: its pages go back")
                    await self._release_all(held, handle)
                    return
        finally:
            self.metrics.awaiting_worker_stop(-1)

    async def _release(self, held: Held, store: StoreClient) -> None:
        """Everything `held` names goes back to `store`. The lists are emptied
        before any await, so nothing is ever given back twice, and the store
        calls then run as one shielded task: a request cancelled between the
        unlock and the release (a client that hangs up while the prefill
        store is being let go) would otherwise lose the release, its ids
        being in no list any more. If the store refuses a batch (an id the
        request no longer holds, e.g. an insert that completed while its
        caller was cancelled), the ids are given back one by one, so the
        others are not lost."""
        while held.pending:  # calls still running in their threads record into held
            await asyncio.gather(*held.pending, return_exceptions=True)
            held.pending = [f for f in held.pending if not f.done()]
        nodes, held.nodes = held.nodes, []
        pages, slots = held.pages, held.slots
        held.pages, held.slots = [], []
        await asyncio.shield(asyncio.ensure_future(
            self._return_to_store(store, nodes, pages, slots)))

    async def _return_to_store(self, store: StoreClient, nodes: list, pages: list,
                               slots: list) -> None:
        """_release's store calls: unlock the prefix nodes, free pages and slots."""
        try:
            if nodes:
                await self._each_or_all(store.unlock, [nodes], [[[n]] for n in nodes])
            if pages or slots:
                await self._each_or_all(store.release, [pages, slots],
                                        [[[p], []] for p in pages] + [[[], [s]] for s in slots])
            if store is self.store:
                stats = await asyncio.to_thread(store.stats)
                self.metrics.set_kv_usage(stats.total_pages - stats.free_pages, stats.total_pages)
        except StoreError as e:
            log(PROCESS, f"could not give back a request's pages: {e}")

    @staticmethod
    async def _each_or_all(call, whole: list, parts: list[list]) -> None:
        try:
            await asyncio.to_thread(call, *whole)
        except StoreError as e:
            if e.code != "FAILED_PRECONDITION":
                raise
            for args in parts:
                try:
                    await asyncio.to_thread(call, *args)
                except StoreError as part_error:
                    if part_error.code != "FAILED_PRECONDITION":
                        raise

    async def _stop_worker(self, handle: Running) -> bool:
        """Whether every worker busy with the request has stopped it (or is
        dead: a dead worker writes nothing any more); then the request is in
        no worker (`busy_in` None), else it stays where it was."""
        prefill = handle.prefill_stub or self.prefill
        decode = handle.decode_stub or self.decode
        stubs = {"prefill": [prefill], "decode": [decode],
                 "transfer": [prefill, decode]}.get(handle.busy_in, [])
        stopped = True
        for stub in stubs:  # the writer first: prefill pushes into the decode store
            try:
                await stub.Abort(wpb.AbortWork(request_id=handle.worker_id),
                                 timeout=STOP_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    stopped = False
                    log(PROCESS, f"could not stop {handle.busy_in} for {handle.request_id} "
                                 f"({e.code().name}): its pages stay held until it does")
        if stopped:
            handle.busy_in = None
        return stopped

    @staticmethod
    def _decode_request(req: GenerationRequest, worker_id: str, plan: Plan, first: int,
                        sampling: wpb.Sampling) -> wpb.DecodeRequest:
        return wpb.DecodeRequest(request_id=worker_id, prompt_le32=req.packed_prompt,
                                 first_token=first, sampling=sampling, pages=plan.pages,
                                 state_slot=plan.state_slot, boundary_slot=plan.boundary_slot,
                                 spare_slots=plan.spare_slots, open_pages=plan.open_pages,
                                 open_held=plan.open_held)


def _describe(spec) -> str:
    """ModelInfo.speculative: "none", or the drafter and k, e.g. "mtp:3"."""
    return f"{spec.method}:{spec.num_draft_tokens}" if spec.enabled else "none"


def _accepted_emitted(step: wpb.DecodeTokens, emitted: int) -> int:
    """The step's accepted drafts among the `emitted` tokens the client got.
    Counted as the decode worker counts a step that a stop rule cuts short
    (SpeculativeDecoder.commit): the last token kept stands for the target's
    own, so accepted + verify steps stays the tokens emitted, and the mean
    accepted length stays tokens per target forward."""
    if emitted == len(step.tokens):
        return step.accepted
    return min(step.accepted, emitted - 1)


def first_token_of(reply: wpb.PrefillResponse, worker: str) -> wpb.GeneratedToken:
    """A prefill's first token. A reply without one is a prefill the worker
    stopped (it answers an empty reply to a cancelled call): read as is, it
    would stream token 0 to the client."""
    if not reply.HasField("first"):
        raise WorkerUnavailable(f"{worker} stopped the request's prefill before its first "
                                "token: retry")
    return reply.first


def _being_cancelled() -> bool:
    """Whether this task has been asked to stop (Python 3.11+ can tell; 3.10
    cannot, and then only Running.aborted decides, as before)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling and cancelling())


def _stop_ids(req: GenerationRequest, tokenizer) -> tuple[int, ...]:
    eos = () if req.params.ignore_eos else tuple(tokenizer.eos_token_ids)
    return tuple(dict.fromkeys((*req.params.stop_token_ids, *eos)))


def _chunk(request_id: str, token: wpb.GeneratedToken, text: str, tokenizer,
           with_logprobs: bool) -> pb.GenerateResponse:
    chunk = pb.Chunk(token_ids=[token.token_id], text=text)
    if with_logprobs:  # each token's own text, for clients that show alternatives
        top = [pb.TokenLogprob(token_id=t.token_id, logprob=t.logprob,
                               text=tokenizer.decode([t.token_id])) for t in token.top]
        chunk.logprobs.append(pb.Logprobs(logprob=token.logprob, top=top,
                                          text=tokenizer.decode([token.token_id])))
    return pb.GenerateResponse(request_id=request_id, chunk=chunk)


def decode_finish(finished: wpb.DecodeFinished, asked_to_abort: bool) -> tuple[int, str | None]:
    """The public finish reason of decode's last event, and why decode gave the
    request up on its own (None when it did not): an ABORT nobody asked for is
    a failed step, which the client must see as an error, not a finish."""
    finish = _FINISH[finished.reason]
    if finish == pb.FINISH_REASON_ABORT and not asked_to_abort:
        return finish, finished.detail or "no reason given"
    return finish, None


# who failed a request, by Running.busy_in when its call to a worker failed
_WORKER_NAMES = {"prefill": "the prefill worker", "decode": "the decode worker",
                 "transfer": "the prefill or decode worker (KV transfer)"}


def _worker_failure(e: grpc.aio.AioRpcError, busy_in: str | None) -> tuple[grpc.StatusCode, str]:
    code = e.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return code, "the request's deadline passed before it finished"
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        worker = _WORKER_NAMES.get(busy_in, "a worker")
        return grpc.StatusCode.UNAVAILABLE, (f"{worker} is unavailable ({e.details()}); the server "
                                             "keeps its cache: retry shortly")
    return code, e.details() or code.name


def _public_api(router):
    """What the router's gRPC server registers: the public GenerationService
    (served by `router`, shared or disaggregated), reflection and health."""
    def register(server) -> None:
        add_refusing_undecodable(pb_grpc.add_GenerationServiceServicer_to_server, router, server)
        names = (pb.DESCRIPTOR.services_by_name["GenerationService"].full_name,
                 reflection.SERVICE_NAME, "grpc.health.v1.Health")
        reflection.enable_server_reflection(names, server)
    return register


async def _main(args) -> None:
    if args.prefill_group or args.decode_group:
        await _main_disaggregated(args)
        return
    if not (args.store and args.prefill and args.decode):
        raise TandemError("give --store, --prefill and --decode (shared topology) or "
                          "--prefill-group and --decode-group (disaggregated)")
    wait_for_store(args.store, timeout=args.store_timeout)
    store = StoreClient.connect(args.store, name=PROCESS, map_memory=False)
    tokenizer = load_tokenizer(store.info.model_id)
    prefill_channel = worker_channel(args.prefill)
    decode_channel = worker_channel(args.decode)
    metrics = RouterMetrics()
    metrics_server = metrics.serve(args.metrics_port, args.host) if args.metrics_port else None
    try:
        router = Router(store, wpb_grpc.PrefillServiceStub(prefill_channel),
                        wpb_grpc.DecodeServiceStub(decode_channel), tokenizer, metrics,
                        RouterConfig(snapshot_every=args.snapshot_every,
                                     model_name=args.model_name))
    except ValueError as e:  # a configuration the store's layout cannot serve
        raise TandemError(str(e)) from e

    register = _public_api(router)

    async def on_stop() -> None:
        router.tokenizing.shutdown(wait=False, cancel_futures=True)
        await prefill_channel.close()
        await decode_channel.close()
        if metrics_server is not None:
            metrics_server.shutdown()
        store.close()

    await serve(PROCESS, f"{args.host}:{args.port}", register, (SERVICE,), on_stop)


async def _main_disaggregated(args) -> None:
    from router.disagg import DisaggRouter, Worker
    from tandem.serving import TRANSFER_SERVICE

    if not (args.prefill_group and args.decode_group):
        raise TandemError("a disaggregated router needs at least one --prefill-group and one "
                          "--decode-group STORE_SOCKET=WORKER_SOCKET")
    channels, workers = [], {"prefill": [], "decode": []}
    for kind, groups, stub_class in (("prefill", args.prefill_group, wpb_grpc.PrefillServiceStub),
                                     ("decode", args.decode_group, wpb_grpc.DecodeServiceStub)):
        for index, group in enumerate(groups):
            store_sock, sep, worker_sock = group.partition("=")
            if not sep:
                raise TandemError(f"--{kind}-group wants STORE_SOCKET=WORKER_SOCKET, got {group!r}")
            wait_for_store(store_sock, timeout=args.store_timeout)
            store = StoreClient.connect(store_sock, name=PROCESS, map_memory=False)
            channel = worker_channel(worker_sock)
            channels.append(channel)
            await _wait_until_serving(channel, TRANSFER_SERVICE, f"{kind}-{index}",
                                      args.transfer_ready_timeout)
            workers[kind].append(Worker(f"{kind}-{index}", index, store, stub_class(channel)))
    tokenizer = load_tokenizer(workers["decode"][0].store.info.model_id)
    metrics = RouterMetrics()
    metrics_server = metrics.serve(args.metrics_port, args.host) if args.metrics_port else None
    try:
        router = DisaggRouter(workers["prefill"], workers["decode"], tokenizer, metrics,
                              RouterConfig(snapshot_every=args.snapshot_every,
                                           model_name=args.model_name),
                              method=args.kv_transfer, transfer_timeout_s=args.transfer_timeout)
    except ValueError as e:
        raise TandemError(str(e)) from e
    log(PROCESS, f"disaggregated: {len(workers['prefill'])} prefill and "
                 f"{len(workers['decode'])} decode workers, transfers by {args.kv_transfer}")

    register = _public_api(router)

    async def on_stop() -> None:
        router.tokenizing.shutdown(wait=False, cancel_futures=True)
        for channel in channels:
            await channel.close()
        if metrics_server is not None:
            metrics_server.shutdown()
        for w in (*workers["prefill"], *workers["decode"]):
            w.store.close()

    await serve(PROCESS, f"{args.host}:{args.port}", register, (SERVICE,), on_stop)


async def _wait_until_serving(channel, service: str, name: str, timeout: float) -> None:
    """Until the worker's `service` health is SERVING (its transfer path is up)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while True:
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:
            pass
        if time.monotonic() > deadline:
            raise TandemError(f"{name}'s KV transfer path was not ready after {timeout:.0f} s "
                              "(see its log: the process group forms once every worker joined)")
        await asyncio.sleep(0.1)


def _record(held: Held, future, taken=None) -> None:
    """What a finished store call took, into `held` (see Router._acquire)."""
    if future.cancelled() or future.exception() is not None:
        return
    result = future.result()
    if isinstance(result, Allocation):
        held.pages.extend(result.pages)
        held.pages.extend(result.staging)
        held.slots.extend(result.slots)
    elif getattr(result, "locked", False):  # a locking Match or Insert
        held.nodes.append(result.node_id)
    if taken is not None:
        taken(result)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m router.server", description=__doc__.splitlines()[0])
    p.add_argument("--store", default=None, help="shared topology: the store's socket")
    p.add_argument("--prefill", default=None, help="shared topology: the prefill worker's socket")
    p.add_argument("--decode", default=None, help="shared topology: the decode worker's socket")
    p.add_argument("--prefill-group", action="append", default=[],
                   metavar="STORE_SOCKET=WORKER_SOCKET",
                   help="disaggregated: a prefill worker and its store (repeat, in rank order)")
    p.add_argument("--decode-group", action="append", default=[],
                   metavar="STORE_SOCKET=WORKER_SOCKET",
                   help="disaggregated: a decode worker and its store (repeat, in rank order)")
    p.add_argument("--kv-transfer", choices=["dist", "peer"], default="dist")
    p.add_argument("--transfer-timeout", type=float, default=120.0,
                   help="seconds a finished prefill's transfer may take to arrive")
    p.add_argument("--transfer-ready-timeout", type=float, default=600.0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--metrics-port", type=int, default=0, help="0 = no metrics endpoint")
    p.add_argument("--snapshot-every", type=int, default=0)
    p.add_argument("--model-name", default="")
    p.add_argument("--store-timeout", type=float, default=60.0)
    args = p.parse_args(argv)
    return run_server(PROCESS, lambda: _main(args))


if __name__ == "__main__":
    sys.exit(main())

