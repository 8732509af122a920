"""The decode GEMV over QuantTensor's packed layout: y[M, N] = x[M, K] @ w.T
for M <= GEMV_MAX_ROWS, built to stream the packed weight at memory speed.

Why it is shaped this way (Hopper, batch-1 decode is purely bandwidth bound):
  * the codes are read as int32 words (8 nibbles or 4 bytes; the uint8/int8
    storage viewed as int32, no repacking): word w of a row holds
    k = 8w..8w+7 (4-bit) or 4w..4w+3 (8-bit) in bit order. A program's tile
    is [BLOCK_N, groups, words per group], each thread owning one group's
    words as one 16-byte load;
  * a code becomes fp32 without a shift or an I2F (I2F runs at 1/8 of the FP
    rate): masking the code in place and OR-ing the exponent of 2**23 gives
    the float 2**23 + code * 16**pos exactly; one FADD removes 2**23. The
    16**pos (4-bit) or 256**pos (8-bit) factor is divided out once per group
    by keeping one partial sum per in-word position;
  * per group the kernel sums code * x over the group and applies the
    two-level scale once, s * dot(q, x) - b * sum(x) (s = d*sc, b = dmin*m),
    so the inner loop costs a mask, a subtract and an FMA per weight and row;
  * every row of the batch is multiplied against the same loaded tile;
  * the grid is cdiv(N, BLOCK_N) x SPLIT_K programs; split-K partial sums are
    fp32 and one small second kernel adds them, casts and adds the bias.
A config with int8_x (one row, 4-bit codes in groups of 32) quantizes the
activation to int8 per group instead and multiplies with DP4A
(`_gemv_x8_program`): on the H200 it beat the float kernel on every one-row
Q4_K shape of the 27B (1.3-2.2x, 2026-12-02), so TUNED and the heuristic pick
it there; TANDEM_GEMV_INT8_X=0 turns it off (=1 forces it). A DP4A config
with stream_k launches it as stream-K instead of split-K (equal runs of
(block, K tile) units per program; `_gemv_x8_stream_kernel`), an
experiment that only a sweep picks.
On a GPU with NVRTC, gemv() hands one contiguous bf16 row without bias to
the CUDA C++ version of the DP4A kernel instead (engine/quant/gemv_cuda.py,
q4_gemv.cu: same numerics, faster on every 27B shape, 2026-12-04);
TANDEM_GEMV_CUDA=0 keeps it here, and a config or block override given to
gemv() always runs these Triton kernels.
Configs (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) come from
engine/quant/gemv_configs.py: TUNED (filled from `python -m bench.quant
--sweep` on the H200), a sweep's JSON named by TANDEM_GEMV_TUNED, or a
heuristic.
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch
import triton
import triton.language as tl

from engine.gpu_facts import multiprocessors
from engine.pdl import pdl_launch, pdl_prologue
from engine.quant import gemv_cuda
from engine.quant.gemv_configs import GemvConfig, pick_config
from engine.quant.tensor import QuantTensor
from engine.switches import on_off

GEMV_MAX_ROWS = 8
FP32_TWO_23 = tl.constexpr(8388608.0)
MAGIC_BITS = tl.constexpr(0x4B000000)  # the fp32 bit pattern of 2**23


# ------------------------------------------------------------------ kernels


@triton.jit
def _mask_or(src, MASK: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """(src & MASK) | MAGIC (4-bit) or (src & MASK) ^ MAGIC (8-bit; MAGIC
    carries the sign flip), as one LOP3 (ptxas emits two for the plain ops)."""
    if BITS == 4:
        MAGIC: tl.constexpr = MAGIC_BITS
    else:
        MAGIC: tl.constexpr = MAGIC_BITS | (MASK & 0x80808080)
    if ASM:
        if BITS == 4:   # lut 0xEA: (a & b) | c
            return tl.inline_asm_elementwise(
                "lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,n,n", [src, MASK, MAGIC],
                dtype=tl.int32, is_pure=True, pack=1)
        else:           # lut 0x6A: (a & b) ^ c
            return tl.inline_asm_elementwise(
                "lop3.b32 $0, $1, $2, $3, 0x6A;", "=r,r,n,n", [src, MASK, MAGIC],
                dtype=tl.int32, is_pure=True, pack=1)
    elif BITS == 4:
        return (src & MASK) | MAGIC
    else:
        return (src & MASK) ^ MAGIC


@triton.jit
def _code_float(words, words_hi, P: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """The code in slot P of each int32 word as fp32 times 16**(P%4) (4-bit,
    unsigned) or 256**(P%2) (8-bit, signed), exact. Slots in the upper half
    come from words_hi = words >> 16, so every slot is masked in place."""
    if BITS == 4:
        POS: tl.constexpr = P % 4
        src = words if P < 4 else words_hi
        bits = _mask_or(src, 0xF << (4 * POS), BITS, ASM)
        return bits.to(tl.float32, bitcast=True) - FP32_TWO_23
    else:
        POS: tl.constexpr = P % 2
        src = words if P < 2 else words_hi
        # XOR 0x80 turns a two's complement byte into code + 128
        bits = _mask_or(src, 0xFF << (8 * POS), BITS, ASM)
        return bits.to(tl.float32, bitcast=True) - (FP32_TWO_23 + 128.0 * (256 ** POS))


@triton.jit
def _row_dot(x_row, q0, q1, q2, q3, q4, q5, q6, q7, xoff, xmask, EVEN: tl.constexpr,
             BITS: tl.constexpr):
    """One activation row against the tile's codes [BN, BW] (words): per word,
    (sum of code * x [BN, BW], sum of x [BW]). x of slot P sits at xoff + P."""
    if EVEN:
        x0 = tl.load(x_row + xoff).to(tl.float32)
        x1 = tl.load(x_row + xoff + 1).to(tl.float32)
        x2 = tl.load(x_row + xoff + 2).to(tl.float32)
        x3 = tl.load(x_row + xoff + 3).to(tl.float32)
    else:
        x0 = tl.load(x_row + xoff, mask=xmask, other=0.0).to(tl.float32)
        x1 = tl.load(x_row + xoff + 1, mask=xmask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + xoff + 2, mask=xmask, other=0.0).to(tl.float32)
        x3 = tl.load(x_row + xoff + 3, mask=xmask, other=0.0).to(tl.float32)
    if BITS == 4:
        if EVEN:
            x4 = tl.load(x_row + xoff + 4).to(tl.float32)
            x5 = tl.load(x_row + xoff + 5).to(tl.float32)
            x6 = tl.load(x_row + xoff + 6).to(tl.float32)
            x7 = tl.load(x_row + xoff + 7).to(tl.float32)
        else:
            x4 = tl.load(x_row + xoff + 4, mask=xmask, other=0.0).to(tl.float32)
            x5 = tl.load(x_row + xoff + 5, mask=xmask, other=0.0).to(tl.float32)
            x6 = tl.load(x_row + xoff + 6, mask=xmask, other=0.0).to(tl.float32)
            x7 = tl.load(x_row + xoff + 7, mask=xmask, other=0.0).to(tl.float32)
        xs = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7
        # x is divided by the power of two its slot's code carries (exact, and
        # shared by the rows of the tile), so one FMA chain per word remains
        t = q0 * x0[None, :]
        t += q1 * (x1 * (1.0 / 16))[None, :]
        t += q2 * (x2 * (1.0 / 256))[None, :]
        t += q3 * (x3 * (1.0 / 4096))[None, :]
        t += q4 * x4[None, :]
        t += q5 * (x5 * (1.0 / 16))[None, :]
        t += q6 * (x6 * (1.0 / 256))[None, :]
        t += q7 * (x7 * (1.0 / 4096))[None, :]
    else:
        xs = x0 + x1 + x2 + x3
        t = q0 * x0[None, :]
        t += q1 * (x1 * (1.0 / 256))[None, :]
        t += q2 * x2[None, :]
        t += q3 * (x3 * (1.0 / 256))[None, :]
    return t, xs


@triton.jit
def _gemv_kernel(x_ptr, qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, out_ptr, bias_ptr,
                 M, N, stride_xm, stride_os, stride_om, ROW_WORDS, GROUPS, SUPERS, TILES,
                 BITS: tl.constexpr, G: tl.constexpr, S: tl.constexpr,
                 ASYM: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr,
                 PDL: tl.constexpr):
    """ROW_WORDS = K / codes per word, GROUPS = K / G, SUPERS = K / S are
    passed (not derived from K) so Triton sees their divisibility by 16, which
    is what lets it issue 16-byte loads; TILES is BLOCK_K steps per split."""
    pdl_prologue(PDL)
    _gemv_program(x_ptr, qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, out_ptr, bias_ptr,
                  M, N, stride_xm, stride_os, stride_om, ROW_WORDS, GROUPS, SUPERS, TILES,
                  BITS, G, S, ASYM, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, EVEN, ASM, PREFETCH)


@triton.jit
def _gemv_kernel_interpreted(x_ptr, qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, out_ptr, bias_ptr,
                             M, N, stride_xm, stride_os, stride_om, ROW_WORDS, GROUPS, SUPERS,
                             TILES: tl.constexpr,
                             BITS: tl.constexpr, G: tl.constexpr, S: tl.constexpr,
                             ASYM: tl.constexpr, HAS_BIAS: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr,
                             PREFETCH: tl.constexpr, PDL: tl.constexpr):
    """The same with a constant TILES: the interpreter cannot loop over a runtime count."""
    pdl_prologue(PDL)
    _gemv_program(x_ptr, qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, out_ptr, bias_ptr,
                  M, N, stride_xm, stride_os, stride_om, ROW_WORDS, GROUPS, SUPERS, TILES,
                  BITS, G, S, ASYM, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, EVEN, ASM, PREFETCH)


@triton.jit
def _tile_loads(qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, w_row, n_safe, tile_id, valid,
                ROW_WORDS, GROUPS, SUPERS, G: tl.constexpr, S: tl.constexpr,
                NG: tl.constexpr, BW: tl.constexpr, ASYM: tl.constexpr,
                UNMASKED: tl.constexpr):
    """Tile `tile_id`'s raw words [BN, BW] and d, sc (dmin, m) [BN, NG];
    nothing is read where `valid` is false or past K. UNMASKED: the caller
    knows every load is in range."""
    g_ids = tile_id * NG + tl.arange(0, NG)
    w_ids = tile_id * BW + tl.arange(0, BW)
    g_off = n_safe[:, None] * GROUPS + g_ids[None, :]
    s_off = n_safe[:, None] * SUPERS + (g_ids // (S // G))[None, :]
    if UNMASKED:
        words = tl.load(w_row + w_ids[None, :])
        d = tl.load(d_ptr + s_off)
        sc = tl.load(sc_ptr + g_off)
        if ASYM:
            dmin = tl.load(dmin_ptr + s_off)
            m = tl.load(m_ptr + g_off)
        else:
            dmin = d
            m = sc
    else:
        w_ok = (w_ids < ROW_WORDS) & valid
        g_ok = ((g_ids < GROUPS) & valid)[None, :]
        words = tl.load(w_row + w_ids[None, :], mask=w_ok[None, :], other=0)
        d = tl.load(d_ptr + s_off, mask=g_ok, other=0.0)
        sc = tl.load(sc_ptr + g_off, mask=g_ok, other=0)
        if ASYM:
            dmin = tl.load(dmin_ptr + s_off, mask=g_ok, other=0.0)
            m = tl.load(m_ptr + g_off, mask=g_ok, other=0)
        else:
            dmin = d
            m = sc
    return words, d, sc, dmin, m


@triton.jit
def _gemv_program(x_ptr, qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, out_ptr, bias_ptr,
                  M, N, stride_xm, stride_os, stride_om, ROW_WORDS, GROUPS, SUPERS, TILES,
                  BITS: tl.constexpr, G: tl.constexpr, S: tl.constexpr,
                  ASYM: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  EVEN: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    CPW: tl.constexpr = 32 // BITS          # codes per int32 word
    WPG: tl.constexpr = G // CPW            # words per group
    NG: tl.constexpr = BLOCK_K // G         # groups per tile

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    n_safe = tl.minimum(offs_n, N - 1)      # rows past N re-read row N-1: no load masks
    rows = tl.arange(0, BLOCK_M)
    BW: tl.constexpr = BLOCK_K // CPW       # words per tile row
    wi = tl.arange(0, BW)

    w_row = qw_ptr + n_safe[:, None] * ROW_WORDS
    acc = tl.zeros([BLOCK_M, BLOCK_N, NG], dtype=tl.float32)
    first = pid_k * TILES
    # PREFETCH: the next tile's words and scales are loaded before this
    # tile's arithmetic, so their DRAM latency hides behind it (the launch's
    # num_stages does not pipeline loads that feed no tl.dot); it costs
    # their registers
    if PREFETCH:
        w_nx, d_nx, sc_nx, dmin_nx, m_nx = _tile_loads(
            qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, w_row, n_safe, first, TILES > 0,
            ROW_WORDS, GROUPS, SUPERS, G, S, NG, BW, ASYM, False)
    for tile in range(0, TILES):
        tile_id = first + tile
        w_ids = tile_id * BW + wi                                # [BW]
        w_ok = w_ids < ROW_WORDS
        if PREFETCH:
            words, d, sc, dmin, m = w_nx, d_nx, sc_nx, dmin_nx, m_nx
            w_nx, d_nx, sc_nx, dmin_nx, m_nx = _tile_loads(
                qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, w_row, n_safe, tile_id + 1,
                tile + 1 < TILES, ROW_WORDS, GROUPS, SUPERS, G, S, NG, BW, ASYM, False)
        else:
            words, d, sc, dmin, m = _tile_loads(
                qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, w_row, n_safe, tile_id, True,
                ROW_WORDS, GROUPS, SUPERS, G, S, NG, BW, ASYM, EVEN)
        words_hi = words >> 16
        q0 = _code_float(words, words_hi, 0, BITS, ASM)
        q1 = _code_float(words, words_hi, 1, BITS, ASM)
        q2 = _code_float(words, words_hi, 2, BITS, ASM)
        q3 = _code_float(words, words_hi, 3, BITS, ASM)
        if BITS == 4:
            q4 = _code_float(words, words_hi, 4, BITS, ASM)
            q5 = _code_float(words, words_hi, 5, BITS, ASM)
            q6 = _code_float(words, words_hi, 6, BITS, ASM)
            q7 = _code_float(words, words_hi, 7, BITS, ASM)
        else:
            q4 = q0
            q5 = q1
            q6 = q2
            q7 = q3
        # the two-level scales of the tile's [BLOCK_N, NG] groups, once per group
        scale = d.to(tl.float32) * sc.to(tl.float32)
        if ASYM:
            minimum = dmin.to(tl.float32) * m.to(tl.float32)
        for r in tl.static_range(BLOCK_M):
            t, xs = _row_dot(x_ptr + r * stride_xm, q0, q1, q2, q3, q4, q5, q6, q7,
                             w_ids * CPW, w_ok & (r < M), EVEN and BLOCK_M == 1, BITS)
            qx = tl.sum(tl.reshape(t, [BLOCK_N, NG, WPG]), axis=2)          # [BN, NG]
            part = qx * scale
            if ASYM:
                part -= minimum * tl.sum(tl.reshape(xs, [NG, WPG]), axis=1)[None, :]
            if BLOCK_M == 1:
                acc += part[None, :, :]
            else:
                acc = tl.where((rows == r)[:, None, None], acc + part[None, :, :], acc)
    y = tl.sum(acc, axis=2)                                      # [BM, BN]
    out_mask = (rows < M)[:, None] & n_ok[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + pid_k * stride_os + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _slot_dot(acc, x_row, xmask, words, words_hi, s_pos, minimum_w, P: tl.constexpr,
              BITS: tl.constexpr, ASM: tl.constexpr, IEEE: tl.constexpr):
    """acc [16, BN] += x[:, slot P of each word] @ dequant(slot P codes).T on
    tensor cores; s_pos is the group scale divided by the slot's power of 16.
    IEEE (fp32 x, or the interpreter, whose bf16 dot is wrong): fp32 operands."""
    q = _code_float(words, words_hi, P, BITS, ASM)
    w = q * s_pos - minimum_w
    x = tl.load(x_row + P, mask=xmask, other=0.0)
    if IEEE:
        return tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    else:
        return tl.dot(x, tl.trans(w.to(x.dtype)), acc)


@triton.jit
def _gemv_dot_program(x_ptr, qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, out_ptr, bias_ptr,
                      M, N, stride_xm, stride_os, stride_om, ROW_WORDS, GROUPS, SUPERS, TILES,
                      BITS: tl.constexpr, G: tl.constexpr, S: tl.constexpr,
                      ASYM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, ASM: tl.constexpr, IEEE: tl.constexpr):
    """Rows 2..8 on tensor cores: the rows padded to 16, each slot of the
    tile's words dequantized to x's dtype (one LOP3, FADD, FFMA per weight,
    whatever the row count) and multiplied by that slot's x columns."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    CPW: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = G // CPW
    NG: tl.constexpr = BLOCK_K // G
    BW: tl.constexpr = BLOCK_K // CPW
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    n_safe = tl.minimum(offs_n, N - 1)
    rows = tl.arange(0, 16)
    gi = tl.arange(0, NG)
    wi = tl.arange(0, BW)
    w_row = qw_ptr + n_safe[:, None] * ROW_WORDS
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for tile in range(0, TILES):
        tile_id = pid_k * TILES + tile
        g_ids = tile_id * NG + gi
        g_ok = g_ids < GROUPS
        w_ids = tile_id * BW + wi
        w_ok = w_ids < ROW_WORDS
        words = tl.load(w_row + w_ids[None, :], mask=w_ok[None, :], other=0)
        words_hi = words >> 16
        g_off = n_safe[:, None] * GROUPS + g_ids[None, :]
        s_off = n_safe[:, None] * SUPERS + (g_ids // (S // G))[None, :]
        scale = tl.load(d_ptr + s_off, mask=g_ok[None, :], other=0.0).to(tl.float32) * \
            tl.load(sc_ptr + g_off, mask=g_ok[None, :], other=0).to(tl.float32)
        # per word: its group's scale [BN, BW]
        s_w = tl.reshape(tl.broadcast_to(scale[:, :, None], [BLOCK_N, NG, WPG]),
                         [BLOCK_N, BW])
        if ASYM:
            minimum = tl.load(dmin_ptr + s_off, mask=g_ok[None, :], other=0.0
                              ).to(tl.float32) * \
                tl.load(m_ptr + g_off, mask=g_ok[None, :], other=0).to(tl.float32)
            m_w = tl.reshape(tl.broadcast_to(minimum[:, :, None], [BLOCK_N, NG, WPG]),
                             [BLOCK_N, BW])
        else:
            m_w = s_w * 0.0
        x_row = x_ptr + rows[:, None] * stride_xm + w_ids[None, :] * CPW
        xmask = (rows < M)[:, None] & w_ok[None, :]
        if BITS == 4:
            s1 = s_w * (1.0 / 16)
            s2 = s_w * (1.0 / 256)
            s3 = s_w * (1.0 / 4096)
            acc = _slot_dot(acc, x_row, xmask, words, words_hi, s_w, m_w, 0, BITS, ASM,
                            IEEE)
            acc = _slot_dot(acc, x_row, xmask, words, words_hi, s1, m_w, 1, BITS, ASM,
                            IEEE)
            acc = _slot_dot(acc, x_row, xmask, words, words_hi, s2, m_w, 2, BITS, ASM,
                            IEEE)
            acc = _slot_dot(acc, x_row, xmask, words, words_hi, s3, m_w, 3, BITS, ASM,
                            IEEE)
            acc = _slot_dot(acc, x_row, xmask, words, words_hi, s_w, m_w, 4, BITS, ASM,
                            IEEE)
            acc = _slot_dot(acc, x_row, xmask, words, words_hi, s1, m_w, 5, BITS, ASM,
                            IEEE)
            acc = _slot_dot(acc, x_row, xmask, words, words_hi, s2, m_w, 6, BITS, ASM,
                            IEEE)
            acc = _slot_dot(acc, x_row, xmask, words, words_hi, s3, m_w, 7, BITS, ASM,
                            IEEE)
        else:
            s1 = s_w * (1.0 / 256)
            acc = _slot_dot(acc, x_row, xmask, words, words_hi, s_w, m_w, 0, BITS, ASM,
                            IEEE)
            acc = _slot_dot(acc, x_row, xmask, words, words_hi, s1, m_w, 1, BITS, ASM,
                            IEEE)
            acc = _slot_dot(acc, x_row, xmask, words, words_hi, s_w, m_w, 2, BITS, ASM,
                            IEEE)
            acc = _slot_dot(acc, x_row, xmask, words, words_hi, s1, m_w, 3, BITS, ASM,
                            IEEE)
    out_mask = (rows < M)[:, None] & n_ok[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + pid_k * stride_os + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _gemv_dot_kernel(x_ptr, qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, out_ptr, bias_ptr,
                     M, N, stride_xm, stride_os, stride_om, ROW_WORDS, GROUPS, SUPERS, TILES,
                     BITS: tl.constexpr, G: tl.constexpr, S: tl.constexpr,
                     ASYM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, ASM: tl.constexpr, IEEE: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_prologue(PDL)
    _gemv_dot_program(x_ptr, qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, out_ptr, bias_ptr,
                      M, N, stride_xm, stride_os, stride_om, ROW_WORDS, GROUPS, SUPERS, TILES,
                      BITS, G, S, ASYM, HAS_BIAS, BLOCK_N, BLOCK_K, ASM, IEEE)


@triton.jit
def _gemv_dot_kernel_interpreted(x_ptr, qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, out_ptr,
                                 bias_ptr, M, N, stride_xm, stride_os, stride_om, ROW_WORDS,
                                 GROUPS, SUPERS, TILES: tl.constexpr,
                                 BITS: tl.constexpr, G: tl.constexpr, S: tl.constexpr,
                                 ASYM: tl.constexpr, HAS_BIAS: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 ASM: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    _gemv_dot_program(x_ptr, qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, out_ptr, bias_ptr,
                      M, N, stride_xm, stride_os, stride_om, ROW_WORDS, GROUPS, SUPERS, TILES,
                      BITS, G, S, ASYM, HAS_BIAS, BLOCK_N, BLOCK_K, ASM, IEEE)


# ------------------------------------------------- int8 activations (dp4a)


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    """c + sum over the four bytes of a (unsigned) times those of b (signed),
    in int32: one DP4A on the GPU, byte by byte in the interpreter."""
    if ASM:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        total = c
        for i in tl.static_range(4):
            total += ((a >> (8 * i)) & 0xFF) * ((b << (24 - 8 * i)) >> 24)
        return total


@triton.jit
def _pack_bytes(b0, b1, b2, b3):
    """Four int32 values in -128..127 as the bytes of one int32, b0 lowest."""
    return (b0 & 0xFF) | ((b1 & 0xFF) << 8) | ((b2 & 0xFF) << 16) | (b3 << 24)


@triton.jit
def _int8_code(x, inv_scale):
    """floor(x / scale + 0.5) clamped to the symmetric int8 range, as int32."""
    return tl.minimum(tl.maximum(tl.floor(x * inv_scale + 0.5), -127.0), 127.0).to(tl.int32)


@triton.jit
def _quantize_x(x_ptr, xoff, xmask, NG: tl.constexpr, WPG: tl.constexpr):
    """The activation slice of a tile as int8 codes, one scale per weight
    group: per word w (8 K-elements), the codes of its even elements packed
    in one int32 and those of its odd elements in another (the order of the
    word's low and high nibbles); per group the scale amax / 127 and the sum
    of its codes. Codes are floor(x * 127 / amax + 0.5)."""
    x0 = tl.load(x_ptr + xoff, mask=xmask, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + xoff + 1, mask=xmask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + xoff + 2, mask=xmask, other=0.0).to(tl.float32)
    x3 = tl.load(x_ptr + xoff + 3, mask=xmask, other=0.0).to(tl.float32)
    x4 = tl.load(x_ptr + xoff + 4, mask=xmask, other=0.0).to(tl.float32)
    x5 = tl.load(x_ptr + xoff + 5, mask=xmask, other=0.0).to(tl.float32)
    x6 = tl.load(x_ptr + xoff + 6, mask=xmask, other=0.0).to(tl.float32)
    x7 = tl.load(x_ptr + xoff + 7, mask=xmask, other=0.0).to(tl.float32)
    word_max = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)),
                                     tl.maximum(tl.abs(x2), tl.abs(x3))),
                          tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)),
                                     tl.maximum(tl.abs(x6), tl.abs(x7))))
    amax = tl.max(tl.reshape(word_max, [NG, WPG]), axis=1)                    # [NG]
    inv = tl.where(amax > 0.0, 127.0 / tl.where(amax > 0.0, amax, 1.0), 0.0)
    inv_w = tl.reshape(tl.broadcast_to(inv[:, None], [NG, WPG]), [NG * WPG])   # [BW]
    q0 = _int8_code(x0, inv_w)
    q1 = _int8_code(x1, inv_w)
    q2 = _int8_code(x2, inv_w)
    q3 = _int8_code(x3, inv_w)
    q4 = _int8_code(x4, inv_w)
    q5 = _int8_code(x5, inv_w)
    q6 = _int8_code(x6, inv_w)
    q7 = _int8_code(x7, inv_w)
    even = _pack_bytes(q0, q2, q4, q6)
    odd = _pack_bytes(q1, q3, q5, q7)
    word_sum = q0 + q1 + q2 + q3 + q4 + q5 + q6 + q7
    code_sum = tl.sum(tl.reshape(word_sum, [NG, WPG]), axis=1)               # [NG]
    return even, odd, amax * (1.0 / 127.0), code_sum


