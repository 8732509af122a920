"""A Triton GEMV for bf16 (dense) weights at decode widths (1..8 rows).

Why not cuBLAS: a bf16 27B decode step is ~880 kernels, and the dependent
launches that hide the gaps between them (engine/pdl.py) reach only our own
kernels; a kernel after a cuBLAS GEMM still waits for its end. This kernel
takes part (PDL prologue) and reads each weight tile once for all rows.

Each program owns BLOCK_N output features and 1/SPLIT_K of K; the rows are
padded to 16 for one tensor-core dot per tile (bf16 products are exact in
fp32; rows never mix, so a row's result does not depend on how many rows
run beside it: decode and a k+1-row verify compute the same numbers).
Split-K partials are fp32 and the last program of each tile adds them
(engine/quant/gemv.py's split_fixup; TANDEM_SPLIT_FIXUP=0 leaves it to a
second launch, the sum kernel, with the same numbers).

At load on sm_90+ the model's nn.Linear forwards and its output head whose
shapes are in TUNED go onto it (`adopt_dense_gemv`; TANDEM_DENSE_GEMV=1 takes
every shape, 0 none). The H200 comparison against cuBLAS per shape is
`python -m bench.dense_gemv`; the whole step, `bench.decode` with
TANDEM_DENSE_GEMV=0/unset. The reference is `dense_gemv_reference`.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from engine.gpu_facts import capability_major
from engine.pdl import pdl_launch, pdl_prologue
from engine.quant.gemv import (MAX_FIXUP_TILES, _interpreting, _sm_count, _split_k_sum_kernel,
                               _sum_splits_if_last, early_weights, split_counters, split_fixup)
from engine.switches import on_off

DENSE_GEMV_ENV = "TANDEM_DENSE_GEMV"
MAX_ROWS = 8
MAX_SPLIT_K = 16


@dataclass(frozen=True)
class DenseGemvConfig:
    block_n: int = 64
    block_k: int = 256
    split_k: int | None = None  # None: enough programs to fill the GPU
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 16 and name != "num_warps" or value & (value - 1):
                raise ValueError(f"DenseGemvConfig.{name} must be a power of two"
                                 f"{' >= 16' if name != 'num_warps' else ''}, got {value}")
        if self.split_k is not None and not 1 <= self.split_k <= MAX_SPLIT_K:
            raise ValueError(f"DenseGemvConfig.split_k must be 1..{MAX_SPLIT_K}, got {self}")

    def key(self) -> str:
        split = "auto" if self.split_k is None else self.split_k
        return (f"n{self.block_n}-k{self.block_k}-s{split}-w{self.num_warps}"
                f"-p{self.num_stages}")


# bench.dense_gemv's candidates (each also with split-K 1, 2, 4, 8). Shared
# memory per program is stages x (BLOCK_N + 16) x BLOCK_K x 2 bytes (the
# weight and padded-row tiles of each pipelined load), within sm_90's 227 KB.
CANDIDATES = (DenseGemvConfig(32, 256), DenseGemvConfig(64, 256),
              DenseGemvConfig(64, 512, num_stages=2),
              DenseGemvConfig(128, 256, num_warps=8, num_stages=3),
              DenseGemvConfig(64, 128, num_stages=6))

# The sweep's best one-row config per 27B shape (N, K), from bench.dense_gemv
# on the H200, 2026-12-02 20:03 (BENCHMARKS.md). Keyed by shape alone, not by
# row count: a different split-K sums in another order, and decode (1 row)
# must give the k+1-row verify's numbers. At 4 rows these were within 2-8%
# of that width's own best.
TUNED: dict[tuple[int, int], DenseGemvConfig] = {
    (34816, 5120): DenseGemvConfig(32, 256, split_k=1),  # gate_up 84.9 us, 99% of floor
    (5120, 17408): DenseGemvConfig(32, 256, split_k=2),  # down 45.6 us, 92%
    (16480, 5120): DenseGemvConfig(64, 128, split_k=1, num_stages=6),  # gdn in_proj 40.8, 98%
    (14336, 5120): DenseGemvConfig(64, 256, split_k=1),  # attn qkv 38.2 us, 91%
    (5120, 6144): DenseGemvConfig(64, 128, split_k=1, num_stages=6),  # gdn out / attn o 18.1
    (248320, 5120): DenseGemvConfig(64, 128, split_k=1, num_stages=6),  # lm_head 554.4 us
}


def pick_dense_config(n: int, k: int) -> DenseGemvConfig:
    """TUNED for a swept shape, else the default (split-K by pick_split)."""
    return TUNED.get((n, k), DenseGemvConfig())


@triton.jit
def _weight_tile(w_ptr, offs_n, n_ok, offs_k, k_ok, stride_wn):
    return tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                   mask=n_ok[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def _rows_tile(x_ptr, rows, M, offs_k, k_ok, stride_xm):
    return tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                   mask=(rows < M)[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def _dense_tiles(acc, x_ptr, w_ptr, rows, M, offs_n, n_ok, K, pid_k, stride_xm, stride_wn,
                 TILES, FIRST: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc plus the split's tiles FIRST.. (one tensor-core dot each)."""
    for tile in range(FIRST, TILES):
        offs_k = (pid_k * TILES + tile) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = _rows_tile(x_ptr, rows, M, offs_k, k_ok, stride_xm)
        w = _weight_tile(w_ptr, offs_n, n_ok, offs_k, k_ok, stride_wn)
        acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def _dense_gemv_program(x_ptr, w_ptr, out_ptr, final_ptr, counter_ptr, M, N, K, stride_xm,
                        stride_wn, stride_os, stride_om, stride_fm, TILES,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                        EARLY: tl.constexpr, SPLIT_K: tl.constexpr, FIXUP: tl.constexpr):
    """EARLY: the first weight tile is loaded before the dependent-launch wait
    (weights are never written by a kernel; the rows and the output wait),
    as engine/quant/gemv.py's DP4A kernel does. FIXUP: out_ptr holds SPLIT_K
    fp32 partials, and the last program of each tile sums them into
    final_ptr (engine/quant/gemv.py's _sum_splits_if_last)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, 16)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    if EARLY:
        offs_k = pid_k * TILES * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w = _weight_tile(w_ptr, offs_n, n_ok, offs_k, k_ok, stride_wn)
        pdl_prologue(PDL)
        acc = tl.dot(_rows_tile(x_ptr, rows, M, offs_k, k_ok, stride_xm), tl.trans(w), acc)
        acc = _dense_tiles(acc, x_ptr, w_ptr, rows, M, offs_n, n_ok, K, pid_k, stride_xm,
                           stride_wn, TILES, 1, BLOCK_K)
    else:
        pdl_prologue(PDL)
        acc = _dense_tiles(acc, x_ptr, w_ptr, rows, M, offs_n, n_ok, K, pid_k, stride_xm,
                           stride_wn, TILES, 0, BLOCK_K)
    tile = (rows < M)[:, None] & n_ok[None, :]
    out = out_ptr + pid_k * stride_os + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=tile)
    if FIXUP:
        _sum_splits_if_last(out_ptr, final_ptr, counter_ptr, pid_n,
                            rows[:, None] * stride_om + offs_n[None, :],
                            rows[:, None] * stride_fm + offs_n[None, :], tile, stride_os, SPLIT_K,
                            SPLIT_K)


@triton.jit
def _dense_gemv_kernel(x_ptr, w_ptr, out_ptr, final_ptr, counter_ptr, M, N, K, stride_xm,
                       stride_wn, stride_os, stride_om, stride_fm, TILES,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                       EARLY: tl.constexpr, SPLIT_K: tl.constexpr, FIXUP: tl.constexpr):
    _dense_gemv_program(x_ptr, w_ptr, out_ptr, final_ptr, counter_ptr, M, N, K, stride_xm,
                        stride_wn, stride_os, stride_om, stride_fm, TILES, BLOCK_N, BLOCK_K,
                        PDL, EARLY, SPLIT_K, FIXUP)


@triton.jit
def _dense_gemv_kernel_interpreted(x_ptr, w_ptr, out_ptr, final_ptr, counter_ptr, M, N, K,
                                   stride_xm, stride_wn, stride_os, stride_om, stride_fm,
                                   TILES: tl.constexpr, BLOCK_N: tl.constexpr,
                                   BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                                   EARLY: tl.constexpr, SPLIT_K: tl.constexpr,
                                   FIXUP: tl.constexpr):
    """The same with a constant TILES: the interpreter cannot loop over a runtime count."""
    _dense_gemv_program(x_ptr, w_ptr, out_ptr, final_ptr, counter_ptr, M, N, K, stride_xm,
                        stride_wn, stride_os, stride_om, stride_fm, TILES, BLOCK_N, BLOCK_K,
                        PDL, EARLY, SPLIT_K, FIXUP)




def pick_split(n: int, k: int, config: DenseGemvConfig, sms: int) -> int:
    """config.split_k, or the fewest splits that give every SM ~4 programs
    (each split keeps at least two tiles)."""
    if config.split_k is not None:
        return config.split_k
    blocks = triton.cdiv(n, config.block_n)
    tiles = triton.cdiv(k, config.block_k)
    split = 1
    while blocks * split < 4 * sms and split * 2 <= min(MAX_SPLIT_K, tiles // 2):
        split *= 2
    return split


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None, config: DenseGemvConfig | None = None
               ) -> torch.Tensor:
    """x [M, K] (1 <= M <= 8) @ weight [N, K].T (+ bias) in x's dtype."""
    m_rows, k_dim = x.shape
    n_dim = weight.shape[0]
    if not 1 <= m_rows <= MAX_ROWS or weight.shape[1] != k_dim or weight.stride(1) != 1:
        raise ValueError(f"dense_gemv takes 1..{MAX_ROWS} rows and a row-major [N, {k_dim}] "
                         f"weight, got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    config = config or pick_dense_config(n_dim, k_dim)
    x = x if x.stride(-1) == 1 else x.contiguous()
    tiles = triton.cdiv(k_dim, config.block_k)
    split = min(pick_split(n_dim, k_dim, config, _sm_count(x.device)), tiles)
    per_split = triton.cdiv(tiles, split)
    split = triton.cdiv(tiles, per_split)  # no split without a tile
    if out is None:
        out = torch.empty(m_rows, n_dim, dtype=x.dtype, device=x.device)
    direct = split == 1 and bias is None
    target = out if direct else torch.empty(split, m_rows, n_dim, dtype=torch.float32,
                                            device=x.device)
    stride_os = 0 if direct else target.stride(0)
    launch = pdl_launch(x.device)
    grid = (triton.cdiv(n_dim, config.block_n), split)
    fixup = split > 1 and bias is None and split_fixup() and grid[0] <= MAX_FIXUP_TILES
    counters = split_counters(x.device) if fixup else target
    kernel = _dense_gemv_kernel_interpreted if _interpreting() else _dense_gemv_kernel
    kernel[grid](
        x, weight, target, out, counters, m_rows, n_dim, k_dim, x.stride(0), weight.stride(0),
        stride_os, target.stride(-2), out.stride(0), per_split, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, EARLY=early_weights(default=False),
        SPLIT_K=split if fixup else 1, FIXUP=fixup, num_warps=config.num_warps,
        num_stages=config.num_stages, **launch)
    if not direct and not fixup:
        block = 256
        _split_k_sum_kernel[(triton.cdiv(n_dim, block), m_rows)](
            target, out, bias if bias is not None else target, m_rows, n_dim, target.stride(0),
            out.stride(0), SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=block, **launch)
    return out


def dense_gemv_reference(x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 x @ weight.T (+ bias): what the kernel computes before its cast."""
    y = x.float() @ weight.float().t()
    return y if bias is None else y + bias.float()


def is_dense_weight(weight: torch.Tensor) -> bool:
    """A plain matrix (not a quantized module's). The type is checked first: a quantized
    module's QuantWeight answers most other questions (is_cuda, stride) by
    dequantizing the whole matrix (2.4 GiB for the 27B's head on each call;
    the H200's 24 GiB run of 2026-12-02 21:58 held 10-20 GiB more that way)."""
    return type(weight) in (torch.Tensor, nn.Parameter) and weight.dim() == 2


def takes_dense_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A plain bf16/fp16 weight on the GPU, at most MAX_ROWS rows."""
    return (is_dense_weight(weight) and x.is_cuda and weight.is_cuda
            and weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype
            and weight.stride(1) == 1
            and x.numel() // max(x.shape[-1], 1) <= MAX_ROWS)


def dense_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through dense_gemv where it takes the call."""
    if not takes_dense_gemv(x, weight):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    return dense_gemv(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])


class GemvLinear(nn.Linear):
    """nn.Linear whose decode-width calls go through dense_gemv."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias)


def dense_gemv_forced() -> bool | None:
    """TANDEM_DENSE_GEMV: 1 every decode-width bf16 matmul, 0 none (cuBLAS),
    unset the default (dense_gemv_shapes)."""
    return on_off(DENSE_GEMV_ENV, None, on="the Triton GEMV for every shape",
                  off="cuBLAS for every shape")


def dense_gemv_shapes(device: torch.device) -> frozenset[tuple[int, int]] | None:
    """The weight shapes (N, K) to swap at load: None means all of them.
    By default the TUNED shapes on sm_90+, where the H200 measured the whole
    bf16 27B step faster with them (2026-12-02 20:33: 14.53-14.78 against
    14.93-15.22 ms at 4K, 17.51-17.70 against 17.99-18.34 at 128K); other
    shapes and cards keep cuBLAS (the default config lost to it there)."""
    forced = dense_gemv_forced()
    if forced is not None:
        return None if forced else frozenset()
    device = torch.device(device)
    if device.type != "cuda" or capability_major(device) < 9:
        return frozenset()
    return frozenset(TUNED)


def use_dense_gemv(model: nn.Module,
                   shapes: frozenset[tuple[int, int]] | None = None) -> int:
    """Every plain nn.Linear of the model with a dense weight whose shape is
    in `shapes` (None: all) becomes a GemvLinear (same parameters, no copy),
    and so does the output head (CausalLM.head_linear); quantized ones keep
    their own GEMV. Returns how many modules changed."""
    def wanted(weight: torch.Tensor) -> bool:
        return is_dense_weight(weight) and (shapes is None or tuple(weight.shape) in shapes)

    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear and wanted(module.weight):
            module.__class__ = GemvLinear
            changed += 1
    if hasattr(model, "head_linear") and wanted(model.output_embedding):
        model.head_linear = dense_linear
        changed += 1
    return changed


def adopt_dense_gemv(model: nn.Module, device: torch.device) -> None:
    """use_dense_gemv on a GPU model, on the shapes dense_gemv_shapes picks
    (read at load)."""
    if torch.device(device).type != "cuda":
        return
    shapes = dense_gemv_shapes(device)
    if shapes is not None and not shapes:
        return
    changed = use_dense_gemv(model, shapes)
    if changed:
        which = "every shape" if shapes is None else "the tuned shapes"
        print(f"tandem: {changed} linear layers on the Triton GEMV ({which}; "
              f"{DENSE_GEMV_ENV}=0 keeps cuBLAS)", file=sys.stderr, flush=True)
