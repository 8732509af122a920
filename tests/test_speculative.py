"""Speculative decoding in the offline engine, checked against the oracle we
did not write for it: plain (non-speculative) greedy decoding must give the
very same tokens, for each drafter, on the embedded model and on a tiny
random Qwen3.5 (whose GDN state must be selected per accepted prefix); and
the rejection sampler must reproduce the target distribution."""
from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.llm import EngineConfig, OfflineEngine
from engine.loader import load_model
from engine.sampling import SamplingParams
from engine.speculative import SpeculativeConfig
from engine.speculative.acceptance import accept_sampled
from engine.speculative.ngram import NgramIndex

GREEDY = SamplingParams(temperature=0, max_new_tokens=20)


@pytest.fixture(scope="module")
def qwen35():
    return load_model("tiny-qwen3.5", progress=False)


@pytest.fixture(scope="module")
def embedded():
    return load_model(None, progress=False)


def _run(loaded, prompts, params, spec=None, speculate=None, max_batch=4):
    cfg = EngineConfig(max_batch=max_batch, max_context=512,
                       speculative=spec or SpeculativeConfig())
    engine = OfflineEngine(loaded, cfg)
    out = {i: [] for i in range(len(prompts))}
    for event in engine.generate(prompts, params, speculate=speculate):
        out[event.index].append(event.token_id)
    return [out[i] for i in range(len(prompts))], engine


def _oracle_drafter(engine, reference, seed):
    """Replaces the drafter by one that proposes the plain run's own tokens with
    one position corrupted at random (or none), so every acceptance count from
    0 to k happens; what is under test is verify, acceptance and state selection."""
    rng = random.Random(seed)
    vocab = engine.loaded.config.vocab_size

    def draft(seqs):
        for seq in seqs:
            if seq.spec is None:
                continue
            done = len(seq.output)
            future = reference[seq.index][done:done + engine.spec.draft_cap(seq)]
            drafts = list(future)
            wrong = rng.randrange(len(drafts) + 1) if drafts else 0
            if wrong < len(drafts):
                drafts[wrong] = (drafts[wrong] + 1) % vocab
            seq.spec.drafts = drafts

    engine.spec.draft = draft


TINY_PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8] * 2, [1, 2, 3, 4, 1, 2, 3, 4, 1, 2],
                [100, 200, 300, 17, 18, 19, 20, 21], list(range(40, 75))]


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0, max_new_tokens=20,
                                                           repetition_penalty=1.3,
                                                           frequency_penalty=0.5)],
                         ids=["plain", "penalties"])
def test_gdn_state_selection_keeps_greedy_parity(qwen35, params):
    """Tiny Qwen3.5, k=3, a batch of four whose drafts are accepted to different
    depths every step (and one that does not speculate): identical to plain."""
    reference, _ = _run(qwen35, TINY_PROMPTS, params)
    spec = SpeculativeConfig("ngram", 3)
    cfg = EngineConfig(max_batch=4, max_context=512, speculative=spec)
    engine = OfflineEngine(qwen35, cfg)
    _oracle_drafter(engine, reference, seed=1)
    out = {i: [] for i in range(len(TINY_PROMPTS))}
    for event in engine.generate(TINY_PROMPTS, params, speculate=[True, True, True, False]):
        out[event.index].append(event.token_id)
    assert [out[i] for i in range(4)] == reference
    t = engine.spec_totals
    assert 0 < t["accepted"] < t["drafted"]  # partial acceptance happened
    assert engine.mean_accepted_length > 1.5


