"""Turning a public GenerateRequest into a validated, fully resolved request.

Protobuf stops here: everything after works on `GenerationRequest`. Every
defect becomes an InvalidRequestError whose message says what to fix; the
server maps it to INVALID_ARGUMENT."""
from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.sampling import SamplingParams
from engine.vocabulary import first_outside_vocabulary
from tandem.text_limits import LONE_SURROGATE, MAX_STOP_CHARS, MAX_STOP_STRINGS
from tandem.wire import pack_token_ids, unpack_token_ids

DEFAULT_MAX_NEW_TOKENS = 256
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams  # seed always set, so prefill and decode draw alike
    cache_salt: str
    # the prompt as the internal RPCs carry it (tandem.wire.pack_token_ids),
    # packed once for every Match, Prefill, Insert and Decode of the request
    packed_prompt: bytes


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


def prompt_from_pb(pb, tokenizer) -> list[int]:
    """Token ids of a request's `input` oneof (text, token_ids or chat)."""
    kind = pb.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError("the request has no input: set one of text, token_ids or chat")
    if kind == "text":
        if not pb.text:
            raise InvalidRequestError("input.text is empty")
        return tokenizer.encode(pb.text)
    if kind == "token_ids":
        return list(pb.token_ids.ids)
    return chat_prompt(pb.chat, tokenizer)


def chat_prompt(chat_pb, tokenizer) -> list[int]:
    if not chat_pb.messages:
        raise InvalidRequestError("input.chat has no messages")
    messages = [_message(i, m) for i, m in enumerate(chat_pb.messages)]
    tools = [_tool(i, t) for i, t in enumerate(chat_pb.tools)] or None
    add_prompt = chat_pb.add_generation_prompt if chat_pb.HasField("add_generation_prompt") else True
    if chat_pb.assistant_prefix and not add_prompt:
        raise InvalidRequestError("input.chat.assistant_prefix needs add_generation_prompt")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_prompt, tools=tools)
    except InvalidRequestError:
        raise
    except Exception as e:  # a template's raise_exception: the conversation is malformed
        raise InvalidRequestError(f"the chat template rejected the conversation: {e}") from e
    return _encode_rendered(tokenizer, text + chat_pb.assistant_prefix)


def _encode_rendered(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered conversation. The tools' JSON is checked for
    lone surrogates before rendering; this catches any a template still makes,
    which the tokenizer refuses with a bare TypeError (a 500 for the client)."""
    if LONE_SURROGATE.search(text):
        raise InvalidRequestError("the rendered conversation holds a lone UTF-16 surrogate "
                                  "(an unpaired \\ud800-\\udfff): send valid Unicode text")
    return tokenizer.encode(text, add_special_tokens=False)


def _message(i: int, m) -> dict:
    """A chat message as HF templates expect it (OpenAI's shape, with tool-call
    arguments as a mapping when they are a JSON object, as Qwen's template wants)."""
    if m.role not in ("system", "user", "assistant", "tool"):
        raise InvalidRequestError(f"chat message {i} has role {m.role!r}; use system, user, "
                                  "assistant or tool")
    message: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        if m.role != "assistant":
            raise InvalidRequestError(f"chat message {i} has tool_calls but role {m.role!r}; "
                                      "only assistant messages make tool calls")
        message["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name,
                          "arguments": _arguments(f"chat message {i} tool call {j} ({c.name})",
                                                  c.arguments)}}
            for j, c in enumerate(m.tool_calls)]
    if m.role == "tool":
        message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
    return message


def _arguments(where: str, text: str):
    try:
        value = _json_value(f"{where}: arguments", text) if text else {}
    except _NotJson:
        return text  # rendered as the model wrote it
    return value if isinstance(value, dict) else text


