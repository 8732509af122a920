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

rk4 pages hold K and V in the rotated space (x @ R); the caller rotates the
query and un-rotates the output (q.k == (q R).(k R), and attention over
rotated V is out @ R), so the kernel sees the stored space only.

rk4p pages hold K before RoPE (per-channel codes per page) and rotated V;
page ids >= num_pages name bf16 staging pages (open pages). The kernel
applies RoPE from the key positions to the rotary channels only (partial
rotary: the first ROTARY_DIM; the 27B rotates 64 of 256): the scores are
q . k over the other channels (K loaded once, its rotary channels masked to
zero) plus q1 . A + q2 . B over [BLOCK_N, half] tiles of the roped halves
(`_roped_halves`), whose cos/sin come from an explicit range reduction
(`_sin_cos`) because libdevice's sinf/cosf take a slow path at the angles a
long context reaches. The caller un-rotates the output.

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

from engine.kv.kernels import (_e8m0_scale, _k_step_decode, _load_dense, _store_dense,
                               as_kernel_dense)

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
    """Width of the rotary half tiles: half the rotary dims, a power of two
    and at least tl.dot's 16 (zero columns pad the tiny test heads)."""
    return max(16, triton.next_power_of_2(max(1, rotary_dim // 2)))


@triton.jit
def _load_kv(codes_ptr, scales_ptr, slot, kv_head, cols, key_ok, col_ok,
             KV_HEADS: tl.constexpr, D: tl.constexpr, KIND: tl.constexpr,
             SCALE_BLOCK: tl.constexpr, E8M0: tl.constexpr):
    """Dequantized [BLOCK_N, D_PAD] fp32 K or V rows of (slot, kv_head).

    Mirrors formats.py: int8 is code * fp16 scale per (token, head); rk4 byte i
    of a row holds channel 2i in its low nibble and 2i+1 in its high one, the
    code is nibble - 8, with one scale per SCALE_BLOCK channels."""
    row = slot * KV_HEADS + kv_head  # int64 [BLOCK_N]
    mask = key_ok[:, None] & col_ok[None, :]
    if KIND == 0:
        return _load_dense(codes_ptr, row[:, None] * D + cols[None, :], mask, False)
    elif KIND == 1:
        return _load_dense(codes_ptr, row[:, None] * D + cols[None, :], mask, True)
    elif KIND == 2:
        codes = tl.load(codes_ptr + row[:, None] * D + cols[None, :], mask=mask, other=0)
        scale = tl.load(scales_ptr + row, mask=key_ok, other=0.0).to(tl.float32)
        return codes.to(tl.float32) * scale[:, None]
    else:
        packed = tl.load(codes_ptr + row[:, None] * (D // 2) + cols[None, :] // 2, mask=mask,
                         other=0).to(tl.int32)
        nibble = (packed >> ((cols[None, :] % 2) * 4)) & 0xF
        scale_at = scales_ptr + row[:, None] * (D // SCALE_BLOCK) + cols[None, :] // SCALE_BLOCK
        if E8M0:
            scale = _e8m0_scale(tl.load(scale_at, mask=mask, other=127))
        else:
            scale = tl.load(scale_at, mask=mask, other=0.0).to(tl.float32)
        return (nibble - 8).to(tl.float32) * scale


@triton.jit
def _load_bf16_rows(ptr, row, cols, mask, D: tl.constexpr):
    return _load_dense(ptr, row[:, None] * D + cols[None, :], mask, True)


@triton.jit
def _load_rk4p_k(codes_ptr, min_ptr, step_ptr, open_ptr, slot, first_staged, kv_head, cols,
                 key_ok, col_ok, KV_HEADS: tl.constexpr, D: tl.constexpr,
                 PAGE_SIZE: tl.constexpr):
    """rk4p K [BLOCK_N, D_PAD] before RoPE: a real page's codes with its
    per-channel min and e5m3 step, or a staging page's bf16 (formats.py)."""
    staged = slot >= first_staged
    real_mask = (key_ok & ~staged)[:, None] & col_ok[None, :]
    open_mask = (key_ok & staged)[:, None] & col_ok[None, :]
    row = slot * KV_HEADS + kv_head
    packed = tl.load(codes_ptr + row[:, None] * (D // 2) + cols[None, :] // 2, mask=real_mask,
                     other=0).to(tl.int32)
    nibble = (packed >> ((cols[None, :] % 2) * 4)) & 0xF
    page_row = (slot // PAGE_SIZE) * KV_HEADS + kv_head
    lo = tl.load(min_ptr + page_row[:, None] * D + cols[None, :], mask=real_mask,
                 other=0.0).to(tl.float32)
    step = _k_step_decode(tl.load(step_ptr + page_row[:, None] * D + cols[None, :],
                                  mask=real_mask, other=0))
    real = lo + nibble.to(tl.float32) * step
    open_row = tl.where(staged, slot - first_staged, 0) * KV_HEADS + kv_head
    exact = _load_bf16_rows(open_ptr, open_row, cols, open_mask, D)
    return tl.where(staged[:, None], exact, real)


@triton.jit
def _load_rk4p_v(codes_ptr, scales_ptr, open_ptr, slot, first_staged, kv_head, cols, key_ok,
                 col_ok, KV_HEADS: tl.constexpr, D: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    """rk4p V (rotated) [BLOCK_N, D_PAD]: per-token codes with fp16 block scales,
    or a staging page's bf16."""
    staged = slot >= first_staged
    real_ok = key_ok & ~staged
    real = _load_kv(codes_ptr, scales_ptr, slot, kv_head, cols, real_ok, col_ok,
                    KV_HEADS, D, 3, SCALE_BLOCK, False)
    open_mask = (key_ok & staged)[:, None] & col_ok[None, :]
    open_row = tl.where(staged, slot - first_staged, 0) * KV_HEADS + kv_head
    exact = _load_bf16_rows(open_ptr, open_row, cols, open_mask, D)
    return tl.where(staged[:, None], exact, real)


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
def _roped_halves(k_codes_ptr, min_ptr, step_ptr, open_ptr, slot, first_staged, kv_head,
                  keys, key_ok, inv_freq_ptr, KV_HEADS: tl.constexpr, D: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, ROTARY_DIM: tl.constexpr, ROPE_PAD: tl.constexpr,
                  COMPILED: tl.constexpr):
    """RoPE'd rotary halves A = k1 c - k2 s, B = k2 c + k1 s, [BLOCK_N, ROPE_PAD]
    fp32 (rotate-half layout, engine/rotary.py: k1, k2 are channels [0, half)
    and [half, ROTARY_DIM)); pad columns are zero."""
    half: tl.constexpr = ROTARY_DIM // 2
    j = tl.arange(0, ROPE_PAD)
    j_ok = j < half
    k1 = _load_rk4p_k(k_codes_ptr, min_ptr, step_ptr, open_ptr, slot, first_staged, kv_head,
                      j, key_ok, j_ok, KV_HEADS, D, PAGE_SIZE)
    k2 = _load_rk4p_k(k_codes_ptr, min_ptr, step_ptr, open_ptr, slot, first_staged, kv_head,
                      j + half, key_ok, j_ok, KV_HEADS, D, PAGE_SIZE)
    freq = tl.load(inv_freq_ptr + j, mask=j_ok, other=0.0)
    angle = _mul_rn(tl.broadcast_to(keys.to(tl.float32)[:, None], k1.shape),
                    tl.broadcast_to(freq[None, :], k1.shape), COMPILED)
    sin, cos = _sin_cos(angle)
    return k1 * cos - k2 * sin, k2 * cos + k1 * sin


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
def _attend_tile(q, q1, q2, q_pos, m_i, l_i, acc, start, hi, table, cols, col_ok, kv_head,
                 k_codes_ptr, k_scales_ptr, v_codes_ptr, v_scales_ptr,
                 k_step_ptr, k_open_ptr, v_open_ptr, inv_freq_ptr, first_staged,
                 KV_HEADS: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 KIND: tl.constexpr, SCALE_BLOCK: tl.constexpr, E8M0: tl.constexpr,
                 ROTARY_DIM: tl.constexpr, ROPE_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                 DOT_BF16: tl.constexpr, COMPILED: tl.constexpr):
    """One online-softmax step over keys [start, start + BLOCK_N) (< hi).
    DOT_BF16: q (already rounded), K, P and V enter the dots as bf16,
    which runs them at twice tf32's rate with half the shared memory; the
    accumulators and the softmax stay fp32. q1, q2: rk4p's rotary halves of
    q, [ROWS, ROPE_PAD] (unused by the other kinds)."""
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = keys < hi
    page = tl.load(table + keys // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
    slot = page * PAGE_SIZE + keys % PAGE_SIZE
    if KIND == 4:
        if ROTARY_DIM < D:
            # the rotary channels load as zeros here: their roped values
            # enter through q1 . A + q2 . B, on [BLOCK_N, half] tiles
            k = _load_rk4p_k(k_codes_ptr, k_scales_ptr, k_step_ptr, k_open_ptr, slot,
                             first_staged, kv_head, cols, key_ok,
                             col_ok & (cols >= ROTARY_DIM), KV_HEADS, D, PAGE_SIZE)
            s = tl.dot(q, tl.trans(_dot_operand(k, DOT_BF16)))
        else:  # full rotary: no other channels
            s = tl.zeros([q.shape[0], BLOCK_N], tl.float32)
        if ROTARY_DIM > 0:
            a, b = _roped_halves(k_codes_ptr, k_scales_ptr, k_step_ptr, k_open_ptr, slot,
                                 first_staged, kv_head, keys, key_ok, inv_freq_ptr, KV_HEADS,
                                 D, PAGE_SIZE, ROTARY_DIM, ROPE_PAD, COMPILED)
            s = tl.dot(q1, tl.trans(_dot_operand(a, DOT_BF16)), s)
            s = tl.dot(q2, tl.trans(_dot_operand(b, DOT_BF16)), s)
    else:
        k = _load_kv(k_codes_ptr, k_scales_ptr, slot, kv_head, cols, key_ok, col_ok,
                     KV_HEADS, D, KIND, SCALE_BLOCK, E8M0)
        s = tl.dot(q, tl.trans(_dot_operand(k, DOT_BF16)))
    visible = (keys[None, :] <= q_pos[:, None]) & key_ok[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if KIND == 4:
        v = _load_rk4p_v(v_codes_ptr, v_scales_ptr, v_open_ptr, slot, first_staged, kv_head,
                         cols, key_ok, col_ok, KV_HEADS, D, SCALE_BLOCK)
    else:
        v = _load_kv(v_codes_ptr, v_scales_ptr, slot, kv_head, cols, key_ok, col_ok,
                     KV_HEADS, D, KIND, SCALE_BLOCK, E8M0)
    acc = acc * alpha[:, None] + tl.dot(_dot_operand(p, DOT_BF16), _dot_operand(v, DOT_BF16))
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
        q_ptr, q_offsets_ptr, kv_lens_ptr, page_table_ptr, page_table_stride,
        k_codes_ptr, k_scales_ptr, v_codes_ptr, v_scales_ptr,
        k_step_ptr, k_open_ptr, v_open_ptr, inv_freq_ptr, first_staged,
        out_ptr, part_out_ptr, part_lse_ptr, qk_scale,
        Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
        D: tl.constexpr, D_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
        KIND: tl.constexpr, SCALE_BLOCK: tl.constexpr, E8M0: tl.constexpr,
        ROTARY_DIM: tl.constexpr, ROPE_PAD: tl.constexpr,
        Q_BF16: tl.constexpr, OUT_BF16: tl.constexpr,
        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        FOR_LOOP: tl.constexpr, DOT_BF16: tl.constexpr):
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

    cols = tl.arange(0, D_PAD)
    col_ok = cols < D
    q_rows = (q_lo + token).to(tl.int64) * Q_HEADS + head
    q_mask = row_ok[:, None] & col_ok[None, :]
    q = _load_dense(q_ptr, q_rows[:, None] * D + cols[None, :], q_mask, Q_BF16) * qk_scale
    q = _dot_operand(q, DOT_BF16)
    if KIND == 4 and ROTARY_DIM > 0:
        half: tl.constexpr = ROTARY_DIM // 2
        j = tl.arange(0, ROPE_PAD)
        half_mask = row_ok[:, None] & (j < half)[None, :]
        q_at = q_rows[:, None] * D + j[None, :]
        q1 = _dot_operand(_load_dense(q_ptr, q_at, half_mask, Q_BF16) * qk_scale, DOT_BF16)
        q2 = _dot_operand(_load_dense(q_ptr, q_at + half, half_mask, Q_BF16) * qk_scale,
                          DOT_BF16)
    else:
        q1 = q
        q2 = q

    # Keys this row block needs (causal), then this split's share of them,
    # whole BLOCK_Ns so that splits never share a tile.
    last_token = tl.minimum(n_new - 1, (first_row + ROWS - 1) // GROUP)
    key_end = tl.minimum(kv_len, kv_len - n_new + last_token + 1)
    key_end = tl.where(first_row < n_new * GROUP, key_end, 0)
    split_len = tl.cdiv(tl.cdiv(key_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, key_end)

    m_i = tl.full([ROWS], _NEG_BIG, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    table = page_table_ptr + seq.to(tl.int64) * page_table_stride
    # FOR_LOOP also tells _attend_tile it is compiled (it may use inline PTX)
    if FOR_LOOP:  # compiled: a for loop, which Triton software-pipelines
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, q1, q2, q_pos, m_i, l_i, acc, start, hi, table, cols, col_ok, kv_head,
                k_codes_ptr, k_scales_ptr, v_codes_ptr, v_scales_ptr,
                k_step_ptr, k_open_ptr, v_open_ptr, inv_freq_ptr, first_staged,
                KV_HEADS, D, PAGE_SIZE, KIND, SCALE_BLOCK, E8M0, ROTARY_DIM, ROPE_PAD,
                BLOCK_N, DOT_BF16, FOR_LOOP)
    else:  # the interpreter cannot take tensor range bounds (numpy 2): a while loop
        start = lo
        while start < hi:
            m_i, l_i, acc = _attend_tile(
                q, q1, q2, q_pos, m_i, l_i, acc, start, hi, table, cols, col_ok, kv_head,
                k_codes_ptr, k_scales_ptr, v_codes_ptr, v_scales_ptr,
                k_step_ptr, k_open_ptr, v_open_ptr, inv_freq_ptr, first_staged,
                KV_HEADS, D, PAGE_SIZE, KIND, SCALE_BLOCK, E8M0, ROTARY_DIM, ROPE_PAD,
                BLOCK_N, DOT_BF16, FOR_LOOP)
            start += BLOCK_N

    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        _store_dense(out_ptr, q_rows[:, None] * D + cols[None, :], o, q_mask, OUT_BF16)
    else:
        part = q_rows * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * D + cols[None, :], o, mask=q_mask)
        lse = tl.where(has_keys, m_i + tl.math.log2(tl.where(has_keys, l_i, 1.0)),
                       float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def _combine_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, n_rows,
                           D: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                           SPLITS_PAD: tl.constexpr, OUT_BF16: tl.constexpr):
    """out = sum_s w_s o_s / sum_s w_s with w_s = 2**(lse_s - max lse)."""
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
    _store_dense(out_ptr, row * D + cols, o, cols < D, OUT_BF16)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def launch(kind_args: tuple, q: torch.Tensor, q_offsets: torch.Tensor, kv_lens: torch.Tensor,
           page_table: torch.Tensor, page_size: int, kv_heads: int, max_new_tokens: int,
           softmax_scale: float, out: torch.Tensor, num_splits: int,
           rows: int, block_n: int, num_warps: int | None = None,
           num_stages: int | None = None, dot_bf16: bool = False) -> torch.Tensor:
    """Runs the attention kernel (and the split combine when num_splits > 1).

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
    grid = (triton.cdiv(max(max_new_tokens, 1) * group, rows), batch * kv_heads, num_splits)
    extra = {} if num_warps is None else {"num_warps": num_warps}
    if num_stages is not None:
        extra["num_stages"] = num_stages
    _paged_attention_kernel[grid](
        q_arg, q_offsets, kv_lens, page_table, page_table.stride(0),
        k_codes, k_scales, v_codes, v_scales, k_step, k_open, v_open, inv_freq, first_staged,
        out_arg, part_out, part_lse, softmax_scale * LOG2E,
        Q_HEADS=q_heads, KV_HEADS=kv_heads, GROUP=group, D=head_dim, D_PAD=d_pad,
        PAGE_SIZE=page_size, KIND=kind, SCALE_BLOCK=scale_block, E8M0=e8m0,
        ROTARY_DIM=rotary_dim, ROPE_PAD=rope_pad(rotary_dim),
        Q_BF16=q_bf16, OUT_BF16=out_bf16, ROWS=rows, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        FOR_LOOP=not _interpreting(),
        DOT_BF16=(2 if _interpreting() else 1) if dot_bf16 else 0, **extra)
    if num_splits > 1:
        _combine_splits_kernel[(tokens * q_heads,)](
            part_out, part_lse, out_arg, tokens * q_heads, D=head_dim, D_PAD=d_pad,
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
            OUT_BF16=out_bf16)
    return out


def splits_for(batch: int, kv_heads: int, max_kv_len: int, block_n: int,
               programs_wanted: int) -> int:
    """Key splits for a decode batch: enough programs to fill the GPU, never
    more splits than key tiles, a power of two (few distinct compilations)."""
    tiles = max(1, math.ceil(max_kv_len / block_n))
    splits = max(1, math.ceil(programs_wanted / max(1, batch * kv_heads)))
    splits = 1 << (min(splits, tiles, 64) - 1).bit_length()
    return min(splits, 64)
