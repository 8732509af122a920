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
groups; the values are unchanged). Scales stay as stored (fp16 or fp32; bf16
is widened to fp32, exactly): the caller must not cast them first.

`tandem plan` checks and sizes a checkpoint from its config and safetensors
headers through the same functions loading uses (quant_scheme,
matrix_layout, check_group_index), so it refuses exactly what loading
refuses, with the same message, and counts exactly the bytes loading makes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple

import torch

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.quant.tensor import QuantTensor

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_PARTS = ("qweight", "qzeros", "scales", "g_idx")
ONE_GROUP_PER_ROW = -1


@dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's quantization_config, checked: what tandem can read."""
    method: str  # "gptq" or "awq"
    group: int   # input columns per scale; ONE_GROUP_PER_ROW for a row's one group
    v1: bool     # GPTQ format v1 (zeros stored minus one)


def quant_scheme(quant: object, source: str) -> QuantScheme:
    """The scheme of a quantization_config, or the error loading (and the
    plan) gives for it."""
    if not isinstance(quant, dict):
        raise ModelLoadError(f"{source}: quantization_config must be an object, got {quant!r}")
    method = str(quant.get("quant_method", "")).lower()
    if method not in ("gptq", "awq"):
        raise UnsupportedModelError(f"{source}: quantization {method!r} is not supported; tandem "
                                    "reads GPTQ and AWQ int4 checkpoints (or GGUF files)")
    bits = _config_int(quant, ("bits", "w_bit"), 4, source)
    if bits != 4:
        raise UnsupportedModelError(f"{source}: {method} with {bits} bits is not supported "
                                    "(int4 only)")
    group = _config_int(quant, ("group_size", "q_group_size"), 128, source)
    if group != ONE_GROUP_PER_ROW and group < 1:
        raise ModelLoadError(f"{source}: quantization_config group_size must be -1 (one group "
                             f"a row) or >= 1, got {group}")
    v1 = method == "gptq" and quant.get("checkpoint_format", "gptq") == "gptq"
    return QuantScheme(method, group, v1)


def _config_int(quant: dict, keys: tuple[str, ...], default: int, source: str) -> int:
    key = next((k for k in keys if k in quant), None)
    if key is None:
        return default
    try:
        return int(quant[key])
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{source}: quantization_config {key} must be an integer, "
                             f"got {quant[key]!r}") from e


class MatrixLayout(NamedTuple):
    """One packed matrix as loading lays it out (QuantTensor, 4-bit, d = dmin
    = scale, sc = 1, m = zero)."""
    rows: int                 # N
    cols: int                 # K
    group: int                # the power-of-two group of the packed layout
    scale_dtype: torch.dtype  # of d and dmin

    @property
    def quant_format(self):
        """The recipe format that counts and lays out this matrix (the plan's
        bytes come from it, so there is one formula for both)."""
        from engine.quant.recipes import QuantFormat

        return QuantFormat("GPTQ/AWQ int4", 4, 0, 15, self.group, self.group, True,
                           self.scale_dtype.itemsize)


def loaded_scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scales are kept in: fp16 and fp32 as stored (no rounding),
    anything wider or bf16 (which QuantTensor does not hold) as fp32."""
    if not dtype.is_floating_point:
        raise ValueError(f"scales must be floating point, got {dtype}")
    return dtype if dtype in (torch.float16, torch.float32) else torch.float32


def matrix_layout(method: str, group: int, qweight: tuple[int, ...] | None,
                  qzeros: tuple[int, ...] | None, scales: tuple[int, ...] | None,
                  dtypes: Mapping[str, torch.dtype]) -> MatrixLayout:
    """Check one matrix's stored shapes and dtypes (ValueError saying what
    does not fit) and return its packed layout. Shapes only: no data."""
    if qweight is None or qzeros is None or scales is None:
        raise ValueError("needs qweight, qzeros and scales")
    for part in ("qweight", "qzeros"):
        if dtypes[part] != torch.int32:
            raise ValueError(f"{part} must be int32, got {dtypes[part]}")
    if len(qweight) != 2 or len(qzeros) != 2 or len(scales) != 2:
        raise ValueError(f"qweight {qweight}, qzeros {qzeros} and scales {scales} must be "
                         "matrices")
    if method == "gptq":
        k, n = qweight[0] * 8, qweight[1]
    else:
        k, n = qweight[0], qweight[1] * 8
    if group != ONE_GROUP_PER_ROW and group < 1:
        raise ValueError(f"group size {group} must be -1 or >= 1")
    group = k if group == ONE_GROUP_PER_ROW else group
    zero_columns = -(-n // 8) if method == "gptq" else n // 8
    if k % group or tuple(scales) != (k // group, n) or tuple(qzeros) != (k // group,
                                                                          zero_columns):
        raise ValueError(f"scales {tuple(scales)} / zeros {tuple(qzeros)} do not fit a "
                         f"[{n}, {k}] weight with group {group}")
    return MatrixLayout(n, k, _power_of_two_group(group, k),
                        loaded_scale_dtype(dtypes["scales"]))


def check_group_index(g_idx: torch.Tensor | None, k: int, group: int) -> None:
    """GPTQ's g_idx must be k // group: act-order (desc_act) checkpoints whose
    g_idx reorders the input channels are refused. Static groups with
    desc_act keep k // group and load."""
    group = k if group == ONE_GROUP_PER_ROW else group
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64),
                                             torch.arange(k, dtype=torch.int64) // group):
        raise UnsupportedModelError("g_idx reorders the input channels (desc_act=True with "
                                    "act-order); tandem supports desc_act=False checkpoints")


