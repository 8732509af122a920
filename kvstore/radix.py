"""The prefix cache: a radix tree from (namespace, token prefix) to KV pages and
GDN state snapshots, so that a request whose prompt starts with a cached prefix
skips prefilling it.

DECISION: the tree works at page granularity. Every edge holds a whole number
of pages (page_size tokens each), so every node boundary is a multiple of
page_size; snapshots of the GDN recurrent state are only taken at page-aligned
token counts, and a snapshot always sits at a node's end (a node is split where
needed so that one ends exactly there). A partial tail page is never cached: the
caller keeps or frees it.

Shape of the tree::

    root ── "ns-a" (namespace root, no pages) ── [t0..t7] pages 3,4 ── [t8..t11] page 9  (snapshot 1)
         │                                   └─ [u0..u3] page 5
         └─ "ns-b" ── ...

* The namespace is an opaque string the caller builds from the model, the KV
  format and cache_salt. Each namespace is its own subtree under the root, so
  different namespaces never share nodes and never match each other.
* Children are keyed by the token key of their first page, so one step down
  costs one dict lookup plus comparing the tokens touched; match and insert
  cost O(tokens).
* Keys are token ids packed as bytes, 4 per token (uint32), not tuples of
  ints: comparing a cached 100K-token prefix is then one memcmp (~0.05 ms)
  instead of 100K int comparisons (~1.5 ms), the store hands over the
  prompt as a numpy view of its request's bytes without making 100K Python
  ints (~3 ms), and a cached token costs 4 bytes, not an 8-byte pointer
  (plus an int object above 256).
* For hybrid models only a node that holds a snapshot is restorable: the
  recurrent state cannot be rebuilt from KV pages. A match therefore stops at
  the deepest node on the path that has a snapshot.
* Every walk over the tree (match, insert, lock, eviction, stats, the
  invariant check) is a loop, never a recursion: one agent conversation adds
  a node per turn below the last, so a tree is thousands of levels deep after
  a long session, past Python's recursion limit (evict_staging of such a
  subtree raised RecursionError on every Allocate that needed a sink page).
* LRU uses a logical clock (one tick per match or insert), not wall time, so
  eviction order is deterministic. Ties break by node creation order.

* Page ids may be staging ids (PageAllocator.staging): a KV format that keeps
  a sequence's first pages exact in bf16 (rk4p's sinks) caches those pages as
  they are. They come free only with their node's whole subtree
  (evict_staging); evict() counts and frees real pages.

Ownership: pages and snapshot slots the tree references belong to the cache; it
gives them back to the allocators when it evicts. Pure Python and numpy; no torch.
"""
from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.allocator import PageAllocator, SlotAllocator

# bytes per token in a key (uint32 ids)
TOKEN_BYTES = 4


class CacheNode:
    """One edge of the tree: `key` holds whole pages of tokens (token_key
    bytes), `pages` their KV page ids (one per page_size tokens). Callers
    treat it as an opaque handle for lock()/unlock(); a handle stays valid
    across splits (it keeps its end boundary) until the node is evicted."""

    __slots__ = (
        "namespace", "key", "pages", "parent", "children", "depth",
        "snapshot", "lock_ref", "last_used", "seq", "alive",
    )

    def __init__(self, namespace: str, key: bytes, pages: list[int],
                 parent: CacheNode | None, depth: int, seq: int):
        self.namespace = namespace
        self.key = key                  # tokens on this edge, len(pages) * page_size of them
        self.pages = pages
        self.parent = parent
        self.children: dict = {}        # first page's key -> child (namespace str at the root)
        self.depth = depth              # tokens from the namespace root to this node's end
        self.snapshot: int | None = None
        self.lock_ref = 0               # locks on this node plus on every node below it
        self.last_used = 0
        self.seq = seq                  # creation order: LRU tie-break
        self.alive = True

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def holds_pages(self) -> bool:
        """False only for the root and namespace roots."""
        return bool(self.pages)

    def __repr__(self) -> str:
        return (f"CacheNode(ns={self.namespace!r}, depth={self.depth}, pages={self.pages}, "
                f"snapshot={self.snapshot}, lock_ref={self.lock_ref}, last_used={self.last_used})")


