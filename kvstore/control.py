"""The KV store's control state: sessions, who holds which page and state
slot, locks on prefix-cache nodes, and the prefix cache itself.

Every request names a session; every page or slot is at any moment exactly
one of free, held by one session, or referenced by the cache:

    free + held by sessions + cached == total       (pages, and slots)

Staging pages (bf16 pages of a format that quantizes whole pages, ids after
the real pages) are pages in this sense: held, cached and released the same
way, with a free count of their own.

Requests are validated in full before anything changes, so a bad request
(unknown session, ids out of range or not held, wrong counts) raises a
ControlError and leaves the state exactly as it was. Closing a session gives
back everything it held and drops its locks, which is how a worker that died
is cleaned up.

Pure Python and single-threaded (the server calls it from one event loop).
Owns ownership; must not know about memory, tensors or RPC (the server maps
ControlError subclasses to gRPC status codes and these dataclasses to protobuf).
"""
from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.errors import TandemError
from engine.vocabulary import first_outside_vocabulary
from kvstore.allocator import PageAllocator, SlotAllocator
from kvstore.radix import CacheNode, RadixCache


class ControlError(TandemError):
    """A request the store refuses; it changed nothing."""


class InvalidArgument(ControlError):
    """Malformed whatever the state: ids out of range, negative or wrong counts."""


class FailedPrecondition(ControlError):
    """Well formed but not valid now: unknown session, ids not held, evicted node."""


class ResourceExhausted(ControlError):
    """Not enough free pages or slots even after evicting unlocked cache entries."""


# ------------------------------------------------------------ plain results


@dataclass(frozen=True)
class MatchResult:
    num_tokens: int
    pages: tuple[int, ...]
    snapshot_slot: int | None
    node_id: int  # 0 on a miss
    locked: bool


@dataclass(frozen=True)
class Allocation:
    pages: tuple[int, ...]
    slots: tuple[int, ...]
    staging: tuple[int, ...] = ()  # bf16 staging page ids (num_pages ..)


@dataclass(frozen=True)
class InsertResult:
    node_id: int  # 0 when nothing was cached
    num_tokens: int
    pages: tuple[int, ...]  # the cache's pages for the prefix
    new_pages: int
    freed_duplicate_pages: int
    snapshot_taken: bool
    locked: bool


@dataclass(frozen=True)
class StoreStats:
    total_pages: int
    free_pages: int
    total_slots: int
    free_slots: int
    cached_pages: int
    evictable_pages: int
    locked_pages: int
    snapshots: int
    sessions: int
    held_pages: int
    held_slots: int
    cache_queries: int
    cache_hits: int
    queried_tokens: int
    hit_tokens: int
    total_staging: int = 0
    free_staging: int = 0


@dataclass
class Session:
    id: str
    name: str
    pages: set[int] = field(default_factory=set)
    slots: set[int] = field(default_factory=set)
    locks: Counter = field(default_factory=Counter)  # node id -> times locked


# ------------------------------------------------------------------- control


