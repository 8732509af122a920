"""What the KV store keeps in shared memory, and how any process rebuilds the
model and the paged cache around it without copying.

Four arenas (kvstore/arena.py):
  weights  every parameter on the store's device, by its state-dict name;
  host     parameters kept in host memory (POSIX shared memory even for a GPU
           store): the token table of an untied model on a GPU, which a step
           reads a few rows of (CausalLM.embed); empty otherwise;
  kv       `kv.{layer}.{buffer}`: each full-attention layer's KV-format buffers
           ([num_pages, page_size, kv_heads, ...]);
  state    `recurrent.{layer}` (fp32 [slots, v_heads, k_dim, v_dim]) and
           `conv.{layer}` ([slots, conv_dim, kernel - 1]) for each GDN layer.
           One slot pool: live sequences and prefix-cache snapshots both draw
           from it, so a snapshot is a state copy within the same tensors.

Owns these names and shapes, copying weights in once, and building a CausalLM
and a PagedKVCache over views. Must not know about sessions, the radix tree,
who holds which page, or how handles travel (the RPC's business).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from engine.cache import CacheShape, PagedKVCache
from engine.config import ModelConfig
from engine.kv import KVFormat, make_format
from engine.loader import build_model
from engine.model import CausalLM
from kvstore.arena import Arena, ArenaHandle, Layout, dtype_from_name, dtype_name

WEIGHTS, KV, STATE, HOST = "weights", "kv", "state", "host"
ARENA_NAMES = (WEIGHTS, KV, STATE, HOST)
# Parameters a GPU store keeps in host memory (with host_embeddings).
HOST_PREFIXES = ("model.embed_tokens.",)
EMBEDDING_PLACES = ("auto", "host", "device")
# PagedKVCache's default; the conv window is tiny, so fp32 costs nothing.
CONV_DTYPE = torch.float32


@dataclass(frozen=True)
class KVFormatSpec:
    """A KV format by name and options, serialisable for the RPC (a torch dtype
    option travels as its name)."""

    name: str
    options: dict = field(default_factory=dict, hash=False)

    def build(self) -> KVFormat:
        return make_format(self.name, **self.options)

    def to_json(self) -> str:
        return json.dumps({k: dtype_name(v) if isinstance(v, torch.dtype) else v
                           for k, v in sorted(self.options.items())})

    @classmethod
    def from_json(cls, name: str, text: str) -> "KVFormatSpec":
        options = json.loads(text or "{}")
        if "dtype" in options:
            options["dtype"] = dtype_from_name(options["dtype"])
        return cls(name, options)

    def describe(self) -> str:
        """The name and options, as used in cache namespaces and logs."""
        return f"{self.name}{self.to_json() if self.options else ''}"


def config_to_json(config: ModelConfig) -> str:
    return json.dumps(asdict(config), sort_keys=True)


def config_from_json(text: str) -> ModelConfig:
    d = json.loads(text)
    d["layer_types"] = tuple(d["layer_types"])
    return ModelConfig(**d)


# ----------------------------------------------------------------- layouts


def weights_layout(model: nn.Module, on_host: bool = False,
                   host_embeddings: bool = False) -> Layout:
    """The device weights (on_host=False) or the host ones: with
    host_embeddings, the token table of an untied model goes to the host."""
    def wanted(name: str) -> bool:
        return on_host == (host_embeddings and name.startswith(HOST_PREFIXES))
    return Layout.pack((name, t.dtype, tuple(t.shape))
                       for name, t in model.state_dict().items() if wanted(name))


def can_host_embeddings(config: ModelConfig) -> bool:
    """Only an untied table: a tied one is also the lm_head, read whole each step."""
    return not config.tie_word_embeddings


def kv_layout(config: ModelConfig, shape: CacheShape, kv_format: KVFormat) -> Layout:
    """Every full-attention layer's buffers (and staging pages), as the cache
    would allocate them."""
    from engine.cache import allocate_pool, kv_layer_ids, pool_formats

    entries = []
    # the MTP layers' pools too, when laid out
    for layer, fmt in zip(kv_layer_ids(config, shape), pool_formats(kv_format, config, shape)):
        # On the meta device: shapes and dtypes without a byte of memory.
        buffers = allocate_pool(fmt, kv_format, shape, config, "meta")
        entries += [(f"kv.{layer}.{name}", t.dtype, tuple(t.shape)) for name, t in buffers.items()]
    return Layout.pack(entries)


def state_layout(config: ModelConfig, num_slots: int) -> Layout:
    entries = []
    for layer in config.linear_layers:
        entries.append((f"recurrent.{layer}", torch.float32,
                        (num_slots, config.linear_num_v_heads, config.linear_k_head_dim,
                         config.linear_v_head_dim)))
        entries.append((f"conv.{layer}", CONV_DTYPE,
                        (num_slots, config.linear_conv_dim, config.linear_conv_kernel - 1)))
    return Layout.pack(entries)


# ------------------------------------------------------------------ arenas


@dataclass
class StoreArenas:
    weights: Arena
    kv: Arena
    state: Arena
    host: Arena

    def by_name(self) -> dict[str, Arena]:
        return {WEIGHTS: self.weights, KV: self.kv, STATE: self.state, HOST: self.host}

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        return {**self.weights.tensors(), **self.host.tensors()}

    def handles(self) -> dict[str, ArenaHandle]:
        return {name: arena.handle for name, arena in self.by_name().items()}

    def close(self) -> None:
        for arena in self.by_name().values():
            arena.close()


def create_arenas(model: nn.Module, config: ModelConfig, shape: CacheShape, kv_format: KVFormat,
                  device: torch.device | str, store_id: str, copy_weights: bool = True,
                  host_embeddings: bool = False) -> StoreArenas:
    """Allocate the arenas once and copy the model's weights in (a model on
    the meta device only lays out the weights arenas: copy_weights=False)."""
    host_embeddings = host_embeddings and can_host_embeddings(config)
    made: list[Arena] = []
    try:
        for name, layout, where in (
                (WEIGHTS, weights_layout(model, False, host_embeddings), device),
                (KV, kv_layout(config, shape, kv_format), device),
                (STATE, state_layout(config, shape.num_state_slots), device),
                (HOST, weights_layout(model, True, host_embeddings), "cpu")):
            made.append(Arena.create(name, layout, where, store_id))
    except BaseException:
        for arena in made:  # no half-made store leaves files behind
            arena.close()
        raise
    arenas = StoreArenas(*made)
    with torch.no_grad():
        for name, t in model.state_dict().items() if copy_weights else ():
            arena = arenas.host if name in arenas.host.layout.names else arenas.weights
            arena.tensor(name).copy_(t)
    if torch.device(device).type == "cuda":
        # Workers map the memory later on other streams: the copies must be done.
        torch.cuda.synchronize(device)
    return arenas


def open_arenas(handles: dict[str, ArenaHandle], owner_pid: int | None = None) -> StoreArenas:
    return StoreArenas(*(Arena.open(name, handles[name], owner_pid) for name in ARENA_NAMES))


# --------------------------------------------------------------- rebuilding


def model_on_arena(config: ModelConfig, arenas: StoreArenas, dtype: torch.dtype,
                   source: str) -> CausalLM:
    """A CausalLM whose parameters are views of the weights arenas (zero copy)."""
    device = arenas.weights.buffer.device
    model = build_model(config, arenas.weight_tensors(), device, dtype, source,
                        host_prefixes=HOST_PREFIXES if arenas.host.layout.names else ())
    if device.type == "cuda":  # (imports triton)
        from engine.dense_gemv import adopt_dense_gemv
        adopt_dense_gemv(model, device)
    return model


def cache_on_arenas(config: ModelConfig, shape: CacheShape, kv_format: KVFormat,
                    arenas: StoreArenas) -> PagedKVCache:
    """A PagedKVCache whose pages and state slots are views of the kv and state arenas."""
    from engine.cache import kv_layer_ids

    kv_buffers = [{name.removeprefix(f"kv.{layer}."): t
                   for name, t in arenas.kv.tensors(f"kv.{layer}.").items()}
                  for layer in kv_layer_ids(config, shape)]
    recurrent = [arenas.state.tensor(f"recurrent.{layer}") for layer in config.linear_layers]
    conv = [arenas.state.tensor(f"conv.{layer}") for layer in config.linear_layers]
    return PagedKVCache.from_tensors(config, shape, kv_format, kv_buffers, recurrent, conv)
