"""Open pages: where a sequence's not-yet-quantized pages live, and when they
are sealed into their real pages.

A format that quantizes whole pages (rk4: K per channel along a page's
tokens) cannot quantize a page before all its tokens are known and final. So a
sequence's newest page, and the next one when speculative drafts cross a page
boundary, are written to bf16 staging pages; the page table handed to a
forward names them by id num_pages + staging id. When every token of such a
page is committed (a later forward starts past it, or a prefill ends past it),
seal() quantizes it into the sequence's real page and the table goes back to
the real id.

Owns the mapping logical page -> staging page of one sequence and the rules
below. It does not own which staging or real pages a sequence holds (the
engine's free list or the KV store hands them out) nor the quantization
(formats.py).

Rules, for a forward that writes positions [start, end) of a sequence:
  * the first `exact_first_pages` pages (attention sinks, the format says how
    many) are always staged and never sealed: they stay bf16 for the
    sequence's life, in staging pages of their own;
  * other pages below start // page_size are committed and full: any still
    staged are sealed before the forward (seal_committed);
  * a prefill (its tokens are committed) writes the other pages that lie
    wholly inside [start, end) straight into their real pages;
  * every other page written goes to a staging page (the page holding a
    partial prompt end, decode tokens, speculative drafts).
Positions >= start are never read by the prefix cache, so a page only reaches
it sealed (seal_committed(committed length) before inserting), or, for a sink
page, as its final bf16 staging page.
The real page a sequence holds for a sink page stays unwritten: one 4-bit page
per sequence, the price of page tables that keep one id per logical page.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

# Staging pages per sequence for open pages: the page being filled, plus the
# next one for speculative drafts that run past its end (drafts are fewer than
# a page). The format's exact first pages come on top (staging_per_sequence).
STAGING_PER_SEQUENCE = 2


def staging_per_sequence(kv_format) -> int:
    """bf16 staging pages one live sequence holds under kv_format (0 for a
    per-token format): its open pages plus its never-sealed first pages."""
    if not getattr(kv_format, "uses_staging", False):
        return 0
    return STAGING_PER_SEQUENCE + kv_format.exact_first_pages


class Sealer(Protocol):
    def seal(self, staging_ids: list[int], page_ids: list[int]) -> None: ...


class OpenPagesError(ValueError):
    """A forward would need more open pages than the sequence holds."""


@dataclass
class OpenPages:
    """One sequence's staging pages and the logical page each one holds (-1: free).

    num_pages: real pages in the pool; staging page s appears in page tables
    as num_pages + s. exact_first_pages: leading pages never sealed (sinks).
    """

    staging: tuple[int, ...]
    num_pages: int
    page_size: int
    exact_first_pages: int = 0
    held: list[int] = field(default_factory=list)

    @classmethod
    def for_format(cls, kv_format, staging: Sequence[int], num_pages: int,
                   page_size: int) -> "OpenPages":
        """A sequence's open pages under kv_format, over its staging ids."""
        return cls(tuple(staging), num_pages, page_size,
                   exact_first_pages=kv_format.exact_first_pages)

    def __post_init__(self) -> None:
        if len(self.staging) <= self.exact_first_pages:
            raise ValueError(f"open pages need more staging pages ({len(self.staging)}) than "
                             f"exact first pages ({self.exact_first_pages})")
        if not self.held:
            self.held = [-1] * len(self.staging)

    def table(self, pages: Sequence[int]) -> tuple[int, ...]:
        """The page table as forwards see it: real ids, staging ids for held pages."""
        table = list(pages)
        for s, logical in zip(self.staging, self.held):
            if logical >= 0:
                table[logical] = self.num_pages + s
        return tuple(table)

    def prepare(self, sealer: Sealer, pages: Sequence[int], start: int, end: int,
                prefill: bool) -> tuple[int, ...]:
        """Seal what [0, start) completed, stage the pages [start, end) needs;
        returns the page table for the forward."""
        self.seal_committed(sealer, pages, start)
        p = self.page_size
        for logical in range(start // p, -(-end // p)):
            whole = prefill and logical * p >= start and (logical + 1) * p <= end \
                and logical >= self.exact_first_pages
            if whole or logical in self.held:
                continue
            self._stage(logical)
        return self.table(pages)

    def seal_committed(self, sealer: Sealer, pages: Sequence[int], committed: int) -> None:
        """Seal every staged page whose tokens all lie below `committed`
        (sink pages excepted: they stay staged)."""
        src, dst = [], []
        for i, logical in enumerate(self.held):
            if self.exact_first_pages <= logical and (logical + 1) * self.page_size <= committed:
                src.append(self.staging[i])
                dst.append(pages[logical])
                self.held[i] = -1
        sealer.seal(src, dst)

    def sealed_pages(self, committed: int) -> int:
        """How many leading pages hold their final content after
        seal_committed(committed): what a prefix cache may take (sink pages
        among them are final in their bf16 staging page, not the real one)."""
        return committed // self.page_size

    def _stage(self, logical: int) -> None:
        free = [i for i, held in enumerate(self.held) if held < 0]
        if not free:
            raise OpenPagesError(
                f"page {logical} needs a staging page but the sequence's {len(self.staging)} "
                f"hold pages {self.held}: a forward may span at most "
                f"{len(self.staging) - self.exact_first_pages} open pages besides the "
                f"{self.exact_first_pages} exact first (drafts must be shorter than a page)")
        self.held[free[0]] = logical


def prepare_pages(seq, sealer, start: int, end: int, prefill: bool) -> tuple[int, ...]:
    """The page table for a forward writing [start, end) of seq: its pages as
    they are, or, with open pages, sealed and staged first (open_pages.py)."""
    if getattr(seq, "open_pages", None) is None:
        return tuple(seq.pages)
    return seq.open_pages.prepare(sealer, seq.pages, start, end, prefill)


def page_table_of(seq) -> tuple[int, ...]:
    """The page table as the last prepare_pages left it (for forwards that
    only write pages a verify step already staged: MTP drafts)."""
    if getattr(seq, "open_pages", None) is None:
        return tuple(seq.pages)
    return seq.open_pages.table(seq.pages)
