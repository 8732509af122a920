"""Where a prefill is cut into forwards, and where the GDN state is captured.

A prefill of positions [start, end) runs in chunks of at most `chunk_size`
tokens (so a long prompt never holds the GPU for long). Snapshot points are
page-aligned positions where the sequence's GDN state is kept in a snapshot
slot for the prefix cache: a chunk ending at one copies its state after the
forward, a chunk with one inside has the forward leave it there. Snapshots are page-aligned
so that a restored prefix is always whole pages plus its state (see
kvstore/radix.py).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    start: int
    end: int
    snapshot: bool  # copy the GDN state after this chunk (its end is a snapshot point)
    # a snapshot point inside (start, end) that the forward itself leaves
    # (SequenceInput.snapshot), or None
    inner_snapshot: int | None = None


def snapshot_points(start: int, end: int, page_size: int, every: int = 0,
                    prompt_end_snapshot: bool = True) -> list[int]:
    """Page-aligned positions in (start, end] after which to snapshot: every
    `every` tokens (0 = never), and the last page boundary before the prompt's
    last token.

    Not `end` itself when the prompt fills whole pages: a request must run at
    least one token to get logits, so a snapshot at `end` could never serve
    the same prompt again (a retry, or n parallel samples of one prompt),
    while one a page earlier does; the next turn of the conversation does not
    need it, decode leaves a snapshot at every page boundary it fills."""
    if every and every % page_size:
        raise ValueError(f"snapshot interval {every} must be a multiple of the page size {page_size}")
    points = set(range(every, end + 1, every)) if every else set()
    if prompt_end_snapshot:
        points.add((end - 1) // page_size * page_size)
    return sorted(p for p in points if start < p <= end)


def prefill_chunks(start: int, end: int, chunk_size: int, snapshots: list[int] = (),
                   fold: bool = True) -> list[Chunk]:
    """Cut [start, end) into chunks of at most `chunk_size` tokens. With `fold`,
    a chunk takes the first snapshot point inside it as its inner_snapshot
    and is cut at a second one: a prompt's last partial page (1..16 tokens
    after the prompt-end snapshot) no longer costs a forward of its own.
    Without, it is cut at every snapshot point too."""
    if not 0 <= start < end:
        raise ValueError(f"empty or negative prefill range [{start}, {end})")
    if chunk_size < 1:
        raise ValueError("chunk_size must be >= 1")
    marks = set(snapshots)
    if not fold:
        cuts = sorted({*range(start + chunk_size, end, chunk_size), *snapshots, end} - {start})
        return [Chunk(lo, hi, hi in marks) for lo, hi in zip([start, *cuts], cuts)]
    chunks, lo = [], start
    while lo < end:
        hi = min(lo + chunk_size, end)
        inside = sorted(p for p in marks if lo < p < hi)
        if len(inside) > 1:
            hi = inside[1]
        chunks.append(Chunk(lo, hi, hi in marks, inside[0] if inside else None))
        lo = hi
    return chunks
