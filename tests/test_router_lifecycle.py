"""A request's life in the router, end to end but in one process: the real
Router (and DisaggRouter) served over grpc.aio, its workers as scripted
servicers over gRPC too, and each store the real kvstore.control.StoreControl
(the page, slot and lock bookkeeping the kvstore serves) behind a client of
StoreClient's shape. Scripted workers and an in-process store make the
moments that matter exact: a request cancelled while a store call runs in its
thread, an Abort that comes too late, a prefill stopped under a live call.

`RouterStack` is shared with tests/test_openai_gateway.py."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time

import grpc
import pytest
import torch

import router.disagg
import router.server
from engine.loader import load_tokenizer, peek_config
from kvstore.client import StoreCapacityError, StoreError, StoreInfo, StoreUnavailable
from kvstore.control import FailedPrecondition, InvalidArgument, ResourceExhausted, StoreControl
from kvstore.memory import KVFormatSpec
from router.disagg import DisaggRouter, Worker
from router.metrics import RouterMetrics
from tandem.text_limits import MAX_STOP_CHARS, MAX_STOP_STRINGS
from router.server import Router, RouterConfig
from tandem.internal.v1 import workers_pb2 as wpb
from tandem.internal.v1 import workers_pb2_grpc as wpb_grpc
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc as pb_grpc
from tandem.wire import pack_token_ids, unpack_token_ids

PAGE = 16
MODEL = "tiny-llama"  # a named shape: a byte tokenizer, so token ids spell the text


class ControlStore:
    """StoreClient's calls on a StoreControl in this process, with its errors
    as the client raises them. `gate(method)` holds that method's calls in
    their thread until `open_gates()`; `fail(method, error)` makes its next
    call raise; `entered[method]` is set once one was called."""

    METHODS = ("match", "allocate", "insert", "unlock", "release")

    def __init__(self, model: str = MODEL, num_pages: int = 64, num_slots: int = 0,
                 max_context: int | None = None) -> None:
        config = peek_config(model)
        if max_context is not None:
            config = dataclasses.replace(config, max_position_embeddings=max_context)
        self.info = StoreInfo(session_id="router", model_id=model, config=config,
                              dtype=torch.float32, kv_format=KVFormatSpec("int8"),
                              page_size=PAGE, num_pages=num_pages, num_state_slots=num_slots,
                              store_pid=0, arenas={})
        self.control = StoreControl(num_pages, num_slots, PAGE, config.is_hybrid,
                                    config.vocab_size, f"{model}|int8")
        self.session = self.control.open_session("router").id
        self.calls: list[str] = []
        self.entered = {m: threading.Event() for m in self.METHODS}
        self._gates: dict[str, threading.Event] = {}
        self._failures: dict[str, StoreError] = {}

    def forget_calls(self) -> None:
        """From here on `calls` and `entered` say what the router called."""
        self.calls.clear()
        for event in self.entered.values():
            event.clear()

    def gate(self, method: str) -> None:
        self._gates[method] = threading.Event()

    def open_gates(self) -> None:
        for gate in self._gates.values():
            gate.set()

    def fail(self, method: str, error: StoreError) -> None:
        self._failures[method] = error

    def _call(self, method: str, *args):
        self.calls.append(method)
        self.entered[method].set()
        if method in self._gates:
            self._gates[method].wait(30)
        if method in self._failures:
            raise self._failures.pop(method)
        try:
            return getattr(self.control, method)(self.session, *args)
        except ResourceExhausted as e:
            raise StoreCapacityError("RESOURCE_EXHAUSTED", str(e)) from None
        except FailedPrecondition as e:
            raise StoreError("FAILED_PRECONDITION", str(e)) from None
        except InvalidArgument as e:
            raise StoreError("INVALID_ARGUMENT", str(e)) from None

    def match(self, tokens, cache_salt: str = "", lock: bool = False):
        return self._call("match", cache_salt, unpack_token_ids(tokens), lock)

    def allocate(self, pages: int = 0, slots: int = 0, staging: int = 0):
        return self._call("allocate", pages, slots, staging)

    def insert(self, tokens, pages, snapshot_slot=None, cache_salt: str = "", lock: bool = False):
        return self._call("insert", cache_salt, unpack_token_ids(tokens), list(pages),
                          snapshot_slot, lock)

    def unlock(self, node_ids):
        return self._call("unlock", list(node_ids))

    def release(self, pages=(), slots=()):
        return self._call("release", list(pages), list(slots))

    def stats(self):
        return self.control.stats()

    def holdings(self) -> tuple[list[int], dict[int, int]]:
        """The router session's pages and prefix locks (node id -> count)."""
        session = self.control.sessions[self.session]
        return sorted(session.pages), {n: c for n, c in session.locks.items() if c}


