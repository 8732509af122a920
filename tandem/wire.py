"""Conversions between the internal worker protobufs (tandem.internal.v1
workers.proto) and the engine's dataclasses, in one place for the router and
both workers: protobuf stops at these functions."""
from __future__ import annotations

from engine.sampling import SamplingParams
from tandem.internal.v1 import workers_pb2 as pb


def sampling_to_pb(params: SamplingParams, stop_token_ids) -> pb.Sampling:
    """Fully resolved settings: `stop_token_ids` already holds EOS unless ignore_eos."""
    return pb.Sampling(temperature=params.temperature, top_p=params.top_p, top_k=max(0, params.top_k),
                       min_p=params.min_p, repetition_penalty=params.repetition_penalty,
                       presence_penalty=params.presence_penalty,
                       frequency_penalty=params.frequency_penalty, seed=params.seed,
                       max_new_tokens=params.max_new_tokens, stop_token_ids=stop_token_ids,
                       ignore_eos=params.ignore_eos,
                       logprobs=-1 if params.logprobs is None else params.logprobs)


def sampling_from_pb(s: pb.Sampling) -> SamplingParams:
    return SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, seed=s.seed,
        max_new_tokens=max(1, s.max_new_tokens), stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos, logprobs=None if s.logprobs < 0 else s.logprobs)


def generated_token_pb(token_id: int, logprob: float | None,
                       top: list[tuple[int, float]] | None) -> pb.GeneratedToken:
    return pb.GeneratedToken(token_id=token_id, logprob=logprob or 0.0,
                             top=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in top or []])