@dataclass
class Match:
    """What the cache holds for a prompt's prefix.

    `num_tokens` tokens (a multiple of page_size, never the whole prompt) are
    covered by `pages` (num_tokens // page_size ids, in order). For hybrid
    models `snapshot_slot` holds the recurrent state after exactly num_tokens
    tokens (None on a miss). `node` is the handle to lock()."""

    num_tokens: int
    pages: list[int]
    snapshot_slot: int | None
    node: CacheNode

    @property
    def hit(self) -> bool:
        return self.num_tokens > 0


@dataclass
class Inserted:
    """Result of insert(): `node` ends at `num_tokens` (= len(tokens) // page_size
    * page_size) and may be locked by the caller. The cache took `new_pages` of
    the caller's pages. The caller must free exactly `duplicate_pages` (its own
    page ids for a prefix the cache already held with other ids; the tree
    references none of them) and `unused_snapshot` if not None."""

    node: CacheNode
    num_tokens: int
    new_pages: int
    duplicate_pages: list[int]
    unused_snapshot: int | None


@dataclass(frozen=True)
class CacheStats:
    cached_pages: int       # pages the tree references
    evictable_pages: int    # of those, pages of unlocked nodes
    locked_pages: int       # pages of locked nodes
    snapshots: int          # snapshot slots the tree references
    nodes: int              # nodes holding pages (roots excluded)
    locked_nodes: int       # nodes with lock_ref > 0 (roots included)
    queries: int            # match() calls
    hits: int               # matches with num_tokens > 0
    queried_tokens: int     # prompt tokens seen by match()
    hit_tokens: int         # prompt tokens served from the cache


class PrefixCache(ABC):
    """Contract of a prefix cache over paged KV (and, for hybrid models, GDN
    state snapshots).

    * Lock before use: match() does not lock. A caller that will read the
      matched pages or snapshot calls lock(match.node) right after match(),
      with no other cache call in between, and unlock() when done. Only locked
      nodes are safe from eviction.
    * Evicting 0 is always safe: evict(0) and evict_snapshots(0) do nothing.
    * match() never returns freed pages or slots: everything it returns is
      referenced by the cache at that moment.
    * Pages handed to insert() become the cache's, except the ids it returns in
      Inserted.duplicate_pages, which stay the caller's to free. A snapshot
      slot handed to insert() becomes the cache's unless it comes back as
      Inserted.unused_snapshot.
    * The cache frees pages and slots to the allocators only when it evicts.
    """

    @abstractmethod
    def match(self, namespace: str, tokens: Sequence[int]) -> Match:
        """Longest restorable cached prefix of `tokens` in `namespace`.

        Leaves at least one token uncached (num_tokens <= len(tokens) - 1,
        rounded down to a page multiple) so the model has a token to run and
        produce logits for. Marks the matched path as recently used. Does not
        lock. May split a node in two (what is cached does not change)."""

    @abstractmethod
    def lock(self, node: CacheNode) -> None:
        """Pin `node` and all its ancestors: their pages and snapshots are not
        evicted until the matching unlock(). Raises ValueError for an evicted
        node."""

    @abstractmethod
    def unlock(self, node: CacheNode) -> None:
        """Undo one lock(node). Raises ValueError if `node` is not locked."""

    @abstractmethod
    def insert(self, namespace: str, tokens: Sequence[int], pages: Sequence[int],
               snapshot_slot: int | None = None) -> Inserted:
        """Cache the full pages of `tokens`: len(pages) == len(tokens) // page_size.

        Where the cache already holds the same prefix it keeps its own pages;
        caller pages it did not take come back in duplicate_pages (the caller
        frees exactly those). `snapshot_slot` (hybrid only) attaches to the
        node ending at len(tokens) // page_size * page_size tokens; if that
        node already has one, the new slot comes back as unused_snapshot.
        Checks everything before changing anything: a page or slot that is
        free in its allocator, listed twice, or cached at another position
        raises ValueError and the cache is unchanged."""

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages if possible, removing least recently
        used unlocked leaves (a parent whose children are gone becomes a
        candidate). Frees removed nodes' snapshots too. Returns pages freed."""

    @abstractmethod
    def evict_snapshots(self, num_slots: int) -> int:
        """Free up to `num_slots` snapshot slots of unlocked nodes, least
        recently used first, keeping their pages. Returns slots freed."""

    @abstractmethod
    def stats(self) -> CacheStats:
        """Sizes and hit counters, for metrics."""

    @abstractmethod
    def reset(self) -> int:
        """Free everything that is not locked. Returns pages freed."""