class ScriptedWorker(wpb_grpc.PrefillServiceServicer, wpb_grpc.DecodeServiceServicer):
    """A prefill and a decode worker in one servicer: Prefill's first token is
    the first byte of `text`, Decode streams the rest (`per_event` tokens an
    event, as speculative steps do) until max_new_tokens (LENGTH) or the text
    ends (STOP), or `failure` (an ABORT nobody asked for: a failed step)."""

    def __init__(self, text: str = "Hello there, general", step_s: float = 0.005,
                 per_event: int = 1) -> None:
        self.text, self.step_s, self.per_event = text, step_s, per_event
        self.failure: str | None = None
        self.aborts: list[str] = []

    async def Prefill(self, request, context):
        return wpb.PrefillResponse(first=wpb.GeneratedToken(token_id=self.text.encode()[0]))

    async def Decode(self, request, context):
        tokens = list(self.text.encode())[1:request.sampling.max_new_tokens]
        for start in range(0, len(tokens), self.per_event):
            await asyncio.sleep(self.step_s)
            yield wpb.DecodeEvent(tokens=wpb.DecodeTokens(tokens=[
                wpb.GeneratedToken(token_id=t) for t in tokens[start:start + self.per_event]]))
        if self.failure is not None:
            yield wpb.DecodeEvent(finished=wpb.DecodeFinished(reason=wpb.DECODE_FINISH_ABORT,
                                                              detail=self.failure))
            return
        length = len(tokens) + 1 >= request.sampling.max_new_tokens
        yield wpb.DecodeEvent(finished=wpb.DecodeFinished(
            reason=wpb.DECODE_FINISH_LENGTH if length else wpb.DECODE_FINISH_STOP))

    async def Abort(self, request, context):
        self.aborts.append(request.request_id)
        return wpb.AbortWorkReply(found=False)


@contextlib.asynccontextmanager
async def _served(register):
    """A grpc.aio server in this process with what `register` adds, and a
    channel to it."""
    server = grpc.aio.server()
    register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel
    finally:
        await channel.close()
        await server.stop(None)


@contextlib.asynccontextmanager
async def serving_workers(worker: ScriptedWorker):
    """`worker` over gRPC: (its PrefillService stub, its DecodeService stub)."""
    def register(server):
        wpb_grpc.add_PrefillServiceServicer_to_server(worker, server)
        wpb_grpc.add_DecodeServiceServicer_to_server(worker, server)
    async with _served(register) as channel:
        yield wpb_grpc.PrefillServiceStub(channel), wpb_grpc.DecodeServiceStub(channel)


