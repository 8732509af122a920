"""The prefill worker's warm-up: before it serves, it prefills a made-up
prompt on scratch pages, cut into the chunk kinds a request's prefill is cut
into, so that every Triton kernel a request runs is compiled (or loaded from
Triton's disk cache) before the first request and not during it.

The kinds (engine/kv/attention.py, engine/gdn_kernels.py): chunks of more
than 16 new tokens (the dense prefill path), chunks of 9..16 (the batched
GDN path, fp32 attention dots), tails of 2..8 (the fused GDN step kernels at
MAX_T = 8) and of 1 (MAX_T = 1, decode's attention tiles). The router cuts a
prompt at the last page boundary before its end, so a request's prefill
ends with a tail of 1..page_size tokens after a cached prefix: the warm-up
runs two jobs the same way, the second resuming the first from its snapshot
slot. Its context reaches 64 key tiles, past which short batches always
split their keys 64 ways, so the split count long contexts use is compiled
too; a third job resumes the second with a chunk of two pages, which
splits its keys as a short prefill over a long context does (an agent turn:
attention.prefill_key_splits). The decode worker reads the same kernels
from Triton's disk cache.

On the GPU only (off it nothing compiles). Every page and slot goes back to
the store, whatever happens."""
from __future__ import annotations

import time

import torch

from engine.kv.attention import PREFILL_KEY_SPLITS, PREFILL_MIN_TILES_PER_SPLIT, tiles_for
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


def warm_up(store: StoreClient, chunk: int) -> float:
    """Runs the warm-up's two jobs on pages and slots it takes from the store
    and gives back; returns its seconds (0.0 when the store is too small)."""
    length = warm_up_length(store)
    if not length:
        return 0.0
    info, cache = store.info, store.cache
    page = info.page_size
    # job 1: [0, length + 1): chunks, then a one-token tail after the snapshot
    # at `length`; job 2 resumes there: a page of 16 or fewer tokens, then a
    # tail of 5 after the snapshot a page later; job 3 resumes from that one:
    # a two-page chunk (more than 16 tokens, few programs: split keys), then
    # a one-token tail
    jobs = ((0, length + 1), (length, length + page + 5), (length + page, length + 3 * page + 1))
    end = jobs[-1][1]
    total_pages = -(-end // page)
    hybrid = info.config.is_hybrid
    sinks = min(info.sink_pages_per_sequence, total_pages)
    started = time.perf_counter()
    grant = store.allocate(total_pages - sinks, 2 if hybrid else 0,
                           sinks + info.open_pages_per_sequence)
    try:
        pages = (*grant.staging[:sinks], *grant.pages)
        open_ids = tuple(grant.staging[sinks:])
        state, snapshot = (grant.slots[0], grant.slots[1]) if hybrid else (-1, -1)
        tokens = tuple((7 * i + 3) % info.config.vocab_size for i in range(end))
        for start, stop in jobs:
            cut = (stop - 1) // page * page
            job = PrefillJob(WARM_UP_ID, tokens[:stop], start, pages, state,
                             restore_slot=snapshot if hybrid and start else -1,
                             snapshots=((cut, snapshot),) if hybrid else (),
                             open_pages=open_ids)
            run_prefill(store.model, cache, job, chunk,
                        open_pages=cache.open_pages_for(open_ids, pages))
    finally:
        store.release([*grant.pages, *grant.staging], grant.slots)
    return time.perf_counter() - started
