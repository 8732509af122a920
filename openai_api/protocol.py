"""OpenAI request JSON -> `tandem.v1.GenerateRequest`, and generation events
-> OpenAI response JSON (whole responses and server-sent event chunks).

Validation here names OpenAI's parameter in every error (`param`), checks
types and OpenAI's ranges, and rejects what tandem does not do (n > 1,
best_of > 1, echo, suffix, logit_bias, non-text response formats, non-text
content parts) with a 400 that says so. The router validates again; its
INVALID_ARGUMENT also becomes a 400.

Decisions (README "OpenAI-compatible HTTP API"):
  * tool_choice "auto" (default with tools): tools rendered, `<tool_call>`
    blocks parsed; "none": tools rendered (so the prompt, and its cached
    prefix, is the same as with "auto") but output never parsed;
    "required" / a named function: the assistant turn is forced to open
    with `<tool_call>\\n{"name": "` (required) or
    `<tool_call>\\n{"name": "NAME", "arguments": ` (named), which the model
    continues and the gateway parses with that opening put back.
  * a negative `seed` is taken modulo 2**64 (tandem's seeds are unsigned).
  * unset max_tokens takes the router's default (256 tokens).
  * finish_reason: EOS/stop -> "stop", length -> "length", parsed tool
    calls -> "tool_calls", an Abort -> "stop".
"""
from __future__ import annotations

import functools
import json
import math
import time
import uuid
from dataclasses import dataclass

from openai_api.errors import ApiError, invalid
from openai_api.tools import OPEN as TOOL_OPEN
from tandem.text_limits import LONE_SURROGATE, MAX_STOP_CHARS, MAX_STOP_STRINGS
from tandem.v1 import generation_pb2 as pb

MAX_TOP_LOGPROBS = 20
# the range a protobuf float (float32) holds without flushing to 0 or
# overflowing to inf: its smallest normal value and its largest
_FLOAT32_MIN_NORMAL = 1.1754943508222875e-38
_FLOAT32_MAX = 3.4028234663852886e38
_INT32_MAX = (1 << 31) - 1  # top_k's protobuf field
_TOKEN_ID_LIMIT = 1 << 32  # TokenIds' protobuf field: uint32
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool"}
_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
           pb.FINISH_REASON_ABORT: "stop"}


@dataclass(frozen=True)
class Job:
    """One OpenAI request, translated, with what shaping its answer needs."""

    chat: bool  # /v1/chat/completions (else /v1/completions)
    id: str  # the response id, also the router's request_id
    model: str
    created: int
    generate: pb.GenerateRequest
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None = no logprobs
    tool_names: frozenset[str]  # functions whose calls are parsed; empty = no parsing
    forced_prefix: str  # text the assistant turn was made to start with


# --- reading parameters ------------------------------------------------------
class _Body:
    """Typed access to a request's JSON object; errors name the parameter."""

    def __init__(self, body) -> None:
        if not isinstance(body, dict):
            raise invalid(None, "the request body must be a JSON object")
        self.body = body

    def has(self, name: str) -> bool:
        return self.body.get(name) is not None

    def get(self, name: str, default=None):
        value = self.body.get(name)
        return default if value is None else value

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self.get(name, default)
        if not isinstance(value, bool):
            raise invalid(name, f"'{name}' must be true or false, got {value!r}")
        return value

    def integer(self, name: str, low: int | None = None, high: int | None = None) -> int | None:
        value = self.get(name)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(name, f"'{name}' must be an integer, got {value!r}")
        _check_range(name, value, low, high)
        return value

    def number(self, name: str, low: float | None = None, high: float | None = None,
               low_open: bool = False) -> float | None:
        value = self.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise invalid(name, f"'{name}' must be a number, got {value!r}")
        if low_open and value <= low:
            raise invalid(name, f"'{name}' must be > {low}, got {value}")
        _check_range(name, value, low, high)
        return float(value)

    def string(self, name: str, default: str = "") -> str:
        value = self.get(name, default)
        if not isinstance(value, str):
            raise invalid(name, f"'{name}' must be a string, got {value!r}")
        return value


def _check_range(name: str, value, low, high) -> None:
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
        # 1e300 passes as an integer: say it in a few digits, not three hundred
        shown = f"{value:.3g}" if abs(value) >= 1e15 else value
        raise invalid(name, f"'{name}' must be in {bounds}, got {shown}")


