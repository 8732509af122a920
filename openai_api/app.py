"""The aiohttp application: routes, the API key, whole and streamed answers.

Every generation is one `tandem.v1` Generate call. A client that goes away
cancels the handler (the app runs with handler_cancellation), and the
handler's `finally` cancels the gRPC call; the router then stops the request
and gives back its pages. Errors before the first byte of an answer are
OpenAI error JSON with their HTTP status; an error in the middle of a stream
(the status line is gone) is sent as one `data: {"error": ...}` event, then
`data: [DONE]`.
"""
from __future__ import annotations

import hmac
import json
import sys
import time

import grpc
from aiohttp import web

from openai_api import protocol
from openai_api.errors import ApiError, from_grpc, invalid
from openai_api.protocol import Job
from openai_api.tools import ToolCallStream, new_call_id
from tandem.v1 import generation_pb2 as pb

MAX_BODY_BYTES = 64 << 20  # a long agent conversation, resent whole each turn
_NO_KEY_PATHS = ("/health",)
# set on a request once its streamed response sent its status line (a typed
# key where aiohttp has them, 3.12+; a plain one warns there)
_STREAM_STARTED = (web.RequestKey("tandem_stream_started", bool) if hasattr(web, "RequestKey")
                   else "tandem_stream_started")


class Gateway:
    """The HTTP side of one router: `app()` builds the aiohttp application."""

    def __init__(self, stub, info: pb.ModelInfo, api_key: str | None = None,
                 model_name: str | None = None) -> None:
        self.stub = stub
        self.info = info
        self.api_key = api_key or None
        self.started = int(time.time())
        # the id clients send as `model`; the router's full name is accepted too
        self.model_name = model_name or short_model_name(info.model)
        self.aliases = frozenset({self.model_name, info.model})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES,
                              middlewares=[self._errors, self._authorize])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        return app

    # --- middlewares --------------------------------------------------------
    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)
        except web.HTTPException as e:
            if e.status == 404:
                e = ApiError(404, f"no route {request.method} {request.path}; this server has "
                                  "/v1/chat/completions, /v1/completions and /v1/models",
                             code="unknown_url")
            elif e.status == 405:
                e = ApiError(405, f"{request.method} is not allowed on {request.path}",
                             code="method_not_allowed")
            elif e.status == 413:
                e = ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes",
                             code="request_too_large")
            else:
                raise
            return web.json_response(e.body(), status=e.status)
        except (ConnectionError, TimeoutError):
            raise  # the client went away: nobody to answer
        except Exception as e:  # a bug of ours: the client still gets JSON
            if request.get(_STREAM_STARTED):
                # a status line went out already; a second one would land in
                # the open body: let aiohttp close the connection instead
                raise
            print(f"openai_api: error on {request.method} {request.path}: {e!r}", file=sys.stderr,
                  flush=True)
            error = ApiError(500, f"internal error: {type(e).__name__}", "server_error")
            return web.json_response(error.body(), status=500)

    @web.middleware
    async def _authorize(self, request, handler):
        if self.api_key is not None and request.path not in _NO_KEY_PATHS:
            scheme, _, key = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not key:
                raise ApiError(401, "missing API key: send the header 'Authorization: Bearer KEY'",
                               code="invalid_api_key")
            if not _key_matches(key.strip(), self.api_key):
                raise ApiError(401, "incorrect API key", code="invalid_api_key")
        return await handler(request)

    # --- routes -------------------------------------------------------------
    async def health(self, request):
        return web.json_response({"status": "ok"})

    def _model_json(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.started,
                "owned_by": "tandem", "max_model_len": self.info.max_context_tokens}

    async def models(self, request):
        return web.json_response({"object": "list", "data": [self._model_json()]})

    async def model(self, request):
        protocol.check_model(request.match_info["model"], self.aliases, self.model_name)
        return web.json_response(self._model_json())

    async def chat_completions(self, request):
        body = await _json(request)
        return await self._run(request, protocol.chat_job(body, self.aliases, self.model_name))

    async def completions(self, request):
        body = await _json(request)
        return await self._run(request, protocol.completion_job(body, self.aliases,
                                                                self.model_name))

    # --- one generation -----------------------------------------------------
    async def _run(self, request, job: Job):
        call = self.stub.Generate(job.generate)
        try:
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as e:
                raise from_grpc(e) from None
            if job.stream:
                return await self._stream(request, job, call, first)
            return await self._whole(job, call, first)
        finally:
            call.cancel()  # a no-op once finished; after a disconnect it stops the request

    async def _whole(self, job: Job, call, event) -> web.Response:
        answer = Answer(job)
        try:
            while event is not grpc.aio.EOF:
                answer.add(event)
                event = await call.read()
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        if answer.complete is None:
            raise ApiError(500, "the router's stream ended without a result", "server_error")
        return web.json_response(answer.whole())

    async def _stream(self, request, job: Job, call, event) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        request[_STREAM_STARTED] = True
        answer = Answer(job)
        try:
            for payload in answer.opening():
                await _send(response, payload)
            while event is not grpc.aio.EOF:
                for payload in answer.add(event):
                    await _send(response, payload)
                event = await call.read()
        except grpc.aio.AioRpcError as e:
            await _send(response, from_grpc(e).body())
        except (ConnectionError, TimeoutError):
            raise  # the client went away: nobody to answer
        except Exception as e:  # a bug of ours, with the status line gone: an error event
            print(f"openai_api: error in the stream of {request.method} {request.path}: {e!r}",
                  file=sys.stderr, flush=True)
            await _send(response, ApiError(500, f"internal error: {type(e).__name__}",
                                           "server_error").body())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


