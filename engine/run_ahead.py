"""Decode steps queued one ahead of the host (TANDEM_RUN_AHEAD): the pieces
the offline engine (engine/llm.py) and the decode worker's scheduler
(decode/scheduler.py) share.

A sampled token is drawn on the GPU (engine.sampling.draw: an argmax, or
the exponential race on the row's own generator; its logprobs beside it,
engine.sampling.pick), so the GPU can feed it to the next step itself and
that step can be queued before the host has read the token; the host reads
it through an asynchronous copy while the next step runs, and the GPU no
longer idles through the host's loop between tokens. The draw for a queued
step's logits is made when the step is consumed, after the host has
appended the token before, so penalties and generators see exactly what the
plain loop shows them.

Owns the switch, the token kept on the device with its copy to the host, and
the rules for whether a batch may run ahead and whether a length limit makes
a queued step useless. Must not know sequences, pages or stop tokens: the
callers decide when a queued step is worth queueing and what to do with a
step queued past a sequence's end.
"""
from __future__ import annotations

from typing import Sequence

import torch

from engine.sampling import SampleResult, SequenceSamplingState, pick
from engine.switches import on_off

# On by default on CUDA: the H100's int4 step went from 6.97-7.61 to
# 6.55-6.66 ms on three hosts, each its graph's figure replayed back to back
# (BENCHMARKS.md 2026-12-06, "decode steps queued one ahead"). Off
# elsewhere: where the host runs each step itself nothing overlaps, and a
# step queued past a stop token would only cost time.
RUN_AHEAD_ENV = "TANDEM_RUN_AHEAD"


def run_ahead_on(device: torch.device | str) -> bool:
    """TANDEM_RUN_AHEAD as 1 or 0; unset, on for a CUDA device."""
    return on_off(RUN_AHEAD_ENV, torch.device(device).type == "cuda",
                  on="decode steps queued one ahead of the host",
                  off="each step after the host has its token")


def feeds_itself(model) -> bool:
    """Whether a batch's next tokens can stay on the device: token ids are
    embedded there (a host-side token table needs them on the host)."""
    return not model.embeds_on_host


def continues_past_next_token(generated: int, max_new_tokens: int, length: int,
                              max_context: int) -> bool:
    """Whether no length limit ends a sequence (`generated` tokens so far,
    `length` with its prompt) at the token being read now, so a step after
    it is worth queueing (a stop token may still end it: that step is then
    wasted, never wrong)."""
    return generated + 1 < max_new_tokens and length + 1 < max_context


class DeviceTokens:
    """One sampled token per row of `logits` and the logprobs asked for
    (engine.sampling.pick), left on the device; the tokens feed the next
    step, and the copy of it all to the host is under way (on_host)."""

    def __init__(self, logits: torch.Tensor, states: Sequence[SequenceSamplingState]) -> None:
        picks = pick(logits, states)
        self.ids = picks.token_ids
        self._host = picks.moved(_to_pinned_host) if self.ids.is_cuda else picks
        self._copied = StepDone(self.ids.device)

    def on_host(self) -> SampleResult:
        self._copied.wait()   # these copies only, not the step queued after them
        return self._host.result()


def _to_pinned_host(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


class StepDone:
    """Marks the work queued so far on the current stream; wait() returns
    once it has run. Off CUDA the work has already run when it was queued."""

    def __init__(self, device: torch.device) -> None:
        self._event = None
        if device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