# --- requests -----------------------------------------------------------------
def _names_bad_text(translate):
    """A lone surrogate fails only where its string meets protobuf, deep in a
    translation: then the body is searched for it, so the 400 names where it
    is and valid requests pay nothing."""
    @functools.wraps(translate)
    def checked(body, *args):
        try:
            return translate(body, *args)
        except UnicodeEncodeError:
            where = _surrogate_at(body)
            raise invalid(where, f"{where or 'the request body'} holds a lone UTF-16 surrogate "
                                 "(an unpaired \\ud800-\\udfff escape): send valid Unicode "
                                 "text") from None
    return checked


def _surrogate_at(body) -> str | None:
    """Where in the JSON `body` the first string with a lone surrogate is (for a
    key, the object holding it: the key itself cannot be shown)."""
    pending = [(None, body)]
    while pending:
        where, value = pending.pop()
        if isinstance(value, str):
            if LONE_SURROGATE.search(value):
                return where
        elif isinstance(value, dict):
            if any(LONE_SURROGATE.search(key) for key in value):
                return where
            pending.extend((key if where is None else f"{where}.{key}", item)
                           for key, item in reversed(value.items()))
        elif isinstance(value, list):
            pending.extend((f"{where}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None


@_names_bad_text
def chat_job(body, models: frozenset[str], served_model: str) -> Job:
    b = _Body(body)
    model = _model(b, models, served_model)
    _reject_unsupported(b)
    tools = _tools(b)
    tool_names = frozenset(t.name for t in tools)
    choice, forced_name = _tool_choice(b, tool_names)
    prefix = ""
    if choice == "required":
        prefix = TOOL_OPEN + '\n{"name": "'
    elif forced_name is not None:
        prefix = TOOL_OPEN + "\n" + '{"name": ' + json.dumps(forced_name) + ', "arguments": '
    top = _chat_logprobs(b)
    request = _generate_request(b, "chatcmpl")
    request.chat.CopyFrom(pb.Chat(messages=_messages(b), tools=tools, assistant_prefix=prefix))
    if top is not None:
        request.logprobs = top
    return Job(True, request.request_id, model, int(time.time()), request, _stream(b),
               _include_usage(b), top, tool_names if choice != "none" else frozenset(), prefix)


@_names_bad_text
def completion_job(body, models: frozenset[str], served_model: str) -> Job:
    b = _Body(body)
    model = _model(b, models, served_model)
    _reject_unsupported(b)
    if b.boolean("echo"):
        raise invalid("echo", "'echo' is not supported: the response holds only the completion")
    if b.string("suffix"):
        raise invalid("suffix", "'suffix' (insertion) is not supported")
    best_of = b.integer("best_of", 1)
    if best_of is not None and best_of != 1:
        raise invalid("best_of", "'best_of' must be 1: tandem returns one completion per request")
    top = b.integer("logprobs", 0, MAX_TOP_LOGPROBS)
    request = _generate_request(b, "cmpl")
    prompt = _completion_prompt(b)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.CopyFrom(pb.TokenIds(ids=prompt))
    if top is not None:
        request.logprobs = top
    return Job(False, request.request_id, model, int(time.time()), request, _stream(b),
               _include_usage(b), top, frozenset(), "")


def _model(b: _Body, models: frozenset[str], served_model: str) -> str:
    model = b.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "'model' is required: a string naming the model (GET /v1/models)")
    return check_model(model, models, served_model)


def check_model(model: str, models: frozenset[str], served_model: str) -> str:
    if model not in models:
        raise ApiError(404, f"the model {model!r} does not exist here; this server serves "
                            f"{served_model!r}", "invalid_request_error", "model", "model_not_found")
    return model


def _reject_unsupported(b: _Body) -> None:
    n = b.integer("n", 1)
    if n is not None and n != 1:
        raise invalid("n", f"'n' must be 1 (got {n}): tandem returns one choice per request; "
                           "send n requests instead")
    if b.get("logit_bias"):
        raise invalid("logit_bias", "'logit_bias' is not supported")
    fmt = b.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise invalid("response_format", "only response_format {\"type\": \"text\"} is supported")


def _stream(b: _Body) -> bool:
    return b.boolean("stream")


def _include_usage(b: _Body) -> bool:
    options = b.get("stream_options", {})
    if not isinstance(options, dict):
        raise invalid("stream_options", "'stream_options' must be an object")
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise invalid("stream_options.include_usage", "'include_usage' must be true or false")
    return value


def _generate_request(b: _Body, id_prefix: str) -> pb.GenerateRequest:
    """The fields chat and completions share: sampling, length, stops."""
    sampling = pb.SamplingParameters()
    for name, value in (("temperature", b.number("temperature", 0.0, 2.0)),
                        ("top_p", _tiny_top_p(b.number("top_p", 0.0, 1.0, low_open=True))),
                        ("presence_penalty", b.number("presence_penalty", -2.0, 2.0)),
                        ("frequency_penalty", b.number("frequency_penalty", -2.0, 2.0)),
                        # vLLM's extra sampling parameters, for clients that send them
                        ("top_k", b.integer("top_k", -1, _INT32_MAX)),
                        ("min_p", b.number("min_p", 0.0, 1.0)),
                        # > 0, as far as the protobuf float can carry it
                        ("repetition_penalty", b.number("repetition_penalty",
                                                        _FLOAT32_MIN_NORMAL, _FLOAT32_MAX))):
        if value is not None:
            setattr(sampling, name, max(0, value) if name == "top_k" else value)
    seed = b.integer("seed", -(1 << 63), (1 << 64) - 1)
    if seed is not None:
        sampling.seed = seed % (1 << 64)
    request = pb.GenerateRequest(request_id=f"{id_prefix}-{uuid.uuid4().hex[:24]}",
                                 sampling=sampling, stop=_stop(b),
                                 ignore_eos=b.boolean("ignore_eos"),
                                 cache_salt=b.string("cache_salt"))
    name = "max_completion_tokens" if b.has("max_completion_tokens") else "max_tokens"
    limit = b.integer(name, 1, (1 << 32) - 1)
    if limit is not None:
        request.max_new_tokens = limit
    return request


def _tiny_top_p(value: float | None) -> float | None:
    """top_p as the protobuf float carries it: below float32's range (1e-60)
    it would arrive as 0, which the router refuses quoting 0.0. Any top_p
    below the likeliest token's probability keeps that token alone, so the
    smallest normal float32 means the same."""
    return None if value is None else max(value, _FLOAT32_MIN_NORMAL)


def _stop(b: _Body) -> list[str]:
    stop = b.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise invalid("stop", "'stop' must be a non-empty string or a list of them")
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid("stop", f"'stop' has {len(stop)} strings; at most {MAX_STOP_STRINGS} are "
                              "allowed")
    total = sum(len(s) for s in stop)
    if total > MAX_STOP_CHARS:
        raise invalid("stop", f"'stop' has {total} characters in all; at most {MAX_STOP_CHARS} "
                              "are allowed")
    return stop


def _completion_prompt(b: _Body) -> str | list[int]:
    prompt = b.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)):
        too_big = next((t for t in prompt if t >= _TOKEN_ID_LIMIT), None)
        if too_big is not None:
            raise invalid("prompt", f"'prompt' holds the token id {too_big}, which is past any "
                                    "vocabulary: token ids are below the model's vocab size")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise invalid("prompt", "a batch of prompts is not supported: send one request per prompt")
    raise invalid("prompt", "'prompt' must be a non-empty string or a list of token ids")