def test_gdn_slots_come_back_whole_when_sequences_follow_each_other(qwen35):
    """One slot of batch room, four prompts one after another, drafts accepted
    to different depths: each sequence hands back exactly the GDN slots it
    took, although accepting drafts moves its live state into a spare slot.
    The engine gave back the old live slot twice and lost the new one, so the
    next sequence shared a slot with itself and left greedy parity."""
    reference, _ = _run(qwen35, TINY_PROMPTS, GREEDY)
    engine = OfflineEngine(qwen35, EngineConfig(max_batch=1, max_context=512,
                                                speculative=SpeculativeConfig("ngram", 3)))
    every_slot = sorted(engine.slots.free)
    for i, (prompt, expected) in enumerate(zip(TINY_PROMPTS, reference)):
        _oracle_drafter(engine, [expected], seed=i)  # each call's sequence is index 0
        assert engine.generate_ids(prompt, GREEDY) == expected
        assert sorted(engine.slots.free) == every_slot
    assert 0 < engine.spec_totals["accepted"] < engine.spec_totals["drafted"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_replayed_verify_keeps_greedy_parity_on_cuda():
    """On the GPU verify batches of k+1 tokens replay CUDA graphs through the
    fused GDN steps (engine/cuda_graphs.py VerifyForward): still identical to
    plain greedy decoding, with acceptance to every depth."""
    loaded = load_model("tiny-qwen3.5", device="cuda", dtype=torch.float32, progress=False)
    reference, _ = _run(loaded, TINY_PROMPTS, GREEDY)
    engine = OfflineEngine(loaded, EngineConfig(max_batch=4, max_context=512,
                                                speculative=SpeculativeConfig("ngram", 3)))
    _oracle_drafter(engine, reference, seed=2)
    out = {i: [] for i in range(len(TINY_PROMPTS))}
    for event in engine.generate(TINY_PROMPTS, GREEDY):
        out[event.index].append(event.token_id)
    assert [out[i] for i in range(4)] == reference
    assert engine.spec.verify_forward.replays > 0 and not engine.spec.verify_forward.capture_errors
    assert 0 < engine.spec_totals["accepted"] < engine.spec_totals["drafted"]


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafter_greedy_parity_tiny_qwen35(qwen35, k):
    assert qwen35.config.mtp_num_layers == 1
    reference, _ = _run(qwen35, TINY_PROMPTS[:3], GREEDY)
    got, engine = _run(qwen35, TINY_PROMPTS[:3], GREEDY, SpeculativeConfig("mtp", k))
    assert got == reference
    assert engine.spec_totals["drafted"] > 0


def _chat(engine_or_loaded, texts):
    engine = OfflineEngine(engine_or_loaded, EngineConfig(max_batch=1, max_context=512))
    return [engine.chat_prompt([{"role": "user", "content": t}]) for t in texts]


EMBEDDED_TEXTS = ["Repeat exactly: the cat sat on the mat, the cat sat on the mat.",
                  "Write a Python function that returns the square of a number.",
                  "What is the capital of France?"]


def test_ngram_greedy_parity_embedded(embedded):
    prompts = _chat(embedded, EMBEDDED_TEXTS)
    reference, _ = _run(embedded, prompts, GREEDY)
    got, engine = _run(embedded, prompts, GREEDY, SpeculativeConfig("ngram", 3))
    assert got == reference
    assert engine.spec_totals["accepted"] > 0  # the repeat prompt lets lookup hit


def _shipped_head_exists() -> bool:
    from engine.speculative.heads import SHIPPED
    return any(SHIPPED.glob("*.mtp.safetensors"))


@pytest.mark.skipif(not _shipped_head_exists(),
                    reason="no trained head in engine/heads yet: run `tandem train-mtp`")
def test_mtp_head_greedy_parity_embedded(embedded):
    """The shipped trained head (engine/heads) is found by the model's identity."""
    assert embedded.config.mtp_num_layers == 1, "the embedded model's trained MTP head is missing"
    prompts = _chat(embedded, EMBEDDED_TEXTS[1:])
    reference, _ = _run(embedded, prompts, GREEDY)
    got, engine = _run(embedded, prompts, GREEDY, SpeculativeConfig("mtp", 2))
    assert got == reference
    assert engine.spec_totals["accepted"] > 0


def _plain_answer_probs(loaded, prompt, params, depth):
    """The probability of every answer of `depth` tokens the non-speculative
    path can sample: each prefix's next-token distribution as sampling hands
    it to that path (processed_probs of the model's logits after the prompt
    and the prefix), multiplied down the tree of the tokens it can emit."""
    from engine.batch import ForwardBatch, SequenceInput
    from engine.cache import CacheShape, PagedKVCache
    from engine.kv import make_format
    from engine.sampling import SequenceSamplingState, processed_probs

    page = 16
    pages = tuple(range(-(-(len(prompt) + depth) // page)))
    answers = {(): 1.0}
    for _ in range(depth):
        longer = {}
        for prefix, prob in answers.items():
            cache = PagedKVCache(loaded.config, CacheShape(len(pages), page, 1), loaded.device,
                                 make_format("bf16", dtype=torch.float32))
            ids = tuple(prompt) + prefix
            batch = ForwardBatch.build([SequenceInput(ids, 0, pages, 0)], page, loaded.device)
            with torch.inference_mode():
                logits = loaded.model(batch, cache)[-1:]
            state = SequenceSamplingState(params, prompt).with_pending(list(prefix))
            dist = processed_probs(logits, [state])[0]
            for token in torch.nonzero(dist).flatten().tolist():
                longer[prefix + (token,)] = prob * float(dist[token])
        answers = longer
    return answers


def _chi2_against(counts: dict, probs: dict, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic of sampled answers against their exact probabilities,
    answers expected fewer than `min_expected` times pooled into one cell,
    and its degrees of freedom."""
    n = sum(counts.values())
    assert set(counts) <= set(probs), "an answer the plain path cannot sample came out"
    cells, pooled = [], [0, 0.0]
    for answer, prob in probs.items():
        if n * prob >= min_expected:
            cells.append((counts.get(answer, 0), n * prob))
        else:
            pooled[0] += counts.get(answer, 0)
            pooled[1] += n * prob
    if pooled[1] > 0:
        cells.append(tuple(pooled))
    stat = sum((seen - expected) ** 2 / expected for seen, expected in cells)
    return stat, len(cells) - 1


@pytest.mark.skipif(not _shipped_head_exists(),
                    reason="no trained head in engine/heads yet: run `tandem train-mtp`")
def test_sampling_with_the_trained_head_keeps_the_plain_distribution(embedded):
    """The rejection sampler end to end: the trained head proposes (q from its
    own processed logits), the target verifies, and the first four sampled
    tokens of 200 seeded answers follow the distribution the non-speculative
    path samples from, computed exactly over the tree of answers top-k 2
    allows (at most 16). The unit test above checks the accept rule on
    made-up p and q; this one the q the decoder hands it and the p it
    computes with drafts pending. One sample against exact probabilities has
    twice the power of the two samples (plain and speculative) this test drew
    before, at a third of the forwards: the accept rule gives 14.3 at 14
    dof, one that keeps every draft with p > 0 (a bias toward the head) 62.1,
    against the bound of 37.7 (CPU, 2026-12-06)."""
    import collections

    prompt = _chat(embedded, ["Name a colour."])[0]
    n, depth = 200, 4
    params = [SamplingParams(temperature=1.0, top_k=2, seed=s, max_new_tokens=depth)
              for s in range(n)]
    exact = _plain_answer_probs(embedded, prompt, params[0], depth)
    assert abs(sum(exact.values()) - 1.0) < 1e-5 and len(exact) <= 2 ** depth
    out, engine = _run(embedded, [prompt] * n, params, SpeculativeConfig("mtp", 3), max_batch=64)
    stat, dof = _chi2_against(collections.Counter(tuple(o) for o in out), exact)
    # the 0.999 quantile of chi-square: 29.6 at 11 dof, 37.7 at 15 (at most 16 cells)
    assert dof <= 15 and stat < 37.7, (stat, dof, exact)
    totals = engine.spec_totals
    assert totals["drafted"] >= n and totals["accepted"] > 0.2 * totals["drafted"], totals


def test_seeded_speculative_sampling_is_reproducible(qwen35):
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=s, max_new_tokens=16)
              for s in (1, 2)]
    spec = SpeculativeConfig("mtp", 2)
    first, _ = _run(qwen35, TINY_PROMPTS[:2], params, spec)
    alone, _ = _run(qwen35, TINY_PROMPTS[1:2], params[1:], spec)
    second, _ = _run(qwen35, TINY_PROMPTS[:2], params, spec)
    assert first == second and all(len(o) == 16 for o in first)
    assert first[1] == alone[0]  # a row's draws do not depend on its batch-mates


# --- the rejection sampler ----------------------------------------------

def _counts(values, n):
    return torch.bincount(torch.tensor(values), minlength=n).double()


def _chi2_ok(counts, probs):
    """Pearson chi-square against probs; the 0.999 quantile for <= 5 dof is 20.5."""
    expected = probs.double() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat < 20.5, stat


@pytest.mark.parametrize("drafter", ["sampled", "deterministic"])
def test_rejection_sampler_keeps_the_target_distribution(drafter):
    p = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.10, 0.00],
                      [0.05, 0.05, 0.30, 0.30, 0.20, 0.10],
                      [0.10, 0.10, 0.10, 0.10, 0.10, 0.50]])
    q = torch.tensor([[0.10, 0.50, 0.10, 0.10, 0.10, 0.10],
                      [0.30, 0.10, 0.10, 0.10, 0.10, 0.30]])
    gen = torch.Generator().manual_seed(1234)
    firsts, seconds = [], []
    for _ in range(6000):
        if drafter == "sampled":
            drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
            got = accept_sampled(p, drafts, q, gen)
        else:  # prompt lookup: a fixed draft, q one-hot
            drafts = [1, 3]
            got = accept_sampled(p, drafts, None, gen)
        firsts.append(got.tokens[0])
        if got.num_drafts_accepted >= 1:
            seconds.append(got.tokens[1])
    ok, stat = _chi2_ok(_counts(firsts, 6), p[0])
    assert ok, f"first token chi2 {stat}"
    # given the first draft was kept, the second token follows p_1 again
    ok, stat = _chi2_ok(_counts(seconds, 6), p[1])
    assert ok, f"second token chi2 {stat}"
    assert 500 < len(seconds) < 6000


# --- configuration errors ------------------------------------------------

@pytest.mark.parametrize("method,k", [("eagle", 3), ("mtp", 0), ("ngram", 5), ("mtp", 2.0)])
def test_bad_speculative_config_is_a_clear_error(method, k):
    with pytest.raises(InvalidRequestError, match="speculative method|draft tokens"):
        SpeculativeConfig(method, k)


def test_mtp_on_a_model_without_head_is_a_clear_error():
    loaded = load_model("tiny-llama", progress=False)
    with pytest.raises(InvalidRequestError, match="train-mtp"):
        OfflineEngine(loaded, EngineConfig(speculative=SpeculativeConfig("mtp", 2)))


@pytest.mark.parametrize("flags,message", [(["--draft-tokens", "5"], "1..4"),
                                           (["--speculative", "mtp"], "train-mtp")])
def test_cli_rejects_bad_speculation(flags, message):
    run = subprocess.run([sys.executable, "-m", "tandem.cli", "generate", "--model", "tiny-llama",
                          "--max-new-tokens", "2", *flags, "hi"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr


def test_ngram_index_proposes_what_followed_the_latest_match():
    index = NgramIndex([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2], n_min=1, n_max=3)
    assert index.propose(3) == [3, 7, 8]  # "1 2" last followed by 3 7 8
    index.extend([3])
    assert index.propose(2) == [7, 8]
    assert NgramIndex([4, 5, 6], 1, 3).propose(3) == []


# --- the decode worker's scheduler ---------------------------------------

def test_decode_scheduler_speculates_with_exact_greedy_parity(qwen35):
    """The service path: prefill (prefill/runner.py, which fills the MTP KV),
    then the decode scheduler with MTP k=3 over reserved pages and spare GDN
    slots, a batch mixing a speculating and a plain sequence."""
    from decode.scheduler import DecodeScheduler, DecodeSequence, run_to_completion
    from engine.cache import CacheShape, PagedKVCache
    from engine.kv import make_format
    from prefill.runner import PrefillJob, run_prefill

    page, k = 4, 3
    params = SamplingParams(temperature=0, max_new_tokens=14, ignore_eos=True)
    reference, _ = _run(qwen35, TINY_PROMPTS[:2], params)
    cache = PagedKVCache(qwen35.config, CacheShape(64, page, 2 * (2 + k), mtp_layers=1), "cpu",
                         make_format("bf16", dtype=torch.float32))

    class NoMorePages:
        def allocate_pages(self, count):
            raise AssertionError("speculation asked for pages beyond the reservation")

    sched = DecodeScheduler(qwen35.model, cache, NoMorePages(), max_batch=4,
                            speculative=SpeculativeConfig("mtp", k))
    seqs = []
    for i, prompt in enumerate(TINY_PROMPTS[:2]):
        pages = tuple(range(i * 32, i * 32 + -(-(len(prompt) + 14) // page)))
        slot = i * (2 + k)
        first = run_prefill(qwen35.model, cache, PrefillJob(f"r{i}", tuple(prompt), 0, pages, slot,
                                                            params=params), 8).token_ids[0]
        spare = list(range(slot + 2, slot + 2 + k)) if i == 0 else []  # r1 does not speculate
        seqs.append(DecodeSequence(f"r{i}", list(prompt), [first], params, list(pages), slot,
                                   (), boundary_slot=slot + 1, spare_slots=spare))
        sched.add(seqs[-1])
    run_to_completion(sched)
    assert [s.output for s in seqs] == reference
    assert seqs[0].spec is not None and seqs[0].spec.drafted > 0 and seqs[1].spec is None


def test_a_two_layer_trained_head_is_planned_loaded_and_drafts_exactly(embedded, tmp_path):
    """A train-mtp head of two layers beside a GGUF file: the plan (no weights
    read) and the loaded model both count two MTP layers and the same bytes;
    speculation keeps greedy parity, and every draft, at every depth, is
    what train.EngineKV's unroll predicts over the verified text and the
    chain's drafts (both layers' MTP KV filled right by the catch-up pairs,
    deeper drafts reading the chain's own entries). The dense unroll that
    train-mtp trained with before misses some deeper drafts, so the check
    can tell the two apart."""
    from engine.loader import plan_inputs
    from engine.speculative import train
    from engine.speculative.heads import head_path_for, head_state, save_head
    from engine.weights.gguf import embedded_model_path

    gguf = tmp_path / "base.gguf"
    gguf.symlink_to(embedded_model_path())
    base = load_model(str(gguf), progress=False, trained_head=False)
    shipped = head_path_for(embedded_model_path())
    head = train.head_from_file(base.model, str(shipped), layers=2)
    torch.manual_seed(0)
    with torch.no_grad():  # the grown layer starts as an identity: make it matter
        new = head.layers[1]
        for proj, like in ((new.self_attn.o_proj, head.layers[0].self_attn.o_proj),
                           (new.mlp.down_proj, head.layers[0].mlp.down_proj)):
            proj.weight.copy_(torch.randn_like(proj.weight) * like.weight.std() * 0.3)
    save_head(tmp_path / "base.mtp.safetensors", base.config, head_state(head))

    loaded = load_model(str(gguf), progress=False)
    planned = plan_inputs(str(gguf), "auto", "cpu")
    held = sum(t.numel() * t.element_size() for t in loaded.model.state_dict().values())
    assert loaded.config.mtp_num_layers == planned.config.mtp_num_layers == 2
    assert planned.weight_bytes == held

    prompts = _chat(loaded, EMBEDDED_TEXTS)
    params = SamplingParams(temperature=0, max_new_tokens=24)
    reference, _ = _run(loaded, prompts, params)
    got, engine = _run(loaded, prompts, params, SpeculativeConfig("mtp", 3))
    assert got == reference
    drafting = []
    inner = engine.spec.draft

    def draft(seqs):
        inner(seqs)
        drafting.extend((list(s.prompt) + list(s.output), list(s.spec.drafts))
                        for s in seqs if s.spec is not None and s.spec.drafts)
    engine.spec.draft = draft
    for prompt in prompts:
        engine.generate_ids(prompt, params)
    totals = engine.spec_totals
    assert len(drafting) >= 10 and 0 < totals["accepted"] < totals["drafted"]
    assert any(len(drafts) == 3 for _, drafts in drafting)
    lm = loaded.model.output_embedding.float()
    dense_misses = 0
    with torch.no_grad():
        for text, drafts in drafting:
            # the chain starts at the pair (hidden of the token before the
            # last, the last token); depth r is fed the engine's draft r - 1
            tokens = torch.tensor(text + drafts[:-1])
            start = len(text) - 2
            hidden = train.base_features(loaded.model, [tokens.tolist()])[0][0][:-1].float()
            for kv in (train.EngineKV(2), None):
                h = hidden
                for r, drafted in enumerate(drafts, 1):
                    n = len(tokens) - r
                    h = train.head_forward(loaded.model, loaded.model.mtp, h[:n],
                                           tokens[r:r + n], torch.arange(r - 1, r - 1 + n), kv=kv)
                    logits = torch.nn.functional.linear(h[start], lm)
                    # the engine's features come from incremental verify steps:
                    # equal to fp32 rounding, so a near-tie may pick either token
                    if kv is not None:
                        assert logits[drafted] >= logits.max() - 1e-3, (r, text[-4:])
                    else:
                        dense_misses += bool(logits[drafted] < logits.max() - 1e-3)
    assert dense_misses > 0