class RouterStack:
    """A Router over `store` and `worker`, served over gRPC in this process:
    `async with RouterStack(...) as stack`, then `stack.stub` (the public API),
    `stack.router`, `stack.metric(name)`."""

    def __init__(self, store: ControlStore | None = None, worker: ScriptedWorker | None = None,
                 config: RouterConfig = RouterConfig()) -> None:
        self.store = store or ControlStore()
        self.worker = worker or ScriptedWorker()
        self.config = config
        self.metrics = RouterMetrics(gpu=False)
        self._stack = contextlib.AsyncExitStack()

    def make_router(self, prefill, decode):
        return Router(self.store, prefill, decode, load_tokenizer(self.store.info.model_id),
                      self.metrics, self.config)

    async def __aenter__(self) -> "RouterStack":
        prefill, decode = await self._stack.enter_async_context(serving_workers(self.worker))
        self.router = self.make_router(prefill, decode)
        channel = await self._stack.enter_async_context(
            _served(router.server._public_api(self.router)))
        self.stub = pb_grpc.GenerationServiceStub(channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._stack.aclose()
        self.router.tokenizing.shutdown(wait=False)

    def metric(self, name: str, **labels) -> float:
        return self.metrics.registry.get_sample_value(name, labels or None) or 0.0

    async def settled(self, timeout: float = 10.0) -> None:
        """Until no request runs and every give-back (background ones too) is done."""
        deadline = time.monotonic() + timeout
        while self.router.running or self.router.stopping or self.metric(
                "tandem_requests_running"):
            assert time.monotonic() < deadline, "the router never settled"
            await asyncio.sleep(0.01)


async def _read_all(call) -> list:
    """The events of a Generate call still to come."""
    events = []
    while (event := await call.read()) is not grpc.aio.EOF:
        events.append(event)
    return events


def _ids(events) -> list[int]:
    return [t for e in events if e.HasField("chunk") for t in e.chunk.token_ids]


def _finish(events):
    return [e.complete.finish_reason for e in events if e.HasField("complete")]


# --- 1. the disaggregated router gives back to the store it took from ----------
@pytest.mark.parametrize("ending", ["cancelled", "store error"])
def test_a_disaggregated_request_gives_back_to_the_decode_store_it_took_from(monkeypatch, ending):
    """The preferred decode worker is not decodes[0] (decode-1 caches the
    prompt's first page). The request ends (the client hangs up, or the store
    fails) while decode-1's allocate runs: its lock and pages must go back to
    decode-1, and decode-0, where another request holds pages 0-3, must not
    be touched. (Given back to decode-0, the lock and pages leaked on decode-1
    and decode-0 freed the other request's pages.)"""
    # StoreInfo here has no arenas: every store lays its pages out alike
    monkeypatch.setattr(router.disagg, "layout_signature", lambda info: info.model_id)
    monkeypatch.setattr(router.disagg, "page_bytes", lambda info: 0)
    prompt = [5] * 40
    prefill_store, decode0, decode1 = ControlStore(), ControlStore(), ControlStore()
    earlier = decode1.allocate(1)  # an earlier turn cached the first page on decode-1
    decode1.insert(pack_token_ids(prompt[:PAGE]), earlier.pages)
    other = decode0.allocate(4)  # another request's pages on decode-0
    decode0.forget_calls()
    decode1.forget_calls()
    if ending == "cancelled":
        decode1.gate("allocate")
    else:
        decode1.fail("allocate", StoreUnavailable("UNAVAILABLE", "decode-1's store went away"))

    async def scenario() -> grpc.StatusCode:
        async with serving_workers(ScriptedWorker()) as (prefill_stub, decode_stub):
            disagg = DisaggRouter(
                [Worker("prefill-0", 0, prefill_store, prefill_stub)],
                [Worker("decode-0", 0, decode0, decode_stub),
                 Worker("decode-1", 1, decode1, decode_stub)],
                load_tokenizer(MODEL), RouterMetrics(gpu=False), RouterConfig(), method="peer")
            async with _served(router.server._public_api(disagg)) as channel:
                call = pb_grpc.GenerationServiceStub(channel).Generate(pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=prompt), max_new_tokens=20))
                reading = asyncio.ensure_future(_read_all(call))
                while not decode1.entered["allocate"].is_set():
                    await asyncio.sleep(0.005)
                if ending == "cancelled":
                    call.cancel()
                    while disagg.running:  # until the router's handler is in its give-back
                        await asyncio.sleep(0.005)
                    decode1.open_gates()
                try:
                    await reading
                    code = grpc.StatusCode.OK
                except asyncio.CancelledError:
                    code = grpc.StatusCode.CANCELLED
                except grpc.aio.AioRpcError as e:
                    code = e.code()
                deadline = time.monotonic() + 10
                while (disagg.running or decode1.holdings() != ([], {})) and (
                        time.monotonic() < deadline):
                    await asyncio.sleep(0.01)
            disagg.tokenizing.shutdown(wait=False)
        return code

    code = asyncio.run(scenario())
    assert code == (grpc.StatusCode.CANCELLED if ending == "cancelled"
                    else grpc.StatusCode.UNAVAILABLE)
    assert decode1.holdings() == ([], {})  # its lock and any pages went back to it
    assert decode0.holdings() == (sorted(other.pages), {})  # the other request's pages stay
    assert "allocate" in decode1.calls  # it ended there, as meant
    assert not [c for c in decode0.calls if c in ("unlock", "release")]
    assert prefill_store.holdings() == ([], {})


