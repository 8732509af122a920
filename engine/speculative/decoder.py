"""One speculative decode step over the paged interface, in three calls:

  verify(seqs)   one target forward of [last token, *drafts] per sequence, the
                 GDN state after every verified token written to its own slot;
                 acceptance per sequence (acceptance.py).
  commit(seq, v, kept)
                 after the caller kept `kept` tokens (fewer than verified when
                 a stop rule fired): select the slot holding the state of the
                 kept prefix by swapping slot ids (no copy, no replay); queue
                 the MTP head's catch-up pairs.
  draft(seqs)    propose the next step's drafts (MTP head or prompt lookup).

A sequence is any object with `prompt`, `output`, `pages`, `state_slot`,
`sampling` and `spec` (a SpecState, or None for a sequence that does not
speculate: it runs one token per step exactly as plain decoding does, in the
same batch). Full-attention KV written for rejected drafts is simply
overwritten by later steps.

The MTP invariant: between steps, the MTP layer's KV holds the pairs
(h_p, token p+1) for every position p < length - 1 (prefill writes the
prompt's, `commit` queues the step's and `draft` runs them first).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.batch import ForwardBatch, SequenceInput
from engine.cache import PagedKVCache
from engine.cuda_graphs import DraftForward, VerifyForward
from engine.kv.open_pages import page_table_of, prepare_pages
from engine.model import CausalLM
from engine.sampling import processed_probs
from engine.speculative.acceptance import accept_greedy, accept_sampled, draw, target_probs
from engine.speculative.config import SpeculativeConfig
from engine.speculative.ngram import NgramIndex
from engine.uploads import upload


@dataclass
class SpecState:
    """What speculation remembers about one sequence between steps."""

    spare_slots: list[int]  # GDN slots for the states after draft positions 1..k
    drafts: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [len(drafts), V] when drafts were sampled
    ngram: NgramIndex | None = None
    # MTP pairs not yet run: (position of the first, next tokens, target hidden rows)
    pending: tuple[int, list[int], torch.Tensor] | None = None
    steps: int = 0  # target forwards of this sequence
    drafted: int = 0
    accepted: int = 0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per target forward, counting the target's own token."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


@dataclass
class Verified:
    """One sequence's outcome of a verify forward."""

    tokens: list[int]  # kept drafts, then the target's own token
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]
    num_drafts: int
    num_accepted: int
    base: int  # tokens in the cache before the step
    live_slot: int
    position_slots: tuple[int, ...]  # slot of the state after verified token j
    hidden: torch.Tensor | None  # target hidden of the verified tokens [m+1, H] (MTP only)

    def state_slot_covering(self, tokens: int) -> int | None:
        """The slot whose GDN state covers the first `tokens` tokens, if this step
        computed it (valid until the next step)."""
        j = tokens - self.base - 1
        if not self.position_slots:
            return self.live_slot if j == 0 else None
        return self.position_slots[j] if 0 <= j < len(self.position_slots) else None


