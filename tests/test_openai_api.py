"""The OpenAI-compatible HTTP API as agent frameworks meet it: the official
`openai` client against `tandem serve` (all five processes, the embedded
model, CPU), checked against the public gRPC API of the same service (the
router's own answers) and against the client's own parsing of every response.
One service for the whole module, with an API key required."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import openai
import pytest

from openai_api.tools import ToolCallStream, parse_tool_calls
from tandem.v1 import generation_pb2 as pb
from tandem.ports import free_port
from tests.test_service import PAGE, Service, _generate

KEY = "sk-tandem-test"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    svc = Service(tmp_path_factory.mktemp("openai"), http=True, api_key=KEY)
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def client(service):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{service.http_port}/v1", api_key=KEY,
                         max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _chat(client, model, text, **kwargs):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                          **kwargs)


def test_models_lists_the_one_served_model(client, model):
    (listed,) = client.models.list().data
    assert listed.id == model == "SmolLM2-135M-Instruct.Q4_1"
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_chat_is_the_routers_greedy_answer(service, client, model):
    question = "Name three colours."
    reply = _chat(client, model, question, max_tokens=16, temperature=0,
                  extra_body={"cache_salt": uuid.uuid4().hex})
    ids, text, complete = _generate(service.stub, sampling=pb.SamplingParameters(temperature=0.0),
                                    max_new_tokens=16, cache_salt="chat-grpc",
                                    chat=pb.Chat(messages=[pb.ChatMessage(role="user",
                                                                          content=question)]))
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason == {pb.FINISH_REASON_STOP: "stop",
                                    pb.FINISH_REASON_LENGTH: "length"}[complete.finish_reason]
    assert reply.usage.completion_tokens == len(ids) == complete.usage.completion_tokens
    assert reply.usage.prompt_tokens == complete.usage.prompt_tokens
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.usage.prompt_tokens_details.cached_tokens == 0  # its own salt: nothing cached
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"


def test_completions_and_their_logprobs(service, client, model):
    reply = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6,
                                      temperature=0, logprobs=2)
    ids, text, _ = _generate(service.stub, text="The capital of France is", max_new_tokens=6,
                             sampling=pb.SamplingParameters(temperature=0.0))
    choice = reply.choices[0]
    assert choice.text == text and choice.finish_reason in ("stop", "length")
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) == reply.usage.completion_tokens
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) == 2
        assert max(top.values()) == pytest.approx(logprob)  # greedy took the likeliest
    assert "".join(lp.tokens) == text
    # token ids as the prompt give the same answer
    prompt_ids = service.stub.Tokenize(pb.TokenizeRequest(text="The capital of France is")).token_ids
    again = client.completions.create(model=model, prompt=list(prompt_ids), max_tokens=6,
                                      temperature=0)
    assert again.choices[0].text == text


def test_chat_logprobs_name_each_token(client, model):
    reply = _chat(client, model, "Say hello.", max_tokens=5, temperature=0, logprobs=True,
                  top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert bytes(entry.bytes).decode() == entry.token


def test_streaming_chat_and_usage(client, model):
    whole = _chat(client, model, "Write a haiku about rain.", max_tokens=20, temperature=0)
    stream = _chat(client, model, "Write a haiku about rain.", max_tokens=20, temperature=0,
                   stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in body)
    assert body[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == whole.choices[0].message.content
    assert body[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    # the second identical prompt found the first one's whole pages in the cache
    cached = last.usage.prompt_tokens_details.cached_tokens
    assert cached == last.usage.prompt_tokens // PAGE * PAGE > 0
    # without include_usage: no usage anywhere
    plain = list(_chat(client, model, "Write a haiku about rain.", max_tokens=4, temperature=0,
                       stream=True))
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason


def test_streaming_completions(client, model):
    chunks = list(client.completions.create(model=model, prompt="One, two, three,", max_tokens=8,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    whole = client.completions.create(model=model, prompt="One, two, three,", max_tokens=8,
                                      temperature=0)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings_end_the_answer_unshown(client, model):
    full = _chat(client, model, "Count from one to ten in words.", max_tokens=30,
                 temperature=0).choices[0].message.content
    # a stop string from the middle of the greedy answer, whatever its words:
    # rk4's greedy answer here is words on one CPU and digits on another
    assert len(full) >= 8, full
    stop = full[len(full) // 2:len(full) // 2 + 2]
    cut = _chat(client, model, "Count from one to ten in words.", max_tokens=30, temperature=0,
                stop=[stop, "zzz-never"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[:full.index(stop)]


def test_seed_reproduces_a_sampled_answer(client, model):
    def sample(seed):
        return _chat(client, model, "Tell me a story.", max_tokens=10, temperature=1.0, top_p=0.95,
                     seed=seed).choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(99), sample(-5)}) > 1  # a negative seed is accepted too


def test_presence_and_frequency_penalties_are_applied(client, model):
    """They act on output tokens only: a greedy answer that repeats a word
    ("wild" here) changes once repeats are penalised."""
    kwargs = dict(model=model, prompt="the the the the the the", max_tokens=12, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    assert plain.count("wild") > 1, plain
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        penalised = client.completions.create(**kwargs, **penalty).choices[0].text
        assert penalised.count("wild") < plain.count("wild"), (penalty, penalised)


# An earlier exchange shows the 135M model the call format (its template has
# no tool support: tandem renders tools, calls and results in Qwen's format).
EXAMPLE = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
    {"role": "assistant", "content": "It is 21 degrees in Paris."},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_tool_call_round_trip(client, model):
    messages = EXAMPLE + [{"role": "user", "content": "What is the weather in Rome?"}]
    first = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER],
                                           tool_choice=NAMED, max_tokens=24, temperature=0,
                                           extra_body={"cache_salt": "tools"})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Rome"}
    assert call.id.startswith("call_") and choice.message.content is None
    # the framework runs the tool and sends everything back
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 25}'}]
    second = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER],
                                            max_tokens=16, temperature=0,
                                            extra_body={"cache_salt": "tools"})
    answer = second.choices[0]
    assert answer.message.content and not answer.message.tool_calls
    assert answer.finish_reason in ("stop", "length")
    # the previous prompt (tools block, example, question) came from the cache
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // PAGE * PAGE
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def test_required_tool_call_streamed_and_whole(client, model):
    kwargs = dict(model=model, messages=EXAMPLE + [{"role": "user", "content": "Weather in Rome?"}],
                  tools=[WEATHER], max_tokens=24, temperature=0, tool_choice="required")
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert whole.finish_reason == chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert whole.message.tool_calls[0].function.name == "get_weather"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)


def test_malformed_tool_call_comes_back_as_text(client, model):
    # a stop string cuts the forced call's JSON short: the client gets the text
    reply = client.chat.completions.create(
        model=model, messages=EXAMPLE + [{"role": "user", "content": "Weather in Rome?"}],
        tools=[WEATHER], tool_choice=NAMED, max_tokens=24, temperature=0, stop=["Rome"])
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content.startswith('<tool_call>\n{"name": "get_weather", "arguments": ')


@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": 5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 2}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"stop": 7}, "stop"),
    ({"messages": [{"role": ["user"], "content": "hi"}]}, "messages[0].role"),
    ({"extra_body": {"top_k": 2**31}}, "top_k"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": "get_weather"}},
     "tool_choice"),
])
def test_bad_parameters_are_400_naming_the_parameter(client, model, kwargs, param):
    args = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**{**args, **kwargs})
    assert err.value.status_code == 400
    assert err.value.body["param"] == param and err.value.body["type"] == "invalid_request_error"


def test_router_rejections_and_unknown_models(client, model):
    with pytest.raises(openai.NotFoundError) as err:
        _chat(client, "gpt-4o", "hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and "gpt-4o" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:  # the router's INVALID_ARGUMENT
        client.completions.create(model=model, prompt=[5] * 9000, max_tokens=2)
    assert "context" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt=["a", "b"], max_tokens=2)
    assert err.value.body["param"] == "prompt"


def _http(service, path, body=None, key=KEY, method=None):
    request = urllib.request.Request(f"http://127.0.0.1:{service.http_port}{path}", data=body,
                                     method=method)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_api_key_bad_json_and_unknown_routes(service, model):
    wrong = openai.OpenAI(base_url=f"http://127.0.0.1:{service.http_port}/v1", api_key="sk-wrong",
                          max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        wrong.models.list()
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    # the client refuses to send no key at all: ask by hand
    status, body = _http(service, "/v1/chat/completions", b"{}", key=None)
    assert status == 401 and "missing API key" in body["error"]["message"]
    assert _http(service, "/health", key=None) == (200, {"status": "ok"})
    status, body = _http(service, "/v1/chat/completions", b"{not json")
    assert status == 400 and "JSON" in body["error"]["message"]
    status, body = _http(service, "/v1/embeddings", b"{}")
    assert status == 404 and body["error"]["code"] == "unknown_url"
    status, body = _http(service, "/v1/chat/completions", method="GET")
    assert status == 405 and body["error"]["type"] == "invalid_request_error"


def test_text_protobuf_cannot_carry_is_400_naming_where(service, model):
    """JSON that json.loads takes but a GenerateRequest cannot hold: a lone
    UTF-16 surrogate escape (protobuf strings are UTF-8), a token id past
    uint32, nesting past the decoder's stack. Each is a 400 naming the
    parameter, never a 500."""
    chat = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for body, param in (
            ({**chat, "messages": [{"role": "user", "content": "a\ud800b"}]},
             "messages[0].content"),
            ({**chat, "stop": ["ok", "\udfff"]}, "stop[1]"),
            ({**chat, "cache_salt": "\ud800"}, "cache_salt")):
        status, reply = _http(service, "/v1/chat/completions", json.dumps(body).encode())
        assert (status, reply["error"]["param"]) == (400, param), reply
        assert "lone UTF-16 surrogate" in reply["error"]["message"]
    for prompt in ("\udc00", [1, 2**32]):
        status, reply = _http(service, "/v1/completions",
                              json.dumps({"model": model, "prompt": prompt}).encode())
        assert (status, reply["error"]["param"]) == (400, "prompt"), reply
    status, reply = _http(service, "/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and "too deeply" in reply["error"]["message"]
    status, reply = _http(service, "/v1/chat/completions",
                          json.dumps(chat)[:-1].encode() + b', "seed": ' + b"9" * 5000 + b"}")
    assert status == 400 and "not valid JSON" in reply["error"]["message"], reply
    status, reply = _http(service, "/v1/chat/completions",
                          json.dumps({**chat, "max_tokens": 1e300}).encode())
    assert (status, reply["error"]["param"]) == (400, "max_tokens"), reply
    assert "got 1e+300" in reply["error"]["message"]
    # an emoji escaped as its surrogate pair is valid text
    status, reply = _http(service, "/v1/chat/completions", json.dumps(
        {**chat, "messages": [{"role": "user", "content": "\U0001F600"}]}).encode())
    assert status == 200, reply


def test_disconnect_mid_stream_gives_back_every_page(service, client, model):
    baseline = service.store_stats().held_pages
    stream = _chat(client, model, "Count to one thousand.", max_tokens=800, temperature=0,
                   stream=True, extra_body={"ignore_eos": True, "cache_salt": "disconnect"})
    next(stream), next(stream), next(stream)
    assert service.store_stats().held_pages > baseline  # the request holds its 800 tokens' pages
    stream.close()
    deadline = time.time() + 3
    while service.store_stats().held_pages != baseline and time.time() < deadline:
        time.sleep(0.05)
    assert service.store_stats().held_pages == baseline
    assert _chat(client, model, "Hi", max_tokens=2).choices[0].message.content is not None


def test_ten_turn_agent_conversation_is_served_from_the_cache(client, model):
    """An agent loop resends the whole conversation as text each turn: from
    turn 2 on, everything up to the previous turn's answer comes from the
    prefix cache, so cached_tokens grows every turn and covers earlier turns."""
    messages = [{"role": "system", "content": "You are a terse assistant."}]
    salt, previous = f"agent-{uuid.uuid4().hex}", None
    for turn in range(10):
        messages.append({"role": "user", "content": f"Step {turn}: name a fruit."})
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                               temperature=0, extra_body={"cache_salt": salt})
        usage = reply.usage
        cached = usage.prompt_tokens_details.cached_tokens
        if previous is None:
            assert cached == 0
        else:
            seen = previous.prompt_tokens + previous.completion_tokens
            assert cached > previous.prompt_tokens_details.cached_tokens
            assert cached >= (seen - 1) // PAGE * PAGE, (turn, cached, seen)
            assert cached < usage.prompt_tokens
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        previous = usage


def test_standalone_gateway_without_a_key(service):
    """`python -m openai_api`, as compose runs it, against the same router; no
    key needed when none is set; a taken port is a one-line error, exit 2."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_API_KEY"}
    argv = [sys.executable, "-m", "openai_api", "--router", f"127.0.0.1:{service.port}",
            "--port", str(port), "--model-name", "smol"]
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert "serving smol" in proc.stderr.readline()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0)
        assert [m.id for m in client.models.list().data] == ["smol"]
        taken = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert taken.returncode == 2 and "cannot listen" in taken.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=15)


