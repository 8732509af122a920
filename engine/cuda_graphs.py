"""Decode and speculative verify forwards replayed from CUDA graphs, one graph
per (batch-size bucket, tokens per sequence).

A decode step launches hundreds of small kernels; at batch 1 the launch cost
is a large part of the step. `DecodeForward` records the step once per bucket
into a CUDA graph over static input buffers and replays it afterwards;
`VerifyForward` does the same for verify batches where every sequence runs
k+1 tokens (the speculative decoder's common case), with the logits and
hidden states of every row as the graph's outputs.

How a forward fits a fixed graph:
- inputs live in static buffers (token ids, positions, KV slots, state slots,
  the GDN read/write slots, KV lengths and a page table as wide as
  `max_context`);
- a batch smaller than its bucket is padded by repeating its last sequence:
  the copy has the same tokens, positions and K/V slots and writes the same
  K/V to the same places, so padding needs no scratch pages or slots. The
  fused GDN steps do not compute copies (a copy could read the slot its
  original has already written): the copies take the original's output rows;
- attention uses a fixed number of key splits per bucket, and the kernels read
  lengths and page tables from device memory, so one graph serves every
  context length up to max_context.

The first forward of a bucket runs eagerly (that is the warm-up: Triton
kernels compile and fla autotunes at the exact shapes) and is then captured;
later ones replay. Anything else (prefill, ragged verify batches, CPU
tensors, batches beyond the largest bucket) takes the eager forward.
CUDA-only by nature; on the CPU both are plain calls of the model.
"""
from __future__ import annotations

import sys
from dataclasses import replace

import torch

from engine.batch import ForwardBatch, GdnSlots, SequenceInput
from engine.cache import PagedKVCache
from engine.kv.attention import AttentionMetadata, tiles_for
from engine.model import CausalLM

