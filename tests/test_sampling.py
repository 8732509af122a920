"""Token selection: parameter validation, greedy, seeded draws, batch
invariance, truncation filters, penalties, distribution and logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.sampling import (
    SamplingParams,
    SequenceSamplingState,
    apply_penalties,
    processed_probs,
    sample,
)

VOCAB = 50


def states_for(*params: SamplingParams) -> list[SequenceSamplingState]:
    return [SequenceSamplingState(p) for p in params]


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def draw_sequence(logits_per_step: list[torch.Tensor], params: SamplingParams) -> list[int]:
    state = SequenceSamplingState(params)
    tokens = []
    for row in logits_per_step:
        token = sample(row.unsqueeze(0), [state]).token_ids[0]
        state.append(token)
        tokens.append(token)
    return tokens


# --------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------


@pytest.mark.parametrize("field, value, allowed", [
    ("temperature", -0.5, ">= 0"),
    ("temperature", float("nan"), ">= 0"),
    ("top_k", -2, "0 or -1"),
    ("top_k", 1.5, "0 or -1"),
    ("top_p", 0.0, "(0, 1]"),
    ("top_p", 1.5, "(0, 1]"),
    ("min_p", -0.1, "[0, 1]"),
    ("repetition_penalty", 0.0, "> 0"),
    ("presence_penalty", 2.5, "[-2, 2]"),
    ("frequency_penalty", -3, "[-2, 2]"),
    ("seed", -1, "[0, 2**64)"),
    ("max_new_tokens", 0, ">= 1"),
    ("stop_token_ids", (1, -4), ">= 0"),
    ("stop", ("ok", ""), "non-empty"),
    ("logprobs", 21, "[0, 20]"),
    ("logprobs", -1, "[0, 20]"),
])
def test_invalid_params_name_field_value_and_range(field, value, allowed):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    message = str(err.value)
    assert field in message and repr(value) in message and allowed in message


def test_valid_params_and_normalisation():
    p = SamplingParams(temperature=0, top_k=-1, stop=["a"], stop_token_ids=[3], logprobs=20)
    assert p.is_greedy and p.stop == ("a",) and p.stop_token_ids == (3,)
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert not SamplingParams().is_greedy


def test_unseeded_state_records_a_seed_that_reproduces_it():
    logits = [random_logits(1, seed=s)[0] for s in range(20)]
    state = SequenceSamplingState(SamplingParams())
    assert isinstance(state.seed, int)
    tokens = []
    for row in logits:
        tokens.append(sample(row.unsqueeze(0), [state]).token_ids[0])
    assert draw_sequence(logits, SamplingParams(seed=state.seed)) == tokens


# --------------------------------------------------------------------------
# Greedy, seeds, batch invariance
# --------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = random_logits(4)
    result = sample(logits, states_for(*[SamplingParams(temperature=0)] * 4))
    assert result.token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_ties_take_lowest_index():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0]])
    assert sample(logits, states_for(SamplingParams(temperature=0))).token_ids == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_greedy_takes_the_general_paths_tokens(dtype, monkeypatch):
    """The plain-greedy shortcut (one argmax) against the general path
    (penalties, one-hot, noise) forced on: the same tokens for random rows,
    bf16 rows full of ties, and a row with NaN."""
    import engine.sampling as sampling

    g = torch.Generator().manual_seed(5)
    rows = torch.cat([torch.randn(6, VOCAB, generator=g),
                      torch.randint(0, 3, (4, VOCAB), generator=g).float()])
    rows[2, 7] = float("nan")
    logits = rows.to(dtype)
    states = states_for(*[SamplingParams(temperature=0)] * len(rows))
    fast = sample(logits, states)
    monkeypatch.setattr(sampling, "plain_greedy", lambda params: False)
    general = sample(logits, states)
    assert fast.token_ids == general.token_ids
    assert fast.logprobs == general.logprobs and fast.top_logprobs == general.top_logprobs


def test_same_seed_same_draws_different_seed_differs():
    logits = [torch.zeros(VOCAB)] * 30  # uniform: every draw is pure randomness
    first = draw_sequence(logits, SamplingParams(seed=1234))
    assert draw_sequence(logits, SamplingParams(seed=1234)) == first
    assert draw_sequence(logits, SamplingParams(seed=4321)) != first


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [VOCAB, 151_936])  # large: reductions may split rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_alone_equals_row_in_batch(dtype, vocab, device):
    target = SamplingParams(seed=7, top_p=0.9, top_k=20, min_p=0.01,
                            repetition_penalty=1.3, frequency_penalty=0.5)
    others = [SamplingParams(seed=1), SamplingParams(temperature=0),
              SamplingParams(seed=3, top_k=5, presence_penalty=1.0)]
    alone = SequenceSamplingState(target, prompt_token_ids=[1, 2, 3])
    batched = SequenceSamplingState(target, prompt_token_ids=[1, 2, 3])
    mates = states_for(*others)
    for step in range(6 if vocab > VOCAB else 25):
        logits = random_logits(4, vocab, seed=step).to(device=device, dtype=dtype)
        solo_token = sample(logits[2:3], [alone]).token_ids[0]
        # Target row sits first in the batch here, third when sampled alone.
        batch_logits = torch.cat([logits[2:3], logits[0:2], logits[3:4]])
        batch = [batched, *mates]
        batch_tokens = sample(batch_logits, batch).token_ids
        assert batch_tokens[0] == solo_token
        alone.append(solo_token)
        for state, token in zip(batch, batch_tokens):
            state.append(token)


@pytest.mark.parametrize("device", DEVICES)
def test_plain_rows_alone_equal_rows_in_batch_with_large_vocab(device):
    # Untruncated rows at temperature 1: the token rests on the whole
    # distribution, so any batch-dependent rounding would show up here.
    vocab, rows = 151_936, 6
    logits = random_logits(rows, vocab, seed=99).to(device)
    batch = [SequenceSamplingState(SamplingParams(seed=s, min_p=0.001 * s)) for s in range(rows)]
    solo = [SequenceSamplingState(SamplingParams(seed=s, min_p=0.001 * s)) for s in range(rows)]
    for _ in range(3):
        together = sample(logits, batch).token_ids
        alone = [sample(logits[i:i + 1], [solo[i]]).token_ids[0] for i in range(rows)]
        assert together == alone


def test_top_k_one_equals_greedy():
    logits = random_logits(8)
    result = sample(logits, states_for(*[SamplingParams(top_k=1, seed=i) for i in range(8)]))
    assert result.token_ids == logits.argmax(dim=-1).tolist()


# --------------------------------------------------------------------------
# Truncation filters
# --------------------------------------------------------------------------

# softmax of these logits: roughly [0.53, 0.20, 0.11, 0.07, 0.04, 0.03, 0.01, ...]
SKEWED = torch.tensor([3.0, 2.0, 1.4, 1.0, 0.5, 0.2, -1.0, -1.5, -2.0, -3.0])


def draws_from(params_for_seed, rows: int = 2000) -> set[int]:
    states = [SequenceSamplingState(params_for_seed(seed)) for seed in range(rows)]
    return set(sample(SKEWED.expand(rows, -1), states).token_ids)


def allowed_by_top_p(top_p: float) -> set[int]:
    probs = torch.softmax(SKEWED, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # SKEWED is sorted
    return set(torch.nonzero(mass_before < top_p).flatten().tolist())


def test_top_p_never_draws_outside_nucleus():
    allowed = allowed_by_top_p(0.8)
    assert allowed == {0, 1, 2}
    assert draws_from(lambda seed: SamplingParams(top_p=0.8, seed=seed)) == allowed


def test_min_p_never_draws_below_threshold():
    probs = torch.softmax(SKEWED, dim=-1)
    allowed = set(torch.nonzero(probs >= 0.1 * probs.max()).flatten().tolist())
    assert allowed == {0, 1, 2, 3}
    assert draws_from(lambda seed: SamplingParams(min_p=0.1, seed=seed)) == allowed


def test_top_k_then_top_p_judge_renormalised_mass():
    # After top_k=2 the kept mass is [0.73, 0.27]; top_p=0.7 keeps only token 0.
    assert draws_from(lambda seed: SamplingParams(top_k=2, top_p=0.7, seed=seed)) == {0}


def test_processed_probs_are_distributions_with_zeros_outside_the_filter():
    states = states_for(SamplingParams(temperature=0), SamplingParams(top_k=3),
                        SamplingParams(min_p=0.1), SamplingParams(temperature=0.5))
    probs = processed_probs(SKEWED.expand(4, -1).to(torch.bfloat16), states)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(4))
    assert probs[0].tolist() == [1.0] + [0.0] * 9
    assert torch.count_nonzero(probs[1]) == 3 and torch.count_nonzero(probs[2]) == 4
    torch.testing.assert_close(probs[3], torch.softmax(SKEWED.bfloat16().float() / 0.5, -1))


# --------------------------------------------------------------------------
# Penalties
# --------------------------------------------------------------------------


def test_penalties_on_hand_built_example():
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5,
                            frequency_penalty=0.25)
    state = SequenceSamplingState(params, prompt_token_ids=[0, 0])
    for token in (1, 1, 4):
        state.append(token)
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 3.0]])
    # token 0: prompt only -> 2/2 = 1.0; no presence/frequency (output only)
    # token 1: output x2   -> -1*2 - 0.25*2 - 0.5 = -3.0
    # tokens 2, 3: unseen  -> unchanged
    # token 4: output x1   -> 3/2 - 0.25 - 0.5 = 0.75
    expected = torch.tensor([[1.0, -3.0, 0.5, 0.0, 0.75]])
    assert torch.equal(apply_penalties(logits, [state]), expected)


def test_penalty_counts_follow_appends_after_first_use():
    params = SamplingParams(frequency_penalty=1.0)
    state = SequenceSamplingState(params)
    logits = torch.zeros(1, 4)
    assert apply_penalties(logits, [state]).tolist() == [[0.0] * 4]
    state.append(2)
    state.append(2)
    assert apply_penalties(logits, [state]).tolist() == [[0.0, 0.0, -2.0, 0.0]]


def test_rows_without_penalties_are_untouched():
    logits = random_logits(2)
    states = [SequenceSamplingState(SamplingParams(), prompt_token_ids=[1, 2]),
              SequenceSamplingState(SamplingParams(repetition_penalty=1.5),
                                    prompt_token_ids=[1, 2])]
    out = apply_penalties(logits, states)
    assert torch.equal(out[0], logits[0]) and not torch.equal(out[1], logits[1])


def test_greedy_uses_penalised_logits():
    state = SequenceSamplingState(SamplingParams(temperature=0, repetition_penalty=10.0),
                                  prompt_token_ids=[0])
    assert sample(torch.tensor([[3.0, 1.0, 0.0]]), [state]).token_ids == [1]


# --------------------------------------------------------------------------
# Distribution of draws
# --------------------------------------------------------------------------

FIVE = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5])
CHI2_DF4_P001 = 18.467  # chi-square critical value, 4 degrees of freedom, p = 0.001


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_empirical_distribution_matches_softmax(temperature):
    draws = 20_000
    states = [SequenceSamplingState(SamplingParams(temperature=temperature, seed=seed))
              for seed in range(draws)]
    tokens = torch.tensor(sample(FIVE.expand(draws, -1), states).token_ids)
    observed = torch.bincount(tokens, minlength=5).double()
    expected = torch.softmax(FIVE.double() / temperature, dim=-1) * draws
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    assert chi2 < CHI2_DF4_P001
    assert (observed / draws - expected / draws).abs().max() < 0.015


# --------------------------------------------------------------------------
# Logprobs
# --------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_and_top_lists_sorted():
    logits = random_logits(3).to(torch.bfloat16)
    states = states_for(
        SamplingParams(logprobs=5, temperature=0.3, repetition_penalty=2.0, seed=1),
        SamplingParams(logprobs=0, top_k=3, seed=2),
        SamplingParams())
    states[0].append(int(logits[0].float().argmax()))
    result = sample(logits, states)
    raw = torch.log_softmax(logits.float(), dim=-1)

    for row in (0, 1):
        assert math.isclose(result.logprobs[row], raw[row, result.token_ids[row]].item(),
                            rel_tol=1e-6, abs_tol=1e-6)
    top = result.top_logprobs[0]
    assert len(top) == 5
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    want_ids = raw[0].topk(5).indices.tolist()
    assert [t for t, _ in top] == want_ids
    for token, lp in top:
        assert math.isclose(lp, raw[0, token].item(), rel_tol=1e-6, abs_tol=1e-6)
    assert result.top_logprobs[1] == []
    assert result.logprobs[2] is None and result.top_logprobs[2] is None


def test_logprobs_off_for_whole_batch():
    result = sample(random_logits(2), states_for(SamplingParams(), SamplingParams()))
    assert result.logprobs == [None, None] and result.top_logprobs == [None, None]


def test_batch_shape_mismatch_is_a_bug():
    with pytest.raises(ValueError, match="one row per state"):
        sample(random_logits(2), states_for(SamplingParams()))
