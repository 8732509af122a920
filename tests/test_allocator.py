"""PageAllocator / SlotAllocator: exact ids, all-or-nothing, errors never corrupt state."""
import pytest

from engine.errors import TandemError
from kvstore.allocator import OutOfCapacity, OutOfPages, OutOfSlots, PageAllocator, SlotAllocator


def snapshot(a):
    return a.num_free, [a.is_free(i) for i in range(a.num_total)]


def test_allocates_lowest_ids_first():
    a = PageAllocator(8)
    assert a.allocate(3) == [0, 1, 2]
    assert a.allocate(2) == [3, 4]
    a.free([1, 3])
    assert a.allocate(1) == [1]
    assert a.allocate(3) == [3, 5, 6]
    assert a.num_free == 1 and a.num_total == 8 and a.num_used == 7


def test_free_order_does_not_matter():
    a = PageAllocator(6)
    a.allocate(6)
    a.free([5, 2, 4])
    assert a.allocate(3) == [2, 4, 5]


def test_allocate_zero_and_can_allocate():
    a = PageAllocator(2)
    assert a.allocate(0) == []
    assert a.can_allocate(2) and not a.can_allocate(3) and a.can_allocate(0)
    assert not a.can_allocate(-1)
    a.allocate(2)
    assert not a.can_allocate(1) and a.can_allocate(0)


def test_all_or_nothing():
    a = PageAllocator(4)
    a.allocate(2)
    before = snapshot(a)
    with pytest.raises(OutOfPages) as err:
        a.allocate(3)
    assert "only 2 of 4" in str(err.value)
    assert isinstance(err.value, TandemError)
    assert snapshot(a) == before
    assert a.allocate(2) == [2, 3]


@pytest.mark.parametrize("bad", [-1, 1.0, True, "1"])
def test_allocate_rejects_bad_counts(bad):
    a = PageAllocator(4)
    with pytest.raises(ValueError):
        a.allocate(bad)
    assert a.num_free == 4


def test_double_free_leaves_state_unchanged():
    a = PageAllocator(5)
    a.allocate(3)
    a.free([1])
    before = snapshot(a)
    with pytest.raises(ValueError, match="double free"):
        a.free([0, 1])  # 0 is in use, 1 is already free: neither may be freed
    assert snapshot(a) == before
    with pytest.raises(ValueError, match="listed twice"):
        a.free([2, 2])
    assert snapshot(a) == before
    assert a.allocate(2) == [1, 3]


@pytest.mark.parametrize("bad", [-1, 5, 100, True, 1.5, None])
def test_out_of_range_free_leaves_state_unchanged(bad):
    a = PageAllocator(5)
    a.allocate(5)
    before = snapshot(a)
    with pytest.raises(ValueError, match="out of range"):
        a.free([0, bad])
    assert snapshot(a) == before
    with pytest.raises(ValueError):
        a.is_free(bad)


def test_free_accepts_any_iterable():
    a = PageAllocator(3)
    a.allocate(3)
    a.free(i for i in (2, 0))
    assert a.allocate(2) == [0, 2]


def test_empty_pool_and_bad_size():
    a = PageAllocator(0)
    assert a.allocate(0) == [] and a.num_free == 0
    with pytest.raises(OutOfPages):
        a.allocate(1)
    with pytest.raises(ValueError):
        PageAllocator(-1)


def test_slot_allocator_same_contract():
    s = SlotAllocator(3)
    assert s.allocate(2) == [0, 1]
    with pytest.raises(OutOfSlots):
        s.allocate(2)
    assert s.num_free == 1
    s.free([0])
    with pytest.raises(ValueError, match="double free"):
        s.free([0])
    assert s.allocate(2) == [0, 2]
    assert not issubclass(OutOfSlots, OutOfPages) and issubclass(OutOfSlots, TandemError)


def test_staging_pages_continue_the_page_ids_and_free_with_them():
    a = PageAllocator(4, staging_pages=3)
    assert a.num_ids == 7 and a.num_total == 4 and a.staging.num_total == 3
    assert a.allocate(2) == [0, 1] and a.staging.allocate(2) == [4, 5]
    assert a.is_staging(4) and not a.is_staging(3) and not a.is_free(5) and a.is_free(6)
    assert a.num_free == 2 and a.staging.num_free == 1  # the counts stay per kind
    before = snapshot(a), a.staging.num_free
    with pytest.raises(ValueError, match="already free"):
        a.free([0, 4, 6])  # 6 is a free staging page: nothing is freed
    with pytest.raises(ValueError, match="out of range"):
        a.free([1, 7])
    assert (snapshot(a), a.staging.num_free) == before
    a.free([5, 0, 4])
    assert a.num_free == 3 and a.staging.num_free == 3
    with pytest.raises(OutOfCapacity):
        a.staging.allocate(4)


def test_first_free_is_the_first_free_id_in_the_callers_order():
    """PageAllocator.first_free (the vectorized check an insert of thousands
    of pages makes) agrees with is_free id by id, staging pages included,
    and rejects an id out of range as is_free does."""
    import random

    from kvstore.allocator import PageAllocator

    pages = PageAllocator(40, staging_pages=8)
    taken = pages.allocate(30) + pages.staging.allocate(5)
    pages.free(taken[3:30:4] + taken[31:32])
    rng = random.Random(3)
    for _ in range(50):
        ids = rng.sample(range(48), rng.randrange(0, 20))
        expected = next((i for i in ids if pages.is_free(i)), None)
        assert pages.first_free(ids) == expected
        assert pages.staging.first_free([i for i in ids if i >= 40]) == \
            next((i for i in ids if i >= 40 and pages.is_free(i)), None)
    assert pages.first_free([0, 1]) is None and pages.first_free([]) is None
    for bad in ([0, 48], [-1], [0, True]):
        with pytest.raises(ValueError, match="out of range"):
            pages.first_free(bad)
