"""Free lists for the KV store's fixed pools: KV pages (with, for formats that
quantize whole pages, bf16 staging pages) and GDN state slots.

Pools hand out small integer ids in [first_id, first_id + num_total); staging
pages continue the page ids (num_pages ..), as page tables name them, so one
PageAllocator frees, checks and counts both kinds. The contract is the same
for every pool:

* `allocate(n)` is all-or-nothing: it returns exactly n ids or raises
  (`OutOfPages` / `OutOfSlots`) and changes nothing.
* Ids come out lowest first, so the order is deterministic and tests can
  expect exact ids.
* `free(ids)` checks every id before releasing any: an id out of range, one
  that is already free, or one listed twice raises ValueError and the pool is
  left exactly as it was. A bug in a caller never corrupts the pool.

Pure Python and numpy; no torch. The owner of the actual tensors maps ids
to memory.
"""
from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

import numpy as np

from engine.errors import TandemError


class OutOfCapacity(TandemError):
    """A pool has fewer free ids than asked for; evict or wait, then retry."""


class OutOfPages(OutOfCapacity):
    """Fewer free KV pages than asked for."""


class OutOfSlots(OutOfCapacity):
    """Fewer free GDN state slots than asked for."""


class IdAllocator:
    """Free list of ids 0..num_total-1, handing out the lowest free ids first."""

    kind = "id"
    out_of_capacity: type[OutOfCapacity] = OutOfCapacity

    def __init__(self, num_total: int, first_id: int = 0):
        if isinstance(num_total, bool) or not isinstance(num_total, int) or num_total < 0:
            raise ValueError(f"{self.kind} pool size must be an int >= 0, got {num_total!r}")
        self._num_total = num_total
        self._first = first_id
        # sorted, hence a valid heap
        self._free_heap: list[int] = list(range(first_id, first_id + num_total))
        self._is_free = bytearray(b"\x01") * num_total

    @property
    def num_total(self) -> int:
        return self._num_total

    @property
    def num_free(self) -> int:
        return len(self._free_heap)

    @property
    def num_used(self) -> int:
        return self._num_total - len(self._free_heap)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free_heap)

    def is_free(self, id_: int) -> bool:
        self._check_in_range(id_)
        return bool(self._is_free[id_ - self._first])

    def first_free(self, ids: Sequence[int]) -> int | None:
        """The first of ids that is free, or None; an id out of range raises
        as is_free does. Vectorized: an insert checks thousands of pages."""
        return _first_free(ids, ((self._first, self._num_total, self._is_free),), self)

    def owns(self, id_: int) -> bool:
        """Whether id_ is one of this pool's ids (free or not)."""
        return isinstance(id_, int) and not isinstance(id_, bool) \
            and self._first <= id_ < self._first + self._num_total

    def allocate(self, n: int) -> list[int]:
        """Take n ids, lowest first; raise (taking none) when fewer are free."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"cannot allocate {n!r} {self.kind}s: need an int >= 0")
        if n > len(self._free_heap):
            raise self.out_of_capacity(
                f"asked for {n} {self.kind}s but only {len(self._free_heap)} of "
                f"{self._num_total} are free; evict cached entries or wait for requests to finish"
            )
        ids = [heapq.heappop(self._free_heap) for _ in range(n)]
        for i in ids:
            self._is_free[i - self._first] = 0
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return ids to the pool. Checks all of them first; on error frees none."""
        ids = list(ids)
        self._check_freeable(ids)
        for i in ids:
            self._is_free[i - self._first] = 1
            heapq.heappush(self._free_heap, i)

    def _check_freeable(self, ids: list[int]) -> None:
        seen: set[int] = set()
        for i in ids:
            self._check_in_range(i)
            if self._is_free[i - self._first]:
                raise ValueError(f"double free: {self.kind} {i} is already free")
            if i in seen:
                raise ValueError(f"double free: {self.kind} {i} is listed twice in one free()")
            seen.add(i)

    def _check_in_range(self, id_: int) -> None:
        if not self.owns(id_):
            raise ValueError(f"{self.kind} id {id_!r} is out of range "
                             f"[{self._first}, {self._first + self._num_total})")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(free={self.num_free}/{self.num_total})"


class OutOfStagingPages(OutOfCapacity):
    """Fewer free bf16 staging pages than asked for."""


class StagingAllocator(IdAllocator):
    """Free list of bf16 staging pages, ids num_pages .. num_pages + n - 1."""

    kind = "staging page"
    out_of_capacity = OutOfStagingPages


class PageAllocator(IdAllocator):
    """Free list of fixed-size KV pages (page_size tokens of full-attention KV
    each). `allocate`, `num_free` and `num_total` are about the real pages;
    `staging` hands out staging pages; `free` and `is_free` take either kind."""

    kind = "page"
    out_of_capacity = OutOfPages

    def __init__(self, num_pages: int, staging_pages: int = 0):
        super().__init__(num_pages)
        self.staging = StagingAllocator(staging_pages, first_id=num_pages)

    @property
    def num_ids(self) -> int:
        """Real and staging pages: valid ids are 0 .. num_ids - 1."""
        return self.num_total + self.staging.num_total

    def is_staging(self, id_: int) -> bool:
        return self.staging.owns(id_)

    def is_free(self, id_: int) -> bool:
        if self.staging.owns(id_):
            return self.staging.is_free(id_)
        return super().is_free(id_)

    def first_free(self, ids: Sequence[int]) -> int | None:
        """The first of ids (real or staging pages) that is free, or None."""
        pools = ((self._first, self._num_total, self._is_free),
                 (self.staging._first, self.staging._num_total, self.staging._is_free))
        return _first_free(ids, pools, self)

    def free(self, ids: Iterable[int]) -> None:
        """Return pages of either kind. Checks all of them first; on error frees none."""
        ids = list(ids)
        staged = [i for i in ids if self.staging.owns(i)]
        real = [i for i in ids if not self.staging.owns(i)]
        self._check_freeable(real)
        self.staging._check_freeable(staged)
        super().free(real)
        self.staging.free(staged)


class SlotAllocator(IdAllocator):
    """Free list of GDN recurrent-state slots (one sequence's state per slot)."""

    kind = "state slot"
    out_of_capacity = OutOfSlots

    def __init__(self, num_slots: int):
        super().__init__(num_slots)


def _first_free(ids: Sequence[int], pools, allocator: IdAllocator) -> int | None:
    """The first of ids that some pool (first id, size, free flags) marks free.
    An id no pool owns (or one that is not an int) goes through the
    allocator's own per-id check, which raises."""
    if not ids:
        return None
    if not all(type(i) is int for i in ids):
        return next((i for i in ids if allocator.is_free(i)), None)
    wanted = np.fromiter(ids, dtype=np.int64, count=len(ids))
    free = np.zeros(len(ids), dtype=bool)
    owned = np.zeros(len(ids), dtype=bool)
    for first, total, flags in pools:
        mine = (wanted >= first) & (wanted < first + total)
        free[mine] = np.frombuffer(flags, dtype=np.uint8)[wanted[mine] - first] != 0
        owned |= mine
    if not owned.all():
        allocator.is_free(ids[int(np.argmin(owned))])  # raises: out of range
    hits = np.flatnonzero(free)
    return ids[int(hits[0])] if len(hits) else None
