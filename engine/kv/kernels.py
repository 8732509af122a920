"""Triton kernels for the quantized KV formats, and their launch wrappers.

Owns the device side of formats.py: quantize-and-scatter of new tokens into
their page slots, and gather-and-dequantize of a page table into a dense
[length, H, D] tensor, for int8 and rk4; unquantized pages get the scatter
only (`dense_write`, one dependent launch for K and V). The rk4 rotation is the caller's
(formats.py: a torch matmul, or hadamard_kernels.py's FWHT), except in
rk4_rotate_write_kv, which applies fwht.rotate_rows to K and V itself;
every other kernel sees the stored space only.

Each kernel mirrors the reference in formats.py operation for operation, so
codes and scales come out bit-identical:
  * divisions use div_rn (IEEE round-to-nearest; plain `/` may be approximate
    on GPU);
  * rounding is round-half-to-even built from floor, which is exact;
  * e8m0 scales and rk4p's e5m3 K steps are built from their bits, never
    from exp2/log2.

Work is split into rows: a (token, head) pair for int8, one block of `block`
channels of one (token, head) for rk4. Row r of token t is stored at row
slot(t) * rows_per_token + r % rows_per_token of the layer's flat buffer.

Importing this module imports triton; under TRITON_INTERPRET=1 the kernels run
on CPU tensors (the tests use this).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kv import formats
from engine.kv.fwht import rotate_rows
from engine.kv.rotation import hadamard_scale
from engine.pdl import pdl_launch, pdl_prologue

# rk4p's e5m3 K step (formats.k_step_encode), as constants kernels may read.
_K_STEP_BIAS = tl.constexpr(formats.K_STEP_BIAS)
_K_STEP_MANTISSA_BITS = tl.constexpr(formats.K_STEP_MANTISSA_BITS)
_K_STEP_MANTISSA_MASK = tl.constexpr(formats._K_STEP_MANTISSA_MASK)
_K_STEP_SHIFT = tl.constexpr(formats._K_STEP_SHIFT)
_K_STEP_DROPPED = tl.constexpr(formats._K_STEP_DROPPED)
_K_STEP_EXPONENT_MAX = tl.constexpr(formats.K_STEP_EXPONENT_MAX)

# Elements per program: enough work per program for the GPU, and few enough
# programs that the CPU interpreter stays fast.
_TILE_ELEMENTS = 4096


# ------------------------------------------------------------ shared helpers


@triton.jit
def _round_half_even(x):
    # floor, x - floor(x) and f * 0.5 are exact in fp32, so this matches
    # torch.round bit for bit (libdevice rint is not available to the
    # interpreter).
    f = tl.floor(x)
    frac = x - f
    half_f = f * 0.5
    f_is_odd = (half_f - tl.floor(half_f)) != 0.0
    round_up = (frac > 0.5) | ((frac == 0.5) & f_is_odd)
    return tl.where(round_up, f + 1.0, f)


@triton.jit
def _quantize_symmetric(x, scale, QMAX: tl.constexpr):
    """round(clamp(x / scale, +-QMAX)); scale broadcast to x; zero scale -> 1."""
    safe = tl.where(scale == 0.0, 1.0, scale)
    v = tl.math.div_rn(x, tl.broadcast_to(safe, x.shape))
    v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
    return _round_half_even(v)


@triton.jit
def _fp16_scale(amax, QMAX: tl.constexpr):
    """amax / QMAX rounded to fp16, as its fp32 value (formats.fp16_scale)."""
    s = tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))
    s = tl.minimum(s, 65504.0)
    return s.to(tl.float16).to(tl.float32)


@triton.jit
def _e8m0_scale(biased_exp):
    """2**(E - 127) from its bits (formats.e8m0_to_scale)."""
    return (biased_exp.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_ceil_exponent(amax):
    """Biased exponent of the least power of two s with amax <= 7 s."""
    bits = amax.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    mantissa = bits & 0x7FFFFF
    e = exponent - 2 + (mantissa > 0x600000).to(tl.int32)
    return tl.minimum(tl.maximum(e + 127, 1), 254)


@triton.jit
def _e8m0_block_error(x_even, x_odd, biased_exp):
    """Squared error of each row's block at exponent E (exact terms, fp64 sum)."""
    scale = _e8m0_scale(biased_exp)[:, None]
    d_even = x_even - _quantize_symmetric(x_even, scale, 7.0) * scale
    d_odd = x_odd - _quantize_symmetric(x_odd, scale, 7.0) * scale
    d_even = d_even.to(tl.float64)
    d_odd = d_odd.to(tl.float64)
    return tl.sum(d_even * d_even, axis=1) + tl.sum(d_odd * d_odd, axis=1)


