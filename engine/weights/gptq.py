"""GPTQ and AWQ int4 checkpoints (Hugging Face layout), repacked without
re-quantizing into QuantTensor (engine/quant/tensor.py).

GPTQ (`quant_method: gptq`, AutoGPTQ/GPTQModel/optimum layout):
  qweight int32 [K/8, N]: k = 8i + j in bits 4j..4j+3 of row i
  qzeros  int32 [K/G, N/8]: n = 8c + j in bits 4j of column c; format v1
          ("gptq", the default) stores zero - 1, v2 ("gptq_v2") the zero
  scales  fp16 [K/G, N];  g_idx int32 [K] (must be k // G: desc_act
          reordering is not supported)
  w[n, k] = scales[g, n] * (q - zero[g, n]),  g = k // G
AWQ (`quant_method: awq`, GEMM layout):
  qweight int32 [K, N/8], qzeros int32 [K/G, N/8]: nibble i of column c holds
  n = 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]; scales [K/G, N]; zeros stored as is.
Both map to 4-bit codes with d = dmin = scale, sc = 1, m = zero, exact in
fp32. Group size -1 (one group per row) becomes the largest power-of-two
group <= 128 dividing K, its scale repeated (the kernels need power-of-two
groups; the values are unchanged).
"""
from __future__ import annotations

import torch

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.quant.tensor import QuantTensor

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def repack_checkpoint(tensors: dict[str, torch.Tensor], quant: dict, dtype: torch.dtype,
                      keep_quantized: bool, source: str) -> dict[str, torch.Tensor]:
    method = str(quant.get("quant_method", "")).lower()
    if method not in ("gptq", "awq"):
        raise UnsupportedModelError(f"{source}: quantization {method!r} is not supported; tandem "
                                    "reads GPTQ and AWQ int4 checkpoints (or GGUF files)")
    bits = int(quant.get("bits", quant.get("w_bit", 4)))
    if bits != 4:
        raise UnsupportedModelError(f"{source}: {method} with {bits} bits is not supported "
                                    "(int4 only)")
    group = int(quant.get("group_size", quant.get("q_group_size", 128)))
    v1 = method == "gptq" and quant.get("checkpoint_format", "gptq") == "gptq"
    out = dict(tensors)
    for prefix in sorted(n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight")):
        parts = {p: out.pop(f"{prefix}.{p}", None) for p in _PARTS}
        try:
            if method == "gptq":
                qt = gptq_tensor(parts["qweight"], parts["qzeros"], parts["scales"],
                                 parts["g_idx"], group, v1)
            else:
                qt = awq_tensor(parts["qweight"], parts["qzeros"], parts["scales"], group)
        except (ValueError, TypeError, AttributeError, RuntimeError) as e:
            raise ModelLoadError(f"{source}: {method} tensor {prefix!r}: {e}") from e
        if keep_quantized:
            out.update(qt.state(prefix))
        else:
            out[f"{prefix}.weight"] = qt.dequantize(dtype)
    return out


def _nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their 8 nibbles (low first), interleaved along `dim`."""
    p = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    x = (p.unsqueeze(-1) >> shifts) & 0xF  # [..., 8] at the end
    x = x.movedim(-1, dim + 1)
    shape = list(packed.shape)
    shape[dim] *= 8
    return x.reshape(shape).to(torch.int32)


def _scales(scales: torch.Tensor) -> torch.Tensor:
    return scales if scales.dtype in (torch.float16, torch.float32) else scales.to(torch.float32)


def _finish(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int
            ) -> QuantTensor:
    """codes [N, K], zeros and scales [N, K/group] -> QuantTensor (G = S)."""
    n, k = codes.shape
    if zeros.shape != scales.shape or scales.shape[1] * group != k:
        raise ValueError(f"scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} do not fit "
                         f"a [{n}, {k}] weight with group {group}")
    step = _power_of_two_group(group, k)
    rep = group // step
    if rep > 1:
        zeros, scales = zeros.repeat_interleave(rep, 1), scales.repeat_interleave(rep, 1)
    if int(zeros.min()) < 0 or int(zeros.max()) > 127:
        raise ValueError("zero points outside 0..127")
    return QuantTensor.from_codes(codes, 4, scales, torch.ones_like(zeros, dtype=torch.int8),
                                  scales.clone(), zeros.to(torch.int8))


def _power_of_two_group(group: int, k: int) -> int:
    g = 128
    while g > 1 and (group % g or k % g):
        g //= 2
    if g < 2:
        raise ValueError(f"group {group} has no even power-of-two divisor")
    return g


def gptq_tensor(qweight, qzeros, scales, g_idx, group: int, v1: bool = True) -> QuantTensor:
    if qweight is None or qzeros is None or scales is None:
        raise ValueError("needs qweight, qzeros and scales")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    group = k if group == -1 else group
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64),
                                             torch.arange(k, dtype=torch.int64) // group):
        raise UnsupportedModelError("g_idx reorders the input channels (desc_act=True with "
                                    "act-order); tandem supports desc_act=False checkpoints")
    codes = _nibbles(qweight, 0).t().contiguous()  # [N, K]
    zeros = _nibbles(qzeros, 1)[:, :n] + (1 if v1 else 0)  # [K/G, N]
    return _finish(codes, zeros.t().contiguous(), _scales(scales).t().contiguous(), group)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    x = _nibbles(packed, 1)  # column 8c + i holds nibble i
    n = x.shape[1]
    order = torch.tensor(AWQ_ORDER)
    perm = torch.empty(8, dtype=torch.long)
    perm[order] = torch.arange(8)  # column 8c + j is nibble perm[j]
    index = (torch.arange(n) // 8) * 8 + perm.repeat(n // 8)
    return x.index_select(1, index)


def awq_tensor(qweight, qzeros, scales, group: int) -> QuantTensor:
    if qweight is None or qzeros is None or scales is None:
        raise ValueError("needs qweight, qzeros and scales")
    k = qweight.shape[0]
    group = k if group == -1 else group
    codes = _awq_columns(qweight).t().contiguous()  # [N, K]
    zeros = _awq_columns(qzeros)
    return _finish(codes, zeros.t().contiguous(), _scales(scales).t().contiguous(), group)
