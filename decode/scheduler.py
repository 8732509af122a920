"""Continuous batching for the decode worker: sequences join and leave between
steps; each step is one forward of every running sequence's last token over
its pages, then per-request sampling and stop checks. A batch may queue its
next step before the host reads its tokens (TANDEM_RUN_AHEAD,
engine/run_ahead.py).

Owns the running set and the per-step work. Does not own text (stop strings
are the router's: it aborts a sequence whose text matched one) nor where pages
come from (a PageSource: the KV store's client, or a local allocator in tests).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol, Sequence

import torch

from engine.batch import ForwardBatch, SequenceInput
from engine.cache import PagedKVCache
from engine.cuda_graphs import DecodeForward
from engine.kv.open_pages import OpenPages, prepare_pages
from engine.model import CausalLM
from engine.run_ahead import (DeviceTokens, StepDone, continues_past_next_token, feeds_itself,
                               run_ahead_on)
from engine.sampling import SampleResult, SamplingParams, SequenceSamplingState, sample
from engine.speculative import SpecState, SpeculativeConfig, SpeculativeDecoder
from engine.stopping import FinishReason, StopChecker


class PageSource(Protocol):
    def allocate_pages(self, count: int) -> list[int]:
        """`count` new page ids for this worker, or raise engine.errors.TandemError."""


@dataclass
class DecodeSequence:
    """A request handed over after prefill: the prompt's KV is in `pages` and
    `state_slot`, and `output` holds the first token the prefill sampled."""

    request_id: str
    prompt: list[int]
    output: list[int]
    params: SamplingParams
    pages: list[int]
    state_slot: int
    eos_token_ids: Sequence[int]
    # where the GDN state is copied each time the sequence fills a page, so a
    # finished request leaves a page-aligned snapshot for the prefix cache
    boundary_slot: int = -1
    boundary_tokens: int = 0
    # GDN slots for the states after draft positions (hybrid models with
    # speculation); held by the request like state_slot, whose id may swap with one
    spare_slots: list[int] = field(default_factory=list)
    spec: SpecState | None = None
    # staging pages of a KV format that quantizes whole pages (rk4p)
    open_pages: OpenPages | None = None
    sampling: SequenceSamplingState = field(init=False)
    stop: StopChecker = field(init=False)
    finish_reason: FinishReason | None = None
    finish_detail: str = ""

    def __post_init__(self) -> None:
        if not self.output:
            raise ValueError("a decode sequence starts with the prefill's first token")
        self.sampling = SequenceSamplingState(self.params, self.prompt)
        for token in self.output:
            self.sampling.append(token)
        self.stop = StopChecker(self.params, self.eos_token_ids)

    @property
    def length(self) -> int:
        """Tokens so far; the KV of all but the last is in the pages."""
        return len(self.prompt) + len(self.output)


@dataclass
class TokenOut:
    request_id: str
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    finish_reason: FinishReason | None
    # speculative steps: set on the first token of a sequence's step, so that
    # summing over the tokens counts each step once
    drafted: int = 0  # drafts the step verified
    accepted: int = 0  # of those, kept and emitted


@dataclass
class StepProgress:
    """What the step in progress has done so far: the tokens it produced and
    the sequences that left the batch (finished, or dropped for want of pages).

    A step takes a leaving sequence out of `running` at once, so while the
    step runs such a sequence is in no list but this one. The scheduler keeps
    it (`DecodeScheduler.progress`) so that when a step raises part way, the
    step loop can still end every sequence the step held (decode/server.py
    StepLoop._end_failed_step); returned in a local list, they were lost with
    the exception, and their streams waited for ever."""

    tokens: list[TokenOut] = field(default_factory=list)
    left: list[DecodeSequence] = field(default_factory=list)

    def completed(self) -> list[DecodeSequence]:
        """Sequences that finished by a stop rule or their length in this step:
        every token of theirs is sampled, its KV written and its speculative
        state committed (a sequence leaves the batch only after that), so a
        later failure in the step takes nothing from them."""
        return [s for s in self.left if s.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)]


@dataclass
class _QueuedStep:
    """A decode step queued before the host read the tokens it runs on
    (TANDEM_RUN_AHEAD): one row of `logits` per sequence of `seqs`, in order."""

    seqs: list[DecodeSequence]
    logits: torch.Tensor
    done: StepDone

    def holds(self, seq: DecodeSequence) -> bool:
        return any(s is seq for s in self.seqs)

    def logits_of(self, running: list[DecodeSequence]) -> torch.Tensor:
        """The rows of the sequences still running (an abort may have taken some)."""
        if len(running) == len(self.seqs):
            return self.logits
        still = {id(s) for s in running}
        return self.logits[[i for i, s in enumerate(self.seqs) if id(s) in still]]


class DecodeScheduler:
    def __init__(self, model: CausalLM, cache: PagedKVCache, pages: PageSource,
                 max_batch: int = 32, max_context: int | None = None,
                 cuda_graphs: bool | None = None,
                 speculative: SpeculativeConfig | None = None,
                 run_ahead: bool | None = None) -> None:
        self.model = model
        self.cache = cache
        self.page_source = pages
        self.page_size = cache.page_size
        self.max_batch = max_batch
        self.max_context = max_context or model.config.max_position_embeddings
        self.running: list[DecodeSequence] = []
        self.waiting: list[DecodeSequence] = []
        # the latest step's tokens and leaving sequences, also when it raised
        self.progress = StepProgress()
        # decode steps queued one ahead of the host (None: TANDEM_RUN_AHEAD,
        # on for CUDA; read here so that a mistyped value stops the worker at its start)
        self.run_ahead = run_ahead_on(cache.device) if run_ahead is None else run_ahead
        # the next step, already queued on the device (run-ahead), or None
        self._queued: _QueuedStep | None = None
        # decode steps replay CUDA graphs on a GPU (None: on for CUDA caches)
        self.forward = DecodeForward(model, cache, self.max_context, enabled=cuda_graphs)
        speculative = speculative or SpeculativeConfig()
        self.spec = (SpeculativeDecoder(model, cache, speculative, self.max_context,
                                        cuda_graphs=cuda_graphs, graph_pool_of=self.forward)
                     if speculative.enabled else None)

    # --- membership -----------------------------------------------------
    def add(self, seq: DecodeSequence) -> None:
        """Joins at the next step (or when a batch place frees up)."""
        seq.sampling.skip_draws(len(seq.output), self.model.config.vocab_size, self.cache.device)
        self.waiting.append(seq)

    def abort(self, request_id: str) -> DecodeSequence | None:
        """Removes a sequence now; the caller gives back its pages and slots
        (a step queued ahead that writes them has run by the time this returns)."""
        for group in (self.running, self.waiting):
            for seq in group:
                if seq.request_id == request_id:
                    group.remove(seq)
                    seq.finish_reason = FinishReason.ABORT
                    self._let_go_of([seq])
                    return seq
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # --- one step -------------------------------------------------------
    def step(self) -> tuple[list[TokenOut], list[DecodeSequence]]:
        """Runs one decode step. Returns the tokens produced and the sequences
        that finished (their pages and slots are the caller's to release).
        If it raises, `progress` holds what it had done: the sequences it
        took out of the batch are there, in no other list.

        With run-ahead on, the batch queues the next step on
        the device before the host reads this one's tokens (_queue_next); the
        next call then starts from that step's logits. Sequences join only
        at a step that starts afresh, so one that waits stops the queueing
        and joins one step later."""
        self.progress = StepProgress()
        outs, finished = self.progress.tokens, self.progress.left
        queued, self._queued = self._queued, None
        if queued is None:
            self._admit()
            self._ensure_pages(finished)
            if self.running and self.spec is not None:
                return self._speculative_step(outs, finished)
        if not self.running:
            return outs, finished
        logits = self.forward(self._batch()) if queued is None else queued.logits_of(self.running)
        self._capture_boundaries()
        picked = self._pick_tokens(logits)
        for row, seq in enumerate(list(self.running)):
            finish = self._take_token(seq, picked.token_ids[row])
            outs.append(TokenOut(seq.request_id, picked.token_ids[row], picked.logprobs[row],
                                 picked.top_logprobs[row], finish))
            if finish is not None:
                self.running.remove(seq)
                finished.append(seq)
        self._let_go_of(finished)
        return outs, finished

    def _pick_tokens(self, logits: torch.Tensor) -> SampleResult:
        """Each running sequence's token and the logprobs it asked for; a
        batch that runs ahead queues the next step before the host reads them."""
        if not (self.run_ahead and feeds_itself(self.model)):
            return sample(logits, [s.sampling for s in self.running])
        tokens = DeviceTokens(logits, [s.sampling for s in self.running])
        self._queued = self._queue_next(tokens)
        return tokens.on_host()

    def _take_token(self, seq: DecodeSequence, token: int) -> FinishReason | None:
        """Appends a sampled token and applies the stop rules and the context's end."""
        seq.output.append(token)
        seq.sampling.append(token)
        seq.finish_reason = seq.stop.check_token(token, len(seq.output))
        if seq.finish_reason is None and seq.length >= self.max_context:
            seq.finish_reason = FinishReason.LENGTH
        return seq.finish_reason

    def _queue_next(self, tokens: DeviceTokens) -> _QueuedStep | None:
        """Queues the step after this one on `tokens` (still on the device),
        one position further. Not when a sequence waits to join, when a
        length limit ends a sequence at this token (nothing would read the
        step), or when a page for it cannot be had (the next step, started
        afresh, allocates or drops as usual). A stop token may still end a
        sequence: its row of the queued step is then wasted, never wrong."""
        if self.waiting or not all(self._continues_past_next_token(s) for s in self.running):
            return None
        from engine.errors import TandemError

        try:
            for seq in self.running:
                self._allocate_pages(seq, seq.length + 1)
        except TandemError:
            return None
        inputs = [SequenceInput((0,), s.length,   # 0: the device's token replaces it
                                prepare_pages(s, self.cache, s.length, s.length + 1, prefill=False),
                                s.state_slot)
                  for s in self.running]
        batch = ForwardBatch.build(inputs, self.page_size, self.cache.device)
        logits = self.forward(replace(batch, input_ids=tokens.ids))
        return _QueuedStep(list(self.running), logits, StepDone(self.cache.device))

    def _continues_past_next_token(self, seq: DecodeSequence) -> bool:
        return continues_past_next_token(len(seq.output), seq.params.max_new_tokens,
                                         seq.length, self.max_context)

    def _let_go_of(self, leaving: list[DecodeSequence]) -> None:
        """Sequences about to go back to the caller, who may give their pages
        and slots to another process at once: wait for a queued step that
        writes them (its rows of theirs are wasted)."""
        if self._queued is not None and any(self._queued.holds(s) for s in leaving):
            self._queued.done.wait()

    def _speculative_step(self, outs: list[TokenOut], finished: list[DecodeSequence]
                          ) -> tuple[list[TokenOut], list[DecodeSequence]]:
        """Verify each sequence's drafts in one forward; emit the kept tokens
        (a stop rule may cut a step short); draft for the next step. Sequences
        without speculation (no spare slots on a hybrid model) run one token."""
        verified = self.spec.verify(self.running)
        for seq, v in zip(list(self.running), verified):
            kept = 0
            first = len(outs)
            for j, token in enumerate(v.tokens):
                kept += 1
                self._take_token(seq, token)
                outs.append(TokenOut(seq.request_id, token, v.logprobs[j], v.top_logprobs[j],
                                     seq.finish_reason))
                if seq.finish_reason is not None:
                    break
            # counted as SpecState counts them: drafts cut off by a stop rule are not accepted
            outs[first].drafted = v.num_drafts
            outs[first].accepted = min(v.num_accepted, kept - 1)
            self._capture_verified_boundary(seq, v)
            self.spec.commit(seq, v, kept)
            if seq.finish_reason is not None:
                self.running.remove(seq)
                finished.append(seq)
        self.spec.draft(self.running)
        return outs, finished

    def _capture_verified_boundary(self, seq: DecodeSequence, v) -> None:
        """The state after each kept token is in a slot until the next step:
        copy the last page-aligned one for the prefix cache."""
        if seq.boundary_slot < 0:
            return
        cached = seq.length - 1  # tokens whose KV and state this step produced
        for tokens in range(cached, v.base, -1):
            if tokens % self.page_size == 0:
                slot = v.state_slot_covering(tokens)
                if slot is not None:
                    self.cache.copy_state(slot, seq.boundary_slot)
                    seq.boundary_tokens = tokens
                return

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if self.spec is not None and seq.spec is None and self._can_speculate(seq):
                seq.spec = self.spec.start(seq, seq.spare_slots)
            # moved only once started: if start raises, it is still waiting
            self.running.append(self.waiting.pop(0))

    def _can_speculate(self, seq: DecodeSequence) -> bool:
        return len(seq.spare_slots) >= self.spec.config.spare_slots(self.model.config)

    def _ensure_pages(self, dropped: list[DecodeSequence]) -> None:
        """Every running sequence gets a page for the token this step writes;
        one that cannot is finished with ABORT (its pages go back to the
        caller) and added to `dropped` at once, the step's list of leavers."""
        from engine.errors import TandemError

        for seq in list(self.running):
            try:
                self._allocate_pages(seq, seq.length)
            except TandemError as e:
                seq.finish_reason, seq.finish_detail = FinishReason.ABORT, f"out of KV pages: {e}"
                self.running.remove(seq)
                dropped.append(seq)

    def _allocate_pages(self, seq: DecodeSequence, tokens: int) -> None:
        """Pages for `tokens` tokens of `seq`, or raise engine.errors.TandemError."""
        needed = -(-tokens // self.page_size) - len(seq.pages)
        if needed > 0:
            seq.pages.extend(self.page_source.allocate_pages(needed))

    def _batch(self) -> ForwardBatch:
        inputs = [SequenceInput((s.output[-1],), s.length - 1,
                                prepare_pages(s, self.cache, s.length - 1, s.length, prefill=False),
                                s.state_slot)
                  for s in self.running]
        return ForwardBatch.build(inputs, self.page_size, self.cache.device)

    def settle(self, seq: DecodeSequence) -> int:
        """A sequence that left: make its KV final in its pages and return how
        many tokens that covers (all but the last sampled one), so the prefix
        cache may take the whole pages below it."""
        final = seq.length - 1
        if seq.open_pages is not None:
            seq.open_pages.flush(self.cache, seq.pages, final)
        return final

    def _capture_boundaries(self) -> None:
        """After this step a sequence's state covers `length` tokens; when that
        is a whole number of pages, keep a copy for the prefix cache."""
        for seq in self.running:
            if seq.boundary_slot >= 0 and seq.length % self.page_size == 0:
                self.cache.copy_state(seq.state_slot, seq.boundary_slot)
                seq.boundary_tokens = seq.length


@torch.inference_mode()
def run_to_completion(scheduler: DecodeScheduler) -> list[TokenOut]:
    """Steps until nothing is left (tests and the offline comparison)."""
    outs: list[TokenOut] = []
    while scheduler.has_work:
        outs.extend(scheduler.step()[0])
    return outs
