"""RadixCache: exact small cases with page_size=4, then a hypothesis state machine
that drives it like the KV store's callers do and checks it against a model."""
import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.allocator import OutOfPages, OutOfSlots, PageAllocator, SlotAllocator
from kvstore.radix import PrefixCache, RadixCache

PS = 4
NS = "m|bf16|"


def seq(n, base=0):
    """n tokens base, base+1, ... (distinct pages never collide by accident)."""
    return list(range(base, base + n))


def dense(num_pages=32):
    pages = PageAllocator(num_pages)
    return RadixCache(PS, pages, None, hybrid=False), pages


def hybrid(num_pages=32, num_slots=8):
    pages, slots = PageAllocator(num_pages), SlotAllocator(num_slots)
    return RadixCache(PS, pages, slots, hybrid=True), pages, slots


def put(cache, pages, tokens, ns=NS, slot=None, reuse=()):
    """Insert like a caller: reuse `reuse` (matched pages), allocate the rest."""
    n = len(tokens) // PS
    own = pages.allocate(n - len(reuse))
    return cache.insert(ns, tokens, list(reuse) + own, slot)


def test_is_a_prefix_cache():
    cache, _ = dense()
    assert isinstance(cache, PrefixCache)


def test_token_ids_match_whatever_sequence_holds_them():
    """The store hands the tree a uint32 view of a request's packed bytes;
    tests and other callers hand it lists: the same ids are the same key."""
    cache, pages = dense()
    put(cache, pages, seq(12, 70_000))
    for tokens in (seq(13, 70_000), tuple(seq(13, 70_000)),
                   np.array(seq(13, 70_000), dtype=np.uint32), np.array(seq(13, 70_000))):
        m = cache.match(NS, tokens)
        assert m.num_tokens == 12 and m.pages == [0, 1, 2]
    assert cache.match(NS, np.array(seq(13, 70_001), dtype=np.uint32)).num_tokens == 0
    cache.check_invariants()


# ------------------------------------------------------------------ matching

def test_match_caps_below_whole_prompt():
    cache, pages = dense()
    ins = put(cache, pages, seq(12))
    assert ins.num_tokens == 12 and ins.new_pages == 3 and ins.duplicate_pages == []
    m = cache.match(NS, seq(13))
    assert (m.num_tokens, m.pages, m.snapshot_slot) == (12, [0, 1, 2], None)
    assert m.node is ins.node
    # the whole prompt is cached: one token must stay for the model, so only 2 pages
    m = cache.match(NS, seq(12))
    assert (m.num_tokens, m.pages) == (8, [0, 1])
    assert cache.match(NS, seq(9)).pages == [0, 1]
    assert cache.match(NS, seq(8)).pages == [0]
    assert cache.match(NS, seq(5)).pages == [0]
    for n in (4, 1, 0):
        m = cache.match(NS, seq(n))
        assert (m.num_tokens, m.pages, m.hit) == (0, [], False)


def test_match_stops_at_first_differing_page():
    cache, pages = dense()
    put(cache, pages, seq(12))
    tokens = seq(6) + [99] + seq(20, 7)  # differs inside the second page
    m = cache.match(NS, tokens)
    assert (m.num_tokens, m.pages) == (4, [0])
    assert cache.match(NS, [99] + seq(20)).num_tokens == 0
    assert cache.match("other", seq(20)).num_tokens == 0


def test_match_splits_a_node_so_the_handle_ends_at_the_match():
    cache, pages = dense()
    ins = put(cache, pages, seq(12))
    assert cache.stats().nodes == 1
    m = cache.match(NS, seq(12))  # 8 tokens of a 12-token edge
    assert cache.stats().nodes == 2
    assert m.node.depth == 8 and m.node.pages == [0, 1]
    assert ins.node.depth == 12 and ins.node.pages == [2] and ins.node.parent is m.node
    cache.lock(m.node)
    assert cache.stats().locked_pages == 2
    cache.check_invariants()


