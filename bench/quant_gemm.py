"""The quantized prefill matmul on the Qwen3.5-27B shapes: the fused Triton
`gemm` against dequantize-into-a-workspace + cuBLAS (`workspace_matmul`) at
several workspace sizes, with cuBLAS on the dense bf16 weight as the ceiling.

    python -m bench.quant_gemm [--rows 64 512 4096] [--workspace-mb 8 16 32 64]

GPU only. Each call is timed with events around single eager calls (a
prefill chunk's matmul is long next to a launch); TFLOP/s counts 2 x M x N x
K. The "per layer set" line sums each path over one of every per-layer
matrix the model runs, weighted by how many layers run it: a prefill
chunk's quantized matmul time, without the output head (a prefill computes
logits for its last row only)."""
from __future__ import annotations

import argparse
import sys

import torch

from bench.common import environment, print_table, write_json
from bench.quant import _random_quant, _time, model_shapes


def _paths(x, qt, dense, budgets):
    from engine.quant.kernels import gemm, workspace_matmul
    paths = {"fused gemm": lambda: gemm(x, qt), "bf16 cuBLAS": lambda: x @ dense.t()}
    for mb in budgets:
        paths[f"workspace {mb} MB"] = (lambda b=mb << 20: workspace_matmul(x, qt, budget_bytes=b))
    return paths


def run(rows_list, budgets, device) -> list[dict]:
    results = []
    for name, fmt, n, k, uses in model_shapes():
        if not uses or name == "lm_head":
            continue
        qt = _random_quant(fmt, n, k, device)
        dense = qt.dequantize(torch.bfloat16)
        for m in rows_list:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            want = x.float() @ dense.float().t()
            for path, fn in _paths(x, qt, dense, budgets).items():
                err = ((fn().float() - want).abs().max() / want.abs().max()).item()
                seconds = _time(fn, repeats=10)
                results.append({"matrix": name, "format": fmt.name, "N": n, "K": k, "rows": m,
                                "uses": uses, "path": path, "us": seconds * 1e6,
                                "tflops": 2 * m * n * k / seconds / 1e12, "rel_err": err})
            del x, want
        del qt, dense
        torch.cuda.empty_cache()
    return results


def per_layer_set(results: list[dict]) -> list[list]:
    rows = []
    for m in sorted({r["rows"] for r in results}):
        for path in dict.fromkeys(r["path"] for r in results):
            sel = [r for r in results if r["rows"] == m and r["path"] == path]
            ms = sum(r["us"] * r["uses"] for r in sel) / 1e3
            flops = sum(2 * m * r["N"] * r["K"] * r["uses"] for r in sel)
            rows.append([m, path, f"{ms:.2f}", f"{flops / ms / 1e9:.0f}"])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.quant_gemm",
                                description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 512, 4096])
    p.add_argument("--workspace-mb", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.quant_gemm needs a CUDA GPU", file=sys.stderr)
        return 2
    if any(r < 9 for r in args.rows) or any(mb < 1 for mb in args.workspace_mb):
        print("--rows takes 9 or more (fewer run the GEMV), --workspace-mb 1 or more",
              file=sys.stderr)
        return 2
    results = run(args.rows, args.workspace_mb, torch.device("cuda"))
    print_table("quantized prefill matmul, Qwen3.5-27B shapes (Q4_K; down also Q6_K at 0 uses)",
                ["matrix", "format", "N", "K", "rows", "path", "us", "TFLOP/s", "rel err"],
                [[r["matrix"], r["format"], r["N"], r["K"], r["rows"], r["path"],
                  f"{r['us']:.0f}", f"{r['tflops']:.0f}", f"{r['rel_err']:.1e}"]
                 for r in results])
    print_table("per layer set (every layer's matrices once, weighted by layer count)",
                ["rows", "path", "ms", "TFLOP/s"], per_layer_set(results))
    write_json(args.json, {"environment": environment(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
