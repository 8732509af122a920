"""The real embedded model (SmolLM2-135M-Instruct, Q4_1 GGUF) loaded by tandem
agrees with transformers loading the same file: greedy continuations of chat
prompts are token-identical, also when tandem runs them as one batch."""
from pathlib import Path

import pytest
import torch

from engine.llm import EngineConfig, OfflineEngine
from engine.loader import load_model
from engine.sampling import SamplingParams
from engine.weights.gguf import embedded_model_path

PROMPTS = [
    "Explain in detail how a bicycle works.",
    "Write a short story about a lighthouse keeper.",
    "List five uses of Python in science and explain each.",
    "What is the capital of France? Describe the city.",
]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def engine():
    return OfflineEngine(load_model(progress=False), EngineConfig(max_batch=4, max_context=1024))


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = embedded_model_path()
    return AutoModelForCausalLM.from_pretrained(Path(path).parent, gguf_file=Path(path).name,
                                                dtype=torch.float32).eval()


def _transformers_greedy(hf_model, prompt, eos_ids):
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                eos_token_id=list(eos_ids), pad_token_id=eos_ids[0])
    return out[0, len(prompt):].tolist()


def test_greedy_matches_transformers_as_one_batch(engine, hf_model):
    prompts = [engine.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    ours = {i: [] for i in range(len(prompts))}
    for event in engine.generate(prompts, params):
        ours[event.index].append(event.token_id)
    eos = engine.tokenizer.eos_token_ids
    for i, prompt in enumerate(prompts):
        theirs = _transformers_greedy(hf_model, prompt, eos)
        assert ours[i] == theirs, f"prompt {i}: {PROMPTS[i]!r}"
        assert len(ours[i]) >= 32


def test_seeded_sampling_is_reproducible(engine):
    prompt = engine.chat_prompt([{"role": "user", "content": "Tell me a joke."}])
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_new_tokens=24)
    first = engine.generate_ids(prompt, params)
    assert engine.generate_ids(prompt, params) == first
    other = engine.generate_ids(prompt, SamplingParams(temperature=0.9, top_p=0.95, seed=99,
                                                       max_new_tokens=24))
    assert other != first


def test_streamed_text_equals_decoded_output_and_honours_stop(engine):
    prompt = engine.chat_prompt([{"role": "user", "content": "Count from one to ten in words."}])
    events = list(engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=48)))
    text = "".join(e.text for e in events)
    ids = [e.token_id for e in events]
    decoded = engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert text == decoded
    stop_word = text.split()[2]
    stopped = list(engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=48,
                                                            stop=(stop_word,))))
    cut = "".join(e.text for e in stopped)
    assert cut == text[: text.index(stop_word)]
    assert stopped[-1].finish_reason.value == "stop"


def test_logprobs_are_reported(engine):
    prompt = engine.chat_prompt([{"role": "user", "content": "Hi"}])
    events = list(engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=4,
                                                           logprobs=3)))
    for e in events:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0][0] == e.token_id  # greedy picks the most likely