# --- tool-call parsing without the model ---------------------------------------
NAMES = frozenset({"get_weather", "search"})


@pytest.mark.parametrize("text,expected", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     ("", [("get_weather", {"city": "Paris"})])),
    ('Let me check.\n<tool_call>{"name": "search", "arguments": {"q": "a"}}</tool_call>\n'
     '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"B\\"}"}</tool_call>',
     ("Let me check.", [("search", {"q": "a"}), ("get_weather", {"city": "B"})])),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}', ("", [
        ("get_weather", {"city": "Rome"})])),  # EOS before the closing tag
    ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', None),
    ('<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>', None),
    ('<tool_call>["get_weather"]</tool_call>', None),
    ("no call here", None),
])
def test_parse_tool_calls(text, expected):
    parsed = parse_tool_calls(text, NAMES)
    if expected is None:
        assert parsed is None
        return
    content, calls = parsed
    assert (content, [(c["name"], json.loads(c["arguments"])) for c in calls]) == expected


@pytest.mark.parametrize("text", [
    'Sure. <tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>',
    "a < b and <tool_ca is not a call",
    'text <tool_call>{"broken" </tool_call> after',
])
def test_streaming_tool_parser_agrees_with_the_whole_parse(text):
    whole = parse_tool_calls(text, NAMES)
    for size in (1, 2, 3, 7, len(text)):
        stream = ToolCallStream(NAMES)
        shown = "".join(stream.push(text[i:i + size]) for i in range(0, len(text), size))
        tail, calls = stream.finish()
        if whole is None:
            assert calls is None and shown + tail == text
        else:
            assert calls == whole[1] and (shown + tail).strip() == whole[0]
