"""A store's KV pages and GDN state slots as raw bytes, layer by layer.

Every KV buffer in the kv arena is page-major ([num_pages, ...]) and every
state buffer slot-major ([num_slots, ...]), whatever the KV format (bf16,
int8 codes + scales, rk4 nibbles + scales, MTP pools): a transfer copies the
bytes of each buffer of each layer and never interprets them. A layer's
pages travel as one contiguous uint8 tensor (its buffers' page rows, in
buffer-name order), so one message moves one layer."""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import torch

_KV_NAME = re.compile(r"^kv\.(\d+)\.(.+)$")
_STATE_NAME = re.compile(r"^(recurrent|conv)\.(\d+)$")


@dataclass
class LayerBuffers:
    """The buffers of one layer, all indexed by page (or slot) on dim 0."""

    name: str  # "kv.3" or "state.0"
    tensors: list[torch.Tensor]

    @property
    def row_bytes(self) -> int:
        """Bytes of one page (or slot) over all of this layer's buffers."""
        return sum(t[0].numel() * t.element_size() for t in self.tensors)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows' bytes, contiguous: [len(rows) * row_bytes] uint8."""
        parts = [t.index_select(0, rows).view(torch.uint8).reshape(-1) for t in self.tensors]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def scatter(self, rows: torch.Tensor, data: torch.Tensor) -> None:
        """Write bytes made by gather (of as many rows) into `rows`."""
        offset, n = 0, rows.numel()
        for t in self.tensors:
            size = n * t[0].numel() * t.element_size()
            chunk = data[offset:offset + size].view(t.dtype).view(n, *t.shape[1:])
            t.index_copy_(0, rows, chunk)
            offset += size
        if offset != data.numel():
            raise ValueError(f"{self.name}: {data.numel()} bytes for {n} rows of {self.row_bytes}")

    def copy_rows(self, src: "LayerBuffers", src_rows: torch.Tensor,
                  dst_rows: torch.Tensor) -> None:
        """Peer copy: src's rows into ours, buffer by buffer (no staging on one device)."""
        for mine, theirs in zip(self.tensors, src.tensors):
            rows = theirs.index_select(0, src_rows.to(theirs.device))
            mine.index_copy_(0, dst_rows, rows.to(mine.device, non_blocking=True))


class StoreBuffers:
    """All layers of one store: `kv` (attention and MTP layers) and `state`
    (GDN layers: recurrent + conv window), from its mapped arenas."""

    def __init__(self, kv_tensors: dict[str, torch.Tensor],
                 state_tensors: dict[str, torch.Tensor]) -> None:
        self.kv = _group(kv_tensors, _KV_NAME, "kv")
        self.state = _group(state_tensors, _STATE_NAME, "state", layer_group=2)
        some = next(iter(kv_tensors.values()), None)
        self.device = some.device if some is not None else torch.device("cpu")

    @classmethod
    def of_arenas(cls, arenas) -> "StoreBuffers":
        """From kvstore.memory.StoreArenas (or anything with .kv and .state arenas)."""
        return cls(arenas.kv.tensors("kv."), arenas.state.tensors())

    def fingerprint(self) -> str:
        """Equal for two stores whose pages and slots hold the same bytes per
        row (same model, KV format, page size): only then can they trade pages."""
        h = hashlib.sha256()
        for layer in (*self.kv, *self.state):
            for t in layer.tensors:
                h.update(f"{layer.name}:{t.dtype}:{tuple(t.shape[1:])};".encode())
        return h.hexdigest()[:16]

    def page_bytes(self) -> int:
        return sum(layer.row_bytes for layer in self.kv)

    def slot_bytes(self) -> int:
        return sum(layer.row_bytes for layer in self.state)

    def rows(self, ids) -> torch.Tensor:
        return torch.tensor(list(ids), dtype=torch.long, device=self.device)


def _group(tensors: dict[str, torch.Tensor], pattern, prefix: str,
           layer_group: int = 1) -> list[LayerBuffers]:
    layers: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        m = pattern.match(name)
        if m is None:
            continue
        layers.setdefault(int(m.group(layer_group)), []).append((name, t))
    return [LayerBuffers(f"{prefix}.{layer}", [t for _, t in sorted(items)])
            for layer, items in sorted(layers.items())]