# --- 4. tandem_requests_running and the finish reasons ------------------------
def test_every_way_a_request_ends_is_counted_once():
    """request_finished runs exactly once per admitted request, however it
    ends: tandem_requests_running goes back to 0 and tandem_requests_total
    says how each ended (it rose by one on every refusal and cancellation)."""
    store = ControlStore(num_pages=8)  # 128 tokens of KV

    async def scenario(stack: RouterStack) -> None:
        events = await _read_all(stack.stub.Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5] * 20), max_new_tokens=5)))
        assert _finish(events) == [pb.FINISH_REASON_LENGTH]
        hog = store.allocate(6)  # no room for the next one
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _read_all(stack.stub.Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[5] * 20), max_new_tokens=100)))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        store.release(hog.pages)
        call = stack.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 20),
                                                      max_new_tokens=50))
        await call.read(), await call.read()
        call.cancel()  # the client hangs up mid-stream
        await stack.settled()
        stack.worker.failure = "decode step failed: boom"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _read_all(stack.stub.Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[5] * 20), max_new_tokens=50)))
        assert "boom" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:  # refused before admission: not counted
            await _read_all(stack.stub.Generate(pb.GenerateRequest(text="x", stop=["x"] * 65)))
        await stack.settled()

    async def run() -> RouterStack:
        async with RouterStack(store, ScriptedWorker("Hello there. " * 10, step_s=0.02)) as stack:
            await scenario(stack)
        return stack

    stack = asyncio.run(run())
    assert stack.metric("tandem_requests_running") == 0
    counted = {reason: stack.metric("tandem_requests_total", finish_reason=reason)
               for reason in ("length", "stop", "abort", "error", "cancelled")}
    # the failed decode step was once counted as an "abort" finish
    assert counted == {"length": 1, "stop": 0, "abort": 0, "error": 2, "cancelled": 1}
    assert store.stats().held_pages == 0


class _SpeculatingWorker(ScriptedWorker):
    """Every decode event is a verify step of k=3 that kept its three tokens:
    two accepted drafts and the target's own token."""

    async def Decode(self, request, context):
        async for event in super().Decode(request, context):
            if event.HasField("tokens"):
                event.tokens.drafted, event.tokens.accepted = 3, len(event.tokens.tokens) - 1
            yield event


def test_drafts_past_a_stop_string_are_not_counted_accepted():
    """A stop string inside a speculative step: the tokens after it are never
    emitted, so its drafts are not accepted ones. The step is counted as the
    decode worker counts a step a stop rule cuts short (the last token it
    keeps is the step's own), so that accepted + steps is still the tokens
    emitted; all three were counted before."""
    async def run():
        async with RouterStack(worker=_SpeculatingWorker("Hello there", per_event=3)) as stack:
            events = await _read_all(stack.stub.Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[5] * 8), max_new_tokens=20, stop=["l"])))
            await stack.settled()
            return events, stack

    events, stack = asyncio.run(run())
    assert _finish(events) == [pb.FINISH_REASON_STOP]
    assert bytes(_ids(events)) == b"Hel"  # prefill's H, then e and l of the step "ell"
    assert stack.metric("tandem_spec_drafted_tokens_total") == 3
    assert stack.metric("tandem_spec_accepted_tokens_total") == 1


