"""The store's control state without processes or gRPC: ownership moves
between sessions and the prefix cache, bad requests change nothing, and a
closed session gives everything back. Exact ids: allocators hand out lowest
first."""
import pytest

from kvstore.control import (FailedPrecondition, InvalidArgument, ResourceExhausted,
                             StoreControl)

PAGE = 4


def _control(pages=16, slots=4, hybrid=True):
    return StoreControl(pages, slots, PAGE, hybrid, vocab_size=1000, namespace_prefix="m|rk4")


def _conserved(c: StoreControl) -> None:
    s = c.stats()
    assert s.free_pages + s.held_pages + s.cached_pages == s.total_pages
    assert s.free_slots + s.held_slots + s.snapshots == s.total_slots
    c.cache.check_invariants()


def _snapshot(c: StoreControl):
    return (c.stats(), {sid: (set(s.pages), set(s.slots), dict(s.locks))
                        for sid, s in c.sessions.items()})


def test_insert_moves_ownership_and_match_locks_for_the_session():
    c = _control()
    a = c.open_session("writer")
    got = c.allocate(a.id, 3, 2)
    assert got.pages == (0, 1, 2) and got.slots == (0, 1)
    ins = c.insert(a.id, "", list(range(1, 11)), got.pages[:2], snapshot_slot=1, lock=False)
    assert (ins.num_tokens, ins.pages, ins.new_pages, ins.snapshot_taken) == (8, (0, 1), 2, True)
    assert a.pages == {2} and a.slots == {0}
    b = c.open_session("reader")
    m = c.match(b.id, "", list(range(1, 13)), lock=True)
    assert (m.num_tokens, m.pages, m.snapshot_slot, m.locked) == (8, (0, 1), 1, True)
    assert c.stats().locked_pages == 2
    assert c.match(b.id, "other tenant", list(range(1, 13)), lock=False).num_tokens == 0
    c.close_session(b.id)
    assert c.stats().locked_pages == 0 and c.stats().evictable_pages == 2
    _conserved(c)


def test_duplicate_pages_are_freed_by_the_store():
    c = _control()
    a, b = c.open_session(), c.open_session()
    pa, pb = c.allocate(a.id, 2, 1), c.allocate(b.id, 2, 1)
    c.insert(a.id, "", list(range(8)), pa.pages, pa.slots[0], lock=False)
    ins = c.insert(b.id, "", list(range(8)), pb.pages, pb.slots[0], lock=True)
    assert ins.pages == pa.pages and ins.freed_duplicate_pages == 2
    assert not ins.snapshot_taken and b.pages == set() and b.slots == set()
    assert c.stats().free_pages == 16 - 2 and c.stats().free_slots == 4 - 1
    _conserved(c)


def test_allocate_evicts_unlocked_entries_then_refuses():
    c = _control(pages=4, slots=2)
    a = c.open_session()
    got = c.allocate(a.id, 4, 2)
    c.insert(a.id, "", list(range(8)), got.pages[:2], got.slots[1], lock=True)
    c.release(a.id, got.pages[2:], [])
    with pytest.raises(ResourceExhausted, match="2 pages and 0 slots are free"):
        c.allocate(a.id, 3, 0)  # 2 free, 2 locked
    assert c.stats().free_pages == 2
    c.unlock(a.id, [1])
    assert c.allocate(a.id, 3, 1).pages == (0, 1, 2)  # evicted the prefix and its snapshot
    assert c.stats().cached_pages == 0
    _conserved(c)


