"""Open pages in the offline engine with rk4p: pages are staged in bf16 while
a sequence fills them, sealed into 4-bit pages mid-decode, and speculative
decoding (drafts crossing page boundaries, rejected drafts rewritten) keeps
exact greedy parity with plain decoding on the same format; every staging
page comes back."""
from __future__ import annotations

import pytest

from engine.llm import EngineConfig, OfflineEngine
from engine.loader import load_model
from engine.sampling import SamplingParams
from engine.speculative import SpeculativeConfig

from tests.test_speculative import _oracle_drafter

PAGE = 32
PARAMS = SamplingParams(temperature=0, max_new_tokens=68, ignore_eos=True)
# rk4p keeps page 0 (sinks) and the three newest pages in staging. 67 tokens
# (+68): prefill stages pages 0, 1 and 2; decode crosses into pages 3 and 4
# (drafts too) and seals page 1 at 128; 70 (+68): page 0 staged, page 1
# whole but among the newest for the prompt's last token (staged), page 2
# staged; page 1 is sealed at 128
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8] * 6 + [1, 2, 3, 4, 5, 6, 7], list(range(40, 110))]


@pytest.fixture(scope="module")
def qwen35():
    return load_model("tiny-qwen3.5", progress=False)


def _engine(loaded, spec=None):
    cfg = EngineConfig(max_batch=2, max_context=512, page_size=PAGE, kv_format="rk4p",
                       prefill_chunk=64, speculative=spec or SpeculativeConfig())
    engine = OfflineEngine(loaded, cfg)
    sealed = []
    seal = engine.cache.seal

    def recording_seal(staging_ids, page_ids):
        sealed.extend(page_ids)
        seal(staging_ids, page_ids)

    engine.cache.seal = recording_seal
    return engine, sealed


def _generate(engine, speculate=None):
    out = {i: [] for i in range(len(PROMPTS))}
    for event in engine.generate(PROMPTS, PARAMS, speculate=speculate):
        out[event.index].append(event.token_id)
    return [out[i] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def reference(qwen35):
    """Plain greedy decoding on rk4p: pages 1 and 2 get sealed mid-decode and
    every staging page comes back."""
    plain, sealed = _engine(qwen35)
    tokens = _generate(plain)
    assert len(sealed) >= 2
    assert sorted(plain.staging.free) == list(range(plain.cache.shape.staging_pages))
    return tokens


def test_rk4p_speculation_keeps_greedy_parity_across_sealed_pages(qwen35, reference):

    engine, sealed = _engine(qwen35, SpeculativeConfig("ngram", 3))
    _oracle_drafter(engine, reference, seed=2)
    assert _generate(engine) == reference
    t = engine.spec_totals
    assert 0 < t["accepted"] < t["drafted"]
    assert len(sealed) >= 2
    assert sorted(engine.staging.free) == list(range(engine.cache.shape.staging_pages))


def test_rk4p_mtp_drafter_keeps_greedy_parity(qwen35, reference):
    engine, _ = _engine(qwen35, SpeculativeConfig("mtp", 3))
    assert _generate(engine) == reference
    assert engine.spec_totals["drafted"] > 0


def test_rk4p_engine_needs_its_page_size(qwen35):
    with pytest.raises(ValueError, match="budget"):
        EngineConfig(kv_format="rk4p", page_size=16)
