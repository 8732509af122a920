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
