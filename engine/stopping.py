"""Ending a sequence and deciding which generated text the client may see.

Owns the finish reasons, the per-token stop check (stop token ids, EOS,
max_new_tokens) and the streaming stop-string matcher that holds back text
which might still turn out to be the start of a stop string.

Does not own detokenisation: the matcher works on the text deltas a
detokeniser produces.
"""
from __future__ import annotations

import enum
from typing import Iterable

from engine.errors import InvalidRequestError
from engine.sampling import SamplingParams


class FinishReason(enum.Enum):
    """Why a sequence ended; the values are the OpenAI finish_reason strings."""

    STOP = "stop"  # stop token, EOS or stop string
    LENGTH = "length"  # max_new_tokens reached
    ABORT = "abort"  # cancelled by the client or the engine


class StopChecker:
    """Per-token stop decision for one request."""

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int]):
        self.max_new_tokens = params.max_new_tokens
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(eos_token_ids)
        self.stop_token_ids = frozenset(stop_ids)

    def check_token(self, token_id: int, num_generated: int) -> FinishReason | None:
        """Finish reason after generating `token_id`, or None to continue.

        `num_generated` counts the output tokens including this one. A stop
        token on the last allowed step reports STOP: the model chose to end.
        """
        if token_id in self.stop_token_ids:
            return FinishReason.STOP
        if num_generated >= self.max_new_tokens:
            return FinishReason.LENGTH
        return None


class StopStringMatcher:
    """Streaming stop-string matcher over text deltas.

    `feed` returns the text that is safe to show now. It holds back the
    longest suffix that is a proper prefix of some stop string (that text may
    yet become part of a match), and nothing before it can ever be part of a
    match. When a stop string completes, `feed` returns the text before it
    and stopped=True; the stop string itself is never emitted, and later
    feeds return ("", True).

    Which match wins: the first stop string to *complete* while reading left
    to right (that is when the engine stops generating); among stop strings
    completing at the same character, the longest, i.e. the earliest start.
    This equals "truncate at the first occurrence" except when one stop
    string occurs strictly inside another whose match started earlier but
    ends later (stops "abcd" and "bc" on "abcd" give "a", not ""): waiting
    for the longer one would mean generating past a stop string.

    Invariant: the concatenated emits (+ flush() when not stopped) equal the
    full text truncated before the winning match, or the full text.
    """

    def __init__(self, stop_strings: Iterable[str]):
        self.stop_strings = tuple(stop_strings)
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise InvalidRequestError(
                f"stop strings must be non-empty strings; got {self.stop_strings!r}")
        self._longest = max((len(s) for s in self.stop_strings), default=0)
        self._held = ""
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        """Text safe to show after `delta`, and whether a stop string ended."""
        if self.stopped:
            return "", True
        text = self._held + delta
        match_start = self._first_completed_match(text)
        if match_start is not None:
            self._held = ""
            self.stopped = True
            return text[:match_start], True
        split = len(text) - self._partial_match_length(text)
        self._held = text[split:]
        return text[:split], False

    def flush(self) -> str:
        """Held-back text at the end of the stream ("" once stopped)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _first_completed_match(self, text: str) -> int | None:
        """Start of the match that ends first in `text` (ties: longest)."""
        best: tuple[int, int] | None = None  # (end, start)
        for stop in self.stop_strings:
            start = text.find(stop)
            if start >= 0:
                candidate = (start + len(stop), start)
                if best is None or candidate < best:
                    best = candidate
        return None if best is None else best[1]

    def _partial_match_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that a stop string starts with."""
        for length in range(min(len(text), self._longest - 1), 0, -1):
            suffix = text[-length:]
            if any(stop.startswith(suffix) for stop in self.stop_strings):
                return length
        return 0
