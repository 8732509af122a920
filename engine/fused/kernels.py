"""Triton kernels of the fused ops, one launch each, and their wrappers.

Every kernel loads in the activation dtype, computes in fp32 and rounds to the
activation dtype exactly where the PyTorch reference (engine/fused/reference.py)
rounds, so bf16 results agree to an ulp or so (the fp32 reductions sum in a
different order). Rows are whole in one program: the norms reduce over at
most MAX_ROW elements (27B hidden 5120, head dims 128/256), so no two-pass
reduction is needed; wider rows take the reference.

Importing this module imports triton; under TRITON_INTERPRET=1 the kernels run
on CPU tensors (tests/test_fused.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.fused import reference
from engine.pdl import pdl_launch, pdl_prologue, release_first_launch

MAX_ROW = 16384  # widest row one program normalizes (registers: 16 warps x 32 values)


def _row_block(n: int) -> tuple[int, int]:
    """(power-of-two block covering n, warps for it)."""
    block = max(triton.next_power_of_2(n), 16)
    return block, min(max(block // 512, 1), 16)


@triton.jit
def _rounded(v, DT: tl.constexpr):
    """fp32 v rounded to the activation dtype and back (a no-op for fp32)."""
    return v.to(DT).to(tl.float32)


@triton.jit
def _scaled(xhat, w_ptr, offs, mask, ZERO_CENTERED: tl.constexpr, DT: tl.constexpr):
    """The normalized row times its weight, as fp32 holding the stored value:
    zero-centred x̂ * (1 + w) in fp32; Llama w * round(x̂), rounded."""
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        y = xhat * (1.0 + w)
    else:
        y = w * _rounded(xhat, DT)
    return _rounded(y, DT)


@triton.jit
def _rms_norm_kernel(x_ptr, h_ptr, w_ptr, sum_ptr, out_ptr, N, x_stride, h_stride, sum_stride,
                     out_stride, eps, HAS_RESIDUAL: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr, RELEASE_FIRST: tl.constexpr):
    """One row: optionally s = x + h (stored, rounded), then RMSNorm(s). The
    Llama product w * round(x̂) is rounded by the store to out's dtype (x's, or
    fp32 when the weight is wider). The weight is read before the
    dependent-launch wait (no kernel writes it), off the step's critical path."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_prologue(PDL, RELEASE_FIRST)
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    xf = x.to(tl.float32)
    if HAS_RESIDUAL:
        h = tl.load(h_ptr + row * h_stride + offs, mask=mask, other=0.0).to(tl.float32)
        xf = _rounded(xf + h, DT)
        tl.store(sum_ptr + row * sum_stride + offs, xf.to(DT), mask=mask)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    xhat = xf * rstd
    if ZERO_CENTERED:
        y = xhat * (1.0 + w)
    else:
        y = w * _rounded(xhat, DT)
    tl.store(out_ptr + row * out_stride + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, out_ptr, N, H, g_stride_t, g_stride_h, eps,
                           ROUND: tl.constexpr, BLOCK: tl.constexpr,
                           PDL: tl.constexpr, RELEASE_FIRST: tl.constexpr):
    """One head row (x: contiguous rows of N; g: head h of token t at
    t * g_stride_t + h * g_stride_h, H heads): round(w * round(x̂)) * SiLU(g)
    in fp32. The weight is read before the dependent-launch wait."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_prologue(PDL, RELEASE_FIRST)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    xf = tl.load(x_ptr + row * N + offs, mask=mask, other=0.0).to(tl.float32)
    g_row = (row // H) * g_stride_t + (row % H) * g_stride_h
    g = tl.load(g_ptr + g_row + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    y = w * _rounded(xf * rstd, DT)
    if ROUND:
        y = _rounded(y, DT)
    silu = g / (1.0 + tl.exp(-g))
    tl.store(out_ptr + row * N + offs, (y * silu).to(DT), mask=mask)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, g_stride, u_stride, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    """Row program_id(0), columns block program_id(1); g and u rows may be
    strided (the two halves of one [T, 2n] gate_up output), out is contiguous."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    DT: tl.constexpr = g_ptr.dtype.element_ty
    g = tl.load(g_ptr + row * g_stride + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_stride + offs, mask=mask, other=0.0).to(tl.float32)
    a = _rounded(g / (1.0 + tl.exp(-g)), DT)
    tl.store(out_ptr + row * n + offs, (a * u).to(DT), mask=mask)