class RadixCache(PrefixCache):
    """Radix tree at page granularity; see the module docstring."""

    def __init__(self, page_size: int, pages: PageAllocator,
                 snapshots: SlotAllocator | None = None, hybrid: bool = False):
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        if hybrid and snapshots is None:
            raise ValueError("a hybrid prefix cache needs a SlotAllocator for GDN state snapshots")
        self.page_size = page_size
        self._page_bytes = page_size * TOKEN_BYTES  # one page's share of a key
        self.hybrid = hybrid
        self._pages = pages
        self._snapshots = snapshots
        self._seq = 0
        self._clock = 0
        self._root = self._new_node("", b"", [], None, 0)
        self._cached_pages: set[int] = set()
        self._cached_slots: set[int] = set()
        self._num_nodes = 0
        self._locked_pages = 0
        self._locked_nodes = 0
        self._queries = 0
        self._hits = 0
        self._queried_tokens = 0
        self._hit_tokens = 0

    # ------------------------------------------------------------------ match

    def match(self, namespace: str, tokens: Sequence[int]) -> Match:
        _check_namespace(namespace)
        key = token_key(tokens)
        num_tokens = len(key) // TOKEN_BYTES
        path, partial = self._descend(namespace, key, self._matchable_pages(num_tokens))
        if self.hybrid:
            path = _cut_to_last_snapshot(path)
        elif partial is not None:
            path.append(self._split(*partial))
        self._touch(path)
        node = path[-1] if path else self._root
        self._count_query(num_tokens, node.depth)
        return Match(node.depth, _pages_of(path), node.snapshot if path else None, node)

    def _matchable_pages(self, num_tokens: int) -> int:
        """Pages a prompt of num_tokens may take from the cache: one token at least
        stays uncached for the model to run."""
        return max(num_tokens - 1, 0) // self.page_size

    def _count_query(self, queried: int, hit: int) -> None:
        self._queries += 1
        self._queried_tokens += queried
        self._hit_tokens += hit
        self._hits += hit > 0

    # ---------------------------------------------------------- lock / unlock

    def lock(self, node: CacheNode) -> None:
        if not node.alive:
            raise ValueError("cannot lock an evicted node; match again")
        for n in _self_and_ancestors(node):
            if n.lock_ref == 0:
                self._locked_pages += n.num_pages
                self._locked_nodes += 1
            n.lock_ref += 1

    def unlock(self, node: CacheNode) -> None:
        if node.lock_ref <= 0:
            raise ValueError(f"unlock of a node that is not locked: {node!r}")
        for n in _self_and_ancestors(node):
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._locked_pages -= n.num_pages
                self._locked_nodes -= 1

    # ----------------------------------------------------------------- insert

    def insert(self, namespace: str, tokens: Sequence[int], pages: Sequence[int],
               snapshot_slot: int | None = None) -> Inserted:
        _check_namespace(namespace)
        key, pages = token_key(tokens), list(pages)
        num_tokens = len(key) // TOKEN_BYTES
        n = num_tokens // self.page_size
        if len(pages) != n:
            raise ValueError(f"insert of {num_tokens} tokens needs {n} full pages "
                             f"(page_size={self.page_size}), got {len(pages)}")
        path, partial = self._descend(namespace, key, n)
        tree_pages = _pages_of(path) + (partial[0].pages[:partial[1]] if partial else [])
        duplicates = self._check_insert_pages(pages, tree_pages)
        target = path[-1] if path and partial is None and len(tree_pages) == n else None
        self._check_insert_snapshot(snapshot_slot, target)
        if n == 0:
            return Inserted(self._root, 0, 0, [], snapshot_slot)

        if partial is not None:
            path.append(self._split(*partial))
        if len(tree_pages) < n:
            parent = path[-1] if path else self._namespace_root(namespace)
            start = len(tree_pages)
            path.append(self._add_leaf(parent, key[start * self._page_bytes:n * self._page_bytes],
                                       pages[start:]))
        self._touch(path)
        node = path[-1]
        unused = self._attach_snapshot(node, snapshot_slot)
        return Inserted(node, node.depth, n - len(tree_pages), duplicates, unused)

    def _check_insert_pages(self, pages: list[int], tree_pages: list[int]) -> list[int]:
        """Validate the caller's pages against what the tree holds on the same
        path; return the caller's ids the tree will not take."""
        seen: set[int] = set()
        duplicates = []
        free = self._pages.first_free(pages)  # also rejects ids out of range
        for i, page in enumerate(pages):
            if page == free:
                raise ValueError(f"page {page} is free in the allocator; insert only allocated pages")
            if page in seen:
                raise ValueError(f"page {page} is listed twice in one insert")
            seen.add(page)
            if i < len(tree_pages) and page == tree_pages[i]:
                continue
            if page in self._cached_pages:
                raise ValueError(f"page {page} is cached for other tokens; "
                                 "was it used after its match was unlocked?")
            if i < len(tree_pages):
                duplicates.append(page)
        return duplicates

    def _check_insert_snapshot(self, slot: int | None, target: CacheNode | None) -> None:
        if slot is None:
            return
        if not self.hybrid:
            raise ValueError("snapshot_slot given to a prefix cache of a model without GDN state")
        if self._snapshots.is_free(slot):
            raise ValueError(f"state slot {slot} is free in the allocator; insert only allocated slots")
        if slot in self._cached_slots and (target is None or target.snapshot != slot):
            raise ValueError(f"state slot {slot} is already a snapshot of another prefix")

    def _attach_snapshot(self, node: CacheNode, slot: int | None) -> int | None:
        """Give `node` the snapshot `slot`; return the slot if the node already has one."""
        if slot is None or node.snapshot == slot:
            return None
        if node.snapshot is not None:
            return slot
        node.snapshot = slot
        self._cached_slots.add(slot)
        return None

    # ------------------------------------------------------------------ evict

    def evict(self, num_pages: int) -> int:
        _check_count(num_pages, "pages")
        if num_pages == 0:
            return 0
        candidates = [_lru_key(n) for n in self._iter_nodes() if _is_evictable_leaf(n)]
        heapq.heapify(candidates)
        freed = 0
        while freed < num_pages and candidates:
            leaf = heapq.heappop(candidates)[2]
            parent = leaf.parent
            freed += self._remove_leaf(leaf)
            if _is_evictable_leaf(parent):
                heapq.heappush(candidates, _lru_key(parent))
        return freed

    def evict_staging(self, num_pages: int) -> int:
        """Free at least `num_pages` staging pages if possible. Staging pages
        are the sink pages at the start of prefixes, so each comes free only
        with its node's whole subtree: the least recently used unlocked node
        holding one goes first, with everything below it. Returns staging
        pages freed."""
        _check_count(num_pages, "staging pages")
        freed = 0
        while freed < num_pages:
            holders = [n for n in self._iter_nodes()
                       if n.lock_ref == 0 and any(map(self._pages.is_staging, n.pages))]
            if not holders:
                break
            freed += self._remove_subtree(min(holders, key=_lru_key))
        return freed

    def _remove_subtree(self, node: CacheNode) -> int:
        """Remove an unlocked node and everything below it; staging pages freed.

        Iterative, deepest nodes first: one agent conversation adds a node per
        turn below its sink page's node, so a subtree may be thousands of
        levels deep, past Python's recursion limit."""
        staged = 0
        for n in reversed(_subtree_preorder(node)):  # every child before its parent
            staged += sum(map(self._pages.is_staging, n.pages))
            self._remove_leaf(n)
        return staged

    def evict_snapshots(self, num_slots: int) -> int:
        _check_count(num_slots, "snapshots")
        if num_slots == 0 or not self._cached_slots:
            return 0
        candidates = [_lru_key(n) for n in self._iter_nodes()
                      if n.snapshot is not None and n.lock_ref == 0]
        for _, _, node in heapq.nsmallest(num_slots, candidates):
            self._drop_snapshot(node)
        return min(num_slots, len(candidates))

    def reset(self) -> int:
        return self.evict(len(self._cached_pages))

    def _remove_leaf(self, leaf: CacheNode) -> int:
        parent = leaf.parent
        del parent.children[leaf.key[:self._page_bytes]]
        leaf.alive = False
        self._num_nodes -= 1
        self._drop_snapshot(leaf)
        self._pages.free(leaf.pages)
        self._cached_pages.difference_update(leaf.pages)
        if parent.parent is self._root and not parent.children:
            self._drop_namespace(parent)
        # real pages only: staging pages (sinks) are a pool of their own
        return leaf.num_pages - sum(map(self._pages.is_staging, leaf.pages))

    def _drop_snapshot(self, node: CacheNode) -> None:
        if node.snapshot is None:
            return
        self._snapshots.free([node.snapshot])
        self._cached_slots.discard(node.snapshot)
        node.snapshot = None

    def _drop_namespace(self, ns_root: CacheNode) -> None:
        del self._root.children[ns_root.namespace]
        ns_root.alive = False

    # ------------------------------------------------------------------ stats

    def stats(self) -> CacheStats:
        cached = len(self._cached_pages)
        return CacheStats(
            cached_pages=cached,
            evictable_pages=cached - self._locked_pages,
            locked_pages=self._locked_pages,
            snapshots=len(self._cached_slots),
            nodes=self._num_nodes,
            locked_nodes=self._locked_nodes,
            queries=self._queries,
            hits=self._hits,
            queried_tokens=self._queried_tokens,
            hit_tokens=self._hit_tokens,
        )

    def referenced_pages(self) -> frozenset[int]:
        """Page ids the tree holds (for checks and debugging)."""
        return frozenset(self._cached_pages)

    def referenced_snapshots(self) -> frozenset[int]:
        """Snapshot slot ids the tree holds (for checks and debugging)."""
        return frozenset(self._cached_slots)

    # --------------------------------------------------------- tree plumbing

    def _descend(self, namespace: str, key: bytes, max_pages: int):
        """Follow `key` (token_key bytes) down the namespace's subtree over at
        most max_pages pages. Returns (nodes matched in full, in order; (node,
        pages matched) for a last edge matched only part way, or None)."""
        path: list[CacheNode] = []
        node = self._root.children.get(namespace)
        matched = 0
        while node is not None and matched < max_pages:
            child = node.children.get(self._page_key(key, matched))
            if child is None:
                break
            common = self._common_pages(child, key, matched, max_pages - matched)
            if common < child.num_pages:
                return path, (child, common)
            path.append(child)
            node = child
            matched += common
        return path, None

    def _page_key(self, key: bytes, page: int) -> bytes:
        return key[page * self._page_bytes:(page + 1) * self._page_bytes]

    def _common_pages(self, child: CacheNode, key: bytes, start_page: int,
                      max_pages: int) -> int:
        """How many of child's pages equal key's pages from start_page on (>= 1:
        the first page is its key)."""
        pb = self._page_bytes
        limit = min(child.num_pages, max_pages)
        offset = start_page * pb
        if child.key[:limit * pb] == key[offset:offset + limit * pb]:
            return limit
        common = 1
        while child.key[common * pb:(common + 1) * pb] == self._page_key(key, start_page + common):
            common += 1
        return common

    def _split(self, node: CacheNode, num_pages: int) -> CacheNode:
        """Cut `node` after its first num_pages pages; return the new upper part.
        `node` keeps its end (and snapshot), so handles to it stay valid."""
        pb = self._page_bytes
        upper = self._new_node(node.namespace, node.key[:num_pages * pb], node.pages[:num_pages],
                               node.parent,
                               node.depth - (node.num_pages - num_pages) * self.page_size)
        upper.lock_ref = node.lock_ref
        upper.last_used = node.last_used
        if upper.lock_ref > 0:
            self._locked_nodes += 1
        self._num_nodes += 1
        node.parent.children[upper.key[:pb]] = upper
        node.key = node.key[num_pages * pb:]
        node.pages = node.pages[num_pages:]
        node.parent = upper
        upper.children[node.key[:pb]] = node
        return upper

    def _add_leaf(self, parent: CacheNode, key: bytes, pages: list[int]) -> CacheNode:
        leaf = self._new_node(parent.namespace, key, pages, parent,
                              parent.depth + len(pages) * self.page_size)
        parent.children[key[:self._page_bytes]] = leaf
        self._cached_pages.update(pages)
        self._num_nodes += 1
        return leaf

    def _namespace_root(self, namespace: str) -> CacheNode:
        ns_root = self._root.children.get(namespace)
        if ns_root is None:
            ns_root = self._new_node(namespace, b"", [], self._root, 0)
            self._root.children[namespace] = ns_root
        return ns_root

    def _new_node(self, namespace, key, pages, parent, depth) -> CacheNode:
        self._seq += 1
        return CacheNode(namespace, key, pages, parent, depth, self._seq)

    def _touch(self, path: list[CacheNode]) -> None:
        self._clock += 1
        for node in path:
            node.last_used = self._clock

    def _iter_nodes(self) -> Iterator[CacheNode]:
        """Every node holding pages, depth first."""
        stack = [ns for ns in self._root.children.values()]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.holds_pages:
                yield node

    # ------------------------------------------------------------- self-check

    def check_invariants(self) -> None:
        """Walk the whole tree and raise AssertionError on any inconsistency.
        O(tree size): for tests and debugging, not the serving path."""
        pages: list[int] = []
        slots: list[int] = []
        locked_pages = 0
        locked_nodes = int(self._root.lock_ref > 0)
        nodes = 0
        _require(self._root.lock_ref >= sum(c.lock_ref for c in self._root.children.values()),
                 "root lock_ref below its children's")
        for ns, ns_root in self._root.children.items():
            _require(ns_root.namespace == ns and ns_root.parent is self._root and not ns_root.pages,
                     f"bad namespace root {ns!r}")
            _require(bool(ns_root.children), f"empty namespace {ns!r} kept")
            locked_nodes += ns_root.lock_ref > 0
            self._check_children(ns_root)
        for node in self._iter_nodes():
            nodes += 1
            pages.extend(node.pages)
            if node.snapshot is not None:
                slots.append(node.snapshot)
            if node.lock_ref > 0:
                locked_pages += node.num_pages
                locked_nodes += 1
            self._check_node(node)
        _require(len(pages) == len(set(pages)), "a page is referenced twice")
        _require(set(pages) == self._cached_pages, "page bookkeeping out of sync")
        _require(len(slots) == len(set(slots)), "a snapshot slot is referenced twice")
        _require(set(slots) == self._cached_slots, "snapshot bookkeeping out of sync")
        _require(not any(self._pages.is_free(p) for p in pages), "a cached page is free")
        _require(not any(self._snapshots.is_free(s) for s in slots), "a cached slot is free")
        _require(nodes == self._num_nodes, "node count out of sync")
        _require(locked_pages == self._locked_pages, "locked page count out of sync")
        _require(locked_nodes == self._locked_nodes, "locked node count out of sync")

    def _check_node(self, node: CacheNode) -> None:
        ps, pb = self.page_size, self._page_bytes
        parent = node.parent
        _require(node.alive and node.pages and isinstance(node.key, bytes)
                 and len(node.key) == node.num_pages * pb, f"bad edge {node!r}")
        _require(parent.children.get(node.key[:pb]) is node, f"{node!r} not under its key")
        _require(node.namespace == parent.namespace, f"{node!r} crosses namespaces")
        _require(node.depth == parent.depth + node.num_pages * ps and node.depth % ps == 0,
                 f"bad depth {node!r}")
        self._check_children(node)

    def _check_children(self, node: CacheNode) -> None:
        _require(node.lock_ref >= 0, f"negative lock_ref {node!r}")
        _require(node.lock_ref >= sum(c.lock_ref for c in node.children.values()),
                 f"lock_ref below its children's {node!r}")