@triton.jit
def _x8_tile(x_ptr, words, d, sc, dmin, m, w_ids, w_ok, BLOCK_N: tl.constexpr,
             NG: tl.constexpr, WPG: tl.constexpr, ASYM: tl.constexpr, ASM: tl.constexpr):
    """One tile's per-group partial sums [BN, NG] from its loaded weights and
    the activation slice it quantizes."""
    even, odd, x_scale, code_sum = _quantize_x(x_ptr, w_ids * 8, w_ok, NG, WPG)
    low = words & 0x0F0F0F0F
    high = (words >> 4) & 0x0F0F0F0F
    dot = _dp4a(high, odd[None, :], _dp4a(low, even[None, :], 0, ASM), ASM)   # [BN, BW]
    group_dot = tl.sum(tl.reshape(dot, [BLOCK_N, NG, WPG]), axis=2)           # [BN, NG]
    part = group_dot.to(tl.float32) * (d.to(tl.float32) * sc.to(tl.float32)) \
        * x_scale[None, :]
    if ASYM:
        part -= dmin.to(tl.float32) * m.to(tl.float32) \
            * (code_sum.to(tl.float32) * x_scale)[None, :]
    return part


@triton.jit
def _x8_tiles(acc, x_ptr, qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, w_row, n_safe, wi, pid_k,
              FIRST: tl.constexpr, ROW_WORDS, GROUPS, SUPERS, TILES, G: tl.constexpr,
              S: tl.constexpr, NG: tl.constexpr, BW: tl.constexpr, WPG: tl.constexpr,
              BLOCK_N: tl.constexpr, ASYM: tl.constexpr, ASM: tl.constexpr):
    """acc plus the split's tiles FIRST.. (loads, then the tile's sums)."""
    for tile in range(FIRST, TILES):
        tile_id = pid_k * TILES + tile
        w_ids = tile_id * BW + wi
        words, d, sc, dmin, m = _tile_loads(
            qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, w_row, n_safe, tile_id, True,
            ROW_WORDS, GROUPS, SUPERS, G, S, NG, BW, ASYM, False)
        acc += _x8_tile(x_ptr, words, d, sc, dmin, m, w_ids, w_ids < ROW_WORDS, BLOCK_N, NG,
                        WPG, ASYM, ASM)
    return acc