# --- 6. a reused request id, and a prefill that answers without a token --------
class _PrefillKeyedById(ScriptedWorker):
    """Work keyed by request id as prefill/server.py keys it: Abort(id) stops
    whatever runs under that id, and a stopped Prefill answers an empty reply.
    The first request's chunk is stuck: the router's first Abort for it comes
    back DEADLINE_EXCEEDED, so the router asks again in the background; that
    second Abort arrives while the next request's prefill runs."""

    def __init__(self) -> None:
        super().__init__()
        self.work: dict[str, asyncio.Event] = {}
        self.prefills = 0
        self.second_prefill = asyncio.Event()
        self.retried = asyncio.Event()

    async def Prefill(self, request, context):
        self.prefills += 1
        stopped = self.work[request.request_id] = asyncio.Event()
        if self.prefills == 1:
            await stopped.wait()  # stuck until stopped
            return wpb.PrefillResponse()
        self.second_prefill.set()
        await asyncio.wait([asyncio.ensure_future(stopped.wait()),
                            asyncio.ensure_future(self.retried.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
        if stopped.is_set():
            return wpb.PrefillResponse()  # "nobody is listening"
        return await super().Prefill(request, context)

    async def Abort(self, request, context):
        self.aborts.append(request.request_id)
        if len(self.aborts) == 2:  # the background retry: once the next request prefills
            await self.second_prefill.wait()
        work = self.work.get(request.request_id)
        if work is not None:
            work.set()
        if len(self.aborts) == 1:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"the prefill of {request.request_id!r} is still running")
        if len(self.aborts) == 2:
            self.retried.set()
        return wpb.AbortWorkReply(found=work is not None)


def test_a_reused_request_id_is_not_stopped_by_the_old_requests_give_back(monkeypatch):
    """A client hangs up during a stuck prefill and retries with the same
    request_id: the old request's background Abort must stop only the old
    work, so the new request streams its real tokens (once, Abort("x") of the
    old request stopped the new one's prefill, whose empty reply streamed
    token 0 as if the model had said it)."""
    monkeypatch.setattr(router.server, "STOP_RETRY_S", 0.05)
    worker = _PrefillKeyedById()

    async def scenario(stack: RouterStack):
        request = pb.GenerateRequest(request_id="x", token_ids=pb.TokenIds(ids=[5] * 20),
                                     max_new_tokens=5)
        first = stack.stub.Generate(request)
        reading = asyncio.ensure_future(_read_all(first))
        while not worker.work:
            await asyncio.sleep(0.005)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        deadline = time.monotonic() + 10
        while stack.metric("tandem_requests_awaiting_worker_stop") != 1:  # its pages stay held
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        events = await _read_all(stack.stub.Generate(request))  # the retry, same id
        await stack.settled()
        return events

    async def run():
        async with RouterStack(worker=worker) as stack:
            return stack, await scenario(stack)

    stack, events = asyncio.run(run())
    assert _ids(events) == list(b"Hello")
    assert _finish(events) == [pb.FINISH_REASON_LENGTH]
    first_id, second_id = list(worker.work)
    assert first_id != second_id and first_id.startswith("x") and second_id.startswith("x")
    assert worker.aborts[:2] == [first_id, first_id]  # never the new request's work
    assert stack.metric("tandem_requests_awaiting_worker_stop") == 0
    assert stack.store.stats().held_pages == 0


class _PrefillStoppedUnderTheCall(ScriptedWorker):
    async def Prefill(self, request, context):
        return wpb.PrefillResponse()  # what a prefill stopped by Abort answers


def test_a_prefill_reply_without_a_first_token_is_an_error_not_token_0():
    async def run():
        async with RouterStack(worker=_PrefillStoppedUnderTheCall()) as stack:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _read_all(stack.stub.Generate(pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=[5] * 20), max_new_tokens=5)))
            await stack.settled()
            return err.value

    error = asyncio.run(run())
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "before its first token" in error.details()


# --- 8. snapshot_every against the page size ----------------------------------
def test_a_snapshot_interval_that_is_not_whole_pages_is_refused_at_start_up():
    """Every hybrid request failed (ValueError -> UNKNOWN) under such a router."""
    store = ControlStore("tiny-qwen3.5", num_slots=16)
    tokenizer = load_tokenizer("tiny-qwen3.5")
    with pytest.raises(ValueError, match="snapshot_every 10 is not a multiple of the store's "
                                         "page size 16"):
        Router(store, None, None, tokenizer, RouterMetrics(gpu=False),
               RouterConfig(snapshot_every=10))
    Router(store, None, None, tokenizer, RouterMetrics(gpu=False),
           RouterConfig(snapshot_every=2 * PAGE)).tokenizing.shutdown()


# --- 2, 3. what the router cannot take is INVALID_ARGUMENT, saying what -------
_USER = pb.ChatMessage(role="user", content="hi")


def _tool_chat(parameters_json: str = '{"type": "object"}', arguments: str = "{}") -> pb.Chat:
    return pb.Chat(messages=[
        _USER, pb.ChatMessage(role="assistant", tool_calls=[
            pb.ToolCall(id="c1", name="f", arguments=arguments)]),
        pb.ChatMessage(role="tool", content="ok", tool_call_id="c1")],
        tools=[pb.Tool(name="f", parameters_json=parameters_json)])


