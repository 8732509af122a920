"""A small K-quant packer for test files: float weights -> Q4_K / Q5_K / Q6_K
block bytes in llama.cpp's layout (the gguf package reads K-quants but cannot
write them). The quantization itself is plain min/max rounding, not
llama.cpp's error search: only the byte layout has to be right, and the tests
check that by dequantizing with the gguf package (an oracle we did not write)
and comparing with the original weights."""
from __future__ import annotations

import numpy as np

QK_K = 256


def _round(x: np.ndarray) -> np.ndarray:
    return np.floor(x + 0.5)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit (sc, m) pairs -> the 12 scale bytes (inverse of get_scale_min)."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    return out


def _asymmetric_superblocks(w: np.ndarray, qmax: int):
    """Per group of 32: scale and min; per 256: d, dmin; returns codes and bytes."""
    blocks = w.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(blocks.min(axis=2), 0.0)           # min <= 0, stored as -min >= 0
    hi = blocks.max(axis=2)
    scale = (hi - lo) / qmax
    d = (scale.max(axis=1, keepdims=True) / 63).astype(np.float16)
    dmin = ((-lo).max(axis=1, keepdims=True) / 63).astype(np.float16)
    df, dminf = d.astype(np.float32), dmin.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(_round(np.where(df > 0, scale / df, 0)), 0, 63)
        mm = np.clip(_round(np.where(dminf > 0, -lo / dminf, 0)), 0, 63)
        eff = df * sc
        q = _round(np.where(eff[..., None] > 0,
                            (blocks + (dminf * mm)[..., None]) / eff[..., None], 0))
    q = np.clip(q, 0, qmax).astype(np.uint8)
    return q, d, dmin, sc, mm


def pack_q4_k(w: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> [rows, cols/256 * 144] uint8."""
    rows = w.shape[0]
    q, d, dmin, sc, mm = _asymmetric_superblocks(w, 15)
    q = q.reshape(-1, 4, 2, 32)  # chunk c: groups 2c (low nibble) and 2c+1 (high)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), _pack_k_scales(sc, mm), qs],
                         axis=1)
    return out.reshape(rows, -1)


def pack_q5_k(w: np.ndarray) -> np.ndarray:
    rows = w.shape[0]
    q, d, dmin, sc, mm = _asymmetric_superblocks(w, 31)
    q = q.reshape(-1, 4, 2, 32)
    low = q & 0x0F
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    fifth = (q >> 4).reshape(-1, 8, 32)  # group g's 5th bits go to bit g of qh[l]
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for g in range(8):
        qh |= fifth[:, g] << g
    out = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), _pack_k_scales(sc, mm), qh, qs],
                         axis=1)
    return out.reshape(rows, -1)


def pack_q6_k(w: np.ndarray) -> np.ndarray:
    rows = w.shape[0]
    blocks = w.reshape(-1, 16, 16).astype(np.float32)
    amax = np.abs(blocks).max(axis=2)
    scale = amax / 31
    d = (scale.max(axis=1, keepdims=True) / 127).astype(np.float16)
    df = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(_round(np.where(df > 0, scale / df, 0)), -128, 127)
        eff = df * sc
        q = _round(np.where(eff[..., None] > 0, blocks / eff[..., None], 0))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # halves of 128
    low, high = q & 0x0F, q >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4),
                         low[:, :, 1] | (low[:, :, 3] << 4)], axis=2).reshape(-1, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4)
          | (high[:, :, 3] << 6)).reshape(-1, 64)
    out = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), d.view(np.uint8)], axis=1)
    return out.reshape(rows, -1)


PACKERS = {"Q4_K": pack_q4_k, "Q5_K": pack_q5_k, "Q6_K": pack_q6_k}