class SpeculativeDecoder:
    def __init__(self, model: CausalLM, cache: PagedKVCache, config: SpeculativeConfig,
                 max_context: int | None = None, cuda_graphs: bool | None = None,
                 graph_pool_of=None) -> None:
        config.check_model(model.config)
        if config.uses_mtp and cache.shape.mtp_layers < model.config.mtp_num_layers:
            raise ValueError("--speculative mtp needs the cache laid out with the MTP layers' "
                             "KV pools (CacheShape.mtp_layers)")
        self.model, self.cache, self.config = model, cache, config
        self.page_size = cache.page_size
        self.hybrid = model.config.is_hybrid
        self.max_context = max_context or model.config.max_position_embeddings
        # verify batches of k+1 tokens per sequence replay CUDA graphs on a GPU
        # (None: on for CUDA caches), in the decode graphs' pool when given
        self.verify_forward = VerifyForward(model, cache, self.max_context, enabled=cuda_graphs,
                                            pool_of=graph_pool_of)
        # and the MTP head's drafting forwards, in the same pool
        self.draft_forward = (DraftForward(model, cache, self.max_context, enabled=cuda_graphs,
                                           pool_of=self.verify_forward)
                              if config.uses_mtp else None)

    # --- membership -----------------------------------------------------
    def start(self, seq, spare_slots: Sequence[int] = ()) -> SpecState:
        """Speculation state for a sequence joining the batch (after prefill)."""
        needed = self.config.spare_slots(self.model.config)
        if len(spare_slots) < needed:
            raise ValueError(f"speculation with k={self.config.num_draft_tokens} on a hybrid "
                             f"model needs {needed} spare GDN slots per sequence, got "
                             f"{len(spare_slots)}")
        state = SpecState(spare_slots=list(spare_slots))
        if self.config.method == "ngram":
            state.ngram = NgramIndex([*seq.prompt, *seq.output], self.config.ngram_min,
                                     self.config.ngram_max)
        return state

    def draft_cap(self, seq) -> int:
        """Drafts the next step may verify: k, but never past max_new_tokens, the
        context or the pages the sequence holds (so speculation needs no more
        pages than plain decoding would)."""
        length = len(seq.prompt) + len(seq.output)
        return max(0, min(self.config.num_draft_tokens,
                          seq.sampling.params.max_new_tokens - len(seq.output) - 1,
                          self.max_context - length - 1,
                          len(seq.pages) * self.page_size - length))

    # --- verify ---------------------------------------------------------
    def verify(self, seqs: Sequence) -> list[Verified]:
        inputs, slots = [], []
        for seq in seqs:
            drafts = seq.spec.drafts if seq.spec is not None else []
            position_slots = ()
            if drafts and self.hybrid:
                position_slots = (seq.state_slot, *seq.spec.spare_slots[:len(drafts)])
            length = len(seq.prompt) + len(seq.output)
            table = prepare_pages(seq, self.cache, length - 1, length + len(drafts),
                                  prefill=False)
            inputs.append(SequenceInput((seq.output[-1], *drafts), length - 1, table,
                                        seq.state_slot, position_slots))
            slots.append(position_slots)
        batch = ForwardBatch.build(inputs, self.page_size, self.cache.device)
        logits, hidden = self.verify_forward(batch)
        if not self.config.uses_mtp:
            hidden = None
        choices = _raw_argmax(logits, seqs)
        results = []
        for i, seq in enumerate(seqs):
            lo, hi = batch.offsets[i], batch.offsets[i + 1]
            results.append(self._accept(seq, inputs[i], slots[i], logits[lo:hi],
                                        None if hidden is None else hidden[lo:hi],
                                        None if choices is None else choices[lo:hi]))
        return results

    def _accept(self, seq, inp: SequenceInput, position_slots, logits, hidden,
                raw_choices) -> Verified:
        spec = seq.spec
        drafts = list(inp.tokens[1:])
        state = seq.sampling
        if state.params.is_greedy:
            accepted = accept_greedy(logits, state, drafts, raw_choices)
        else:
            p = target_probs(logits, state, drafts)
            q = spec.draft_probs if spec is not None else None
            accepted = accept_sampled(p, drafts, q, state.generator(logits.device))
        logprobs, top = _logprobs(logits, accepted.tokens, state.params.logprobs)
        return Verified(accepted.tokens, logprobs, top, len(drafts), accepted.num_drafts_accepted,
                        inp.start, inp.state_slot, position_slots, hidden)

    # --- commit ---------------------------------------------------------
    def commit(self, seq, v: Verified, kept: int) -> None:
        """The caller appended v.tokens[:kept] to seq.output (stop rules may cut
        the step short). Make the sequence's slot hold the state of its kept
        prefix and remember the MTP pairs to run."""
        if not 1 <= kept <= len(v.tokens):
            raise ValueError(f"kept {kept} of {len(v.tokens)} verified tokens")
        spec = seq.spec
        if spec is None:
            return
        if v.position_slots and kept > 1:
            # the state after the last cached token is in position slot kept-1:
            # it becomes the live slot, the old live slot a spare
            chosen = v.position_slots[kept - 1]
            spare = spec.spare_slots.index(chosen)
            spec.spare_slots[spare], seq.state_slot = seq.state_slot, chosen
            # the sequence's own list too: whoever gives its slots back reads
            # it (the offline engine gave back the old live slot twice and
            # lost the new one, so a later sequence shared a slot with another)
            seq.spare_slots = list(spec.spare_slots)
        spec.steps += 1
        spec.drafted += v.num_drafts
        # a step cut short by a stop rule may keep only drafts; its last kept
        # token still counts as the step's own, so that accepted + steps is
        # the tokens emitted and the mean accepted length is tokens per
        # target forward (the router counts stop strings the same way)
        spec.accepted += min(v.num_accepted, kept - 1)
        spec.drafts, spec.draft_probs = [], None
        if spec.ngram is not None:
            spec.ngram.extend(v.tokens[:kept])
        if v.hidden is not None:
            # pair (h_p, token p+1) for each newly cached position p
            spec.pending = (v.base, list(v.tokens[:kept]), v.hidden[:kept])

    # --- draft ----------------------------------------------------------
    def draft(self, seqs: Sequence) -> None:
        """Fill seq.spec.drafts for the next step."""
        seqs = [s for s in seqs if s.spec is not None]
        if self.config.uses_mtp:
            self._draft_mtp(seqs)
        elif self.config.method == "ngram":
            for seq in seqs:
                seq.spec.drafts = seq.spec.ngram.propose(self.draft_cap(seq))

    def run_pairs(self, pages: Sequence[int], start: int, next_tokens: Sequence[int],
                  hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP pairs of one sequence at positions start.. (prefill fills the
        prompt's MTP KV with this). Returns (logits of the last pair, outputs)."""
        seq = SequenceInput(tuple(next_tokens), start, tuple(pages))
        batch = ForwardBatch.build([seq], self.page_size, self.cache.device)
        return self.model.mtp_forward(batch, hidden, self.cache)

    def _draft_mtp(self, seqs: Sequence) -> None:
        """Catch-up pairs and draft 1 in one MTP forward; then one single-token
        MTP forward per further draft, on the MTP's own output."""
        ready = [s for s in seqs if s.spec.pending is not None]
        if not ready:
            return
        inputs, hiddens = [], []
        for seq in ready:
            start, tokens, hidden = seq.spec.pending
            inputs.append(SequenceInput(tuple(tokens), start, page_table_of(seq)))
            hiddens.append(hidden)
            seq.spec.pending = None
        caps = [self.draft_cap(s) for s in ready]
        batch = ForwardBatch.build(inputs, self.page_size, self.cache.device)
        logits, out = self.draft_forward(batch, torch.cat(hiddens))
        hidden = out.index_select(0, batch.last_token_indices())
        positions = [inp.end - 1 for inp in inputs]  # of each sequence's last pair
        probs: list[list[torch.Tensor]] = [[] for _ in ready]
        rows = list(range(len(ready)))  # row of logits/hidden -> sequence
        r = 0
        while rows:
            choices = _raw_argmax(logits, [ready[i] for i in rows], float_logits=False)
            for row, i in enumerate(rows):
                if caps[i] <= r:  # no room for a draft (its catch-up pairs still ran)
                    continue
                token, q = self._draw_draft(ready[i], logits[row],
                                            None if choices is None else choices[row])
                ready[i].spec.drafts.append(token)
                if q is not None:
                    probs[i].append(q)
            r += 1
            keep = [row for row, i in enumerate(rows) if caps[i] > r]
            if not keep:
                break
            rows = [rows[row] for row in keep]
            # the next pair: (the MTP's own output, the draft just made), one position on
            step = [SequenceInput((ready[i].spec.drafts[-1],), positions[i] + r,
                                  page_table_of(ready[i])) for i in rows]
            batch = ForwardBatch.build(step, self.page_size, self.cache.device)
            index = upload(keep, torch.long, hidden.device)
            logits, hidden = self.draft_forward(batch, hidden.index_select(0, index))
        for i, seq in enumerate(ready):
            if probs[i]:
                seq.spec.draft_probs = torch.stack(probs[i])

    @staticmethod
    def _draw_draft(seq, logits: torch.Tensor,
                    argmax: int | None = None) -> tuple[int, torch.Tensor | None]:
        """Greedy requests draft the MTP's argmax (`argmax`, when the caller
        took it for every row at once); sampled ones draw from the MTP's
        processed distribution q (kept for the accept rule)."""
        state = seq.sampling
        if state.params.is_greedy:
            return (int(logits.argmax()) if argmax is None else argmax), None
        q = processed_probs(logits[None], [state])[0]
        return draw(q, state.generator(logits.device)), q


def _raw_argmax(logits: torch.Tensor, seqs, float_logits: bool = True) -> list[int] | None:
    """Every row's argmax in one device sync, when some sequence is greedy
    (a sync per sequence and draft drains the GPU's queue each time); None
    when none is."""
    if not any(s.sampling.params.is_greedy for s in seqs):
        return None
    return (logits.float() if float_logits else logits).argmax(dim=-1).tolist()


def _logprobs(logits: torch.Tensor, tokens: list[int], wanted: int | None):
    """Raw-distribution logprobs of the kept tokens (as sampling reports them)."""
    n = len(tokens)
    if wanted is None:
        return [None] * n, [None] * n
    logp = torch.log_softmax(logits[:n].float(), dim=-1)
    chosen = logp[torch.arange(n), torch.tensor(tokens)].tolist()
    k = min(wanted, logp.shape[1])
    if not k:
        return chosen, [[] for _ in range(n)]
    vals, ids = logp.topk(k, dim=-1)
    return chosen, [list(zip(ids[j].tolist(), vals[j].tolist())) for j in range(n)]
