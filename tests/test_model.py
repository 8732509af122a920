"""The forward agrees with transformers (tiny random models saved as real HF
directories): whole prompts, token by token through pages, chunked prefill,
and mixed-length batches against each sequence alone."""
import random

import pytest
import torch

from engine.batch import ForwardBatch, SequenceInput
from engine.cache import CacheShape, PagedKVCache
from engine.kv import make_format
from engine.loader import load_model

FAMILIES = ["llama", "llama3-scaled", "qwen2", "qwen3", "qwen3_5"]
PAGE = 4


def _reference_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0]


def _cache(loaded, pages=64, slots=8):
    return PagedKVCache(loaded.config, CacheShape(pages, PAGE, slots), "cpu", make_format("bf16", dtype=torch.float32))


def _scattered_pages(n, seed):
    """Non-contiguous, shuffled page ids: the forward must follow the table."""
    ids = list(range(64))
    random.Random(seed).shuffle(ids)
    return tuple(ids[:n])


def _run(loaded, cache, seq, all_logits=True):
    return loaded.model(ForwardBatch.build([seq], PAGE, "cpu"), cache, all_logits=all_logits)


@pytest.fixture(params=FAMILIES)
def family(request, tiny_hf_dir):
    directory, hf_model = tiny_hf_dir(request.param)
    return load_model(str(directory), progress=False), hf_model


def _prompt(n, seed=0):
    return [random.Random(seed).randrange(512) for _ in range(n)]


def test_whole_prompt_matches_transformers(family):
    loaded, hf_model = family
    ids = _prompt(45)
    ours = _run(loaded, _cache(loaded), SequenceInput(tuple(ids), 0, _scattered_pages(12, 1), 3))
    torch.testing.assert_close(ours, _reference_logits(hf_model, ids), rtol=1e-4, atol=1e-4)


def test_token_by_token_matches_transformers(family):
    loaded, hf_model = family
    ids = _prompt(30, seed=1)
    reference = _reference_logits(hf_model, ids)
    cache, pages = _cache(loaded), _scattered_pages(8, 2)
    steps = [_run(loaded, cache, SequenceInput((t,), i, pages, 5)) for i, t in enumerate(ids)]
    torch.testing.assert_close(torch.cat(steps), reference, rtol=1e-4, atol=1e-4)


def test_chunked_prefill_matches_one_pass(family):
    loaded, hf_model = family
    ids = _prompt(41, seed=2)
    cache, pages = _cache(loaded), _scattered_pages(11, 3)
    outs, start = [], 0
    for size in (7, 1, 16, 17):  # chunk ends land inside and on page boundaries
        outs.append(_run(loaded, cache, SequenceInput(tuple(ids[start:start + size]), start, pages, 0)))
        start += size
    torch.testing.assert_close(torch.cat(outs), _reference_logits(hf_model, ids), rtol=1e-4, atol=1e-4)


def test_mixed_batch_matches_each_sequence_alone(family):
    """Three sequences at different positions, one prefilling and two decoding,
    in one forward: each row equals the same sequence run alone."""
    loaded, _ = family
    prompts = [_prompt(n, seed=n) for n in (13, 22, 9)]
    pages = [tuple(range(0, 8)), tuple(range(8, 16)), tuple(range(16, 24))]
    alone, batched = _cache(loaded), _cache(loaded)
    # bring sequences 1 and 2 to different prefixes first, identically in both caches
    for cache in (alone, batched):
        _run(loaded, cache, SequenceInput(tuple(prompts[1][:-1]), 0, pages[1], 1))
        _run(loaded, cache, SequenceInput(tuple(prompts[2][:-1]), 0, pages[2], 2))
    seqs = [SequenceInput(tuple(prompts[0]), 0, pages[0], 0),
            SequenceInput((prompts[1][-1],), 21, pages[1], 1),
            SequenceInput((prompts[2][-1],), 8, pages[2], 2)]
    expected = torch.cat([_run(loaded, alone, s, all_logits=False) for s in seqs])
    got = loaded.model(ForwardBatch.build(seqs, PAGE, "cpu"), batched)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_new_sequence_ignores_stale_state_slot(tiny_hf_dir):
    """A slot reused by a new sequence (start == 0) must not leak the old state."""
    directory, hf_model = tiny_hf_dir("qwen3_5")
    loaded = load_model(str(directory), progress=False)
    cache = _cache(loaded)
    _run(loaded, cache, SequenceInput(tuple(_prompt(20, 7)), 0, tuple(range(5)), 0))
    ids = _prompt(10, 8)
    ours = _run(loaded, cache, SequenceInput(tuple(ids), 0, tuple(range(10, 13)), 0))
    torch.testing.assert_close(ours, _reference_logits(hf_model, ids), rtol=1e-4, atol=1e-4)


def test_bf16_forward_stays_close(tiny_hf_dir):
    directory, hf_model = tiny_hf_dir("qwen3_5")
    loaded = load_model(str(directory), dtype=torch.bfloat16, progress=False)
    ids = _prompt(20, 9)
    cache = PagedKVCache(loaded.config, CacheShape(16, PAGE, 2), "cpu", make_format("bf16", dtype=torch.bfloat16))
    ours = _run(loaded, cache, SequenceInput(tuple(ids), 0, tuple(range(5)), 0)).float()
    ref = _reference_logits(hf_model, ids)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    assert (ours - ref).abs().max() < 0.1 * ref.abs().max()