BAD_REQUESTS = [
    (lambda c, s: c.allocate("nobody", 1, 0), FailedPrecondition, "unknown session"),
    (lambda c, s: c.allocate(s, -1, 0), InvalidArgument, "counts are >= 0"),
    (lambda c, s: c.allocate(s, 99, 0), InvalidArgument, "16 in all"),
    (lambda c, s: c.release(s, [99], []), InvalidArgument, "out of range"),
    (lambda c, s: c.release(s, [5], []), FailedPrecondition, "not held by this session"),
    (lambda c, s: c.release(s, [0, 0], []), InvalidArgument, "listed twice"),
    (lambda c, s: c.insert(s, "", list(range(8)), [0], None, False), InvalidArgument,
     "fill 2 whole pages"),
    (lambda c, s: c.insert(s, "", list(range(8)), [0, 9], None, False), FailedPrecondition,
     "page 9 is free"),
    (lambda c, s: c.insert(s, "", list(range(8)), [0, 1], 3, False), FailedPrecondition,
     "state slot 3 is not held"),
    (lambda c, s: c.insert(s, "", [0, 1, 2, 3000], [0], None, False), InvalidArgument,
     "outside the vocabulary"),
    (lambda c, s: c.match(s, "", [-1], False), InvalidArgument, "outside the vocabulary"),
    (lambda c, s: c.lock(s, [0]), InvalidArgument, "never handed out"),
    (lambda c, s: c.unlock(s, [1]), FailedPrecondition, "locked 0 times"),
]


@pytest.mark.parametrize("request_, error, message", BAD_REQUESTS)
def test_bad_requests_change_nothing(request_, error, message):
    c = _control()
    s = c.open_session()
    got = c.allocate(s.id, 2, 1)
    c.insert(s.id, "", list(range(100, 104)), [got.pages[1]], None, lock=False)  # node 1
    other = c.open_session()
    c.allocate(other.id, 1, 0)  # page 2: held by someone else
    before = _snapshot(c)
    with pytest.raises(error, match=message):
        request_(c, s.id)
    assert _snapshot(c) == before
    _conserved(c)


def test_page_held_by_another_session_cannot_be_inserted():
    c = _control()
    a, b = c.open_session(), c.open_session()
    c.allocate(a.id, 1, 0)
    with pytest.raises(FailedPrecondition, match="held by another session"):
        c.insert(b.id, "", list(range(4)), [0], None, False)


def test_closing_a_session_returns_pages_slots_and_locks():
    c = _control()
    s = c.open_session()
    got = c.allocate(s.id, 5, 2)
    c.insert(s.id, "", list(range(8)), got.pages[:2], got.slots[0], lock=True)
    c.lock(s.id, [1, 1])
    c.close_session(s.id)
    st = c.stats()
    assert (st.sessions, st.held_pages, st.held_slots, st.locked_pages) == (0, 0, 0, 0)
    assert st.free_pages == 14 and st.evictable_pages == 2
    c.close_session(s.id)  # idempotent
    with pytest.raises(FailedPrecondition, match="unknown session"):
        c.allocate(s.id, 1, 0)
    _conserved(c)


def test_dense_models_have_no_slots_or_snapshots():
    c = _control(slots=0, hybrid=False)
    s = c.open_session()
    with pytest.raises(InvalidArgument, match="no GDN layers"):
        c.allocate(s.id, 1, 1)
    got = c.allocate(s.id, 2, 0)
    with pytest.raises(InvalidArgument, match="no GDN layers"):
        c.insert(s.id, "", list(range(8)), got.pages, 0, False)
    ins = c.insert(s.id, "", list(range(8)), got.pages, None, True)
    assert c.match(s.id, "", list(range(9)), False).pages == ins.pages


def test_evicted_node_ids_fail_with_a_precondition():
    c = _control(pages=2, slots=1)
    s = c.open_session()
    got = c.allocate(s.id, 2, 1)
    ins = c.insert(s.id, "", list(range(8)), got.pages, got.slots[0], False)
    c.allocate(s.id, 2, 0)  # evicts the unlocked prefix
    with pytest.raises(FailedPrecondition, match="evicted"):
        c.lock(s.id, [ins.node_id])


