"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step launches hundreds of small kernels; at batch 1 the launch cost
is a large part of the step. `DecodeForward` records the step once per bucket
into a CUDA graph over static input buffers and replays it afterwards.

How a step fits a fixed graph:
- inputs live in static buffers (token ids, positions, KV slots, state slots,
  KV lengths and a page table as wide as `max_context`);
- a batch smaller than its bucket is padded by repeating its last sequence:
  the copy computes the same K/V, the same state and the same logits and
  writes them to the same places, so padding needs no scratch pages or slots;
- attention uses a fixed number of key splits per bucket, and the kernels read
  lengths and page tables from device memory, so one graph serves every
  context length up to max_context.

The first step of a bucket runs eagerly (that is the warm-up: Triton kernels
compile and fla autotunes at the exact shapes) and is then captured; later
steps replay. Anything else (prefill, mixed batches, CPU tensors, batches
beyond the largest bucket) takes the eager forward. CUDA-only by nature; on
the CPU `DecodeForward` is a plain call of the model.
"""
from __future__ import annotations

import sys
from dataclasses import replace

import torch

from engine.batch import ForwardBatch, SequenceInput
from engine.cache import PagedKVCache
from engine.kv.attention import AttentionMetadata, tiles_for
from engine.model import CausalLM

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)


class _Graph:
    """One captured bucket: its static buffers, graph and output."""

    def __init__(self, size: int, pages: int, device: torch.device, num_splits: int,
                 max_context: int, page_size: int) -> None:
        with torch.inference_mode(False):  # see _allocate_buffers
            self._allocate_buffers(size, pages, device)
        self.num_splits = num_splits
        self.max_context = max_context
        self.page_size = page_size
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def _allocate_buffers(self, size: int, pages: int, device: torch.device) -> None:
        # Normal tensors, not inference tensors: fill() must be able to update
        # them whether or not the caller runs under torch.inference_mode.
        longs = dict(dtype=torch.long, device=device)
        self.size = size
        self.input_ids = torch.zeros(size, **longs)
        self.positions = torch.zeros(size, **longs)
        self.kv_slots = torch.zeros(size, **longs)
        self.state_slots = torch.zeros(size, **longs)
        self.kv_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(size, pages, dtype=torch.int32, device=device)
        self.q_offsets = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.input_embeds: torch.Tensor | None = None  # [size, H], with a host token table

    def fill(self, batch: ForwardBatch) -> None:
        """Copies the batch into the static buffers, padding with its last row."""
        n = len(batch.seqs)
        pad = self.size - n

        def padded(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t[-1:].expand(pad, *t.shape[1:])]) if pad else t

        meta = batch.attention
        self.input_ids.copy_(padded(batch.input_ids))
        self.positions.copy_(padded(batch.positions))
        self.kv_slots.copy_(padded(batch.kv_slots))
        self.state_slots.copy_(padded(batch.state_slots))
        self.kv_lens.copy_(padded(meta.kv_lens))
        width = meta.page_table.shape[1]
        self.page_table[:, :width].copy_(padded(meta.page_table))
        if batch.input_embeds is not None:  # a host token table: looked up before the graph
            if self.input_embeds is None:
                with torch.inference_mode(False):
                    self.input_embeds = torch.empty(self.size, batch.input_embeds.shape[1],
                                                    dtype=batch.input_embeds.dtype,
                                                    device=self.input_ids.device)
            self.input_embeds.copy_(padded(batch.input_embeds))

    def batch(self, seqs: list[SequenceInput]) -> ForwardBatch:
        """A ForwardBatch whose tensors are the static buffers."""
        meta = AttentionMetadata(
            q_offsets=self.q_offsets, kv_lens=self.kv_lens, page_table=self.page_table,
            max_new_tokens=1, max_kv_len=self.max_context,
            host_offsets=list(range(self.size + 1)), host_kv_lens=[self.max_context] * self.size,
            page_tables=[], num_splits=self.num_splits)
        padded = seqs + [seqs[-1]] * (self.size - len(seqs))
        return ForwardBatch(seqs=padded, page_size=self.page_size, input_ids=self.input_ids,
                            positions=self.positions, kv_slots=self.kv_slots, page_tables=[],
                            state_slots=self.state_slots, offsets=list(range(self.size + 1)),
                            _attention=meta, input_embeds=self.input_embeds)


class DecodeForward:
    """`forward(batch) -> logits [B, V]` for decode steps, replaying CUDA graphs
    where it can. Use it where the model would be called for a decode step."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, max_context: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, enabled: bool | None = None) -> None:
        self.model, self.cache = model, cache
        self.max_context = max_context
        self.buckets = tuple(sorted(buckets))
        self.enabled = cache.device.type == "cuda" if enabled is None else enabled
        if self.enabled and cache.device.type != "cuda":
            raise ValueError("CUDA graphs need the cache on a CUDA device")
        self._graphs: dict[int, _Graph] = {}
        self._eager_buckets: set[int] = set()
        self._pool = None
        self.replays = 0  # steps served from a graph (tests and benches read it)
        self.capture_errors: list[str] = []  # buckets that fell back to eager steps

    @torch.inference_mode()
    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        bucket = self._bucket(batch)
        if bucket is None or bucket in self._eager_buckets:
            return self.model(batch, self.cache)
        if self.model.embeds_on_host:  # a host copy cannot be captured: embed first
            batch = replace(batch, input_embeds=self.model.embed(batch))
        graph = self._graphs.get(bucket)
        if graph is None or graph.graph is None:
            return self._warm_up_and_capture(bucket, batch)
        graph.fill(batch)
        graph.graph.replay()
        self.replays += 1
        return graph.logits[:len(batch.seqs)]

    def _bucket(self, batch: ForwardBatch) -> int | None:
        if not self.enabled or not batch.is_decode or not batch.input_ids.is_cuda:
            return None
        if batch.attention.max_kv_len > self.max_context:
            return None
        n = len(batch.seqs)
        return next((b for b in self.buckets if b >= n), None)

    def _new_graph(self, bucket: int) -> _Graph:
        config = self.model.config
        pages = -(-self.max_context // self.cache.page_size)
        tiles = tiles_for(config.head_dim, config.num_heads // config.num_kv_heads, True, True)
        from engine.kv.attention import _programs_wanted
        from engine.kv.attention_kernels import splits_for

        splits = splits_for(bucket, config.num_kv_heads, self.max_context, tiles.block_n,
                            _programs_wanted(self.cache.device))
        return _Graph(bucket, pages, self.cache.device, splits, self.max_context,
                      self.cache.page_size)

    @torch.inference_mode()
    def _warm_up_and_capture(self, bucket: int, batch: ForwardBatch) -> torch.Tensor:
        graph = self._graphs.setdefault(bucket, self._new_graph(bucket))
        graph.fill(batch)
        static = graph.batch(list(batch.seqs))
        # The real step, eagerly, on a side stream (as torch.cuda.graphs asks
        # of warm-up runs); its padded rows repeat the last sequence.
        side = torch.cuda.Stream(device=self.cache.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self.model(static, self.cache, all_logits=True)[:len(batch.seqs)].clone()
        torch.cuda.current_stream().wait_stream(side)
        # Recording runs nothing, so the step is not applied twice.
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        cuda_graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(cuda_graph, pool=self._pool):
                graph.logits = self.model(static, self.cache, all_logits=True)
        except RuntimeError as e:
            # A forward that cannot be captured (a host copy somewhere in it)
            # must not take the service down: this bucket runs eagerly, loudly.
            self._eager_buckets.add(bucket)
            self._graphs.pop(bucket, None)
            self.capture_errors.append(f"bucket {bucket}: {e}")
            print(f"cuda graphs: bucket {bucket} runs eagerly, capture failed: {e}",
                  file=sys.stderr, flush=True)
            return logits
        graph.graph = cuda_graph
        return logits
