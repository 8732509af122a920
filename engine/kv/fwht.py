"""The randomised Hadamard rotation R = H diag(signs) / sqrt(D) as Triton
device functions on a register tile of rows, for the kernels that rotate
as they load or before they store (hadamard_kernels' row kernel, rk4's
rotating write, the split combine's rotation back).

Owns the butterflies and their order; must not know pages, formats or
launches. Every caller gets the same arithmetic, stage for stage, as
rotation.hadamard_rotate (half-widths 1, 2, ..., D/2, the exact sign
products at the same end, one multiply by the same fp32 scale), so a fused
kernel's rotation is bitwise the row kernel's.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def butterfly_stage(x, ROWS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr):
    """One FWHT stage: index i (bit HALF clear) and i + HALF become (a + b, a - b).
    The pair axis is moved last so tl.split can take it apart."""
    pairs = tl.permute(tl.reshape(x, (ROWS, D // (2 * HALF), 2, HALF)), (0, 1, 3, 2))
    a, b = tl.split(pairs)
    joined = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    return tl.reshape(joined, (ROWS, D))


@triton.jit
def fwht(x, ROWS: tl.constexpr, D: tl.constexpr, LOG2_D: tl.constexpr):
    """x @ H over each row, stages in rotation.fwht's order."""
    for stage in tl.static_range(LOG2_D):
        x = butterfly_stage(x, ROWS, D, 1 << stage)
    return x


@triton.jit
def rotate_rows(x, signs, ROWS: tl.constexpr, D: tl.constexpr, LOG2_D: tl.constexpr,
                SCALE: tl.constexpr, INVERSE: tl.constexpr):
    """fp32 x [ROWS, D] @ R (INVERSE: @ R.T); signs [1, D] fp32 (±1)."""
    if INVERSE:
        x = x * signs
    y = fwht(x, ROWS, D, LOG2_D)
    if not INVERSE:
        y = y * signs
    return y * SCALE