def test_insert_splits_where_sequences_diverge():
    cache, pages = dense()
    put(cache, pages, seq(12))                       # pages 0 1 2
    ins = put(cache, pages, seq(8) + [100, 101, 102, 103, 104], reuse=[0, 1])
    assert ins.new_pages == 1 and ins.duplicate_pages == [] and ins.num_tokens == 12
    assert cache.stats().nodes == 3
    assert cache.match(NS, seq(8) + [100, 101, 102, 103, 0]).pages == [0, 1, 3]
    assert cache.match(NS, seq(13)).pages == [0, 1, 2]
    assert cache.match(NS, seq(4) + [7, 7, 7, 7, 7]).pages == [0]
    # a sequence that ends inside an edge splits it so that a node ends there
    ins = cache.insert(NS, seq(4), [0])
    assert ins.node.depth == 4 and ins.node.pages == [0] and ins.new_pages == 0
    assert cache.stats().nodes == 4
    cache.check_invariants()


def test_insert_keeps_tree_pages_and_returns_only_callers_duplicates():
    cache, pages = dense()
    put(cache, pages, seq(12))                       # pages 0 1 2
    # a concurrent prefill of the same prompt produced other ids for the same tokens
    ins = cache.insert(NS, seq(14), pages.allocate(3))
    assert ins.duplicate_pages == [3, 4, 5] and ins.new_pages == 0
    pages.free(ins.duplicate_pages)
    # a request that matched two pages and prefilled two more, one of them raced
    ins = cache.insert(NS, seq(16), [0, 1] + pages.allocate(2))
    assert ins.duplicate_pages == [3] and ins.new_pages == 1
    pages.free(ins.duplicate_pages)
    assert cache.match(NS, seq(17)).pages == [0, 1, 2, 4]
    assert cache.referenced_pages() == {0, 1, 2, 4}
    assert pages.num_free == 32 - 4
    cache.check_invariants()


def test_insert_rejects_bad_pages_without_changing_anything():
    cache, pages = dense()
    put(cache, pages, seq(8))                         # pages 0 1
    before = (cache.stats(), cache.referenced_pages(), pages.num_free)
    spare = pages.allocate(1)                         # page 2
    with pytest.raises(ValueError, match="full pages"):
        cache.insert(NS, seq(8), [0])
    with pytest.raises(ValueError, match="cached for other tokens"):
        cache.insert(NS, seq(4, 50) + seq(4), spare + [0])   # page 0 belongs to tokens 0..3
    with pytest.raises(ValueError, match="free in the allocator"):
        cache.insert(NS, seq(4, 50), [9])
    with pytest.raises(ValueError, match="out of range"):
        cache.insert(NS, seq(4, 50), [999])
    with pytest.raises(ValueError, match="listed twice"):
        cache.insert(NS, seq(8, 50), spare + spare)
    with pytest.raises(ValueError, match="without GDN state"):
        cache.insert(NS, seq(4, 50), spare, snapshot_slot=0)
    with pytest.raises(TypeError):
        cache.insert(b"ns", seq(4, 50), spare)
    after = (cache.stats(), cache.referenced_pages(), pages.num_free + 1)
    assert before == after
    cache.check_invariants()


def test_insert_of_less_than_a_page_caches_nothing():
    cache, pages = dense()
    ins = cache.insert(NS, [1, 2, 3], [])
    assert (ins.num_tokens, ins.new_pages, ins.duplicate_pages) == (0, 0, [])
    assert cache.stats().nodes == 0


# ----------------------------------------------------------------- snapshots

def test_snapshot_attaches_at_the_last_full_page():
    cache, pages, slots = hybrid()
    ins = put(cache, pages, seq(14), slot=slots.allocate(1)[0])   # 14 tokens: snapshot at 12
    assert ins.num_tokens == 12 and ins.node.snapshot == 0 and ins.unused_snapshot is None
    m = cache.match(NS, seq(13))
    assert (m.num_tokens, m.pages, m.snapshot_slot) == (12, [0, 1, 2], 0)


