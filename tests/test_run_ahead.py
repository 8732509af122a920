"""Run-ahead decode (TANDEM_RUN_AHEAD, on by default on CUDA): greedy steps
queued before the host reads the token of the step before, the argmax fed
to the next step on the device. The plain loop is the oracle: the same
events (tokens, text, finish reasons) for batches whose sequences end at
different steps by length, by a stop token and at the context's end, on a
hybrid model (GDN state updated in place: a token run twice would show) and
on a Llama."""
import pytest
import torch

from engine.llm import EngineConfig, OfflineEngine
from engine.loader import load_model
from engine.run_ahead import RUN_AHEAD_ENV
from engine.sampling import SamplingParams
from engine.stopping import FinishReason

PROMPTS = [[5, 9, 200, 17], [3, 1, 4, 1, 5, 9, 2, 6], [42] * 5]


def _events(engine, params, monkeypatch, on: str):
    monkeypatch.setenv(RUN_AHEAD_ENV, on)
    ran_ahead = []
    real = engine._run_ahead

    def spy(running):
        ran_ahead.append(len(running))
        yield from real(running)

    monkeypatch.setattr(engine, "_run_ahead", spy)
    with torch.inference_mode():
        events = [(e.index, e.token_id, e.text, e.finish_reason, e.logprob, e.top_logprobs)
                  for e in engine.generate(PROMPTS, params)]
    return events, ran_ahead


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs, the async token copy)"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", ["tiny-qwen3.5", "tiny-llama"])
def test_run_ahead_gives_the_plain_loops_events(model, device, monkeypatch):
    loaded = load_model(model, device=device, progress=False)
    engine = OfflineEngine(loaded, EngineConfig(max_batch=3, max_context=48))
    lengths = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
               for n in (7, 12, 40)]   # the last reaches the context's end
    plain, _ = _events(engine, lengths, monkeypatch, "0")
    ahead, ran = _events(engine, lengths, monkeypatch, "1")
    assert ahead == plain and ran and ran[0] == 3
    finish = {event[0]: event[3] for event in plain if event[3] is not None}
    assert len(finish) == 3

    # a stop token the first sequence emits mid-way: the step queued past it is wasted
    first = [event[1] for event in plain if event[0] == 0]
    stop = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True,
                          stop_token_ids=(first[3],))
    params = [stop, lengths[1], lengths[1]]
    plain, _ = _events(engine, params, monkeypatch, "0")
    ahead, ran = _events(engine, params, monkeypatch, "1")
    assert ahead == plain and ran
    assert [event[1] for event in plain if event[0] == 0][-1] == first[3]


def _drawn_and_penalised(max_new_tokens: int) -> list[SamplingParams]:
    """A batch whose tokens need the row's generator and the host's counts:
    seeded top-p, seeded min-p with a frequency penalty, greedy with a
    repetition penalty."""
    return [SamplingParams(temperature=0.9, top_p=0.8, seed=11, max_new_tokens=max_new_tokens,
                           ignore_eos=True),
            SamplingParams(temperature=1.1, min_p=0.05, frequency_penalty=0.7, seed=5,
                           max_new_tokens=max_new_tokens, ignore_eos=True),
            SamplingParams(temperature=0, repetition_penalty=1.3, max_new_tokens=max_new_tokens,
                           ignore_eos=True)]


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_and_penalised_rows_run_ahead_to_the_plain_loops_tokens(device, monkeypatch):
    """The draw for a queued step's logits is made once the host has
    appended the token before: each row's generator and counts see what the
    plain loop shows them, so seeded sampling and penalties give its tokens."""
    loaded = load_model("tiny-qwen3.5", device=device, progress=False)
    engine = OfflineEngine(loaded, EngineConfig(max_batch=3, max_context=48))
    params = _drawn_and_penalised(14)
    plain, _ = _events(engine, params, monkeypatch, "0")
    ahead, ran = _events(engine, params, monkeypatch, "1")
    assert ahead == plain and ran == [3]
    assert len({tuple(e[1] for e in plain if e[0] == row) for row in range(3)}) == 3