class Answer:
    """One response being built from the router's events: add() returns the
    stream chunks each event makes; whole() is the non-streamed response."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.complete: pb.Complete | None = None
        self.tools = ToolCallStream(job.tool_names, job.forced_prefix) if job.tool_names else None
        self.content: list[str] = []  # what the client is shown as content
        self.calls: list[dict] | None = None  # parsed tool calls, with their ids
        self.chat_logprobs: list[dict] = []
        self.completion_logprobs = protocol.CompletionLogprobs()
        self.logprob_parts: list[dict] = []

    def opening(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""})] if self.job.chat else []

    def add(self, event: pb.GenerateResponse) -> list[dict]:
        if event.HasField("complete"):
            self.complete = event.complete
            return self._closing()
        chunk = event.chunk
        content = self.tools.push(chunk.text) if self.tools else chunk.text
        self.content.append(content)
        logprobs = self._logprobs(chunk)
        if not content and logprobs is None:
            return []
        return [self._content_chunk(content, logprobs)]

    def _content_chunk(self, content: str, logprobs=None) -> dict:
        if self.job.chat:
            return self._chunk({"content": content}, logprobs=logprobs)
        return self._chunk(None, text=content, logprobs=logprobs)

    def _logprobs(self, chunk: pb.Chunk):
        if self.job.top_logprobs is None or not chunk.logprobs:
            return None
        if self.job.chat:
            entries = protocol.chat_logprob_entries(chunk)
            self.chat_logprobs.extend(entries)
            return {"content": entries}
        part = self.completion_logprobs.of(chunk)
        self.logprob_parts.append(part)
        return part

    def _closing(self) -> list[dict]:
        out = []
        if self.tools is not None:
            tail, calls = self.tools.finish()
            if calls is not None:
                tail = tail if tail.strip() else ""  # whitespace around the blocks is no content
                self.calls = [{"id": new_call_id(), "type": "function", "function": c}
                              for c in calls]
            if tail:
                self.content.append(tail)
                out.append(self._content_chunk(tail))
            if self.calls:
                out.append(self._chunk({"tool_calls": [
                    {"index": i, **call} for i, call in enumerate(self.calls)]}))
        finish = protocol.finish_reason(self.complete, bool(self.calls))
        if self.job.chat:
            out.append(self._chunk({}, finish=finish))
        else:
            out.append(self._chunk(None, text="", finish=finish))
        if self.job.include_usage:
            out.append({**protocol.envelope(self.job, True), "choices": [],
                        "usage": protocol.usage_json(self.complete.usage)})
        return out

    def _chunk(self, delta: dict | None, *, text: str | None = None, logprobs=None,
               finish: str | None = None) -> dict:
        choice: dict = {"index": 0}
        if self.job.chat:
            choice["delta"] = delta
        else:
            choice["text"] = text
        choice.update(logprobs=logprobs, finish_reason=finish)
        out = {**protocol.envelope(self.job, True), "choices": [choice]}
        if self.job.include_usage:
            out["usage"] = None
        return out

    def whole(self) -> dict:
        text = "".join(self.content)
        finish = protocol.finish_reason(self.complete, bool(self.calls))
        usage = protocol.usage_json(self.complete.usage)
        if not self.job.chat:
            logprobs = (protocol.merge_completion_logprobs(self.logprob_parts)
                        if self.job.top_logprobs is not None else None)
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
            return {**protocol.envelope(self.job, False), "choices": [choice], "usage": usage}
        message: dict = {"role": "assistant", "content": text}
        if self.calls:
            message = {"role": "assistant", "content": text.strip() or None,
                       "tool_calls": self.calls}
        logprobs = {"content": self.chat_logprobs} if self.job.top_logprobs is not None else None
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
        return {**protocol.envelope(self.job, False), "choices": [choice], "usage": usage}


def short_model_name(model: str) -> str:
    """A path's file name without .gguf ("SmolLM2-135M-Instruct.Q4_1"); a
    directory's or a shape's name as is."""
    name = model.rstrip("/").rsplit("/", 1)[-1]
    return name[:-len(".gguf")] if name.endswith(".gguf") else name


def _key_matches(sent: str, expected: str) -> bool:
    """Whether the key a client sent is the API key, in constant time. aiohttp
    keeps header bytes that are no UTF-8 as surrogate escapes: they go back to
    those bytes (a plain encode() raised: a 500 instead of a 401), as Python
    keeps such bytes of the environment, where the key may come from."""
    return hmac.compare_digest(sent.encode("utf-8", "surrogateescape"),
                               expected.encode("utf-8", "surrogateescape"))


async def _json(request) -> dict:
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError as e:  # bad JSON, bad UTF-8, an integer of more than 4,300 digits
        raise invalid(None, f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # the decoder's stack, not the body's size, ran out
        raise invalid(None, "the request body nests arrays or objects too deeply to read") from None
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    return body


async def _send(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")
