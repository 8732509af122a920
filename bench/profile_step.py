"""Where a decode step's GPU time goes: every kernel of one step, grouped.

Runs decode steps as bench/decode.py does (CUDA graphs on unless
--no-cuda-graphs) under torch.profiler and prints, per kernel name, the calls
and microseconds per step, then the same summed by kind (weight GEMV/GEMM,
attention, GDN, norms and elementwise, copies). The step's wall time over the
sum of kernel times shows how much is gaps between kernels. CUDA only: the
CPU path has no kernels to attribute.

With dependent launches on (engine/pdl.py) a kernel's own time includes its
wait for the kernel before, so its duration says little. --critical-path
instead charges each kernel with how far it moved the end of the step (its
end minus the latest end before it), grouped by the kernel and the one before
it: that sum is the step, and a hop that costs more than its work shows.

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
    """(the finished profiler, active step times)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    sched = schedule(wait=0, warmup=warmup, active=active, repeat=1)
    with profile(activities=[ProfilerActivity.CUDA], schedule=sched) as prof:
        times = decode_steps(loaded, kv_format, batch, context, warmup + active,
                             cuda_graphs=cuda_graphs, after_step=prof.step)
    return prof, times[warmup:]


def kernel_spans(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every kernel of a finished profiler run, by start."""
    spans = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(spans, key=lambda s: s[1])


def short_name(name: str) -> str:
    """A kernel's name without its template and argument noise."""
    name = name.split("(")[0].split("<")[0].strip()
    return name.removeprefix("void ").split("::")[-1][:40]


def critical_path(spans: list[tuple[str, float, float]]) -> dict[str, list[float]]:
    """{"before -> kernel": [calls, us the step's end advanced, us of lead]}:
    each kernel's advance is its end past the latest end before it, so the
    advances add up to the span; the lead is how long before that latest end
    it started (its programs placed early under dependent launches)."""
    table: dict[str, list[float]] = {}
    latest, before = None, "(start)"
    for name, start, end in spans:
        this = short_name(name)
        entry = table.setdefault(f"{before} -> {this}", [0, 0.0, 0.0])
        entry[0] += 1
        if latest is None:
            entry[1] += end - start
        else:
            entry[1] += max(0.0, end - latest)
            entry[2] += max(0.0, latest - start)
        latest = end if latest is None else max(latest, end)
        before = this
    return table


def print_critical_path(spans, per: int, top: int) -> dict:
    table = critical_path(spans)
    rows = sorted(table.items(), key=lambda kv: -kv[1][1])
    span = sum(adv for _, (_, adv, _) in rows)
    print_table("critical path, per step: each kernel's advance of the step's end, after the "
                "kernel before it", ["hop", "calls", "us", "us each", "lead us each", "share %"],
                [[hop[:80], calls / per, adv / per, adv / calls, lead / calls, 100 * adv / span]
                 for hop, (calls, adv, lead) in rows[:top]])
    print(f"critical path {span / per / 1e3:.2f} ms a step in {len(spans) / per:.0f} launches")
    return {hop: {"calls": c / per, "us": a / per, "lead_us": l / per}
            for hop, (c, a, l) in rows}


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
    p.add_argument("--critical-path", action="store_true",
                   help="also charge each kernel with its advance of the step's end (for PDL on)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("bench.profile_step needs a CUDA device")

    from engine.loader import load_model

    loaded = load_model(args.model, device="cuda", weights=args.weights, progress=False)
    graphs = False if args.no_cuda_graphs else None
    prof, times = profile_steps(loaded, args.kv_format, args.batch, args.context,
                                args.warmup, args.steps, graphs)
    kernels = kernel_times(prof)
    step_ms = median(times) * 1e3
    title = (f"{args.model} {args.weights} weights, {args.kv_format} KV, batch {args.batch}, "
             f"context {args.context}, graphs {'off' if graphs is False else 'on'}, per step")
    summary = summarize(kernels, args.steps, title, args.top)
    kernel_us, launches = summary["kernel_us"], summary["launches"]
    print(f"step {step_ms:.2f} ms (median of {args.steps} profiled, profiler on); kernels "
          f"{kernel_us / 1e3:.2f} ms in {launches:.0f} launches; gaps {step_ms - kernel_us / 1e3:.2f} ms")
    if args.critical_path:
        summary["critical_path"] = print_critical_path(kernel_spans(prof), args.steps, args.top)
    write_json(args.json, {"args": vars(args), "step_ms": step_ms, **summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