# Every batch size has its own graph (they share one memory pool), so no batch
# is padded by default. Padded buckets (custom ones) replay correctly in bf16
# on the H200 (2026-12-01, 23:32 UTC); the disagreement first blamed on
# padding was the fp32 replay question of BENCHMARKS.md, exact buckets too.
DEFAULT_BUCKETS = tuple(range(1, 33))
VERIFY_BUCKETS = (1, 2, 4, 8, 16, 32)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """DEFAULT_BUCKETS and, past 32, padded buckets up to `max_batch`
    (48, 64, 96, 128, ... and max_batch itself): for the offline engine's
    wide batches, which otherwise ran eagerly, one Python launch at a time
    (train-mtp's answering at batch 128-256)."""
    wide, b = set(), 32
    while b < max_batch:
        wide |= {w for w in (b + b // 2, 2 * b) if w < max_batch}
        b *= 2
    if max_batch > DEFAULT_BUCKETS[-1]:
        wide.add(max_batch)
    return DEFAULT_BUCKETS + tuple(sorted(wide))


class _Graph:
    """One captured bucket: `size` sequences of `tokens` new tokens each, its
    static buffers, graph and outputs."""

    def __init__(self, size: int, tokens: int, pages: int, device: torch.device,
                 num_splits: int, max_context: int, page_size: int) -> None:
        with torch.inference_mode(False):  # see _allocate_buffers
            self._allocate_buffers(size, tokens, pages, device)
        self.num_splits = num_splits
        self.max_context = max_context
        self.page_size = page_size
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, ...] = ()

    def _allocate_buffers(self, size: int, tokens: int, pages: int, device: torch.device) -> None:
        # Normal tensors, not inference tensors: fill() must be able to update
        # them whether or not the caller runs under torch.inference_mode.
        longs = dict(dtype=torch.long, device=device)
        rows = size * tokens
        self.size, self.tokens = size, tokens
        self.input_ids = torch.zeros(rows, **longs)
        self.positions = torch.zeros(rows, **longs)
        self.kv_slots = torch.zeros(rows, **longs)
        self.state_slots = torch.zeros(size, **longs)
        self.gdn_read = torch.zeros(size, **longs)
        self.gdn_write = torch.full((rows,), -1, **longs)
        self.gdn_rows = torch.arange(rows, **longs)
        self._identity_rows = torch.arange(rows, **longs)
        self.kv_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(size, pages, dtype=torch.int32, device=device)
        self.q_offsets = torch.arange(0, rows + 1, tokens, dtype=torch.int32, device=device)
        # each sequence's last row: static, so no capture records a tensor the
        # forward would otherwise build (and free) on its first use
        self.last_rows = torch.arange(tokens - 1, rows, tokens, **longs)
        self.input_embeds: torch.Tensor | None = None  # [rows, H], with a host token table
        self.hidden: torch.Tensor | None = None  # [rows, H]: the MTP head's target hidden
        self.static: ForwardBatch | None = None  # the batch the graph was recorded from

    def fill(self, batch: ForwardBatch, hidden: torch.Tensor | None = None) -> None:
        """Copies the batch (and the MTP head's hidden rows) into the static
        buffers, padding with copies of its last sequence: same tokens,
        positions, K/V slots and pages, so the copy
        writes what the original writes. The fused GDN steps skip the copies
        (read slot -1, nothing written) and give them the original's output
        rows: a copy run after its original had written the shared slot would
        read the new state (the unfused path reads every slot before it writes)."""
        n, t = len(batch.seqs), self.tokens
        pad = self.size - n

        def padded(x: torch.Tensor, width: int = 1) -> torch.Tensor:
            if not pad:
                return x
            return torch.cat([x, x[-width:].repeat(pad, *([1] * (x.dim() - 1)))])

        meta = batch.attention
        self.input_ids.copy_(padded(batch.input_ids, t))
        self.positions.copy_(padded(batch.positions, t))
        self.kv_slots.copy_(padded(batch.kv_slots, t))
        self.state_slots.copy_(padded(batch.state_slots))
        self.kv_lens.copy_(padded(meta.kv_lens))
        width = meta.page_table.shape[1]
        self.page_table[:, :width].copy_(padded(meta.page_table))
        if batch.seqs[0].state_slot >= 0:  # hybrid models: GDN slots
            self.gdn_read[:n].copy_(batch.state_slots)
            self.gdn_read[n:].fill_(-1)
            self.gdn_write[:n * t].copy_(batch.gdn.write)
            self.gdn_write[n * t:].fill_(-1)
            self.gdn_rows.copy_(padded(self._identity_rows[:n * t], t))
        if batch.input_embeds is not None:  # a host token table: looked up before the graph
            if self.input_embeds is None:
                with torch.inference_mode(False):
                    self.input_embeds = torch.empty(self.size * t, batch.input_embeds.shape[1],
                                                    dtype=batch.input_embeds.dtype,
                                                    device=self.input_ids.device)
            self.input_embeds.copy_(padded(batch.input_embeds, t))
        if hidden is not None:
            if self.hidden is None:
                with torch.inference_mode(False):
                    self.hidden = torch.empty(self.size * t, hidden.shape[1], dtype=hidden.dtype,
                                              device=self.input_ids.device)
            self.hidden.copy_(padded(hidden, t))

    def batch(self, seqs: list[SequenceInput]) -> ForwardBatch:
        """A ForwardBatch whose tensors are the static buffers."""
        size, t = self.size, self.tokens
        offsets = list(range(0, size * t + 1, t))
        meta = AttentionMetadata(
            q_offsets=self.q_offsets, kv_lens=self.kv_lens, page_table=self.page_table,
            max_new_tokens=t, max_kv_len=self.max_context,
            host_offsets=offsets, host_kv_lens=[self.max_context] * size,
            page_tables=[], num_splits=self.num_splits)
        padded = seqs + [seqs[-1]] * (size - len(seqs))
        return ForwardBatch(seqs=padded, page_size=self.page_size, input_ids=self.input_ids,
                            positions=self.positions, kv_slots=self.kv_slots, page_tables=[],
                            state_slots=self.state_slots, offsets=offsets, _attention=meta,
                            _last_rows=self.last_rows, input_embeds=self.input_embeds,
                            # a bucket of one is never padded: no row copy to capture
                            _gdn=GdnSlots(self.gdn_read, self.gdn_write,
                                          self.gdn_rows if size > 1 else None))


class _Pool:
    """One CUDA graph memory pool, made at the first capture. Graphs that share
    it may reuse each other's intermediates, so their outputs are only valid
    until the next replay of any of them (callers consume or clone them)."""

    def __init__(self) -> None:
        self._handle = None

    def handle(self):
        if self._handle is None:
            self._handle = torch.cuda.graph_pool_handle()
        return self._handle


class _GraphedForward:
    """Buckets of captured forwards over (batch size, tokens per sequence): the
    first batch of a bucket runs eagerly (the warm-up: Triton kernels compile
    at the exact shapes) and is then captured; later ones replay."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, max_context: int,
                 buckets: tuple[int, ...], enabled: bool | None,
                 pool_of: "_GraphedForward | None" = None) -> None:
        self.model, self.cache = model, cache
        self.max_context = max_context
        self.buckets = tuple(sorted(buckets))
        self.enabled = cache.device.type == "cuda" if enabled is None else enabled
        if self.enabled and cache.device.type != "cuda":
            raise ValueError("CUDA graphs need the cache on a CUDA device")
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._eager_keys: set[tuple[int, int]] = set()
        # one process's decode and verify graphs never run at the same time:
        # sharing the pool keeps their memory at the larger of the two
        self.pool = pool_of.pool if pool_of is not None else _Pool()
        self.replays = 0  # forwards served from a graph (tests and benches read it)
        self.capture_errors: list[str] = []  # buckets that fell back to eager forwards

    def _key(self, batch: ForwardBatch, tokens: int) -> tuple[int, int] | None:
        if not self.enabled or not batch.input_ids.is_cuda:
            return None
        if batch.attention.max_kv_len > self.max_context:
            return None
        n = len(batch.seqs)
        bucket = next((b for b in self.buckets if b >= n), None)
        return None if bucket is None else (bucket, tokens)

    def _uniform_key(self, batch: ForwardBatch) -> tuple[int, int] | None:
        """The key of a batch whose sequences all run the same number of
        tokens; None (eager) for a ragged one."""
        tokens = batch.attention.max_new_tokens
        if batch.num_tokens != tokens * len(batch.seqs):
            return None
        return self._key(batch, tokens)

    def _run(self, key: tuple[int, int] | None, batch: ForwardBatch, eager,
             hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """The outputs of the forward: (logits, hidden) of every row (padding
        cut). `hidden`: the MTP head's input rows, for draft forwards."""
        if key is None or key in self._eager_keys:
            return eager()
        if self.model.embeds_on_host:  # a host copy cannot be captured: embed first
            batch = replace(batch, input_embeds=self.model.embed(batch))
        graph = self._graphs.get(key)
        if graph is None or graph.graph is None:
            return self._warm_up_and_capture(key, batch, hidden)
        graph.fill(batch, hidden)
        graph.graph.replay()
        self.replays += 1
        rows = batch.num_tokens
        return tuple(out[:rows] for out in graph.outputs)

    def _new_graph(self, bucket: int, tokens: int) -> _Graph:
        config = self.model.config
        pages = -(-self.max_context // self.cache.page_size)
        tiles = tiles_for(config.head_dim, config.num_heads // config.num_kv_heads, True, True)
        from engine.kv.attention import _programs_wanted
        from engine.kv.attention_kernels import splits_for

        # the keys split as for decode: at batch 1 a multi-token verify would
        # otherwise leave most of the GPU idle over a long context
        splits = splits_for(bucket, config.num_kv_heads, self.max_context, tiles.block_n,
                            _programs_wanted(self.cache.device))
        return _Graph(bucket, tokens, pages, self.cache.device, splits, self.max_context,
                      self.cache.page_size)

    def _forward(self, batch: ForwardBatch,
                 hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model(batch, self.cache, all_logits=True, return_hidden=True)

    @torch.inference_mode()
    def _warm_up_and_capture(self, key: tuple[int, int], batch: ForwardBatch,
                             hidden: torch.Tensor | None = None):
        graph = self._graphs.setdefault(key, self._new_graph(*key))
        graph.fill(batch, hidden)
        static = graph.batch(list(batch.seqs))
        # kept with the graph: whatever the forward builds lazily on it (a
        # device index) is memory the recorded kernels read at every replay
        graph.static = static
        rows = batch.num_tokens
        # The real forward, eagerly, on a side stream (as torch.cuda.graphs asks
        # of warm-up runs); its padding copies are skipped or repeat the last sequence.
        side = torch.cuda.Stream(device=self.cache.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            outputs = tuple(out[:rows].clone() for out in self._forward(static, graph.hidden))
        torch.cuda.current_stream().wait_stream(side)
        # Recording runs nothing, so the step is not applied twice.
        cuda_graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(cuda_graph, pool=self.pool.handle()):
                graph.outputs = self._forward(static, graph.hidden)
        except RuntimeError as e:
            # A forward that cannot be captured (a host copy somewhere in it)
            # must not take the service down: this bucket runs eagerly, loudly.
            self._eager_keys.add(key)
            self._graphs.pop(key, None)
            self.capture_errors.append(f"bucket {key}: {e}")
            print(f"cuda graphs: bucket {key} runs eagerly, capture failed: {e}",
                  file=sys.stderr, flush=True)
            return outputs
        graph.graph = cuda_graph
        return outputs


class DecodeForward(_GraphedForward):
    """`forward(batch) -> logits [B, V]` for decode steps, replaying CUDA graphs
    where it can. Use it where the model would be called for a decode step."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, max_context: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, enabled: bool | None = None) -> None:
        super().__init__(model, cache, max_context, buckets, enabled)

    @torch.inference_mode()
    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        key = self._key(batch, 1) if batch.is_decode else None
        return self._run(key, batch, lambda: (self.model(batch, self.cache),))[0]


class VerifyForward(_GraphedForward):
    """`forward(batch) -> (logits [T, V], hidden [T, H])` of every row for
    speculative verify batches, replaying a CUDA graph when every sequence runs
    the same number of tokens (k+1: the common case; 1 when no sequence has
    drafts) within the fused GDN steps' limit; any other batch runs the eager
    forward. The GDN state after
    each token goes to the sequence's position slots (the graph reads them
    from static buffers), so a graph needs the fused GDN path on a hybrid
    model (TANDEM_FUSED_GDN=0 runs verify eagerly)."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, max_context: int,
                 buckets: tuple[int, ...] = VERIFY_BUCKETS, enabled: bool | None = None,
                 pool_of: _GraphedForward | None = None) -> None:
        super().__init__(model, cache, max_context, buckets, enabled, pool_of)

    @torch.inference_mode()
    def __call__(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        key = self._verify_key(batch)
        logits, hidden = self._run(key, batch, lambda: self._forward(batch, None))
        if key is not None:
            # the graph's outputs are overwritten by its next replay, and the
            # hidden rows live on in Verified until the MTP head has run them
            logits, hidden = logits.clone(), hidden.clone()
        return logits, hidden

    def _verify_key(self, batch: ForwardBatch) -> tuple[int, int] | None:
        key = self._uniform_key(batch)
        if key is not None and self.model.config.is_hybrid:
            from engine import gdn_batched, gdn_kernels  # triton: only where graphs run

            if not (gdn_batched.fused_enabled() and gdn_kernels.fits(key[1])):
                return None
        return key


class DraftForward(_GraphedForward):
    """`forward(batch, hidden) -> (logits [B, V], out [T, H])`: the MTP head
    over pairs (batch.input_ids the next tokens, `hidden` the target's hidden
    at their positions), as CausalLM.mtp_forward, replaying a CUDA graph when
    every sequence runs the same number of pairs: the drafts after the first
    (one pair each) and, at batch 1, every catch-up forward (the kept tokens
    of the last step, 1..k+1). Eager, each draft was a launch-bound forward of
    its own: the embedded model decoded 73 tok/s speculating against 234
    plainly on the H200 (12-02 14:18). The graph computes the logits of every
    pair (the lm_head reads its weights once for a few rows as for one) and
    the last pair's are picked outside it. Shares the decode graphs' pool."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, max_context: int,
                 buckets: tuple[int, ...] = VERIFY_BUCKETS, enabled: bool | None = None,
                 pool_of: _GraphedForward | None = None) -> None:
        super().__init__(model, cache, max_context, buckets, enabled, pool_of)

    @torch.inference_mode()
    def __call__(self, batch: ForwardBatch,
                 hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = self._uniform_key(batch)
        if key is None or key in self._eager_keys:
            return self.model.mtp_forward(batch, hidden, self.cache)
        logits, out = self._run(key, batch, lambda: None, hidden)
        # the outputs live in the shared pool until the next replay of any graph
        return logits.index_select(0, batch.last_token_indices()), out.clone()

    def _forward(self, batch: ForwardBatch,
                 hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.mtp_forward(batch, hidden, self.cache, all_logits=True)
