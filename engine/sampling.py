"""Token selection: turning a batch of next-token logits into one token per
sequence, under each request's own sampling parameters.

Owns the request-level sampling parameters (`SamplingParams`, validated on
creation), the per-sequence state that sampling needs between steps
(`SequenceSamplingState`: random generator, token counts for penalties), the
processed next-token distribution (`processed_probs`) and the draw itself
(`sample`).

Guarantees:
  * Batch invariance: a sequence's token depends only on its own logits row,
    its own parameters and its own generator; never on the other rows, the
    batch size or its position in the batch. Randomness comes from each
    sequence's generator (exponential race, see `_draw_tokens`), and the
    vectorised work is grouped by what a row itself asks for, so a row always
    takes the same code path whatever it is batched with.
  * Reproducibility: same seed + same logits => same tokens.

Does not own stopping (engine/stopping.py) or detokenisation.
"""
from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.errors import InvalidRequestError
from engine.uploads import upload

MAX_LOGPROBS = 20
_MAX_SEED = 2**64  # torch.Generator.manual_seed takes a 64-bit unsigned seed


# --------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------


def _reject(name: str, value: object, allowed: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"sampling parameter {name}={value!r} is out of range: must be {allowed}"
    )


def _is_number(value: object) -> bool:
    # bool is an int subclass; True as a temperature is a caller bug, not 1.0.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_float(name: str, value: object, lo: float, hi: float,
                 allowed: str, lo_open: bool = False) -> None:
    ok = _is_number(value) and math.isfinite(value) and value <= hi and (
        value > lo if lo_open else value >= lo)
    if not ok:
        raise _reject(name, value, allowed)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it ends.

    temperature: >= 0; 0 means greedy (argmax of the penalised logits).
    top_k: 0 or -1 = off, else keep the k most likely tokens.
    top_p: in (0, 1]; keep the smallest set of tokens whose mass >= top_p.
    min_p: in [0, 1]; drop tokens with prob < min_p * (max prob).
    repetition_penalty: > 0, 1.0 = off. Hugging Face semantics: for every
        token seen in the prompt or the output, positive logits are divided
        by it and negative logits multiplied by it.
    presence_penalty, frequency_penalty: in [-2, 2]. OpenAI semantics, over
        output tokens only: logit -= frequency * count + presence * (count > 0).
    seed: None (fresh OS randomness, recorded on the state) or an int in
        [0, 2**64).
    max_new_tokens: >= 1.
    stop_token_ids: token ids that end the sequence (in addition to EOS).
    stop: stop strings; the output is cut before the first one to complete.
    ignore_eos: keep generating past EOS (stop_token_ids still apply).
    logprobs: None = off; 0 = the chosen token's logprob only; k in 1..20 =
        also the k most likely alternatives.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        self._normalise_sequences()
        self._validate_distribution_params()
        self._validate_penalties()
        self._validate_request_limits()

    def _normalise_sequences(self) -> None:
        # Requests arrive as JSON/protobuf lists (and OpenAI allows a bare
        # string for `stop`); store tuples so the params stay hashable.
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def _validate_distribution_params(self) -> None:
        _check_float("temperature", self.temperature, 0.0, math.inf,
                     "a finite number >= 0 (0 = greedy)")
        if not (_is_int(self.top_k) and (self.top_k in (0, -1) or self.top_k >= 1)):
            raise _reject("top_k", self.top_k, "0 or -1 (off) or an integer >= 1")
        _check_float("top_p", self.top_p, 0.0, 1.0, "in (0, 1]", lo_open=True)
        _check_float("min_p", self.min_p, 0.0, 1.0, "in [0, 1]")

    def _validate_penalties(self) -> None:
        _check_float("repetition_penalty", self.repetition_penalty, 0.0,
                     math.inf, "a finite number > 0 (1.0 = off)", lo_open=True)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0,
                     "in [-2, 2]")
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0,
                     "in [-2, 2]")

    def _validate_request_limits(self) -> None:
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < _MAX_SEED):
            raise _reject("seed", self.seed, "None or an integer in [0, 2**64)")
        if not (_is_int(self.max_new_tokens) and self.max_new_tokens >= 1):
            raise _reject("max_new_tokens", self.max_new_tokens, "an integer >= 1")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise _reject("stop_token_ids", self.stop_token_ids,
                          "a list of integers >= 0")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise _reject("stop", self.stop, "a list of non-empty strings")
        if not isinstance(self.ignore_eos, bool):
            raise _reject("ignore_eos", self.ignore_eos, "true or false")
        if self.logprobs is not None and not (
                _is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise _reject("logprobs", self.logprobs,
                          f"None or an integer in [0, {MAX_LOGPROBS}]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncates_by_rank(self) -> bool:
        """top-k or top-p is on: the row needs its logits sorted."""
        return self.top_k > 0 or self.top_p < 1.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


# --------------------------------------------------------------------------
# Per-sequence state
# --------------------------------------------------------------------------


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(8), "little")


class SequenceSamplingState:
    """What sampling remembers about one sequence between steps.

    The caller appends each accepted token with `append` (sampling never does,
    so a speculative verifier can accept several tokens per step).

    Token counts are kept incrementally: dicts always (O(1) per token), and,
    only for requests with penalties, a device tensor of size V that is built
    once on first use and then updated per appended token. Cost per step
    therefore does not grow with the sequence length.
    """

    def __init__(self, params: SamplingParams, prompt_token_ids: Sequence[int] = ()):
        self.params = params
        # Recorded so a request without a seed can still be reproduced.
        self.seed: int = params.seed if params.seed is not None else _fresh_seed()
        # only penalties read the prompt's tokens: counting a 100K-token prompt
        # in Python took ~10 ms of every request's time to first token
        self.prompt_counts: dict[int, int] = (dict(Counter(prompt_token_ids))
                                              if params.has_penalties else {})
        self.output_counts: dict[int, int] = {}
        self.num_output_tokens = 0
        self._generators: dict[torch.device, torch.Generator] = {}
        self._seen_mask: torch.Tensor | None = None  # [V] bool: prompt or output
        self._output_count_vec: torch.Tensor | None = None  # [V] float32

    def append(self, token_id: int) -> None:
        """Record a token accepted into the output."""
        token_id = int(token_id)
        self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1
        self.num_output_tokens += 1
        if self._output_count_vec is not None:
            # fill_, not `mask[i] = True`: that copies the scalar from the host
            # with a stream sync, which would hold up a step queued ahead
            self._output_count_vec[token_id] += 1
            self._seen_mask[token_id].fill_(True)

    def with_pending(self, tokens: Sequence[int]) -> "SequenceSamplingState":
        """A copy with `tokens` appended to the counts, for judging a speculative
        draft position as if the drafts before it were generated. It shares the
        generators (draws on it advance this sequence's randomness)."""
        clone = SequenceSamplingState.__new__(SequenceSamplingState)
        clone.params, clone.seed = self.params, self.seed
        clone.prompt_counts = self.prompt_counts
        clone.output_counts = dict(self.output_counts)
        clone.num_output_tokens = self.num_output_tokens
        clone._generators = self._generators
        clone._seen_mask = None if self._seen_mask is None else self._seen_mask.clone()
        clone._output_count_vec = (None if self._output_count_vec is None
                                   else self._output_count_vec.clone())
        for token in tokens:
            clone.append(token)
        return clone

    def skip_draws(self, count: int, vocab_size: int, device: torch.device | str) -> None:
        """Advance past `count` draws made in another process (the prefill worker
        samples a request's first token, the decode worker the rest), so a
        seeded request gives the same tokens as in one process."""
        if self.params.is_greedy:
            return  # greedy rows consume no randomness
        gen = self.generator(torch.device(device))
        for _ in range(count):
            torch.empty(vocab_size, dtype=torch.float32, device=device).exponential_(generator=gen)

    def generator(self, device: torch.device) -> torch.Generator:
        """This sequence's generator on `device`, seeded from `self.seed`.

        One per device because CUDA draws need a CUDA generator; a sequence
        normally only ever uses one.
        """
        device = _canonical_device(device)
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    def penalty_tensors(self, vocab_size: int, device: torch.device
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen mask [V] bool, output counts [V] float32) on `device`."""
        vec = self._output_count_vec
        if vec is None or vec.shape[0] != vocab_size or vec.device != _canonical_device(device):
            self._build_penalty_tensors(vocab_size, device)
        return self._seen_mask, self._output_count_vec

    def _build_penalty_tensors(self, vocab_size: int, device: torch.device) -> None:
        seen = torch.zeros(vocab_size, dtype=torch.bool)
        counts = torch.zeros(vocab_size, dtype=torch.float32)
        ids = [t for t in (*self.prompt_counts, *self.output_counts) if t < vocab_size]
        seen[ids] = True
        for token_id, count in self.output_counts.items():
            if token_id < vocab_size:
                counts[token_id] = count
        self._seen_mask = upload(seen, torch.bool, device)
        self._output_count_vec = upload(counts, torch.float32, device)


def _canonical_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


# --------------------------------------------------------------------------
# Logit processing: penalties -> temperature -> top-k -> top-p -> min-p
# --------------------------------------------------------------------------


def _check_batch(logits: torch.Tensor, states: Sequence[SequenceSamplingState]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(states):
        raise ValueError(
            f"logits must be [batch, vocab] with one row per state; got shape "
            f"{tuple(logits.shape)} for {len(states)} states")


def apply_penalties(logits: torch.Tensor,
                    states: Sequence[SequenceSamplingState]) -> torch.Tensor:
    """float32 copy of `logits` with each row's penalties applied.

    Repetition penalty first (prompt + output), then frequency and presence
    (output only), the order vLLM uses.
    """
    _check_batch(logits, states)
    out = logits.float().clone()
    rows = [i for i, s in enumerate(states) if s.params.has_penalties]
    if not rows:
        return out
    vocab, device = out.shape[1], out.device
    seen, counts = zip(*(states[i].penalty_tensors(vocab, device) for i in rows))
    seen, counts = torch.stack(seen), torch.stack(counts)
    params = [states[i].params for i in rows]
    rep = _column([p.repetition_penalty for p in params], device)
    freq = _column([p.frequency_penalty for p in params], device)
    pres = _column([p.presence_penalty for p in params], device)

    index = _row_index(rows, device)
    x = out.index_select(0, index)
    penalised = torch.where(x > 0, x / rep, x * rep)
    x = torch.where(seen, penalised, x)
    x = x - freq * counts - pres * (counts > 0).float()
    return out.index_copy_(0, index, x)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return upload(values, torch.float32, device).unsqueeze(1)


def _row_index(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row numbers as a device index. Indexing a CUDA tensor with a Python
    list uploads the list with a stream sync, which would stall a decode
    step queued ahead of the host (engine/run_ahead.py)."""
    return upload(rows, torch.long, device)


def _mask_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Drop tokens whose prob < min_p * max prob, per row of logits [n, V].

    Masks logits rather than renormalising probs: a row-sum can be split
    across threads differently for a lone row than for a batch, which would
    break batch invariance; softmax and amax are computed per row.
    """
    if all(p.min_p == 0 for p in params):
        return logits  # a zero threshold keeps every token anyway
    min_p = _column([p.min_p for p in params], logits.device)
    probs = torch.softmax(logits, dim=-1)
    keep = probs >= min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(~keep, -math.inf)


def _plain_logits(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Rows without top-k/top-p: only min-p, so no sort is needed."""
    return _mask_min_p(scaled, params)


def _truncated_logits(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Rows with top-k and/or top-p: filter in descending-sorted order.

    A stable sort puts the lowest index first among ties, so top_k=1 keeps
    the same token argmax picks. Each filter judges the distribution left by
    the previous one (Hugging Face warper semantics).
    """
    vocab, device = scaled.shape[1], scaled.device
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=device).unsqueeze(0)

    k = upload([p.top_k if p.top_k > 0 else vocab for p in params], torch.long,
               device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(rank >= k, -math.inf)

    probs = torch.softmax(sorted_logits, dim=-1)
    top_p = _column([p.top_p for p in params], device)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    # Keep the smallest prefix reaching top_p; top_p == 1 keeps everything
    # (rounding could otherwise push mass_before of far-tail tokens to 1.0).
    keep = (mass_before < top_p) | (top_p >= 1.0)
    sorted_logits = sorted_logits.masked_fill(~keep, -math.inf)

    sorted_logits = _mask_min_p(sorted_logits, params)
    return torch.full_like(scaled, -math.inf).scatter_(1, order, sorted_logits)


def _one_hot_argmax(penalised: torch.Tensor) -> torch.Tensor:
    probs = torch.zeros_like(penalised)
    return probs.scatter_(1, penalised.argmax(dim=-1, keepdim=True), 1.0)


def _distribution(penalised: torch.Tensor,
                  states: Sequence[SequenceSamplingState]) -> torch.Tensor:
    """Final per-row distribution from penalised float32 logits.

    Rows are grouped by the work they ask for (greedy / sorted truncation /
    plain) so a row's arithmetic never depends on its batch-mates.
    """
    probs = torch.empty_like(penalised)
    groups: dict[str, list[int]] = {"greedy": [], "truncated": [], "plain": []}
    for i, state in enumerate(states):
        p = state.params
        kind = "greedy" if p.is_greedy else "truncated" if p.truncates_by_rank else "plain"
        groups[kind].append(i)

    device = penalised.device
    if groups["greedy"]:
        index = _row_index(groups["greedy"], device)
        probs.index_copy_(0, index, _one_hot_argmax(penalised.index_select(0, index)))
    for kind, filter_logits in (("truncated", _truncated_logits),
                                ("plain", _plain_logits)):
        rows = groups[kind]
        if rows:
            params = [states[i].params for i in rows]
            temperature = _column([p.temperature for p in params], device)
            index = _row_index(rows, device)
            kept = filter_logits(penalised.index_select(0, index) / temperature, params)
            probs.index_copy_(0, index, torch.softmax(kept, dim=-1))
    return probs


def processed_probs(logits: torch.Tensor,
                    states: Sequence[SequenceSamplingState]) -> torch.Tensor:
    """The distribution each row's next token is drawn from: [B, V] float32.

    penalties -> temperature -> top-k -> top-p -> min-p; greedy rows are
    one-hot at the argmax of their penalised logits.

    The speculative verifier (engine/speculative/acceptance.py) calls this
    on the target's logits (p) and the MTP drafter on its own (q).
    """
    _check_batch(logits, states)
    return _distribution(apply_penalties(logits, states), states)


# --------------------------------------------------------------------------
# Drawing
# --------------------------------------------------------------------------


def _draw_tokens(probs: torch.Tensor,
                 states: Sequence[SequenceSamplingState]) -> torch.Tensor:
    """One token per row: argmax(probs / E), E ~ Exp(1) from the row's generator.

    The exponential race selects token i with probability probs[i], and since
    each row's noise comes only from its own generator, a row's token does not
    depend on the batch. Greedy rows (one-hot) take argmax and consume no
    randomness.
    """
    noise = torch.ones_like(probs)
    for i, state in enumerate(states):
        if not state.params.is_greedy:
            noise[i].exponential_(generator=state.generator(probs.device))
    # Exp(1) can return 0 in float32; 0/0 would be NaN and win the argmax.
    noise.clamp_(min=torch.finfo(torch.float32).tiny)
    return (probs / noise).argmax(dim=-1)


@dataclass
class SampleResult:
    """Per-row outcome of one sampling step.

    logprobs[i]: the chosen token's logprob, or None when the request did not
    ask for logprobs. top_logprobs[i]: the request's k most likely
    (token_id, logprob) pairs, most likely first ([] for logprobs=0, None when
    off).
    """

    token_ids: list[int]
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)


def plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing to add: no penalties, no logprobs."""
    return params.is_greedy and not params.has_penalties and params.logprobs is None


def draw(logits: torch.Tensor, states: Sequence[SequenceSamplingState]) -> torch.Tensor:
    """sample()'s token per row of `logits`, left on the device [B] long:
    nothing in it waits for the GPU, so the next decode step can be queued on
    these tokens before the host reads them (engine/run_ahead.py). Advances
    the generators of non-greedy rows."""
    _check_batch(logits, states)
    if all(plain_greedy(s.params) for s in states):
        # one argmax launch where the general path makes ~11 over the vocabulary
        # (cast, clone, one-hot, noise, divide, argmax) for the same index:
        # the float cast keeps bf16's order, and both take a tie's first index
        return logits.argmax(dim=-1)
    return _draw_tokens(_distribution(apply_penalties(logits, states), states), states)


@dataclass
class Picks:
    """One sampling step's outcome as tensors, where they were computed (the
    logits' device) until moved: the token per row, and the logprobs of the
    rows that asked for them.

    Logprobs are of the model's raw distribution: log_softmax of the
    unprocessed float32 logits (no penalties, temperature or truncation).
    Chosen deliberately: they describe what the model thinks, are comparable
    across requests with different sampling settings, and are never -inf for
    a chosen token (as truncation could make them). This matches what vLLM
    reports by default.
    """

    token_ids: torch.Tensor  # [B] long
    asked: list[tuple[int, int]] = field(default_factory=list)  # (row, k) of rows that asked
    chosen: torch.Tensor | None = None  # [len(asked)]: each asking row's token's logprob
    top_ids: torch.Tensor | None = None  # [len(asked), k_max]: most likely first
    top_vals: torch.Tensor | None = None

    def moved(self, move) -> "Picks":
        """The same picks with each tensor passed through `move`."""
        def apply(t):
            return None if t is None else move(t)
        return Picks(move(self.token_ids), self.asked, apply(self.chosen),
                     apply(self.top_ids), apply(self.top_vals))

    def result(self) -> SampleResult:
        """As Python lists (reads the tensors: a sync where they are on a GPU)."""
        n = self.token_ids.shape[0]
        result = SampleResult(token_ids=self.token_ids.tolist(), logprobs=[None] * n,
                              top_logprobs=[None] * n)
        if not self.asked:
            return result
        chosen = self.chosen.tolist()
        # no top tensors only when every asking row wants k = 0 (pick's k_max)
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        top_vals = self.top_vals.tolist() if self.top_vals is not None else None
        for j, (row, k) in enumerate(self.asked):
            result.logprobs[row] = chosen[j]
            result.top_logprobs[row] = list(zip(top_ids[j][:k], top_vals[j][:k])) if k else []
        return result


def pick(logits: torch.Tensor, states: Sequence[SequenceSamplingState]) -> Picks:
    """draw()'s tokens and the logprobs asked for, left on the device:
    nothing in it waits for the GPU either."""
    token_ids = draw(logits, states)
    asked = [(i, s.params.logprobs) for i, s in enumerate(states) if s.params.logprobs is not None]
    if not asked:
        return Picks(token_ids)
    index = _row_index([row for row, _ in asked], logits.device)
    logp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen = logp.gather(1, token_ids.index_select(0, index).unsqueeze(1)).squeeze(1)
    k_max = min(max(k for _, k in asked), logp.shape[1])
    top_vals, top_ids = logp.topk(k_max, dim=-1) if k_max else (None, None)
    return Picks(token_ids, asked, chosen, top_ids, top_vals)


def sample(logits: torch.Tensor,
           states: Sequence[SequenceSamplingState]) -> SampleResult:
    """Pick one token per row of `logits` [B, V] (bf16 or float32, any device),
    with the logprobs each row asked for (see Picks).

    Advances the generators of non-greedy rows; does not append the tokens to
    the states (the caller does, once it accepts them).
    """
    return pick(logits, states).result()