def test_hybrid_match_is_the_deepest_snapshot_on_the_path():
    cache, pages, slots = hybrid()
    put(cache, pages, seq(12), slot=slots.allocate(1)[0])         # pages 0 1 2, snapshot 0 at 12
    ins = cache.insert(NS, seq(8), [0, 1], slots.allocate(1)[0])  # splits: snapshot 1 at 8
    assert ins.node.depth == 8 and ins.node.snapshot == 1 and cache.stats().nodes == 2
    put(cache, pages, seq(20), reuse=[0, 1, 2])                   # pages 3 4, no snapshot
    put(cache, pages, seq(8) + seq(8, 50), reuse=[0, 1])          # pages 5 6, no snapshot

    def got(tokens):
        m = cache.match(NS, tokens)
        return m.num_tokens, m.pages, m.snapshot_slot

    assert got(seq(21)) == (12, [0, 1, 2], 0)   # 20 cached, but no snapshot past 12
    assert got(seq(13)) == (12, [0, 1, 2], 0)
    assert got(seq(12)) == (8, [0, 1], 1)       # cap: 8 tokens, snapshot 1 sits there
    assert got(seq(9)) == (8, [0, 1], 1)
    assert got(seq(8)) == (0, [], None)         # 4 tokens cached, no snapshot at 4
    assert got(seq(8) + seq(9, 50)) == (8, [0, 1], 1)
    assert cache.match(NS, seq(8)).node.parent is None  # a miss hands out the root
    cache.check_invariants()


def test_second_snapshot_for_a_node_is_returned_unused():
    cache, pages, slots = hybrid()
    put(cache, pages, seq(8), slot=slots.allocate(1)[0])
    ins = cache.insert(NS, seq(8), [0, 1], slots.allocate(1)[0])
    assert ins.unused_snapshot == 1 and ins.duplicate_pages == []
    slots.free([ins.unused_snapshot])
    # handing the node's own slot again is not a second snapshot
    assert cache.insert(NS, seq(8), [0, 1], 0).unused_snapshot is None
    with pytest.raises(ValueError, match="another prefix"):
        cache.insert(NS, seq(4), [0], 0)
    assert cache.referenced_snapshots() == {0} and slots.num_free == 7
    cache.check_invariants()


def test_hybrid_needs_a_slot_allocator():
    with pytest.raises(ValueError):
        RadixCache(PS, PageAllocator(4), None, hybrid=True)


# ------------------------------------------------------------------ eviction

def lru_tree():
    """P=[1111] (page 0) with leaves X=[2222] (page 1) and Y=[3333] (page 2); Z=[5555]
    (page 3) on its own. Last use: Y, then Z, then X (and P) via a match."""
    cache, pages = dense()
    x, y, z = [1] * 4 + [2] * 4, [1] * 4 + [3] * 4, [5] * 4
    put(cache, pages, x)
    put(cache, pages, y, reuse=[0])
    put(cache, pages, z)
    cache.match(NS, x + [0])
    return cache, pages, (x, y, z)


def test_evict_removes_lru_leaves_first_in_exact_order():
    cache, pages, _ = lru_tree()
    assert cache.referenced_pages() == {0, 1, 2, 3}
    order = []
    for _ in range(4):
        before = cache.referenced_pages()
        assert cache.evict(1) == 1
        (gone,) = before - cache.referenced_pages()
        order.append(gone)
        assert pages.is_free(gone)
        cache.check_invariants()
    # Y (oldest leaf), Z, X; P last: shared, and only a leaf once X and Y are gone
    assert order == [2, 3, 1, 0]
    assert cache.evict(1) == 0 and cache.stats().nodes == 0 and pages.num_free == 32


def test_evict_frees_at_least_what_is_asked_and_zero_is_a_noop():
    cache, pages, _ = lru_tree()
    assert cache.evict(0) == 0 and cache.referenced_pages() == {0, 1, 2, 3}
    with pytest.raises(ValueError):
        cache.evict(-1)
    assert cache.evict(2) == 2 and cache.referenced_pages() == {0, 1}
    assert cache.evict(100) == 2 and pages.num_free == 32


def test_evict_skips_locked_nodes_and_their_ancestors():
    cache, pages, (x, y, z) = lru_tree()
    m = cache.match(NS, y + [0])          # locks P and Y
    cache.lock(m.node)
    cache.lock(m.node)
    s = cache.stats()
    assert (s.locked_pages, s.evictable_pages, s.cached_pages) == (2, 2, 4)
    assert cache.evict(100) == 2                       # X and Z only
    assert cache.referenced_pages() == {0, 2}
    assert cache.match(NS, y + [0]).pages == [0, 2]
    cache.unlock(m.node)
    assert cache.evict(100) == 0
    cache.unlock(m.node)
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(m.node)
    assert cache.stats().locked_nodes == 0
    assert cache.evict(100) == 2 and pages.num_free == 32
    with pytest.raises(ValueError, match="evicted"):
        cache.lock(m.node)
    cache.check_invariants()


