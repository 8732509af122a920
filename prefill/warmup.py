"""The prefill worker's warm-up: before it serves, it prefills a made-up
prompt on scratch pages, cut into the chunk kinds a request's prefill is cut
into, so that every Triton kernel a request runs is compiled (or loaded from
Triton's disk cache) before the first request and not during it.
The kinds (engine/kv/attention.py, engine/gdn_kernels.py): chunks of more
than 16 new tokens (the dense prefill path), chunks of 9..16 (the batched
GDN path, fp32 attention dots), of 2..8 (the fused GDN step kernels at
MAX_T = 8) and of 1 (MAX_T = 1, decode's attention tiles). The router puts a
snapshot at the last page boundary before a prompt's end; a chunk with one
inside runs its GDN layers in two parts around it (engine/batch.py
SnapshotSplit), the part after it 1..16 rows: fused steps or fla. The
warm-up runs jobs the same way (warm_up_jobs), each resuming the previous
one's snapshot. The first job's context reaches 64 key tiles, past which
short batches always split their keys 64 ways, so the split count long
contexts use is compiled too; a short chunk over it splits its keys as an
agent turn does (attention.prefill_key_splits). A last job runs one whole
chunk with its keys dequantized inside the attention kernel
(attention.paged_prefill_attention), the path chunks take once their keys
outgrow the dense workspace (past 64K on the 27B). The decode worker reads
the same kernels from Triton's disk cache.
On the GPU only (off it nothing compiles). Every page and slot goes back to
the store, whatever happens."""
from __future__ import annotations

import time

import torch

from engine.kv.attention import (PREFILL_DOT_BF16_FROM, PREFILL_KEY_SPLITS,
                                 PREFILL_MIN_TILES_PER_SPLIT, paged_prefill_attention,
                                 tiles_for)
from engine.kv.attention_kernels import MAX_SPLITS
from kvstore.client import StoreClient
from prefill.runner import PrefillJob, run_prefill

WARM_UP_ID = "prefill-warm-up"


def warm_up_length(store: StoreClient) -> int:
    """Tokens of the first job's whole pages: 64 key tiles (and enough keys
    for a prefill chunk to split them), or what half the pool holds on a
    small store (0: too small to bother)."""
    info = store.info
    cfg = info.config
    if not cfg.attention_layers:
        wanted = info.page_size * 4
    else:
        group = cfg.num_heads // cfg.num_kv_heads
        decode_tiles = tiles_for(cfg.head_dim, group, decode=True, on_gpu=True)
        # a prefill chunk's tiles on the dense path (bf16 queries and pages)
        prefill_tiles = tiles_for(cfg.head_dim, group, decode=False, on_gpu=True,
                                  q_dtype=torch.bfloat16, new_tokens=2 * info.page_size)
        wanted = max(MAX_SPLITS * decode_tiles.block_n,
                     PREFILL_KEY_SPLITS * PREFILL_MIN_TILES_PER_SPLIT * prefill_tiles.block_n)
    room = (info.num_pages // 2 - 4) * info.page_size
    length = min(wanted, room) // info.page_size * info.page_size
    return length if length >= 2 * info.page_size else 0


def warm_up_jobs(length: int, page: int) -> tuple[tuple[int, int], ...]:
    """(start, stop) of each warm-up job over `length` tokens of whole pages,
    each resuming at the snapshot the one before left (a page boundary):
    1. chunks up to `length`, then a one-token chunk of its own;
    2. 21 tokens, the snapshot after 16: GDN parts of 16 (fla) and 5 (fused, MAX_T 8);
    3. 33 tokens over the long context (split keys), the snapshot after 32:
       parts of 32 and 1 (fused, MAX_T 1);
    4. 12 tokens with no snapshot inside: a chunk of 9..16;
    5. 5 tokens, again from 4's start: a chunk of 2..8."""
    short = length + 3 * page
    return ((0, length + 1), (length, length + page + 5), (length + page, short + 1),
            (short, short + 12), (short, short + 5))


def paged_chunk_job(length: int, page: int, chunk: int,
                    pool_tokens: int) -> tuple[int, int] | None:
    """(start, stop) of the job that runs one whole `chunk` over the first
    job's context with the keys dequantized in-kernel: from job 3's snapshot,
    as jobs 4 and 5 (its keys then split as a long context's do). Cut to
    what a small pool holds beside the first job, less four pages for the
    decode worker's warm-up, which may run meanwhile; None when
    that is no chunk at all (a chunk of up to PREFILL_DOT_BF16_FROM tokens
    never takes the dense workspace)."""
    short = length + 3 * page
    new_tokens = min(chunk, pool_tokens - short - 4 * page)
    return (short, short + new_tokens) if new_tokens > PREFILL_DOT_BF16_FROM else None


def warm_up(store: StoreClient, chunk: int) -> float:
    """Runs the warm-up's jobs on pages and slots it takes from the store
    and gives back; returns its seconds (0.0 when the store is too small)."""
    length = warm_up_length(store)
    if not length:
        return 0.0
    info, cache = store.info, store.cache
    page = info.page_size
    jobs = warm_up_jobs(length, page)
    paged_job = paged_chunk_job(length, page, chunk, info.num_pages * page)
    end = max(max(stop for _, stop in jobs), paged_job[1] if paged_job else 0)
    hybrid = info.config.is_hybrid
    started = time.perf_counter()
    with store.scratch_sequence(end, 2 if hybrid else 0) as scratch:
        pages, open_ids = scratch.pages, scratch.open_pages
        state, snapshot = scratch.slots[:2] if hybrid else (-1, -1)
        tokens = tuple((7 * i + 3) % info.config.vocab_size for i in range(end))

        def run(start: int, stop: int) -> None:
            cut = (stop - 1) // page * page  # where the router snapshots a prompt
            job = PrefillJob(WARM_UP_ID, tokens[:stop], start, pages, state,
                             restore_slot=snapshot if hybrid and start else -1,
                             snapshots=((cut, snapshot),) if hybrid and cut > start else (),
                             open_pages=open_ids)
            run_prefill(store.model, cache, job, chunk,
                        open_pages=cache.open_pages_for(open_ids, pages))

        for start, stop in jobs:
            run(start, stop)
        if paged_job:
            with paged_prefill_attention():
                run(*paged_job)
    return time.perf_counter() - started
