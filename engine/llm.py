"""The offline engine: one process, one model, a few sequences at a time.

It is what `tandem generate` runs and the oracle the service is checked
against: chunked prefill into pages, then batched decode steps, per-request
sampling and stop conditions, streamed as text deltas that never split a
UTF-8 character. Pages come from a private free list here; in the service
the KV store hands them out instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator, Sequence

import torch

from engine.batch import ForwardBatch, SequenceInput
from engine.cache import CacheShape, PagedKVCache
from engine.cuda_graphs import DecodeForward, batch_buckets
from engine.kv import make_format
from engine.kv.open_pages import OpenPages, prepare_pages, staging_per_sequence
from engine.errors import InvalidRequestError
from engine.loader import LoadedModel
from engine.run_ahead import (DeviceTokens, continues_past_next_token, feeds_itself,
                               run_ahead_on)
from engine.sampling import SamplingParams, SequenceSamplingState, sample
from engine.speculative import SpecState, SpeculativeConfig, SpeculativeDecoder
from engine.stopping import FinishReason, StopChecker, StopStringMatcher


@dataclass(frozen=True)
class EngineConfig:
    """Capacity of the offline engine; validated on creation."""

    max_batch: int = 8
    page_size: int | None = None  # None: the format's (16; 32 for rk4p)
    max_context: int = 4096  # capped at the model's own context length
    prefill_chunk: int = 512
    kv_format: str = "bf16"  # "bf16" stores the compute dtype as is; or "int8", "rk4"
    cuda_graphs: bool | None = None  # decode steps from CUDA graphs; None: on for CUDA
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.page_size is None:
            from engine.kv.formats import default_page_size
            object.__setattr__(self, "page_size", default_page_size(self.kv_format))
        for name in ("max_batch", "page_size", "max_context", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine config: {name} must be >= 1, got {getattr(self, name)}")
        kv_format_for(self.kv_format, self.page_size)  # unknown formats fail here, naming the known ones
        if not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError("engine config: speculative must be a SpeculativeConfig")


def kv_format_for(name: str, page_size: int, dtype: torch.dtype | None = None):
    """The KV format for a name; rk4p takes the page size (its K scales are per page)."""
    from engine.kv.formats import FORMATS

    options = {}
    if name == "bf16" and dtype is not None:
        options["dtype"] = dtype
    if name in FORMATS and getattr(FORMATS[name], "uses_staging", False):
        options["page_size"] = page_size
    return make_format(name, **options)


@dataclass
class GenerationEvent:
    """One step of one sequence: the token it produced and the text now visible."""

    index: int  # which prompt of the call
    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: FinishReason | None = None


@dataclass
class _Sequence:
    index: int
    prompt: list[int]
    params: SamplingParams
    sampling: SequenceSamplingState
    stop: StopChecker
    matcher: StopStringMatcher
    detokenizer: object
    state_slot: int
    pages: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    spare_slots: list[int] = field(default_factory=list)  # GDN slots for draft positions
    spec: SpecState | None = None
    mtp_tail: tuple[int, torch.Tensor] | None = None  # prompt's last position and its hidden
    open_pages: OpenPages | None = None  # staging pages of a format that quantizes whole pages

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)


class _FreeList:
    """Pages and state slots of the private cache: lowest ids first."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n - 1, -1, -1))

    def take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise InvalidRequestError("the offline engine ran out of KV pages; lower --max-new-tokens")
        return [self.free.pop() for _ in range(n)]

    def give(self, ids: Sequence[int]) -> None:
        self.free.extend(reversed(ids))


class OfflineEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.config = config or EngineConfig()
        self.max_context = min(self.config.max_context, loaded.config.max_position_embeddings)
        spec = self.config.speculative
        spec.check_model(loaded.config)
        self.spare_slots = spec.spare_slots(loaded.config)
        pages_per_seq = -(-self.max_context // self.config.page_size)
        slots = self.config.max_batch * (1 + self.spare_slots)
        shape = CacheShape(num_pages=pages_per_seq * self.config.max_batch,
                           page_size=self.config.page_size,
                           num_state_slots=slots, mtp_layers=spec.mtp_kv_layers(loaded.config))
        kv_format = kv_format_for(self.config.kv_format, self.config.page_size, loaded.dtype)
        if kv_format.uses_staging:
            shape = CacheShape(num_pages=shape.num_pages, page_size=shape.page_size,
                               num_state_slots=shape.num_state_slots, mtp_layers=shape.mtp_layers,
                               staging_pages=staging_per_sequence(kv_format) * self.config.max_batch)
        self.cache = PagedKVCache(loaded.config, shape, loaded.device, kv_format)
        self.pages = _FreeList(shape.num_pages)
        self.staging = _FreeList(shape.staging_pages)
        self.slots = _FreeList(slots)
        graphs = self.config.cuda_graphs
        if graphs is None:
            graphs = loaded.device.type == "cuda"
        self.decode_forward = DecodeForward(self.model, self.cache, self.max_context,
                                            buckets=batch_buckets(self.config.max_batch),
                                            enabled=graphs)
        self.spec = (SpeculativeDecoder(self.model, self.cache, spec, self.max_context,
                                        cuda_graphs=graphs, graph_pool_of=self.decode_forward)
                     if spec.enabled else None)
        self.spec_totals = {"steps": 0, "drafted": 0, "accepted": 0}

    # --- public ---------------------------------------------------------
    def chat_prompt(self, messages: list[dict], **template_kwargs) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  **template_kwargs)
        # the template already wrote any BOS it wants
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams],
                 speculate: Sequence[bool] | None = None) -> Iterator[GenerationEvent]:
        """Streams events for all prompts, interleaved step by step. With a
        speculative config, `speculate` can leave some prompts out of
        speculation (they decode one token per step in the same batches)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError("one SamplingParams per prompt, or one for all")
        speculate = [True] * len(prompts) if speculate is None else list(speculate)
        if len(speculate) != len(prompts):
            raise InvalidRequestError("one speculate flag per prompt")
        for prompt in prompts:
            self._check_prompt(prompt)
        waiting = [(i, list(p), sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        running: list[_Sequence] = []
        try:
            while waiting or running:
                while waiting and len(running) < self.config.max_batch:
                    seq = self._admit(*waiting.pop(0))
                    running.append(seq)
                    logits = self._prefill(seq)
                    yield from self._advance([seq], logits, running)
                    if seq in running and self.spec is not None and speculate[seq.index]:
                        self._start_speculating(seq)
                if running and self.spec is not None:
                    yield from self._speculative_step(running)
                elif running and not waiting and self._may_run_ahead():
                    yield from self._run_ahead(running)
                elif running:
                    logits = self._decode_step(running)
                    yield from self._advance(list(running), logits, running)
        finally:
            for seq in running:
                self._release(seq)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per target forward over finished speculative sequences,
        counting the target's own token (0 when nothing speculated)."""
        t = self.spec_totals
        return (t["accepted"] + t["steps"]) / t["steps"] if t["steps"] else 0.0

    def generate_ids(self, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        return [e.token_id for e in self.generate([prompt], params)]

    # --- steps ----------------------------------------------------------
    def _check_prompt(self, prompt: Sequence[int]) -> None:
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        if len(prompt) >= self.max_context:
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} tokens but the context holds {self.max_context} "
                f"(prompt plus at least one generated token): shorten the prompt")
        vocab = self.loaded.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")

    def _admit(self, index: int, prompt: list[int], params: SamplingParams) -> _Sequence:
        from engine.tokenizer import IncrementalDetokenizer

        return _Sequence(
            index=index, prompt=prompt, params=params,
            sampling=SequenceSamplingState(params, prompt),
            stop=StopChecker(params, self.tokenizer.eos_token_ids),
            matcher=StopStringMatcher(params.stop),
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt),
            state_slot=self.slots.take(1)[0], open_pages=self._open_pages())

    def _open_pages(self) -> OpenPages | None:
        if not self.cache.kv_format.uses_staging:
            return None
        fmt = self.cache.kv_format
        return OpenPages.for_format(fmt, self.staging.take(staging_per_sequence(fmt)),
                                    self.cache.shape.num_pages, self.config.page_size)

    def _ensure_pages(self, seq: _Sequence, length: int) -> None:
        needed = -(-length // self.config.page_size) - len(seq.pages)
        if needed > 0:
            seq.pages.extend(self.pages.take(needed))

    def _prefill(self, seq: _Sequence) -> torch.Tensor:
        """Runs the prompt in chunks. With the MTP drafter, also fills the MTP
        layer's KV with the prompt's pairs (h_p, token p+1); the last position's
        pair waits for the first sampled token (kept in seq.mtp_tail)."""
        chunk = self.config.prefill_chunk
        mtp = self.spec is not None and self.spec.config.uses_mtp
        logits = None
        n = len(seq.prompt)
        for start in range(0, n, chunk):
            tokens = seq.prompt[start:start + chunk]
            self._ensure_pages(seq, start + len(tokens))
            table = prepare_pages(seq, self.cache, start, start + len(tokens), prefill=True)
            batch = ForwardBatch.build(
                [SequenceInput(tuple(tokens), start, table, seq.state_slot)],
                self.config.page_size, self.loaded.device)
            if not mtp:
                logits = self.model(batch, self.cache)
                continue
            logits, hidden = self.model(batch, self.cache, return_hidden=True)
            end = start + len(tokens)
            known = min(end, n - 1) - start  # pairs whose next token is in the prompt
            if known > 0:
                self.spec.run_pairs(table, start, seq.prompt[start + 1:start + 1 + known],
                                    hidden[:known])
            if end == n:
                seq.mtp_tail = (n - 1, hidden[-1:])
        return logits

    def _start_speculating(self, seq: _Sequence) -> None:
        seq.spare_slots = self.slots.take(self.spare_slots)
        seq.spec = self.spec.start(seq, seq.spare_slots)
        if seq.mtp_tail is not None:
            position, hidden = seq.mtp_tail
            seq.spec.pending, seq.mtp_tail = (position, [seq.output[-1]], hidden), None
        self._ensure_pages(seq, min(seq.length + self.spec.config.num_draft_tokens,
                                    self.max_context))
        self.spec.draft([seq])

    def _decode_step(self, running: list[_Sequence],
                     next_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step of `running` on each sequence's last token; with
        `next_tokens` (one per sequence, on the device) on those instead,
        tokens the host has not seen yet, one position further."""
        inputs = []
        for seq in running:
            length = seq.length + (next_tokens is not None)
            self._ensure_pages(seq, length)
            table = prepare_pages(seq, self.cache, length - 1, length, prefill=False)
            token = seq.output[-1] if next_tokens is None else 0   # 0: replaced below
            inputs.append(SequenceInput((token,), length - 1, table, seq.state_slot))
        batch = ForwardBatch.build(inputs, self.config.page_size, self.loaded.device)
        if next_tokens is not None:
            batch = replace(batch, input_ids=next_tokens)
        return self.decode_forward(batch)

    def _may_run_ahead(self) -> bool:
        """Run-ahead on (TANDEM_RUN_AHEAD, by default on CUDA) and token ids
        the graph embeds on the device (the token is drawn on the GPU, which
        feeds it to the next step itself)."""
        return run_ahead_on(self.loaded.device) and feeds_itself(self.model)

    def _continues_past_next_token(self, seq: _Sequence) -> bool:
        return continues_past_next_token(len(seq.output), seq.params.max_new_tokens,
                                         seq.length, self.max_context)

    def _run_ahead(self, running: list[_Sequence]) -> Iterator[GenerationEvent]:
        """Decode steps each queued before the host reads the token of the
        one before: the token is drawn on the device and feeds the next step,
        and the host reads it (an async copy) while that step runs, so the
        GPU does not wait on the host's loop between tokens. The tokens are
        the plain loop's: sample() picks by the same draw, made here too
        once the host has appended the token before.

        A step queued past a token that ends its sequence is wasted: the
        sequence is released after it in stream order (its pages and state
        slot are written by that step before any later owner's work), and
        the rows of the others go on. Every step queued for a sequence that
        goes on is consumed: the GDN state is updated in place, so running
        a token twice would corrupt it. Returns with nothing queued, when a
        length limit is one token away (the plain loop finishes there) or
        no sequence is left."""
        seqs = list(running)
        logits = self._decode_step(seqs)
        while True:
            tokens = DeviceTokens(logits, [s.sampling for s in seqs])
            ahead = self._decode_step(seqs, tokens.ids) \
                if all(self._continues_past_next_token(s) for s in seqs) else None
            picked = tokens.on_host()
            for row, seq in enumerate(seqs):
                yield self._emit(seq, picked.token_ids[row], picked.logprobs[row],
                                 picked.top_logprobs[row], running)
            kept = [i for i, seq in enumerate(seqs) if seq in running]
            if ahead is None or not kept:
                return
            logits = ahead if len(kept) == len(seqs) else ahead[kept]
            seqs = [seqs[i] for i in kept]

    def _speculative_step(self, running: list[_Sequence]) -> Iterator[GenerationEvent]:
        """Verify every sequence's drafts in one forward, emit what it keeps,
        then draft for the next step."""
        for seq in running:
            self._ensure_pages(seq, seq.length + (len(seq.spec.drafts) if seq.spec else 0))
        verified = self.spec.verify(running)
        for seq, v in zip(list(running), verified):
            kept, finished = 0, False
            for j, token in enumerate(v.tokens):
                kept += 1
                event = self._emit(seq, token, v.logprobs[j], v.top_logprobs[j], running,
                                   release=False)
                finished = event.finish_reason is not None
                yield event
                if finished:
                    break
            if seq.spec is not None:
                self.spec.commit(seq, v, kept)
            if finished:
                self._release(seq)
        for seq in running:
            self._ensure_pages(seq, min(seq.length + self.spec.config.num_draft_tokens,
                                        self.max_context))
        self.spec.draft(running)

    def _advance(self, seqs: list[_Sequence], logits: torch.Tensor,
                 running: list[_Sequence]) -> Iterator[GenerationEvent]:
        """Samples one token per sequence, applies stop rules, emits events."""
        result = sample(logits, [s.sampling for s in seqs])
        for row, seq in enumerate(seqs):
            yield self._emit(seq, result.token_ids[row], result.logprobs[row],
                             result.top_logprobs[row], running)

    def _emit(self, seq: _Sequence, token: int, logprob, top_logprobs,
              running: list[_Sequence], release: bool = True) -> GenerationEvent:
        """Appends one token, applies stop rules; a finished sequence leaves
        `running` and (unless the caller does it) is released."""
        seq.output.append(token)
        seq.sampling.append(token)
        finish = seq.stop.check_token(token, len(seq.output))
        if finish is None and seq.length >= self.max_context:
            finish = FinishReason.LENGTH
        visible_token = finish is None or token not in seq.stop.stop_token_ids
        text, stopped = seq.matcher.feed(seq.detokenizer.push(token) if visible_token else "")
        if stopped:
            finish = FinishReason.STOP
        elif finish is not None:
            text += seq.matcher.feed(seq.detokenizer.flush())[0] + seq.matcher.flush()
        if finish is not None:
            running.remove(seq)
            if release:
                self._release(seq)
        return GenerationEvent(seq.index, token, text, logprob, top_logprobs, finish)

    def _release(self, seq: _Sequence) -> None:
        if seq.spec is not None:
            for key in self.spec_totals:
                self.spec_totals[key] += getattr(seq.spec, key)
            seq.spec = None
        if seq.state_slot >= 0:
            if seq.open_pages is not None:
                self.staging.give(seq.open_pages.staging)
                seq.open_pages = None
            self.pages.give(seq.pages)
            self.slots.give([seq.state_slot, *seq.spare_slots])
            seq.pages, seq.state_slot, seq.spare_slots = [], -1, []
