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
        two or fp16), two codes packed per byte.

A slot is page * page_size + offset. write() takes a slot per token; read()
takes a sequence's page table and length and returns dense [length, H, D].

Every quantizer here is the reference for a Triton kernel in kernels.py; the
two must agree bit for bit on codes and scales, so each step below is written
with an exactly reproducible float operation (IEEE division, exact power-of-two
scaling, round-half-to-even) and the kernels mirror them step by step.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.kv import rotation

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
                   triton: bool, rotated: bool) -> torch.Tensor: ...

    def write(self, buffers: dict[str, torch.Tensor], slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, use_triton: bool | None = None) -> None:
        """Quantize k, v [T, H, D] and store token i at slots[i] (slots unique)."""
        _check_write_args(slots, k, v)
        triton = self._wants_triton(k, use_triton)
        slots = slots.to(torch.long)
        for side, x in (("k", k), ("v", v)):
            self._write_side(buffers, side, slots, x, triton)

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

    def rotate_query(self, q: torch.Tensor) -> torch.Tensor:
        """Map a query into the stored space (identity unless rotated)."""
        return q

    def unrotate_output(self, o: torch.Tensor) -> torch.Tensor:
        """Map attention output over stored V back (identity unless rotated)."""
        return o

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

    def _write_side(self, buffers, side, slots, x, triton):
        # A plain scatter: nothing to quantize, so no kernel of our own.
        buf = buffers[side]
        buf.view(-1, *buf.shape[2:]).index_copy_(0, slots, x.to(self.dtype))

    def _read_side(self, buffers, side, page_table, length, dtype, triton, rotated):
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

    def _write_side(self, buffers, side, slots, x, triton):
        codes, scales = buffers[f"{side}_codes"], buffers[f"{side}_scales"]
        if triton:
            _kernels().int8_write(x, slots, codes, scales)
            return
        c, s = int8_quantize(x)
        codes.view(-1, *codes.shape[2:])[slots] = c
        scales.view(-1, scales.shape[2])[slots] = s

    def _read_side(self, buffers, side, page_table, length, dtype, triton, rotated):
        codes, scales = buffers[f"{side}_codes"], buffers[f"{side}_scales"]
        if triton:
            out = torch.empty(length, *codes.shape[2:], dtype=dtype, device=codes.device)
            return _kernels().int8_read(codes, scales, page_table, length, out)
        slots = page_table_slots(page_table, length, codes.shape[1])
        flat_codes = codes.view(-1, *codes.shape[2:])
        flat_scales = scales.view(-1, scales.shape[2])
        return int8_dequantize(flat_codes[slots], flat_scales[slots]).to(dtype)


class RotatedInt4Format(KVFormat):
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
        return rotation.rotate(q, self._rotation(q.shape[-1], q.device)).to(q.dtype)

    def unrotate_output(self, o: torch.Tensor) -> torch.Tensor:
        if not self.rotate:
            return o
        return rotation.unrotate(o, self._rotation(o.shape[-1], o.device)).to(o.dtype)

    def to_stored_space(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 x @ R (or x itself, unrotated): the quantizer's input."""
        if not self.rotate:
            return x.to(torch.float32)
        return rotation.rotate(x, self._rotation(x.shape[-1], x.device))

    def _write_side(self, buffers, side, slots, x, triton):
        self._check_head_dim(x.shape[-1])
        codes, scales = buffers[f"{side}_codes"], buffers[f"{side}_scales"]
        stored = self.to_stored_space(x)
        if triton:
            _kernels().rk4_write(stored, slots, codes, scales, self.block, self.scale_format)
            return
        c, s = rk4_quantize(stored, self.block, self.scale_format)
        codes.view(-1, *codes.shape[2:])[slots] = c
        scales.view(-1, *scales.shape[2:])[slots] = s

    def _read_side(self, buffers, side, page_table, length, dtype, triton, rotated):
        codes, scales = buffers[f"{side}_codes"], buffers[f"{side}_scales"]
        back_to_original = self.rotate and not rotated
        # Un-rotating needs the fp32 values; rounding to dtype first would add
        # a second rounding error.
        dense_dtype = torch.float32 if back_to_original else dtype
        if triton:
            dense = torch.empty(length, codes.shape[2], codes.shape[3] * 2, dtype=dense_dtype,
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

    def _rotation(self, head_dim: int, device: torch.device) -> torch.Tensor:
        key = (head_dim, str(device))
        if key not in self._rotations:
            self._rotations[key] = rotation.rotation_matrix(head_dim, self.seed, device)
        return self._rotations[key]

    def _check_head_dim(self, head_dim: int) -> None:
        if head_dim % self.block:
            raise ValueError(f"rk4 block {self.block} does not divide head_dim {head_dim}")


FORMATS: dict[str, type[KVFormat]] = {
    "bf16": Bf16Format,
    "int8": Int8Format,
    "rk4": RotatedInt4Format,
}


def make_format(name: str, **options) -> KVFormat:
    """Build a KV format by name with its options (see each class)."""
    if name not in FORMATS:
        raise ValueError(f"unknown KV format {name!r}; known formats: {', '.join(FORMATS)}")
    return FORMATS[name](**options)