def test_lock_survives_a_split_of_the_locked_node():
    cache, pages = dense()
    ins = put(cache, pages, seq(12))
    cache.lock(ins.node)
    cache.match(NS, seq(9))               # splits the locked edge at 8
    assert cache.stats().locked_pages == 3
    assert cache.stats().locked_nodes == 4  # root, namespace root, both halves
    cache.check_invariants()
    assert cache.evict(100) == 0
    cache.unlock(ins.node)
    assert cache.stats().locked_nodes == 0 and cache.evict(100) == 3


def test_evict_frees_snapshots_of_removed_nodes():
    cache, pages, slots = hybrid()
    put(cache, pages, seq(8), slot=slots.allocate(1)[0])
    put(cache, pages, seq(12), slot=slots.allocate(1)[0], reuse=[0, 1])
    assert cache.evict(1) == 1 and cache.referenced_snapshots() == {0} and slots.is_free(1)
    assert cache.match(NS, seq(13)).num_tokens == 8
    assert cache.evict(1) == 2 and slots.num_free == 8


def test_evict_snapshots_lru_keeps_pages_and_skips_locked():
    cache, pages, slots = hybrid()
    put(cache, pages, seq(4), slot=slots.allocate(1)[0])                  # slot 0 at 4
    put(cache, pages, seq(8), slot=slots.allocate(1)[0], reuse=[0])       # slot 1 at 8
    put(cache, pages, seq(4, 50), slot=slots.allocate(1)[0])              # slot 2, other branch
    m = cache.match(NS, seq(9))                                           # uses 0 and 1
    assert m.snapshot_slot == 1
    assert cache.evict_snapshots(0) == 0
    assert cache.evict_snapshots(1) == 1 and cache.referenced_snapshots() == {0, 1}
    assert slots.is_free(2) and cache.referenced_pages() == {0, 1, 2}
    cache.lock(m.node)                                                    # pins 0 and 1
    assert cache.evict_snapshots(5) == 0
    cache.unlock(m.node)
    # 0 and 1 were last used by the same match: the tie goes to the older node (slot 0)
    assert cache.evict_snapshots(1) == 1
    assert cache.referenced_snapshots() == {1}
    assert cache.match(NS, seq(5)).num_tokens == 0                        # no snapshot at 4 now
    assert cache.match(NS, seq(9)).snapshot_slot == 1
    assert cache.evict_snapshots(9) == 1 and slots.num_free == 8
    assert cache.match(NS, seq(9)).num_tokens == 0
    assert cache.referenced_pages() == {0, 1, 2}                          # pages stay
    cache.check_invariants()


def test_reset_frees_everything_unlocked():
    cache, pages, slots = hybrid()
    put(cache, pages, seq(8), slot=slots.allocate(1)[0])
    put(cache, pages, seq(8, 50), slot=slots.allocate(1)[0])
    m = cache.match(NS, seq(9))
    cache.lock(m.node)
    assert cache.reset() == 2
    assert cache.referenced_pages() == {0, 1} and cache.referenced_snapshots() == {0}
    cache.unlock(m.node)
    assert cache.reset() == 2 and pages.num_free == 32 and slots.num_free == 8
    assert cache.stats().nodes == 0
    cache.check_invariants()


# ---------------------------------------------------------- namespaces, stats

def test_namespaces_never_share_or_match():
    cache, pages = dense()
    put(cache, pages, seq(8), ns="a")
    assert cache.match("b", seq(9)).num_tokens == 0
    ins = put(cache, pages, seq(8), ns="b")       # same tokens, own pages, no duplicates
    assert ins.duplicate_pages == [] and ins.new_pages == 2
    assert cache.match("a", seq(9)).pages == [0, 1]
    assert cache.match("b", seq(9)).pages == [2, 3]
    assert cache.match("a|salt", seq(9)).num_tokens == 0
    assert cache.evict(100) == 4
    cache.check_invariants()


