"""W4A16 / W8A16 matmul over QuantTensor's packed layout: y = x @ w.T + bias.

Three paths, each with the PyTorch reference it is tested against:

  * `gemv` (engine/quant/gemv.py): decode batches of up to GEMV_MAX_ROWS
    rows (the MTP verify width included), built for memory bandwidth; its
    docstring says how.
  * `workspace_matmul`: prefill chunks (from `dense_gemm_min_rows()` rows,
    by default everything wider than the GEMV). A slice of the weight's rows
    at a time is dequantized into a bf16 workspace (`dequantize_rows`, one
    Triton launch) and cuBLAS writes that slice's columns of the output. A
    prefill chunk is compute-bound: cuBLAS's tensor-core GEMM is what it
    needs, and each packed weight is dequantized once per chunk. Slices of
    256 MB beat smaller ones (fewer and larger cuBLAS calls, fewer
    launches for the host; H100, engine/quant/workspace.py has the figures).
  * `gemm`: the fused path, when the workspace is switched off or below its
    row threshold. Each K tile of the weight is dequantized into the
    activation dtype and fed to tl.dot. 4-bit tiles are used as two halves
    (even and odd k, the low and high nibbles) against x's even and odd
    columns, so nothing is interleaved in registers. It ran at 15-25 TFLOP/s
    on the 27B's shapes, untuned.

All accumulate in fp32. `reference_matmul` (dequantize, then matmul) is what
the CPU runs and what the tests compare against.

Importing this module imports triton; under TRITON_INTERPRET=1 the kernels
run on CPU tensors (the tests use this).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.quant.tensor import QuantTensor
from engine.quant.workspace import (DEQUANT_BLOCK_N, dense_gemm_min_rows, slice_rows,
                                    workspace_bytes)

from engine.quant.gemv import GEMV_MAX_ROWS, gemv  # noqa: F401  (the decode path)


def reference_matmul(x: torch.Tensor, qt: QuantTensor, bias: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """x [..., K] @ dequantize(qt).T in x's dtype (fp32 dequantization). 4-bit
    weights are used as their even and odd columns, which skips interleaving."""
    if qt.bits == 4:
        w_even, w_odd = qt.dequantize_halves(x.dtype)
        y = torch.nn.functional.linear(x[..., 0::2], w_even)
        y = y.add_(torch.nn.functional.linear(x[..., 1::2], w_odd))
    else:
        y = torch.nn.functional.linear(x, qt.dequantize(x.dtype))
    return y if bias is None else y + bias


# ------------------------------------------------------------------ kernels


@triton.jit
def _group_scales(d_ptr, sc_ptr, dmin_ptr, m_ptr, offs_n, g_ids, mask, K,
                  G: tl.constexpr, S: tl.constexpr, ASYM: tl.constexpr, N_MAJOR: tl.constexpr):
    """fp32 s = d*sc and b = dmin*m for rows offs_n and groups g_ids, laid out
    [n, g] (N_MAJOR) or [g, n]."""
    groups = K // G
    supers = K // S
    if N_MAJOR:
        g_off = offs_n[:, None] * groups + g_ids[None, :]
        s_off = offs_n[:, None] * supers + (g_ids // (S // G))[None, :]
    else:
        g_off = offs_n[None, :] * groups + g_ids[:, None]
        s_off = offs_n[None, :] * supers + (g_ids // (S // G))[:, None]
    scale = tl.load(d_ptr + s_off, mask=mask, other=0.0).to(tl.float32) * \
        tl.load(sc_ptr + g_off, mask=mask, other=0).to(tl.float32)
    if ASYM:
        minimum = tl.load(dmin_ptr + s_off, mask=mask, other=0.0).to(tl.float32) * \
            tl.load(m_ptr + g_off, mask=mask, other=0).to(tl.float32)
    else:
        minimum = scale * 0.0
    return scale, minimum


@triton.jit
def _dequant_tile(q, scale, minimum, NG: tl.constexpr, W: tl.constexpr, BLOCK_N: tl.constexpr,
                  ROWS: tl.constexpr):
    """q [ROWS, BLOCK_N] codes of NG groups of W rows each -> q*s - b, same shape."""
    q3 = tl.reshape(q.to(tl.float32), [NG, W, BLOCK_N])
    w = q3 * scale[:, None, :] - minimum[:, None, :]
    return tl.reshape(w, [ROWS, BLOCK_N])


@triton.jit(do_not_specialize=("M",))
def _gemm_kernel(x_ptr, qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, out_ptr,
                 M, N, K, stride_xm, stride_om,
                 BITS: tl.constexpr, G: tl.constexpr, S: tl.constexpr, ASYM: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 K_TILES: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    NG: tl.constexpr = BLOCK_K // G
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for tile in range(0, K_TILES):
        k0 = tile * BLOCK_K
        g_ids = k0 // G + tl.arange(0, NG)
        g_mask = (g_ids < K // G)[:, None] & n_mask[None, :]
        scale, minimum = _group_scales(d_ptr, sc_ptr, dmin_ptr, m_ptr, offs_n, g_ids, g_mask,
                                       K, G, S, ASYM, False)
        if BITS == 4:
            HALF: tl.constexpr = BLOCK_K // 2
            j = k0 // 2 + tl.arange(0, HALF)
            j_ok = j < K // 2
            packed = tl.load(qw_ptr + offs_n[None, :] * (K // 2) + j[:, None],
                             mask=j_ok[:, None] & n_mask[None, :], other=0)
            w_lo = _dequant_tile(packed & 0xF, scale, minimum, NG, G // 2, BLOCK_N, HALF)
            w_hi = _dequant_tile(packed >> 4, scale, minimum, NG, G // 2, BLOCK_N, HALF)
            x_off = x_ptr + offs_m[:, None] * stride_xm + 2 * j[None, :]
            x_ok = m_mask[:, None] & j_ok[None, :]
            xe = tl.load(x_off, mask=x_ok, other=0.0)
            xo = tl.load(x_off + 1, mask=x_ok, other=0.0)
            if IEEE:  # fp32 activations, or the interpreter (its bf16 dot is wrong)
                acc += tl.dot(xe.to(tl.float32), w_lo, input_precision="ieee")
                acc += tl.dot(xo.to(tl.float32), w_hi, input_precision="ieee")
            else:
                acc += tl.dot(xe, w_lo.to(xe.dtype))
                acc += tl.dot(xo, w_hi.to(xo.dtype))
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            q = tl.load(qw_ptr + offs_n[None, :] * K + k[:, None],
                        mask=k_ok[:, None] & n_mask[None, :], other=0)
            w = _dequant_tile(q, scale, minimum, NG, G, BLOCK_N, BLOCK_K)
            xv = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                         mask=m_mask[:, None] & k_ok[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(xv.to(tl.float32), w, input_precision="ieee")
            else:
                acc += tl.dot(xv, w.to(xv.dtype))
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _dequantize_rows_kernel(qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, out_ptr,
                            first_row, rows, K, stride_o,
                            BITS: tl.constexpr, G: tl.constexpr, S: tl.constexpr,
                            ASYM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[r, :] = the weight's row first_row + r, dequantized (r < rows)."""
    NG: tl.constexpr = BLOCK_K // G
    local = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = first_row + local
    n_ok = local < rows
    k0 = tl.program_id(1) * BLOCK_K
    g_ids = k0 // G + tl.arange(0, NG)
    g_mask = n_ok[:, None] & (g_ids < K // G)[None, :]
    scale, minimum = _group_scales(d_ptr, sc_ptr, dmin_ptr, m_ptr, offs_n, g_ids, g_mask,
                                   K, G, S, ASYM, True)
    k = k0 + tl.arange(0, BLOCK_K)
    k_ok = n_ok[:, None] & (k < K)[None, :]
    if BITS == 4:
        j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(qw_ptr + offs_n[:, None] * (K // 2) + j[None, :],
                         mask=n_ok[:, None] & (j < K // 2)[None, :], other=0)
        codes = tl.interleave(packed & 0xF, packed >> 4)  # byte j holds k = 2j, 2j + 1
    else:
        codes = tl.load(qw_ptr + offs_n[:, None] * K + k[None, :], mask=k_ok, other=0)
    q = tl.reshape(codes.to(tl.float32), [BLOCK_N, NG, G])
    # QuantTensor's order: (d * sc) * q - dmin * m, in fp32
    w = tl.reshape(q * scale[:, :, None] - minimum[:, :, None], [BLOCK_N, BLOCK_K])
    tl.store(out_ptr + local[:, None] * stride_o + k[None, :],
             w.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=k_ok)


# ----------------------------------------------------------------- launchers


def _parts(qt: QuantTensor):
    dmin = qt.dmin if qt.asymmetric else qt.d  # never read when symmetric
    m = qt.m if qt.asymmetric else qt.sc
    return qt.qweight, qt.d, qt.sc, dmin, m


def _block_k(qt: QuantTensor, want: int) -> int:
    return max(want, qt.group)


def _interpreting() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# K-elements one dequantization program writes (with DEQUANT_BLOCK_N rows: 64 KiB of bf16)
DEQUANT_BLOCK_K = 1024


def dequantize_rows(qt: QuantTensor, first_row: int, out: torch.Tensor) -> torch.Tensor:
    """out [rows, K] = rows first_row .. first_row + rows of the dense weight,
    in out's dtype (QuantTensor.dequantize's values: fp32 math, then rounded)."""
    rows, k_dim = out.shape
    if k_dim != qt.in_features or not 0 <= first_row <= qt.out_features - rows:
        raise ValueError(f"rows {first_row}..{first_row + rows} x {k_dim} are not inside the "
                         f"{qt.out_features} x {qt.in_features} weight")
    if out.stride(1) != 1:
        raise ValueError("dequantize_rows writes rows of contiguous columns")
    block_k = max(DEQUANT_BLOCK_K, qt.superblock)
    grid = (triton.cdiv(rows, DEQUANT_BLOCK_N), triton.cdiv(k_dim, block_k))
    _dequantize_rows_kernel[grid](
        *_parts(qt), out, first_row, rows, k_dim, out.stride(0),
        BITS=qt.bits, G=qt.group, S=qt.superblock, ASYM=qt.asymmetric,
        BLOCK_N=DEQUANT_BLOCK_N, BLOCK_K=block_k)
    return out


def workspace_matmul(x: torch.Tensor, qt: QuantTensor, budget_bytes: int | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype: the weight a slice of rows at a time,
    dequantized into a workspace of at most `budget_bytes` (default
    workspace_bytes()), times x by the dense matmul into its output columns."""
    m_rows, k_dim = x.shape
    n_dim = qt.out_features
    if out is None:
        out = torch.empty(m_rows, n_dim, dtype=x.dtype, device=x.device)
    step = min(slice_rows(k_dim, budget_bytes or workspace_bytes(), x.element_size()), n_dim)
    workspace = torch.empty(step, k_dim, dtype=x.dtype, device=x.device)
    for first in range(0, n_dim, step):
        rows = min(step, n_dim - first)
        w = dequantize_rows(qt, first, workspace[:rows])
        # a column slice of a row-major output is a strided matrix cuBLAS writes in place
        torch.mm(x, w.t(), out=out[:, first:first + rows])
    return out


def gemm(x: torch.Tensor, qt: QuantTensor, block_m: int = 64, block_n: int = 64,
         block_k: int = 64, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (any M) -> [M, N] in x's dtype, via tl.dot on dequantized tiles."""
    m_rows, k_dim = x.shape
    n_dim = qt.out_features
    x = x.contiguous()
    block_k = _block_k(qt, block_k)
    if qt.bits == 4:
        block_k = max(block_k, 32)  # halves of >= 16 for tl.dot
    if out is None:
        out = torch.empty(m_rows, n_dim, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m_rows, block_m), triton.cdiv(n_dim, block_n))
    _gemm_kernel[grid](
        x, *_parts(qt), out, m_rows, n_dim, k_dim, x.stride(0), out.stride(0),
        BITS=qt.bits, G=qt.group, S=qt.superblock, ASYM=qt.asymmetric,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, K_TILES=triton.cdiv(k_dim, block_k),
        IEEE=x.dtype == torch.float32 or _interpreting())
    return out


def triton_matmul(x: torch.Tensor, qt: QuantTensor, bias: torch.Tensor | None = None,
                  l2_prefetch=None) -> torch.Tensor:
    """x [..., K] -> [..., N]: gemv for up to GEMV_MAX_ROWS rows (l2_prefetch:
    what a one-row CUDA GEMV reads ahead), else gemm."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        y = x2.new_empty(0, qt.out_features)
    elif x2.shape[0] <= GEMV_MAX_ROWS:
        y = gemv(x2, qt, bias=bias, l2_prefetch=l2_prefetch)
    elif x2.shape[0] >= dense_gemm_min_rows() and (budget := workspace_bytes()):
        y = workspace_matmul(x2, qt, budget)
        if bias is not None:
            y = y + bias
    else:
        y = gemm(x2, qt)
        if bias is not None:
            y = y + bias
    return y.view(*lead, qt.out_features)
