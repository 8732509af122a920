"""Which draft tokens a sequence keeps, given the target's logits at every
verified position.

Greedy requests keep drafts while they equal the target's argmax (of the
penalised logits, exactly as plain decoding picks), then add the target's
own token: the output is token-identical to decoding without speculation.

Sampled requests use speculative rejection sampling (Leviathan et al. 2023;
Chen et al. 2023), which emits tokens distributed exactly as the target's
processed distribution p (penalties, temperature, top-k/p, min-p applied).

Randomness and penalties under speculation (decided):
  * Every draw comes from the sequence's own seeded generator, in a fixed
    order per step (drafts, then one uniform per verified draft, then the
    residual or bonus draw), so a seeded request is reproducible for a given
    drafter and k and independent of its batch-mates. It is not the same
    token sequence as the seeded non-speculative run (which consumes the
    generator differently); its distribution is the same. Nor is a seeded
    MTP request's text the same through `tandem serve` as through the
    offline engine (`tandem generate`): the offline engine drafts right after
    the prefill from the last prompt position's hidden state, while the
    decode worker never holds that state (it stayed in the prefill worker),
    so its first step after a prefill runs without drafts and the later
    draws fall differently. Greedy requests are token-identical on both
    paths, and sampled ones follow the same distribution
    (tests/test_speculative.py). The first step's drafts are what the service
    gives up: about one step in an answer's ~45 at 96 tokens.
  * Penalties are exact: the target distribution at verified position j is
    computed with drafts 1..j counted as if already generated, which is what
    plain decoding would have seen had it produced them.
  * A step without drafts draws exactly as plain decoding does (one
    exponential race), so it consumes the generator identically.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engine.sampling import SequenceSamplingState, processed_probs


@dataclass
class Accepted:
    tokens: list[int]  # kept drafts then the target's own token
    num_drafts_accepted: int


def pending_states(state: SequenceSamplingState, drafts: Sequence[int]) -> list[SequenceSamplingState]:
    """The sampling state at each verified position: drafts 0..j-1 appended.
    Only penalties read the counts, so without penalties all positions share
    the state as is (no copies)."""
    if not state.params.has_penalties or not drafts:
        return [state] * (len(drafts) + 1)
    states = [state]
    for token in drafts:
        states.append(states[-1].with_pending([token]))
    return states


def target_probs(logits: torch.Tensor, state: SequenceSamplingState,
                 drafts: Sequence[int]) -> torch.Tensor:
    """p at every verified position [m+1, V], penalties counting earlier drafts."""
    states = pending_states(state, drafts)
    return torch.cat([processed_probs(logits[j:j + 1], [states[j]]) for j in range(len(states))])


def accept_greedy(logits: torch.Tensor, state: SequenceSamplingState,
                  drafts: Sequence[int], raw_choices: Sequence[int] | None = None) -> Accepted:
    """logits [m+1, V]: keep drafts while each equals the target's choice.
    raw_choices: logits.float().argmax(-1) when the caller took it for the
    whole batch at once (one device sync per step, not one per sequence)."""
    if state.params.has_penalties:
        choices = target_probs(logits, state, drafts).argmax(dim=-1).tolist()
    elif raw_choices is not None:
        choices = list(raw_choices)
    else:  # one-hot at the argmax of the raw float logits: what sample() picks
        choices = logits.float().argmax(dim=-1).tolist()
    kept = 0
    while kept < len(drafts) and drafts[kept] == choices[kept]:
        kept += 1
    return Accepted(list(drafts[:kept]) + [choices[kept]], kept)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from probs [V] by the exponential race, as sampling.sample draws."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    noise.clamp_(min=torch.finfo(torch.float32).tiny)
    return int((probs / noise).argmax())


def accept_sampled(p: torch.Tensor, drafts: Sequence[int], q: torch.Tensor | None,
                   generator: torch.Generator) -> Accepted:
    """Speculative rejection sampling for one sequence.

    p: target distribution at each verified position [m+1, V]; drafts: m
    tokens; q: the distribution each draft was drawn from [m, V], or None for
    a deterministic drafter (q is one-hot at the draft, as for prompt lookup).

    Accept rule: draft x at position j is kept with probability
    min(1, p_j(x) / q_j(x)) (u ~ U[0,1), keep iff u * q_j(x) < p_j(x)). On the
    first rejection, emit a token drawn from the residual
    r_j = max(p_j - q_j, 0) / sum(max(p_j - q_j, 0)) and stop. If all m are
    kept, emit a bonus token drawn from p_m. The emitted token at position j
    then has probability
        q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) r(x)
      = min(p(x), q(x)) + max(p(x) - q(x), 0) = p(x),
    so every emitted token follows the target distribution exactly.
    """
    device = p.device
    for j, x in enumerate(drafts):
        p_x = float(p[j, x])
        q_x = 1.0 if q is None else float(q[j, x])
        u = float(torch.rand((), generator=generator, device=device))
        if u * q_x < p_x:
            continue
        if q is None:
            residual = p[j].clone()
            residual[x] = 0.0
        else:
            residual = (p[j] - q[j]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p <= q everywhere only by rounding: fall back to p
            residual = p[j]
        return Accepted(list(drafts[:j]) + [draw(residual, generator)], j)
    return Accepted(list(drafts) + [draw(p[len(drafts)], generator)], len(drafts))