@triton.jit
def _x8_tiles_prefetched(acc, x_ptr, qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, w_row, n_safe, wi,
                         pid_k, ROW_WORDS, GROUPS, SUPERS, TILES, G: tl.constexpr,
                         S: tl.constexpr, NG: tl.constexpr, BW: tl.constexpr, WPG: tl.constexpr,
                         BLOCK_N: tl.constexpr, ASYM: tl.constexpr, ASM: tl.constexpr,
                         PDL: tl.constexpr, EARLY: tl.constexpr):
    """acc plus the split's tiles, each tile's loads issued one tile ahead
    (the one past the last masked off); with EARLY the first before the
    dependent-launch wait (weights are never written by a kernel)."""
    if not EARLY:
        pdl_prologue(PDL)
    first = pid_k * TILES
    w_nx, d_nx, sc_nx, dmin_nx, m_nx = _tile_loads(
        qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, w_row, n_safe, first, TILES > 0,
        ROW_WORDS, GROUPS, SUPERS, G, S, NG, BW, ASYM, False)
    if EARLY:
        pdl_prologue(PDL)
    for tile in range(0, TILES):
        tile_id = first + tile
        words, d, sc, dmin, m = w_nx, d_nx, sc_nx, dmin_nx, m_nx
        w_nx, d_nx, sc_nx, dmin_nx, m_nx = _tile_loads(
            qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, w_row, n_safe, tile_id + 1,
            tile + 1 < TILES, ROW_WORDS, GROUPS, SUPERS, G, S, NG, BW, ASYM, False)
        w_ids = tile_id * BW + wi
        acc += _x8_tile(x_ptr, words, d, sc, dmin, m, w_ids, w_ids < ROW_WORDS, BLOCK_N, NG,
                        WPG, ASYM, ASM)
    return acc