@pytest.mark.parametrize("request_,message", [
    (pb.GenerateRequest(chat=_tool_chat(parameters_json='{"description": "\\ud800"}')),
     "tool 0 (f): parameters_json holds a lone UTF-16 surrogate"),
    (pb.GenerateRequest(chat=_tool_chat(parameters_json='{"\\udc00": {}}')),
     "tool 0 (f): parameters_json holds a lone UTF-16 surrogate"),
    (pb.GenerateRequest(chat=_tool_chat(arguments='{"city": "\\ud800"}')),
     "chat message 1 tool call 0 (f): arguments holds a lone UTF-16 surrogate"),
    (pb.GenerateRequest(chat=_tool_chat(parameters_json="[" * 5000 + "]" * 5000)),
     "parameters_json nests arrays or objects too deeply"),
    (pb.GenerateRequest(chat=_tool_chat(arguments='{"a": ' + "[" * 5000 + "]" * 5000 + "}")),
     "arguments nests arrays or objects too deeply"),
    (pb.GenerateRequest(text="hi", stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]),
     f"at most {MAX_STOP_STRINGS}"),
    (pb.GenerateRequest(text="hi", stop=["x" * (MAX_STOP_CHARS - 1), "yz"]),
     f"at most {MAX_STOP_CHARS}"),
])
def test_what_the_router_cannot_take_is_invalid_argument(request_, message):
    """Tool JSON that is JSON but no text a tokenizer can encode (a lone
    surrogate escape), or nested past the decoder's stack, and stop lists
    past the limits: INVALID_ARGUMENT saying what to fix (they were UNKNOWN,
    or, for stop lists, accepted: 200,000 stop strings stalled every stream).
    Tokenize renders the same chats and says the same."""
    async def run():
        async with RouterStack() as stack:
            errors = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _read_all(stack.stub.Generate(request_))
            errors.append(err.value)
            if request_.HasField("chat"):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stack.stub.Tokenize(pb.TokenizeRequest(chat=request_.chat))
                errors.append(err.value)
            at_the_limits = pb.GenerateRequest(  # and the service goes on serving
                text="hi", max_new_tokens=3,
                stop=["x" * (MAX_STOP_CHARS // MAX_STOP_STRINGS)] * MAX_STOP_STRINGS)
            assert _finish(await _read_all(stack.stub.Generate(at_the_limits)))
            await stack.settled()
            return errors

    for error in asyncio.run(run()):
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert message in error.details()


# --- a client that leaves right after an Abort --------------------------------
class _Context:
    """The servicer context of a call made here, without a server."""

    def time_remaining(self):
        return None

    async def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


def test_abort_finishes_the_stream_but_a_hang_up_after_it_still_cancels():
    """Abort ends a stream with FINISH_REASON_ABORT (the decode call's own
    cancel reads as CancelledError, which the router then expects). A client
    that also hangs up at that moment cancels the handler: that cancellation
    must go on (it was swallowed, and the handler ran to the end)."""
    async def run():
        async with RouterStack(worker=ScriptedWorker("x" * 200, step_s=0.01)) as stack:
            call = stack.stub.Generate(pb.GenerateRequest(
                request_id="a", token_ids=pb.TokenIds(ids=[5] * 20), max_new_tokens=150))
            await call.read(), await call.read()
            assert (await stack.stub.Abort(pb.AbortRequest(request_id="a"))).found
            aborted = await _read_all(call)
            await stack.settled()

            async def consume(received: list) -> None:
                async for event in stack.router.Generate(pb.GenerateRequest(
                        request_id="b", token_ids=pb.TokenIds(ids=[5] * 20),
                        max_new_tokens=150), _Context()):
                    received.append(event)

            received = []
            task = asyncio.ensure_future(consume(received))
            while len(received) < 3:
                await asyncio.sleep(0.005)
            await stack.router.Abort(pb.AbortRequest(request_id="b"), None)
            task.cancel()  # the client goes away at the same moment
            with pytest.raises(asyncio.CancelledError):
                await task
            await stack.settled()
            return stack, aborted, received

    stack, aborted, received = asyncio.run(run())
    assert _finish(aborted) == [pb.FINISH_REASON_ABORT]
    assert not _finish(received)
    assert stack.metric("tandem_requests_total", finish_reason="abort") == 1
    assert stack.metric("tandem_requests_total", finish_reason="cancelled") == 1
