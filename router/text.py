"""Text of a streaming request: token ids to UTF-8-safe text deltas with stop
strings applied. Lives in the router, the only process that knows text."""
from __future__ import annotations

from engine.stopping import StopStringMatcher
from engine.tokenizer import IncrementalDetokenizer


class TextStream:
    def __init__(self, tokenizer, stop_strings, stop_token_ids=()) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.matcher = StopStringMatcher(stop_strings)
        self.hidden = frozenset(stop_token_ids)
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Text that became visible with this token ('' while held back). A stop
        token's own text is not shown."""
        if self.stopped or token_id in self.hidden:
            return ""
        text, self.stopped = self.matcher.feed(self.detokenizer.push(token_id))
        return text

    def finish(self) -> str:
        """Whatever was held back, at the end of the stream."""
        if self.stopped:
            return ""
        text, self.stopped = self.matcher.feed(self.detokenizer.flush())
        return text if self.stopped else text + self.matcher.flush()
