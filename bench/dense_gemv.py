"""`python -m bench.dense_gemv`: the bf16 Triton GEMV (engine/dense_gemv.py)
against cuBLAS (F.linear) on the Qwen3.5-27B's merged matrix shapes.

    python -m bench.dense_gemv [--rows 1 4] [--json FILE]

GPU only. Each shape is timed both ways inside a CUDA graph of 16
back-to-back calls, each on another copy of the weight so none is still in
L2 (bench.quant's method), for every candidate config (engine/dense_gemv.py
CANDIDATES, split-K 1/2/4/8 and the heuristic's); the floor is the weight
bytes over the measured copy bandwidth. The last table sums a 27B decode
step's GEMVs (per-step use counts from bench.quant.model_shapes) both ways:
if the Triton sum is the smaller, `TANDEM_DENSE_GEMV=1` is the A/B for the
whole step (bench.decode)."""
from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from bench.common import print_table, write_json
from bench.quant import L2_FLUSH_BYTES, _copy_bandwidth, _time_graph, model_shapes


def bf16_shapes() -> list[tuple[str, int, int, int]]:
    """(name, N, K, uses per step) of the 27B's matmuls as the model runs them."""
    seen, out = set(), []
    for name, _, n, k, per_step in model_shapes():
        if per_step and (name, n, k) not in seen:
            seen.add((name, n, k))
            out.append((name, n, k, per_step))
    return out


def _copies(n: int, k: int, device) -> list[torch.Tensor]:
    one = n * k * 2
    count = max(1, min(8, -(-L2_FLUSH_BYTES // one)))
    return [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5
            for _ in range(count)]


def _timed(x, copies, run, calls: int = 16) -> float:
    out = torch.empty(x.shape[0], copies[0].shape[0], dtype=x.dtype, device=x.device)
    return _time_graph([(lambda w=copies[i % len(copies)]: run(x, w, out))
                        for i in range(calls)])


def compare(rows_list, device, bandwidth: float) -> list[dict]:
    from engine.dense_gemv import CANDIDATES, dense_gemv, pick_dense_config

    out = []
    for name, n, k, per_step in bf16_shapes():
        copies = _copies(n, k, device)
        floor = n * k * 2 / bandwidth
        for rows in rows_list:
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            cublas = _timed(x, copies, lambda x, w, o: torch.matmul(x, w.t(), out=o))
            configs = [pick_dense_config(n, k)] + [replace(c, split_k=s) for c in CANDIDATES
                                             for s in (None, 1, 2, 4, 8)]
            timed = []
            for config in configs:
                try:
                    t = _timed(x, copies, lambda x, w, o, c=config: dense_gemv(x, w, out=o,
                                                                                config=c))
                except Exception as e:  # a config the card cannot run (shared memory)
                    print(f"{name} rows={rows} {config.key()}: {type(e).__name__}: {e}")
                    continue
                timed.append((t, config))
            best_t, best = min(timed, key=lambda tc: tc[0])
            picked_t = timed[0][0] if timed and timed[0][1] == configs[0] else float("nan")
            out.append({"matrix": name, "N": n, "K": k, "rows": rows, "per_step": per_step,
                        "cublas_us": cublas * 1e6, "triton_picked_us": picked_t * 1e6,
                        "triton_best_us": best_t * 1e6, "best": best.key(),
                        "floor_us": floor * 1e6, "cublas_of_floor": floor / cublas,
                        "best_of_floor": floor / best_t})
        del copies
    return out


def step_sums(rows: list[dict]) -> list[dict]:
    out = []
    for batch in sorted({r["rows"] for r in rows}):
        mine = [r for r in rows if r["rows"] == batch]
        out.append({"rows": batch,
                    "cublas_ms": sum(r["cublas_us"] * r["per_step"] for r in mine) / 1e3,
                    "triton_picked_ms": sum(r["triton_picked_us"] * r["per_step"]
                                            for r in mine) / 1e3,
                    "triton_best_ms": sum(r["triton_best_us"] * r["per_step"] for r in mine) / 1e3,
                    "floor_ms": sum(r["floor_us"] * r["per_step"] for r in mine) / 1e3})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dense_gemv", description=__doc__)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.dense_gemv needs a GPU")
    device = torch.device("cuda")
    bandwidth = _copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    rows = compare(a.rows, device, bandwidth)
    columns = ["matrix", "N", "K", "rows", "cublas_us", "triton_picked_us", "triton_best_us",
               "best", "floor_us", "cublas_of_floor", "best_of_floor"]
    print_table("bf16 GEMV: cuBLAS against the Triton GEMV (graph-timed, weights past L2)",
                columns, [[r[c] for c in columns] for r in rows])
    sums = step_sums(rows)
    columns = ["rows", "cublas_ms", "triton_picked_ms", "triton_best_ms", "floor_ms"]
    print_table("a 27B decode step's bf16 GEMVs", columns, [[r[c] for c in columns] for r in sums])
    if a.json:
        write_json(a.json, {"shapes": rows, "step": sums})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
