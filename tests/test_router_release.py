"""The router's give-back of a request's store holdings survives the
request's cancellation at any await (the contract: cancelled requests give
back every page they held). A store stand-in that only records calls stands
in for the kvstore's client here: what is under test is the router's
ordering of awaits, which the service tests hit only by timing (CI saw a
disaggregated prefill store keep one page and one slot, 2026-12-03)."""
import asyncio
import threading
import time

import grpc
import pytest

from router.server import Held, Router, Running


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


class _Worker:
    """A worker stub whose Abort fails with `failures` (status codes) in turn,
    then stops the request."""

    def __init__(self, *failures) -> None:
        self.failures = list(failures)
        self.aborts = 0

    async def Abort(self, request, timeout):
        self.aborts += 1
        if self.failures:
            raise grpc.aio.AioRpcError(self.failures.pop(0), grpc.aio.Metadata(),
                                       grpc.aio.Metadata())


class _StoppingRouterParts(_RouterParts):
    """_RouterParts with the worker-stopping half of the give-back."""
    prefill = decode = None
    _give_back = Router._give_back
    _stop_worker = Router._stop_worker
    _release_all = Router._release_all
    _release_once_stopped = Router._release_once_stopped

    def __init__(self) -> None:
        from router.metrics import RouterMetrics

        self.stopping = set()
        self.metrics = RouterMetrics(gpu=False)

    def awaiting(self) -> float:
        return self.metrics.registry.get_sample_value("tandem_requests_awaiting_worker_stop")


@pytest.mark.parametrize("failure, held_until_stopped", [
    (grpc.StatusCode.DEADLINE_EXCEEDED, True),  # busy past the timeout: may still write
    (grpc.StatusCode.UNAVAILABLE, False)])  # dead: writes nothing any more
def test_pages_go_back_only_once_the_worker_has_stopped_the_request(monkeypatch, failure,
                                                                   held_until_stopped):
    """A worker that does not confirm the stop in time may still be writing the
    request's pages: they stay held (the call returns at once) and go back when
    a later Abort succeeds; a dead worker's go back at once."""
    import router.server

    monkeypatch.setattr(router.server, "STOP_RETRY_S", 0.05)
    store, worker = _SlowUnlockStore(), _Worker(failure)
    parts = _StoppingRouterParts()
    handle = Running("r1", busy_in="prefill", prefill_stub=worker, decode_store=store)

    async def give_back() -> tuple[list, float]:
        await parts._give_back(Held(pages=[3, 4], slots=[7]), handle)
        right_after = list(store.calls)
        await asyncio.sleep(0)  # the background task starts
        awaiting = parts.awaiting()
        for _ in range(100):
            if store.calls:
                break
            await asyncio.sleep(0.01)
        return right_after, awaiting

    right_after, awaiting = asyncio.run(give_back())
    assert right_after == ([] if held_until_stopped else [("release", [3, 4], [7])])
    assert awaiting == (1 if held_until_stopped else 0) and parts.awaiting() == 0
    assert store.calls == [("release", [3, 4], [7])]
    assert worker.aborts == (2 if held_until_stopped else 1) and not parts.stopping


def test_an_abort_nobody_asked_for_is_a_failure():
    """decode's finish ABORT after a failed step (the router did not ask) must
    reach the client as an error status with the worker's reason; one the
    client asked for is a plain finish."""
    from router.server import decode_finish
    from tandem.internal.v1 import workers_pb2 as wpb
    from tandem.v1 import generation_pb2 as pb

    failed = wpb.DecodeFinished(reason=wpb.DECODE_FINISH_ABORT, detail="decode step failed: boom")
    assert decode_finish(failed, asked_to_abort=False) == (pb.FINISH_REASON_ABORT,
                                                           "decode step failed: boom")
    assert decode_finish(failed, asked_to_abort=True) == (pb.FINISH_REASON_ABORT, None)
    silent = wpb.DecodeFinished(reason=wpb.DECODE_FINISH_ABORT)
    assert decode_finish(silent, asked_to_abort=False)[1] == "no reason given"
    for reason, public in ((wpb.DECODE_FINISH_STOP, pb.FINISH_REASON_STOP),
                           (wpb.DECODE_FINISH_LENGTH, pb.FINISH_REASON_LENGTH)):
        assert decode_finish(wpb.DecodeFinished(reason=reason), False) == (public, None)