def test_staging_pages_are_held_cached_and_shared_like_pages():
    """rk4p: a request takes its sink page and open pages from the staging
    pool; the sink goes to the cache with the prompt's pages, is shared by
    the next prompt with the same first page, and the pool refills by
    evicting cached sinks (with their subtrees) when short."""
    c = StoreControl(8, 0, PAGE, False, vocab_size=1000, namespace_prefix="m|rk4p",
                     staging_pages=4)
    a = c.open_session("router")
    got = c.allocate(a.id, 2, 0, 3)
    assert got.pages == (0, 1) and got.staging == (8, 9, 10)
    sink, open_pages = got.staging[0], got.staging[1:]
    ins = c.insert(a.id, "", list(range(12)), [sink, *got.pages], None, lock=False)
    assert ins.pages == (8, 0, 1) and a.pages == set(open_pages)
    c.release(a.id, open_pages, [])
    assert c.stats().free_staging == 3 and c.stats().total_staging == 4
    m = c.match(a.id, "", list(range(4)) + [900] * 5, lock=True)
    assert m.pages == (sink,)  # another prompt, same first page: the same bf16 sink
    with pytest.raises(ResourceExhausted, match=r"4 staging pages \(3 free\)"):
        c.allocate(a.id, 0, 0, 4)  # the cached sink is locked
    _conserved_staging(c)
    c.unlock(a.id, [m.node_id])
    assert c.allocate(a.id, 0, 0, 4).staging == (8, 9, 10, 11)  # the cached sink was evicted
    assert c.stats().cached_pages == 0 and c.match(a.id, "", list(range(12)), False).num_tokens == 0
    _conserved_staging(c)
    plain = _control()
    with pytest.raises(InvalidArgument, match="no staging pages"):
        plain.allocate(plain.open_session().id, 1, 0, 1)


def _conserved_staging(c: StoreControl) -> None:
    s = c.stats()
    assert s.free_pages + s.free_staging + s.held_pages + s.cached_pages == \
        s.total_pages + s.total_staging
    c.cache.check_invariants()


DEEP = 3000  # turns of one conversation: three times Python's default recursion limit


def deep_conversation(c: StoreControl, session_id: str) -> list[int]:
    """One agent conversation of DEEP turns of a page each, cached under the
    store's one staging sink page: the prefix cache holds a chain of DEEP
    nodes. Built as the last turn's insert, then a match per earlier turn
    (each splits the node where the turn ended), so it costs O(DEEP), not
    the O(DEEP**2) of replaying the turns; the tree is the same. Returns the
    conversation's tokens."""
    tokens = [t % 1000 for t in range(DEEP * PAGE + 1)]
    got = c.allocate(session_id, DEEP - 1, 0, 1)
    c.insert(session_id, "", tokens[:-1], [*got.staging, *got.pages], None, lock=False)
    for turn in range(DEEP - 1, 0, -1):
        c.match(session_id, "", tokens[:turn * PAGE + 1], lock=False)
    assert c.cache.stats().nodes == DEEP
    return tokens


def test_a_conversation_thousands_of_turns_deep_gives_its_sink_page_back():
    """rk4p: every prefix starts with a staging (sink) page. A new request
    that needs one while the only one is cached evicts the conversation
    holding it, a chain DEEP nodes deep: that raised RecursionError on every
    such Allocate, and the store never handed out a sink page again."""
    c = StoreControl(DEEP + 4, 0, PAGE, False, vocab_size=1000, namespace_prefix="m|rk4p",
                     staging_pages=1)
    tokens = deep_conversation(c, c.open_session("router").id)
    other = c.open_session("router-2")
    m = c.match(other.id, "", tokens, lock=True)
    assert m.num_tokens == DEEP * PAGE
    with pytest.raises(ResourceExhausted, match=r"1 staging pages \(0 free\)"):
        c.allocate(other.id, 1, 0, 1)  # locked: its sink stays
    c.unlock(other.id, [m.node_id])
    got = c.allocate(other.id, 1, 0, 1)
    assert got.staging == (DEEP + 4,) and got.pages == (0,)
    s = c.stats()
    assert s.cached_pages == 0 and s.free_pages == DEEP + 3 and s.free_staging == 0
    _conserved_staging(c)
