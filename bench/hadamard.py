"""`python -m bench.hadamard`: the rk4/rk4p rotation as today's fp32 matmul
by R against the Triton FWHT (engine/kv/hadamard_kernels.py), at the 27B's
head_dim 256 and the row counts its attention layers rotate.

    python -m bench.hadamard [--rows 4 24 96 49152] [--json FILE]

GPU only. Each way is timed inside a CUDA graph of 16 back-to-back calls
(bench.quant's method), through the format's own methods so the matmul side
includes its dtype casts: rotate_query on a bf16 query (cast, GEMM, cast),
unrotate_output on the attention kernel's fp32 output to bf16 (GEMM, cast),
to_stored_space on a bf16 query or K/V write to fp32 (cast, GEMM). The kernel side sweeps its rows per program. If the kernel wins at
the decode rows (4 KV heads, 24 query heads), `TANDEM_HADAMARD_KERNEL=1` is
the A/B for the whole step (scripts/device_hadamard.sh)."""
from __future__ import annotations

import argparse

import torch

from bench.common import environment, print_table, write_json
from bench.quant import _time_graph

HEAD_DIM = 256
ROWS_PER_PROGRAM = (1, 2, 4, 8, 16)
# (method, input dtype, output dtype): what one attention layer rotates.
CASES = (("rotate_query", torch.bfloat16, torch.bfloat16),
         ("unrotate_output", torch.float32, torch.bfloat16),
         ("to_stored_space", torch.bfloat16, torch.float32))


def _rotation_of(fmt, method: str, out_dtype: torch.dtype, rows_per_program: int | None):
    """The rotation `method` of fmt (the matmul), or the kernel as that
    method calls it with the given rows per program."""
    inverse = method == "unrotate_output"
    if rows_per_program is None:
        if inverse:
            return lambda x: fmt.unrotate_output(x, dtype=out_dtype)
        return getattr(fmt, method)
    from engine.kv.hadamard_kernels import hadamard_rotate_rows

    def kernel(x):
        signs = fmt.rotation_signs(x.shape[-1], x.device)
        return hadamard_rotate_rows(x, signs, inverse, out_dtype, rows_per_program)
    return kernel


def compare(rows_list: list[int], device) -> list[dict]:
    from engine.kv.formats import make_format
    from engine.kv.hadamard_kernels import _rows_per_program

    # Off the Triton path the format's methods are the matmul, switch or not.
    fmt = make_format("rk4", use_triton=False)
    default = _rows_per_program(HEAD_DIM)
    out = []
    for rows in rows_list:
        for method, in_dtype, out_dtype in CASES:
            x = torch.randn(rows, HEAD_DIM, device=device).to(in_dtype)
            timed = {}
            for per_program in (None,) + ROWS_PER_PROGRAM:
                fn = _rotation_of(fmt, method, out_dtype, per_program)
                timed[per_program] = _time_graph([lambda fn=fn: fn(x)] * 16)
            best = min(ROWS_PER_PROGRAM, key=lambda r: timed[r])
            out.append(dict(method=method, rows=rows, matmul_us=timed[None] * 1e6,
                            kernel_default_us=timed[default] * 1e6,
                            kernel_best_us=timed[best] * 1e6, best_rows_per_program=best))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hadamard",
                                description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[4, 24, 96, 49152])
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.hadamard needs a GPU")
    rows = compare(a.rows, torch.device("cuda"))
    columns = ["method", "rows", "matmul_us", "kernel_default_us", "kernel_best_us",
               "best_rows_per_program"]
    print_table(f"rk4 rotation at head_dim {HEAD_DIM}: fp32 matmul against the Triton FWHT "
                "(graph-timed, per call)", columns, [[r[c] for c in columns] for r in rows])
    write_json(a.json, {"environment": environment(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
