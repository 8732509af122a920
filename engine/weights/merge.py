"""Merged projections: a checkpoint's per-matrix tensors joined into the
model's merged modules (engine/model.py `merged_parts`: MLP gate_up_proj,
attention qkv_proj, GDN in_proj), so a decode step reads each group of
matrices that share an input in one weight launch.

Owns which checkpoint tensors make which merged tensor (the groups, read off
the model's modules), the join, and its fallback:
  * dense parts: torch.cat along the output dimension (weights and biases);
  * packed parts (QuantTensor state, engine/quant/tensor.py) of one layout
    (bits, group, superblock, asymmetric, every component's dtype and
    trailing shape): each component concatenated along dim 0, nothing
    re-quantized;
  * parts of different layouts (Q6_K beside Q4_K, as Q4_K_M gives v_proj
    more bits in some layers; dense beside packed): runs of neighbouring
    parts with one layout are joined and kept side by side as
    `{merged}.parts.{j}`, which engine/quant/linear.py's SplitLinear holds;
  * tensors already under a merged name (`{merged}.weight`, `.qweight`,
    `.parts.{j}.*`: what a store's weights arena holds) pass through
    untouched, so merging a merged state changes nothing.
A group's parts leave the dict as soon as they are joined, so loading holds
at most one group twice, never the model. `unmerged_state` is the reverse
(head files are written under checkpoint names).

Must not know: file formats, devices, model families, weight recipes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.quant.tensor import SUFFIXES, QuantTensor, is_quant_prefix

DENSE_SUFFIXES = ("weight", "bias")


@dataclass(frozen=True)
class MergeGroup:
    """One merged projection: its module name, its checkpoint parts (module
    names, in output order) with their output rows, the shared input width
    and whether the parts carry biases."""
    name: str
    parts: tuple[str, ...]
    rows: tuple[int, ...]
    in_features: int
    bias: bool


def merge_groups(model: nn.Module, prefix: str = "") -> list[MergeGroup]:
    """Every merged projection of `model` (names prefixed with `prefix`)."""
    groups = []
    for owner_name, owner in model.named_modules():
        spec = getattr(owner, "merged_parts", None)
        if not spec:
            continue
        base = prefix + (f"{owner_name}." if owner_name else "")
        for merged, parts in spec.items():
            module = owner.get_submodule(merged)
            first = module.parts[0] if hasattr(module, "parts") else module  # a SplitLinear
            groups.append(MergeGroup(base + merged, tuple(base + name for name, _ in parts),
                                     tuple(rows for _, rows in parts), module.in_features,
                                     getattr(first, "bias", None) is not None))
    return groups


def split_name(merged: str, run: int) -> str:
    return f"{merged}.parts.{run}"


def runs(keys: Sequence[Hashable]) -> list[range]:
    """Index ranges of neighbouring equal keys: [a, a, b, a] -> 0..1, 2, 3."""
    out, start = [], 0
    for j in range(1, len(keys) + 1):
        if j == len(keys) or keys[j] != keys[start]:
            out.append(range(start, j))
            start = j
    return out


def packed_layout(qt: QuantTensor) -> tuple:
    """What must agree for packed parts to be concatenated row-wise."""
    return tuple((suffix, t.dtype, tuple(t.shape[1:])) for suffix, t in qt.tensors().items())


DENSE = ("dense",)


def split_rows(tensors: dict[str, torch.Tensor], merged: str) -> list[int]:
    """The rows of each `{merged}.parts.{j}` in `tensors` ([] when the group
    is not split)."""
    rows = []
    while True:
        name = split_name(merged, len(rows))
        t = tensors.get(f"{name}.qweight", tensors.get(f"{name}.weight"))
        if t is None:
            return rows
        rows.append(int(t.shape[0]))


def merge_checkpoint(tensors: dict[str, torch.Tensor], groups: Sequence[MergeGroup],
                     dtype: torch.dtype, source: str) -> None:
    """Join each group's parts in `tensors` (in place; dense parts cast to
    `dtype`). Missing or misshapen parts are a ModelLoadError naming them."""
    owners = {name.rpartition(".")[0] for name in tensors}
    split_owners = {name.split(".parts.")[0] for name in tensors if ".parts." in name}
    for group in groups:
        if group.name in owners or group.name in split_owners:
            continue  # already merged (or split) by an earlier merge
        parts = [_read_part(tensors, group, j, source) for j in range(len(group.parts))]
        spans = runs([key for key, _, _ in parts])
        for j, span in enumerate(spans):
            target = group.name if len(spans) == 1 else split_name(group.name, j)
            tensors.update(_join([parts[i] for i in span], target, dtype))
        for part in group.parts:
            for suffix in (*DENSE_SUFFIXES, *SUFFIXES):
                tensors.pop(f"{part}.{suffix}", None)
        del parts


def _read_part(tensors, group: MergeGroup, j: int, source: str):
    """(layout key, dense weight or QuantTensor, bias or None) of part j, checked."""
    part, shape = group.parts[j], (group.rows[j], group.in_features)
    if is_quant_prefix(tensors, part):
        try:
            weight = QuantTensor.from_state(tensors, part)
        except ValueError as e:
            raise ModelLoadError(f"{source}: packed weight {part!r} is malformed ({e})") from e
        key, found, name = packed_layout(weight), tuple(weight.shape), f"{part} (packed)"
    else:
        name = f"{part}.weight"
        weight = tensors.get(name)
        if weight is None:
            raise ModelLoadError(f"{source}: tensor {name!r} is missing; the file does not match "
                                 "its own config: re-download or re-convert it")
        key, found = DENSE, tuple(weight.shape)
    _check_shape(name, found, shape, source)
    bias = None
    if group.bias:
        name = f"{part}.bias"
        bias = tensors.get(name)
        if bias is None:
            raise ModelLoadError(f"{source}: tensor {name!r} is missing; the file does not match "
                                 "its own config: re-download or re-convert it")
        _check_shape(name, tuple(bias.shape), shape[:1], source)
    return key, weight, bias


def _check_shape(name: str, found: tuple, expected: tuple, source: str) -> None:
    if found != expected:
        raise ModelLoadError(
            f"{source}: tensor {name!r} has shape {found}, but the config implies {expected}; "
            "the weights and config.json do not belong together")


def _join(parts, target: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The state entries of `target` made of parts sharing one layout; a
    single part is renamed, not copied."""
    weights = [w for _, w, _ in parts]
    biases = [b for _, _, b in parts if b is not None]
    if isinstance(weights[0], QuantTensor):
        components = [w.tensors() for w in weights]
        out = {f"{target}.{suffix}": _cat([c[suffix] for c in components])
               for suffix in components[0]}
    else:
        out = {f"{target}.weight": _cat([w.to(dtype) for w in weights])}
    if biases:
        out[f"{target}.bias"] = _cat([b.to(dtype) for b in biases])
    return out


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)


def unmerged_state(state: dict[str, torch.Tensor], groups: Sequence[MergeGroup]
                   ) -> dict[str, torch.Tensor]:
    """`state` with every merged (or split) tensor of `groups` cut back into
    its checkpoint parts' names (row views, no copies); other names as they are."""
    out = dict(state)
    for group in groups:
        pieces = [group.name] if any(f"{group.name}.{s}" in state for s in
                                     (*DENSE_SUFFIXES, *SUFFIXES)) else \
            [split_name(group.name, j) for j in range(len(split_rows(state, group.name)))]
        part = 0
        for piece in pieces:
            names = [s for s in (*DENSE_SUFFIXES, *SUFFIXES) if f"{piece}.{s}" in state]
            first, total = part, 0
            rows = int(state[f"{piece}.{names[0]}"].shape[0])
            while total < rows:
                total += group.rows[part]
                part += 1
            cuts = list(group.rows[first:part])
            for suffix in names:
                for name, t in zip(group.parts[first:part],
                                   out.pop(f"{piece}.{suffix}").split(cuts, dim=0)):
                    out[f"{name}.{suffix}"] = t
    return out
