"""Continuous batching in the decode worker: sequences joining at different
steps, with different lengths, produce exactly what the offline engine (one
sequence at a time) produces; boundary snapshots capture the right state."""
import time

import pytest
import torch

from decode.scheduler import DecodeScheduler, DecodeSequence, run_to_completion
from engine.batch import ForwardBatch, SequenceInput
from engine.cache import CacheShape, PagedKVCache
from engine.kv import make_format
from engine.llm import EngineConfig, OfflineEngine
from engine.loader import load_model
from engine.sampling import SamplingParams, SequenceSamplingState, sample
from kvstore.allocator import PageAllocator, SlotAllocator

PAGE = 4


class _LocalPages:
    def __init__(self, allocator):
        self.allocator = allocator

    def allocate_pages(self, count):
        return self.allocator.allocate(count)


def _prefill(loaded, cache, pages, slots, prompt, params, request_id):
    """What the prefill worker does: run the prompt, sample the first token."""
    page_ids = pages.allocate(-(-len(prompt) // PAGE))
    slot = slots.allocate(1)[0]
    batch = ForwardBatch.build([SequenceInput(tuple(prompt), 0, tuple(page_ids), slot)], PAGE, "cpu")
    logits = loaded.model(batch, cache)
    first = sample(logits, [SequenceSamplingState(params, prompt)]).token_ids[0]
    return DecodeSequence(request_id, list(prompt), [first], params, page_ids, slot,
                          loaded.tokenizer.eos_token_ids)


def test_joining_sequences_match_the_offline_engine():
    loaded = load_model("tiny-qwen3.5", seed=2)
    prompts = [[(3 * i + n) % 256 for i in range(n)] for n in (5, 13, 8, 21)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=m, ignore_eos=True) for m in (12, 7, 15, 9)]
    params[2] = SamplingParams(temperature=0.8, seed=7, max_new_tokens=15, ignore_eos=True)

    offline = OfflineEngine(loaded, EngineConfig(max_batch=1, page_size=PAGE, max_context=256))
    expected = {f"r{i}": offline.generate_ids(p, sp) for i, (p, sp) in enumerate(zip(prompts, params))}

    cache = PagedKVCache(loaded.config, CacheShape(128, PAGE, 8), "cpu", make_format("bf16", dtype=torch.float32))
    pages, slots = PageAllocator(128), SlotAllocator(8)
    sched = DecodeScheduler(loaded.model, cache, _LocalPages(pages), max_batch=3)
    got = {}
    seqs = [_prefill(loaded, cache, pages, slots, p, sp, f"r{i}")
            for i, (p, sp) in enumerate(zip(prompts, params))]
    for seq in seqs:
        got[seq.request_id] = list(seq.output)
    sched.add(seqs[0])
    sched.add(seqs[1])
    for step in range(40):
        if step == 3:
            sched.add(seqs[2])  # joins mid-flight
        if step == 5:
            sched.add(seqs[3])  # waits for a place in the batch of 3
        outs, finished = sched.step()
        for out in outs:
            got[out.request_id].append(out.token_id)
        for seq in finished:
            pages.free(seq.pages)
            slots.free([seq.state_slot])
        if not sched.has_work:
            break
    assert got == expected
    assert pages.num_free == 128 and slots.num_free == 8


@pytest.mark.parametrize("run_ahead", [False, True])
def test_abort_and_out_of_pages(run_ahead):
    loaded = load_model("tiny-llama", seed=1)
    cache = PagedKVCache(loaded.config, CacheShape(6, PAGE, 0), "cpu", make_format("bf16", dtype=torch.float32))
    pages, slots = PageAllocator(6), SlotAllocator(2)
    sched = DecodeScheduler(loaded.model, cache, _LocalPages(pages), max_batch=2,
                            run_ahead=run_ahead)
    params = SamplingParams(temperature=0.0, max_new_tokens=50, ignore_eos=True)
    a = _prefill(loaded, cache, pages, slots, [1, 2, 3], params, "a")
    b = _prefill(loaded, cache, pages, slots, [4, 5, 6, 7, 8], params, "b")
    sched.add(a)
    sched.add(b)
    sched.step()
    assert sched.abort("a").finish_reason.value == "abort"
    assert sched.abort("nope") is None
    pages.free(a.pages)
    finished = []
    while sched.has_work:
        finished.extend(sched.step()[1])
    assert [s.request_id for s in finished] == ["b"]
    assert finished[0].finish_reason.value == "abort" and "out of KV pages" in finished[0].finish_detail


@pytest.mark.parametrize("run_ahead", [False, True])
def test_boundary_snapshot_holds_the_state_at_a_page_end(run_ahead):
    loaded = load_model("tiny-qwen3.5", seed=5)
    cache = PagedKVCache(loaded.config, CacheShape(32, PAGE, 4), "cpu", make_format("bf16", dtype=torch.float32))
    pages, slots = PageAllocator(32), SlotAllocator(4)
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    seq = _prefill(loaded, cache, pages, slots, [9, 8, 7, 6, 5, 4], params, "s")
    seq.boundary_slot = slots.allocate(1)[0]
    sched = DecodeScheduler(loaded.model, cache, _LocalPages(pages), run_ahead=run_ahead)
    sched.add(seq)
    run_to_completion(sched)
    # 12 tokens exist but the last sampled one never ran: the state covers 11,
    # so the last page end it passed is 8
    assert seq.boundary_tokens == 8
    tokens = (seq.prompt + seq.output)[:8]
    spare = slots.allocate(1)[0]
    loaded.model(ForwardBatch.build([SequenceInput(tuple(tokens), 0, tuple(pages.allocate(2)), spare)],
                                    PAGE, "cpu"), cache)
    for layer in loaded.config.linear_layers:
        torch.testing.assert_close(cache.recurrent_state(layer)[seq.boundary_slot],
                                   cache.recurrent_state(layer)[spare], rtol=1e-4, atol=1e-5)


def test_step_loop_abort_returns_only_when_the_sequence_is_gone():
    """The router gives a cancelled request's pages away only after this ack:
    no step that could still write the request's KV may be running then."""
    import asyncio

    from decode.server import StepLoop, _Subscriber

    loaded = load_model("tiny-llama", seed=1)
    cache = PagedKVCache(loaded.config, CacheShape(64, PAGE, 0), "cpu", make_format("bf16", dtype=torch.float32))
    pages, slots = PageAllocator(64), SlotAllocator(2)
    steps = StepLoop(DecodeScheduler(loaded.model, cache, _LocalPages(pages), max_batch=2))
    steps.start()
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True)
        seq = _prefill(loaded, cache, pages, slots, [1, 2, 3], params, "long")
        steps.submit(seq, _Subscriber(asyncio.new_event_loop(), asyncio.Queue()))
        deadline = time.time() + 10
        while len(seq.output) < 3 and time.time() < deadline:
            time.sleep(0.01)
        assert steps.abort_and_wait("long")
        produced = len(seq.output)
        time.sleep(0.2)
        assert len(seq.output) == produced  # no step touched it after the ack
        assert not steps.scheduler.has_work
        assert steps.abort_and_wait("long") is False  # already gone: found is False
    finally:
        steps.stop()
    # a loop that does not answer in time (stopped here; stuck in a step in
    # life) is None, which the worker's Abort turns into DEADLINE_EXCEEDED
    assert steps.abort_and_wait("long", timeout=0.1) is None