def _chat_logprobs(b: _Body) -> int | None:
    wanted = b.boolean("logprobs")
    top = b.integer("top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return (top or 0) if wanted else None


def _messages(b: _Body) -> list[pb.ChatMessage]:
    messages = b.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "'messages' must be a non-empty list of message objects")
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, m) -> pb.ChatMessage:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise invalid(where, f"{where} must be an object with 'role' and 'content'")
    role = _ROLES.get(m.get("role")) if isinstance(m.get("role"), str) else None
    if role is None:
        raise invalid(f"{where}.role", f"{where}.role must be one of {sorted(_ROLES)}, "
                                        f"got {m.get('role')!r}")
    out = pb.ChatMessage(role=role, content=_content(where, m.get("content")))
    calls = m.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise invalid(f"{where}.tool_calls", f"{where}.tool_calls must be a list, on an "
                                                 "assistant message")
        out.tool_calls.extend(_history_call(f"{where}.tool_calls[{j}]", c)
                              for j, c in enumerate(calls))
    if role == "tool":
        call_id = m.get("tool_call_id", "")
        if not isinstance(call_id, str):
            raise invalid(f"{where}.tool_call_id", f"{where}.tool_call_id must be a string")
        out.tool_call_id = call_id
        if isinstance(m.get("name"), str):
            out.name = m["name"]
    if role != "assistant" and m.get("content") is None:
        raise invalid(f"{where}.content", f"{where}.content is required for role {role!r}")
    return out