def test_stats_count_queries_and_hits():
    cache, pages = dense()
    put(cache, pages, seq(8))
    cache.match(NS, seq(9))     # hit 8
    cache.match(NS, seq(6))     # hit 4
    cache.match(NS, seq(3))     # miss
    s = cache.stats()
    assert (s.queries, s.hits, s.queried_tokens, s.hit_tokens) == (3, 2, 18, 12)
    assert (s.cached_pages, s.evictable_pages, s.locked_pages, s.snapshots) == (2, 2, 0, 0)


def test_lru_uses_a_logical_clock_matches_refresh_insert_order():
    cache, pages = dense()
    put(cache, pages, [1] * 4)     # page 0
    put(cache, pages, [2] * 4)     # page 1
    cache.match(NS, [1] * 5)       # refresh page 0
    assert cache.evict(1) == 1 and cache.referenced_pages() == {0}


# ------------------------------------------------------------ state machine

# Prompts are a few pages from a tiny vocabulary (two words differ only in their last
# token) plus a partial tail, so that prefixes collide, diverge mid-edge and repeat.
PAGE_WORDS = [(0, 0, 0, 0), (0, 0, 0, 1), (1, 1, 1, 1)]
TOKENS = st.builds(lambda words, tail: [t for w in words for t in w] + tail,
                   st.lists(st.sampled_from(PAGE_WORDS), max_size=4),
                   st.lists(st.integers(0, 1), max_size=3))
NAMESPACES = st.sampled_from(["a", "b"])
NUM_PAGES, NUM_SLOTS = 20, 4


