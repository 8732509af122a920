"""Public requests become validated GenerationRequests; every defect is an
InvalidRequestError that says what to fix."""
import pytest

from engine.errors import InvalidRequestError
from engine.loader import load_model
from router.requests import request_from_pb
from router.text import TextStream
from tandem.v1 import generation_pb2 as pb


@pytest.fixture(scope="module")
def tokenizer():
    return load_model(progress=False).tokenizer


def _req(**kw):
    return pb.GenerateRequest(**kw)


def test_chat_text_and_ids_inputs(tokenizer):
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="Hi there")])
    r = request_from_pb(_req(chat=chat), tokenizer, 2048, 49152)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert list(r.prompt) == tokenizer.encode(text, add_special_tokens=False)
    assert r.request_id.startswith("req-") and r.params.seed is not None
    assert r.params.temperature == 1.0 and r.params.max_new_tokens == 256
    r = request_from_pb(_req(text="hello", request_id="mine"), tokenizer, 2048, 49152)
    assert r.request_id == "mine" and list(r.prompt) == tokenizer.encode("hello")
    r = request_from_pb(_req(token_ids=pb.TokenIds(ids=[5, 6, 7])), tokenizer, 2048, 49152)
    assert r.prompt == (5, 6, 7)


def test_explicit_zero_differs_from_unset(tokenizer):
    r = request_from_pb(_req(text="x", sampling=pb.SamplingParameters(temperature=0.0, seed=5),
                             max_new_tokens=3, stop=["\n"], logprobs=0), tokenizer, 2048, 49152)
    assert r.params.is_greedy and r.params.seed == 5 and r.params.max_new_tokens == 3
    assert r.params.stop == ("\n",) and r.params.logprobs == 0


def test_max_new_tokens_is_capped_by_the_context(tokenizer):
    r = request_from_pb(_req(token_ids=pb.TokenIds(ids=list(range(90))), max_new_tokens=500),
                        tokenizer, 100, 49152)
    assert r.params.max_new_tokens == 10


@pytest.mark.parametrize("kwargs,message", [
    ({}, "no input"),
    ({"text": ""}, "empty"),
    ({"token_ids": pb.TokenIds(ids=[1, 60000])}, "outside the vocabulary"),
    ({"token_ids": pb.TokenIds(ids=list(range(120)))}, "120 tokens.*100"),
    ({"chat": pb.Chat()}, "no messages"),
    ({"chat": pb.Chat(messages=[pb.ChatMessage(role="wizard", content="x")])}, "role 'wizard'"),
    ({"text": "x", "sampling": pb.SamplingParameters(top_p=1.5)}, "top_p"),
    ({"text": "x", "sampling": pb.SamplingParameters(temperature=-1)}, "temperature"),
    ({"text": "x", "max_new_tokens": 0}, "max_new_tokens"),
    ({"text": "x", "logprobs": 50}, "logprobs"),
    # stop strings are matched on the router's event loop: their cost is bounded
    ({"text": "x", "stop": ["s"] * 65}, "stop has 65 strings; at most 64"),
    ({"text": "x", "stop": ["s" * 4000, "t" * 97]}, "4097 characters in all; at most 4096"),
])
def test_bad_requests_say_what_to_fix(tokenizer, kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        request_from_pb(_req(**kwargs), tokenizer, 100, 49152)


def test_text_stream_hides_stop_strings_and_stop_tokens(tokenizer):
    ids = tokenizer.encode("Hello world, goodbye world")
    stream = TextStream(tokenizer, ["goodbye"], stop_token_ids=[2])
    text = "".join(stream.push(t) for t in ids) + stream.finish()
    assert text == "Hello world, " and stream.stopped
    stream = TextStream(tokenizer, [], stop_token_ids=[2])
    text = "".join(stream.push(t) for t in ids + [2]) + stream.finish()
    assert text == "Hello world, goodbye world"


def _tool_chat(**kw):
    return pb.Chat(messages=[
        pb.ChatMessage(role="user", content="Weather in Paris?"),
        pb.ChatMessage(role="assistant", tool_calls=[
            pb.ToolCall(id="c1", name="get_weather", arguments='{"city": "Paris"}')]),
        pb.ChatMessage(role="tool", content='{"celsius": 21}', tool_call_id="c1")],
        tools=[pb.Tool(name="get_weather", description="Weather",
                       parameters_json='{"type": "object"}')], **kw)


def test_chat_with_tools_renders_through_the_template(tokenizer):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": '{"celsius": 21}', "tool_call_id": "c1"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                               "parameters": {"type": "object"}}}]
    text = tokenizer.apply_chat_template(messages, tools=tools)
    r = request_from_pb(_req(chat=_tool_chat()), tokenizer, 2048, 49152)
    assert list(r.prompt) == tokenizer.encode(text, add_special_tokens=False)
    prefix = '<tool_call>\n{"name": "'
    r = request_from_pb(_req(chat=_tool_chat(assistant_prefix=prefix)), tokenizer, 2048, 49152)
    assert list(r.prompt) == tokenizer.encode(text + prefix, add_special_tokens=False)


@pytest.mark.parametrize("chat,message", [
    (pb.Chat(messages=[pb.ChatMessage(role="user", content="x", tool_calls=[
        pb.ToolCall(id="a", name="f", arguments="{}")])]), "only assistant"),
    (pb.Chat(messages=[pb.ChatMessage(role="user", content="x")],
             tools=[pb.Tool(name="f", parameters_json="{not json")]), "parameters_json"),
    (pb.Chat(messages=[pb.ChatMessage(role="user", content="x")], tools=[pb.Tool()]), "no name"),
    (pb.Chat(messages=[pb.ChatMessage(role="user", content="x")], add_generation_prompt=False,
             assistant_prefix="<tool_call>"), "add_generation_prompt"),
    # JSON whose lone surrogate escape no tokenizer encodes (the fast tokenizer
    # raised a bare TypeError), or nested past the decoder's stack
    (pb.Chat(messages=[pb.ChatMessage(role="user", content="x")],
             tools=[pb.Tool(name="f", parameters_json='{"description": "\\ud800"}')]),
     r"tool 0 \(f\): parameters_json holds a lone UTF-16 surrogate"),
    (pb.Chat(messages=[
        pb.ChatMessage(role="user", content="x"),
        pb.ChatMessage(role="assistant", tool_calls=[
            pb.ToolCall(id="a", name="f", arguments='{"city": "\\udfff"}')])]),
     r"chat message 1 tool call 0 \(f\): arguments holds a lone UTF-16 surrogate"),
    (pb.Chat(messages=[pb.ChatMessage(role="user", content="x")],
             tools=[pb.Tool(name="f", parameters_json="[" * 5000 + "]" * 5000)]),
     "parameters_json nests arrays or objects too deeply"),
])
def test_bad_tool_chats_say_what_to_fix(tokenizer, chat, message):
    with pytest.raises(InvalidRequestError, match=message):
        request_from_pb(_req(chat=chat), tokenizer, 2048, 49152)
