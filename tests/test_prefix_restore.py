"""A hybrid model's prefix restored from the cache (pages + GDN snapshot) and
continued with only the new suffix gives the same logits as running the whole
prompt: the radix tree, the page-aligned snapshots and the paged forward fit."""
import pytest
import torch

from engine.batch import ForwardBatch, SequenceInput
from engine.cache import CacheShape, PagedKVCache
from engine.chunking import Chunk, prefill_chunks, snapshot_points
from engine.kv import make_format
from engine.loader import load_model
from kvstore.allocator import PageAllocator, SlotAllocator
from kvstore.radix import RadixCache

PAGE = 4


def test_chunks_cut_at_size_and_snapshots():
    points = snapshot_points(0, 23, PAGE, every=8)
    assert points == [8, 16, 20]
    chunks = prefill_chunks(0, 23, 6, points, fold=False)
    assert [(c.start, c.end, c.snapshot) for c in chunks] == [
        (0, 6, False), (6, 8, True), (8, 12, False), (12, 16, True), (16, 18, False),
        (18, 20, True), (20, 23, False)]
    # folded: each chunk leaves the one snapshot inside it, a second one cuts it
    chunks = prefill_chunks(0, 23, 6, points)
    assert [(c.start, c.end, c.snapshot, c.inner_snapshot) for c in chunks] == [
        (0, 6, False, None), (6, 12, False, 8), (12, 18, False, 16), (18, 23, False, 20)]
    chunks = prefill_chunks(0, 23, 16, points)
    assert [(c.start, c.end, c.snapshot, c.inner_snapshot) for c in chunks] == [
        (0, 16, True, 8), (16, 23, False, 20)]
    # the agent turn: the prompt-end snapshot 16 tokens before the end folds in
    assert prefill_chunks(80048, 81152, 4096, [81136]) == [Chunk(80048, 81152, False, 81136)]
    assert snapshot_points(9, 13, PAGE) == [12]
    assert snapshot_points(9, 11, PAGE) == []
    # a prompt of whole pages snapshots a page before its end, so that the
    # same prompt again restores 12 tokens and runs its last 4
    assert snapshot_points(0, 16, PAGE) == [12]
    assert snapshot_points(9, 12, PAGE) == []
    with pytest.raises(ValueError, match="multiple of the page size"):
        snapshot_points(0, 20, PAGE, every=6)


class _Store:
    """The pieces of the kvstore process, in one process."""

    def __init__(self, loaded):
        self.cache = PagedKVCache(loaded.config, CacheShape(64, PAGE, 16), "cpu",
                                  make_format("rk4"))
        self.pages, self.slots = PageAllocator(64), SlotAllocator(16)
        self.tree = RadixCache(PAGE, self.pages, self.slots, hybrid=True)


def _prefill(loaded, store, tokens, start, pages, slot, every=8, fold=True):
    """Run tokens[start:] and snapshot at page-aligned points into the tree,
    after a chunk or (fold) inside one."""
    logits = None
    points = snapshot_points(start, len(tokens), PAGE, every=every)
    for chunk in prefill_chunks(start, len(tokens), 5, points, fold=fold):
        snaps = {p: store.slots.allocate(1)[0]
                 for p in (chunk.inner_snapshot, chunk.end if chunk.snapshot else None)
                 if p is not None}
        inner = chunk.inner_snapshot
        seq = SequenceInput(tuple(tokens[chunk.start:chunk.end]), chunk.start, tuple(pages), slot,
                            snapshot=None if inner is None else (inner, snaps[inner]))
        logits = loaded.model(ForwardBatch.build([seq], PAGE, "cpu"), store.cache)
        if chunk.snapshot:
            store.cache.copy_state(slot, snaps[chunk.end])
        for point, snap in sorted(snaps.items()):
            inserted = store.tree.insert("ns", tokens[:point], pages[:point // PAGE], snap)
            store.pages.free(inserted.duplicate_pages)
            if inserted.unused_snapshot is not None:
                store.slots.free([inserted.unused_snapshot])
    return logits


@pytest.mark.parametrize("fold", [True, False])
def test_restored_prefix_continues_exactly(fold):
    """fold: snapshots left inside forwards (SequenceInput.snapshot), against
    forwards cut at every snapshot point."""
    loaded = load_model("tiny-qwen3.5", seed=4)
    store = _Store(loaded)
    first = [(5 * i + 1) % 512 for i in range(27)]
    slot = store.slots.allocate(1)[0]
    pages = store.pages.allocate(7)
    _prefill(loaded, store, first, 0, pages, slot, fold=fold)
    store.pages.free(pages[27 // PAGE:])  # the partial tail page is the caller's
    store.slots.free([slot])

    second = first + [(3 * i + 7) % 512 for i in range(9)]  # the next agent turn
    match = store.tree.match("ns", second)
    assert match.num_tokens == 24 and match.snapshot_slot is not None
    store.tree.lock(match.node)
    slot = store.slots.allocate(1)[0]
    store.cache.copy_state(match.snapshot_slot, slot)
    pages = list(match.pages) + store.pages.allocate(-(-len(second) // PAGE) - len(match.pages))
    restored = _prefill(loaded, store, second, match.num_tokens, pages, slot, fold=fold)

    fresh = _Store(loaded).cache
    seq = SequenceInput(tuple(second), 0, tuple(range(10)), 0)
    full = loaded.model(ForwardBatch.build([seq], PAGE, "cpu"), fresh)
    # rk4 pages on both sides; only the chunking and the restore differ
    torch.testing.assert_close(restored, full, rtol=1e-4, atol=1e-4)
    assert store.tree.stats().snapshots >= 3
    store.tree.unlock(match.node)