class CacheMachine(RuleBasedStateMachine):
    """Callers as the KV store will have them: a request matches and locks, allocates
    pages for the rest, later inserts and frees what the cache did not take; other
    callers lock matches for a while; eviction runs under memory pressure.

    The model: for every cached page-aligned prefix (namespace, tokens) the page at
    its last position (and its snapshot slot), kept prefix-closed."""

    HYBRID = False
    STAGING = 0  # > 0: a request's first page is a staging page (rk4p's sink)

    def __init__(self):
        super().__init__()
        self.pages = PageAllocator(NUM_PAGES, self.STAGING)
        self.slots = SlotAllocator(NUM_SLOTS)
        self.cache = RadixCache(PS, self.pages, self.slots if self.HYBRID else None, self.HYBRID)
        self.model_pages: dict[tuple, int] = {}
        self.model_snaps: dict[tuple, int] = {}
        self.inflight: list[dict] = []     # started requests: own pages/slot held by the caller
        self.held: list[tuple] = []        # (node, namespace, locked prefix tokens)

    # --- model

    def expected_match(self, ns, tokens):
        best, pages = (0, [], None), []
        for j in range(1, max(len(tokens) - 1, 0) // PS + 1):
            key = (ns, tuple(tokens[:j * PS]))
            if key not in self.model_pages:
                break
            pages.append(self.model_pages[key])
            if not self.HYBRID:
                best = (j * PS, list(pages), None)
            elif key in self.model_snaps:
                best = (j * PS, list(pages), self.model_snaps[key])
        return best

    def locked_keys(self):
        locks = [(ns, prefix) for _, ns, prefix in self.held]
        locks += [(r["ns"], r["tokens"][:r["match"].num_tokens]) for r in self.inflight]
        return {(ns, tuple(prefix[:j * PS])) for ns, prefix in locks
                for j in range(1, len(prefix) // PS + 1)}

    def prune_model(self):
        self.model_pages = {k: p for k, p in self.model_pages.items() if not self.pages.is_free(p)}
        self.model_snaps = {k: s for k, s in self.model_snaps.items() if not self.slots.is_free(s)}
        assert set(self.model_snaps) <= set(self.model_pages)

    def checked_match(self, ns, tokens):
        m = self.cache.match(ns, tokens)
        assert (m.num_tokens, m.pages, m.snapshot_slot) == self.expected_match(ns, tokens)
        assert m.num_tokens < max(len(tokens), 1) and m.num_tokens % PS == 0
        assert not any(self.pages.is_free(p) for p in m.pages)
        return m

    def evict_for(self, n, allocator, evict):
        if not allocator.can_allocate(n):
            evict(n - allocator.num_free)
            self.prune_model()
        return allocator.allocate(n) if allocator.can_allocate(n) else None

    # --- rules

    @rule(ns=NAMESPACES, tokens=TOKENS, fresh=st.booleans(), snapshot=st.booleans())
    def start_request(self, ns, tokens, fresh, snapshot):
        m = self.checked_match(ns, tokens)
        self.cache.lock(m.node)
        reuse = [] if fresh else list(m.pages)  # fresh: raced a concurrent prefill
        n = len(tokens) // PS
        own = []
        if self.STAGING and not reuse and n > 0:  # its own sink page
            own = self.evict_for(1, self.pages.staging, self.cache.evict_staging)
            if own is None:
                self.cache.unlock(m.node)
                return
        more = self.evict_for(n - len(reuse) - len(own), self.pages, self.cache.evict)
        if more is None and own:
            self.pages.free(own)
        own = None if more is None else own + more
        slot = None
        if own is not None and self.HYBRID and snapshot and n > 0:
            got = self.evict_for(1, self.slots, self.cache.evict_snapshots)
            slot = got[0] if got else None
        if own is None:
            self.cache.unlock(m.node)
            return
        self.inflight.append(dict(ns=ns, tokens=tokens, match=m, pages=reuse + own, slot=slot))

    @precondition(lambda self: self.inflight)
    @rule(i=st.integers(0, 99), keep_locked=st.booleans())
    def finish_request(self, i, keep_locked):
        r = self.inflight.pop(i % len(self.inflight))
        ns, tokens, pages, slot = r["ns"], r["tokens"], r["pages"], r["slot"]
        ins = self.cache.insert(ns, tokens, pages, slot)
        n = len(tokens) // PS
        dups = []
        for j in range(n):
            key = (ns, tuple(tokens[:(j + 1) * PS]))
            if key not in self.model_pages:
                self.model_pages[key] = pages[j]
            elif self.model_pages[key] != pages[j]:
                dups.append(pages[j])
        assert ins.duplicate_pages == dups and ins.new_pages == n - len(dups) - len(
            [j for j in range(n) if j < len(r["match"].pages) and pages[j] == r["match"].pages[j]])
        unused = None
        if slot is not None:
            key = (ns, tuple(tokens[:n * PS]))
            if key in self.model_snaps:
                unused = slot
            else:
                self.model_snaps[key] = slot
        assert ins.unused_snapshot == unused and ins.num_tokens == n * PS
        assert not set(dups) & self.cache.referenced_pages()
        self.pages.free(ins.duplicate_pages)
        if unused is not None:
            self.slots.free([unused])
        self.cache.unlock(r["match"].node)
        if keep_locked and n > 0:
            self.cache.lock(ins.node)
            self.held.append((ins.node, ns, tokens[:n * PS]))

    @rule(ns=NAMESPACES, tokens=TOKENS, lock=st.booleans())
    def match(self, ns, tokens, lock):
        m = self.checked_match(ns, tokens)
        if lock:
            self.cache.lock(m.node)
            self.held.append((m.node, ns, tokens[:m.num_tokens]))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 99))
    def unlock(self, i):
        node, _, _ = self.held.pop(i % len(self.held))
        self.cache.unlock(node)

    @rule(k=st.integers(0, 8))
    def evict(self, k):
        locked = self.locked_keys()
        evictable = [key for key in self.model_pages if key not in locked
                     and not self.pages.is_staging(self.model_pages[key])]  # counts real pages
        free_before = self.pages.num_free
        freed = self.cache.evict(k)
        assert freed == self.pages.num_free - free_before
        assert freed >= k if len(evictable) >= k else freed == len(evictable)
        assert not any(self.pages.is_free(self.model_pages[key]) for key in locked)
        self.prune_model()

    @precondition(lambda self: self.STAGING)
    @rule(k=st.integers(0, 3))
    def evict_staging(self, k):
        locked = self.locked_keys()
        sinks = [key for key in self.model_pages if key not in locked
                 and self.pages.is_staging(self.model_pages[key])]
        free_before = self.pages.staging.num_free
        freed = self.cache.evict_staging(k)
        assert freed == self.pages.staging.num_free - free_before == min(k, len(sinks))
        assert not any(self.pages.is_free(self.model_pages[key]) for key in locked)
        self.prune_model()

    @rule(k=st.integers(0, 3))
    def evict_snapshots(self, k):
        locked = self.locked_keys()
        evictable = [key for key in self.model_snaps if key not in locked]
        pages_before = self.cache.referenced_pages()
        freed = self.cache.evict_snapshots(k)
        assert freed == min(k, len(evictable))
        assert not any(self.slots.is_free(self.model_snaps[key]) for key in locked
                       if key in self.model_snaps)
        assert self.cache.referenced_pages() == pages_before
        self.prune_model()

    @rule()
    def reset(self):
        locked = self.locked_keys()
        self.cache.reset()
        self.prune_model()
        assert set(self.model_pages) == locked

    # --- invariants

    @invariant()
    def tree_is_consistent(self):
        self.cache.check_invariants()

    @invariant()
    def no_page_lost_or_shared(self):
        tree = self.cache.referenced_pages()
        free = {p for p in range(self.pages.num_ids) if self.pages.is_free(p)}
        caller = [p for r in self.inflight for p in r["pages"] if p not in tree]
        assert not tree & free
        assert not set(caller) & free and not set(caller) & tree and len(caller) == len(set(caller))
        assert len(tree) + len(free) + len(caller) == self.pages.num_ids
        assert tree == set(self.model_pages.values())
        # a staging page only ever sits at a prefix's first page
        assert all(self.pages.is_staging(p) == (len(key[1]) == PS)
                   for key, p in self.model_pages.items()) or not self.STAGING

    @invariant()
    def no_slot_lost_or_shared(self):
        tree = self.cache.referenced_snapshots()
        free = {s for s in range(NUM_SLOTS) if self.slots.is_free(s)}
        caller = {r["slot"] for r in self.inflight if r["slot"] is not None}
        assert not tree & free and not caller & free and not caller & tree
        assert len(tree) + len(free) + len(caller) == NUM_SLOTS
        assert tree == set(self.model_snaps.values())

    @invariant()
    def lock_accounting_matches_model(self):
        s = self.cache.stats()
        assert s.locked_pages == len(self.locked_keys())
        assert s.evictable_pages == s.cached_pages - s.locked_pages
        if not self.held and not self.inflight:
            assert s.locked_nodes == 0

    def teardown(self):
        for r in self.inflight:
            self.cache.unlock(r["match"].node)
            self.pages.free(p for p in r["pages"] if p not in self.cache.referenced_pages())
            if r["slot"] is not None:
                self.slots.free([r["slot"]])
        for node, _, _ in self.held:
            self.cache.unlock(node)
        assert self.cache.stats().locked_nodes == 0 and self.cache.stats().locked_pages == 0
        self.cache.reset()
        self.cache.check_invariants()
        assert self.pages.num_free == NUM_PAGES and self.slots.num_free == NUM_SLOTS
        assert self.pages.staging.num_free == self.STAGING


class HybridCacheMachine(CacheMachine):
    HYBRID = True


class SinkCacheMachine(CacheMachine):
    """rk4p's arrangement: every prefix's first page is a staging page, shared
    by the prefixes that start alike and freed only with its whole subtree."""

    HYBRID = True
    STAGING = 3


MACHINE_SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestDenseCacheMachine = CacheMachine.TestCase
TestDenseCacheMachine.settings = MACHINE_SETTINGS
TestHybridCacheMachine = HybridCacheMachine.TestCase
TestHybridCacheMachine.settings = MACHINE_SETTINGS
TestSinkCacheMachine = SinkCacheMachine.TestCase
TestSinkCacheMachine.settings = MACHINE_SETTINGS


def test_staging_sink_pages_come_free_with_their_whole_subtree():
    """rk4p caches a prefix's first page as a bf16 staging page (ids >= the
    pool's size). evict() counts real pages; evict_staging() removes the least
    recently used unlocked subtree holding a staging page, and never a locked one."""
    pages = PageAllocator(16, staging_pages=2)
    cache = RadixCache(PS, pages, None, hybrid=False)
    sink_a, sink_b = pages.staging.allocate(2)
    cache.insert(NS, seq(12), [sink_a, *pages.allocate(2)])
    shared = cache.match(NS, seq(9)).pages  # sink_a and the second page
    cache.insert(NS, seq(8) + seq(4, 500), [*shared, *pages.allocate(1)])
    cache.insert(NS, seq(8, 100), [sink_b, *pages.allocate(1)])
    m = cache.match(NS, seq(13))  # a's branch is now the most recent: b goes first
    assert cache.evict_staging(1) == 1
    assert pages.staging.num_free == 1 and pages.is_free(sink_b) and not pages.is_free(sink_a)
    assert cache.match(NS, seq(9, 100)).num_tokens == 0 and pages.num_free == 16 - 3
    cache.lock(m.node)
    assert cache.evict_staging(1) == 0  # locked: its sink stays
    assert cache.evict(2) == 1  # the one unlocked leaf (the 500.. branch), real pages only
    cache.unlock(m.node)
    assert cache.evict_staging(1) == 1 and pages.staging.num_free == 2
    assert cache.stats().cached_pages == 0 and pages.num_free == 16
    cache.check_invariants()


# ------------------------------------------------------------ deep trees

DEEP = 3000  # nodes in one chain: three times Python's default recursion limit


def _deep_conversation(cache, pages, snapshots=None):
    """One agent conversation of DEEP turns, a page each, under a staging
    sink page: a chain of DEEP nodes. Built from the last turn back (each
    insert splits the node above it), so it costs O(DEEP) steps, not the
    O(DEEP**2) of replaying the turns; the tree is the same."""
    tokens = np.arange(DEEP * PS + 1, dtype=np.uint32)
    chain = pages.staging.allocate(1) + pages.allocate(DEEP - 1)
    for turn in range(DEEP, 0, -1):
        slot = snapshots.allocate(1)[0] if snapshots is not None else None
        if turn == DEEP or snapshots is not None:
            cache.insert(NS, tokens[:turn * PS], chain[:turn], slot)
        else:  # a dense tree splits where a match ends
            cache.match(NS, tokens[:turn * PS + 1])
    assert cache.stats().nodes == DEEP
    return tokens, chain


@pytest.mark.parametrize("is_hybrid", [False, True])
def test_a_tree_thousands_of_levels_deep_works_without_recursion(is_hybrid):
    """An agent loop's conversation adds one node per turn below the last:
    every walk over the tree must be a loop. evict_staging of such a chain
    raised RecursionError, which left an rk4p store unable to hand out a
    sink page again (it kept picking the same subtree)."""
    pages = PageAllocator(DEEP + 8, staging_pages=1)
    slots = SlotAllocator(DEEP + 1) if is_hybrid else None
    cache = RadixCache(PS, pages, slots, hybrid=is_hybrid)
    tokens, chain = _deep_conversation(cache, pages, slots)
    cache.check_invariants()
    m = cache.match(NS, tokens)
    assert m.num_tokens == DEEP * PS and m.pages == chain
    cache.lock(m.node)
    assert cache.stats().locked_pages == DEEP and cache.evict_staging(1) == 0
    cache.unlock(m.node)
    # the next turn extends the conversation at the bottom
    more = np.arange(DEEP * PS, (DEEP + 1) * PS, dtype=np.uint32)
    ins = cache.insert(NS, np.concatenate([tokens[:-1], more]), [*chain, *pages.allocate(1)])
    assert ins.new_pages == 1 and ins.node.depth == (DEEP + 1) * PS
    if is_hybrid:
        assert cache.evict_snapshots(1) == 1
    assert cache.evict(1) == 1  # the chain's one leaf: the newest turn
    cache.check_invariants()
    assert cache.evict_staging(1) == 1  # the whole conversation goes with its sink
    assert cache.stats().nodes == 0 and cache.stats().cached_pages == 0
    assert pages.num_free == DEEP + 8 and pages.staging.num_free == 1
    assert slots is None or slots.num_free == DEEP + 1
    cache.check_invariants()
    _deep_conversation(cache, pages, slots)
    assert cache.reset() == DEEP - 1  # real pages; the sink comes free with them
    assert pages.num_free == DEEP + 8 and pages.staging.num_free == 1
    cache.check_invariants()