def _content(where: str, content) -> str:
    """String content, or OpenAI's list of parts when all are text."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise invalid(f"{where}.content", f"{where}.content has a {kind!r} part; this "
                                                  "model takes text parts only")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"{where}.content", f"{where}.content must be a string or a list of text parts")


def _history_call(where: str, call) -> pb.ToolCall:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise invalid(where, f"{where} must be {{\"id\", \"type\": \"function\", \"function\": "
                             "{\"name\", \"arguments\"}}")
    arguments = function.get("arguments", "")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return pb.ToolCall(id=str(call.get("id", "")), name=function["name"], arguments=arguments)


def _tools(b: _Body) -> list[pb.Tool]:
    tools = b.get("tools", [])
    if not isinstance(tools, list):
        raise invalid("tools", "'tools' must be a list of {\"type\": \"function\", \"function\": ...}")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(function, dict) or tool.get("type", "function") != "function"
                or not isinstance(function.get("name"), str) or not function["name"]):
            raise invalid(where, f"{where} must be {{\"type\": \"function\", \"function\": "
                                 "{\"name\", \"description\", \"parameters\"}}")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise invalid(f"{where}.function.parameters", "parameters must be a JSON Schema object")
        description = function.get("description") or ""
        if not isinstance(description, str):
            raise invalid(f"{where}.function.description", "description must be a string")
        # not ASCII-escaped: a lone surrogate (a key's too) then fails here, where
        # _names_bad_text names it, instead of reaching the router as "\\ud800"
        parameters_json = ("" if parameters is None
                           else json.dumps(parameters, ensure_ascii=False))
        out.append(pb.Tool(name=function["name"], description=description,
                           parameters_json=parameters_json))
    return out


def _tool_choice(b: _Body, tool_names: frozenset[str]) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the forced function's name)."""
    choice = b.get("tool_choice", "auto" if tool_names else "none")
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tool_names:
            raise invalid("tool_choice", f"tool_choice {choice!r} needs 'tools'")
        return choice, None
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
            choice.get("function"), dict):
        name = choice["function"].get("name")
    if not isinstance(name, str):
        raise invalid("tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                                     "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in tool_names:
        raise invalid("tool_choice", f"tool_choice names {name!r}, which is not in 'tools'")
    return "named", name


# --- responses ----------------------------------------------------------------
def usage_json(usage: pb.Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def finish_reason(complete: pb.Complete, has_tool_calls: bool) -> str:
    return "tool_calls" if has_tool_calls else _FINISH.get(complete.finish_reason, "stop")


def chat_logprob_entries(chunk: pb.Chunk) -> list[dict]:
    """OpenAI chat logprobs (`choices[].logprobs.content`) of a chunk's tokens."""
    return [{"token": lp.text, "logprob": lp.logprob, "bytes": list(lp.text.encode()),
             "top_logprobs": [{"token": t.text, "logprob": t.logprob,
                               "bytes": list(t.text.encode())} for t in lp.top]}
            for lp in chunk.logprobs]


class CompletionLogprobs:
    """The legacy completions logprobs object, built token by token."""

    def __init__(self) -> None:
        self.offset = 0

    def of(self, chunk: pb.Chunk) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in chunk.logprobs:
            out["tokens"].append(lp.text)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({t.text: t.logprob for t in lp.top})
            out["text_offset"].append(self.offset)
            self.offset += len(lp.text)
        return out


def merge_completion_logprobs(parts: list[dict]) -> dict | None:
    if not parts:
        return None
    return {key: [x for part in parts for x in part[key]] for key in parts[0]}


def envelope(job: Job, chunk: bool) -> dict:
    kind = ("chat.completion" if job.chat else "text_completion") + (".chunk" if chunk and job.chat
                                                                     else "")
    return {"id": job.id, "object": kind, "created": job.created, "model": job.model,
            "system_fingerprint": None}
