"""One prefill, minus the RPC: restore the cached prefix's state, run the
uncached suffix in bounded chunks into the request's pages, take the GDN
snapshots the router asked for, and sample the first token."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from engine.batch import ForwardBatch, SequenceInput
from engine.cache import PagedKVCache
from engine.chunking import prefill_chunks
from engine.errors import InvalidRequestError
from engine.kv.open_pages import OpenPages
from engine.model import CausalLM
from engine.sampling import SamplingParams, SampleResult, SequenceSamplingState, sample
from engine.vocabulary import first_outside_vocabulary


@dataclass(frozen=True, eq=False)  # no ==: an array has no single truth value
class PrefillJob:
    request_id: str
    # the whole prompt's ids as an int array (a sequence given is made one):
    # the worker hands over a view of the request's packed bytes, so of a
    # 100K-token prompt only the chunks that run become Python ints
    tokens: np.ndarray
    start: int  # tokens already in the pages (and in restore_slot's state)
    pages: tuple[int, ...]
    state_slot: int
    restore_slot: int = -1
    snapshots: tuple[tuple[int, int], ...] = ()  # (page-aligned token count, slot)
    params: SamplingParams = field(default_factory=SamplingParams)
    # staging page ids (>= the pool's num_pages) for the open pages of a KV
    # format that quantizes whole pages (rk4p); its sink pages are in `pages`
    open_pages: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", np.asarray(self.tokens))

    def check(self, page_size: int, vocab_size: int) -> None:
        n = len(self.tokens)
        if not 0 <= self.start < n:
            raise InvalidRequestError(f"prefill start {self.start} must be in [0, {n})")
        if len(self.pages) * page_size < n:
            raise InvalidRequestError(f"{len(self.pages)} pages cannot hold {n} tokens")
        for count, _slot in self.snapshots:
            if count % page_size or not self.start < count <= n:
                raise InvalidRequestError(f"snapshot at {count} tokens is not a page boundary "
                                          f"in ({self.start}, {n}]")
        self._check_snapshot_points()
        bad = first_outside_vocabulary(self.tokens, vocab_size)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")

    def _check_snapshot_points(self) -> None:
        """One slot per point and one point per slot. Two slots for one token
        count merged into one (the other slot, which the router then caches as
        a snapshot, never got the state); one slot for two counts keeps only
        the later state under the earlier count's name; a snapshot into the
        live slot is overwritten as the prefill goes on. (The restored slot
        may take a snapshot: it is read once, before the first chunk, and the
        warm-up's jobs do so.)"""
        counts = [count for count, _slot in self.snapshots]
        twice = _first_repeated(counts)
        if twice is not None:
            raise InvalidRequestError(f"two snapshots at {twice} tokens: one slot per snapshot "
                                      "point")
        slots = [slot for _count, slot in self.snapshots]
        twice = _first_repeated(slots)
        if twice is not None:
            raise InvalidRequestError(f"state slot {twice} is the slot of two snapshot points")
        if self.state_slot >= 0 and self.state_slot in slots:
            raise InvalidRequestError(f"snapshot slot {self.state_slot} is the job's live state "
                                      "slot: a snapshot needs a slot of its own")

    def check_ids(self, cache: PagedKVCache) -> None:
        """Every page and state slot id names one of `cache`'s: the kernels
        index the pools with them unchecked (on a GPU a bad id reads or writes
        another allocation's memory; a negative slot is the last one, another
        request's). The worker checks them as a request arrives."""
        cache.check_page_ids(self.pages)
        if not cache.config.is_hybrid:  # no GDN state: the slot fields are never read
            return
        cache.check_state_slot(self.state_slot, "state_slot")
        cache.check_state_slot(self.restore_slot, "restore_slot", optional=True)
        for _count, slot in self.snapshots:
            cache.check_state_slot(slot, "snapshot slot")


def _first_repeated(values):
    seen = set()
    for value in values:
        if value in seen:
            return value
        seen.add(value)
    return None


@torch.inference_mode()
def run_prefill(model: CausalLM, cache: PagedKVCache, job: PrefillJob, chunk_size: int,
                between_chunks: Callable[[], None] = lambda: None,
                chunk_starts: Callable[[int, bool], None] | None = None,
                open_pages: OpenPages | None = None) -> SampleResult:
    """Runs `job`; `between_chunks` is called after each chunk (the worker
    yields the GPU there and checks for cancellation); `chunk_starts(end,
    last)` before each chunk's forward (a transfer listening on the cache's
    writes then knows which pages each layer's write makes final).
    `open_pages` (cache.open_pages_for(job.open_pages, job.pages), for a
    format that quantizes whole pages) is left as the decode must resume it:
    every whole prompt page is final in job.pages, the newest still staged."""
    job.check(cache.page_size, model.config.vocab_size)
    job.check_ids(cache)
    if cache.kv_format.uses_staging and open_pages is None:
        raise InvalidRequestError(f"KV format {cache.kv_format.name} needs the job's open pages")
    if job.restore_slot >= 0:
        cache.copy_state(job.restore_slot, job.state_slot)
    snapshot_slot = dict(job.snapshots)  # no count twice: job.check
    mtp = cache.has_mtp_kv and model.mtp is not None
    logits = hidden = None
    n = len(job.tokens)
    table = job.pages
    for chunk in prefill_chunks(job.start, n, chunk_size, sorted(snapshot_slot)):
        if open_pages is not None:
            table = open_pages.prepare(cache, job.pages, chunk.start, chunk.end, prefill=True)
        inner = chunk.inner_snapshot
        seq = SequenceInput(_as_tokens(job.tokens[chunk.start:chunk.end]), chunk.start, table,
                            job.state_slot,
                            snapshot=None if inner is None else (inner, snapshot_slot[inner]))
        batch = ForwardBatch.build([seq], cache.page_size, cache.device)
        if chunk_starts is not None:
            chunk_starts(chunk.end, chunk.end == n)
        if mtp:
            logits, hidden = model(batch, cache, return_hidden=True)
            _mtp_pairs(model, cache, table, chunk.start,
                       _as_tokens(job.tokens[chunk.start + 1:chunk.end + 1]), hidden)
        else:
            logits = model(batch, cache)
        if chunk.snapshot:
            cache.copy_state(job.state_slot, snapshot_slot[chunk.end])
        between_chunks()
    # only penalties read the prompt's ids (as ints): the whole prompt becomes
    # Python ints only for them
    prompt = job.tokens.tolist() if job.params.has_penalties else ()
    result = sample(logits, [SequenceSamplingState(job.params, prompt)])
    if mtp:  # the prompt's last pair needs the first token
        _mtp_pairs(model, cache, table, n - 1, (result.token_ids[0],), hidden[-1:])
    if open_pages is not None:  # the prefix cache takes the prompt's whole pages next
        open_pages.flush(cache, job.pages, n)
    return result


def _as_tokens(ids: np.ndarray) -> tuple[int, ...]:
    """A slice of the prompt's array as a forward takes tokens (Python ints)."""
    return tuple(ids.tolist())


def _mtp_pairs(model: CausalLM, cache: PagedKVCache, table, start: int, next_tokens,
               hidden) -> None:
    """The MTP layer's KV for pairs (h_p, token p+1), p = start.. (speculative
    decoding with the MTP drafter expects it for every position before the
    decode's first)."""
    if not next_tokens:
        return
    seq = SequenceInput(tuple(next_tokens), start, tuple(table))
    model.mtp_forward(ForwardBatch.build([seq], cache.page_size, cache.device),
                      hidden[:len(next_tokens)], cache)
