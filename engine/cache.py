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

import torch

from engine.config import ModelConfig
from engine.kv.attention import AttentionMetadata, paged_attention
from engine.kv.formats import KVFormat


@dataclass(frozen=True)
class CacheShape:
    """How much cache memory to lay out for one model."""

    num_pages: int
    page_size: int = 16
    num_state_slots: int = 0
    mtp_layers: int = 0  # MTP layers that get a KV page pool (speculative decoding)

    def __post_init__(self) -> None:
        if self.num_pages < 1 or self.page_size < 1 or self.num_state_slots < 0 \
                or self.mtp_layers < 0:
            raise ValueError(f"invalid cache shape {self}")


def kv_layer_ids(config: ModelConfig, shape: CacheShape) -> tuple[int, ...]:
    """Layers with a page pool, in pool order: the target's full-attention layers,
    then the MTP layers (numbered after the target's, as the MTP head numbers them)."""
    if shape.mtp_layers > config.mtp_num_layers:
        raise ValueError(f"the cache shape asks for {shape.mtp_layers} MTP KV pools but the "
                         f"model has {config.mtp_num_layers} MTP layers")
    mtp = tuple(range(config.num_layers, config.num_layers + shape.mtp_layers))
    return tuple(config.attention_layers) + mtp


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
        self.kv = [kv_format.allocate(shape.num_pages, shape.page_size, config.num_kv_heads,
                                       config.head_dim, self.device)
                   for _ in self._attn_index]
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
    def write_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        index = self._attn_index[layer]
        self.kv_format.write(self.kv[index], slots, k, v)
        if self.kv_written is not None:
            # a listener (the prefill's transfer) may send this pool's finished
            # pages while the following layers compute
            self.kv_written(index)

    def read_kv(self, layer: int, page_table: torch.Tensor, length: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_format.read(self.kv[self._attn_index[layer]], page_table, length, dtype)

    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata,
               softmax_scale: float) -> torch.Tensor:
        """Causal attention of q [T, Hq, D] over the layer's pages (the new
        tokens' K/V already written): Triton on CUDA, PyTorch elsewhere."""
        return paged_attention(self.kv_format, self.kv[self._attn_index[layer]], q, meta,
                               softmax_scale)

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
