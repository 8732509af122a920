"""Tool calls in the model's own text format -> OpenAI `tool_calls`.

The format is Qwen's (also what tandem's fallback tools prompt asks for):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, possibly after some text. A block whose JSON does not
parse (or nests too deeply to read, or holds a lone surrogate escape, which
no response can carry), lacks a name (or has one that is no string), or names
a function the request did not offer makes the whole output plain text
content (never an error): the client sees what the model wrote. A last
block cut off before `</tool_call>` (EOS right after the JSON) still counts
when its JSON is complete.
"""
from __future__ import annotations

import json
import re
import uuid

from tandem.text_limits import LONE_SURROGATE

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.S)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str, tool_names: frozenset[str]) -> tuple[str, list[dict]] | None:
    """(the text outside the blocks, the calls) or None when TEXT holds no
    well-formed tool call. Each call: {"name", "arguments" (JSON text)}."""
    if OPEN not in text:
        return None
    calls = []
    for block in _BLOCK.finditer(text):
        call = _one_call(block.group(1), tool_names)
        if call is None:
            return None
        calls.append(call)
    return _BLOCK.sub("", text).strip(), calls


def _one_call(body: str, tool_names: frozenset[str]) -> dict | None:
    try:
        value = json.loads(body.strip())
    except (ValueError, RecursionError):  # not JSON, a 4,300-digit integer, nested too deep
        return None
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or name not in tool_names:  # a list is not even hashable
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the JSON as a string
        return _carried({"name": name, "arguments": arguments})
    if not isinstance(arguments, dict):
        return None
    try:
        text = json.dumps(arguments, ensure_ascii=False)
    except (ValueError, RecursionError):
        return None
    return _carried({"name": name, "arguments": text})


def _carried(call: dict) -> dict | None:
    """The call, unless its arguments hold a lone surrogate (decoded from a
    "\\ud800" escape): no UTF-8 response can carry that, so it is malformed."""
    return None if LONE_SURROGATE.search(call["arguments"]) else call


class ToolCallStream:
    """Streams content while holding back anything that may be a tool call.

    push(text) returns the content to show now: text before a `<tool_call>`,
    minus a tail that could still become one. From the first `<tool_call>` on,
    everything is held; finish() then returns (the held text to show as
    content, the parsed calls or None). `prefix` is text the model was made to
    start with (a forced tool call's opening): it is held, never shown, unless
    the call turns out malformed."""

    def __init__(self, tool_names: frozenset[str], prefix: str = "") -> None:
        self.tool_names = tool_names
        self.held = ""
        self.in_call = False
        if prefix:
            self.push(prefix)

    def push(self, text: str) -> str:
        if self.in_call:
            self.held += text
            return ""
        buffer = self.held + text
        start = buffer.find(OPEN)
        if start >= 0:
            self.in_call = True
            self.held = buffer[start:]
            return buffer[:start]
        keep = _partial_open_length(buffer)
        self.held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep]

    def finish(self) -> tuple[str, list[dict] | None]:
        held, self.held = self.held, ""
        if not self.in_call:
            return held, None
        parsed = parse_tool_calls(held, self.tool_names)
        if parsed is None:
            return held, None
        return parsed


def _partial_open_length(text: str) -> int:
    """Length of the longest tail of TEXT that begins `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
