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

import argparse
from dataclasses import dataclass

# --prefill-chunk auto on a GPU: the largest chunk up to this cap that the
# memory budget fits (kvstore/plan.py, CapacityPlan.with_auto_chunk). A decode
# step sharing the GPU waits out a whole chunk, and 2,048 was the knee of
# decode latency against prefill throughput under MPS (BENCHMARKS.md, 12-04
# 10:55); 2,048 prefills the 27B's 4K prompt at 4.0x llama.cpp with 4-bit
# weights, where 512 is host-bound at 1.4x (12-05).
AUTO_PREFILL_CHUNK_CAP = 2048
# --prefill-chunk auto on the CPU: a chunk there costs its tokens whatever its
# size (no per-chunk weight dequantization to spread), and a short one lets
# a cancel or a decode step sharing the cores in sooner.
AUTO_PREFILL_CHUNK_CPU = 512
# how the flag's "auto" travels in options (ServerOptions.prefill_chunk_tokens)
AUTO_PREFILL_CHUNK = 0


def parse_prefill_chunk(text: str) -> int:
    """--prefill-chunk: "auto" (AUTO_PREFILL_CHUNK) or a token count >= 1.
    Raises argparse's type error, whose message argparse prints as it is."""
    text = str(text).strip()
    if text.lower() == "auto":
        return AUTO_PREFILL_CHUNK
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a prefill chunk is auto or a number of tokens >= 1, "
                                         f"got {text!r}")
    return int(text)


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