@triton.jit
def _norm_rope_head(pid, x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, normed_ptr, H, D, R,
                    stride_t, stride_h, cs_stride, eps, HAS_NORM: tl.constexpr,
                    ZERO_CENTERED: tl.constexpr, STORE_NORMED: tl.constexpr,
                    HALF_BLOCK: tl.constexpr, REST_BLOCK: tl.constexpr):
    """(token, head) number pid of x: optional RMSNorm over the head, then
    rotate-half rotary on its first R dims. The head is loaded as three
    pieces (first and second rotary halves, the unrotated rest) so the
    rotation pairs lanes without shuffles. Products and the sum are rounded
    like the eager ops."""
    t = pid // H
    head = pid % H
    base = x_ptr + t * stride_t + head * stride_h
    DT: tl.constexpr = out_ptr.dtype.element_ty
    half = R // 2
    o1 = tl.arange(0, HALF_BLOCK)
    m1 = o1 < half
    o2 = o1 + half
    o3 = R + tl.arange(0, REST_BLOCK)
    m3 = o3 < D
    x1 = tl.load(base + o1, mask=m1, other=0.0).to(tl.float32)
    x2 = tl.load(base + o2, mask=m1, other=0.0).to(tl.float32)
    x3 = tl.load(base + o3, mask=m3, other=0.0).to(tl.float32)
    if HAS_NORM:
        ss = tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0) + tl.sum(x3 * x3, axis=0)
        rstd = tl.rsqrt(ss / D + eps)
        x1 = _scaled(x1 * rstd, w_ptr, o1, m1, ZERO_CENTERED, DT)
        x2 = _scaled(x2 * rstd, w_ptr, o2, m1, ZERO_CENTERED, DT)
        x3 = _scaled(x3 * rstd, w_ptr, o3, m3, ZERO_CENTERED, DT)
    cs = t * cs_stride
    c1 = tl.load(cos_ptr + cs + o1, mask=m1, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + o2, mask=m1, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cs + o1, mask=m1, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + cs + o2, mask=m1, other=0.0).to(tl.float32)
    r1 = _rounded(_rounded(x1 * c1, DT) - _rounded(x2 * s1, DT), DT)
    r2 = _rounded(_rounded(x2 * c2, DT) + _rounded(x1 * s2, DT), DT)
    out = out_ptr + pid * D
    tl.store(out + o1, r1.to(DT), mask=m1)
    tl.store(out + o2, r2.to(DT), mask=m1)
    tl.store(out + o3, x3.to(DT), mask=m3)
    if STORE_NORMED:
        normed = normed_ptr + pid * D
        tl.store(normed + o1, x1.to(DT), mask=m1)
        tl.store(normed + o2, x2.to(DT), mask=m1)
        tl.store(normed + o3, x3.to(DT), mask=m3)


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, normed_ptr, H, D, R,
                      stride_t, stride_h, cs_stride, eps, HAS_NORM: tl.constexpr,
                      ZERO_CENTERED: tl.constexpr, STORE_NORMED: tl.constexpr,
                      HALF_BLOCK: tl.constexpr, REST_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One (token, head) of x a program (_norm_rope_head)."""
    pdl_prologue(PDL)
    _norm_rope_head(tl.program_id(0).to(tl.int64), x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr,
                    normed_ptr, H, D, R, stride_t, stride_h, cs_stride, eps, HAS_NORM,
                    ZERO_CENTERED, STORE_NORMED, HALF_BLOCK, REST_BLOCK)


@triton.jit
def _norm_rope_pair_kernel(q_ptr, qw_ptr, k_ptr, kw_ptr, cos_ptr, sin_ptr, q_out_ptr,
                           k_out_ptr, k_normed_ptr, q_programs, HQ, HK, D, R, q_stride_t,
                           q_stride_h, k_stride_t, k_stride_h, cs_stride, eps,
                           HAS_NORM: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                           STORE_NORMED: tl.constexpr, HALF_BLOCK: tl.constexpr,
                           REST_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """The queries' and the keys' (token, head)s in one launch: programs
    below q_programs take q's, the rest k's (with STORE_NORMED, k's before
    rotary too)."""
    pdl_prologue(PDL)
    pid = tl.program_id(0).to(tl.int64)
    if pid < q_programs:
        _norm_rope_head(pid, q_ptr, qw_ptr, cos_ptr, sin_ptr, q_out_ptr, q_out_ptr, HQ, D, R,
                        q_stride_t, q_stride_h, cs_stride, eps, HAS_NORM, ZERO_CENTERED, False,
                        HALF_BLOCK, REST_BLOCK)
    else:
        _norm_rope_head(pid - q_programs, k_ptr, kw_ptr, cos_ptr, sin_ptr, k_out_ptr,
                        k_normed_ptr, HK, D, R, k_stride_t, k_stride_h, cs_stride, eps,
                        HAS_NORM, ZERO_CENTERED, STORE_NORMED, HALF_BLOCK, REST_BLOCK)


@triton.jit
def _sigmoid_gate_kernel(o_ptr, g_ptr, out_ptr, H, D, g_stride_t, g_stride_h,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One (token, head): out * round(sigmoid(gate)); the gate is read in place
    from the q projection's [query | gate] layout."""
    pdl_prologue(PDL)
    pid = tl.program_id(0).to(tl.int64)
    t = pid // H
    head = pid % H
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    DT: tl.constexpr = out_ptr.dtype.element_ty
    o = tl.load(o_ptr + pid * D + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + t * g_stride_t + head * g_stride_h + offs, mask=mask,
                other=0.0).to(tl.float32)
    s = _rounded(1.0 / (1.0 + tl.exp(-g)), DT)
    tl.store(out_ptr + pid * D + offs, (o * s).to(DT), mask=mask)