class StoreControl:
    """Sessions, page/slot ownership and the prefix cache of one store."""

    def __init__(self, num_pages: int, num_slots: int, page_size: int, hybrid: bool,
                 vocab_size: int, namespace_prefix: str, staging_pages: int = 0):
        self.pages = PageAllocator(num_pages, staging_pages)
        self.slots = SlotAllocator(num_slots)
        self.hybrid = hybrid
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.namespace_prefix = namespace_prefix
        self.cache = RadixCache(page_size, self.pages, self.slots, hybrid=hybrid)
        self.sessions: dict[str, Session] = {}
        self._nodes = _NodeHandles()

    # ---------------------------------------------------------- sessions

    def open_session(self, name: str = "") -> Session:
        session = Session(secrets.token_hex(8), name)
        self.sessions[session.id] = session
        return session

    def close_session(self, session_id: str) -> None:
        """Give back everything the session holds; a no-op for an unknown id."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return
        for node_id, count in session.locks.items():
            node = self._nodes.get(node_id)
            for _ in range(count):
                self.cache.unlock(node)
        self.pages.free(sorted(session.pages))
        self.slots.free(sorted(session.slots))

    def namespace(self, cache_salt: str) -> str:
        """Model and KV format (the prefix) plus the tenant's salt."""
        return f"{self.namespace_prefix}|salt={cache_salt}"

    # -------------------------------------------------------------- match

    def match(self, session_id: str, cache_salt: str, tokens: Sequence[int],
              lock: bool) -> MatchResult:
        session = self._session(session_id)
        tokens = self._check_tokens(tokens)
        m = self.cache.match(self.namespace(cache_salt), tokens)
        if not m.hit:
            return MatchResult(0, (), None, 0, False)
        node_id = self._nodes.id_of(m.node)
        if lock:
            self.cache.lock(m.node)
            session.locks[node_id] += 1
        return MatchResult(m.num_tokens, tuple(m.pages), m.snapshot_slot, node_id, lock)

    # ----------------------------------------------------------- allocate

    def allocate(self, session_id: str, num_pages: int, num_slots: int,
                 num_staging: int = 0) -> Allocation:
        session = self._session(session_id)
        if num_slots and not self.hybrid:
            raise InvalidArgument("this model has no GDN layers: ask for 0 state slots")
        if num_staging and not self.pages.staging.num_total:
            raise InvalidArgument("this store's KV format keeps no staging pages: ask for 0")
        _check_count(num_pages, "pages", self.pages.num_total)
        _check_count(num_slots, "state slots", self.slots.num_total)
        _check_count(num_staging, "staging pages", self.pages.staging.num_total)
        self._make_room(num_pages, num_slots, num_staging)
        if not (self.pages.can_allocate(num_pages) and self.slots.can_allocate(num_slots)
                and self.pages.staging.can_allocate(num_staging)):
            raise ResourceExhausted(self._shortage(num_pages, num_slots, num_staging))
        pages, slots = self.pages.allocate(num_pages), self.slots.allocate(num_slots)
        staging = self.pages.staging.allocate(num_staging)
        session.pages.update(pages)
        session.pages.update(staging)
        session.slots.update(slots)
        return Allocation(tuple(pages), tuple(slots), tuple(staging))

    def _make_room(self, num_pages: int, num_slots: int, num_staging: int) -> None:
        # Evicting unlocked entries is always safe; only what is short is evicted.
        if num_staging > self.pages.staging.num_free:  # first: it frees whole subtrees
            self.cache.evict_staging(num_staging - self.pages.staging.num_free)
        if num_pages > self.pages.num_free:
            self.cache.evict(num_pages - self.pages.num_free)
        if num_slots > self.slots.num_free:
            self.cache.evict_snapshots(num_slots - self.slots.num_free)

    def _shortage(self, num_pages: int, num_slots: int, num_staging: int) -> str:
        stats = self.stats()
        staging = (f" and {num_staging} staging pages ({stats.free_staging} free)"
                   if num_staging else "")
        return (f"asked for {num_pages} pages and {num_slots} state slots{staging}; after "
                f"evicting every unlocked cache entry {stats.free_pages} pages and "
                f"{stats.free_slots} slots are free ({stats.held_pages} pages / "
                f"{stats.held_slots} slots held by {stats.sessions} sessions, "
                f"{stats.locked_pages} cached pages locked): release or unlock, wait for "
                "requests to finish, or plan a larger store")

    # ------------------------------------------------------------- insert

    def insert(self, session_id: str, cache_salt: str, tokens: Sequence[int],
               pages: Sequence[int], snapshot_slot: int | None, lock: bool) -> InsertResult:
        session = self._session(session_id)
        tokens = self._check_tokens(tokens)
        pages = list(pages)
        expected = len(tokens) // self.page_size
        if len(pages) != expected:
            raise InvalidArgument(f"{len(tokens)} tokens fill {expected} whole pages of "
                                  f"{self.page_size}; the request lists {len(pages)} pages")
        self._check_insert_pages(session, pages)
        self._check_insert_snapshot(session, snapshot_slot)
        try:
            inserted = self.cache.insert(self.namespace(cache_salt), tokens, pages, snapshot_slot)
        except ValueError as e:  # the cache checked everything before changing anything
            raise FailedPrecondition(f"insert refused by the prefix cache: {e}") from e
        return self._settle_insert(session, pages, snapshot_slot, inserted, lock)

    def _check_insert_pages(self, session: Session, pages: list[int]) -> None:
        self._check_ids(pages, self.pages.num_ids, "page")
        # pages this session does not hold: an agent turn's cached prefix
        # (thousands of pages, the cache's) plus any bad ones
        foreign = [page for page in pages if page not in session.pages]
        free = self.pages.first_free(foreign)
        others = [s for s in self.sessions.values() if s is not session]
        held_elsewhere = {page for s in others for page in s.pages.intersection(foreign)}
        for page in foreign:
            if page in held_elsewhere:
                holder = next(s.id for s in others if page in s.pages)
                raise FailedPrecondition(f"page {page} is held by another session ({holder}), "
                                         "not this one")
            if page == free:
                raise FailedPrecondition(f"page {page} is free: allocate pages before inserting")
            # Otherwise the cache holds it; RadixCache.insert checks it sits at this position.

    def _check_insert_snapshot(self, session: Session, slot: int | None) -> None:
        if slot is None:
            return
        if not self.hybrid:
            raise InvalidArgument("this model has no GDN layers: send no snapshot_slot")
        self._check_ids([slot], self.slots.num_total, "state slot")
        if slot not in session.slots:
            raise FailedPrecondition(f"state slot {slot} is not held by this session: insert a "
                                     "snapshot copied into a slot you allocated")

    def _settle_insert(self, session: Session, pages: list[int], snapshot_slot: int | None,
                       inserted, lock: bool) -> InsertResult:
        """Move ownership: pages the cache took leave the session; duplicates and
        an unused snapshot are freed by the store, which knows who holds them."""
        session.pages.difference_update(pages)
        self.pages.free(inserted.duplicate_pages)
        taken = snapshot_slot is not None and inserted.unused_snapshot is None
        if snapshot_slot is not None:
            session.slots.discard(snapshot_slot)
            if inserted.unused_snapshot is not None:
                self.slots.free([inserted.unused_snapshot])
        if inserted.num_tokens == 0:
            return InsertResult(0, 0, (), 0, 0, False, False)
        node_id = self._nodes.id_of(inserted.node)
        if lock:
            self.cache.lock(inserted.node)
            session.locks[node_id] += 1
        return InsertResult(node_id, inserted.num_tokens, _path_pages(inserted.node),
                            inserted.new_pages, len(inserted.duplicate_pages), taken, lock)

    # -------------------------------------------------------- lock/unlock

    def lock(self, session_id: str, node_ids: Sequence[int]) -> None:
        session = self._session(session_id)
        nodes = [self._live_node(i) for i in node_ids]
        for node_id, node in zip(node_ids, nodes):
            self.cache.lock(node)
            session.locks[node_id] += 1

    def unlock(self, session_id: str, node_ids: Sequence[int]) -> None:
        session = self._session(session_id)
        wanted = Counter(node_ids)
        for node_id, count in wanted.items():
            if session.locks[node_id] < count:
                held = session.locks[node_id]
                raise FailedPrecondition(f"node {node_id} is locked {held} times by this session; "
                                         f"cannot unlock it {count} times")
        for node_id, count in wanted.items():
            node = self._nodes.get(node_id)
            for _ in range(count):
                self.cache.unlock(node)
            session.locks[node_id] -= count
            if not session.locks[node_id]:
                del session.locks[node_id]

    # ------------------------------------------------------------ release

    def release(self, session_id: str, pages: Sequence[int], slots: Sequence[int]) -> None:
        session = self._session(session_id)
        self._check_held(session.pages, pages, self.pages.num_ids, "page")
        self._check_held(session.slots, slots, self.slots.num_total, "state slot")
        self.pages.free(pages)
        self.slots.free(slots)
        session.pages.difference_update(pages)
        session.slots.difference_update(slots)

    # -------------------------------------------------------------- stats

    def stats(self) -> StoreStats:
        c = self.cache.stats()
        return StoreStats(
            total_pages=self.pages.num_total, free_pages=self.pages.num_free,
            total_slots=self.slots.num_total, free_slots=self.slots.num_free,
            cached_pages=c.cached_pages, evictable_pages=c.evictable_pages,
            locked_pages=c.locked_pages, snapshots=c.snapshots,
            sessions=len(self.sessions),
            held_pages=sum(len(s.pages) for s in self.sessions.values()),
            held_slots=sum(len(s.slots) for s in self.sessions.values()),
            cache_queries=c.queries, cache_hits=c.hits,
            queried_tokens=c.queried_tokens, hit_tokens=c.hit_tokens,
            total_staging=self.pages.staging.num_total, free_staging=self.pages.staging.num_free)

    # ---------------------------------------------------------- validation

    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise FailedPrecondition(f"unknown session {session_id!r}: it ended (its stream "
                                     "closed) or never existed; Attach again")
        return session

    def _check_tokens(self, tokens: Sequence[int]) -> np.ndarray:
        """The ids as an array (the server hands over a uint32 view of the
        request's bytes, which stays one), checked against the vocabulary."""
        tokens = np.asarray(tokens)
        bad = first_outside_vocabulary(tokens, self.vocab_size)
        if bad is not None:
            raise InvalidArgument(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return tokens

    @staticmethod
    def _check_ids(ids: Sequence[int], total: int, kind: str) -> None:
        bad = next((i for i in ids if not 0 <= i < total), None)
        if bad is not None:
            raise InvalidArgument(f"{kind} id {bad} is out of range [0, {total})")
        if len(set(ids)) != len(ids):
            raise InvalidArgument(f"a {kind} id is listed twice")

    def _check_held(self, held: set[int], ids: Sequence[int], total: int, kind: str) -> None:
        self._check_ids(ids, total, kind)
        missing = next((i for i in ids if i not in held), None)
        if missing is not None:
            raise FailedPrecondition(f"{kind} {missing} is not held by this session; release "
                                     "only ids you allocated and still hold")

    def _live_node(self, node_id: int) -> CacheNode:
        node = self._nodes.get(node_id)
        if node is None:
            raise InvalidArgument(f"node id {node_id} was never handed out")
        if not node.alive:
            raise FailedPrecondition(f"node {node_id} was evicted: Match again")
        return node


class _NodeHandles:
    """Integer handles for radix nodes, as the RPC carries them. Ids start at 1
    (0 means "no node") and are never reused; dead nodes are dropped now and
    then, so the map stays about the size of the tree."""

    def __init__(self) -> None:
        self._by_id: dict[int, CacheNode] = {}
        self._by_node: dict[int, int] = {}  # id(node) -> handle; nodes are kept alive by _by_id
        self._next = 1
        self._prune_at = 1024

    def id_of(self, node: CacheNode) -> int:
        handle = self._by_node.get(id(node))
        if handle is None:
            handle, self._next = self._next, self._next + 1
            self._by_id[handle] = node
            self._by_node[id(node)] = handle
            self._maybe_prune()
        return handle

    def get(self, handle: int) -> CacheNode | None:
        node = self._by_id.get(handle)
        if node is None and 0 < handle < self._next:
            return _EVICTED  # pruned: it was evicted
        return node

    def _maybe_prune(self) -> None:
        if len(self._by_id) < self._prune_at:
            return
        # A locked node is never evicted, so no dead node is locked by anyone.
        for handle, node in list(self._by_id.items()):
            if not node.alive:
                del self._by_id[handle]
                del self._by_node[id(node)]
        self._prune_at = max(1024, 2 * len(self._by_id))


def _path_pages(node: CacheNode) -> tuple[int, ...]:
    """The pages from the namespace root down to `node`'s end, in order."""
    chunks = []
    while node is not None and node.pages:
        chunks.append(node.pages)
        node = node.parent
    return tuple(p for chunk in reversed(chunks) for p in chunk)


def _check_count(n: int, what: str, total: int) -> None:
    if n < 0:
        raise InvalidArgument(f"cannot allocate {n} {what}: counts are >= 0")
    if n > total:
        raise InvalidArgument(f"cannot allocate {n} {what}: the store has {total} in all")


# A stand-in for pruned (evicted) nodes: never alive.
_EVICTED = CacheNode("", (), [], None, 0, 0)
_EVICTED.alive = False
