"""How a quantized prefill matmul is split: from how many rows it
dequantizes the weight into a bf16 workspace for cuBLAS, and how large that
workspace is (engine/quant/kernels.py `workspace_matmul` runs it; the
capacity plan counts the workspace). No triton here: the plan imports it.

Owns the two switches and the slice arithmetic; must not know the kernels."""
from __future__ import annotations

from engine.switches import one_of

WORKSPACE_ENV = "TANDEM_QUANT_GEMM_WORKSPACE_MB"
MIN_ROWS_ENV = "TANDEM_QUANT_GEMM_DENSE_MIN_ROWS"
# Rows one dequantization program writes (kernels.py); a slice holds whole tiles of them.
DEQUANT_BLOCK_N = 32


def workspace_bytes() -> int:
    """The bf16 workspace one dequantized weight slice may fill
    (TANDEM_QUANT_GEMM_WORKSPACE_MB; 0: prefill chunks run the fused `gemm`).
    Larger slices won at every row count on the H100 (12-05, bench.quant_gemm,
    the 27B's layer matrices): 512 rows 168 TFLOP/s at 16 MB, 315 at 64;
    4,096 rows 600 and 660; the 27B's 4K prefill 10,141 tok/s at 64 MB,
    10,608 at 128. The 24 GiB plan's 512-token chunks are host-bound (a
    dequantization and a cuBLAS launch per slice): 2,307 tok/s at 64 MB,
    3,010 at 256 (H100, 12-05 19:16), where every 27B matrix but gate_up
    is one slice. 256 MB costs the plan 0.19 GiB more than 64 did; a model
    whose largest packed matrix is smaller allocates only that (the plan
    still counts the whole budget)."""
    return (one_of(WORKSPACE_ENV, 256, (0, 4, 8, 16, 32, 64, 128, 256)) or 0) << 20


def dense_gemm_min_rows() -> int:
    """Rows from which a quantized matmul dequantizes into the workspace and
    runs cuBLAS (TANDEM_QUANT_GEMM_DENSE_MIN_ROWS); fewer run the fused `gemm`.
    The default, 9, is every matmul wider than the GEMV's 8 rows: at 64 rows
    the workspace already ran the 27B's layer matrices 3.3x faster than the
    fused gemm (61 against 204 ms, H100, 12-05), whose cost hardly depends on
    the rows below its 64-row tile."""
    return one_of(MIN_ROWS_ENV, 9, (9, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096))


def slice_rows(in_features: int, budget_bytes: int, element_bytes: int) -> int:
    """Weight rows per workspace slice: as many as `budget_bytes` holds, in
    whole dequantization tiles, at least one tile."""
    rows = budget_bytes // (in_features * element_bytes) // DEQUANT_BLOCK_N * DEQUANT_BLOCK_N
    return max(rows, DEQUANT_BLOCK_N)


def planned_workspace_bytes(largest_in_features: int, element_bytes: int) -> int:
    """What one prefill worker may hold for the workspace, whichever packed
    weight runs: a slice never passes the budget unless a single tile of the
    widest-K weight does (slice_rows takes at least one tile)."""
    budget = workspace_bytes()
    if not budget:
        return 0
    return max(budget, DEQUANT_BLOCK_N * largest_in_features * element_bytes)
