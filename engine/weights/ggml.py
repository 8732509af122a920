"""ggml's block formats (llama.cpp's quantization types), decoded by us.

Owns turning the raw bytes of one GGUF tensor ([rows, row_bytes] uint8, as
the file stores it) into a QuantTensor (engine/quant/tensor.py) without
re-quantizing: the codes, the two-level scales and the minimums are the
file's own, so QuantTensor.dequantize() equals llama.cpp's (and the gguf
package's) dequantization bit for bit. Float types decode to a dense tensor.

Block layouts (per llama.cpp ggml-common.h; sizes in bytes):
  Q4_0 (18/32):  d f16, qs[16]: k < 16 low nibbles, k >= 16 high nibbles; w = d (q - 8)
  Q4_1 (20/32):  d f16, m f16, qs[16] as Q4_0; w = d q + m
  Q5_0 (22/32):  d, qh u32 (bit k = 5th bit of k), qs[16]; w = d (q - 16)
  Q5_1 (24/32):  d, m, qh, qs; w = d q + m
  Q8_0 (34/32):  d, qs int8[32]; w = d q
  Q4_K (144/256): d, dmin f16, scales[12] (6-bit sc and m of 8 groups of 32),
                  qs[128]: chunk c (of 4, 64 weights) low nibbles are k = 64c + l,
                  high nibbles 64c + 32 + l; w = d sc q - dmin m
  Q5_K (176/256): d, dmin, scales[12], qh[32] (bit 2c / 2c+1 of qh[l]), qs[128]
  Q6_K (210/256): ql[128], qh[64], scales int8[16] (groups of 16), d;
                  w = d sc (q - 32)
Must not know tensor names, models or files.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.quant.tensor import QuantTensor

QK_K = 256

# type name -> (block weights, block bytes)
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
          "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
FLOATS = {"F32": np.float32, "F16": np.float16}
SUPPORTED = sorted([*BLOCKS, *FLOATS, "BF16"])


class UnsupportedGGMLType(ValueError):
    """A ggml type tandem does not decode."""


# type -> (code bits as packed, group, superblock, asymmetric): QuantTensor's layout
PACKED = {"Q4_0": (4, 32, 32, True), "Q4_1": (4, 32, 32, True), "Q5_0": (8, 32, 32, False),
          "Q5_1": (8, 32, 32, True), "Q8_0": (8, 32, 32, False), "Q4_K": (4, 32, 256, True),
          "Q5_K": (8, 32, 256, True), "Q6_K": (8, 16, 256, False)}


def packed_nbytes(type_name: str, rows: int, cols: int) -> int:
    """Bytes of decode_blocks(...)'s QuantTensor for a [rows, cols] tensor."""
    bits, group, superblock, asym = PACKED[type_name]
    per_group, per_super = (2, 4) if asym else (1, 2)
    return (rows * cols * bits // 8 + rows * (cols // group) * per_group
            + rows * (cols // superblock) * per_super)


def is_quantized(type_name: str) -> bool:
    return type_name in BLOCKS


def decode_dense(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A float tensor (F32/F16/BF16) as fp32 of `shape` (HF dim order)."""
    if type_name in FLOATS:
        values = np.asarray(data).view(FLOATS[type_name]).astype(np.float32)
    elif type_name == "BF16":
        bits = np.asarray(data).view(np.uint16).astype(np.uint32) << 16
        values = bits.view(np.float32)
    else:
        raise UnsupportedGGMLType(f"ggml type {type_name} is not a float type")
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)


def decode_blocks(data: np.ndarray, type_name: str, rows: int, cols: int) -> QuantTensor:
    """The QuantTensor [rows, cols] of a block-quantized tensor's raw bytes."""
    if type_name not in BLOCKS:
        raise UnsupportedGGMLType(f"ggml type {type_name} is not supported; tandem decodes "
                                  f"{SUPPORTED}")
    size, nbytes = BLOCKS[type_name]
    if cols % size:
        raise ValueError(f"{type_name} rows hold whole blocks of {size}; a row of {cols} does not")
    raw = np.ascontiguousarray(np.asarray(data, dtype=np.uint8)).reshape(-1)
    if raw.size != rows * cols // size * nbytes:
        raise ValueError(f"{type_name} [{rows}, {cols}] needs {rows * cols // size * nbytes} "
                         f"bytes, got {raw.size}")
    blocks = raw.reshape(rows * cols // size, nbytes)
    parts = _DECODERS[type_name](blocks)
    return _to_quant_tensor(parts, rows, cols)


# ---------------------------------------------------------------- decoders
# Each returns (bits, codes [nb, block], d [nb, S-per-block], sc [nb, groups],
# dmin or None, m or None); all numpy.


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """Q4_0-style: low nibbles are weights 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: bit k of the little-endian u32 is weight k's 5th bit."""
    bits = np.ascontiguousarray(qh).view("<u4")[:, :1] >> np.arange(32, dtype=np.uint32)
    return ((bits & 1) << 4).astype(np.uint8)


def _ones(nb: int, n: int = 1) -> np.ndarray:
    return np.ones((nb, n), dtype=np.int8)


def _q4_0(b):
    d = _f16(b[:, 0:2])
    return 4, _nibbles_32(b[:, 2:18]), d, _ones(len(b)), d, np.full((len(b), 1), 8, np.int8)


def _q4_1(b):
    d, mn = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return 4, _nibbles_32(b[:, 4:20]), d, _ones(len(b)), -mn, _ones(len(b))


def _q5_0(b):
    codes = (_nibbles_32(b[:, 6:22]) | _fifth_bits(b[:, 2:6])).astype(np.int16) - 16
    return 8, codes, _f16(b[:, 0:2]), _ones(len(b)), None, None


def _q5_1(b):
    codes = _nibbles_32(b[:, 8:24]) | _fifth_bits(b[:, 4:8])
    return 8, codes, _f16(b[:, 0:2]), _ones(len(b)), -_f16(b[:, 2:4]), _ones(len(b))


def _q8_0(b):
    return 8, np.ascontiguousarray(b[:, 2:34]).view(np.int8), _f16(b[:, 0:2]), _ones(len(b)), \
        None, None


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 6-bit (sc, m) pairs of a Q4_K/Q5_K block's 12 scale bytes:
    j < 4: sc = s[j] & 63, m = s[j+4] & 63; j >= 4: low 4 bits from s[j+4],
    high 2 bits from the top of s[j-4] (sc) and s[j] (m)."""
    lo, hi, mix = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([lo & 63, (mix & 0x0F) | ((lo >> 6) << 4)], axis=1)
    m = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], axis=1)
    return sc.astype(np.int8), m.astype(np.int8)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: chunk c's 32 bytes hold weights 64c + l (low) and 64c + 32 + l (high)."""
    q = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([q & 0x0F, q >> 4], axis=2).reshape(-1, QK_K)


def _q4_k(b):
    sc, m = _k_scales(b[:, 4:16])
    return 4, _k_nibbles(b[:, 16:144]), _f16(b[:, 0:2]), sc, _f16(b[:, 2:4]), m


def _q5_k(b):
    sc, m = _k_scales(b[:, 4:16])
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    codes = _k_nibbles(b[:, 48:176]) | ((qh & 1) << 4).reshape(-1, QK_K)
    return 8, codes, _f16(b[:, 0:2]), sc, _f16(b[:, 2:4]), m


def _q6_k(b):
    ql = b[:, 0:128].reshape(-1, 2, 1, 64)   # per half of 128 weights
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    codes = (low | (high << 4)).reshape(-1, QK_K).astype(np.int16) - 32
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8)
    return 8, codes, _f16(b[:, 208:210]), sc, None, None


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
             "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def _to_quant_tensor(parts, rows: int, cols: int) -> QuantTensor:
    bits, codes, d, sc, dmin, m = parts

    def per_row(x):
        if x is None:
            return None
        return torch.from_numpy(np.ascontiguousarray(x).reshape(rows, -1).copy())

    codes = codes.reshape(rows, cols)
    if bits == 4:  # two codes a byte, k = 2j low, 2j + 1 high
        qweight = codes[:, 0::2].astype(np.uint8) | (codes[:, 1::2].astype(np.uint8) << 4)
    else:
        qweight = codes.astype(np.int8)
    return QuantTensor(per_row(qweight), per_row(d), per_row(sc), per_row(dmin), per_row(m))