@triton.jit
def _gemv_x8_program(x_ptr, qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, out_ptr, bias_ptr,
                     final_ptr, counter_ptr, N, stride_os, ROW_WORDS, GROUPS, SUPERS, TILES,
                     G: tl.constexpr, S: tl.constexpr, ASYM: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     ASM: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
                     SPLIT_K: tl.constexpr, FIXUP: tl.constexpr, PREFETCH: tl.constexpr):
    """One activation row, 4-bit codes, int8 activations: per word, the low
    nibbles (its even K-elements) and the high ones (odd) each meet their
    activation codes in one DP4A: the sm_90 loop runs ~1.8-2.1 instructions
    per weight at 32-64 x 1024 tiles against the float loop's ~4.5
    (bench.gemv_sass; quantizing the activation in every program costs
    0.37 of the 2.12 at n32-k1024: a scratch variant loading pre-quantized
    codes compiled to 1.75, 2026-12-02). Per group:
    s * sx * dot - b * sx * sum(codes) in fp32.
    EARLY (with PDL): the first tile's weights are loaded before the
    dependent-launch wait, while the kernel before still runs (weights are
    never written by a kernel; only x and the output wait).
    FIXUP: out_ptr holds SPLIT_K fp32 partials and the last program of each
    tile sums them into final_ptr (_sum_splits_if_last).
    PREFETCH: tile i+1's weights are loaded before tile i's arithmetic (and,
    with EARLY, the first before the wait). The launch's num_stages does not
    pipeline loads that feed no tl.dot (the sm_90 build is the same at 1, 2
    and 3 stages), and Nsight Compute on the H200 (2026-12-03) found this
    loop waiting on its loads half the time: gate_up at 59% of DRAM
    bandwidth, 25% occupancy (126 registers), 0.6 eligible warps per
    scheduler. It costs the next tile's registers. A loop-level
    `tl.range(..., num_stages=N)` does pipeline them (Triton's
    pipelineWithoutDot: words and group scales by cp.async into shared
    memory, 157 registers and 40 KB at n32-k1024, 3 stages), but on the H200
    (2026-12-04 14:07) it lost on all six 27B shapes (gate_up 38.6 us
    against 30.2, down 22.2 against 21.1, lm_head 239.6 against 190.3), so
    it was not kept."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    WPG: tl.constexpr = G // 8
    NG: tl.constexpr = BLOCK_K // G
    BW: tl.constexpr = BLOCK_K // 8
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    n_safe = tl.minimum(offs_n, N - 1)
    wi = tl.arange(0, BW)
    w_row = qw_ptr + n_safe[:, None] * ROW_WORDS
    acc = tl.zeros([BLOCK_N, NG], dtype=tl.float32)
    if PREFETCH:
        acc = _x8_tiles_prefetched(acc, x_ptr, qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, w_row,
                                   n_safe, wi, pid_k, ROW_WORDS, GROUPS, SUPERS, TILES, G, S, NG,
                                   BW, WPG, BLOCK_N, ASYM, ASM, PDL, EARLY)
    elif EARLY:
        tile_id = pid_k * TILES
        words, d, sc, dmin, m = _tile_loads(
            qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, w_row, n_safe, tile_id, True,
            ROW_WORDS, GROUPS, SUPERS, G, S, NG, BW, ASYM, False)
        pdl_prologue(PDL)
        w_ids = tile_id * BW + wi
        acc += _x8_tile(x_ptr, words, d, sc, dmin, m, w_ids, w_ids < ROW_WORDS, BLOCK_N, NG,
                        WPG, ASYM, ASM)
        acc = _x8_tiles(acc, x_ptr, qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, w_row, n_safe, wi,
                        pid_k, 1, ROW_WORDS, GROUPS, SUPERS, TILES, G, S, NG, BW, WPG, BLOCK_N,
                        ASYM, ASM)
    else:
        pdl_prologue(PDL)
        acc = _x8_tiles(acc, x_ptr, qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, w_row, n_safe, wi,
                        pid_k, 0, ROW_WORDS, GROUPS, SUPERS, TILES, G, S, NG, BW, WPG, BLOCK_N,
                        ASYM, ASM)
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid_k * stride_os + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)
    if FIXUP:
        _sum_splits_if_last(out_ptr, final_ptr, counter_ptr, pid_n, offs_n, offs_n, n_ok,
                            stride_os, SPLIT_K, SPLIT_K)


@triton.jit
def _gemv_x8_kernel(x_ptr, qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, out_ptr, bias_ptr,
                    final_ptr, counter_ptr, N, stride_os, ROW_WORDS, GROUPS, SUPERS, TILES,
                    G: tl.constexpr, S: tl.constexpr, ASYM: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    ASM: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
                    SPLIT_K: tl.constexpr, FIXUP: tl.constexpr, PREFETCH: tl.constexpr):
    _gemv_x8_program(x_ptr, qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, out_ptr, bias_ptr,
                     final_ptr, counter_ptr, N, stride_os, ROW_WORDS, GROUPS, SUPERS, TILES,
                     G, S, ASYM, HAS_BIAS, BLOCK_N, BLOCK_K, ASM, PDL, EARLY, SPLIT_K, FIXUP,
                     PREFETCH)


@triton.jit
def _gemv_x8_kernel_interpreted(x_ptr, qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, out_ptr,
                                bias_ptr, final_ptr, counter_ptr, N, stride_os, ROW_WORDS,
                                GROUPS, SUPERS, TILES: tl.constexpr,
                                G: tl.constexpr, S: tl.constexpr, ASYM: tl.constexpr,
                                HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
                                EARLY: tl.constexpr, SPLIT_K: tl.constexpr,
                                FIXUP: tl.constexpr, PREFETCH: tl.constexpr):
    """The same with a constant TILES (the interpreter's loops)."""
    _gemv_x8_program(x_ptr, qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, out_ptr, bias_ptr,
                     final_ptr, counter_ptr, N, stride_os, ROW_WORDS, GROUPS, SUPERS, TILES,
                     G, S, ASYM, HAS_BIAS, BLOCK_N, BLOCK_K, ASM, PDL, EARLY, SPLIT_K, FIXUP,
                     PREFETCH)


@triton.jit
def _stream_unit_loads(qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, N, block, k_tile, valid,
                       ROW_WORDS, GROUPS, SUPERS, tile_w, tile_g, tile_s, wi,
                       G: tl.constexpr, S: tl.constexpr, NG: tl.constexpr, BW: tl.constexpr,
                       BLOCK_N: tl.constexpr, ASYM: tl.constexpr):
    """The words and scales of output block `block`'s K tile `k_tile` (one
    work unit). A unit moves the tile's offsets by scalars only:
    tile_w / tile_g / tile_s are the row offsets [BN, 1] of a block at K
    tile 0, and the last block starts at N - BLOCK_N instead of running past
    N (_stream_block_start), so no row is clamped or masked."""
    start = _stream_block_start(block, N, BLOCK_N)
    w_ok = ((k_tile * BW + wi) < ROW_WORDS) & valid
    g_ok = ((k_tile * NG + tl.arange(0, NG)) < GROUPS) & valid
    words = tl.load(qw_ptr + (start * ROW_WORDS + k_tile * BW) + tile_w + wi[None, :],
                    mask=w_ok[None, :], other=0)
    # a tile's groups lie in one superblock or whole superblocks (NG and
    # S // G are powers of two), so the superblock of group kt*NG + g is
    # (kt*NG) // (S // G) + g // (S // G)
    g_in = tl.arange(0, NG)[None, :]
    s_off = start * SUPERS + (k_tile * NG) // (S // G) + tile_s + g_in // (S // G)
    g_off = start * GROUPS + k_tile * NG + tile_g + g_in
    d = tl.load(d_ptr + s_off, mask=g_ok[None, :], other=0.0)
    sc = tl.load(sc_ptr + g_off, mask=g_ok[None, :], other=0)
    if ASYM:
        dmin = tl.load(dmin_ptr + s_off, mask=g_ok[None, :], other=0.0)
        m = tl.load(m_ptr + g_off, mask=g_ok[None, :], other=0)
    else:
        dmin = d
        m = sc
    return words, d, sc, dmin, m


@triton.jit
def _stream_block_start(block, N, BLOCK_N: tl.constexpr):
    """The first row block `block` computes: block * BLOCK_N, except that
    the last block ends at row N - 1 (it recomputes rows of the block before
    it and stores only its own; the launch needs N >= BLOCK_N)."""
    return tl.minimum(block * BLOCK_N, N - BLOCK_N)


@triton.jit
def _stream_segment_end(acc, out_ptr, part_ptr, counter_ptr, block, whole, slot, parts,
                        offs_n, n_ok, BLOCK_N: tl.constexpr, MAX_PARTS: tl.constexpr):
    """A program's run of K tiles of output block `block` has ended. Whole
    (it began at the first tile): the block's result, stored. Else one of
    the block's `parts` partial sums, kept in slot `slot`, which the last to
    arrive adds in slot order (the split-K fix-up, _sum_splits_if_last)."""
    y = tl.sum(acc, axis=1)
    if whole:
        tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        block_parts = block * MAX_PARTS * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(part_ptr + block_parts + slot * BLOCK_N, y)
        _sum_splits_if_last(part_ptr, out_ptr, counter_ptr, block, block_parts, offs_n, n_ok,
                            BLOCK_N, MAX_PARTS, parts)


@triton.jit
def _gemv_x8_stream_kernel(x_ptr, qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, out_ptr, part_ptr,
                           counter_ptr, N, ROW_WORDS, GROUPS, SUPERS, K_TILES, UNITS,
                           G: tl.constexpr, S: tl.constexpr, ASYM: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr,
                           PDL: tl.constexpr, EARLY: tl.constexpr,
                           UNITS_PER_PROGRAM: tl.constexpr, MAX_PARTS: tl.constexpr):
    """The DP4A GEMV as stream-K (GemvConfig.stream_k): the work is
    cdiv(N, BLOCK_N) output blocks x K_TILES tiles = UNITS units in
    block-major order, and program p takes units p*U .. p*U+U-1 (U =
    UNITS_PER_PROGRAM), so every program streams the same number of tiles
    however the blocks divide into the SMs. The split-K grids leave the last
    wave part-empty and give a program of down or gdn out 2-3 tiles, whose
    first load is exposed each time (the H200 sweep: 54-58% of their floor
    against 76-81% for the 5-tile programs). The next unit's loads are
    issued before this one's arithmetic, across block boundaries too. A run
    of tiles that does not cover its block's whole K is a partial sum that
    _stream_segment_end combines; a block has at most MAX_PARTS of them."""
    pid = tl.program_id(0)
    NG: tl.constexpr = BLOCK_K // G
    BW: tl.constexpr = BLOCK_K // 8
    WPG: tl.constexpr = G // 8
    wi = tl.arange(0, BW)
    rows = tl.arange(0, BLOCK_N)
    # [BN, 1] and [1, width]: hoisting whole [BN, BW] offsets cost ~15 registers (sm_90)
    tile_w = rows[:, None] * ROW_WORDS
    tile_g = rows[:, None] * GROUPS
    tile_s = rows[:, None] * SUPERS
    first = pid * UNITS_PER_PROGRAM
    # the unit's block and K tile step along with it: no division in the loop
    block = first // K_TILES
    k_tile = first - block * K_TILES
    if not EARLY:
        pdl_prologue(PDL)
    w_nx, d_nx, sc_nx, dmin_nx, m_nx = _stream_unit_loads(
        qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, N, block, k_tile, first < UNITS, ROW_WORDS,
        GROUPS, SUPERS, tile_w, tile_g, tile_s, wi, G, S, NG, BW, BLOCK_N, ASYM)
    if EARLY:
        pdl_prologue(PDL)
    acc = tl.zeros([BLOCK_N, NG], dtype=tl.float32)
    run_start = k_tile  # the K tile the current run began at
    for i in range(UNITS_PER_PROGRAM):
        unit = first + i
        last_tile = k_tile == K_TILES - 1
        next_block = tl.where(last_tile, block + 1, block)
        next_tile = tl.where(last_tile, 0, k_tile + 1)
        words, d, sc, dmin, m = w_nx, d_nx, sc_nx, dmin_nx, m_nx
        w_nx, d_nx, sc_nx, dmin_nx, m_nx = _stream_unit_loads(
            qw_ptr, d_ptr, sc_ptr, dmin_ptr, m_ptr, N, next_block, next_tile,
            (i + 1 < UNITS_PER_PROGRAM) & (unit + 1 < UNITS), ROW_WORDS, GROUPS,
            SUPERS, tile_w, tile_g, tile_s, wi, G, S, NG, BW, BLOCK_N, ASYM)
        valid = unit < UNITS
        w_ids = k_tile * BW + wi
        acc += _x8_tile(x_ptr, words, d, sc, dmin, m, w_ids, (w_ids < ROW_WORDS) & valid,
                        BLOCK_N, NG, WPG, ASYM, ASM)
        ends = valid & (last_tile | (i == UNITS_PER_PROGRAM - 1))
        if ends:
            start = _stream_block_start(block, N, BLOCK_N)
            offs_n = start + rows
            first_owner = (block * K_TILES) // UNITS_PER_PROGRAM
            parts = (block * K_TILES + K_TILES - 1) // UNITS_PER_PROGRAM - first_owner + 1
            _stream_segment_end(acc, out_ptr, part_ptr, counter_ptr, block,
                                (run_start == 0) & last_tile, pid - first_owner,
                                parts, offs_n, (offs_n >= block * BLOCK_N) & (offs_n < N),
                                BLOCK_N, MAX_PARTS)
        acc = tl.where(ends, 0.0, acc)
        run_start = tl.where(ends, 0, run_start)
        block = next_block
        k_tile = next_tile


def stream_k_plan(n: int, k: int, block_n: int, block_k: int, programs_per_sm: int,
                  sms: int) -> tuple[int, int, int, int, int]:
    """(blocks, K tiles, units per program, programs, most partial sums a
    block has) for a stream-K launch of about programs_per_sm x sms programs."""
    blocks, k_tiles = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    units = blocks * k_tiles
    per_program = triton.cdiv(units, programs_per_sm * sms)
    return (blocks, k_tiles, per_program, triton.cdiv(units, per_program),
            triton.cdiv(k_tiles, per_program) + 1)


def quantize_activations_reference(x: torch.Tensor, group: int
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8-valued codes [M, K] as float, scales [M, K / group]):
    what _quantize_x computes, one scale (amax / 127) per group."""
    xg = x.float().reshape(x.shape[0], -1, group)
    amax = xg.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / torch.where(amax > 0, amax, 1.0), 0.0)
    codes = torch.floor(xg * inv + 0.5).clamp(-127, 127)
    return codes.reshape(x.shape), (amax * (1.0 / 127.0)).squeeze(-1)


def gemv_x8_reference(x: torch.Tensor, qt: QuantTensor) -> torch.Tensor:
    """The int8-activation GEMV in PyTorch (fp32): x quantized per weight
    group, then the exact weight dequantization against the codes."""
    codes, scales = quantize_activations_reference(x, qt.group)
    x_dq = (codes.reshape(x.shape[0], -1, qt.group) * scales[..., None]).reshape(x.shape)
    return x_dq @ qt.dequantize(torch.float32).t()


def normed_gemv_x8_reference(s: torch.Tensor, weight: torch.Tensor, eps: float,
                             zero_centered: bool, qt: QuantTensor) -> torch.Tensor:
    """The CUDA GEMV's norm prologue in PyTorch (fp32): RMSNorm(s) times the
    weight with the row's rstd deferred. x's int8 codes are taken of
    s * (1 + w) (Qwen3.5's zero-centred norm) or w * s (Llama's), rounded to
    bf16, and rstd = rsqrt(mean(s^2) + eps) scales the finished products:
    one factor common to every group, it moves no code. (The norm's own
    launch rounds s * rstd to bf16 before the GEMV quantizes it, so the two
    differ by a code here and there, not in accuracy.)"""
    sf = s.float()
    w = weight.float()
    weighted = (sf * (1.0 + w) if zero_centered else w * sf).to(torch.bfloat16)
    rstd = torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    return gemv_x8_reference(weighted.float(), qt) * rstd


@triton.jit
def _sum_splits_if_last(part_ptr, final_ptr, counter_ptr, tile, part_offs, final_offs, ok,
                        stride_ps, SPLIT_K: tl.constexpr, parts):
    """The split-K fix-up at the end of a GEMV program (split_fixup): each of
    the `parts` programs of output tile `tile` has stored its fp32 partial;
    the last to arrive (one counter per tile) adds all of them in split
    order, as _split_k_sum_kernel does, stores the result and sets the
    counter back to zero for the next launch. That saves the sum's launch.
    The barrier orders every thread's partial before the release; the sum
    reads through L2 (.cg), since L1 does not see other SMs' stores.
    `parts` is SPLIT_K for split-K; stream-K blocks have 1..SPLIT_K parts."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == parts - 1:
        total = tl.load(part_ptr + part_offs, mask=ok, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT_K):
            total += tl.load(part_ptr + s * stride_ps + part_offs, mask=ok & (s < parts),
                             other=0.0, cache_modifier=".cg")
        tl.store(final_ptr + final_offs, total.to(final_ptr.dtype.element_ty), mask=ok)
        tl.store(counter_ptr + tile, 0)


@triton.jit
def _split_k_sum_kernel(part_ptr, out_ptr, bias_ptr, M, N, stride_ps, stride_om,
                        SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    """out[m, n] = sum over splits of the fp32 partials (+ bias), cast."""
    pdl_prologue(PDL)
    row = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        total += tl.load(part_ptr + s * stride_ps + row * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------- launcher

def _sm_count(device: torch.device) -> int:
    """Off the GPU, the H200's count: the interpreter tests run the GPU's grids."""
    return multiprocessors(device, off_gpu=132)


def _interpreting() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_gemv_layout(qt: QuantTensor) -> None:
    """The word layout needs whole int32 words per group."""
    per_word = 8 if qt.bits == 4 else 4
    if qt.group % per_word:
        raise ValueError(f"gemv reads {per_word} codes per int32 word; group {qt.group} "
                         f"of {qt.describe()} does not hold whole words")


def int8_x_override() -> bool | None:
    """TANDEM_GEMV_INT8_X: 0 runs every GEMV with float activations, 1 every
    one-row 4-bit GEMV the DP4A kernel can take with int8 ones; unset, the
    picked config decides (read per call; inside a CUDA graph, at capture).
    The A/B switch for the DP4A kernel's numerics (bench.int8_activations)."""
    import os
    value = os.environ.get("TANDEM_GEMV_INT8_X", "")
    return None if value == "" else value != "0"


def early_weights(default: bool = True) -> bool:
    """Whether the DP4A kernel (and engine/dense_gemv.py's) loads its first
    weight tile before the dependent-launch wait (engine/pdl.py), while the
    kernel before it still runs (without PDL: the same loop, its first tile
    peeled). TANDEM_GEMV_EARLY=1/0 sets it for both; unset, each kernel's
    default: on for DP4A (the H200's int4 step, 2026-12-02, two alternating
    pairs: 7.30 / 7.00 ms against 7.40-7.59 / 7.17-8.90), off for the dense
    GEMV (one untuned run lost). Read per call; in a CUDA graph, at capture."""
    return on_off("TANDEM_GEMV_EARLY", default, on="the first weight tile before the wait",
                  off="after it")


SPLIT_FIXUP_ENV = "TANDEM_SPLIT_FIXUP"
# Output tiles a fix-up launch may count: the 27B's widest, its output head
# (248,320 features), is 15,520 tiles of 16.
MAX_FIXUP_TILES = 1 << 16


def split_fixup() -> bool:
    """Whether a split-K GEMV (the DP4A kernel's and engine/dense_gemv.py's)
    sums its partials in its own last program per tile instead of a second
    launch (_sum_splits_if_last). TANDEM_SPLIT_FIXUP=1/0; on by default:
    the 27B int4 step has 128 such sums, the bf16 one 64, and two A/B pairs
    on the H200 (2026-12-03 05:56) gave int4 7.68 -> 7.65 and 7.32 -> 7.14 ms,
    bf16 4K 14.34 -> 14.22 and 14.35 -> 14.30 ms (128K: 17.23 -> 17.10,
    17.30 -> 17.19). Read per call; in a CUDA graph, at capture."""
    return on_off(SPLIT_FIXUP_ENV, True, on="the last program of a tile sums the splits",
                  off="a sum kernel after the GEMV")


@functools.lru_cache(maxsize=None)
def split_counters(device: torch.device) -> torch.Tensor:
    """The fix-up's arrival counters on `device`, one per output tile, zero
    between launches (each tile's last program resets its own). One set per
    device serves every GEMV of the process: launches on one stream run one
    after the other (with PDL a kernel's programs pass griddepcontrol.wait,
    which waits for the launch before to finish, before they count), and a
    worker runs its model on one stream."""
    return torch.zeros(MAX_FIXUP_TILES, dtype=torch.int32, device=device)


def takes_int8_x(qt: QuantTensor, rows: int) -> bool:
    """The int8-activation kernel's reach: one row, 4-bit codes in groups of
    32 (Q4_K, Q4_0, Q4_1); elsewhere an int8_x config runs the float kernel."""
    return rows == 1 and qt.bits == 4 and qt.group == 32


def _words(qt: QuantTensor) -> torch.Tensor:
    q = qt.qweight
    if q.storage_offset() * q.element_size() % 4 or q.stride(0) % 4:
        q = q.contiguous().clone()
    return q.view(torch.int32)


def gemv(x: torch.Tensor, qt: QuantTensor, out: torch.Tensor | None = None,
         bias: torch.Tensor | None = None, config: GemvConfig | None = None,
         block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
         l2_prefetch=None) -> torch.Tensor:
    """x [M, K] with 1 <= M <= GEMV_MAX_ROWS -> x @ w.T (+ bias) [M, N] in x's
    dtype. `config` (or the block_n/block_k/split_k overrides) replaces the
    picked one. l2_prefetch (gemv_cuda.L2Prefetch): the weight the CUDA
    GEMV reads ahead when it takes the call (ignored by the Triton kernels)."""
    m_rows, k_dim = x.shape
    n_dim = qt.out_features
    if not 1 <= m_rows <= GEMV_MAX_ROWS:
        raise ValueError(f"gemv takes 1..{GEMV_MAX_ROWS} rows, got {m_rows}")
    if k_dim != qt.in_features:
        raise ValueError(f"x has {k_dim} features, the weight {qt.in_features}")
    check_gemv_layout(qt)
    x = x if x.stride(-1) == 1 else x.contiguous()
    if config is None and not (block_n or block_k or split_k) and x.is_cuda \
            and gemv_cuda.runs(x, qt, bias, out):
        return gemv_cuda.gemv_cuda(x, qt, out, l2_prefetch=l2_prefetch)
    if config is None:
        config = pick_config(qt.bits, n_dim, k_dim, m_rows, qt.group, _sm_count(x.device))
        override = int8_x_override()
        if override is not None and takes_int8_x(qt, m_rows):
            config = replace(config, int8_x=override, tensor_cores=False,
                             stream_k=config.stream_k if override else 0)
    if block_n or block_k or split_k:
        config = replace(config, block_n=block_n or config.block_n,
                         block_k=block_k or config.block_k, split_k=split_k or config.split_k)
    codes_per_word = 32 // qt.bits
    block_k = max(config.block_k, qt.group)
    block_n = config.block_n
    if config.tensor_cores:  # tl.dot wants >= 16 along N and along K (words per tile)
        block_k = max(block_k, 16 * codes_per_word)
        block_n = max(block_n, 16)
    tiles = triton.cdiv(k_dim, block_k)
    split = min(config.split_k, tiles)
    tiles_per_split = triton.cdiv(tiles, split)
    split = triton.cdiv(tiles, tiles_per_split)  # no split left without a tile
    even = k_dim % block_k == 0 and tiles == split * tiles_per_split
    if out is None:
        out = torch.empty(m_rows, n_dim, dtype=x.dtype, device=x.device)
    if split == 1:
        target, stride_os = out, 0
    else:
        target = torch.empty(split, m_rows, n_dim, dtype=torch.float32, device=x.device)
        stride_os = target.stride(0)
    dmin = qt.dmin if qt.asymmetric else qt.d  # never read when symmetric
    m = qt.m if qt.asymmetric else qt.sc
    has_bias = bias is not None and split == 1
    pointers = (x, _words(qt), qt.d, qt.sc, dmin, m, target, bias if has_bias else x)
    sizes = (k_dim // codes_per_word, k_dim // qt.group, k_dim // qt.superblock, tiles_per_split)
    args = (*pointers, m_rows, n_dim, x.stride(0), stride_os, target.stride(-2), *sizes)
    grid = (triton.cdiv(n_dim, block_n), split)
    common = dict(BITS=qt.bits, G=qt.group, S=qt.superblock, ASYM=qt.asymmetric,
                  HAS_BIAS=has_bias, BLOCK_N=block_n, BLOCK_K=block_k,
                  ASM=not _interpreting(), num_warps=config.num_warps,
                  num_stages=config.num_stages, **pdl_launch(x.device))
    if config.stream_k and bias is None and takes_int8_x(qt, m_rows) \
            and block_n <= n_dim and triton.cdiv(n_dim, block_n) <= MAX_FIXUP_TILES:
        return _gemv_x8_stream(x, qt, out, config, block_n, block_k, pointers[:6], sizes[:3],
                               common)
    if config.int8_x and takes_int8_x(qt, m_rows):
        fixup = split > 1 and bias is None and split_fixup() and grid[0] <= MAX_FIXUP_TILES
        counters = split_counters(x.device) if fixup else target
        kernel = _gemv_x8_kernel_interpreted if _interpreting() else _gemv_x8_kernel
        kernel[grid](*pointers, out, counters, n_dim, stride_os, *sizes,
                     EARLY=early_weights(), SPLIT_K=split if fixup else 1, FIXUP=fixup,
                     PREFETCH=config.prefetch,
                     **{k: v for k, v in common.items() if k != "BITS"})
        if fixup:
            return out
    elif config.tensor_cores:
        kernel = _gemv_dot_kernel_interpreted if _interpreting() else _gemv_dot_kernel
        kernel[grid](*args, IEEE=x.dtype == torch.float32 or _interpreting(), **common)
    else:
        kernel = _gemv_kernel_interpreted if _interpreting() else _gemv_kernel
        kernel[grid](*args, BLOCK_M=triton.next_power_of_2(m_rows), EVEN=even,
                     PREFETCH=config.prefetch, **common)
    if split > 1:
        block = 256
        _split_k_sum_kernel[(triton.cdiv(n_dim, block), m_rows)](
            target, out, bias if bias is not None else target, m_rows, n_dim,
            target.stride(0), out.stride(0), SPLIT_K=split, HAS_BIAS=bias is not None,
            BLOCK=block, **pdl_launch(x.device))
    elif bias is not None and not has_bias:
        out += bias
    return out


def _gemv_x8_stream(x: torch.Tensor, qt: QuantTensor, out: torch.Tensor, config: GemvConfig,
                    block_n: int, block_k: int, operands: tuple, sizes: tuple,
                    common: dict) -> torch.Tensor:
    """The stream-K launch of the DP4A GEMV (one row, no bias)."""
    blocks, k_tiles, per_program, programs, max_parts = stream_k_plan(
        qt.out_features, qt.in_features, block_n, block_k, config.stream_k,
        _sm_count(x.device))
    # one slot per (block, part) whether or not the split leaves that block parts
    parts = torch.empty(blocks * max_parts * block_n, dtype=torch.float32, device=x.device)
    _gemv_x8_stream_kernel[(programs,)](
        *operands, out, parts, split_counters(x.device), qt.out_features, *sizes, k_tiles,
        blocks * k_tiles, EARLY=early_weights(), UNITS_PER_PROGRAM=per_program,
        MAX_PARTS=max_parts,
        **{k: v for k, v in common.items() if k not in ("BITS", "HAS_BIAS")})
    return out
