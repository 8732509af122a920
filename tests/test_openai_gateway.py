"""The OpenAI gateway where what it is handed is odd: the real Gateway
(aiohttp) in front of a real router over gRPC, whose worker writes exactly the
text a test gives it (tests/test_router_lifecycle.py's RouterStack: a byte
tokenizer, so token ids spell the text). Whatever the model writes or the
client sends, the answer is a well-formed response: tool calls it cannot
parse are text, a client's mistakes are 4xx naming them, and a stream that
started is never given a second status line."""
from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from openai_api import app as gateway_app
from openai_api.app import Gateway
from openai_api.tools import parse_tool_calls
from tandem.v1 import generation_pb2 as pb
from tests.test_router_lifecycle import ControlStore, RouterStack, ScriptedWorker

KEY = "sk-gateway-test"
WEATHER = {"type": "function", "function": {"name": "get_weather",
                                            "parameters": {"type": "object"}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


@contextlib.asynccontextmanager
async def gateway(model_text: str = "Hello there", api_key: str | None = None):
    """(an aiohttp client of the gateway, the model id) over a router whose
    model writes `model_text`."""
    async with RouterStack(ControlStore(num_pages=256),
                           ScriptedWorker(model_text, step_s=0.001, per_event=8)) as stack:
        info = await stack.stub.GetModelInfo(pb.GetModelInfoRequest())
        gw = Gateway(stack.stub, info, api_key=api_key)
        client = TestClient(TestServer(gw.app()))
        await client.start_server()
        try:
            yield client, gw.model_name
        finally:
            await client.close()
            await stack.settled()


def _run(scenario):
    """asyncio.run, bounded: a response the client cannot read to its end
    fails the test instead of hanging it."""
    return asyncio.run(asyncio.wait_for(scenario, 30))


def _sse_events(body: str) -> list:
    """The `data:` events of a whole SSE body, parsed; [DONE] as the string."""
    assert "HTTP/1.1" not in body  # never a status line inside the body
    chunks = [part for part in body.split("\n\n") if part]
    assert all(c.startswith("data: ") for c in chunks), chunks
    return [c[6:] if c == "data: [DONE]" else json.loads(c[6:]) for c in chunks]


def _streamed_content(events: list) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or ""
                   for e in events if isinstance(e, dict) and e.get("choices"))


# --- 5. tool calls the gateway cannot parse are text, never an error ------------
MALFORMED_CALLS = [
    '<tool_call>\n{"name": ["get_weather"], "arguments": {"city": "Paris"}}\n</tool_call>',
    '<tool_call>\n{"name": {"n": 1}, "arguments": {}}\n</tool_call>',
    # valid JSON, but no UTF-8 response can carry the lone surrogate it decodes to
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "\\ud800"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", '
    '"arguments": "{\\"city\\": \\"\\udfff\\"}"}\n</tool_call>',
]


@pytest.mark.parametrize("model_text", MALFORMED_CALLS)
def test_a_tool_call_the_gateway_cannot_parse_is_text_whole_and_streamed(model_text):
    """A name that is no string (a list was unhashable: 500) or arguments with
    a lone surrogate (the stream's UTF-8 encode raised mid-body, and the 500
    went out as a second status line inside the open SSE body)."""
    async def run():
        async with gateway(model_text) as (client, model):
            body = {"model": model, "messages": USER, "tools": [WEATHER], "max_tokens": 400}
            whole = await client.post("/v1/chat/completions", json=body)
            streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
            return (whole.status, await whole.json()), (streamed.status, await streamed.text())

    (status, whole), (stream_status, stream_body) = _run(run())
    assert status == 200, whole
    message = whole["choices"][0]["message"]
    assert message["content"] == model_text and not message.get("tool_calls")
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert stream_status == 200
    events = _sse_events(stream_body)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    assert _streamed_content(events) == model_text


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_weather", "arguments": ' + "[" * 5000 + "]" * 5000 + "}</tool_call>",
    '<tool_call>{"name": "get_weather", "arguments": {"n": ' + "9" * 5000 + "}}</tool_call>",
])
def test_tool_call_json_too_deep_or_too_long_to_read_is_no_call(text):
    """Nesting past the decoder's stack (RecursionError) and an integer past
    Python's 4,300 digits (ValueError): plain text, as any malformed call."""
    assert parse_tool_calls(text, frozenset({"get_weather"})) is None


