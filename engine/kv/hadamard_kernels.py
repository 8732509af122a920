"""The rk4/rk4p rotation as a Triton kernel: the randomised Hadamard R of
rotation.py applied to rows, without the matrix.

Owns one kernel and its launch wrapper, `hadamard_rotate_rows(x, signs,
inverse, out_dtype)`: x [..., D] (D a power of two, 16..512) times R, or R.T
with `inverse`, in fp32, stored as fp32 or bf16. It replaces a small fp32
cuBLAS GEMM ([rows, D] x [D, D], ~5-7 us on the H200 whatever its size at
decode) by one PDL launch that reads and writes each row once.

It must not know formats, pages or which tensors get rotated (formats.py's
_SeededRotation decides that), nor how the signs are made (rotation.py):
it takes the sign vector as given. The butterflies are fwht.py's, shared
with the kernels that rotate in place of this one (rk4's write, attention
and split combine).

Bitwise contract: the result equals rotation.hadamard_rotate(x, signs,
inverse) (rounded to bf16 to nearest even when asked), because the kernel
does the same butterflies in the same stage order (half-width 1, 2, ...,
D/2), the sign products (exact) at the same end, and multiplies by the same
fp32 constant rotation.hadamard_scale(D). Against the matmul it differs by
fp32 rounding only.

Under TRITON_INTERPRET=1 it runs on CPU tensors (the tests use this).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kv.fwht import rotate_rows
from engine.kv.kernels import _load_dense, _store_dense, as_kernel_dense
from engine.kv.rotation import hadamard_scale, is_power_of_two
from engine.pdl import pdl_launch, pdl_prologue

MIN_DIM, MAX_DIM = 16, 512
# Elements per program, as kernels.py: a 256-wide head is 16 rows, which
# keeps a tile in registers on the GPU and the interpreter quick.
_TILE_ELEMENTS = 4096
_OUT_DTYPES = (torch.float32, torch.bfloat16)


def supports_dim(head_dim: int) -> bool:
    """Whether hadamard_rotate_rows takes rows of this width."""
    return is_power_of_two(head_dim) and MIN_DIM <= head_dim <= MAX_DIM


@triton.jit(do_not_specialize=("n_rows",))
def _hadamard_rows_kernel(x_ptr, signs_ptr, out_ptr, n_rows, x_row_stride,
                          D: tl.constexpr, LOG2_D: tl.constexpr, ROWS: tl.constexpr,
                          SCALE: tl.constexpr, INVERSE: tl.constexpr,
                          X_BF16_BITS: tl.constexpr, OUT_BF16_BITS: tl.constexpr,
                          PDL: tl.constexpr):
    pdl_prologue(PDL)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, D)
    # Full-width rows: the mask is the row bound broadcast over the columns.
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    x = _load_dense(x_ptr, rows[:, None] * x_row_stride + cols[None, :], mask, X_BF16_BITS)
    signs = tl.load(signs_ptr + cols)[None, :]
    y = rotate_rows(x, signs, ROWS, D, LOG2_D, SCALE, INVERSE)
    _store_dense(out_ptr, rows[:, None] * D + cols[None, :], y, mask, OUT_BF16_BITS)


def _rows_per_program(head_dim: int) -> int:
    return max(1, _TILE_ELEMENTS // head_dim)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [N, D] with unit column stride: a view where the layout allows
    (a query sliced out of a fused projection), a copy otherwise."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def hadamard_rotate_rows(x: torch.Tensor, signs: torch.Tensor, inverse: bool,
                         out_dtype: torch.dtype = torch.float32,
                         rows_per_program: int | None = None) -> torch.Tensor:
    """x @ R (inverse: x @ R.T) over the last dim, R = H diag(signs) / sqrt(D),
    as a new tensor of x's shape in out_dtype (fp32 or bf16). x: fp32, bf16 or
    fp16; signs: the ±1 vector [D] (rotation.hadamard_signs), fp32 on x's
    device. rows_per_program (a power of two; default 4096 / D elements'
    worth) is for bench.hadamard's sweep: decode rotates only 4-24 rows, so
    fewer rows a program may finish sooner."""
    head_dim = x.shape[-1]
    if not supports_dim(head_dim):
        raise ValueError(f"the Hadamard kernel takes power-of-two rows of {MIN_DIM}.."
                         f"{MAX_DIM}, got {head_dim}")
    per_program = rows_per_program or _rows_per_program(head_dim)
    if not is_power_of_two(per_program):
        raise ValueError(f"rows_per_program must be a power of two, got {per_program}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"the Hadamard kernel stores fp32 or bf16, not {out_dtype}")
    if signs.shape != (head_dim,) or signs.dtype != torch.float32 \
            or signs.device != x.device:
        raise ValueError(f"signs must be fp32 [{head_dim}] on {x.device}, got "
                         f"{signs.dtype} {tuple(signs.shape)} on {signs.device}")
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rows = _as_rows(x)
    n_rows = rows.shape[0]
    if n_rows == 0:
        return out
    x_kernel, x_bits = as_kernel_dense(rows)
    out_kernel, out_bits = as_kernel_dense(out)
    _hadamard_rows_kernel[(triton.cdiv(n_rows, per_program),)](
        x_kernel, signs.contiguous(), out_kernel, n_rows, rows.stride(0),
        D=head_dim, LOG2_D=head_dim.bit_length() - 1, ROWS=per_program,
        SCALE=hadamard_scale(head_dim), INVERSE=inverse, X_BF16_BITS=x_bits,
        OUT_BF16_BITS=out_bits, **pdl_launch(x.device))
    return out