def _matrix_error(e: Exception, source: str, method: str, prefix: str) -> ModelLoadError:
    """A matrix's error, naming the file and the tensor (as loading and the
    plan both report it)."""
    kind = UnsupportedModelError if isinstance(e, UnsupportedModelError) else ModelLoadError
    return kind(f"{source}: {method} tensor {prefix!r}: {e}")


def quantized_prefixes(names) -> list[str]:
    return sorted(n.removesuffix(".qweight") for n in names if n.endswith(".qweight"))


def plan_matrices(header: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                  read: Callable[[str], torch.Tensor], quant: dict, source: str
                  ) -> dict[str, MatrixLayout]:
    """Every packed matrix's layout from the checkpoint's header (name ->
    (shape, dtype)), checked as repack_checkpoint checks it; `read` fetches
    the one tensor the check needs data of (GPTQ's small g_idx)."""
    scheme = quant_scheme(quant, source)
    out = {}
    for prefix in quantized_prefixes(header):
        found = {p: header[f"{prefix}.{p}"] for p in _PARTS if f"{prefix}.{p}" in header}
        shapes = {p: tuple(shape) for p, (shape, _) in found.items()}
        try:
            layout = matrix_layout(scheme.method, scheme.group, shapes.get("qweight"),
                                   shapes.get("qzeros"), shapes.get("scales"),
                                   {p: dtype for p, (_, dtype) in found.items()})
            if scheme.method == "gptq" and "g_idx" in found:
                check_group_index(read(f"{prefix}.g_idx"), layout.cols, scheme.group)
        except (ValueError, UnsupportedModelError) as e:
            raise _matrix_error(e, source, scheme.method, prefix) from e
        out[prefix] = layout
    return out


def repack_checkpoint(tensors: dict[str, torch.Tensor], quant: dict, dtype: torch.dtype,
                      keep_quantized: bool, source: str) -> dict[str, torch.Tensor]:
    scheme = quant_scheme(quant, source)
    method, group = scheme.method, scheme.group
    out = dict(tensors)
    for prefix in quantized_prefixes(tensors):
        parts = {p: out.pop(f"{prefix}.{p}", None) for p in _PARTS}
        try:
            if method == "gptq":
                qt = gptq_tensor(parts["qweight"], parts["qzeros"], parts["scales"],
                                 parts["g_idx"], group, scheme.v1)
            else:
                qt = awq_tensor(parts["qweight"], parts["qzeros"], parts["scales"], group)
        except (ValueError, TypeError, AttributeError, RuntimeError, UnsupportedModelError) as e:
            raise _matrix_error(e, source, method, prefix) from e
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


def _layout_of(method: str, qweight, qzeros, scales, group: int) -> MatrixLayout:
    shape = (lambda t: None if t is None else tuple(t.shape))  # noqa: E731
    dtypes = {p: t.dtype for p, t in (("qweight", qweight), ("qzeros", qzeros),
                                      ("scales", scales)) if t is not None}
    return matrix_layout(method, group, shape(qweight), shape(qzeros), shape(scales), dtypes)


def _finish(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
            layout: MatrixLayout) -> QuantTensor:
    """codes [N, K], zeros and scales [N, K/group] -> QuantTensor (G = S)."""
    k = layout.cols
    rep = k // scales.shape[1] // layout.group
    if rep > 1:
        zeros, scales = zeros.repeat_interleave(rep, 1), scales.repeat_interleave(rep, 1)
    if int(zeros.min()) < 0 or int(zeros.max()) > 127:
        raise ValueError("zero points outside 0..127")
    scales = scales.to(layout.scale_dtype)  # as stored, unless bf16 (widened exactly)
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
    layout = _layout_of("gptq", qweight, qzeros, scales, group)
    check_group_index(g_idx, layout.cols, group)
    codes = _nibbles(qweight, 0).t().contiguous()  # [N, K]
    zeros = _nibbles(qzeros, 1)[:, :layout.rows] + (1 if v1 else 0)  # [K/G, N]
    return _finish(codes, zeros.t().contiguous(), scales.t().contiguous(), layout)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    x = _nibbles(packed, 1)  # column 8c + i holds nibble i
    n = x.shape[1]
    order = torch.tensor(AWQ_ORDER)
    perm = torch.empty(8, dtype=torch.long)
    perm[order] = torch.arange(8)  # column 8c + j is nibble perm[j]
    index = (torch.arange(n) // 8) * 8 + perm.repeat(n // 8)
    return x.index_select(1, index)


def awq_tensor(qweight, qzeros, scales, group: int) -> QuantTensor:
    layout = _layout_of("awq", qweight, qzeros, scales, group)
    codes = _awq_columns(qweight).t().contiguous()  # [N, K]
    zeros = _awq_columns(qzeros)
    return _finish(codes, zeros.t().contiguous(), scales.t().contiguous(), layout)