# ------------------------------------------------------------------ wrappers


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output's allocation (the tests poison it with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with unit stride along the row (a view when it can be)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _norm_dtype(x: torch.Tensor, weight: torch.Tensor, zero_centered: bool) -> torch.dtype:
    return x.dtype if zero_centered else torch.promote_types(weight.dtype, x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """reference.rms_norm in one launch."""
    n = x.shape[-1]
    if n > MAX_ROW or x.numel() == 0:
        return reference.rms_norm(x, weight, eps, zero_centered)
    rows = _rows(x)
    out = _empty(rows.shape, _norm_dtype(x, weight, zero_centered), x.device)
    _launch_rms_norm(rows, None, weight, None, out, eps, zero_centered)
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.add_rms_norm in one launch: (x + h, rms_norm(x + h))."""
    n = x.shape[-1]
    if n > MAX_ROW or x.numel() == 0 or x.shape != h.shape or x.dtype != h.dtype:
        return reference.add_rms_norm(x, h, weight, eps, zero_centered)
    xr, hr = _rows(x), _rows(h)
    total = _empty(xr.shape, x.dtype, x.device)
    out = _empty(xr.shape, _norm_dtype(x, weight, zero_centered), x.device)
    _launch_rms_norm(xr, hr, weight, total, out, eps, zero_centered)
    return total.view(x.shape), out.view(x.shape)


def _launch_rms_norm(rows, residual, weight, total, out, eps, zero_centered) -> None:
    """One program per row; with `residual`, total = rows + residual is
    written too and normed (without, the kernel never touches those args)."""
    has_residual = residual is not None
    residual = residual if has_residual else rows
    total = total if has_residual else rows
    block, warps = _row_block(rows.shape[-1])
    _rms_norm_kernel[(rows.shape[0],)](
        rows, residual, weight, total, out, rows.shape[-1], rows.stride(0),
        residual.stride(0), total.stride(0), out.stride(0), eps, HAS_RESIDUAL=has_residual,
        ZERO_CENTERED=zero_centered, BLOCK=block, num_warps=warps,
        **release_first_launch(rows.device))


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
                   ) -> torch.Tensor:
    """reference.gated_rms_norm in one launch."""
    n = x.shape[-1]
    if n > MAX_ROW or x.numel() == 0 or x.shape != gate.shape:
        return reference.gated_rms_norm(x, gate, weight, eps)
    xr = x.reshape(-1, n).contiguous()
    # the gate may be a strided view ([T, heads, n] out of GDN's merged in_proj)
    gr = gate.reshape(-1, gate.shape[-2] if gate.dim() > 2 else 1, n)
    if gr.stride(-1) != 1:
        gr = gr.contiguous()
    out = _empty(xr.shape, x.dtype, x.device)
    block, warps = _row_block(n)
    _gated_rms_norm_kernel[(xr.shape[0],)](
        xr, gr, weight, out, n, gr.shape[1], gr.stride(0), gr.stride(1), eps,
        ROUND=torch.promote_types(weight.dtype, x.dtype) == x.dtype, BLOCK=block,
        num_warps=warps, **release_first_launch(x.device))
    return out.view(x.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """reference.silu_mul in one launch (same shapes and dtypes)."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.numel() == 0:
        return reference.silu_mul(gate, up)
    g, u = _rows(gate), _rows(up)  # views of gate_up's halves: row-strided, no copy
    n = g.shape[1]
    out = _empty(g.shape, g.dtype, g.device)
    block = 1024
    _silu_mul_kernel[(g.shape[0], triton.cdiv(n, block))](g, u, out, n, g.stride(0), u.stride(0),
                                                          BLOCK=block, num_warps=4,
                                                          **pdl_launch(g.device))
    return out.view(gate.shape)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
              rotary_dim: int, eps: float, zero_centered: bool, keep_normed: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """reference.norm_rope in one launch. x [T, heads, head_dim] may be a strided
    view (the query half of [query | gate]); the outputs are contiguous. The
    normed (pre-rotary) heads come back only with keep_normed."""
    tokens, heads, dim = x.shape
    if not _norm_rope_takes(x, weight, cos, sin, rotary_dim, zero_centered):
        rotated, normed = reference.norm_rope(x, weight, cos, sin, rotary_dim, eps, zero_centered)
        return rotated, normed if keep_normed else None
    out = _empty((tokens, heads, dim), x.dtype, x.device)
    normed = _empty(out.shape, x.dtype, x.device) if keep_normed else out
    _norm_rope_kernel[(tokens * heads,)](
        x, x if weight is None else weight, cos, sin, out, normed, heads, dim, rotary_dim,
        x.stride(0), x.stride(1), cos.stride(0), eps, HAS_NORM=weight is not None,
        ZERO_CENTERED=zero_centered, STORE_NORMED=keep_normed,
        **_norm_rope_blocks(dim, rotary_dim), **pdl_launch(x.device))
    return out, normed if keep_normed else None


def _norm_rope_takes(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor,
                     sin: torch.Tensor, rotary_dim: int, zero_centered: bool) -> bool:
    """Whether the kernel takes x [T, heads, head_dim] (else the reference runs)."""
    dim = x.shape[-1]
    uniform = cos.dtype == x.dtype and sin.dtype == x.dtype and (
        weight is None or _norm_dtype(x, weight, zero_centered) == x.dtype)
    return (x.stride(-1) == 1 and uniform and not rotary_dim % 2 and rotary_dim <= dim
            and dim <= MAX_ROW and x.numel() > 0 and cos.stride(-1) == 1
            and sin.stride() == cos.stride())


def _norm_rope_blocks(dim: int, rotary_dim: int) -> dict:
    return dict(HALF_BLOCK=max(triton.next_power_of_2(rotary_dim // 2), 16),
                REST_BLOCK=max(triton.next_power_of_2(dim - rotary_dim), 16),
                num_warps=1 if dim <= 256 else 2)


def norm_rope_pair(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None,
                   k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                   rotary_dim: int, eps: float, zero_centered: bool, keep_k_normed: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """norm_rope of q and of k (each with its own weight, both or neither)
    in one launch: (q rotated, k rotated, k normed or None). Shapes the
    kernel does not take go through norm_rope, each on its own."""
    if (q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1] or q.dtype != k.dtype
            or (q_weight is None) != (k_weight is None)
            or not _norm_rope_takes(q, q_weight, cos, sin, rotary_dim, zero_centered)
            or not _norm_rope_takes(k, k_weight, cos, sin, rotary_dim, zero_centered)):
        q_out, _ = norm_rope(q, q_weight, cos, sin, rotary_dim, eps, zero_centered)
        k_out, k_normed = norm_rope(k, k_weight, cos, sin, rotary_dim, eps, zero_centered,
                                    keep_normed=keep_k_normed)
        return q_out, k_out, k_normed
    tokens, q_heads, dim = q.shape
    k_heads = k.shape[1]
    q_out = _empty(q.shape, q.dtype, q.device)
    k_out = _empty(k.shape, k.dtype, k.device)
    k_normed = _empty(k.shape, k.dtype, k.device) if keep_k_normed else k_out
    has_norm = q_weight is not None
    _norm_rope_pair_kernel[(tokens * (q_heads + k_heads),)](
        q, q_weight if has_norm else q, k, k_weight if has_norm else k, cos, sin, q_out, k_out,
        k_normed, tokens * q_heads, q_heads, k_heads, dim, rotary_dim, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), cos.stride(0), eps, HAS_NORM=has_norm,
        ZERO_CENTERED=zero_centered, STORE_NORMED=keep_k_normed,
        **_norm_rope_blocks(dim, rotary_dim), **pdl_launch(q.device))
    return q_out, k_out, k_normed if keep_k_normed else None


def sigmoid_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """reference.sigmoid_gate in one launch. out [T, heads * head_dim]
    contiguous; gate [T, heads, head_dim] may be strided (unit stride last)."""
    tokens, heads, dim = gate.shape
    if (out.shape != (tokens, heads * dim) or out.dtype != gate.dtype or gate.stride(-1) != 1
            or out.numel() == 0 or dim > MAX_ROW):
        return reference.sigmoid_gate(out, gate.reshape(tokens, -1))
    o = out.contiguous()
    result = _empty(o.shape, o.dtype, o.device)
    block, warps = _row_block(dim)
    _sigmoid_gate_kernel[(tokens * heads,)](o, gate, result, heads, dim, gate.stride(0),
                                            gate.stride(1), BLOCK=block, num_warps=warps,
                                            **pdl_launch(o.device))
    return result
