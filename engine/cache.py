"""The memory a forward reads and writes, as the model sees it.

Full-attention layers keep K/V in pages of `page_size` tokens; GDN layers keep
one recurrent state (fp32) and one conv window per state slot. Who owns which
page or slot is not this module's business: the KV store hands out ids, the
forward uses them.

How K/V is encoded in a page is a KV format (engine/kv): bf16 (or any compute
dtype) as is, int8, or the rotated 4-bit rk4.

The MTP head's full-attention layer(s) are one more page pool each when the
shape asks for them (`mtp_layers`), indexed by the same page table as the
target's layers: position p of a sequence is row p of both, so one page
reservation covers the target and its drafter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engine.config import ModelConfig
from engine.kv.attention import AttentionMetadata, paged_attention
from engine.kv.formats import KVFormat
from engine.uploads import upload


@dataclass(frozen=True)
class CacheShape:
    """How much cache memory to lay out for one model."""

    num_pages: int
    page_size: int = 16
    num_state_slots: int = 0
    mtp_layers: int = 0  # MTP layers that get a KV page pool (speculative decoding)
    # bf16 pages for the open (not yet sealed) pages of live sequences, and
    # their never-sealed first pages (rk4p's sinks), for formats that quantize
    # whole pages: open_pages.staging_per_sequence(format) per live sequence,
    # a fixed cost per sequence; page ids num_pages.. name them.
    staging_pages: int = 0

    def __post_init__(self) -> None:
        if self.num_pages < 1 or self.page_size < 1 or self.num_state_slots < 0 \
                or self.mtp_layers < 0 or self.staging_pages < 0:
            raise ValueError(f"invalid cache shape {self}")


def kv_layer_ids(config: ModelConfig, shape: CacheShape) -> tuple[int, ...]:
    """Layers with a page pool, in pool order: the target's full-attention layers,
    then the MTP layers (numbered after the target's, as the MTP head numbers them)."""
    if shape.mtp_layers > config.mtp_num_layers:
        raise ValueError(f"the cache shape asks for {shape.mtp_layers} MTP KV pools but the "
                         f"model has {config.mtp_num_layers} MTP layers")
    mtp = tuple(range(config.num_layers, config.num_layers + shape.mtp_layers))
    return tuple(config.attention_layers) + mtp


def pool_formats(kv_format: KVFormat, config: ModelConfig,
                 shape: CacheShape) -> list[KVFormat]:
    """The format of each page pool, in kv_layer_ids order.

    With a staged format (rk4) the MTP pools are int8 over num_pages +
    staging_pages pages: the drafter writes its KV out of step with the target
    (catch-up pairs, draft chains), so whole-page quantization does not fit it,
    and a per-token format can hold real and staging ids in one pool (sealing
    copies the staged rows). One layer of int8 costs little beside the target's."""
    layers = kv_layer_ids(config, shape)
    if not kv_format.uses_staging or not shape.mtp_layers:
        return [kv_format] * len(layers)
    from engine.kv.formats import Int8Format

    mtp = Int8Format(use_triton=kv_format.use_triton)
    return [kv_format] * (len(layers) - shape.mtp_layers) + [mtp] * shape.mtp_layers


def allocate_pool(pool_format: KVFormat, kv_format: KVFormat, shape: CacheShape,
                  config: ModelConfig, device: torch.device | str) -> dict[str, torch.Tensor]:
    """One layer's page pool in pool_format (pool_formats) for a cache whose
    format is kv_format; on the meta device it only lays the buffers out (the
    KV store's arenas are laid out this way, so they match the cache exactly)."""
    dims = (shape.page_size, config.num_kv_heads, config.head_dim, device)
    if pool_format is not kv_format:  # an MTP pool beside staged pages
        return pool_format.allocate(shape.num_pages + shape.staging_pages, *dims)
    buffers = kv_format.allocate(shape.num_pages, *dims)
    if kv_format.uses_staging:
        if shape.staging_pages < 1:
            raise ValueError(f"KV format {kv_format!r} keeps open pages in staging: the "
                             "cache shape needs staging_pages >= 1")
        buffers.update(kv_format.allocate_staging(shape.staging_pages, *dims))
    return buffers


class PagedKVCache:
    """Page pools for the full-attention layers and state slots for the GDN layers."""

    def __init__(self, config: ModelConfig, shape: CacheShape, device: torch.device | str,
                 kv_format: KVFormat, conv_dtype: torch.dtype = torch.float32) -> None:
        self.config = config
        self.shape = shape
        self.page_size = shape.page_size
        self.device = torch.device(device)
        self.kv_format = kv_format
        self._attn_index = {layer: i for i, layer in enumerate(kv_layer_ids(config, shape))}
        self._gdn_index = {layer: i for i, layer in enumerate(config.linear_layers)}
        self.kv_written = None
        self.pool_formats = pool_formats(kv_format, config, shape)
        self.kv = [allocate_pool(fmt, kv_format, shape, config, self.device)
                   for fmt in self.pool_formats]
        slots = shape.num_state_slots if config.is_hybrid else 0
        if config.is_hybrid and slots < 1:
            raise ValueError("a hybrid model needs at least one GDN state slot")
        self.recurrent = [torch.zeros(slots, config.linear_num_v_heads, config.linear_k_head_dim,
                                      config.linear_v_head_dim, dtype=torch.float32, device=self.device)
                          for _ in config.linear_layers]
        self.conv = [torch.zeros(slots, config.linear_conv_dim, config.linear_conv_kernel - 1,
                                 dtype=conv_dtype, device=self.device)
                     for _ in config.linear_layers]

    @classmethod
    def from_tensors(cls, config: ModelConfig, shape: CacheShape, kv_format: KVFormat,
                     kv_buffers: list[dict[str, torch.Tensor]], recurrent: list[torch.Tensor],
                     conv: list[torch.Tensor]) -> "PagedKVCache":
        """A cache over existing memory (the KV store's shared arenas): nothing is
        allocated or copied. One kv_buffers dict per full-attention layer, one
        recurrent and conv tensor per GDN layer, in layer order (kv_layer_ids)."""
        kv_layers = kv_layer_ids(config, shape)
        if len(kv_buffers) != len(kv_layers) or \
                len(recurrent) != len(config.linear_layers) or len(conv) != len(config.linear_layers):
            raise ValueError(f"from_tensors: {len(kv_buffers)} KV layers and {len(recurrent)}/"
                             f"{len(conv)} GDN layers given; the model has "
                             f"{len(kv_layers)} and {len(config.linear_layers)}")
        cache = cls.__new__(cls)
        cache.config, cache.shape, cache.page_size = config, shape, shape.page_size
        cache.kv_format = kv_format
        cache.pool_formats = pool_formats(kv_format, config, shape)
        first = next(iter(kv_buffers[0].values())) if kv_buffers else recurrent[0]
        cache.device = first.device
        cache._attn_index = {layer: i for i, layer in enumerate(kv_layers)}
        cache._gdn_index = {layer: i for i, layer in enumerate(config.linear_layers)}
        cache.kv, cache.recurrent, cache.conv = list(kv_buffers), list(recurrent), list(conv)
        cache.kv_written = None
        return cache

    @property
    def has_mtp_kv(self) -> bool:
        """The MTP layers have page pools: prefill and decode keep their KV."""
        return self.shape.mtp_layers > 0

    # --- full attention -------------------------------------------------
    def layer_format(self, layer: int) -> KVFormat:
        """The format of a layer's pool (MTP pools may differ: pool_formats)."""
        return self.pool_formats[self._attn_index[layer]]

    def write_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k before or after RoPE as layer_format(layer).k_pre_rope says."""
        index = self._attn_index[layer]
        self.pool_formats[index].write(self.kv[index], slots, k, v)
        if self.kv_written is not None:
            # a listener (the prefill's transfer) may send this pool's finished
            # pages while the following layers compute
            self.kv_written(index)

    def read_kv(self, layer: int, page_table: torch.Tensor, length: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        i = self._attn_index[layer]
        return self.pool_formats[i].read(self.kv[i], page_table, length, dtype)

    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata,
               softmax_scale: float, output_gate: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of q [T, Hq, D] over the layer's pages (the new
        tokens' K/V already written): Triton on CUDA, PyTorch elsewhere;
        output_gate: times its sigmoid (engine.kv.attention.paged_attention)."""
        i = self._attn_index[layer]
        return paged_attention(self.pool_formats[i], self.kv[i], q, meta, softmax_scale,
                               rotary=self.rotary, output_gate=output_gate)

    @property
    def rotary(self):
        """The rotary embedding attention applies to keys stored before RoPE."""
        if not self.kv_format.k_pre_rope:
            return None
        if getattr(self, "_rotary", None) is None:
            from engine.rotary import Rotary
            self._rotary = Rotary(self.config)
        return self._rotary

    def open_pages_for(self, table_ids: Sequence[int], page_table: Sequence[int],
                       held: Sequence[int] | None = None, committed: int = 0):
        """A sequence's OpenPages over the staging pages named by their
        page-table ids (>= num_pages), for a page table whose sink pages are
        staging pages already (the KV store's way); `held`/`committed` resume
        what another process left (OpenPages.resumed). None for a per-token
        format. Bad ids raise InvalidRequestError saying what is wrong."""
        from engine.errors import InvalidRequestError
        from engine.kv.open_pages import OpenPages, open_staging_per_sequence, sink_pages

        fmt, num_pages = self.kv_format, self.shape.num_pages
        if not fmt.uses_staging:
            if table_ids:
                raise InvalidRequestError(f"KV format {fmt.name} has no staging pages: send no "
                                          "open pages")
            return None
        wanted = open_staging_per_sequence(fmt)
        staging = [int(p) - num_pages for p in table_ids]
        if len(staging) != wanted or not all(0 <= s < self.shape.staging_pages for s in staging):
            raise InvalidRequestError(
                f"KV format {fmt.name} needs {wanted} open (staging) page ids in "
                f"{num_pages}..{num_pages + self.shape.staging_pages - 1}, got {list(table_ids)}")
        sinks = list(page_table[:sink_pages(fmt)])
        if any(p < num_pages for p in sinks):
            raise InvalidRequestError(f"KV format {fmt.name} keeps the first {len(sinks)} pages "
                                      "exact: the page table must name staging pages there, "
                                      f"got {sinks}")
        if held is None:
            return OpenPages.for_format(fmt, staging, num_pages, self.page_size)
        if len(held) != wanted or any(h < -1 for h in held):
            raise InvalidRequestError(f"open pages: {wanted} held entries (logical page or -1) "
                                      f"expected, got {list(held)}")
        return OpenPages.resumed(fmt, staging, num_pages, self.page_size, held, committed)

    def check_page_ids(self, pages: Sequence[int]) -> None:
        """A request's page table names the pool's pages or its staging pages
        (rk4p's sinks sit there by staging id): the kernels index the pools
        with these ids unchecked, and on a GPU a bad one reads or writes
        another allocation's memory. InvalidRequestError names the first bad id."""
        from engine.errors import InvalidRequestError

        num_ids = self.shape.num_pages + self.shape.staging_pages
        bad = next((p for p in pages if not 0 <= p < num_ids), None)
        if bad is not None:
            raise InvalidRequestError(f"page id {bad} is outside the store's {num_ids} page ids "
                                      f"[0, {num_ids})")

    def check_state_slot(self, slot: int, name: str, optional: bool = False) -> None:
        """`slot` names one of the GDN state slots, or is -1 (none) where
        `optional`: a negative index would reach the last slot, another
        request's. Only a hybrid model's requests carry slots to check."""
        from engine.errors import InvalidRequestError

        if optional and slot == -1:
            return
        num_slots = self.recurrent[0].shape[0] if self.recurrent else 0
        if not 0 <= slot < num_slots:
            none = " or -1 (none)" if optional else ""
            raise InvalidRequestError(f"{name} {slot} is outside the store's {num_slots} GDN "
                                      f"state slots [0, {num_slots}){none}")

    def seal(self, staging_ids: list[int], page_ids: list[int]) -> None:
        """Quantize full, committed staging pages into their real pages, in
        every KV layer (the MTP pools included): staging_ids[i] -> page_ids[i]."""
        if not staging_ids:
            return
        if not self.kv_format.uses_staging:
            raise ValueError(f"KV format {self.kv_format!r} has no staging pages to seal")
        src = upload(staging_ids, torch.long, self.device)
        dst = upload(page_ids, torch.long, self.device)
        for fmt, buffers in zip(self.pool_formats, self.kv):
            if fmt is self.kv_format:
                fmt.seal(buffers, src, dst)
            else:  # a per-token MTP pool: its staged rows move as they are
                src_rows = src + self.shape.num_pages
                for t in buffers.values():
                    t[dst] = t[src_rows]

    # --- GDN state ------------------------------------------------------
    def recurrent_state(self, layer: int) -> torch.Tensor:
        """[num_slots, v_heads, k_dim, v_dim] fp32, indexed by state slot."""
        return self.recurrent[self._gdn_index[layer]]

    def conv_window(self, layer: int) -> torch.Tensor:
        """[num_slots, conv_dim, kernel - 1]: the last inputs of the causal conv."""
        return self.conv[self._gdn_index[layer]]

    def copy_state(self, src: int, dst: int) -> None:
        """Copy one slot's GDN state into another (snapshots, MTP verify slots)."""
        for t in (*self.recurrent, *self.conv):
            t[dst].copy_(t[src])

    def clear_state(self, slot: int) -> None:
        for t in (*self.recurrent, *self.conv):
            t[slot].zero_()
