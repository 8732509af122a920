"""Where a decode step's GPU time goes: every kernel of one step, grouped.

Runs decode steps as bench/decode.py does (CUDA graphs on unless
--no-cuda-graphs) under torch.profiler and prints, per kernel name, the calls
and microseconds per step, then the same summed by kind (weight GEMV/GEMM,
attention, GDN, norms and elementwise, copies). The step's wall time over the
sum of kernel times shows how much is gaps between kernels. CUDA only: the
CPU path has no kernels to attribute.

    python -m bench.profile_step --model qwen3.5-27b --weights int4 --context 4096
"""
from __future__ import annotations

import argparse
import sys

import torch

from bench.common import median, print_table, write_json
from bench.decode import decode_steps
from engine.profiling import by_kind, kernel_times


def profile_steps(loaded, kv_format: str, batch: int, context: int, warmup: int, active: int,
                  cuda_graphs: bool | None):
    """(per-kernel {name: [calls, total_us]} over the active steps, active step times)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    sched = schedule(wait=0, warmup=warmup, active=active, repeat=1)
    with profile(activities=[ProfilerActivity.CUDA], schedule=sched) as prof:
        times = decode_steps(loaded, kv_format, batch, context, warmup + active,
                             cuda_graphs=cuda_graphs, after_step=prof.step)
    return kernel_times(prof), times[warmup:]


def summarize(kernels: dict[str, list[float]], per: int, title: str, top: int) -> dict:
    """Prints the kernels (per `per` runs) and their sums by kind; returns both for JSON."""
    per_kernel = sorted(((name, calls / per, us / per) for name, (calls, us) in kernels.items()),
                        key=lambda r: -r[2])
    kinds = by_kind({name: [calls, us] for name, calls, us in per_kernel})
    kernel_us = sum(us for _, _, us in per_kernel)
    print_table(f"kernels ({title})", ["kernel", "calls", "us", "share %"],
                [[name[:90], calls, us, 100 * us / kernel_us]
                 for name, calls, us in per_kernel[:top]])
    print_table("by kind", ["kind", "calls", "us", "share %"],
                [[k, c, us, 100 * us / kernel_us]
                 for k, (c, us) in kinds.items()])
    return {"kernel_us": kernel_us, "launches": sum(calls for _, calls, _ in per_kernel),
            "kernels": [{"name": n, "calls": c, "us": u} for n, c, u in per_kernel],
            "by_kind": {k: {"calls": c, "us": u} for k, (c, u) in kinds.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile_step",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3.5-27b")
    p.add_argument("--weights", default="bf16")
    p.add_argument("--kv-format", default="int8")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="profiled steps")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("bench.profile_step needs a CUDA device")

    from engine.loader import load_model

    loaded = load_model(args.model, device="cuda", weights=args.weights, progress=False)
    graphs = False if args.no_cuda_graphs else None
    kernels, times = profile_steps(loaded, args.kv_format, args.batch, args.context,
                                   args.warmup, args.steps, graphs)
    step_ms = median(times) * 1e3
    title = (f"{args.model} {args.weights} weights, {args.kv_format} KV, batch {args.batch}, "
             f"context {args.context}, graphs {'off' if graphs is False else 'on'}, per step")
    summary = summarize(kernels, args.steps, title, args.top)
    kernel_us, launches = summary["kernel_us"], summary["launches"]
    print(f"step {step_ms:.2f} ms (median of {args.steps} profiled, profiler on); kernels "
          f"{kernel_us / 1e3:.2f} ms in {launches:.0f} launches; gaps {step_ms - kernel_us / 1e3:.2f} ms")
    write_json(args.json, {"args": vars(args), "step_ms": step_ms, **summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