def _tool(i: int, t) -> dict:
    if not t.name:
        raise InvalidRequestError(f"tool {i} has no name")
    function: dict = {"name": t.name}
    if t.description:
        function["description"] = t.description
    if t.parameters_json:
        where = f"tool {i} ({t.name}): parameters_json"
        try:
            function["parameters"] = _json_value(where, t.parameters_json)
        except _NotJson as e:
            raise InvalidRequestError(f"{where} is not JSON: {e}") from None
    return {"type": "function", "function": function}


class _NotJson(ValueError):
    """Text that does not parse as JSON (the caller decides if that is an error)."""


def _json_value(where: str, text: str):
    """The JSON value of `text`, which the chat template renders. JSON the
    router cannot render is an InvalidRequestError naming `where`: nesting
    past the decoder's stack, and lone surrogate escapes (valid JSON, but no
    text a tokenizer can encode)."""
    try:
        value = json.loads(text)
    except ValueError as e:  # JSONDecodeError, or an integer of more than 4,300 digits
        raise _NotJson(str(e)) from None
    except RecursionError:
        raise InvalidRequestError(f"{where} nests arrays or objects too deeply to read: "
                                  "flatten it") from None
    if _holds_lone_surrogate(value):
        raise InvalidRequestError(f"{where} holds a lone UTF-16 surrogate (an unpaired "
                                  "\\ud800-\\udfff escape): send valid Unicode text")
    return value


def _holds_lone_surrogate(value) -> bool:
    """Whether a parsed JSON value has a lone surrogate in any string or key
    (iterative: the value may nest as deep as the decoder allowed)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            if LONE_SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return False


def sampling_from_pb(pb, prompt_len: int, max_context: int) -> SamplingParams:
    """Resolved sampling parameters: unset fields take SamplingParams' defaults;
    max_new_tokens is capped by what the context leaves."""
    s = pb.sampling
    given = {name: getattr(s, name) for name in _SAMPLING_FIELDS if s.HasField(name)}
    room = max_context - prompt_len
    wanted = pb.max_new_tokens if pb.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS
    if pb.HasField("max_new_tokens") and wanted < 1:
        raise InvalidRequestError("max_new_tokens must be >= 1")
    return SamplingParams(
        **given,
        seed=s.seed if s.HasField("seed") else int.from_bytes(os.urandom(7), "little"),
        max_new_tokens=max(1, min(wanted, room)),
        stop=_stop_strings(pb.stop),
        stop_token_ids=tuple(pb.stop_token_ids),
        ignore_eos=pb.ignore_eos,
        logprobs=pb.logprobs if pb.HasField("logprobs") else None,
    )


def _stop_strings(stop) -> tuple[str, ...]:
    """The request's stop strings, within the limits that bound their matching."""
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} "
                                  "are allowed")
    total = sum(len(s) for s in stop)
    if total > MAX_STOP_CHARS:
        raise InvalidRequestError(f"stop strings have {total} characters in all; at most "
                                  f"{MAX_STOP_CHARS} are allowed")
    return tuple(stop)


def request_from_pb(pb, tokenizer, max_context: int, vocab_size: int) -> GenerationRequest:
    prompt = prompt_from_pb(pb, tokenizer)
    if not prompt:
        raise InvalidRequestError("the prompt tokenizes to nothing")
    try:
        packed = pack_token_ids(prompt)
    except ValueError as e:  # not even a uint32
        raise InvalidRequestError(f"{e}; the vocabulary is [0, {vocab_size})") from None
    bad = first_outside_vocabulary(unpack_token_ids(packed), vocab_size)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(prompt) >= max_context:
        raise InvalidRequestError(
            f"the prompt has {len(prompt)} tokens but this server's context holds {max_context} "
            "(prompt plus at least one generated token): shorten the prompt")
    if len(pb.request_id) > 128:
        raise InvalidRequestError("request_id is longer than 128 characters")
    return GenerationRequest(
        request_id=pb.request_id or new_request_id(),
        prompt=tuple(prompt),
        params=sampling_from_pb(pb, len(prompt), max_context),
        cache_salt=pb.cache_salt,
        packed_prompt=packed,
    )
