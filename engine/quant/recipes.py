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

    def fits(self, k: int) -> bool:
        return k % self.group == 0

    def superblock_for(self, k: int) -> int:
        """The superblock a row of k allows (a narrower one changes no value)."""
        return math.gcd(self.superblock, k)

    def nbytes(self, n: int, k: int) -> int:
        codes = n * k * self.bits // 8
        groups, supers = n * (k // self.group), n * (k // self.superblock_for(k))
        per_group, per_super = (2, 4) if self.asymmetric else (1, 2)
        return codes + groups * per_group + supers * per_super

    def meta(self, n: int, k: int) -> QuantTensor:
        """A QuantTensor of this format on the meta device (shapes only)."""
        s = self.superblock_for(k)
        with torch.device("meta"):
            qweight = torch.empty(n, k // 2, dtype=torch.uint8) if self.bits == 4 else \
                torch.empty(n, k, dtype=torch.int8)
            d = torch.empty(n, k // s, dtype=torch.float16)
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


def plan_formats(model: nn.Module, recipe: str) -> dict[str, QuantFormat]:
    """Module name -> format for every Linear/Embedding the recipe quantizes
    (a module whose row length no group divides stays dense)."""
    from engine.quant.linear import quantizable_modules

    check_recipe(recipe)
    choose = RECIPES[recipe]
    if choose is None:
        return {}
    layers = getattr(getattr(model, "config", None), "num_layers", 0)
    out = {}
    for name, module in quantizable_modules(model).items():
        fmt = choose(name, module, layers)
        if fmt is not None and fmt.fits(_shape_of(module)[1]):
            out[name] = fmt
    return out


def recipe_weight_bytes(model: nn.Module, recipe: str, dense_dtype: torch.dtype,
                        prefix: str = "") -> int:
    """Bytes of `model`'s weights (a meta model is fine) under `recipe`; only
    the parameters whose names start with `prefix`, if given."""
    formats = plan_formats(model, recipe)
    total = 0
    for name, t in model.state_dict().items():
        if not name.startswith(prefix):
            continue
        owner = name.rpartition(".")[0]
        if owner in formats and name.endswith(".weight"):
            total += formats[owner].nbytes(*t.shape)
        else:
            total += t.numel() * dense_dtype.itemsize
    return total


def swap_in_meta(model: nn.Module, recipe: str, compute_dtype: torch.dtype) -> dict[str, QuantFormat]:
    """Replace the recipe's modules of a meta-device model by quantized ones
    holding meta tensors; `to_empty` then allocates them like any buffer."""
    from engine.quant.linear import swap_in

    formats = plan_formats(model, recipe)
    modules = dict(model.named_modules())
    metas = {name: fmt.meta(*_shape_of(modules[name])) for name, fmt in formats.items()}
    swap_in(model, metas, compute_dtype)
    return formats


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
