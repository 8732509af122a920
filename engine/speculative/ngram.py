"""Prompt lookup: propose the tokens that followed the most recent earlier
occurrence of the sequence's last n tokens (longest n first). Agent loops and
code edits repeat their own context, so this needs no weights at all."""
from __future__ import annotations

from typing import Iterable


class NgramIndex:
    """Per-sequence index from an n-gram to where its latest occurrence ended
    that already has a following token, kept up to date as tokens arrive, so
    a proposal costs O(n_max) whatever the context length."""

    def __init__(self, tokens: Iterable[int], n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self._end: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            i = len(self.tokens)
            # the n-grams ending just before token i now have a follower (token i)
            for n in range(self.n_min, self.n_max + 1):
                if i >= n:
                    self._end[tuple(self.tokens[i - n:i])] = i
            self.tokens.append(int(token))

    def propose(self, k: int) -> list[int]:
        """Up to k tokens, [] when no suffix of length n_min..n_max recurred."""
        size = len(self.tokens)
        for n in range(min(self.n_max, size), self.n_min - 1, -1):
            end = self._end.get(tuple(self.tokens[size - n:]))
            if end is not None:
                return self.tokens[end:end + k]
        return []
