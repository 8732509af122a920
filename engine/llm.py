"""The offline engine: one process, one model, a few sequences at a time.

It is what `tandem generate` runs and the oracle the service is checked
against: chunked prefill into pages, then batched decode steps, per-request
sampling and stop conditions, streamed as text deltas that never split a
UTF-8 character. Pages come from a private free list here; in the service
the KV store hands them out instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from engine.batch import ForwardBatch, SequenceInput
from engine.cache import CacheShape, PagedKVCache
from engine.cuda_graphs import DecodeForward
from engine.kv import make_format
from engine.errors import InvalidRequestError
from engine.loader import LoadedModel
from engine.sampling import SamplingParams, SequenceSamplingState, sample
from engine.stopping import FinishReason, StopChecker, StopStringMatcher


@dataclass(frozen=True)
class EngineConfig:
    """Capacity of the offline engine; validated on creation."""

    max_batch: int = 8
    page_size: int = 16
    max_context: int = 4096  # capped at the model's own context length
    prefill_chunk: int = 512
    kv_format: str = "bf16"  # "bf16" stores the compute dtype as is; or "int8", "rk4"
    cuda_graphs: bool | None = None  # decode steps from CUDA graphs; None: on for CUDA

    def __post_init__(self) -> None:
        for name in ("max_batch", "page_size", "max_context", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine config: {name} must be >= 1, got {getattr(self, name)}")
        make_format(self.kv_format)  # an unknown format fails here, naming the known ones


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
    slot: int
    pages: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)

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
        pages_per_seq = -(-self.max_context // self.config.page_size)
        shape = CacheShape(num_pages=pages_per_seq * self.config.max_batch,
                           page_size=self.config.page_size,
                           num_state_slots=self.config.max_batch)
        kv_options = {"dtype": loaded.dtype} if self.config.kv_format == "bf16" else {}
        self.cache = PagedKVCache(loaded.config, shape, loaded.device,
                                  make_format(self.config.kv_format, **kv_options))
        self.pages = _FreeList(shape.num_pages)
        self.slots = _FreeList(self.config.max_batch)
        graphs = self.config.cuda_graphs
        if graphs is None:
            graphs = loaded.device.type == "cuda"
        self.decode_forward = DecodeForward(self.model, self.cache, self.max_context,
                                            enabled=graphs)

    # --- public ---------------------------------------------------------
    def chat_prompt(self, messages: list[dict], **template_kwargs) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  **template_kwargs)
        # the template already wrote any BOS it wants
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> Iterator[GenerationEvent]:
        """Streams events for all prompts, interleaved step by step."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError("one SamplingParams per prompt, or one for all")
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
                if running:
                    logits = self._decode_step(running)
                    yield from self._advance(list(running), logits, running)
        finally:
            for seq in running:
                self._release(seq)

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
            slot=self.slots.take(1)[0])

    def _ensure_pages(self, seq: _Sequence, length: int) -> None:
        needed = -(-length // self.config.page_size) - len(seq.pages)
        if needed > 0:
            seq.pages.extend(self.pages.take(needed))

    def _prefill(self, seq: _Sequence) -> torch.Tensor:
        chunk = self.config.prefill_chunk
        logits = None
        for start in range(0, len(seq.prompt), chunk):
            tokens = seq.prompt[start:start + chunk]
            self._ensure_pages(seq, start + len(tokens))
            batch = ForwardBatch.build(
                [SequenceInput(tuple(tokens), start, tuple(seq.pages), seq.slot)],
                self.config.page_size, self.loaded.device)
            logits = self.model(batch, self.cache)
        return logits

    def _decode_step(self, running: list[_Sequence]) -> torch.Tensor:
        inputs = []
        for seq in running:
            self._ensure_pages(seq, seq.length)
            inputs.append(SequenceInput((seq.output[-1],), seq.length - 1, tuple(seq.pages), seq.slot))
        batch = ForwardBatch.build(inputs, self.config.page_size, self.loaded.device)
        return self.decode_forward(batch)

    def _advance(self, seqs: list[_Sequence], logits: torch.Tensor,
                 running: list[_Sequence]) -> Iterator[GenerationEvent]:
        """Samples one token per sequence, applies stop rules, emits events."""
        result = sample(logits, [s.sampling for s in seqs])
        for row, seq in enumerate(seqs):
            token = result.token_ids[row]
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
            yield GenerationEvent(seq.index, token, text, result.logprobs[row],
                                  result.top_logprobs[row], finish)
            if finish is not None:
                running.remove(seq)
                self._release(seq)

    def _release(self, seq: _Sequence) -> None:
        if seq.slot >= 0:
            self.pages.give(seq.pages)
            self.slots.give([seq.slot])
            seq.pages, seq.slot = [], -1
