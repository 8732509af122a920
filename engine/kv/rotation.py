"""The fixed orthogonal rotation that the rk4 KV format applies over head_dim.

Owns how the rotation matrix R is built and cached. Vectors are rows, so a
rotated key is `k @ R` and rotating back is `x @ R.T`. Because R is orthogonal,
q.k == (q @ R).(k @ R), and attention over rotated V gives `out @ R`; so
attention can run entirely in the rotated space.

Why rotate at all: KV activations have a few outlier channels; a 4-bit block
whose scale is set by one outlier wastes its levels on the other 31 values.
Rotating spreads every channel's energy over all channels (the rotated vector
is close to Gaussian), so block maxima shrink relative to the block RMS.

R is a randomised Hadamard transform, H_D @ diag(s) / sqrt(D) with a fixed
seeded sign vector s, when head_dim is a power of two (exactly orthogonal and
cheap to apply), and otherwise a seeded random orthogonal matrix from QR.

For the Hadamard R, `hadamard_rotate` applies it without the matrix: a fast
Walsh-Hadamard transform (FWHT) by add/sub butterflies in a fixed stage order,
the signs and 1/sqrt(D). Its fp32 result is the one the Triton kernel
(hadamard_kernels.py) must reproduce bit for bit; against the matmul it
differs by fp32 rounding only.
"""
from __future__ import annotations

import functools

import torch

# Fixed so that pages written by one process decode in another, and across
# restarts; changing it invalidates every rk4 page ever written.
DEFAULT_ROTATION_SEED = 0x7A4D


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def hadamard_matrix(n: int) -> torch.Tensor:
    """Sylvester's ±1 Walsh–Hadamard matrix of order n (a power of two), fp64."""
    if not is_power_of_two(n):
        raise ValueError(f"Hadamard order must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h


def _seeded_generator(seed: int) -> torch.Generator:
    # A CPU generator: the same seed must give the same matrix on every device.
    return torch.Generator(device="cpu").manual_seed(seed)


def hadamard_signs(n: int, seed: int = DEFAULT_ROTATION_SEED) -> torch.Tensor:
    """The seeded ±1 vector s of the randomised Hadamard R = H diag(s) / sqrt(n),
    fp64 on the CPU. The random signs break the Hadamard matrix's alignment
    with the coordinate axes, so structured inputs (e.g. a constant vector,
    which a bare Hadamard maps to a single spike) still spread out."""
    return torch.randint(0, 2, (n,), generator=_seeded_generator(seed)).to(torch.float64) * 2 - 1


def _randomised_hadamard(n: int, seed: int) -> torch.Tensor:
    return (hadamard_matrix(n) * hadamard_signs(n, seed)[None, :]) / n ** 0.5


def hadamard_scale(n: int) -> float:
    """1/sqrt(n) rounded to fp32 (R's entries are ±this in fp32), as a Python
    float that fp32 holds exactly: torch and Triton then multiply by the same
    constant. Exact for n a power of four (256: 1/16)."""
    return torch.tensor(1.0 / n ** 0.5, dtype=torch.float32).item()


def fwht(x: torch.Tensor) -> torch.Tensor:
    """x @ H over the last dim (Sylvester's H, n a power of two), by butterflies.

    Stage order (the kernel's, so the two round alike): half-width h = 1, 2,
    4, ..., n/2; at each stage every index i with i & h == 0 pairs with
    i + h: (a, b) -> (a + b, a - b). Within a stage each output is one
    correctly rounded IEEE add or sub of fixed operands, so a fixed stage
    order gives one fixed result on any device."""
    n = x.shape[-1]
    if not is_power_of_two(n):
        raise ValueError(f"FWHT needs a power-of-two last dim, got {n}")
    lead = x.shape[:-1]
    half = 1
    while half < n:
        pairs = x.reshape(*lead, n // (2 * half), 2, half)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, n)
        half *= 2
    return x


def hadamard_rotate(x: torch.Tensor, signs: torch.Tensor, inverse: bool) -> torch.Tensor:
    """fp32 x @ R (inverse: x @ R.T) for R = H diag(signs) / sqrt(n), without R.

    Forward: FWHT(x) * signs * scale; inverse: FWHT(x * signs) * scale (R.T =
    diag(signs) H / sqrt(n), H symmetric). The sign products are exact, so
    rounding comes from the butterflies and, unless n is a power of four, the
    scale. The PyTorch reference of hadamard_kernels.hadamard_rotate_rows."""
    x = x.to(torch.float32)
    signs = signs.to(device=x.device, dtype=torch.float32)
    if inverse:
        x = x * signs
    y = fwht(x)
    if not inverse:
        y = y * signs
    return y * hadamard_scale(x.shape[-1])


def _random_orthogonal(n: int, seed: int) -> torch.Tensor:
    gauss = torch.randn(n, n, generator=_seeded_generator(seed), dtype=torch.float64)
    q, r = torch.linalg.qr(gauss)
    # Fix QR's sign ambiguity so the result depends only on the seed.
    return q * torch.sign(torch.diagonal(r))[None, :]


@functools.lru_cache(maxsize=16)
def _rotation_fp64(head_dim: int, seed: int) -> torch.Tensor:
    if is_power_of_two(head_dim):
        return _randomised_hadamard(head_dim, seed)
    return _random_orthogonal(head_dim, seed)


def rotation_matrix(head_dim: int, seed: int = DEFAULT_ROTATION_SEED,
                    device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [head_dim, head_dim] orthogonal R; row vectors rotate as x @ R."""
    return _rotation_fp64(head_dim, seed).to(device=device, dtype=dtype)


def rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x @ R over the last dim, in fp32 (the quantizer's input precision)."""
    return x.to(torch.float32) @ r


def unrotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x @ R.T over the last dim, in fp32: the inverse of rotate()."""
    return x.to(torch.float32) @ r.T
