"""The router's give-back of a request's store holdings survives the
request's cancellation at any await (the contract: cancelled requests give
back every page they held). A store stand-in that only records calls stands
in for the kvstore's client here: what is under test is the router's
ordering of awaits, which the service tests hit only by timing (CI saw a
disaggregated prefill store keep one page and one slot, 2026-12-03)."""
import asyncio
import threading
import time

import pytest

from router.server import Held, Router


class _SlowUnlockStore:
    """Records unlock and release calls; unlock takes long enough for the
    caller to be cancelled while it runs in its thread."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.unlocking = threading.Event()

    def unlock(self, nodes):
        self.unlocking.set()
        time.sleep(0.2)
        self.calls.append(("unlock", list(nodes)))

    def release(self, pages, slots):
        self.calls.append(("release", list(pages), list(slots)))


class _RouterParts:
    """The router's give-back methods on their own (no store of its own, so
    no usage metric to update)."""
    store = None
    _release = Router._release
    _return_to_store = Router._return_to_store
    _each_or_all = staticmethod(Router._each_or_all)


def test_a_release_cancelled_during_the_unlock_still_frees_pages_and_slots():
    store = _SlowUnlockStore()
    held = Held(pages=[3, 4], slots=[7], nodes=[11])

    async def cancel_mid_unlock() -> None:
        task = asyncio.ensure_future(_RouterParts()._release(held, store))
        while not store.unlocking.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):  # the shielded store calls finish on their own
            if len(store.calls) == 2:
                break
            await asyncio.sleep(0.01)

    asyncio.run(cancel_mid_unlock())
    assert store.calls == [("unlock", [11]), ("release", [3, 4], [7])]
    assert (held.pages, held.slots, held.nodes) == ([], [], [])  # never given back twice
