"""Storage formats for full-attention KV pages, and their PyTorch references.

Owns how one layer's K and V pages are laid out in memory, how tokens are
quantized on write and dequantized on read, and what each format costs in
bits. It does not own which page belongs to whom (the page pool does) nor the
attention kernels that consume the pages.

Formats (make_format(name, **options)):
  bf16  K, V as [num_pages, page_size, H, D] in the compute dtype.
  int8  symmetric int8 codes per (token, head), one fp16 scale per (token, head).
  rk4   rotated 4-bit: x @ R (see rotation.py), then signed codes in [-7, 7]
        in blocks of `block` channels with one scale per block (e8m0 power of
        two or fp16), two codes packed per byte. Per token, so any write goes.
  rk4p  4-bit in 32-token pages (PagedRk4Format): K before RoPE per channel
        along a page's tokens, V rotated per token; a page is quantized whole,
        so open pages live in bf16 staging (page ids >= num_pages) until
        sealed (engine/kv/open_pages.py).

A slot is page * page_size + offset. write() takes a slot per token; read()
takes a sequence's page table and length and returns dense [length, H, D].

Every quantizer here is the reference for a Triton kernel in kernels.py; the
two must agree bit for bit on codes and scales, so each step below is written
with an exactly reproducible float operation (IEEE division, exact power-of-two
scaling, round-half-to-even) and the kernels mirror them step by step.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod

import torch

from engine.kv import rotation
from engine.switches import on_off

INT8_QMAX = 127.0
# Symmetric int4 codes in [-7, 7]: zero is exact and both signs get the same
# step and range, so the error is sign-symmetric and the scale is set by amax
# alone. The unused -8 level would only help negative outliers.
INT4_QMAX = 7.0
INT4_OFFSET = 8  # a code c is stored as the nibble c + 8 (in 1..15)
FP16_MAX = 65504.0
E8M0_BIAS = 127
# Biased exponents kept to fp32's normal range, so 2**(E-127) is an exact,
# normal float built from bits; 255 (NaN in OCP e8m0) is never written.
E8M0_MIN, E8M0_MAX = 1, 254
RK4_BLOCKS = (16, 32, 64)
RK4_SCALE_FORMATS = ("e8m0", "fp16")
RK4_BITS_BUDGET = 4.5
SCALE_BITS = {"e8m0": 8, "fp16": 16}


# ---------------------------------------------------------------- references


def round_half_even(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties to even (the kernels build the same from floor)."""
    return torch.round(x)


def fp16_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """amax / qmax rounded to fp16, returned as its fp32 value."""
    # Clamped below fp16's max so a huge block gives a finite scale (its
    # values clip) rather than inf, which would decode to NaN.
    return torch.clamp(amax / qmax, max=FP16_MAX).to(torch.float16).to(torch.float32)


def quantize_symmetric(x: torch.Tensor, scale: torch.Tensor, qmax: float) -> torch.Tensor:
    """round(clamp(x / scale, ±qmax)) as float; a zero scale gives code 0."""
    # A zero scale only comes from an all-zero (or underflowed) block; dividing
    # by 1 instead maps its values to 0 without producing NaN.
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    # Clamp before rounding: equal to clamping after for integer bounds, and it
    # keeps inf from an over-small scale out of the rounding.
    return round_half_even(torch.clamp(x / safe, -qmax, qmax))


def int8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 codes [..., D], fp16 scales [...]): one scale per row."""
    x = x.to(torch.float32)
    scale = fp16_scale(x.abs().amax(dim=-1), INT8_QMAX)
    codes = quantize_symmetric(x, scale[..., None], INT8_QMAX)
    return codes.to(torch.int8), scale.to(torch.float16)


def int8_dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.to(torch.float32) * scales.to(torch.float32)[..., None]


def e8m0_to_scale(biased_exp: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponent E -> the fp32 scale 2**(E-127), built from bits."""
    return (biased_exp.to(torch.int32) << 23).view(torch.float32)


