"""The prefill worker's job: restoring a snapshot and prefilling only the
suffix gives the same first token and the same state as prefilling it all."""
import pytest
import torch

from engine.cache import CacheShape, PagedKVCache
from engine.errors import InvalidRequestError
from engine.kv import make_format
from engine.loader import load_model
from engine.sampling import SamplingParams
from prefill.runner import PrefillJob, run_prefill

PAGE = 4
GREEDY = SamplingParams(temperature=0.0, logprobs=2)


def _cache(loaded):
    return PagedKVCache(loaded.config, CacheShape(40, PAGE, 8), "cpu", make_format("bf16", dtype=torch.float32))


def test_restored_suffix_prefill_equals_full_prefill():
    loaded = load_model("tiny-qwen3.5", seed=6)
    tokens = tuple((11 * i + 2) % 512 for i in range(30))
    cache = _cache(loaded)
    full = run_prefill(loaded.model, cache, PrefillJob("a", tokens, 0, tuple(range(8)), 0,
                                                       snapshots=((16, 5), (28, 6)), params=GREEDY), 7)
    # a second request: same first 16 tokens from pages 0..3 and snapshot slot 5
    resumed = run_prefill(loaded.model, cache, PrefillJob("b", tokens, 16, tuple(range(4)) + tuple(range(20, 24)),
                                                          1, restore_slot=5, params=GREEDY), 5)
    assert resumed.token_ids == full.token_ids
    assert resumed.logprobs[0] == pytest.approx(full.logprobs[0], abs=1e-4)
    for layer in loaded.config.linear_layers:
        torch.testing.assert_close(cache.recurrent_state(layer)[1], cache.recurrent_state(layer)[0],
                                   rtol=1e-4, atol=1e-5)


def test_bad_jobs_are_rejected_with_a_reason():
    loaded = load_model("tiny-llama")
    cache = _cache(loaded)
    cases = [
        (PrefillJob("x", (1, 2, 3), 3, (0,), -1), "start"),
        (PrefillJob("x", tuple(range(9)), 0, (0, 1), -1), "pages cannot hold"),
        (PrefillJob("x", tuple(range(9)), 0, (0, 1, 2), -1, snapshots=((6, 1),)), "page boundary"),
        (PrefillJob("x", (1, 99999), 0, (0,), -1), "vocabulary"),
    ]
    for job, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            run_prefill(loaded.model, cache, job, 8)


def test_snapshot_points_are_one_slot_each():
    """Two slots for one token count merged into one (the router then cached
    the other slot, which never got the state, as a snapshot)."""
    loaded = load_model("tiny-qwen3.5", seed=6)
    cache = _cache(loaded)
    tokens = tuple(range(1, 20))
    cases = [
        (((8, 1), (8, 2)), "two snapshots at 8 tokens"),
        (((8, 1), (16, 1)), "state slot 1 is the slot of two snapshot points"),
        (((8, 0),), "snapshot slot 0 is the job's live state slot"),
    ]
    for snapshots, message in cases:
        job = PrefillJob("x", tokens, 0, tuple(range(5)), 0, snapshots=snapshots, params=GREEDY)
        with pytest.raises(InvalidRequestError, match=message):
            run_prefill(loaded.model, cache, job, 8)
    # the restored slot is read once, before the first chunk: it may take a
    # later snapshot (the warm-up's jobs do)
    restoring = PrefillJob("x", tokens, 8, tuple(range(5)), 0, restore_slot=3,
                           snapshots=((16, 3),))
    restoring.check(cache.page_size, loaded.config.vocab_size)
    restoring.check_ids(cache)


def test_ids_outside_the_pools_are_rejected_naming_the_id_and_the_pool():
    """The kernels index the pools unchecked: on a GPU a bad id writes another
    allocation's memory, and a slot of -1 is the last slot, another request's."""
    loaded = load_model("tiny-qwen3.5", seed=6)
    cache = _cache(loaded)  # 40 pages, 8 slots
    tokens = tuple(range(1, 10))
    cases = [
        (dict(pages=(0, 1, 40)), r"page id 40 is outside the store's 40 page ids \[0, 40\)"),
        (dict(state_slot=8), r"state_slot 8 is outside the store's 8 GDN state slots \[0, 8\)$"),
        (dict(state_slot=-1), "state_slot -1 is outside"),  # a hybrid request needs its slot
        (dict(restore_slot=-2, start=4), r"restore_slot -2 .* \[0, 8\) or -1 \(none\)"),
        (dict(snapshots=((8, 9),)), "snapshot slot 9 is outside the store's 8"),
    ]
    for fields, message in cases:
        job = PrefillJob(**{**dict(request_id="x", tokens=tokens, start=0, pages=(0, 1, 2),
                                   state_slot=0), **fields})
        with pytest.raises(InvalidRequestError, match=message):
            run_prefill(loaded.model, cache, job, 8)
    # a dense model keeps no state slots and never reads the slot fields:
    # their proto defaults (0) pass, its page ids are still checked
    dense = load_model("tiny-llama")
    PrefillJob("x", tokens, 0, (0, 1, 2), 0, restore_slot=0).check_ids(_cache(dense))
    with pytest.raises(InvalidRequestError, match="page id 40 is outside"):
        PrefillJob("x", tokens, 0, (0, 1, 40), 0).check_ids(_cache(dense))


def test_the_worker_refuses_a_bad_id_as_invalid_argument():
    """At the RPC edge, before the job waits for the worker's thread."""
    import asyncio
    import types

    import grpc

    from prefill.server import PrefillService
    from tandem.internal.v1 import workers_pb2 as wpb
    from tandem.wire import pack_token_ids

    class Aborted(Exception):
        pass

    class Context:
        async def abort(self, code, details):
            raise Aborted(code, details)

    loaded = load_model("tiny-qwen3.5", seed=6)
    service = PrefillService(types.SimpleNamespace(cache=_cache(loaded)), chunk=8)
    try:
        for fields, message in ((dict(pages=[0, 1, 1000], state_slot=0), "page id 1000"),
                                (dict(pages=[0, 1, 2], state_slot=12), "state_slot 12")):
            request = wpb.PrefillRequest(request_id="bad", tokens_le32=pack_token_ids(range(1, 10)),
                                         start=0, restore_slot=-1, **fields,
                                         sampling=wpb.Sampling(top_p=1.0, repetition_penalty=1.0))
            with pytest.raises(Aborted) as err:
                asyncio.run(service.Prefill(request, Context()))
            code, details = err.value.args
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert message in details and "the store's" in details
            assert not service.work  # never accepted
    finally:
        service.gpu.shutdown()


def test_a_worker_runs_the_stores_planned_chunk_or_a_smaller_one_asked():
    """The store's plan sized prefill activations for its chunk: a worker runs
    that one by default, a smaller one when asked, never a larger one (the
    refusal at start, through real processes: tests/test_kvstore_process.py)."""
    from engine.errors import TandemError
    from prefill.server import chunk_for

    assert chunk_for(0, 2048) == 2048
    assert chunk_for(512, 2048) == 512
    assert chunk_for(2048, 2048) == 2048
    with pytest.raises(TandemError, match="--chunk 4096 is larger than the 2048-token"):
        chunk_for(4096, 2048)
    with pytest.raises(TandemError, match="--chunk must be a number of tokens >= 1"):
        chunk_for(-1, 2048)