def test_logprobs_run_ahead_and_the_switch(monkeypatch):
    loaded = load_model("tiny-qwen3.5", progress=False)
    engine = OfflineEngine(loaded, EngineConfig(max_batch=3, max_context=48))
    params = [SamplingParams(temperature=0, max_new_tokens=6, logprobs=0, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=2, max_new_tokens=6, logprobs=3,
                             ignore_eos=True),
              SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)]
    plain, _ = _events(engine, params, monkeypatch, "0")
    ahead, ran = _events(engine, params, monkeypatch, "1")
    assert ahead == plain and ran == [3]
    assert all(e[4] is not None and len(e[5]) == 3 for e in plain if e[0] == 1)
    assert all(e[4] is None and e[5] is None for e in plain if e[0] == 2)
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    _, ran = _events(engine, greedy, monkeypatch, "")
    assert ran == []   # unset: off on the CPU, where nothing would overlap
    monkeypatch.setenv(RUN_AHEAD_ENV, "yes")
    with pytest.raises(ValueError, match=RUN_AHEAD_ENV):
        list(engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=3)))


# --- the decode worker's scheduler -------------------------------------

def _scheduler_run(model: str, device: str, params, run_ahead: bool, max_context: int = 64):
    """Prefills PROMPTS as the prefill worker would, then decodes them in one
    DecodeScheduler batch: each request's tokens and finish, the steps that
    were queued ahead, and whether every page and slot came back."""
    from decode.scheduler import DecodeScheduler, DecodeSequence
    from engine.batch import ForwardBatch, SequenceInput
    from engine.cache import CacheShape, PagedKVCache
    from engine.kv import make_format
    from engine.sampling import SequenceSamplingState, sample
    from kvstore.allocator import PageAllocator, SlotAllocator

    page = 4
    loaded = load_model(model, device=device, seed=3, progress=False)
    cache = PagedKVCache(loaded.config, CacheShape(96, page, 4), device,
                         make_format("bf16", dtype=next(loaded.model.parameters()).dtype))
    pages, slots = PageAllocator(96), SlotAllocator(4)

    class Pages:
        def allocate_pages(self, count):
            return pages.allocate(count)

    sched = DecodeScheduler(loaded.model, cache, Pages(), max_batch=3, max_context=max_context,
                            run_ahead=run_ahead)
    queued = []
    real = sched._queue_next

    def spy(tokens):
        step = real(tokens)
        queued.append(step is not None)
        return step

    sched._queue_next = spy
    got = {}
    with torch.inference_mode():
        for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
            ids = pages.allocate(-(-len(prompt) // page))
            slot = slots.allocate(1)[0]
            batch = ForwardBatch.build([SequenceInput(tuple(prompt), 0, tuple(ids), slot)],
                                       page, device)
            first = sample(loaded.model(batch, cache), [SequenceSamplingState(p, prompt)])
            seq = DecodeSequence(f"r{i}", list(prompt), [first.token_ids[0]], p, ids, slot,
                                 loaded.tokenizer.eos_token_ids)
            got[seq.request_id] = [[(seq.output[0], None, None)], None]
            sched.add(seq)
        while sched.has_work:
            outs, finished = sched.step()
            for out in outs:
                got[out.request_id][0].append((out.token_id, out.logprob, out.top_logprobs))
            for seq in finished:
                got[seq.request_id][1] = seq.finish_reason
                pages.free(seq.pages)
                slots.free([seq.state_slot])
    return got, queued, (pages.num_free, slots.num_free) == (96, 4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", ["tiny-qwen3.5", "tiny-llama"])
def test_scheduler_run_ahead_gives_the_plain_steps_tokens(model, device):
    lengths = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
               for n in (6, 11, 80)]   # the last reaches the context's end
    plain, queued, all_back = _scheduler_run(model, device, lengths, run_ahead=False)
    assert queued == [] and all_back
    ahead, queued, all_back = _scheduler_run(model, device, lengths, run_ahead=True)
    assert ahead == plain and all_back
    assert sum(queued) >= 40   # most steps ran ahead; those at a length limit did not
    assert {finish for _, finish in plain.values()} == {FinishReason.LENGTH}

    # a stop token mid-way: the row queued past it is wasted, the others go on
    stop = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True,
                          stop_token_ids=(plain["r0"][0][4][0],))
    params = [stop, lengths[1], lengths[2]]
    plain, _, _ = _scheduler_run(model, device, params, run_ahead=False)
    ahead, queued, all_back = _scheduler_run(model, device, params, run_ahead=True)
    assert ahead == plain and all_back and any(queued)
    assert plain["r0"][1] == FinishReason.STOP


@pytest.mark.parametrize("device", DEVICES)
def test_scheduler_runs_sampled_and_logprob_rows_ahead(device):
    drawn = _drawn_and_penalised(9)
    plain, _, _ = _scheduler_run("tiny-qwen3.5", device, drawn, False)
    ahead, queued, all_back = _scheduler_run("tiny-qwen3.5", device, drawn, True)
    assert ahead == plain and all_back and sum(queued) >= 6
    logprobs = SamplingParams(temperature=0.8, seed=4, max_new_tokens=8, ignore_eos=True,
                              logprobs=2)
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, logprobs=0)
    plain, _, _ = _scheduler_run("tiny-qwen3.5", device, [greedy, logprobs, drawn[2]], False)
    ahead, queued, all_back = _scheduler_run("tiny-qwen3.5", device,
                                             [greedy, logprobs, drawn[2]], True)
    assert ahead == plain and all_back and sum(queued) >= 6
    assert all(lp is not None and len(top) == 2 for _, lp, top in plain["r1"][0][1:])