def test_an_error_after_the_stream_started_is_an_error_event_not_a_status_line(monkeypatch):
    """Whatever fails once the SSE status line is out (here: building the
    closing chunks) ends the stream with an error event and [DONE]."""
    def broken(self):
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(gateway_app.Answer, "_closing", broken)

    async def run():
        async with gateway("Hello there") as (client, model):
            r = await client.post("/v1/chat/completions", json={
                "model": model, "messages": USER, "max_tokens": 20, "stream": True})
            return r.status, await r.text()

    status, body = _run(run())
    assert status == 200
    *chunks, error, done = _sse_events(body)
    assert _streamed_content(chunks) == "Hello there"
    assert error["error"]["type"] == "server_error" and "RuntimeError" in error["error"]["message"]
    assert done == "[DONE]"


# --- 7. an API key that is no UTF-8 is a wrong key -----------------------------
def test_an_api_key_of_bytes_that_are_no_utf8_is_401():
    async def raw_get(port: int, authorization: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     b"Authorization: " + authorization + b"\r\n\r\n")
        await writer.drain()
        reply = await reader.read()
        writer.close()
        return reply

    async def run():
        async with gateway(api_key=KEY) as (client, _):
            port = client.server.port
            return [await raw_get(port, key) for key in (
                b"Bearer \xff\xfe", b"Bearer caf\xc3\xa9", b"Bearer " + KEY.encode())]

    bad, other_text, right = _run(run())
    for reply in (bad, other_text):
        assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
        assert b'"invalid_api_key"' in reply
    assert right.startswith(b"HTTP/1.1 200")


# --- 3. stop lists past the limits ---------------------------------------------
@pytest.mark.parametrize("stop,limit", [
    ([f"s{i}" for i in range(65)], "at most 64"),
    (["x" * 4000, "y" * 97], "at most 4096"),
])
def test_stop_lists_past_the_limits_are_400_naming_stop(stop, limit):
    async def run():
        async with gateway() as (client, model):
            body = {"model": model, "messages": USER, "max_tokens": 3}
            refused = await client.post("/v1/chat/completions", json={**body, "stop": stop})
            at_limits = await client.post("/v1/chat/completions",
                                          json={**body, "stop": ["z" * 64] * 64})
            return refused.status, await refused.json(), at_limits.status

    status, reply, at_limits = _run(run())
    assert (status, reply["error"]["param"]) == (400, "stop")
    assert limit in reply["error"]["message"]
    assert at_limits == 200


# --- 2. tool JSON the router cannot read, from HTTP ----------------------------
def test_tool_json_with_a_lone_surrogate_is_400_saying_where():
    """A parameter schema's key (the gateway escaped it to ASCII, so the router
    met it only when rendering: 500) and a history call's arguments string
    (JSON text the router decodes: its INVALID_ARGUMENT becomes the 400)."""
    async def run():
        async with gateway() as (client, model):
            base = {"model": model, "max_tokens": 2}
            key = await client.post("/v1/chat/completions", data=json.dumps({
                **base, "messages": USER, "tools": [{"type": "function", "function": {
                    "name": "f", "parameters": {"\ud800": {}}}}]}))
            history = await client.post("/v1/chat/completions", data=json.dumps({
                **base, "messages": USER + [
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": '{"a": "\\ud800"}'}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}))
            return [(r.status, await r.json()) for r in (key, history)]

    (key_status, key_reply), (history_status, history_reply) = _run(run())
    assert (key_status, key_reply["error"]["param"]) == (400, "tools[0].function.parameters")
    assert "lone UTF-16 surrogate" in key_reply["error"]["message"]
    assert history_status == 400, history_reply
    assert "tool call 0 (f): arguments holds a lone UTF-16 surrogate" in (
        history_reply["error"]["message"])


# --- float32 narrowing of sampling parameters ---------------------------------
def test_parameters_below_float32_keep_their_meaning_or_are_refused_as_sent():
    """top_p 1e-60 (valid: only the likeliest token) reached the router as 0
    and was refused quoting 0.0; repetition_penalty 1e-60 or 1e300 (0 or inf
    as float32) is refused quoting what the client sent."""
    async def run():
        async with gateway("Hello there") as (client, model):
            body = {"model": model, "messages": USER, "max_tokens": 3}
            replies = []
            for extra in ({"top_p": 1e-60}, {"repetition_penalty": 1e-60},
                          {"repetition_penalty": 1e300}):
                r = await client.post("/v1/chat/completions", json={**body, **extra})
                replies.append((r.status, await r.json()))
            return replies

    (top_p, top_p_reply), *penalties = _run(run())
    assert top_p == 200, top_p_reply
    assert top_p_reply["choices"][0]["message"]["content"] == "Hel"
    for (status, reply), sent in zip(penalties, ("1e-60", "1e+300")):
        assert (status, reply["error"]["param"]) == (400, "repetition_penalty")
        assert f"got {sent}" in reply["error"]["message"]
