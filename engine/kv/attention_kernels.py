"""Triton paged attention that reads bf16, int8 and rk4 pages in place.

One kernel serves prefill and decode. A program owns ROWS consecutive
(query token, query head) rows of one sequence that share one KV head (so
each K/V tile is dequantized once for the whole GQA group), and one split of
the keys. Keys are walked BLOCK_N tokens at a time through the page table,
dequantized in registers (`_load_kv`, one small function per format so a
layout change stays local) and folded into an online softmax.

Decode (one new token per sequence) has too few rows to fill the GPU, so the
keys are split NUM_SPLITS ways (flash-decoding): each split writes a
normalised partial output and its log-sum-exp, and `_combine_splits_kernel`
merges them. With NUM_SPLITS == 1 (prefill) the program writes the output.

rk4 pages hold K and V in the rotated space (x @ R); the query is rotated
and the output un-rotated (q.k == (q R).(k R), and attention over rotated V
is out @ R), by the caller or, where the caller asks (ROTATE_Q,
rotate_back_signs), by this kernel's q load and the split combine with
fwht.rotate_rows; the key loop sees the stored space only. A byte
holds a channel pair, so rk4's program (`_rk4_pairs_program`, every rk4
launch where the head has 32 channels or more; TANDEM_RK4_PAIRS=0 gives the
channel-order tiles of `_load_kv` back) keeps even and odd channels apart
as rk4p's below: q, K, V and the output as pairs of [.., D / 2] tiles,
scores q_even . k_even + q_odd . k_odd, each nibble a tile.

No code becomes fp32 through an int-to-float conversion on those paths:
I2F runs at 1/8 of FADD's rate on sm_90, and the decode tiles converted
every K and V element. The float with bits 0x4B0000bb is 2**23 + b, so a
byte placed under that exponent (one PRMT, `_nibble_values`,
`_int8_values`) and one FADD give the code exactly; int8's codes take the
same way (TANDEM_INT8_NO_I2F=0: I2F), with the same bits out, where they
are dequantized at all: by default int8's codes enter the dots as they are
and each key's scales multiply its scores and probabilities instead
(`_attend_int8_codes`, TANDEM_INT8_CODES_DOT=0 for the dequantized tiles).

rk4p pages hold K before RoPE (per-channel codes per page) and rotated V;
page ids >= num_pages name bf16 staging pages (open pages). A K or V byte
holds a channel pair (2p, 2p + 1), so the rk4p program (`_rk4p_program`)
keeps even and odd channels apart: q, K, V and the output are pairs of
[.., D / 2] tiles, the bytes load contiguously and each nibble is a tile
(`_load_rk4p_pairs`). When BLOCK_N divides the page size a key tile lies on
one page: its page id, whether it is staged (a branch, not a select per
key) and K's per-channel min and step are read once per tile. The kernel
applies RoPE from the key positions to the rotary channels only (partial
rotary: the first ROTARY_DIM; the 27B rotates 64 of 256): the scores are
q . k over the other channels (K's rotary pairs load as zeros) plus
q1 . A + q2 . B over [BLOCK_N, ROTARY_DIM / 4] even and odd tiles of the
roped halves (`_roped_pairs`), whose cos/sin come from an explicit range
reduction (`_sin_cos`) because libdevice's sinf/cosf take a slow path at the
angles a long context reaches. The caller un-rotates the output.

Softmax runs in base 2: the query is scaled by softmax_scale * log2(e) once,
and exp2/log2 replace exp/log. Row and key masks never produce NaN: a row
with no keys keeps l == 0 and writes zeros (and lse = -inf for the combine).

Importing this module imports triton; under TRITON_INTERPRET=1 the kernels
run on CPU tensors (tests/test_attention.py).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from engine.kv.fwht import rotate_rows
from engine.kv.kernels import (_bf16_bits, _e8m0_scale, _k_step_decode, _load_dense,
                               _store_dense, as_kernel_dense)
from engine.kv.rotation import hadamard_scale
from engine.pdl import pdl_launch, pdl_prologue, release_first_launch

# KV layouts the kernel knows (constexpr KIND).
DENSE, DENSE_BF16, INT8, RK4, RK4P = 0, 1, 2, 3, 4
# constexpr: compiled kernels may only read globals that are constexpr
_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running max: no inf - inf
LOG2E = 1.4426950408889634


def _short_parts(value: float, bits: int, parts: int) -> tuple[float, ...]:
    """value as a sum of fp32 numbers: parts - 1 of `bits` significant bits
    each, then the remainder rounded to fp32 (Cody-Waite). n * part is exact
    in fp32 for n < 2**(24 - bits), with or without FMA contraction, which
    keeps the interpreter (separately rounded) and the GPU (fused) equal."""
    out, rest = [], value
    for _ in range(parts - 1):
        ulp = 2.0 ** (math.floor(math.log2(abs(rest))) - bits + 1)
        out.append(round(rest / ulp) * ulp)
        rest -= out[-1]
    out.append(float(torch.tensor(rest, dtype=torch.float32)))
    return tuple(out)


# RoPE angle reduction by pi/2: quadrants n < 2**20 stay exact, i.e. angles
# up to 2**20 * pi/2 ~ 1.6e6 rad (positions up to 1.6M at inv_freq 1).
_HALF_PI = _short_parts(math.pi / 2, bits=4, parts=5)
_HALF_PI_1, _HALF_PI_2, _HALF_PI_3, _HALF_PI_4, _HALF_PI_5 = (tl.constexpr(c) for c in _HALF_PI)
_TWO_OVER_PI = tl.constexpr(2.0 / math.pi)


def rope_pad(rotary_dim: int) -> int:
    """Width of rk4p's rotary tiles: the channel pairs of one rotary half
    (rotary_dim / 4), a power of two and at least tl.dot's 16 (zero columns
    pad the smaller heads)."""
    return max(16, triton.next_power_of_2(max(1, rotary_dim // 4)))


@triton.jit
def _load_kv(codes_ptr, scales_ptr, slot, kv_head, cols, key_ok, col_ok,
             KV_HEADS: tl.constexpr, D: tl.constexpr, KIND: tl.constexpr,
             SCALE_BLOCK: tl.constexpr, E8M0: tl.constexpr, INT8_NO_I2F: tl.constexpr,
             COMPILED: tl.constexpr):
    """Dequantized [BLOCK_N, D_PAD] fp32 K or V rows of (slot, kv_head).

    Mirrors formats.py: int8 is code * fp16 scale per (token, head); rk4 byte i
    of a row holds channel 2i in its low nibble and 2i+1 in its high one, the
    code is nibble - 8, with one scale per SCALE_BLOCK channels (rk4's
    default program reads them as channel pairs instead: _rk4_pairs_program)."""
    row = slot * KV_HEADS + kv_head  # int64 [BLOCK_N]
    mask = key_ok[:, None] & col_ok[None, :]
    if KIND == 0:
        return _load_dense(codes_ptr, row[:, None] * D + cols[None, :], mask, False)
    elif KIND == 1:
        return _load_dense(codes_ptr, row[:, None] * D + cols[None, :], mask, True)
    elif KIND == 2:
        codes, scale = _int8_rows(codes_ptr, scales_ptr, row, cols, key_ok, mask, D)
        if INT8_NO_I2F:
            return _int8_values(codes, COMPILED) * scale[:, None]
        return codes.to(tl.float32) * scale[:, None]
    else:
        # each byte loaded once, split into its two nibbles (interleaved back
        # to channel order), and one scale load per block of channels,
        # broadcast: per element the sm_90 build loaded byte and scale again
        # (bench.attention_sass: 513 LDG per 64-key tile and thread)
        BLOCK_N: tl.constexpr = row.shape[0]
        D_PAD: tl.constexpr = cols.shape[0]
        NB: tl.constexpr = D_PAD // SCALE_BLOCK
        half = tl.arange(0, D_PAD // 2)
        packed = tl.load(codes_ptr + row[:, None] * (D // 2) + half[None, :],
                         mask=key_ok[:, None] & (half < D // 2)[None, :], other=0).to(tl.int32)
        codes = tl.interleave((packed & 0xF) - 8, (packed >> 4) - 8).to(tl.float32)
        scale = _block_scales(scales_ptr, row, key_ok, D, D_PAD, SCALE_BLOCK, E8M0)
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, NB, SCALE_BLOCK)),
                           (BLOCK_N, D_PAD))
        return codes * scale


@triton.jit
def _int8_rows(codes_ptr, scales_ptr, row, cols, key_ok, mask, D: tl.constexpr):
    """int8 pages' codes [BLOCK_N, cols] of rows `row` (masked: 0) and their
    fp32 scales [BLOCK_N] (masked keys: 0)."""
    codes = tl.load(codes_ptr + row[:, None] * D + cols[None, :], mask=mask, other=0)
    scale = tl.load(scales_ptr + row, mask=key_ok, other=0.0).to(tl.float32)
    return codes, scale


@triton.jit
def _block_scales(scales_ptr, row, key_ok, D: tl.constexpr, D_PAD: tl.constexpr,
                  SCALE_BLOCK: tl.constexpr, E8M0: tl.constexpr):
    """fp32 [BLOCK_N, D_PAD / SCALE_BLOCK] scales of rows `row`, one per block
    of SCALE_BLOCK channels: fp16, or E8M0 exponents (rk4's option). Masked
    blocks read 0 either way (E8M0's bits 0 are +0.0), so their values are
    finite and padded channels add nothing."""
    blocks = tl.arange(0, D_PAD // SCALE_BLOCK)
    at = scales_ptr + row[:, None] * (D // SCALE_BLOCK) + blocks[None, :]
    ok = key_ok[:, None] & (blocks < D // SCALE_BLOCK)[None, :]
    if E8M0:
        return _e8m0_scale(tl.load(at, mask=ok, other=0))
    return tl.load(at, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _int8_values(codes, COMPILED: tl.constexpr):
    """int8 codes as exact fp32 without int-to-float conversions (I2F runs at
    1/8 of FADD's rate on sm_90): code ^ 0x80 is code + 128 as an unsigned
    byte b, and the float with bits 0x4B0000bb is 2**23 + b, so one FADD
    leaves the code. Compiled: one LOP3 per register of four codes flips
    their sign bits, one PRMT per code sets the byte under the exponent
    (as _nibble_values)."""
    if COMPILED:
        bits = tl.inline_asm_elementwise(
            "{ .reg .b32 m, x; mov.b32 m, 0x4B000000; xor.b32 x, $4, 0x80808080; "
            "prmt.b32 $0, x, m, 0x7440; prmt.b32 $1, x, m, 0x7441; "
            "prmt.b32 $2, x, m, 0x7442; prmt.b32 $3, x, m, 0x7443; }",
            "=r,=r,=r,=r,r", [codes], dtype=tl.int32, is_pure=True, pack=4)
    else:
        bits = (codes.to(tl.int32) + 128) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388736.0  # 2**23 + 128


@triton.jit
def _nibble_values(packed, offset: tl.constexpr, COMPILED: tl.constexpr):
    """(low nibble minus `offset`, 16 * high nibble) of uint8 bytes, as exact
    fp32 without int-to-float conversions (I2F runs at 1/8 of FADD's rate,
    engine/quant/gemv.py): the float with bits 0x4B0000bb is 2**23 + b, one
    PRMT per byte straight from the loaded words (Triton hands the asm four
    bytes a register, element i in byte i); masking its high nibble leaves
    2**23 + low, and the difference of the two is 16 * high."""
    if COMPILED:
        byte_bits = tl.inline_asm_elementwise(
            "{ .reg .b32 m; mov.b32 m, 0x4B000000; prmt.b32 $0, $4, m, 0x7440; "
            "prmt.b32 $1, $4, m, 0x7441; prmt.b32 $2, $4, m, 0x7442; "
            "prmt.b32 $3, $4, m, 0x7443; }",
            "=r,=r,=r,=r,r", [packed], dtype=tl.int32, is_pure=True, pack=4)
    else:
        byte_bits = packed.to(tl.int32) | 0x4B000000
    byte = byte_bits.to(tl.float32, bitcast=True)
    low = (byte_bits & 0x4B00000F).to(tl.float32, bitcast=True)
    return low - (8388608.0 + offset), byte - low


@triton.jit
def _fp16_bits_value(bits):
    """fp32 value of the fp16 whose bits are the low 16 of int32 `bits`."""
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_page_params(min_ptr, step_ptr, page, kv_head, pairs, mask, KV_HEADS: tl.constexpr,
                   D: tl.constexpr, ONE_PAGE: tl.constexpr):
    """fp32 (min even, min odd, step even, step odd) of rk4p K's channel
    pairs (2p, 2p + 1), p in `pairs`, on their page: min_ptr reads k_min as
    int32 words (two fp16s) and step_ptr k_step as int16 (two e5m3 codes), so
    one load serves both channels. ONE_PAGE: page is a scalar, the tile's one
    page, and the values come as [1, PAIRS] (one load per tile, not per key);
    else per key, [BLOCK_N, PAIRS]."""
    if ONE_PAGE:
        at = ((page * KV_HEADS + kv_head) * (D // 2) + pairs)[None, :]
    else:
        at = (page * KV_HEADS + kv_head)[:, None] * (D // 2) + pairs[None, :]
    words = tl.load(min_ptr + at, mask=mask, other=0)
    codes = tl.load(step_ptr + at, mask=mask, other=0).to(tl.int32)
    return (_fp16_bits_value(words), _fp16_bits_value(words >> 16),
            _k_step_decode(codes & 0xFF), _k_step_decode((codes >> 8) & 0xFF))


@triton.jit
def _k_real_pairs(codes_ptr, min_ptr, step_ptr, page, row, kv_head, pairs, mask, page_mask,
                  KV_HEADS: tl.constexpr, D: tl.constexpr, ONE_PAGE: tl.constexpr,
                  COMPILED: tl.constexpr):
    """Dequantized rk4p K rows `row` at channel pairs: (even, odd). Byte p of
    a row holds channel 2p in its low nibble and 2p + 1 in its high one
    (formats.py), so the byte loads are contiguous and each nibble is a tile
    of its own. page_mask: the min and step loads' mask (_k_page_params)."""
    lo_even, lo_odd, step_even, step_odd = _k_page_params(min_ptr, step_ptr, page, kv_head,
                                                          pairs, page_mask, KV_HEADS, D,
                                                          ONE_PAGE)
    packed = tl.load(codes_ptr + row[:, None] * (D // 2) + pairs[None, :], mask=mask, other=0)
    low, high16 = _nibble_values(packed, 0, COMPILED)
    return lo_even + low * step_even, lo_odd + high16 * (step_odd * 0.0625)


@triton.jit
def _per_block(x, HALF_BLOCK: tl.constexpr):
    """[BLOCK_N, blocks] values broadcast to each block's HALF_BLOCK channel
    pairs: [BLOCK_N, blocks * HALF_BLOCK]."""
    rows: tl.constexpr = x.shape[0]
    blocks: tl.constexpr = x.shape[1]
    return tl.reshape(tl.broadcast_to(x[:, :, None], [rows, blocks, HALF_BLOCK]),
                      [rows, blocks * HALF_BLOCK])


@triton.jit
def _block_scaled_pairs(codes_ptr, scales_ptr, row, key_ok, D: tl.constexpr,
                        D_PAD: tl.constexpr, SCALE_BLOCK: tl.constexpr, E8M0: tl.constexpr,
                        COMPILED: tl.constexpr):
    """Dequantized rows `row` of per-token 4-bit codes (nibble - 8) with one
    scale per SCALE_BLOCK channels (rk4's K and V, rk4p's V; E8M0: rk4's
    exponent scales) at channel pairs [0, D_PAD / 2): (even, odd). Scales
    load once per (token, block) and broadcast; every product and sum here
    is exact (4-bit codes times fp16 or power-of-two scales)."""
    HALF_BLOCK: tl.constexpr = SCALE_BLOCK // 2
    pairs = tl.arange(0, D_PAD // 2)
    mask = key_ok[:, None] & (pairs < D // 2)[None, :]
    packed = tl.load(codes_ptr + row[:, None] * (D // 2) + pairs[None, :], mask=mask, other=0)
    scale = _block_scales(scales_ptr, row, key_ok, D, D_PAD, SCALE_BLOCK, E8M0)
    low, high16 = _nibble_values(packed, 8, COMPILED)
    # odd: (16 high) * scale / 16 - 8 scale, one FFMA
    return (low * _per_block(scale, HALF_BLOCK),
            high16 * _per_block(scale * 0.0625, HALF_BLOCK)
            + _per_block(scale * -8.0, HALF_BLOCK))


@triton.jit
def _staged_pairs(open_ptr, open_row, pairs, mask, D: tl.constexpr):
    """bf16 staging rows at channel pairs: (even, odd), exactly. open_ptr
    reads the staging pages as int32 words, each a channel pair, the even
    channel in the low half (little-endian)."""
    words = tl.load(open_ptr + open_row[:, None] * (D // 2) + pairs[None, :], mask=mask, other=0)
    return (words << 16).to(tl.float32, bitcast=True), \
        ((words >> 16) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _load_rk4p_pairs(codes_ptr, scales_ptr, step_ptr, open_ptr, page, slot, staged,
                     first_staged, kv_head, pairs, key_ok, pairs_ok, KV_HEADS: tl.constexpr,
                     D: tl.constexpr, D_PAD: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                     IS_K: tl.constexpr, ONE_PAGE: tl.constexpr, COMPILED: tl.constexpr):
    """rk4p K before RoPE (IS_K: scales_ptr, step_ptr are k_min, k_step) at
    channel pairs p (2p, 2p + 1), or V, rotated (scales_ptr: v_scales), at
    all pairs [0, D_PAD / 2): (even, odd) fp32 [BLOCK_N, PAIRS], from a real
    page or a staging page's bf16. ONE_PAGE: page and staged are the tile's,
    scalars, so the tile takes one branch (staged pages are a few per
    sequence); else per key, both loads masked and selected."""
    row = slot * KV_HEADS + kv_head
    if ONE_PAGE:
        mask = key_ok[:, None] & pairs_ok[None, :]
        if staged:
            even, odd = _staged_pairs(open_ptr, (slot - first_staged) * KV_HEADS + kv_head,
                                      pairs, mask, D)
        else:
            if IS_K:
                even, odd = _k_real_pairs(codes_ptr, scales_ptr, step_ptr, page, row, kv_head,
                                          pairs, mask, pairs_ok[None, :], KV_HEADS, D,
                                          ONE_PAGE, COMPILED)
            else:
                even, odd = _block_scaled_pairs(codes_ptr, scales_ptr, row, key_ok, D, D_PAD,
                                                SCALE_BLOCK, False, COMPILED)
    else:
        real_mask = (key_ok & ~staged)[:, None] & pairs_ok[None, :]
        if IS_K:
            even, odd = _k_real_pairs(codes_ptr, scales_ptr, step_ptr, page, row, kv_head, pairs,
                                      real_mask, real_mask, KV_HEADS, D, ONE_PAGE, COMPILED)
        else:
            even, odd = _block_scaled_pairs(codes_ptr, scales_ptr, row, key_ok & ~staged, D,
                                            D_PAD, SCALE_BLOCK, False, COMPILED)
        exact_even, exact_odd = _staged_pairs(
            open_ptr, tl.where(staged, slot - first_staged, 0) * KV_HEADS + kv_head, pairs,
            (key_ok & staged)[:, None] & pairs_ok[None, :], D)
        even = tl.where(staged[:, None], exact_even, even)
        odd = tl.where(staged[:, None], exact_odd, odd)
    return even, odd


@triton.jit
def _mul_rn(a, b, COMPILED: tl.constexpr):
    """a * b rounded to fp32 as its own operation: the GPU build may not fuse
    it into a later add (ptxas keeps mul.rn apart), so the RoPE angle is the
    fp32 product that torch (rotary.cos_sin) takes the cos/sin of."""
    if COMPILED:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def _sin_cos(x):
    """sin(x), cos(x) of fp32 x to about 1e-7 for |x| < 1.6e6: one Cody-Waite
    reduction by pi/2 for both (n * part exact, so r is x - n pi/2 to an ulp),
    Taylor polynomials on |r| <~ pi/4 (the first terms left out are below
    2e-9 there), then the quadrant's swap and signs. libdevice's sinf/cosf
    would each reduce |x| > ~1e5 the slow (Payne-Hanek) way."""
    n = tl.floor(x * _TWO_OVER_PI + 0.5)
    r = x - n * _HALF_PI_1
    r = r - n * _HALF_PI_2
    r = r - n * _HALF_PI_3
    r = r - n * _HALF_PI_4
    r = r - n * _HALF_PI_5
    r2 = r * r
    s = r + r * r2 * (-1.0 / 6 + r2 * (1.0 / 120 + r2 * (-1.0 / 5040 + r2 * (1.0 / 362880))))
    c = 1.0 + r2 * (-0.5 + r2 * (1.0 / 24 + r2 * (-1.0 / 720 + r2 * (
        1.0 / 40320 + r2 * (-1.0 / 3628800)))))
    quadrant = n.to(tl.int32)
    odd = (quadrant & 1) != 0
    sin = tl.where(odd, c, s)
    cos = tl.where(odd, s, c)
    sin = tl.where((quadrant & 2) != 0, -sin, sin)
    cos = tl.where(((quadrant + 1) & 2) != 0, -cos, cos)
    return sin, cos


@triton.jit
def _roped_pairs(k_codes_ptr, min_ptr, step_ptr, open_ptr, page, slot, staged, first_staged,
                 kv_head, keys, key_ok, inv_freq_ptr, KV_HEADS: tl.constexpr, D: tl.constexpr,
                 ROTARY_DIM: tl.constexpr, ROPE_PAD: tl.constexpr, ONE_PAGE: tl.constexpr,
                 COMPILED: tl.constexpr):
    """RoPE'd rotary halves A = k1 c - k2 s, B = k2 c + k1 s (rotate-half
    layout, engine/rotary.py: k1, k2 are channels [0, half) and [half,
    ROTARY_DIM)), each as its even and odd channels: (A even, A odd, B even,
    B odd), fp32 [BLOCK_N, ROPE_PAD]; pad columns are zero. Channel c and its
    partner c + half have the same parity (half is even), so k1's pairs
    [0, half / 2) meet k2's [half / 2, half) column for column."""
    quarter: tl.constexpr = ROTARY_DIM // 4  # channel pairs per half
    i = tl.arange(0, ROPE_PAD)
    i_ok = i < quarter
    k1_even, k1_odd = _load_rk4p_pairs(k_codes_ptr, min_ptr, step_ptr, open_ptr, page, slot,
                                       staged, first_staged, kv_head, i, key_ok, i_ok, KV_HEADS,
                                       D, 0, 0, True, ONE_PAGE, COMPILED)
    k2_even, k2_odd = _load_rk4p_pairs(k_codes_ptr, min_ptr, step_ptr, open_ptr, page, slot,
                                       staged, first_staged, kv_head, i + quarter, key_ok, i_ok,
                                       KV_HEADS, D, 0, 0, True, ONE_PAGE, COMPILED)
    position = tl.broadcast_to(keys.to(tl.float32)[:, None], k1_even.shape)
    freq_even = tl.load(inv_freq_ptr + 2 * i, mask=i_ok, other=0.0)
    freq_odd = tl.load(inv_freq_ptr + 2 * i + 1, mask=i_ok, other=0.0)
    sin_e, cos_e = _sin_cos(_mul_rn(position, tl.broadcast_to(freq_even[None, :], position.shape),
                                    COMPILED))
    sin_o, cos_o = _sin_cos(_mul_rn(position, tl.broadcast_to(freq_odd[None, :], position.shape),
                                    COMPILED))
    return (k1_even * cos_e - k2_even * sin_e, k1_odd * cos_o - k2_odd * sin_o,
            k2_even * cos_e + k1_even * sin_e, k2_odd * cos_o + k1_odd * sin_o)


@triton.jit
def _dot_operand(x, DOT_BF16: tl.constexpr):
    """x as a dot operand: bf16 (DOT_BF16 == 1), or rounded to bf16 and kept
    fp32 (== 2: the interpreter, whose bf16 dot is wrong, gets the same
    numbers), or as is."""
    if DOT_BF16 == 1:
        return x.to(tl.bfloat16)
    elif DOT_BF16 == 2:
        return x.to(tl.bfloat16).to(tl.float32)
    else:
        return x


@triton.jit
def _online_softmax(s, keys, key_ok, q_pos, m_i, l_i):
    """Masks scores s [ROWS, BLOCK_N] to the keys each row sees and folds them
    into the running max and sum: (m_new, alpha (the rescale of what came
    before), p, l_new)."""
    visible = (keys[None, :] <= q_pos[:, None]) & key_ok[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return m_new, alpha, p, l_i


@triton.jit
def _key_slots(table, keys, key_ok, PAGE_SIZE: tl.constexpr):
    """Cache slots of `keys` through the sequence's page table, per key (a
    tile may span pages)."""
    page = tl.load(table + keys // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
    return page * PAGE_SIZE + keys % PAGE_SIZE


@triton.jit
def _attend_tile(q, q_pos, m_i, l_i, acc, start, hi, table, cols, col_ok, kv_head,
                 k_codes_ptr, k_scales_ptr, v_codes_ptr, v_scales_ptr,
                 KV_HEADS: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 KIND: tl.constexpr, SCALE_BLOCK: tl.constexpr, E8M0: tl.constexpr,
                 BLOCK_N: tl.constexpr, DOT_BF16: tl.constexpr, INT8_NO_I2F: tl.constexpr,
                 INT8_CODES_DOT: tl.constexpr, COMPILED: tl.constexpr):
    """One online-softmax step over keys [start, start + BLOCK_N) (< hi).
    DOT_BF16: q (already rounded), K, P and V enter the dots as bf16,
    which runs them at twice tf32's rate with half the shared memory; the
    accumulators and the softmax stay fp32."""
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = keys < hi
    slot = _key_slots(table, keys, key_ok, PAGE_SIZE)
    if KIND == 2 and INT8_CODES_DOT:
        return _attend_int8_codes(q, q_pos, m_i, l_i, acc, keys, key_ok, slot, cols, col_ok,
                                  kv_head, k_codes_ptr, k_scales_ptr, v_codes_ptr, v_scales_ptr,
                                  KV_HEADS, D, DOT_BF16)
    k = _load_kv(k_codes_ptr, k_scales_ptr, slot, kv_head, cols, key_ok, col_ok,
                 KV_HEADS, D, KIND, SCALE_BLOCK, E8M0, INT8_NO_I2F, COMPILED)
    s = tl.dot(q, tl.trans(_dot_operand(k, DOT_BF16)))
    m_new, alpha, p, l_i = _online_softmax(s, keys, key_ok, q_pos, m_i, l_i)
    v = _load_kv(v_codes_ptr, v_scales_ptr, slot, kv_head, cols, key_ok, col_ok,
                 KV_HEADS, D, KIND, SCALE_BLOCK, E8M0, INT8_NO_I2F, COMPILED)
    acc = acc * alpha[:, None] + tl.dot(_dot_operand(p, DOT_BF16), _dot_operand(v, DOT_BF16))
    return m_new, l_i, acc


@triton.jit
def _code_operand(codes, DOT_BF16: tl.constexpr):
    """int8 codes as a dot operand: exact in bf16 (8 significant bits) and
    in tf32 alike."""
    if DOT_BF16 == 1:
        return codes.to(tl.bfloat16)
    else:
        return codes.to(tl.float32)


@triton.jit
def _attend_int8_codes(q, q_pos, m_i, l_i, acc, keys, key_ok, slot, cols, col_ok, kv_head,
                       k_codes_ptr, k_scales_ptr, v_codes_ptr, v_scales_ptr,
                       KV_HEADS: tl.constexpr, D: tl.constexpr, DOT_BF16: tl.constexpr):
    """_attend_tile over int8 pages with the codes themselves in the dots and
    each key's scales outside them: q . (c_k s_k) = (q . c_k) s_k on the
    scores, sum_n p_n (c_n s_n) = sum_n (p_n s_n) c_n on the output. The
    K and V tiles are then int8 codes cast as they enter the dots (no fp32
    tile, no per-element scale), where dequantizing them first cost the 27B's 4K
    decode ~19 instructions an element, 255 registers and spills (Nsight
    Compute, H100, 2026-12-06). The codes are exact operands, so only q and
    p s round (as q and p did)."""
    row = slot * KV_HEADS + kv_head
    mask = key_ok[:, None] & col_ok[None, :]
    k, k_scale = _int8_rows(k_codes_ptr, k_scales_ptr, row, cols, key_ok, mask, D)
    s = tl.dot(q, tl.trans(_code_operand(k, DOT_BF16))) * k_scale[None, :]
    m_new, alpha, p, l_i = _online_softmax(s, keys, key_ok, q_pos, m_i, l_i)
    v, v_scale = _int8_rows(v_codes_ptr, v_scales_ptr, row, cols, key_ok, mask, D)
    pv = tl.dot(_dot_operand(p * v_scale[None, :], DOT_BF16), _code_operand(v, DOT_BF16))
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _pair_scores(q_even, q_odd, k_even, k_odd, DOT_BF16: tl.constexpr):
    """q . k over channel pairs: q_even . k_even + q_odd . k_odd, [ROWS, BLOCK_N]."""
    s = tl.dot(q_even, tl.trans(_dot_operand(k_even, DOT_BF16)))
    return tl.dot(q_odd, tl.trans(_dot_operand(k_odd, DOT_BF16)), s)


@triton.jit
def _accumulate_pairs(acc_even, acc_odd, alpha, p, v_even, v_odd, DOT_BF16: tl.constexpr):
    """The online softmax's output update, acc * alpha + p . V, on even and
    odd channels apart."""
    p = _dot_operand(p, DOT_BF16)
    return (acc_even * alpha[:, None] + tl.dot(p, _dot_operand(v_even, DOT_BF16)),
            acc_odd * alpha[:, None] + tl.dot(p, _dot_operand(v_odd, DOT_BF16)))


@triton.jit
def _attend_rk4_tile(q_even, q_odd, q_pos, m_i, l_i, acc_even, acc_odd, start, hi, table,
                     kv_head, k_codes_ptr, k_scales_ptr, v_codes_ptr, v_scales_ptr,
                     KV_HEADS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                     PAGE_SIZE: tl.constexpr, SCALE_BLOCK: tl.constexpr, E8M0: tl.constexpr,
                     BLOCK_N: tl.constexpr, DOT_BF16: tl.constexpr, COMPILED: tl.constexpr):
    """_attend_tile over rk4 pages on even and odd channels: a byte's two
    nibbles are a K or V element of each (_block_scaled_pairs), so neither
    an int-to-float conversion nor an interleave back to channel order."""
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = keys < hi
    row = _key_slots(table, keys, key_ok, PAGE_SIZE) * KV_HEADS + kv_head
    k_even, k_odd = _block_scaled_pairs(k_codes_ptr, k_scales_ptr, row, key_ok, D, D_PAD,
                                        SCALE_BLOCK, E8M0, COMPILED)
    s = _pair_scores(q_even, q_odd, k_even, k_odd, DOT_BF16)
    m_new, alpha, p, l_i = _online_softmax(s, keys, key_ok, q_pos, m_i, l_i)
    v_even, v_odd = _block_scaled_pairs(v_codes_ptr, v_scales_ptr, row, key_ok, D, D_PAD,
                                        SCALE_BLOCK, E8M0, COMPILED)
    acc_even, acc_odd = _accumulate_pairs(acc_even, acc_odd, alpha, p, v_even, v_odd, DOT_BF16)
    return m_new, l_i, acc_even, acc_odd


@triton.jit
def _rk4p_tile_pages(table, start, keys, key_ok, first_staged, PAGE_SIZE: tl.constexpr,
                     ONE_PAGE: tl.constexpr):
    """(page, slot, staged) of a key tile. Tiles start at multiples of their
    width, so when it divides the page size (ONE_PAGE) a tile lies on one
    page: its page id and whether it is staged are scalars, loaded once (and
    K's min and step with them, _load_rk4p_pairs); else per key."""
    if ONE_PAGE:
        page = tl.load(table + start // PAGE_SIZE).to(tl.int64)
    else:
        page = tl.load(table + keys // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
    slot = page * PAGE_SIZE + keys % PAGE_SIZE
    staged = page * PAGE_SIZE >= first_staged
    return page, slot, staged


@triton.jit
def _attend_rk4p_tile(q_even, q_odd, q1_even, q1_odd, q2_even, q2_odd, q_pos, m_i, l_i,
                      acc_even, acc_odd, start, hi, table, pairs, pairs_ok, kv_head,
                      k_codes_ptr, k_min_ptr, k_step_ptr, k_open_ptr,
                      v_codes_ptr, v_scales_ptr, v_open_ptr, inv_freq_ptr, first_staged,
                      KV_HEADS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                      PAGE_SIZE: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                      ROTARY_DIM: tl.constexpr, ROPE_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                      DOT_BF16: tl.constexpr, COMPILED: tl.constexpr):
    """_attend_tile over rk4p pages, on even and odd channels: the scores are
    q_even . k_even + q_odd . k_odd over the channels RoPE leaves alone (K's
    rotary pairs load as zeros) plus the roped halves' four dots (q1, q2: the
    rotary halves of q, each split likewise, [ROWS, ROPE_PAD]); V's even and
    odd channels accumulate apart (acc_even, acc_odd [ROWS, D_PAD / 2])."""
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = keys < hi
    ONE_PAGE: tl.constexpr = PAGE_SIZE % BLOCK_N == 0
    page, slot, staged = _rk4p_tile_pages(table, start, keys, key_ok, first_staged, PAGE_SIZE,
                                          ONE_PAGE)
    if ROTARY_DIM < D:
        main_ok = pairs_ok & (pairs >= ROTARY_DIM // 2)  # the rotary pairs enter below
        k_even, k_odd = _load_rk4p_pairs(k_codes_ptr, k_min_ptr, k_step_ptr, k_open_ptr, page,
                                         slot, staged, first_staged, kv_head, pairs, key_ok,
                                         main_ok, KV_HEADS, D, 0, 0, True, ONE_PAGE,
                                         COMPILED)
        s = _pair_scores(q_even, q_odd, k_even, k_odd, DOT_BF16)
    else:  # full rotary: no other channels
        s = tl.zeros([q_even.shape[0], BLOCK_N], tl.float32)
    if ROTARY_DIM > 0:
        a_even, a_odd, b_even, b_odd = _roped_pairs(
            k_codes_ptr, k_min_ptr, k_step_ptr, k_open_ptr, page, slot, staged, first_staged,
            kv_head, keys, key_ok, inv_freq_ptr, KV_HEADS, D, ROTARY_DIM, ROPE_PAD, ONE_PAGE,
            COMPILED)
        s = tl.dot(q1_even, tl.trans(_dot_operand(a_even, DOT_BF16)), s)
        s = tl.dot(q1_odd, tl.trans(_dot_operand(a_odd, DOT_BF16)), s)
        s = tl.dot(q2_even, tl.trans(_dot_operand(b_even, DOT_BF16)), s)
        s = tl.dot(q2_odd, tl.trans(_dot_operand(b_odd, DOT_BF16)), s)
    m_new, alpha, p, l_i = _online_softmax(s, keys, key_ok, q_pos, m_i, l_i)
    v_even, v_odd = _load_rk4p_pairs(v_codes_ptr, v_scales_ptr, v_scales_ptr, v_open_ptr, page,
                                     slot, staged, first_staged, kv_head, pairs, key_ok, pairs_ok,
                                     KV_HEADS, D, D_PAD, SCALE_BLOCK, False, ONE_PAGE, COMPILED)
    acc_even, acc_odd = _accumulate_pairs(acc_even, acc_odd, alpha, p, v_even, v_odd, DOT_BF16)
    return m_new, l_i, acc_even, acc_odd


@triton.jit
def _load_q(q_ptr, q_rows, cols, mask, qk_scale, D: tl.constexpr, Q_BF16: tl.constexpr,
            DOT_BF16: tl.constexpr):
    """Query channels `cols` of rows q_rows, scaled and as a dot operand."""
    q = _load_dense(q_ptr, q_rows[:, None] * D + cols[None, :], mask, Q_BF16) * qk_scale
    return _dot_operand(q, DOT_BF16)


@triton.jit
def _load_q_pairs(q_ptr, q_rows, pairs, mask, qk_scale, D: tl.constexpr, Q_BF16: tl.constexpr,
                  DOT_BF16: tl.constexpr):
    """Query channels 2p and 2p + 1, p in `pairs`: (even, odd) dot operands."""
    return (_load_q(q_ptr, q_rows, 2 * pairs, mask, qk_scale, D, Q_BF16, DOT_BF16),
            _load_q(q_ptr, q_rows, 2 * pairs + 1, mask, qk_scale, D, Q_BF16, DOT_BF16))


@triton.jit
def _load_rotated_q_pairs(q_ptr, q_rows, row_ok, signs_ptr, qk_scale, D: tl.constexpr,
                          LOG2_D: tl.constexpr, R_SCALE: tl.constexpr, ROWS: tl.constexpr,
                          Q_BF16: tl.constexpr, DOT_BF16: tl.constexpr):
    """_load_q_pairs of q @ R from q itself (D a power of two): the rotation
    is fwht.rotate_rows in fp32, the very values the Hadamard row kernel
    would have stored for _load_q to read."""
    cols = tl.arange(0, D)
    q = _load_dense(q_ptr, q_rows[:, None] * D + cols[None, :],
                    row_ok[:, None] & (cols < D)[None, :], Q_BF16)
    q = rotate_rows(q, tl.load(signs_ptr + cols)[None, :], ROWS, D, LOG2_D, R_SCALE, False)
    q_even, q_odd = tl.split(tl.reshape(q * qk_scale, (ROWS, D // 2, 2)))
    return _dot_operand(q_even, DOT_BF16), _dot_operand(q_odd, DOT_BF16)


@triton.jit
def _split_keys(n_new, kv_len, first_row, split, ROWS: tl.constexpr, GROUP: tl.constexpr,
                NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys [lo, hi) of this program: those its row block needs (causal), then
    this split's share of them, whole BLOCK_Ns so that splits never share a
    tile. lo is a multiple of BLOCK_N, so every tile starts at one (rk4p's
    per-page tiles rely on it)."""
    last_token = tl.minimum(n_new - 1, (first_row + ROWS - 1) // GROUP)
    key_end = tl.minimum(kv_len, kv_len - n_new + last_token + 1)
    key_end = tl.where(first_row < n_new * GROUP, key_end, 0)
    split_len = tl.cdiv(tl.cdiv(key_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, key_end)
    return lo, hi


@triton.jit
def _store_out(o, q_rows, split, cols, mask, out_ptr, part_out_ptr, D: tl.constexpr,
               NUM_SPLITS: tl.constexpr, OUT_BF16: tl.constexpr):
    """Output channels `cols` of rows q_rows: the output, or this split's part."""
    if NUM_SPLITS == 1:
        _store_dense(out_ptr, q_rows[:, None] * D + cols[None, :], o, mask, OUT_BF16)
    else:
        part = q_rows * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * D + cols[None, :], o, mask=mask)


@triton.jit
def _store_lse(m_i, norm, has_keys, q_rows, split, row_ok, part_lse_ptr,
               NUM_SPLITS: tl.constexpr):
    """Split programs: each row's log2-sum-exp for the combine (-inf: no keys)."""
    if NUM_SPLITS > 1:
        lse = tl.where(has_keys, m_i + tl.math.log2(norm), float("-inf"))
        tl.store(part_lse_ptr + q_rows * NUM_SPLITS + split, lse, mask=row_ok)


@triton.jit
def _no_keys_yet_pairs(ROWS: tl.constexpr, D_PAD: tl.constexpr):
    """A pairs program's online-softmax state before its first key tile:
    (running max, running sum, even and odd accumulators)."""
    return (tl.full([ROWS], _NEG_BIG, tl.float32), tl.zeros([ROWS], tl.float32),
            tl.zeros([ROWS, D_PAD // 2], tl.float32), tl.zeros([ROWS, D_PAD // 2], tl.float32))


@triton.jit
def _finish_pairs(m_i, l_i, acc_even, acc_odd, q_rows, split, pairs, q_mask, row_ok, out_ptr,
                  part_out_ptr, part_lse_ptr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  OUT_BF16: tl.constexpr):
    """A pairs program's end: the normalised output at channels 2p and
    2p + 1, and the split's log-sum-exp."""
    has_keys = l_i > 0.0
    norm = tl.where(has_keys, l_i, 1.0)
    _store_out(acc_even / norm[:, None], q_rows, split, 2 * pairs, q_mask, out_ptr, part_out_ptr,
               D, NUM_SPLITS, OUT_BF16)
    _store_out(acc_odd / norm[:, None], q_rows, split, 2 * pairs + 1, q_mask, out_ptr,
               part_out_ptr, D, NUM_SPLITS, OUT_BF16)
    _store_lse(m_i, norm, has_keys, q_rows, split, row_ok, part_lse_ptr, NUM_SPLITS)


@triton.jit
def _rk4_pairs_program(q_ptr, q_lo, token, head, row_ok, q_pos, n_new, kv_len, first_row, split,
                       table, kv_head, qk_scale, k_codes_ptr, k_scales_ptr, v_codes_ptr,
                       v_scales_ptr, out_ptr, part_out_ptr, part_lse_ptr, signs_ptr,
                       Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                       D: tl.constexpr, D_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
                       SCALE_BLOCK: tl.constexpr, E8M0: tl.constexpr, Q_BF16: tl.constexpr,
                       OUT_BF16: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                       NUM_SPLITS: tl.constexpr, FOR_LOOP: tl.constexpr,
                       DOT_BF16: tl.constexpr, ROTATE_Q: tl.constexpr, LOG2_D: tl.constexpr,
                       R_SCALE: tl.constexpr):
    """The kernel's program over rk4 pages with even and odd channels apart,
    as _rk4p_program (no RoPE, no staging pages): q, K, V and the output as
    two [.., D_PAD / 2] tiles each. A byte's nibbles become fp32 by bit
    tricks (_nibble_values) where _load_kv's channel-order tile took an I2F
    per element and an interleave of the nibble tiles. ROTATE_Q: q arrives
    as the model made it and is rotated into the stored space here
    (_load_rotated_q_pairs) instead of by a launch of its own."""
    pairs = tl.arange(0, D_PAD // 2)
    q_rows = (q_lo + token).to(tl.int64) * Q_HEADS + head
    q_mask = row_ok[:, None] & (pairs < D // 2)[None, :]
    if ROTATE_Q:
        q_even, q_odd = _load_rotated_q_pairs(q_ptr, q_rows, row_ok, signs_ptr, qk_scale, D,
                                              LOG2_D, R_SCALE, ROWS, Q_BF16, DOT_BF16)
    else:
        q_even, q_odd = _load_q_pairs(q_ptr, q_rows, pairs, q_mask, qk_scale, D, Q_BF16,
                                      DOT_BF16)
    lo, hi = _split_keys(n_new, kv_len, first_row, split, ROWS, GROUP, NUM_SPLITS, BLOCK_N)
    m_i, l_i, acc_even, acc_odd = _no_keys_yet_pairs(ROWS, D_PAD)
    if FOR_LOOP:  # as in the kernel
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc_even, acc_odd = _attend_rk4_tile(
                q_even, q_odd, q_pos, m_i, l_i, acc_even, acc_odd, start, hi, table, kv_head,
                k_codes_ptr, k_scales_ptr, v_codes_ptr, v_scales_ptr, KV_HEADS, D, D_PAD,
                PAGE_SIZE, SCALE_BLOCK, E8M0, BLOCK_N, DOT_BF16, FOR_LOOP)
    else:
        start = lo
        while start < hi:
            m_i, l_i, acc_even, acc_odd = _attend_rk4_tile(
                q_even, q_odd, q_pos, m_i, l_i, acc_even, acc_odd, start, hi, table, kv_head,
                k_codes_ptr, k_scales_ptr, v_codes_ptr, v_scales_ptr, KV_HEADS, D, D_PAD,
                PAGE_SIZE, SCALE_BLOCK, E8M0, BLOCK_N, DOT_BF16, FOR_LOOP)
            start += BLOCK_N
    _finish_pairs(m_i, l_i, acc_even, acc_odd, q_rows, split, pairs, q_mask, row_ok, out_ptr,
                  part_out_ptr, part_lse_ptr, D, NUM_SPLITS, OUT_BF16)


@triton.jit
def _rk4p_program(q_ptr, q_lo, token, head, row_ok, q_pos, n_new, kv_len, first_row, split,
                  table, kv_head, qk_scale, k_codes_ptr, k_min_ptr, k_step_ptr, k_open_ptr,
                  v_codes_ptr, v_scales_ptr, v_open_ptr, inv_freq_ptr, first_staged,
                  out_ptr, part_out_ptr, part_lse_ptr,
                  Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                  D: tl.constexpr, D_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  SCALE_BLOCK: tl.constexpr, ROTARY_DIM: tl.constexpr, ROPE_PAD: tl.constexpr,
                  Q_BF16: tl.constexpr, OUT_BF16: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, FOR_LOOP: tl.constexpr,
                  DOT_BF16: tl.constexpr):
    """The kernel's program over rk4p pages, with even and odd channels apart
    (a K or V byte holds a channel pair): q, K, V and the output each as two
    [.., D_PAD / 2] tiles, the rotary halves of q and K likewise."""
    tl.static_assert(ROTARY_DIM % 4 == 0, "rk4p attention pairs channels c, c + half: "
                                          "rotary_dim must be a multiple of 4")
    pairs = tl.arange(0, D_PAD // 2)
    pairs_ok = pairs < D // 2
    q_rows = (q_lo + token).to(tl.int64) * Q_HEADS + head
    q_mask = row_ok[:, None] & pairs_ok[None, :]
    q_even, q_odd = _load_q_pairs(q_ptr, q_rows, pairs, q_mask, qk_scale, D, Q_BF16, DOT_BF16)
    half: tl.constexpr = ROTARY_DIM // 2
    i = tl.arange(0, ROPE_PAD)
    half_mask = row_ok[:, None] & (i < ROTARY_DIM // 4)[None, :]
    q1_even = _load_q(q_ptr, q_rows, 2 * i, half_mask, qk_scale, D, Q_BF16, DOT_BF16)
    q1_odd = _load_q(q_ptr, q_rows, 2 * i + 1, half_mask, qk_scale, D, Q_BF16, DOT_BF16)
    q2_even = _load_q(q_ptr, q_rows, half + 2 * i, half_mask, qk_scale, D, Q_BF16, DOT_BF16)
    q2_odd = _load_q(q_ptr, q_rows, half + 2 * i + 1, half_mask, qk_scale, D, Q_BF16, DOT_BF16)
    lo, hi = _split_keys(n_new, kv_len, first_row, split, ROWS, GROUP, NUM_SPLITS, BLOCK_N)
    m_i, l_i, acc_even, acc_odd = _no_keys_yet_pairs(ROWS, D_PAD)
    if FOR_LOOP:  # as in the kernel
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc_even, acc_odd = _attend_rk4p_tile(
                q_even, q_odd, q1_even, q1_odd, q2_even, q2_odd, q_pos, m_i, l_i,
                acc_even, acc_odd, start, hi, table, pairs, pairs_ok, kv_head,
                k_codes_ptr, k_min_ptr, k_step_ptr, k_open_ptr,
                v_codes_ptr, v_scales_ptr, v_open_ptr, inv_freq_ptr, first_staged,
                KV_HEADS, D, D_PAD, PAGE_SIZE, SCALE_BLOCK, ROTARY_DIM, ROPE_PAD, BLOCK_N,
                DOT_BF16, FOR_LOOP)
    else:
        start = lo
        while start < hi:
            m_i, l_i, acc_even, acc_odd = _attend_rk4p_tile(
                q_even, q_odd, q1_even, q1_odd, q2_even, q2_odd, q_pos, m_i, l_i,
                acc_even, acc_odd, start, hi, table, pairs, pairs_ok, kv_head,
                k_codes_ptr, k_min_ptr, k_step_ptr, k_open_ptr,
                v_codes_ptr, v_scales_ptr, v_open_ptr, inv_freq_ptr, first_staged,
                KV_HEADS, D, D_PAD, PAGE_SIZE, SCALE_BLOCK, ROTARY_DIM, ROPE_PAD, BLOCK_N,
                DOT_BF16, FOR_LOOP)
            start += BLOCK_N
    _finish_pairs(m_i, l_i, acc_even, acc_odd, q_rows, split, pairs, q_mask, row_ok, out_ptr,
                  part_out_ptr, part_lse_ptr, D, NUM_SPLITS, OUT_BF16)


@triton.jit(do_not_specialize=("page_table_stride", "first_staged"))
def _paged_attention_kernel(
        q_ptr, q_offsets_ptr, kv_lens_ptr, page_table_ptr, page_table_stride,
        k_codes_ptr, k_scales_ptr, v_codes_ptr, v_scales_ptr,
        k_step_ptr, k_open_ptr, v_open_ptr, inv_freq_ptr, first_staged,
        out_ptr, part_out_ptr, part_lse_ptr, signs_ptr, qk_scale,
        Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
        D: tl.constexpr, D_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
        KIND: tl.constexpr, SCALE_BLOCK: tl.constexpr, E8M0: tl.constexpr,
        ROTARY_DIM: tl.constexpr, ROPE_PAD: tl.constexpr,
        Q_BF16: tl.constexpr, OUT_BF16: tl.constexpr,
        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        FOR_LOOP: tl.constexpr, DOT_BF16: tl.constexpr, RK4_PAIRS: tl.constexpr,
        INT8_NO_I2F: tl.constexpr, INT8_CODES_DOT: tl.constexpr, ROTATE_Q: tl.constexpr,
        LOG2_D: tl.constexpr,
        R_SCALE: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row_block = tl.program_id(0)
    seq = tl.program_id(1) // KV_HEADS
    kv_head = tl.program_id(1) % KV_HEADS
    split = tl.program_id(2)

    q_lo = tl.load(q_offsets_ptr + seq)
    n_new = tl.load(q_offsets_ptr + seq + 1) - q_lo
    kv_len = tl.load(kv_lens_ptr + seq)
    first_row = row_block * ROWS
    rows = first_row + tl.arange(0, ROWS)
    row_ok = rows < n_new * GROUP
    token = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    q_pos = kv_len - n_new + token  # each query sees keys [0, q_pos]
    table = page_table_ptr + seq.to(tl.int64) * page_table_stride
    if KIND == 4:
        _rk4p_program(q_ptr, q_lo, token, head, row_ok, q_pos, n_new, kv_len, first_row, split,
                      table, kv_head, qk_scale,
                      k_codes_ptr, k_scales_ptr, k_step_ptr, k_open_ptr,
                      v_codes_ptr, v_scales_ptr, v_open_ptr, inv_freq_ptr, first_staged,
                      out_ptr, part_out_ptr, part_lse_ptr, Q_HEADS, KV_HEADS, GROUP, D, D_PAD,
                      PAGE_SIZE, SCALE_BLOCK, ROTARY_DIM, ROPE_PAD, Q_BF16, OUT_BF16, ROWS,
                      BLOCK_N, NUM_SPLITS, FOR_LOOP, DOT_BF16)
        return
    if KIND == 3 and RK4_PAIRS:
        _rk4_pairs_program(q_ptr, q_lo, token, head, row_ok, q_pos, n_new, kv_len, first_row,
                           split, table, kv_head, qk_scale, k_codes_ptr, k_scales_ptr,
                           v_codes_ptr, v_scales_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                           signs_ptr, Q_HEADS, KV_HEADS, GROUP, D, D_PAD, PAGE_SIZE,
                           SCALE_BLOCK, E8M0, Q_BF16, OUT_BF16, ROWS, BLOCK_N, NUM_SPLITS,
                           FOR_LOOP, DOT_BF16, ROTATE_Q, LOG2_D, R_SCALE)
        return

    cols = tl.arange(0, D_PAD)
    col_ok = cols < D
    q_rows = (q_lo + token).to(tl.int64) * Q_HEADS + head
    q_mask = row_ok[:, None] & col_ok[None, :]
    q = _load_q(q_ptr, q_rows, cols, q_mask, qk_scale, D, Q_BF16, DOT_BF16)
    lo, hi = _split_keys(n_new, kv_len, first_row, split, ROWS, GROUP, NUM_SPLITS, BLOCK_N)
    m_i = tl.full([ROWS], _NEG_BIG, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    if FOR_LOOP:  # compiled: a for loop, which Triton software-pipelines
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, q_pos, m_i, l_i, acc, start, hi, table, cols, col_ok, kv_head,
                k_codes_ptr, k_scales_ptr, v_codes_ptr, v_scales_ptr,
                KV_HEADS, D, PAGE_SIZE, KIND, SCALE_BLOCK, E8M0, BLOCK_N, DOT_BF16,
                INT8_NO_I2F, INT8_CODES_DOT, FOR_LOOP)
    else:  # the interpreter cannot take tensor range bounds (numpy 2): a while loop
        start = lo
        while start < hi:
            m_i, l_i, acc = _attend_tile(
                q, q_pos, m_i, l_i, acc, start, hi, table, cols, col_ok, kv_head,
                k_codes_ptr, k_scales_ptr, v_codes_ptr, v_scales_ptr,
                KV_HEADS, D, PAGE_SIZE, KIND, SCALE_BLOCK, E8M0, BLOCK_N, DOT_BF16,
                INT8_NO_I2F, INT8_CODES_DOT, FOR_LOOP)
            start += BLOCK_N

    has_keys = l_i > 0.0
    norm = tl.where(has_keys, l_i, 1.0)
    _store_out(acc / norm[:, None], q_rows, split, cols, q_mask, out_ptr, part_out_ptr, D,
               NUM_SPLITS, OUT_BF16)
    _store_lse(m_i, norm, has_keys, q_rows, split, row_ok, part_lse_ptr, NUM_SPLITS)


@triton.jit
def _rounded_as(v, BF16: tl.constexpr):
    """fp32 v rounded to the output's dtype and back: bf16 to nearest even
    on the bits, as _store_dense stores it; fp32 as it is."""
    if BF16:
        return (_bf16_bits(v) << 16).to(tl.float32, bitcast=True)
    else:
        return v


@triton.jit
def _gated(o, gate_ptr, row, cols, col_ok, g_stride_t, g_stride_h, Q_HEADS: tl.constexpr,
           OUT_BF16: tl.constexpr):
    """The stored output times its gate's sigmoid, each rounded to the
    output's dtype: engine/fused's sigmoid_gate's steps over the stored
    output (the gate read in place from the q projection's [query | gate]).
    The two kernels' fp32 sums may round otherwise: an fp32 ulp, rarely a
    bf16 one (tests/test_attention.py)."""
    token, head = row // Q_HEADS, row % Q_HEADS
    g = _load_dense(gate_ptr, token * g_stride_t + head * g_stride_h + cols, col_ok, OUT_BF16)
    sigmoid = _rounded_as(1.0 / (1.0 + tl.exp(-g)), OUT_BF16)
    return _rounded_as(o, OUT_BF16) * sigmoid


@triton.jit(do_not_specialize=("n_rows", "g_stride_t", "g_stride_h"))
def _combine_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, signs_ptr, gate_ptr, n_rows,
                           g_stride_t, g_stride_h,
                           D: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                           SPLITS_PAD: tl.constexpr, OUT_BF16: tl.constexpr,
                           ROTATE_BACK: tl.constexpr, LOG2_D: tl.constexpr,
                           SCALE: tl.constexpr, GATED: tl.constexpr, Q_HEADS: tl.constexpr,
                           PDL: tl.constexpr, RELEASE_FIRST: tl.constexpr):
    """out = sum_s w_s o_s / sum_s w_s with w_s = 2**(lse_s - max lse); with
    ROTATE_BACK (D a power of two) times R.T before the store, the rotated
    formats' way back from the stored space (fwht.rotate_rows: bitwise the
    Hadamard row kernel's, which would otherwise be a launch of its own);
    with GATED, times round(sigmoid(gate)) (_gated), the gated attention's
    output gate, which would otherwise be a launch of its own too."""
    pdl_prologue(PDL, RELEASE_FIRST)
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < NUM_SPLITS
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + splits, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.math.exp2(lse - top)
    cols = tl.arange(0, D_PAD)
    mask = split_ok[:, None] & (cols < D)[None, :]
    parts = tl.load(part_out_ptr + (row * NUM_SPLITS + splits)[:, None] * D + cols[None, :],
                    mask=mask, other=0.0)
    total = tl.sum(weight, axis=0)
    o = tl.sum(parts * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    if ROTATE_BACK:
        signs = tl.load(signs_ptr + cols)[None, :]
        o = tl.reshape(rotate_rows(tl.reshape(o, (1, D_PAD)), signs, 1, D_PAD, LOG2_D, SCALE,
                                   True), (D_PAD,))
    if GATED:
        o = _gated(o, gate_ptr, row, cols, cols < D, g_stride_t, g_stride_h, Q_HEADS, OUT_BF16)
    _store_dense(out_ptr, row * D + cols, o, cols < D, OUT_BF16)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def program_switches(kind: int, head_dim: int) -> dict[str, bool]:
    """The kernel's A/B constexprs, from the environment at launch
    (attention.rk4_pairs, attention.int8_no_i2f): RK4_PAIRS, rk4's program
    on channel pairs, where its pair tiles are as wide as tl.dot's 16;
    INT8_NO_I2F, int8 codes to fp32 by bit tricks (on the dequantized
    tiles); INT8_CODES_DOT, int8 codes as the dots' operands
    (attention.int8_codes_dot). Off for other formats, so they compile one
    variant whatever the switches say."""
    from engine.kv.attention import int8_codes_dot, int8_no_i2f, rk4_pairs

    # all read: a mistyped value fails anywhere
    pairs, no_i2f, codes_dot = rk4_pairs(), int8_no_i2f(), int8_codes_dot()
    return dict(RK4_PAIRS=kind == RK4 and pairs and triton.next_power_of_2(head_dim) >= 32,
                INT8_NO_I2F=kind == INT8 and no_i2f,
                INT8_CODES_DOT=kind == INT8 and codes_dot)


def rotates_q_in_kernel(kind: int, head_dim: int) -> bool:
    """Whether the kernel can rotate q itself: rk4's channel-pair program
    (program_switches) at a power-of-two head_dim."""
    return (kind == RK4 and program_switches(kind, head_dim)["RK4_PAIRS"]
            and triton.next_power_of_2(head_dim) == head_dim)


def launch(kind_args: tuple, q: torch.Tensor, q_offsets: torch.Tensor, kv_lens: torch.Tensor,
           page_table: torch.Tensor, page_size: int, kv_heads: int, max_new_tokens: int,
           softmax_scale: float, out: torch.Tensor, num_splits: int,
           rows: int, block_n: int, num_warps: int | None = None,
           num_stages: int | None = None, dot_bf16: bool = False,
           rotate_back_signs: torch.Tensor | None = None,
           rotate_q_signs: torch.Tensor | None = None,
           output_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Runs the attention kernel (and the split combine when num_splits > 1).
    rotate_back_signs (num_splits > 1 only): the combine multiplies the
    output by R.T = diag(signs) H / sqrt(D) before storing it in out's dtype.
    output_gate (num_splits > 1 only; [T, Hq, D] in out's dtype, unit stride
    along D, e.g. the gate half of the q projection): the combine stores
    round(out) * round(sigmoid(gate)) instead, rounded to out's dtype.
    rotate_q_signs (rk4 on channel pairs only, rotates_q_in_kernel): the
    kernel multiplies q by R = H diag(signs) / sqrt(D) as it loads it.

    kind_args: (KIND, k_codes, k_scales, v_codes, v_scales, SCALE_BLOCK, E8M0), and for
    RK4P also (k_step, k_open, v_open, inv_freq fp32, first staged slot, rotary_dim);
    q, out [T, Hq, D] contiguous; q_offsets [B+1] int32; kv_lens [B] int32;
    page_table [B, P] int32 (rows padded); max_new_tokens bounds the grid.
    Every launch argument is a tensor or a constant, so the call can be
    captured in a CUDA graph for fixed shapes."""
    kind, k_codes, k_scales, v_codes, v_scales, scale_block, e8m0 = kind_args[:7]
    # rk4p: (k_step, k_open, v_open, inv_freq, first staged slot, rotary_dim)
    k_step, k_open, v_open, inv_freq, first_staged, rotary_dim = (
        kind_args[7:] if kind == RK4P else (k_codes, k_codes, k_codes, q, 0, 0))
    tokens, q_heads, head_dim = q.shape
    batch = kv_lens.shape[0]
    group = q_heads // kv_heads
    d_pad = triton.next_power_of_2(head_dim)
    q_arg, q_bf16 = as_kernel_dense(q)
    out_arg, out_bf16 = as_kernel_dense(out)
    if num_splits > 1:
        part_out = torch.empty(tokens, q_heads, num_splits, head_dim, dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty(tokens, q_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out_arg  # unused
    switches = program_switches(kind, head_dim)
    rotate_q = rotate_q_signs is not None
    if rotate_q and not rotates_q_in_kernel(kind, head_dim):
        raise ValueError("only rk4's channel-pair program rotates q, at a power-of-two head_dim")
    grid = (triton.cdiv(max(max_new_tokens, 1) * group, rows), batch * kv_heads, num_splits)
    extra = {} if num_warps is None else {"num_warps": num_warps}
    if num_stages is not None:
        extra["num_stages"] = num_stages
    _paged_attention_kernel[grid](
        q_arg, q_offsets, kv_lens, page_table, page_table.stride(0),
        k_codes, k_scales, v_codes, v_scales, k_step, k_open, v_open, inv_freq, first_staged,
        out_arg, part_out, part_lse, rotate_q_signs if rotate_q else part_lse,
        softmax_scale * LOG2E,
        Q_HEADS=q_heads, KV_HEADS=kv_heads, GROUP=group, D=head_dim, D_PAD=d_pad,
        PAGE_SIZE=page_size, KIND=kind, SCALE_BLOCK=scale_block, E8M0=e8m0,
        ROTARY_DIM=rotary_dim, ROPE_PAD=rope_pad(rotary_dim),
        Q_BF16=q_bf16, OUT_BF16=out_bf16, ROWS=rows, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        FOR_LOOP=not _interpreting(),
        DOT_BF16=(2 if _interpreting() else 1) if dot_bf16 else 0,
        **switches, ROTATE_Q=rotate_q, LOG2_D=d_pad.bit_length() - 1,
        R_SCALE=hadamard_scale(d_pad), **extra, **pdl_launch(q.device))
    if rotate_back_signs is not None and (num_splits == 1 or d_pad != head_dim):
        raise ValueError("the combine rotates back only split outputs of power-of-two heads")
    gated = output_gate is not None
    if gated:
        refusal = gate_refusal(output_gate, out, num_splits)
        if refusal:
            raise ValueError(refusal)
        gate_arg, _ = as_kernel_dense(output_gate)
    if num_splits > 1:
        rotate_back = rotate_back_signs is not None
        _combine_splits_kernel[(tokens * q_heads,)](
            part_out, part_lse, out_arg, rotate_back_signs if rotate_back else part_lse,
            gate_arg if gated else part_lse, tokens * q_heads,
            output_gate.stride(0) if gated else 0, output_gate.stride(1) if gated else 0,
            D=head_dim, D_PAD=d_pad, NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits), OUT_BF16=out_bf16,
            ROTATE_BACK=rotate_back, LOG2_D=d_pad.bit_length() - 1,
            SCALE=hadamard_scale(d_pad), GATED=gated, Q_HEADS=q_heads,
            **release_first_launch(q.device))
    return out


def gate_refusal(gate: torch.Tensor, out: torch.Tensor, num_splits: int) -> str:
    """Why launch's combine cannot apply this output gate ("" when it can)."""
    if num_splits == 1:
        return "the output gate is applied by the split combine: num_splits > 1"
    if gate.shape != out.shape or gate.dtype != out.dtype or gate.stride(-1) != 1:
        return (f"the output gate must be {tuple(out.shape)} {out.dtype} with unit stride "
                f"along the head, got {tuple(gate.shape)} {gate.dtype} strides {gate.stride()}")
    return ""


# Key splits at most: a long context's short batches (decode, verify, a
# prefill's tail) all take this many, one compiled variant.
MAX_SPLITS = 64


def splits_for(batch: int, kv_heads: int, max_kv_len: int, block_n: int,
               programs_wanted: int) -> int:
    """Key splits for `batch` row blocks (a decode batch: one per sequence):
    enough programs to fill the GPU, never more splits than key tiles, a
    power of two (few distinct compilations)."""
    tiles = max(1, math.ceil(max_kv_len / block_n))
    splits = max(1, math.ceil(programs_wanted / max(1, batch * kv_heads)))
    splits = 1 << (min(splits, tiles, MAX_SPLITS) - 1).bit_length()
    return min(splits, MAX_SPLITS)


# ------------------------------------------- rk4p pages into a dense workspace

@triton.jit(do_not_specialize=("n_keys", "first_staged"))
def _rk4p_dense_kernel(table, k_codes_ptr, k_min_ptr, k_step_ptr, k_open_ptr,
                       v_codes_ptr, v_scales_ptr, v_open_ptr, inv_freq_ptr,
                       k_out_ptr, v_out_ptr, n_keys, first_staged,
                       KV_HEADS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                       PAGE_SIZE: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                       ROTARY_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                       COMPILED: tl.constexpr):
    """BLOCK_N keys of one KV head from rk4p pages (or staging pages) into
    bf16 rows [key, kv_head, D]: K with RoPE applied at the key's position,
    V as stored (rotated; the caller un-rotates the attention output). Each
    rotary pair p is roped with its partner p +- ROTARY_DIM / 4 (rotate-half),
    loaded as a second pair tile; the other pairs get angle 0, which _sin_cos
    maps to exactly (0, 1)."""
    start = tl.program_id(0) * BLOCK_N
    kv_head = tl.program_id(1)
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = keys < n_keys
    ONE_PAGE: tl.constexpr = PAGE_SIZE % BLOCK_N == 0
    page, slot, staged = _rk4p_tile_pages(table, start, keys, key_ok, first_staged, PAGE_SIZE,
                                          ONE_PAGE)
    pairs = tl.arange(0, D_PAD // 2)
    pairs_ok = pairs < D // 2
    k_even, k_odd = _load_rk4p_pairs(k_codes_ptr, k_min_ptr, k_step_ptr, k_open_ptr, page,
                                     slot, staged, first_staged, kv_head, pairs, key_ok,
                                     pairs_ok, KV_HEADS, D, 0, 0, True, ONE_PAGE, COMPILED)
    if ROTARY_DIM > 0:
        quarter: tl.constexpr = ROTARY_DIM // 4  # channel pairs per rotary half
        first_half = pairs < quarter
        rotary = pairs < 2 * quarter
        partner = tl.where(first_half, pairs + quarter, tl.where(rotary, pairs - quarter, pairs))
        p_even, p_odd = _load_rk4p_pairs(k_codes_ptr, k_min_ptr, k_step_ptr, k_open_ptr, page,
                                         slot, staged, first_staged, kv_head, partner, key_ok,
                                         rotary, KV_HEADS, D, 0, 0, True, ONE_PAGE, COMPILED)
        freq_at = tl.where(first_half, pairs, pairs - quarter)
        freq_even = tl.load(inv_freq_ptr + 2 * freq_at, mask=rotary, other=0.0)
        freq_odd = tl.load(inv_freq_ptr + 2 * freq_at + 1, mask=rotary, other=0.0)
        position = tl.broadcast_to(keys.to(tl.float32)[:, None], k_even.shape)
        sin_e, cos_e = _sin_cos(_mul_rn(position, tl.broadcast_to(freq_even[None, :],
                                                                  position.shape), COMPILED))
        sin_o, cos_o = _sin_cos(_mul_rn(position, tl.broadcast_to(freq_odd[None, :],
                                                                  position.shape), COMPILED))
        # first half: k1 c - k2 s; second half: k2 c + k1 s
        sign = tl.where(first_half, -1.0, 1.0)[None, :]
        k_even = k_even * cos_e + sign * p_even * sin_e
        k_odd = k_odd * cos_o + sign * p_odd * sin_o
    v_even, v_odd = _load_rk4p_pairs(v_codes_ptr, v_scales_ptr, v_scales_ptr, v_open_ptr, page,
                                     slot, staged, first_staged, kv_head, pairs, key_ok, pairs_ok,
                                     KV_HEADS, D, D_PAD, SCALE_BLOCK, False, ONE_PAGE, COMPILED)
    # pairs interleaved in registers, so each row is one contiguous store
    cols = tl.arange(0, D_PAD)
    at = (keys.to(tl.int64) * KV_HEADS + kv_head)[:, None] * D + cols[None, :]
    mask = key_ok[:, None] & (cols < D)[None, :]
    _store_dense(k_out_ptr, at, tl.reshape(tl.join(k_even, k_odd), (BLOCK_N, D_PAD)), mask, True)
    _store_dense(v_out_ptr, at, tl.reshape(tl.join(v_even, v_odd), (BLOCK_N, D_PAD)), mask, True)


# sm_90 build at the 27B's shape (head_dim 256, 64 rotary channels, 32-token
# pages; static, 2026-12-02): 16 keys and 4 warps take 168 registers and no
# stack; 32 keys spill (255 registers, 123 STL) unless given 8 warps.
RK4P_DENSE_KEYS, RK4P_DENSE_WARPS = 16, 4


def rk4p_dense(kind_args: tuple, pages: torch.Tensor, kv_len: int, k_out: torch.Tensor,
               v_out: torch.Tensor, page_size: int) -> None:
    """A sequence's first kv_len keys and values from rk4p pages into bf16
    k_out / v_out [kv_len, KV_HEADS, D] (contiguous): K roped, V rotated.
    kind_args: attention._kind_args's tuple for the format; pages: the
    sequence's page table (int32)."""
    _, k_codes, k_min, v_codes, v_scales, scale_block, _ = kind_args[:7]
    k_step, k_open, v_open, inv_freq, first_staged, rotary_dim = kind_args[7:]
    if kv_len == 0:
        return
    kv_heads, head_dim = k_out.shape[1:]
    k_arg, _ = as_kernel_dense(k_out)
    v_arg, _ = as_kernel_dense(v_out)
    if k_out.dtype != torch.bfloat16 or v_out.dtype != torch.bfloat16 or \
            not (k_out.is_contiguous() and v_out.is_contiguous()):
        raise ValueError("rk4p_dense writes contiguous bf16 outputs")
    _rk4p_dense_kernel[(triton.cdiv(kv_len, RK4P_DENSE_KEYS), kv_heads)](
        pages.to(torch.int32).contiguous(), k_codes, k_min, k_step, k_open, v_codes, v_scales,
        v_open, inv_freq, k_arg, v_arg, kv_len, first_staged,
        KV_HEADS=kv_heads, D=head_dim, D_PAD=triton.next_power_of_2(head_dim),
        PAGE_SIZE=page_size, SCALE_BLOCK=scale_block, ROTARY_DIM=rotary_dim,
        BLOCK_N=RK4P_DENSE_KEYS, COMPILED=not _interpreting(), num_warps=RK4P_DENSE_WARPS)