# ------------------------------------------------------------------ helpers

def token_key(tokens: Sequence[int]) -> bytes:
    """Token ids as the tree keys them: TOKEN_BYTES each, uint32. A uint32
    array (what the store's server hands over) costs one copy; a list of
    ints is converted. Callers check the ids first (the store checks them
    against the vocabulary): a negative or >= 2**32 id raises OverflowError."""
    return np.asarray(tokens, dtype=np.uint32).tobytes()


def _check_namespace(namespace: str) -> None:
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")


def _check_count(n: int, what: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"cannot evict {n!r} {what}: need an int >= 0")


def _subtree_preorder(node: CacheNode) -> list[CacheNode]:
    """`node` and every node below it, each parent before its children; with
    an explicit stack, since a tree is as deep as a conversation is long."""
    order, stack = [], [node]
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(n.children.values())
    return order


def _self_and_ancestors(node: CacheNode) -> Iterator[CacheNode]:
    while node is not None:
        yield node
        node = node.parent


def _pages_of(path: list[CacheNode]) -> list[int]:
    return [page for node in path for page in node.pages]


def _cut_to_last_snapshot(path: list[CacheNode]) -> list[CacheNode]:
    """The path up to its deepest node holding a snapshot (empty if none)."""
    for i in range(len(path) - 1, -1, -1):
        if path[i].snapshot is not None:
            return path[:i + 1]
    return []


def _is_evictable_leaf(node: CacheNode) -> bool:
    return node.holds_pages and node.is_leaf and node.lock_ref == 0


def _lru_key(node: CacheNode) -> tuple[int, int, CacheNode]:
    return (node.last_used, node.seq, node)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)