def test_run_ahead_is_on_by_default_for_cuda_only(monkeypatch):
    from engine.run_ahead import run_ahead_on

    monkeypatch.delenv(RUN_AHEAD_ENV, raising=False)
    assert run_ahead_on("cuda") and run_ahead_on(torch.device("cuda", 0))
    assert not run_ahead_on("cpu")
    monkeypatch.setenv(RUN_AHEAD_ENV, "0")
    assert not run_ahead_on("cuda")
    monkeypatch.setenv(RUN_AHEAD_ENV, "1")
    assert run_ahead_on("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (stream syncs)")
def test_the_device_draw_never_waits_for_the_gpu():
    """A queued step is worth queueing only if nothing between the logits and
    the next step's launch waits for the GPU: appending the tokens before,
    the draw (penalties, top-p, min-p, the generators), the logprobs and the
    copies to the host, under torch's sync check, in a batch that mixes
    every kind of row."""
    from engine.run_ahead import DeviceTokens
    from engine.sampling import SequenceSamplingState

    states = [SequenceSamplingState(p, [1, 2, 3]) for p in _drawn_and_penalised(8)]
    states.append(SequenceSamplingState(SamplingParams(temperature=0), [4]))
    states.append(SequenceSamplingState(SamplingParams(temperature=0.5, logprobs=4, seed=9), [4]))
    logits = torch.randn(len(states), 5000, device="cuda", dtype=torch.bfloat16)
    for state in states:   # the counts' first upload is per request, not per step
        state.penalty_tensors(5000, logits.device)
    torch.cuda.synchronize()
    host = None
    for _ in range(3):
        torch.cuda.set_sync_debug_mode("error")
        try:
            for state, token in zip(states, host.token_ids if host else []):
                state.append(token)
            tokens = DeviceTokens(logits, states)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        host = tokens.on_host()   # waits for this copy alone, by design
