"""The decode worker's warm-up (decode/warmup.py) against a real store
process: one short request prefilled on scratch pages and decoded through the
worker's own scheduler (speculating when the store laid out a drafter), every
page and slot given back, also when a step fails."""
from __future__ import annotations

import pytest

from decode import warmup
from decode.scheduler import DecodeScheduler
from decode.server import ReservedPagesOnly
from kvstore.client import StoreClient
from tests.test_kvstore_process import StoreProcess, _conserved
from tests.test_prefill_warmup import _held

STORES = {
    "int8": ("--kv-format", "int8"),
    "rk4p": ("--kv-format", "rk4p", "--page-size", "32"),
    "int8-mtp": ("--kv-format", "int8", "--speculative", "mtp", "--draft-tokens", "3"),
}


@pytest.fixture(scope="module", params=sorted(STORES))
def store(request, tmp_path_factory):
    proc = StoreProcess(tmp_path_factory.mktemp(f"decode-warmup-{request.param}"),
                        "--model", "tiny-qwen3.5", *STORES[request.param],
                        "--max-context-tokens", "1024", "--live-slots", "2",
                        "--snapshot-slots", "2").wait_serving()
    yield proc
    assert proc.terminate() == 0


def _scheduler(client: StoreClient) -> DecodeScheduler:
    return DecodeScheduler(client.model, client.cache, ReservedPagesOnly(), max_batch=4,
                           cuda_graphs=False, speculative=client.info.speculative)


def test_the_warm_up_decodes_a_request_and_gives_everything_back(store):
    with StoreClient.connect(store.socket, "decode-warm-up") as client:
        scheduler = _scheduler(client)
        before = client.stats()
        done = warmup.warm_up(client, scheduler)
        after = client.stats()
        spec = client.info.speculative
    assert done.seconds > 0 and done.tokens >= warmup.WARM_UP_TOKENS
    assert not scheduler.has_work
    assert (done.drafted > 0) == spec.enabled  # the drafter and verify ran when laid out
    if spec.enabled:  # and one verify step checked all k drafts (its GEMV widths compiled)
        assert done.drafted >= spec.num_draft_tokens and done.tokens >= spec.num_draft_tokens + 3
    _conserved(after)
    assert _held(after) == _held(before)


def test_a_failed_warm_up_gives_back_its_pages_and_slots(store, monkeypatch):
    with StoreClient.connect(store.socket, "decode-warm-up") as client:
        scheduler = _scheduler(client)

        def failing():
            raise RuntimeError("CUDA error: out of memory (made up)")

        monkeypatch.setattr(scheduler, "step", failing)
        before = client.stats()
        with pytest.raises(RuntimeError, match="made up"):
            warmup.warm_up(client, scheduler)
        after = client.stats()
    assert not scheduler.has_work
    _conserved(after)
    assert _held(after) == _held(before)


def test_the_warm_up_waits_for_capacity_another_session_gives_back(store):
    """The prefill worker's warm-up starts beside this one and may hold what a
    small store has for a few seconds: the decode warm-up waits for it."""
    import threading
    import time

    with StoreClient.connect(store.socket, "prefill-warm-up") as other, \
            StoreClient.connect(store.socket, "decode-warm-up") as client:
        free = other.stats().free_slots
        held = other.allocate(0, free, 0) if free else None
        timer = threading.Timer(1.0, lambda: held and other.release((), held.slots))
        timer.start()
        try:
            started = time.monotonic()
            done = warmup.warm_up(client, _scheduler(client))
            waited = time.monotonic() - started
        finally:
            timer.join()
        after = client.stats()
    assert done.tokens >= warmup.WARM_UP_TOKENS
    assert waited >= 1.0 or not client.info.config.is_hybrid
    _conserved(after)