@triton.jit
def _e8m0_search_exponent(x_even, x_odd, amax):
    """Among e, e-1, e+1 the exponent of least error; ties keep the earlier."""
    ceil_exp = _e8m0_ceil_exponent(amax)
    best = ceil_exp
    best_err = _e8m0_block_error(x_even, x_odd, ceil_exp)
    lower = tl.maximum(ceil_exp - 1, 1)
    err = _e8m0_block_error(x_even, x_odd, lower)
    take = err < best_err
    best = tl.where(take, lower, best)
    best_err = tl.where(take, err, best_err)
    upper = tl.minimum(ceil_exp + 1, 254)
    err = _e8m0_block_error(x_even, x_odd, upper)
    best = tl.where(err < best_err, upper, best)
    return best


def as_kernel_dense(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A dense tensor as _load_dense/_store_dense take it: bf16 goes as its
    int16 bits (the flag says so), anything else as it is."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16), True
    return t, False


@triton.jit
def _load_dense(ptr, offsets, mask, BF16_BITS: tl.constexpr):
    """fp32 values of a dense tensor; bf16 arrives as int16 bits and is widened
    exactly (the interpreter cannot load bf16 itself)."""
    if BF16_BITS:
        bits = tl.load(ptr + offsets, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _bf16_bits(values):
    """fp32 values' bf16 bits (in the low half of a uint32), rounded to
    nearest even: the interpreter's own fp32->bf16 cast truncates, so it
    would not match torch's rounding."""
    bits = values.to(tl.uint32, bitcast=True)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


@triton.jit
def _store_dense(ptr, offsets, values, mask, BF16_BITS: tl.constexpr):
    """Store fp32 values in the output's dtype: bf16 rounded to nearest even
    (_bf16_bits) and stored as int16."""
    if BF16_BITS:
        bits = _bf16_bits(values)
        tl.store(ptr + offsets, bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(ptr + offsets, values.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _page_slot(page_table_ptr, token, PAGE_SIZE: tl.constexpr, mask):
    page = tl.load(page_table_ptr + token // PAGE_SIZE, mask=mask, other=0).to(tl.int64)
    return page * PAGE_SIZE + token % PAGE_SIZE


# --------------------------------------------------------------------- dense


@triton.jit(do_not_specialize=("n_rows", "k_token_stride", "v_token_stride"))
def _dense_write_kernel(k_ptr, v_ptr, slots_ptr, k_out_ptr, v_out_ptr, n_rows,
                        k_token_stride, v_token_stride,
                        H: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                        ROWS: tl.constexpr, PDL: tl.constexpr):
    """Unquantized K and V rows to their slots in one launch (grid axis 1: 0
    for K, 1 for V), as bits: a decode step's torch scatter was two launches
    a layer that no dependent launch could overlap (~2.5 us each in the 27B's
    bf16 step, H100 profile, 2026-12-06)."""
    pdl_prologue(PDL)
    if tl.program_id(1) == 0:
        _dense_write_rows(k_ptr, k_token_stride, slots_ptr, k_out_ptr, n_rows, H, D, D_PAD, ROWS)
    else:
        _dense_write_rows(v_ptr, v_token_stride, slots_ptr, v_out_ptr, n_rows, H, D, D_PAD, ROWS)


@triton.jit
def _dense_write_rows(x_ptr, token_stride, slots_ptr, out_ptr, n_rows, H: tl.constexpr,
                      D: tl.constexpr, D_PAD: tl.constexpr, ROWS: tl.constexpr):
    """Rows (token, head) of x [T, H, D] (heads contiguous, tokens
    token_stride apart: K and V are views of one projection) to their slots."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    cols = tl.arange(0, D_PAD)
    mask = row_ok[:, None] & (cols < D)[None, :]
    src = (rows // H) * token_stride + (rows % H) * D
    x = tl.load(x_ptr + src[:, None] + cols[None, :], mask=mask)
    slot = tl.load(slots_ptr + rows // H, mask=row_ok, other=0)
    dst = slot * H + rows % H
    tl.store(out_ptr + dst[:, None] * D + cols[None, :], x, mask=mask)


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor as the integers of its element size (the interpreter cannot
    load bf16; a copy needs no more)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def dense_write(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                buffers: dict[str, torch.Tensor]) -> None:
    """Scatter k, v [T, H, D] (already in the buffers' dtype) into buffers'
    k and v [P, S, H, D] at slots, in one launch."""
    tokens, heads, head_dim = k.shape
    n_rows = tokens * heads
    if n_rows == 0:
        return
    k, v = _token_rows(k), _token_rows(v)
    d_pad = triton.next_power_of_2(head_dim)
    rows = _rows_per_program(d_pad)
    _dense_write_kernel[(triton.cdiv(n_rows, rows), 2)](
        _as_bits(k), _as_bits(v), slots.to(torch.int64).contiguous(),
        _as_bits(buffers["k"]), _as_bits(buffers["v"]), n_rows, k.stride(0), v.stride(0),
        H=heads, D=head_dim, D_PAD=d_pad, ROWS=rows, **pdl_launch(k.device))


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with each token's heads contiguous (a view of a wider
    projection row keeps its token stride; anything else is copied)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


# ---------------------------------------------------------------------- int8


@triton.jit(do_not_specialize=("n_rows",))
def _int8_write_kernel(k_ptr, v_ptr, slots_ptr, k_codes_ptr, k_scales_ptr, v_codes_ptr,
                       v_scales_ptr, n_rows, H: tl.constexpr, D: tl.constexpr,
                       D_PAD: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    """K and V in one launch (grid axis 1: 0 for K, 1 for V): a decode step
    writes one token a layer, so a second launch was all latency (~6 µs of
    the H200's 27B step per layer, 2026-12-03 profile)."""
    pdl_prologue(PDL)
    if tl.program_id(1) == 0:
        _int8_write_rows(k_ptr, slots_ptr, k_codes_ptr, k_scales_ptr, n_rows, H, D, D_PAD, ROWS)
    else:
        _int8_write_rows(v_ptr, slots_ptr, v_codes_ptr, v_scales_ptr, n_rows, H, D, D_PAD, ROWS)


@triton.jit
def _int8_write_rows(x_ptr, slots_ptr, codes_ptr, scales_ptr, n_rows, H: tl.constexpr,
                     D: tl.constexpr, D_PAD: tl.constexpr, ROWS: tl.constexpr):
    """This program's ROWS (token, head) rows of x, quantized to their slots."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    cols = tl.arange(0, D_PAD)
    mask = row_ok[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)

    scale = _fp16_scale(tl.max(tl.abs(x), axis=1), 127.0)
    codes = _quantize_symmetric(x, scale[:, None], 127.0)

    slot = tl.load(slots_ptr + rows // H, mask=row_ok, other=0)
    dst = slot * H + rows % H
    tl.store(codes_ptr + dst[:, None] * D + cols[None, :], codes.to(tl.int8), mask=mask)
    tl.store(scales_ptr + dst, scale.to(tl.float16), mask=row_ok)


@triton.jit(do_not_specialize=("n_rows",))
def _int8_read_kernel(codes_ptr, scales_ptr, page_table_ptr, out_ptr, n_rows,
                      H: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                      PAGE_SIZE: tl.constexpr, ROWS: tl.constexpr, BF16_BITS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    cols = tl.arange(0, D_PAD)
    mask = row_ok[:, None] & (cols < D)[None, :]

    src = _page_slot(page_table_ptr, rows // H, PAGE_SIZE, row_ok) * H + rows % H
    codes = tl.load(codes_ptr + src[:, None] * D + cols[None, :], mask=mask, other=0)
    scale = tl.load(scales_ptr + src, mask=row_ok, other=0.0).to(tl.float32)
    values = codes.to(tl.float32) * scale[:, None]
    _store_dense(out_ptr, rows[:, None] * D + cols[None, :], values, mask, BF16_BITS)


def _rows_per_program(row_elements: int) -> int:
    return max(1, _TILE_ELEMENTS // row_elements)


def _dense_out(out: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The output as the kernel sees it: bf16 goes as raw int16 bits."""
    if not out.is_contiguous():
        raise ValueError("the dense output must be contiguous")
    if out.dtype == torch.bfloat16:
        return out.view(torch.int16), True
    return out, False


def _check_page_table(page_table: torch.Tensor, length: int, page_size: int) -> None:
    needed = -(-length // page_size)
    if needed > page_table.numel():
        raise ValueError(f"length {length} needs {needed} pages of {page_size}, "
                         f"page table has {page_table.numel()}")


def int8_write(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               buffers: dict[str, torch.Tensor]) -> None:
    """Quantize k, v [T, H, D] and scatter them into buffers' {k,v}_codes
    [P, S, H, D] and {k,v}_scales [P, S, H], in one launch."""
    tokens, heads, head_dim = k.shape
    n_rows = tokens * heads
    if n_rows == 0:
        return
    d_pad = triton.next_power_of_2(head_dim)
    rows = _rows_per_program(d_pad)
    _int8_write_kernel[(triton.cdiv(n_rows, rows), 2)](
        k.contiguous(), v.contiguous(), slots.to(torch.int64).contiguous(),
        buffers["k_codes"], buffers["k_scales"], buffers["v_codes"], buffers["v_scales"], n_rows,
        H=heads, D=head_dim, D_PAD=d_pad, ROWS=rows, **pdl_launch(k.device))


def int8_read(codes: torch.Tensor, scales: torch.Tensor, page_table: torch.Tensor,
              length: int, out: torch.Tensor) -> torch.Tensor:
    """Gather the first `length` tokens of a page table into out [length, H, D]."""
    _, page_size, heads, head_dim = codes.shape
    _check_page_table(page_table, length, page_size)
    n_rows = length * heads
    if n_rows == 0:
        return out
    d_pad = triton.next_power_of_2(head_dim)
    rows = _rows_per_program(d_pad)
    out_arg, bf16_bits = _dense_out(out)
    _int8_read_kernel[(triton.cdiv(n_rows, rows),)](
        codes, scales, page_table.to(torch.int64).contiguous(), out_arg, n_rows,
        H=heads, D=head_dim, D_PAD=d_pad, PAGE_SIZE=page_size, ROWS=rows, BF16_BITS=bf16_bits)
    return out


# ----------------------------------------------------------------------- rk4


@triton.jit(do_not_specialize=("n_rows", "slot_limit"))
def _rk4_write_kernel(k_ptr, v_ptr, slots_ptr, k_codes_ptr, k_scales_ptr, v_codes_ptr,
                      v_scales_ptr, n_rows, slot_limit,
                      ROWS_PER_TOKEN: tl.constexpr, HALF: tl.constexpr,
                      E8M0: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    """K and V in one launch (grid axis 1: 0 for K, 1 for V; rk4p's V-only
    write launches axis 0 alone): a decode step writes one token a layer, so
    a second launch was all latency."""
    pdl_prologue(PDL)
    if tl.program_id(1) == 0:
        _rk4_write_rows(k_ptr, slots_ptr, k_codes_ptr, k_scales_ptr, n_rows, slot_limit,
                        ROWS_PER_TOKEN, HALF, E8M0, ROWS)
    else:
        _rk4_write_rows(v_ptr, slots_ptr, v_codes_ptr, v_scales_ptr, n_rows, slot_limit,
                        ROWS_PER_TOKEN, HALF, E8M0, ROWS)


@triton.jit
def _rk4_write_rows(x_ptr, slots_ptr, codes_ptr, scales_ptr, n_rows, slot_limit,
                    ROWS_PER_TOKEN: tl.constexpr, HALF: tl.constexpr, E8M0: tl.constexpr,
                    ROWS: tl.constexpr):
    # A row is one block of 2 * HALF channels, loaded contiguously.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok, slot = _rk4_row_slots(rows, n_rows, slots_ptr, slot_limit, ROWS_PER_TOKEN)
    channels = tl.arange(0, 2 * HALF)
    x = tl.load(x_ptr + rows[:, None] * (2 * HALF) + channels[None, :],
                mask=row_ok[:, None], other=0.0).to(tl.float32)
    _rk4_quantize_rows(x, rows, row_ok, slot, codes_ptr, scales_ptr, ROWS_PER_TOKEN, HALF, E8M0,
                       ROWS)


@triton.jit
def _rk4_row_slots(rows, n_rows, slots_ptr, slot_limit, ROWS_PER_TOKEN: tl.constexpr):
    """(rows to store, their token's slot): rows past n_rows or whose slot is
    >= slot_limit (rk4p: tokens of staging pages) are skipped."""
    row_ok = rows < n_rows
    slot = tl.load(slots_ptr + rows // ROWS_PER_TOKEN, mask=row_ok, other=0)
    return row_ok & (slot < slot_limit), slot


@triton.jit
def _rk4_quantize_rows(x, rows, row_ok, slot, codes_ptr, scales_ptr,
                       ROWS_PER_TOKEN: tl.constexpr, HALF: tl.constexpr, E8M0: tl.constexpr,
                       ROWS: tl.constexpr):
    """Blocks x [ROWS, 2 * HALF] (fp32, stored space) quantized and stored:
    even and odd channels go to the low and high nibbles of the same byte."""
    x_even, x_odd = tl.split(tl.reshape(x, (ROWS, HALF, 2)))
    pairs = tl.arange(0, HALF)
    mask = row_ok[:, None] & (pairs < HALF)[None, :]
    amax = tl.maximum(tl.max(tl.abs(x_even), axis=1), tl.max(tl.abs(x_odd), axis=1))

    if E8M0:
        biased_exp = _e8m0_search_exponent(x_even, x_odd, amax)
        scale = _e8m0_scale(biased_exp)
        stored_scale = biased_exp.to(tl.uint8)
    else:
        scale = _fp16_scale(amax, 7.0)
        stored_scale = scale.to(tl.float16)
    low = _quantize_symmetric(x_even, scale[:, None], 7.0).to(tl.int32) + 8
    high = _quantize_symmetric(x_odd, scale[:, None], 7.0).to(tl.int32) + 8
    packed = (low | (high << 4)).to(tl.uint8)

    dst = slot * ROWS_PER_TOKEN + rows % ROWS_PER_TOKEN
    tl.store(codes_ptr + dst[:, None] * HALF + pairs[None, :], packed, mask=mask)
    tl.store(scales_ptr + dst, stored_scale, mask=row_ok)


@triton.jit(do_not_specialize=("n_head_rows",))
def _rk4_rotate_write_kernel(k_ptr, v_ptr, k_token_stride, v_token_stride, signs_ptr, slots_ptr,
                             k_codes_ptr, k_scales_ptr, v_codes_ptr, v_scales_ptr, n_head_rows,
                             slot_limit, H: tl.constexpr, D: tl.constexpr,
                             LOG2_D: tl.constexpr, SCALE: tl.constexpr,
                             HEAD_ROWS: tl.constexpr, ROWS_PER_TOKEN: tl.constexpr,
                             HALF: tl.constexpr, E8M0: tl.constexpr, X_BF16: tl.constexpr,
                             PDL: tl.constexpr):
    """rk4_write_kv with the rotation folded in: K (grid axis 1 = 0) or V
    (= 1). A decode step rotated K and V in two launches of their own
    before this one."""
    pdl_prologue(PDL)
    if tl.program_id(1) == 0:
        _rk4_rotate_write_rows(k_ptr, k_token_stride, signs_ptr, slots_ptr, k_codes_ptr,
                               k_scales_ptr, n_head_rows, slot_limit, H, D, LOG2_D, SCALE,
                               HEAD_ROWS, ROWS_PER_TOKEN, HALF, E8M0, X_BF16)
    else:
        _rk4_rotate_write_rows(v_ptr, v_token_stride, signs_ptr, slots_ptr, v_codes_ptr,
                               v_scales_ptr, n_head_rows, slot_limit, H, D, LOG2_D, SCALE,
                               HEAD_ROWS, ROWS_PER_TOKEN, HALF, E8M0, X_BF16)


@triton.jit
def _rk4_rotate_write_rows(x_ptr, token_stride, signs_ptr, slots_ptr, codes_ptr, scales_ptr,
                           n_head_rows, slot_limit, H: tl.constexpr, D: tl.constexpr,
                           LOG2_D: tl.constexpr, SCALE: tl.constexpr, HEAD_ROWS: tl.constexpr,
                           ROWS_PER_TOKEN: tl.constexpr, HALF: tl.constexpr,
                           E8M0: tl.constexpr, X_BF16: tl.constexpr):
    """HEAD_ROWS (token, head) rows of x as the model made them, rotated in
    registers (fwht.rotate_rows: bitwise hadamard_kernels' rotation to
    fp32), then quantized block by block as _rk4_write_rows does."""
    head_rows = tl.program_id(0).to(tl.int64) * HEAD_ROWS + tl.arange(0, HEAD_ROWS)
    cols = tl.arange(0, D)
    mask = (head_rows < n_head_rows)[:, None] & (cols < D)[None, :]
    offsets = ((head_rows // H) * token_stride + (head_rows % H) * D)[:, None] + cols[None, :]
    x = rotate_rows(_load_dense(x_ptr, offsets, mask, X_BF16), tl.load(signs_ptr + cols)[None, :],
                    HEAD_ROWS, D, LOG2_D, SCALE, False)
    BLOCKS: tl.constexpr = HEAD_ROWS * D // (2 * HALF)
    rows = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    row_ok, slot = _rk4_row_slots(rows, n_head_rows * (D // (2 * HALF)), slots_ptr, slot_limit,
                                  ROWS_PER_TOKEN)
    _rk4_quantize_rows(tl.reshape(x, (BLOCKS, 2 * HALF)), rows, row_ok, slot, codes_ptr,
                       scales_ptr, ROWS_PER_TOKEN, HALF, E8M0, BLOCKS)


@triton.jit(do_not_specialize=("n_rows",))
def _rk4_read_kernel(codes_ptr, scales_ptr, page_table_ptr, out_ptr, n_rows,
                     ROWS_PER_TOKEN: tl.constexpr, HALF: tl.constexpr,
                     PAGE_SIZE: tl.constexpr, E8M0: tl.constexpr, ROWS: tl.constexpr,
                     BF16_BITS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    pairs = tl.arange(0, HALF)
    mask = row_ok[:, None] & (pairs < HALF)[None, :]

    token = rows // ROWS_PER_TOKEN
    src = _page_slot(page_table_ptr, token, PAGE_SIZE, row_ok) * ROWS_PER_TOKEN \
        + rows % ROWS_PER_TOKEN
    packed = tl.load(codes_ptr + src[:, None] * HALF + pairs[None, :], mask=mask,
                     other=0).to(tl.int32)
    if E8M0:
        scale = _e8m0_scale(tl.load(scales_ptr + src, mask=row_ok, other=127))
    else:
        scale = tl.load(scales_ptr + src, mask=row_ok, other=0.0).to(tl.float32)
    low = ((packed & 0xF) - 8).to(tl.float32) * scale[:, None]
    high = ((packed >> 4) - 8).to(tl.float32) * scale[:, None]

    # Interleave in registers so the store is contiguous (two strided stores
    # ran an order of magnitude slower on an H200).
    values = tl.reshape(tl.join(low, high), (ROWS, 2 * HALF))
    channels = tl.arange(0, 2 * HALF)
    _store_dense(out_ptr, rows[:, None] * (2 * HALF) + channels[None, :], values,
                 row_ok[:, None] & (channels < 2 * HALF)[None, :], BF16_BITS)


def rk4_write(x: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
              block: int, scale_format: str, slot_limit: int | None = None) -> None:
    """Quantize x [T, H, D] (stored space, fp32) into codes [P, S, H, D/2] and
    scales [P, S, H, D/block] at the given slots (those below slot_limit)."""
    _launch_rk4_write([(x, codes, scales)], slots, block, scale_format, slot_limit)


def rk4_write_kv(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                 buffers: dict[str, torch.Tensor], block: int, scale_format: str) -> None:
    """rk4_write of k and v (stored space, fp32) into buffers' {k,v}_codes and
    {k,v}_scales, in one launch."""
    _launch_rk4_write([(k, buffers["k_codes"], buffers["k_scales"]),
                       (v, buffers["v_codes"], buffers["v_scales"])],
                      slots, block, scale_format, None)


def rk4_rotate_write_kv(k: torch.Tensor, v: torch.Tensor, signs: torch.Tensor,
                        slots: torch.Tensor, buffers: dict[str, torch.Tensor], block: int,
                        scale_format: str) -> None:
    """rk4_write_kv of k @ R and v @ R (R = H diag(signs) / sqrt(D), D a power
    of two) from k, v [T, H, D] as they are (bf16, fp16 or fp32), rotating in
    the same launch: what rk4_write_kv(hadamard_rotate_rows(k, signs, False),
    hadamard_rotate_rows(v, ...), ...) stores, bit for bit."""
    tokens, heads, head_dim = k.shape
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"rk4_rotate_write_kv: k {tuple(k.shape)} {k.dtype} and v "
                         f"{tuple(v.shape)} {v.dtype} must agree")
    n_head_rows = tokens * heads
    if n_head_rows == 0:
        return
    # a token's heads packed (v may be a view into the fused projection)
    k, v = (x if x.stride(-1) == 1 and x.stride(1) == head_dim else x.contiguous()
            for x in (k, v))
    head_rows = _rows_per_program(head_dim)
    (k_arg, bf16), (v_arg, _) = as_kernel_dense(k), as_kernel_dense(v)
    codes = buffers["k_codes"]
    _rk4_rotate_write_kernel[(triton.cdiv(n_head_rows, head_rows), 2)](
        k_arg, v_arg, k.stride(0), v.stride(0), signs.contiguous(),
        slots.to(torch.int64).contiguous(), codes, buffers["k_scales"], buffers["v_codes"],
        buffers["v_scales"], n_head_rows, codes.shape[0] * codes.shape[1], H=heads, D=head_dim,
        LOG2_D=head_dim.bit_length() - 1, SCALE=hadamard_scale(head_dim), HEAD_ROWS=head_rows,
        ROWS_PER_TOKEN=heads * (head_dim // block), HALF=block // 2,
        E8M0=scale_format == "e8m0", X_BF16=bf16, **pdl_launch(k.device))


def _launch_rk4_write(sides: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                      slots: torch.Tensor, block: int, scale_format: str,
                      slot_limit: int | None) -> None:
    """One launch over one or two (x, codes, scales) sides of one shape."""
    x, codes, _ = sides[0]
    if slot_limit is None:
        slot_limit = codes.shape[0] * codes.shape[1]
    tokens, heads, head_dim = x.shape
    rows_per_token = heads * (head_dim // block)
    n_rows = tokens * rows_per_token
    if n_rows == 0:
        return
    rows = _rows_per_program(block)
    xs = [side[0].to(torch.float32).contiguous() for side in sides]
    last = sides[-1]  # with one side, axis 1 has one program and never reads the second
    _rk4_write_kernel[(triton.cdiv(n_rows, rows), len(sides))](
        xs[0], xs[-1], slots.to(torch.int64).contiguous(), sides[0][1], sides[0][2],
        last[1], last[2], n_rows, slot_limit, ROWS_PER_TOKEN=rows_per_token,
        HALF=block // 2, E8M0=scale_format == "e8m0", ROWS=rows, **pdl_launch(x.device))


def rk4_read(codes: torch.Tensor, scales: torch.Tensor, page_table: torch.Tensor, length: int,
             out: torch.Tensor, block: int, scale_format: str) -> torch.Tensor:
    """Gather and dequantize the first `length` tokens into out [length, H, D]
    (stored space; out's dtype is the output dtype)."""
    _, page_size, heads, half_dim = codes.shape
    _check_page_table(page_table, length, page_size)
    rows_per_token = heads * (2 * half_dim // block)
    n_rows = length * rows_per_token
    if n_rows == 0:
        return out
    rows = _rows_per_program(block)
    out_arg, bf16_bits = _dense_out(out)
    _rk4_read_kernel[(triton.cdiv(n_rows, rows),)](
        codes, scales, page_table.to(torch.int64).contiguous(), out_arg, n_rows,
        ROWS_PER_TOKEN=rows_per_token, HALF=block // 2, PAGE_SIZE=page_size,
        E8M0=scale_format == "e8m0", ROWS=rows, BF16_BITS=bf16_bits)
    return out


# ---------------------------------------------------------------------- rk4p


@triton.jit(do_not_specialize=("n_rows", "first_staged_slot"))
def _staging_write_kernel(x_ptr, slots_ptr, open_ptr, n_rows, first_staged_slot,
                          H: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                          ROWS: tl.constexpr, PDL: tl.constexpr):
    """Rows (token, head) whose slot is a staging slot go to the bf16 pool,
    rounded to nearest even like torch's cast."""
    pdl_prologue(PDL)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    slot = tl.load(slots_ptr + rows // H, mask=row_ok, other=0)
    row_ok = row_ok & (slot >= first_staged_slot)
    cols = tl.arange(0, D_PAD)
    mask = row_ok[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dst = (slot - first_staged_slot) * H + rows % H
    _store_dense(open_ptr, dst[:, None] * D + cols[None, :], x, mask, True)


@triton.jit(do_not_specialize=("n_tokens", "first_staged_slot"))
def _k_page_kernel(x_ptr, slots_ptr, codes_ptr, min_ptr, step_ptr, n_tokens, first_staged_slot,
                   H: tl.constexpr, D: tl.constexpr, HALF_PAD: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, PDL: tl.constexpr):
    """Program (token t, head h): if tokens t..t+P-1 fill one real page in
    order, quantize that page's K of head h per channel (formats.k_page_quantize)."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    first = tl.load(slots_ptr + t)
    last_t = tl.minimum(t + PAGE_SIZE - 1, n_tokens - 1)
    last = tl.load(slots_ptr + last_t)
    starts_page = (first % PAGE_SIZE == 0) & (first < first_staged_slot) \
        & (t + PAGE_SIZE <= n_tokens) & (last == first + PAGE_SIZE - 1)
    tokens = tl.arange(0, PAGE_SIZE)
    pairs = tl.arange(0, HALF_PAD)
    pair_ok = pairs < D // 2
    mask = starts_page & pair_ok[None, :] & (tokens < PAGE_SIZE)[:, None]
    row = ((t + tokens) * H + h).to(tl.int64)
    x_even = tl.load(x_ptr + row[:, None] * D + 2 * pairs[None, :], mask=mask, other=0.0)
    x_odd = tl.load(x_ptr + row[:, None] * D + 2 * pairs[None, :] + 1, mask=mask, other=0.0)
    x_even = x_even.to(tl.float32)
    x_odd = x_odd.to(tl.float32)
    lo_even = _fp16_min(tl.min(x_even, axis=0))
    lo_odd = _fp16_min(tl.min(x_odd, axis=0))
    step_even = _k_step_encode(tl.max(x_even, axis=0) - lo_even)
    step_odd = _k_step_encode(tl.max(x_odd, axis=0) - lo_odd)
    low = _k_codes(x_even, lo_even, step_even)
    high = _k_codes(x_odd, lo_odd, step_odd)
    packed = (low | (high << 4)).to(tl.uint8)
    dst = (first + tokens).to(tl.int64) * H + h
    tl.store(codes_ptr + dst[:, None] * (D // 2) + pairs[None, :], packed, mask=mask)
    page_row = ((first // PAGE_SIZE) * H + h) * D
    chan_ok = starts_page & pair_ok
    tl.store(min_ptr + page_row + 2 * pairs, lo_even.to(tl.float16), mask=chan_ok)
    tl.store(min_ptr + page_row + 2 * pairs + 1, lo_odd.to(tl.float16), mask=chan_ok)
    tl.store(step_ptr + page_row + 2 * pairs, step_even.to(tl.uint8), mask=chan_ok)
    tl.store(step_ptr + page_row + 2 * pairs + 1, step_odd.to(tl.uint8), mask=chan_ok)


@triton.jit
def _fp16_min(x):
    """The channel minimum as stored: clamped to fp16's range, rounded to fp16."""
    return tl.minimum(tl.maximum(x, -65504.0), 65504.0).to(tl.float16).to(tl.float32)


@triton.jit
def _k_step_encode(span):
    """uint8-range int32 code of the least e5m3 step s with span <= 15 s
    (formats.k_step_encode, on the same bits)."""
    quotient = tl.math.div_rn(tl.maximum(span, 0.0), tl.full(span.shape, 15.0, tl.float32))
    bits = quotient.to(tl.int32, bitcast=True)
    up = ((bits + _K_STEP_DROPPED) >> _K_STEP_SHIFT) << _K_STEP_SHIFT
    exponent = (up >> 23) - 127 + _K_STEP_BIAS
    code = (exponent << _K_STEP_MANTISSA_BITS) + ((up >> _K_STEP_SHIFT) & _K_STEP_MANTISSA_MASK)
    code = tl.where(exponent < 0, 0, code)
    return tl.where(exponent > _K_STEP_EXPONENT_MAX, 255, code)


@triton.jit
def _k_step_decode(code):
    """fp32 value of e5m3 step codes, from bits (formats.k_step_decode)."""
    c = code.to(tl.int32)
    bits = (((c >> _K_STEP_MANTISSA_BITS) - _K_STEP_BIAS + 127) << 23) \
        | ((c & _K_STEP_MANTISSA_MASK) << _K_STEP_SHIFT)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _k_codes(x, lo, step_code):
    """round((x - lo) / step) in 0..15 as int32; x - lo and the division each
    round once, as in the reference (div_rn: IEEE on the GPU too)."""
    step = _k_step_decode(step_code)
    v = tl.math.div_rn(x - lo[None, :], tl.broadcast_to(step[None, :], x.shape))
    v = tl.minimum(tl.maximum(v, 0.0), 15.0)
    return _round_half_even(v).to(tl.int32)


def paged_rk4_write(k: torch.Tensor, v_rot: torch.Tensor, slots: torch.Tensor,
                    buffers: dict[str, torch.Tensor], v_block: int) -> None:
    """rk4p write: k (before RoPE) and v_rot (rotated V) [T, H, D] to slots.
    Staging slots (>= num_pages * page_size) take bf16 copies; real pages that
    tokens t..t+P-1 fill in order are quantized whole (K per channel, V per
    token). Real-page tokens outside such a run are not written: the caller
    (OpenPages) stages every page it cannot write whole; the reference path
    raises on them."""
    tokens, heads, head_dim = k.shape
    if tokens == 0:
        return
    num_pages, page_size = buffers["k_codes"].shape[:2]
    first_staged = num_pages * page_size
    slots = slots.to(torch.int64).contiguous()
    k32 = k.to(torch.float32).contiguous()
    v32 = v_rot.to(torch.float32).contiguous()
    d_pad = triton.next_power_of_2(head_dim)
    rows = _rows_per_program(d_pad)
    n_rows = tokens * heads
    for x, side in ((k32, "k"), (v32, "v")):
        _staging_write_kernel[(triton.cdiv(n_rows, rows),)](
            x, slots, buffers[f"{side}_open"].view(torch.int16), n_rows, first_staged,
            H=heads, D=head_dim, D_PAD=d_pad, ROWS=rows, **pdl_launch(x.device))
    if tokens < page_size:
        # no run of tokens fills a page, so every slot is a staging one (the
        # contract above): a decode or verify step skips two launches that
        # would store nothing (0.6 ms of the 27B's 4K step on the H200)
        return
    _k_page_kernel[(tokens, heads)](
        k32, slots, buffers["k_codes"], buffers["k_min"], buffers["k_step"], tokens,
        first_staged, H=heads, D=head_dim, HALF_PAD=triton.next_power_of_2(head_dim // 2),
        PAGE_SIZE=page_size, **pdl_launch(k.device))
    rk4_write(v32, slots, buffers["v_codes"], buffers["v_scales"], v_block, "fp16",
              slot_limit=first_staged)