def e8m0_ceil_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Biased exponent of the smallest power of two s with amax <= 7 * s.

    That is ceil(log2(amax / 7)), computed from amax's float bits so that it is
    exact (a log2 or a division could round differently on another device):
    with amax = m * 2**f, m in [1, 2), 7 * 2**(f-2) = 1.75 * 2**f, so the answer
    is f - 2 when m <= 1.75 and f - 1 otherwise.
    """
    bits = amax.to(torch.float32).view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - E8M0_BIAS
    mantissa = bits & 0x7FFFFF
    e = exponent - 2 + (mantissa > 0x600000).to(torch.int32)
    return torch.clamp(e + E8M0_BIAS, E8M0_MIN, E8M0_MAX)


def _e8m0_block_error(x: torch.Tensor, biased_exp: torch.Tensor) -> torch.Tensor:
    """Squared quantization error of each block [G, B] at exponents [G]."""
    scale = e8m0_to_scale(biased_exp)[:, None]
    # With a power-of-two scale, x / s, q * s and x - q * s are all exact in
    # fp32, and their squares are exact in fp64; only the sum rounds, at fp64
    # precision, so the Triton kernel picks the same exponent except on
    # near-ties below 1e-15 relative.
    diff = x - quantize_symmetric(x, scale, INT4_QMAX) * scale
    return diff.to(torch.float64).square().sum(dim=-1)


def e8m0_search_exponent(x: torch.Tensor) -> torch.Tensor:
    """Per block [G, B]: the biased exponent among e, e-1, e+1 (e: the smallest
    with no clipping) with the least squared error; ties keep the earlier one."""
    ceil_exp = e8m0_ceil_exponent(x.abs().amax(dim=-1))
    best, best_err = ceil_exp, _e8m0_block_error(x, ceil_exp)
    for step in (-1, 1):
        cand = torch.clamp(ceil_exp + step, E8M0_MIN, E8M0_MAX)
        err = _e8m0_block_error(x, cand)
        take = err < best_err
        best = torch.where(take, cand, best)
        best_err = torch.where(take, err, best_err)
    return best


def rk4_quantize(x: torch.Tensor, block: int,
                 scale_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (already in the stored space) -> (packed uint8 [..., D/2],
    scales [..., D/block]: uint8 biased exponents for e8m0, fp16 otherwise).

    Byte i of a row holds channel 2i in its low nibble and 2i+1 in its high one.
    """
    lead, head_dim = x.shape[:-1], x.shape[-1]
    blocks = x.to(torch.float32).reshape(-1, block)
    if scale_format == "e8m0":
        biased_exp = e8m0_search_exponent(blocks)
        scale, stored = e8m0_to_scale(biased_exp), biased_exp.to(torch.uint8)
    else:
        scale = fp16_scale(blocks.abs().amax(dim=-1), INT4_QMAX)
        stored = scale.to(torch.float16)
    nibbles = quantize_symmetric(blocks, scale[:, None], INT4_QMAX).to(torch.int32) + INT4_OFFSET
    packed = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).to(torch.uint8)
    return packed.reshape(*lead, head_dim // 2), stored.reshape(*lead, head_dim // block)


def rk4_dequantize(packed: torch.Tensor, scales: torch.Tensor, block: int,
                   scale_format: str) -> torch.Tensor:
    """Inverse of rk4_quantize, in fp32 (still in the stored space)."""
    lead, head_dim = packed.shape[:-1], packed.shape[-1] * 2
    nibbles = packed.to(torch.int32)
    codes = torch.stack([nibbles & 0xF, nibbles >> 4], dim=-1) - INT4_OFFSET
    if scale_format == "e8m0":
        scale = e8m0_to_scale(scales)
    else:
        scale = scales.to(torch.float32)
    blocks = codes.to(torch.float32).reshape(*lead, head_dim // block, block)
    return (blocks * scale[..., None]).reshape(*lead, head_dim)


# ------------------------------------------------- rk4 pages (K per channel)

K_LEVELS = 15  # asymmetric 4-bit codes 0..15 for K: x = min + code * step
# rk4p's bf16 pages per sequence: its first pages (attention sinks) and its
# newest pages (BENCHMARKS.md, "rk4p v3": both are needed for top-1; "rk4p at
# 8K on the CPU": three newest pages, not two, keep top-1 over 97% at 8K).
DEFAULT_EXACT_FIRST_PAGES = 1
DEFAULT_EXACT_RECENT_PAGES = 3
MAX_EXACT_PAGES = 4


# K's step per (page, head, channel): an unsigned 8-bit float with 5 exponent
# bits and 3 mantissa bits (no sign: a step is positive), value
# 2**(E - K_STEP_BIAS) * (1 + M/8). The bias is the format's, not the model's:
# 18 spans 2**-18 .. 1.875 * 2**13, which holds every step an fp16 minimum can
# need (a span of up to 2 * 65504 in 15 steps) and goes below fp16's own
# precision at any |min| > 2**-8. Rounding the step up to 3 mantissa bits
# wastes at most 1/8 of K's 16 levels, where e8m0's power of two wasted up to
# half (BENCHMARKS.md, "rk4p v3").
K_STEP_MANTISSA_BITS = 3
K_STEP_EXPONENT_MAX = 31
K_STEP_BIAS = 18
_K_STEP_SHIFT = 23 - K_STEP_MANTISSA_BITS  # fp32 mantissa bits below the step's
_K_STEP_DROPPED = (1 << _K_STEP_SHIFT) - 1
_K_STEP_MANTISSA_MASK = (1 << K_STEP_MANTISSA_BITS) - 1


def k_step_encode(span: torch.Tensor) -> torch.Tensor:
    """uint8 code of the least e5m3 step s with span <= 15 * s: span / 15 in
    fp32, rounded up to 3 mantissa bits on its bits (exact). Steps below the
    smallest code take it; above the largest (beyond fp16 values) saturate,
    and their values clip."""
    span = torch.clamp(span.to(torch.float32), min=0.0)
    # by a tensor, not the scalar: CUDA divides by a scalar as a multiply by
    # its reciprocal, which is not the kernel's IEEE div_rn
    quotient = span / torch.full_like(span, K_LEVELS)
    bits = quotient.view(torch.int32)
    up = ((bits + _K_STEP_DROPPED) >> _K_STEP_SHIFT) << _K_STEP_SHIFT
    exponent = (up >> 23) - E8M0_BIAS + K_STEP_BIAS
    code = (exponent << K_STEP_MANTISSA_BITS) + ((up >> _K_STEP_SHIFT) & _K_STEP_MANTISSA_MASK)
    code = torch.where(exponent < 0, 0, code)
    code = torch.where(exponent > K_STEP_EXPONENT_MAX, 255, code)
    return code.to(torch.uint8)


def k_step_decode(code: torch.Tensor) -> torch.Tensor:
    """The fp32 value of e5m3 step codes, built from bits (exact)."""
    c = code.to(torch.int32)
    bits = (((c >> K_STEP_MANTISSA_BITS) - K_STEP_BIAS + E8M0_BIAS) << 23) \
        | ((c & _K_STEP_MANTISSA_MASK) << _K_STEP_SHIFT)
    return bits.view(torch.float32)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int codes 0..15 [..., D] -> uint8 [..., D/2], channel 2i in the low nibble."""
    codes = codes.to(torch.int32)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    nibbles = packed.to(torch.int32)
    return torch.stack([nibbles & 0xF, nibbles >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def k_page_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Whole pages of K, x [n, P, H, D] (before RoPE) -> (packed codes
    [n, P, H, D/2] uint8, fp16 minimum [n, H, D], e5m3 step code [n, H, D]
    uint8): per (page, head, channel), codes round((x - min) / step) in 0..15,
    the step the least e5m3 value that spans max - min in 15 steps.

    Why per channel along the page's tokens: K carries large per-channel
    offsets that are nearly constant across tokens; a per-token scale spends
    its levels on them (BENCHMARKS.md, "rk4 ablations")."""
    x = x.to(torch.float32)
    lo = torch.clamp(x.amin(dim=1), -FP16_MAX, FP16_MAX).to(torch.float16)
    lo32 = lo.to(torch.float32)
    step_code = k_step_encode(x.amax(dim=1) - lo32)
    step = k_step_decode(step_code)
    # x - lo and the division each round once (IEEE, as the kernel's div_rn).
    codes = round_half_even(torch.clamp((x - lo32[:, None]) / step[:, None], 0.0, K_LEVELS))
    return pack_nibbles(codes), lo, step_code


def k_page_dequantize(packed: torch.Tensor, lo: torch.Tensor,
                      step_code: torch.Tensor) -> torch.Tensor:
    """Inverse of k_page_quantize for per-token rows: packed [..., H, D/2] with
    their page's lo, step_code [..., H, D] (broadcast) -> fp32 [..., H, D].
    code * step is exact (4 + 4 significant bits), so only the sum rounds."""
    codes = unpack_nibbles(packed).to(torch.float32)
    return lo.to(torch.float32) + codes * k_step_decode(step_code)


def page_table_slots(page_table: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    """Slots of a sequence's first `length` tokens, in order."""
    needed = -(-length // page_size)
    if needed > page_table.numel():
        raise ValueError(f"length {length} needs {needed} pages of {page_size}, "
                         f"page table has {page_table.numel()}")
    t = torch.arange(length, device=page_table.device)
    return page_table.to(torch.long)[t // page_size] * page_size + t % page_size


# ------------------------------------------------------------------- formats


def _kernels():
    # Imported on first use: triton is optional on CPU machines, and importing
    # it late lets tests set TRITON_INTERPRET first.
    from engine.kv import kernels
    return kernels


def _check_write_args(slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if k.shape != v.shape or k.dim() != 3 or slots.shape != (k.shape[0],):
        raise ValueError(f"write wants slots [T] and k, v [T, H, D]; got slots "
                         f"{tuple(slots.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")


class KVFormat(ABC):
    """One way of storing a layer's K and V pages.

    Buffers are a dict of tensors [num_pages, page_size, H, ...] per layer.
    `use_triton` picks the path: None means Triton on CUDA tensors and the
    PyTorch reference elsewhere; True/False force it (a per-call argument
    overrides the format's).
    """

    name: str = ""
    # K is stored before the rotary embedding; attention applies it to keys
    # after dequantizing (the model writes pre-RoPE K for such a format).
    k_pre_rope: bool = False
    # Pages still being filled live in a bf16 staging pool and are quantized
    # into their real page once full and committed (seal); page ids >=
    # num_pages in a page table name staging pages.
    uses_staging: bool = False
    # With staging: a sequence's first pages that are never sealed (bf16 for
    # its whole life: attention sinks), and how many of its newest pages stay
    # staged (the page being filled and those before it). open_pages.py.
    exact_first_pages: int = 0
    exact_recent_pages: int = 1

    def __init__(self, use_triton: bool | None = None) -> None:
        self.use_triton = use_triton

    @abstractmethod
    def bits_per_element(self, head_dim: int = 256) -> float:
        """Stored bits per K or V element, scales included."""

    @abstractmethod
    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of K plus V for one token in one layer."""

    @abstractmethod
    def allocate(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 device: torch.device | str) -> dict[str, torch.Tensor]:
        """Zeroed buffers for one layer."""

    @abstractmethod
    def _write_side(self, buffers, side: str, slots, x, triton: bool) -> None: ...

    @abstractmethod
    def _read_side(self, buffers, side: str, page_table, length: int, dtype,
                   triton: bool, rotated: bool, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """One side, dense. `out` (of dtype `dtype`): where a Triton read may
        write directly; the result is then `out` itself."""

    def write(self, buffers: dict[str, torch.Tensor], slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, use_triton: bool | None = None) -> None:
        """Quantize k, v [T, H, D] and store token i at slots[i] (slots unique)."""
        _check_write_args(slots, k, v)
        triton = self._wants_triton(k, use_triton)
        if triton and self._write_pair_triton(buffers, slots, k, v):
            return
        slots = slots.to(torch.long)
        for side, x in (("k", k), ("v", v)):
            self._write_side(buffers, side, slots, x, triton)

    def _write_pair_triton(self, buffers, slots, k, v) -> bool:
        """K and V in one kernel launch, where the format has one (a decode
        step writes one token a layer, so a launch per side was latency, not
        work); False sends the write through _write_side per side."""
        return False

    def read(self, buffers: dict[str, torch.Tensor], page_table: torch.Tensor, length: int,
             dtype: torch.dtype, use_triton: bool | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense (k, v) [length, H, D] in the original (unrotated) space."""
        return self._read_both(buffers, page_table, length, dtype, use_triton, rotated=False)

    def read_rotated(self, buffers: dict[str, torch.Tensor], page_table: torch.Tensor,
                     length: int, dtype: torch.dtype, use_triton: bool | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense (k, v) in the stored space; pair with rotate_query/unrotate_output."""
        return self._read_both(buffers, page_table, length, dtype, use_triton, rotated=True)

    def read_rotated_into(self, buffers: dict[str, torch.Tensor], page_table: torch.Tensor,
                          length: int, k_out: torch.Tensor, v_out: torch.Tensor,
                          use_triton: bool | None = None) -> None:
        """read_rotated into k_out / v_out [length, H, D], in their dtype: the
        Triton reads write there directly (a 100K-token prefix read per layer
        per prefill chunk saves its copy)."""
        triton = self._wants_triton(page_table, use_triton)
        for side, out in (("k", k_out), ("v", v_out)):
            dense = self._read_side(buffers, side, page_table, length, out.dtype, triton, True,
                                    out)
            if dense is not out:
                out.copy_(dense)

    def rotate_query(self, q: torch.Tensor) -> torch.Tensor:
        """Map a query into the stored space (identity unless rotated)."""
        return q

    def unrotate_output(self, o: torch.Tensor, dtype: torch.dtype | None = None
                        ) -> torch.Tensor:
        """Map attention output over stored V back (identity unless rotated),
        in `dtype` (default o's): the caller's cast, done in the same pass."""
        return o if dtype is None else o.to(dtype)

    def _read_both(self, buffers, page_table, length, dtype, use_triton, rotated):
        triton = self._wants_triton(page_table, use_triton)
        return tuple(self._read_side(buffers, side, page_table, length, dtype, triton, rotated)
                     for side in ("k", "v"))

    def _wants_triton(self, tensor: torch.Tensor, override: bool | None) -> bool:
        choice = self.use_triton if override is None else override
        return tensor.is_cuda if choice is None else bool(choice)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class Bf16Format(KVFormat):
    """Unquantized K, V in the compute dtype (bf16 by default)."""

    name = "bf16"

    def __init__(self, dtype: torch.dtype = torch.bfloat16, use_triton: bool | None = None):
        super().__init__(use_triton)
        self.dtype = dtype

    def bits_per_element(self, head_dim: int = 256) -> float:
        return float(self.dtype.itemsize * 8)

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> int:
        return 2 * num_kv_heads * head_dim * self.dtype.itemsize

    def allocate(self, num_pages, page_size, num_kv_heads, head_dim, device):
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        return {side: torch.zeros(shape, dtype=self.dtype, device=device) for side in ("k", "v")}

    def _write_pair_triton(self, buffers, slots, k, v) -> bool:
        # nothing to quantize, but one dependent launch for both sides where
        # torch's scatter took two that waited for the kernel before them
        _kernels().dense_write(k.to(self.dtype), v.to(self.dtype), slots, buffers)
        return True

    def _write_side(self, buffers, side, slots, x, triton):
        # the reference path: a plain scatter
        buf = buffers[side]
        buf.view(-1, *buf.shape[2:]).index_copy_(0, slots, x.to(self.dtype))

    def _read_side(self, buffers, side, page_table, length, dtype, triton, rotated, out=None):
        buf = buffers[side]
        slots = page_table_slots(page_table, length, buf.shape[1])
        return buf.view(-1, *buf.shape[2:])[slots].to(dtype)


class Int8Format(KVFormat):
    """Symmetric int8 per (token, head) with one fp16 scale (amax / 127)."""

    name = "int8"

    def bits_per_element(self, head_dim: int = 256) -> float:
        return 8.0 + 16.0 / head_dim

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> int:
        return 2 * num_kv_heads * (head_dim + 2)

    def allocate(self, num_pages, page_size, num_kv_heads, head_dim, device):
        token_shape = (num_pages, page_size, num_kv_heads)
        buffers = {}
        for side in ("k", "v"):
            buffers[f"{side}_codes"] = torch.zeros(*token_shape, head_dim, dtype=torch.int8,
                                                   device=device)
            buffers[f"{side}_scales"] = torch.zeros(token_shape, dtype=torch.float16, device=device)
        return buffers

    def _write_pair_triton(self, buffers, slots, k, v) -> bool:
        _kernels().int8_write(k, v, slots, buffers)
        return True

    def _write_side(self, buffers, side, slots, x, triton):
        # the reference path only: the Triton one writes K and V together
        codes, scales = buffers[f"{side}_codes"], buffers[f"{side}_scales"]
        c, s = int8_quantize(x)
        codes.view(-1, *codes.shape[2:])[slots] = c
        scales.view(-1, scales.shape[2])[slots] = s

    def _read_side(self, buffers, side, page_table, length, dtype, triton, rotated, out=None):
        codes, scales = buffers[f"{side}_codes"], buffers[f"{side}_scales"]
        if triton:
            if out is None:
                out = torch.empty(length, *codes.shape[2:], dtype=dtype, device=codes.device)
            return _kernels().int8_read(codes, scales, page_table, length, out)
        slots = page_table_slots(page_table, length, codes.shape[1])
        flat_codes = codes.view(-1, *codes.shape[2:])
        flat_scales = scales.view(-1, scales.shape[2])
        return int8_dequantize(flat_codes[slots], flat_scales[slots]).to(dtype)


HADAMARD_KERNEL_ENV = "TANDEM_HADAMARD_KERNEL"


def hadamard_kernel_wanted() -> bool:
    """Rotate rk4/rk4p rows with the Triton FWHT (hadamard_kernels.py)
    instead of an fp32 matmul by R; TANDEM_HADAMARD_KERNEL=0 gives the
    matmul back. On by default: on the H200 it made every rk4 and rk4p step
    faster in four alternating A/B pairs (0.2-0.5 ms at 4K and 128K,
    2026-12-03 07:48, scripts/device_hadamard.sh)."""
    return on_off(HADAMARD_KERNEL_ENV, True, on="the Triton Hadamard kernel",
                  off="an fp32 matmul by R")


FUSED_ROTATION_ENV = "TANDEM_RK4_FUSED_ROTATION"
# Where a rotation can be folded into the kernel beside it: K and V into the
# KV write, q into rk4's attention kernel, the output's way back into the
# split combine. Each saves a launch of the Hadamard row kernel and stores
# the same bits.
FUSED_ROTATION_SITES = ("write", "query", "combine")
DEFAULT_FUSED_ROTATION = frozenset(FUSED_ROTATION_SITES)


def fused_rotation_sites() -> frozenset[str]:
    """The sites (FUSED_ROTATION_SITES) whose kernels rotate for themselves
    where the Hadamard kernel is used: TANDEM_RK4_FUSED_ROTATION as "all"
    (or 1), "none" (or 0: the row kernel launched for every rotation) or a
    comma-separated list of sites; DEFAULT_FUSED_ROTATION when unset."""
    value = os.environ.get(FUSED_ROTATION_ENV, "").strip()
    if value == "":
        return DEFAULT_FUSED_ROTATION
    if value in ("1", "all"):
        return frozenset(FUSED_ROTATION_SITES)
    if value in ("0", "none"):
        return frozenset()
    sites = frozenset(part.strip() for part in value.split(","))
    if not sites <= set(FUSED_ROTATION_SITES):
        raise ValueError(f"{FUSED_ROTATION_ENV}={value!r}: give all, none or a comma-separated "
                         f"list of {', '.join(FUSED_ROTATION_SITES)}")
    return sites


def _hadamard_kernels():
    # Imported on first use, like _kernels().
    from engine.kv import hadamard_kernels
    return hadamard_kernels


class _SeededRotation:
    """The fixed orthogonal rotation of a rotated format (its `seed`), built
    once per head size and device, and how rows get rotated by it: today's
    fp32 matmul by R, or, on the format's Triton path with a power-of-two
    head_dim (unless TANDEM_HADAMARD_KERNEL=0), the Hadamard kernel, which never
    builds R (the two agree to fp32 rounding)."""
    seed: int
    rotate: bool = True  # rk4's ablation turns it off; rk4p always rotates V
    _rotations: dict[tuple[int, str], torch.Tensor]
    _signs: dict[tuple[int, str], torch.Tensor]

    def _rotation(self, head_dim: int, device: torch.device) -> torch.Tensor:
        key = (head_dim, str(device))
        if key not in self._rotations:
            self._rotations[key] = rotation.rotation_matrix(head_dim, self.seed, device)
        return self._rotations[key]

    def rotation_signs(self, head_dim: int, device: torch.device) -> torch.Tensor:
        """R's seeded ±1 vector, fp32: all a kernel needs of R (a power-of-two
        head_dim, where rotates_in_kernels holds)."""
        key = (head_dim, str(device))
        if key not in self._signs:
            self._signs[key] = rotation.hadamard_signs(head_dim, self.seed).to(
                device=device, dtype=torch.float32)
        return self._signs[key]

    def _uses_hadamard_kernel(self, x: torch.Tensor, use_triton: bool | None) -> bool:
        # The switch is read last, so the CPU path never looks at it.
        return (self._wants_triton(x, use_triton)
                and _hadamard_kernels().supports_dim(x.shape[-1])
                and hadamard_kernel_wanted())

    def rotates_in_kernels(self, x: torch.Tensor, site: str,
                           use_triton: bool | None = None) -> bool:
        """Whether the kernel at `site` (FUSED_ROTATION_SITES) applies the
        rotation itself: x on the Triton path with the Hadamard kernel, and
        the site among fused_rotation_sites()."""
        return (self.rotate and self._uses_hadamard_kernel(x, use_triton)
                and site in fused_rotation_sites())

    def _rotate_rows(self, x: torch.Tensor, inverse: bool, out_dtype: torch.dtype,
                     use_triton: bool | None = None) -> torch.Tensor:
        """x @ R (inverse: x @ R.T) over the last dim, computed in fp32 and
        returned in out_dtype. The kernel stores bf16 itself (rounded to
        nearest even, as .to() does); other dtypes go through fp32."""
        head_dim = x.shape[-1]
        if self._uses_hadamard_kernel(x, use_triton):
            signs = self.rotation_signs(head_dim, x.device)
            direct = out_dtype in (torch.float32, torch.bfloat16)
            out = _hadamard_kernels().hadamard_rotate_rows(
                x, signs, inverse, out_dtype if direct else torch.float32)
            return out.to(out_dtype)
        r = self._rotation(head_dim, x.device)
        return (rotation.unrotate(x, r) if inverse else rotation.rotate(x, r)).to(out_dtype)


class RotatedInt4Format(_SeededRotation, KVFormat):
    """rk4: rotate over head_dim, then 4-bit block quantization (see module doc).

    Options: block (16/32/64 channels per scale), scale_format ("e8m0": a uint8
    power-of-two exponent chosen by error search; "fp16": amax / 7), rotate
    (False only for ablation), seed (of the rotation).

    Default fp16 scales with block 32 (4.5 bits): on Gaussian data with x10
    outlier channels it had the least error within the 4.5-bit budget
    (relative RMS 0.091, vs 0.103 for e8m0/16 at the same bits and 0.108 for
    e8m0/32 at 4.25); the real-model ablation may revise this.
    """

    name = "rk4"

    def __init__(self, block: int = 32, scale_format: str = "fp16", rotate: bool = True,
                 seed: int = rotation.DEFAULT_ROTATION_SEED, use_triton: bool | None = None):
        super().__init__(use_triton)
        if block not in RK4_BLOCKS:
            raise ValueError(f"rk4 block must be one of {RK4_BLOCKS}, got {block}")
        if scale_format not in RK4_SCALE_FORMATS:
            raise ValueError(f"rk4 scale_format must be one of {RK4_SCALE_FORMATS}, "
                             f"got {scale_format!r}")
        self.block, self.scale_format, self.rotate, self.seed = block, scale_format, rotate, seed
        if self.bits_per_element() > RK4_BITS_BUDGET:
            raise ValueError(f"rk4 with {scale_format} scales and block {block} costs "
                             f"{self.bits_per_element()} bits per element, over the "
                             f"{RK4_BITS_BUDGET}-bit budget; use a larger block or e8m0")
        self._rotations: dict[tuple[int, str], torch.Tensor] = {}
        self._signs: dict[tuple[int, str], torch.Tensor] = {}

    def __repr__(self) -> str:
        return (f"RotatedInt4Format(block={self.block}, scale_format={self.scale_format!r}, "
                f"rotate={self.rotate})")

    def bits_per_element(self, head_dim: int = 256) -> float:
        return 4.0 + SCALE_BITS[self.scale_format] / self.block

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> int:
        self._check_head_dim(head_dim)
        scale_bytes = SCALE_BITS[self.scale_format] // 8
        return 2 * num_kv_heads * (head_dim // 2 + head_dim // self.block * scale_bytes)

    def allocate(self, num_pages, page_size, num_kv_heads, head_dim, device):
        self._check_head_dim(head_dim)
        token_shape = (num_pages, page_size, num_kv_heads)
        scale_dtype = torch.uint8 if self.scale_format == "e8m0" else torch.float16
        buffers = {}
        for side in ("k", "v"):
            buffers[f"{side}_codes"] = torch.zeros(*token_shape, head_dim // 2, dtype=torch.uint8,
                                                   device=device)
            buffers[f"{side}_scales"] = torch.zeros(*token_shape, head_dim // self.block,
                                                    dtype=scale_dtype, device=device)
        return buffers

    def rotate_query(self, q: torch.Tensor) -> torch.Tensor:
        if not self.rotate:
            return q
        return self._rotate_rows(q, inverse=False, out_dtype=q.dtype)

    def unrotate_output(self, o: torch.Tensor, dtype: torch.dtype | None = None
                        ) -> torch.Tensor:
        if not self.rotate:
            return o if dtype is None else o.to(dtype)
        return self._rotate_rows(o, inverse=True, out_dtype=dtype or o.dtype)

    def to_stored_space(self, x: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
        """fp32 x @ R (or x itself, unrotated): the quantizer's input."""
        if not self.rotate:
            return x.to(torch.float32)
        return self._rotate_rows(x, inverse=False, out_dtype=torch.float32,
                                 use_triton=use_triton)

    def _write_pair_triton(self, buffers, slots, k, v) -> bool:
        self._check_head_dim(k.shape[-1])
        if self.rotates_in_kernels(k, "write", use_triton=True):
            _kernels().rk4_rotate_write_kv(k, v, self.rotation_signs(k.shape[-1], k.device),
                                           slots, buffers, self.block, self.scale_format)
            return True
        _kernels().rk4_write_kv(self.to_stored_space(k, use_triton=True),
                                self.to_stored_space(v, use_triton=True), slots, buffers,
                                self.block, self.scale_format)
        return True

    def _write_side(self, buffers, side, slots, x, triton):
        # the reference path only: the Triton one writes K and V together
        self._check_head_dim(x.shape[-1])
        codes, scales = buffers[f"{side}_codes"], buffers[f"{side}_scales"]
        stored = self.to_stored_space(x, use_triton=False)
        c, s = rk4_quantize(stored, self.block, self.scale_format)
        codes.view(-1, *codes.shape[2:])[slots] = c
        scales.view(-1, *scales.shape[2:])[slots] = s

    def _read_side(self, buffers, side, page_table, length, dtype, triton, rotated, out=None):
        codes, scales = buffers[f"{side}_codes"], buffers[f"{side}_scales"]
        back_to_original = self.rotate and not rotated
        # Un-rotating needs the fp32 values; rounding to dtype first would add
        # a second rounding error.
        dense_dtype = torch.float32 if back_to_original else dtype
        if triton:
            dense = out if out is not None and out.dtype == dense_dtype else torch.empty(
                length, codes.shape[2], codes.shape[3] * 2, dtype=dense_dtype,
                device=codes.device)
            _kernels().rk4_read(codes, scales, page_table, length, dense, self.block,
                                self.scale_format)
        else:
            slots = page_table_slots(page_table, length, codes.shape[1])
            dense = rk4_dequantize(codes.view(-1, *codes.shape[2:])[slots],
                                   scales.view(-1, *scales.shape[2:])[slots],
                                   self.block, self.scale_format).to(dense_dtype)
        if back_to_original:
            dense = rotation.unrotate(dense, self._rotation(dense.shape[-1], dense.device))
        return dense.to(dtype)

    def _check_head_dim(self, head_dim: int) -> None:
        if head_dim % self.block:
            raise ValueError(f"rk4 block {self.block} does not divide head_dim {head_dim}")


class PagedRk4Format(_SeededRotation, KVFormat):
    """rk4: 4-bit KV in 32-token pages, K and V treated differently (see
    docs/ARCHITECTURE.md, "rk4", and BENCHMARKS.md for the measurements).

    K, stored before RoPE, per (page, head, channel) along the page's tokens:
    asymmetric codes 0..15 with an fp16 minimum and an 8-bit float (e5m3)
    step, 4 + 24/32 = 4.75 bits. V, rotated over head_dim (rotation.py), per
    token: symmetric codes -7..7 with one fp16 scale per `v_block` channels,
    4 + 16/64 = 4.25 bits. 4.5 bits per element on average.

    A page can only be quantized once all its tokens are known, so the pages a
    sequence is still filling (and any holding unverified speculative tokens)
    live in a bf16 staging pool: page ids >= num_pages in a page table are
    staging page (id - num_pages). Staging holds K before RoPE and V rotated,
    so seal() quantizes it as is. Writes to real pages must cover whole pages
    (a prefill chunk's full pages), writes to staging pages any tokens.

    exact_first_pages: a sequence's first pages (its attention sinks) are
    never sealed; they stay in bf16 staging for the sequence's life.
    exact_recent_pages: its newest pages stay staged too (3: the page being
    filled and the two before, so the newest 64-95 tokens are exact). Both
    are a fixed cost per sequence, not per token, so outside
    bits_per_element (open_pages.py; BENCHMARKS.md, "rk4p v3").

    Buffers: k_codes, v_codes [N, P, H, D/2] uint8 (channel 2i in the low
    nibble); k_min [N, H, D] fp16; k_step [N, H, D] uint8 (e5m3 code,
    k_step_decode); v_scales [N, P, H, D/v_block] fp16; k_open, v_open
    [S, P, H, D] bf16.
    """

    name = "rk4p"
    k_pre_rope = True
    uses_staging = True

    def __init__(self, page_size: int = 32, v_block: int = 64,
                 exact_first_pages: int = DEFAULT_EXACT_FIRST_PAGES,
                 exact_recent_pages: int = DEFAULT_EXACT_RECENT_PAGES,
                 seed: int = rotation.DEFAULT_ROTATION_SEED, use_triton: bool | None = None):
        super().__init__(use_triton)
        if v_block not in RK4_BLOCKS:
            raise ValueError(f"rk4 v_block must be one of {RK4_BLOCKS}, got {v_block}")
        if page_size < 1:
            raise ValueError(f"rk4 page_size must be >= 1, got {page_size}")
        for name, value, lowest in (("exact_first_pages", exact_first_pages, 0),
                                    ("exact_recent_pages", exact_recent_pages, 1)):
            if isinstance(value, bool) or not isinstance(value, int) \
                    or not lowest <= value <= MAX_EXACT_PAGES:
                raise ValueError(f"rk4p {name} must be an int in {lowest}..{MAX_EXACT_PAGES}, "
                                 f"got {value!r}")
        self.page_size, self.v_block, self.seed = page_size, v_block, seed
        self.exact_first_pages = exact_first_pages
        self.exact_recent_pages = exact_recent_pages
        if self.bits_per_element() > RK4_BITS_BUDGET:
            raise ValueError(f"rk4 with {page_size}-token pages and v_block {v_block} costs "
                             f"{self.bits_per_element():g} bits per element, over the "
                             f"{RK4_BITS_BUDGET}-bit budget; use larger pages or blocks")
        self._rotations: dict[tuple[int, str], torch.Tensor] = {}
        self._signs: dict[tuple[int, str], torch.Tensor] = {}

    def __repr__(self) -> str:
        return (f"PagedRk4Format(page_size={self.page_size}, v_block={self.v_block}, "
                f"exact_first_pages={self.exact_first_pages}, "
                f"exact_recent_pages={self.exact_recent_pages})")

    def k_bits(self) -> float:
        return 4.0 + 24.0 / self.page_size

    def v_block_for(self, head_dim: int) -> int:
        """V's scale block: v_block, or the whole head for narrower heads
        (tiny test shapes; the budget holds for head_dim >= v_block)."""
        return min(self.v_block, head_dim)

    def v_bits(self, head_dim: int = 256) -> float:
        return 4.0 + 16.0 / self.v_block_for(head_dim)

    def bits_per_element(self, head_dim: int = 256) -> float:
        return (self.k_bits() + self.v_bits(head_dim)) / 2

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> int:
        self._check_head_dim(head_dim)
        # K's per-page min and step (3 bytes per channel) spread over the page
        k = head_dim // 2 + -(-3 * head_dim // self.page_size)
        v = head_dim // 2 + 2 * (head_dim // self.v_block_for(head_dim))
        return num_kv_heads * (k + v)

    def staging_bytes_per_page(self, num_kv_heads: int, head_dim: int) -> int:
        return 2 * self.page_size * num_kv_heads * head_dim * 2

    def allocate(self, num_pages, page_size, num_kv_heads, head_dim, device):
        self._check_head_dim(head_dim)
        self._check_page_size(page_size)
        n, h, d = num_pages, num_kv_heads, head_dim
        u8, f16 = torch.uint8, torch.float16
        return {
            "k_codes": torch.zeros(n, page_size, h, d // 2, dtype=u8, device=device),
            "k_min": torch.zeros(n, h, d, dtype=f16, device=device),
            "k_step": torch.zeros(n, h, d, dtype=u8, device=device),
            "v_codes": torch.zeros(n, page_size, h, d // 2, dtype=u8, device=device),
            "v_scales": torch.zeros(n, page_size, h, d // self.v_block_for(d), dtype=f16,
                                    device=device),
        }

    def allocate_staging(self, staging_pages, page_size, num_kv_heads, head_dim, device):
        """bf16 staging pages (K before RoPE, V rotated) for open pages."""
        self._check_page_size(page_size)
        shape = (staging_pages, page_size, num_kv_heads, head_dim)
        return {side: torch.zeros(shape, dtype=torch.bfloat16, device=device)
                for side in ("k_open", "v_open")}

    # --- rotation of V ----------------------------------------------------
    def rotate_query(self, q: torch.Tensor) -> torch.Tensor:
        return q  # K is not rotated

    def unrotate_output(self, o: torch.Tensor, dtype: torch.dtype | None = None
                        ) -> torch.Tensor:
        return self._rotate_rows(o, inverse=True, out_dtype=dtype or o.dtype)

    def rotate_v(self, v: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
        """fp32 v @ R: V as stored."""
        return self._rotate_rows(v, inverse=False, out_dtype=torch.float32,
                                 use_triton=use_triton)

    # --- write ------------------------------------------------------------
    def write(self, buffers, slots, k, v, use_triton=None):
        """k (before RoPE), v [T, H, D] to slots: staging slots take any tokens,
        real pages must be written whole (all page_size tokens in this call)."""
        _check_write_args(slots, k, v)
        self._check_head_dim(k.shape[-1])
        triton = self._wants_triton(k, use_triton)
        slots = slots.to(torch.long)
        v_rot = self.rotate_v(v, use_triton=triton)
        if triton:
            _kernels().paged_rk4_write(k, v_rot, slots, buffers, self.v_block_for(k.shape[-1]))
            return
        num_pages, page_size = buffers["k_codes"].shape[:2]
        staged = slots >= num_pages * page_size
        if staged.any():
            open_slots = slots[staged] - num_pages * page_size
            _flat(buffers["k_open"]).index_copy_(0, open_slots, k[staged].to(torch.bfloat16))
            _flat(buffers["v_open"]).index_copy_(0, open_slots, v_rot[staged].to(torch.bfloat16))
        real = ~staged
        if real.any():
            self._write_pages(buffers, slots[real], k[real].float(), v_rot[real])

    def _write_pages(self, buffers, slots, k, v_rot) -> None:
        """Quantize whole real pages: k [n*P, H, D] fp32, v_rot likewise."""
        page_size = buffers["k_codes"].shape[1]
        order = torch.argsort(slots)
        slots, k, v_rot = slots[order], k[order], v_rot[order]
        pages = slots[::page_size] // page_size
        whole = slots.numel() % page_size == 0 and torch.equal(
            slots, (pages[:, None] * page_size
                    + torch.arange(page_size, device=slots.device)).reshape(-1))
        if not whole:
            raise ValueError(f"rk4 writes real pages whole ({page_size} tokens each); got "
                             f"slots {slots.tolist()[:8]}...: a partial page belongs in a "
                             "staging page until it is full")
        heads, dim = k.shape[1:]
        codes, lo, step = k_page_quantize(k.reshape(-1, page_size, heads, dim))
        buffers["k_codes"][pages] = codes
        buffers["k_min"][pages] = lo
        buffers["k_step"][pages] = step
        v_codes, v_scales = rk4_quantize(v_rot, self.v_block_for(dim), "fp16")
        _flat(buffers["v_codes"])[slots] = v_codes
        _flat(buffers["v_scales"])[slots] = v_scales

    def seal(self, buffers, staging_ids: torch.Tensor, page_ids: torch.Tensor,
             use_triton: bool | None = None) -> None:
        """Quantize full staging pages into real pages (staging_ids[i] -> page_ids[i])."""
        staging_ids = staging_ids.to(torch.long)
        page_ids = page_ids.to(torch.long)
        if staging_ids.numel() == 0:
            return
        num_pages, page_size = buffers["k_codes"].shape[:2]
        if int(page_ids.max()) >= num_pages or int(staging_ids.max()) >= buffers["k_open"].shape[0]:
            raise ValueError(f"seal: page ids must be < {num_pages} and staging ids < "
                             f"{buffers['k_open'].shape[0]}")
        k = buffers["k_open"][staging_ids].float().flatten(0, 1)
        v_rot = buffers["v_open"][staging_ids].float().flatten(0, 1)
        slots = (page_ids[:, None] * page_size
                 + torch.arange(page_size, device=page_ids.device)).reshape(-1)
        if self._wants_triton(k, use_triton):
            _kernels().paged_rk4_write(k, v_rot, slots, buffers, self.v_block_for(k.shape[-1]))
        else:
            self._write_pages(buffers, slots, k, v_rot)

    def _write_side(self, buffers, side, slots, x, triton):
        raise NotImplementedError("PagedRk4Format writes K and V together (write)")

    # --- read -------------------------------------------------------------
    def _read_side(self, buffers, side, page_table, length, dtype, triton, rotated, out=None):
        num_pages, page_size = buffers["k_codes"].shape[:2]
        slots = page_table_slots(page_table, length, page_size)
        staged = slots >= num_pages * page_size
        real_slots = torch.where(staged, 0, slots)
        open_slots = torch.where(staged, slots - num_pages * page_size, 0)
        if side == "k":
            pages = real_slots // page_size
            dense = k_page_dequantize(_flat(buffers["k_codes"])[real_slots],
                                      buffers["k_min"][pages], buffers["k_step"][pages])
        else:
            dense = rk4_dequantize(_flat(buffers["v_codes"])[real_slots],
                                   _flat(buffers["v_scales"])[real_slots],
                                   self.v_block_for(buffers["k_min"].shape[-1]), "fp16")
        if staged.any():
            exact = _flat(buffers[f"{side}_open"])[open_slots].float()
            dense = torch.where(staged[:, None, None], exact, dense)
        if side == "v" and not rotated:
            dense = rotation.unrotate(dense, self._rotation(dense.shape[-1], dense.device))
        return dense.to(dtype)

    def _check_head_dim(self, head_dim: int) -> None:
        if head_dim % self.v_block_for(head_dim) or head_dim % 2:
            raise ValueError(f"rk4 v_block {self.v_block} does not divide head_dim {head_dim}")

    def _check_page_size(self, page_size: int) -> None:
        if page_size != self.page_size:
            raise ValueError(f"rk4 is set up for {self.page_size}-token pages (its K scales "
                             f"are per page), got pages of {page_size}; use --page-size "
                             f"{self.page_size} or rk4:page_size={page_size}")


def _flat(buffer: torch.Tensor) -> torch.Tensor:
    """[pages, page_size, ...] -> [slots, ...]."""
    return buffer.view(-1, *buffer.shape[2:])


FORMATS: dict[str, type[KVFormat]] = {
    "bf16": Bf16Format,
    "int8": Int8Format,
    "rk4": RotatedInt4Format,
    "rk4p": PagedRk4Format,
}


def default_page_size(name: str) -> int:
    """16 tokens, but 32 for a format that quantizes whole pages (rk4p): its
    per-page K scales cost 24 / page_size bits per element, within the
    4.5-bit budget only from 32 tokens on."""
    return 32 if getattr(FORMATS.get(name), "uses_staging", False) else 16


def make_format(name: str, **options) -> KVFormat:
    """Build a KV format by name with its options (see each class)."""
    if name not in FORMATS:
        raise ValueError(f"unknown KV format {name!r}; known formats: {', '.join(FORMATS)}")
    return FORMATS[name](**options)
