"""Weight formats (`--weights`): which module gets which packed format, how
many bytes that is, and random low-bit weights for dummy shapes drawn
directly in the packed layout (a 27B shape never exists in bf16).

  bf16       every weight dense in the compute dtype
  q4_k_m     llama.cpp's Q4_K_M mix: Q4_K everywhere, Q6_K for the output
             head and for v_proj / down_proj of the layers llama.cpp gives
             more bits (the first and last eighth, and every third between)
  q4_k_s     Q4_K everywhere, Q6_K for the output head
  q8_0       Q8_0 everywhere
  int4       Q4_K layout for every Linear and embedding, output head included
             (the "4-bit dummy weights" of the 27B demonstration)
  gptq-int4  GPTQ int4, group 128, for every Linear but the output head;
             embeddings and head stay dense (as GPTQ checkpoints ship them)

Sizes are QuantTensor's: Q4_K packs to 4.625 bits per weight here (llama.cpp
stores 4.5: we unpack the 6-bit group scales into bytes), Q6_K to 8.75.

A recipe chooses per checkpoint matrix (q_proj, v_proj, gate_proj, ...), as
a file would store it; the model's merged projections are then laid out as
the loader lays out a checkpoint (engine/weights/merge.py): one module where
the parts' formats agree, runs of equal format side by side where not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from engine.quant.tensor import QuantTensor

DENSE = "bf16"


@dataclass(frozen=True)
class QuantFormat:
    name: str
    bits: int         # stored code width: 4 or 8
    code_min: int     # code range drawn for dummy weights
    code_max: int
    group: int
    superblock: int
    asymmetric: bool
    # bytes of each d (and dmin): fp16 for GGUF and most GPTQ/AWQ files; a
    # checkpoint whose scales are fp32 (or bf16, widened) keeps 4
    scale_bytes: int = 2

    def fits(self, k: int) -> bool:
        return k % self.group == 0

    def superblock_for(self, k: int) -> int:
        """The superblock a row of k allows (a narrower one changes no value)."""
        return math.gcd(self.superblock, k)

    def nbytes(self, n: int, k: int) -> int:
        codes = n * k * self.bits // 8
        groups, supers = n * (k // self.group), n * (k // self.superblock_for(k))
        per_group, scales = (2, 2) if self.asymmetric else (1, 1)
        return codes + groups * per_group + supers * scales * self.scale_bytes

    def meta(self, n: int, k: int) -> QuantTensor:
        """A QuantTensor of this format on the meta device (shapes only)."""
        s = self.superblock_for(k)
        with torch.device("meta"):
            qweight = torch.empty(n, k // 2, dtype=torch.uint8) if self.bits == 4 else \
                torch.empty(n, k, dtype=torch.int8)
            d = torch.empty(n, k // s,
                            dtype=torch.float16 if self.scale_bytes == 2 else torch.float32)
            sc = torch.empty(n, k // self.group, dtype=torch.int8)
            if self.asymmetric:
                return QuantTensor(qweight, d, sc, torch.empty_like(d), torch.empty_like(sc))
            return QuantTensor(qweight, d, sc)


Q4_K = QuantFormat("Q4_K", 4, 0, 15, 32, 256, True)
Q6_K = QuantFormat("Q6_K", 8, -32, 31, 16, 256, False)
Q8_0 = QuantFormat("Q8_0", 8, -127, 127, 32, 32, False)
GPTQ_INT4 = QuantFormat("GPTQ-int4", 4, 0, 15, 128, 128, True)

Chooser = Callable[[str, nn.Module, int], "QuantFormat | None"]


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits(i, n)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def _q4_k_m(name: str, module: nn.Module, layers: int) -> QuantFormat:
    if name == "lm_head":
        return Q6_K
    layer = _layer_of(name)
    if name.endswith(("v_proj", "down_proj")) and layer is not None and _more_bits(layer, layers):
        return Q6_K
    return Q4_K


def _q4_k_s(name: str, module: nn.Module, layers: int) -> QuantFormat:
    return Q6_K if name == "lm_head" else Q4_K


def _q8_0(name: str, module: nn.Module, layers: int) -> QuantFormat:
    return Q8_0


def _gptq(name: str, module: nn.Module, layers: int) -> QuantFormat | None:
    if name == "lm_head" or isinstance(module, nn.Embedding):
        return None
    return GPTQ_INT4


def _int4(name: str, module: nn.Module, layers: int) -> QuantFormat:
    return Q4_K


RECIPES: dict[str, Chooser | None] = {DENSE: None, "int4": _int4, "q4_k_m": _q4_k_m,
                                      "q4_k_s": _q4_k_s, "q8_0": _q8_0, "gptq-int4": _gptq}


def recipe_names() -> list[str]:
    return list(RECIPES)


def check_recipe(name: str) -> None:
    if name not in RECIPES:
        raise ValueError(f"unknown weight format {name!r}; known: {', '.join(RECIPES)}")


def _shape_of(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, nn.Embedding):
        return module.num_embeddings, module.embedding_dim
    return module.out_features, module.in_features


def _matrices(model: nn.Module):
    """(checkpoint name, module name, module, (N, K)) of every Linear/Embedding as a
    checkpoint stores it: a merged projection's parts by their own names
    (recipes choose per checkpoint matrix, e.g. v_proj apart from q_proj)."""
    from engine.quant.linear import quantizable_modules
    from engine.weights.merge import merge_groups

    groups = {g.name: g for g in merge_groups(model)}
    for name, module in quantizable_modules(model).items():
        group = groups.get(name)
        if group is None:
            yield name, name, module, _shape_of(module)
            continue
        for part, rows in zip(group.parts, group.rows):
            yield part, name, module, (rows, group.in_features)


def part_formats(model: nn.Module, recipe: "str | Chooser") -> dict[str, QuantFormat | None]:
    """Checkpoint matrix name -> the recipe's format (None: dense; so is a
    matrix whose row length no group of its format divides). `recipe` may
    be a Chooser of its own (a checkpoint's per-matrix formats, for the plan)."""
    if callable(recipe):
        choose = recipe
    else:
        check_recipe(recipe)
        choose = RECIPES[recipe]
    layers = getattr(getattr(model, "config", None), "num_layers", 0)
    out = {}
    for name, _, module, (_, k) in _matrices(model):
        fmt = None if choose is None else choose(name, module, layers)
        out[name] = fmt if fmt is not None and fmt.fits(k) else None
    return out


@dataclass(frozen=True)
class Layout:
    """How a recipe lays a model out, in the loader's terms: the packed
    format of each module (merged projections under their merged name, or
    `{name}.parts.{j}` where the parts' formats differ) and the output rows
    of each split projection's parts."""
    formats: dict[str, QuantFormat]
    splits: dict[str, tuple[int, ...]]


def plan_layout(model: nn.Module, recipe: str) -> Layout:
    """The recipe's layout of `model` (a meta model is fine), merged as
    engine/weights/merge.py merges a checkpoint: neighbouring parts of one
    format join, a group of one format is one module."""
    from engine.quant.linear import quantizable_modules
    from engine.weights.merge import merge_groups, runs, split_name

    chosen = part_formats(model, recipe)
    formats, splits = {}, {}
    grouped = set()
    for group in merge_groups(model):
        grouped.update(group.parts)
        fmts = [chosen[p] for p in group.parts]
        spans = runs(fmts)
        if len(spans) > 1:
            splits[group.name] = tuple(sum(group.rows[i] for i in span) for span in spans)
        for j, span in enumerate(spans):
            fmt = fmts[span[0]]
            if fmt is not None:
                formats[group.name if len(spans) == 1 else split_name(group.name, j)] = fmt
    for name in quantizable_modules(model):
        if name not in grouped and chosen.get(name) is not None:
            formats[name] = chosen[name]
    return Layout(formats, splits)


def plan_formats(model: nn.Module, recipe: str) -> dict[str, QuantFormat]:
    """Module name -> format for every Linear/Embedding the recipe quantizes,
    as plan_layout names them."""
    return plan_layout(model, recipe).formats


def widest_packed_in_features(model: nn.Module, recipe: "str | Chooser") -> int:
    """The longest row (K) among the matrices `recipe` packs; 0 when it
    packs none (what a prefill's dequantization workspace is sized by)."""
    chosen = part_formats(model, recipe)
    return max((k for name, _, _, (_, k) in _matrices(model) if chosen[name] is not None),
               default=0)


def recipe_weight_bytes(model: nn.Module, recipe: "str | Chooser", dense_dtype: torch.dtype,
                        prefix: str = "") -> int:
    """Bytes of `model`'s weights (a meta model is fine) under `recipe`; only
    the parameters whose names start with `prefix`, if given. Counted per
    checkpoint matrix: merging concatenates, so the sum is the same."""
    chosen = part_formats(model, recipe)
    matrices: dict[str, list] = {}  # module name -> (format, shape) of its matrices
    for name, module_name, _, shape in _matrices(model):
        matrices.setdefault(module_name, []).append((chosen[name], shape))
    total = 0
    for name, t in model.state_dict().items():
        if not name.startswith(prefix):
            continue
        owner = name.rpartition(".")[0]
        if owner in matrices and name.endswith(".weight"):
            total += sum(dense_dtype.itemsize * n * k if fmt is None else fmt.nbytes(n, k)
                         for fmt, (n, k) in matrices[owner])
        else:
            total += t.numel() * dense_dtype.itemsize
    return total


def swap_in_meta(model: nn.Module, recipe: str, compute_dtype: torch.dtype) -> dict[str, QuantFormat]:
    """Lay a meta-device model out as the recipe says: SplitLinear where a
    merged projection's formats differ, quantized modules holding meta
    tensors for every packed matrix; `to_empty` then allocates them like
    any buffer. Returns the formats by module name."""
    from engine.quant.linear import split_in, swap_in

    layout = plan_layout(model, recipe)
    for name, rows in layout.splits.items():
        split_in(model, name, rows)
    modules = dict(model.named_modules())
    metas = {name: fmt.meta(*_shape_of(modules[name])) for name, fmt in layout.formats.items()}
    swap_in(model, metas, compute_dtype)
    return layout.formats


@torch.no_grad()
def randomize_quantized(model: nn.Module, formats: dict[str, QuantFormat], seed: int) -> None:
    """Fill every quantized module with random codes and scales so the dense
    equivalent has std ~ 1/sqrt(fan_in) (0.02 for embeddings) and mean ~ 0."""
    from engine.quant.linear import QuantEmbedding

    modules = dict(model.named_modules())
    for index, (name, fmt) in enumerate(sorted(formats.items())):
        module = modules[name]
        gen = torch.Generator(device=module.qweight.device).manual_seed(seed * 7919 + index)
        k = module.qweight.shape[1] * (2 if fmt.bits == 4 else 1)
        target = 0.02 if isinstance(module, QuantEmbedding) else 1 / math.sqrt(k)
        if fmt.bits == 4:
            module.qweight.random_(0, 256, generator=gen)
        else:
            module.qweight.random_(fmt.code_min, fmt.code_max + 1, generator=gen)
        module.qsc.random_(32, 64, generator=gen)  # mean 47.5
        levels = fmt.code_max - fmt.code_min + 1
        code_std = math.sqrt((levels * levels - 1) / 12)
        d = target / (code_std * 47.5)
        module.qd.fill_(d)
        if fmt.asymmetric:
            middle = (fmt.code_max + fmt.code_min) / 2
            module.qm.copy_(module.qsc)
            module.qdmin.fill_(d * middle)
