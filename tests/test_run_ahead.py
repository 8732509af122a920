"""OfflineEngine's run-ahead decode (TANDEM_RUN_AHEAD=1): greedy steps
queued before the host reads the token of the step before, the argmax fed
to the next step on the device. The plain loop is the oracle: the same
events (tokens, text, finish reasons) for batches whose sequences end at
different steps by length, by a stop token and at the context's end, on a
hybrid model (GDN state updated in place: a token run twice would show) and
on a Llama."""
import pytest
import torch

from engine.llm import RUN_AHEAD_ENV, EngineConfig, OfflineEngine
from engine.loader import load_model
from engine.sampling import SamplingParams

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
        events = [(e.index, e.token_id, e.text, e.finish_reason)
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
    finish = {index: reason for index, _, _, reason in plain if reason is not None}
    assert len(finish) == 3

    # a stop token the first sequence emits mid-way: the step queued past it is wasted
    first = [token for index, token, _, _ in plain if index == 0]
    stop = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True,
                          stop_token_ids=(first[3],))
    params = [stop, lengths[1], lengths[1]]
    plain, _ = _events(engine, params, monkeypatch, "0")
    ahead, ran = _events(engine, params, monkeypatch, "1")
    assert ahead == plain and ran
    assert [t for i, t, _, _ in plain if i == 0][-1] == first[3]


def test_only_plain_greedy_batches_run_ahead(monkeypatch):
    loaded = load_model("tiny-qwen3.5", progress=False)
    engine = OfflineEngine(loaded, EngineConfig(max_batch=3, max_context=48))
    sampled = SamplingParams(temperature=0.8, seed=3, max_new_tokens=6)
    logprobs = SamplingParams(temperature=0, max_new_tokens=6, logprobs=0)
    for params in (sampled, logprobs):
        _, ran = _events(engine, params, monkeypatch, "1")
        assert ran == []
    _, ran = _events(engine, SamplingParams(temperature=0, max_new_tokens=6), monkeypatch, "0")
    assert ran == []   # the switch off
    monkeypatch.setenv(RUN_AHEAD_ENV, "yes")
    with pytest.raises(ValueError, match=RUN_AHEAD_ENV):
        list(engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=3)))
