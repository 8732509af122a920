"""Open pages: where a sequence's not-yet-quantized pages live, and when they
are sealed into their real pages.

A format that quantizes whole pages (rk4p: K per channel along a page's
tokens) cannot quantize a page before all its tokens are known and final. So a
sequence's newest pages, and the next one when speculative drafts cross a page
boundary, are written to bf16 staging pages; the page table handed to a
forward names them by id num_pages + staging id. When every token of such a
page is committed and it is no longer among the newest, seal() quantizes it
into the sequence's real page and the table goes back to the real id.

Owns the mapping logical page -> staging page of one sequence and the rules
below. It does not own which staging or real pages a sequence holds (the
engine's free list or the KV store hands them out) nor the quantization
(formats.py).

Rules, for a forward that writes positions [start, end) of a sequence, whose
first query whose logits matter sits at q = start (decode, verify, a decode-
like bench) or q = end - 1 (a prefill: only its last position samples):
  * the first `exact_first_pages` pages (attention sinks, the format says how
    many) are always staged and never sealed: they stay bf16 for the
    sequence's life, in staging pages of their own;
  * the `exact_recent_pages` newest pages as seen from q (the page holding q
    and those just before it) stay staged, so q reads them in bf16;
  * other pages below start // page_size are committed and full: any still
    staged are sealed before the forward (seal_committed);
  * a prefill (its tokens are committed) writes the other pages that lie
    wholly inside [start, end) straight into their real pages;
  * every other page written goes to a staging page (the newest pages, the
    page holding a partial prompt end, decode tokens, speculative drafts).
So a sequence holds exact_first_pages + exact_recent_pages + 1 staging pages
at most (the one more: a page that a prefill chunk starts inside of, or
drafts that cross a page end; drafts are shorter than a page).
Positions >= start are never read by the prefix cache, so a page only reaches
it sealed, or, for a sink page, as its final bf16 staging page. flush()
quantizes the staged pages whose tokens are all committed into their real
pages without unstaging them (the sequence keeps reading them in bf16), so a
prefix cache can take every whole committed page at once; a later seal of a
flushed page only unstages it (its real page may be the cache's by then).

Sink pages, two ways. The owner of the page table may put them there as
staging ids (>= num_pages) itself: the KV store does, so that its prefix
cache shares them between sequences; OpenPages then leaves them alone (a
table entry that already names a staging page is never staged or sealed
here), and its own staging pages serve the open pages only. Otherwise
(offline engine, benches) OpenPages stages them in its own staging pages and
the real page the sequence holds for a sink page stays unwritten.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

# Staging beyond the exact pages: a page a prefill chunk starts inside of, or
# the next page for speculative drafts that run past the newest's end.
SPILL_PAGES = 1


def staging_per_sequence(kv_format) -> int:
    """bf16 staging pages one live sequence holds under kv_format (0 for a
    per-token format): its never-sealed first pages, its newest pages, and one
    to spill into."""
    if not getattr(kv_format, "uses_staging", False):
        return 0
    return sink_pages(kv_format) + open_staging_per_sequence(kv_format)


def sink_pages(kv_format) -> int:
    """Leading pages a sequence keeps in bf16 staging for its whole life."""
    return kv_format.exact_first_pages if getattr(kv_format, "uses_staging", False) else 0


def open_staging_per_sequence(kv_format) -> int:
    """Staging pages for a sequence's open pages when its sink pages are in its
    page table already (the KV store's way): its newest pages and one to spill into."""
    if not getattr(kv_format, "uses_staging", False):
        return 0
    return kv_format.exact_recent_pages + SPILL_PAGES


class Sealer(Protocol):
    def seal(self, staging_ids: list[int], page_ids: list[int]) -> None: ...


class OpenPagesError(ValueError):
    """A forward would need more open pages than the sequence holds."""


@dataclass
class OpenPages:
    """One sequence's staging pages and the logical page each one holds (-1: free).

    num_pages: real pages in the pool; staging page s appears in page tables
    as num_pages + s. exact_first_pages: leading pages never sealed (sinks);
    exact_recent_pages: newest pages kept staged (1: only the page being filled).
    """

    staging: tuple[int, ...]
    num_pages: int
    page_size: int
    exact_first_pages: int = 0
    exact_recent_pages: int = 1
    held: list[int] = field(default_factory=list)
    # logical pages whose real page already holds their sealed content (flush)
    flushed: set[int] = field(default_factory=set)

    @classmethod
    def for_format(cls, kv_format, staging: Sequence[int], num_pages: int,
                   page_size: int) -> "OpenPages":
        """A sequence's open pages under kv_format, over its staging ids."""
        return cls(tuple(staging), num_pages, page_size,
                   exact_first_pages=kv_format.exact_first_pages,
                   exact_recent_pages=kv_format.exact_recent_pages)

    @classmethod
    def resumed(cls, kv_format, staging: Sequence[int], num_pages: int, page_size: int,
                held: Sequence[int], committed: int) -> "OpenPages":
        """The open pages another process left after flush(committed): the
        prefill worker hands a sequence to the decode worker this way."""
        if len(held) != len(staging):
            raise ValueError(f"{len(staging)} staging pages but {len(held)} held entries")
        open_pages = cls.for_format(kv_format, staging, num_pages, page_size)
        open_pages.held = [int(h) for h in held]
        open_pages.flushed = {h for h in open_pages.held
                              if h >= 0 and (h + 1) * page_size <= committed}
        return open_pages

    def __post_init__(self) -> None:
        if self.exact_recent_pages < 1 or self.exact_first_pages < 0:
            raise ValueError("open pages keep at least the page being filled "
                             "(exact_recent_pages >= 1) and exact_first_pages >= 0")
        exact = self.exact_first_pages + self.exact_recent_pages
        if len(self.staging) < exact:
            raise ValueError(f"open pages need at least {exact} staging pages (exact first + "
                             f"exact recent), got {len(self.staging)}")
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
        """Seal what [0, start) completed and the forward's first scored query
        no longer reads exact, stage the pages [start, end) needs; returns the
        page table for the forward."""
        query = end - 1 if prefill else start
        self.seal_committed(sealer, pages, start, query)
        p = self.page_size
        for logical in range(start // p, -(-end // p)):
            whole = prefill and logical * p >= start and (logical + 1) * p <= end \
                and not self._kept_exact(logical, query)
            if whole or logical in self.held or self._in_table_staging(pages, logical):
                continue
            self._stage(logical)
        return self.table(pages)

    def seal_committed(self, sealer: Sealer, pages: Sequence[int], committed: int,
                       query: int | None = None) -> None:
        """Seal every staged page whose tokens all lie below `committed`, but
        the sink pages and the newest pages as seen from position `query`
        (default: committed, the next token's)."""
        query = committed if query is None else query
        src, dst = [], []
        for i, logical in enumerate(self.held):
            if 0 <= logical and (logical + 1) * self.page_size <= committed \
                    and not self._kept_exact(logical, query):
                if logical not in self.flushed:
                    src.append(self.staging[i])
                    dst.append(pages[logical])
                self.flushed.discard(logical)
                self.held[i] = -1
        sealer.seal(src, dst)

    def flush(self, sealer: Sealer, pages: Sequence[int], committed: int) -> None:
        """Quantize every staged page whose tokens all lie below `committed`
        (sinks excepted) into its real page, keeping it staged: afterwards the
        real pages of the first committed // page_size pages are final, which
        is what a prefix cache may take."""
        src, dst = [], []
        for i, logical in enumerate(self.held):
            if 0 <= logical and (logical + 1) * self.page_size <= committed \
                    and logical >= self.exact_first_pages and logical not in self.flushed:
                src.append(self.staging[i])
                dst.append(pages[logical])
                self.flushed.add(logical)
        sealer.seal(src, dst)

    def _in_table_staging(self, pages: Sequence[int], logical: int) -> bool:
        """The page table names a staging page here already (a sink page the
        table's owner placed, and may share with other sequences)."""
        return logical < len(pages) and pages[logical] >= self.num_pages

    def _kept_exact(self, logical: int, query: int) -> bool:
        """A sink page, or among the exact_recent_pages newest as seen from query."""
        return logical < self.exact_first_pages \
            or logical > query // self.page_size - self.exact_recent_pages

    def sealed_pages(self, committed: int) -> int:
        """How many leading pages hold their final content after
        seal_committed(committed) (flush(committed): all committed // page_size):
        what a prefix cache may take (sink pages among them are final in their
        bf16 staging page, not the real one)."""
        return max(0, committed // self.page_size - self.exact_recent_pages + 1)

    def _stage(self, logical: int) -> None:
        free = [i for i, held in enumerate(self.held) if held < 0]
        if not free:
            raise OpenPagesError(
                f"page {logical} needs a staging page but the sequence's {len(self.staging)} "
                f"hold pages {self.held} ({self.exact_first_pages} exact first, "
                f"{self.exact_recent_pages} exact recent): a forward may add at most "
                f"{len(self.staging) - self.exact_first_pages - self.exact_recent_pages} open "
                "page beyond them (drafts must be shorter than a page)")
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
