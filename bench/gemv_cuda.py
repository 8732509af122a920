"""The CUDA DP4A GEMV (engine/quant/gemv_cuda.py) against the Triton kernels
on the 27B's one-row Q4_K shapes, timed like bench.quant (a CUDA graph of
back-to-back calls, weight copies cycled past L2, PDL on as in the step):

    python -m bench.gemv_cuda [--rows 1 2 4 8] [--only NAME ...] [--no-sweep] [--plans-out FILE] [--json FILE] [--norm] [--silu] [--gated]
        [--read-ahead [MB ...]] [--stages [N ...]]

First every rows-per-tile at the plan's own slots and a full persistent
grid, then, for each shape's best: twice the slots (at the
same and at half the rows), a capped grid and the cross-warp sums of 2, 4, 8
or 16 tiles reduced at once (flush); with --stages, the best register
plan's tiles through a shared-memory ring of bulk copies (q4_gemv.cu
STAGES). The
best plan per shape goes to --plans-out, the file TANDEM_GEMV_CUDA_PLANS
reads, so the step's A/B (`TANDEM_GEMV_CUDA=1 python -m bench.quant
--decode-steps 16`) runs what the sweep chose. --norm also times, on the
shapes that follow a norm (gate_up, gdn in_proj, attn qkv), engine/fused's
add_rms_norm launch then the GEMV against the GEMV doing the norm in its
prologue (gemv_cuda.NormPrologue), and beside them the GEMV alone and the
prologue without the pending residual (what every block's second read of
a row costs); --silu the same for down and the MLP's
silu_mul, --gated for gdn out and GDN's gated norm. --read-ahead times
two GEMVs in the step's order with the small kernels between them (stood in
for by tiny elementwise launches), plain against the first reading the
second's leading 8, 16 or 32 MB into L2 (gemv_cuda.L2Prefetch). GPU only.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from bench.quant import (_copies, _copy_bandwidth, _time_gemv, _time_graph, model_shapes,
                         print_table)


def _time_cuda(x, copies, plan) -> float:
    """Seconds a call, or inf for a plan whose build spills (never launched:
    gemv_cuda.SpillingPlan)."""
    from engine.quant.gemv_cuda import SpillingPlan, gemv_cuda

    out = torch.empty(1, copies[0].out_features, dtype=x.dtype, device=x.device)
    try:
        gemv_cuda(x, copies[0], out=out, plan=plan, pdl=True)
    except SpillingPlan:
        return float("inf")
    fns = [(lambda qt=copies[i % len(copies)]: gemv_cuda(x, qt, out=out, plan=plan, pdl=True))
           for i in range(16)]
    return _time_graph(fns)


def prologue_pair(name: str, n: int, k: int, fmt, device, prologue: str) -> dict:
    """The op before the GEMV as its own launch, then the GEMV, against the
    GEMV doing it in its prologue, graph-timed: "norm", Qwen3.5's
    zero-centred add_rms_norm with a pending residual (NormPrologue);
    "silu", the MLP's silu_mul of a [1, 2K] gate_up row; "gated", GDN's
    gated_rms_norm over heads of 128 (GatedNormPrologue)."""
    from engine.fused import load_kernels
    from engine.quant.gemv_cuda import (GatedNormPrologue, NormPrologue, SiluPrologue, gemv_cuda,
                                        plan_for)

    copies = _copies(fmt, n, k, device)
    kernels = load_kernels()
    extra = {}
    out = torch.empty(1, n, dtype=torch.bfloat16, device=device)
    plan = plan_for(k, rows=4)
    if prologue == "norm":
        x, pending = (torch.randn(1, k, device=device, dtype=torch.bfloat16) for _ in range(2))
        weight = torch.randn(k, device=device, dtype=torch.bfloat16) * 0.1
        residual = torch.empty(1, k, dtype=torch.bfloat16, device=device)

        def apart(qt):
            _, normed = kernels.add_rms_norm(x, pending, weight, 1e-6, True)
            gemv_cuda(normed, qt, out=out, plan=plan, pdl=True)

        def fused(qt):
            gemv_cuda(x, qt, out=out, plan=plan, pdl=True,
                      prologue=NormPrologue(weight, 1e-6, True, pending, residual))

        def fused_without_pending(qt):   # what reading pending in every block costs
            gemv_cuda(x, qt, out=out, plan=plan, pdl=True,
                      prologue=NormPrologue(weight, 1e-6, True))

        def plain(qt):                   # the GEMV alone: what either adds to it
            gemv_cuda(x, qt, out=out, plan=plan, pdl=True)

        extra = {"plain": plain, "fused_without_pending": fused_without_pending}
    elif prologue == "gated":   # the 27B's GDN: 48 heads of 128
        x, gate = (torch.randn(1, k // 128, 128, device=device, dtype=torch.bfloat16)
                   for _ in range(2))
        weight = torch.randn(128, device=device, dtype=torch.bfloat16) * 0.1 + 1.0

        def apart(qt):
            normed = kernels.gated_rms_norm(x, gate, weight, 1e-6)
            gemv_cuda(normed.reshape(1, k), qt, out=out, plan=plan, pdl=True)

        def fused(qt):
            gemv_cuda(x.reshape(1, k), qt, out=out, plan=plan, pdl=True,
                      prologue=GatedNormPrologue(gate.reshape(1, k), weight, 1e-6))
    else:
        gate_up = torch.randn(1, 2 * k, device=device, dtype=torch.bfloat16)
        gate, up = gate_up.split(k, dim=-1)

        def apart(qt):
            gemv_cuda(kernels.silu_mul(gate, up), qt, out=out, plan=plan, pdl=True)

        def fused(qt):
            gemv_cuda(gate_up, qt, out=out, plan=plan, pdl=True, prologue=SiluPrologue())

    timed = {label: _time_graph([(lambda qt=copies[i % len(copies)]: fn(qt)) for i in range(16)])
             for label, fn in {"apart": apart, "fused": fused, **extra}.items()}
    del copies
    return {"matrix": name, "prologue": prologue, "N": n, "K": k,
            **{f"{label}_us": seconds * 1e6 for label, seconds in timed.items()}}


# (first, second, small kernels between them in a 27B step): GDN's conv,
# recurrence and gated norm; an add_rms_norm; the MLP's activation
READ_AHEAD_PAIRS = (("gdn in_proj", "gdn out", 3), ("gdn out", "gate_up", 1),
                    ("gate_up", "down", 1), ("down", "gdn in_proj", 1))


def read_ahead_pair(first: tuple, second: tuple, gap: int, megabytes: list[int],
                    device) -> dict:
    """us per (first GEMV, `gap` tiny launches, second GEMV), graph-timed
    with weight copies cycled past L2, for each read-ahead size (0: none)."""
    from engine.quant.gemv_cuda import L2Prefetch, gemv_cuda

    (name_a, fmt_a, n_a, k_a), (name_b, fmt_b, n_b, k_b) = first, second
    copies_a, copies_b = _copies(fmt_a, n_a, k_a, device), _copies(fmt_b, n_b, k_b, device)
    x_a = torch.randn(1, k_a, device=device, dtype=torch.bfloat16)
    x_b = torch.randn(1, k_b, device=device, dtype=torch.bfloat16)
    out_a = torch.empty(1, n_a, device=device, dtype=torch.bfloat16)
    out_b = torch.empty(1, n_b, device=device, dtype=torch.bfloat16)
    small = torch.zeros(1, 6144, device=device, dtype=torch.bfloat16)

    def sequence(i: int, budget: int) -> None:
        a, b = copies_a[i % len(copies_a)], copies_b[i % len(copies_b)]
        ahead = L2Prefetch.of(b, budget) if budget else None
        gemv_cuda(x_a, a, out=out_a, pdl=True, l2_prefetch=ahead)
        for _ in range(gap):
            small.mul_(1.0)
        gemv_cuda(x_b, b, out=out_b, pdl=True)

    timed = {mb: _time_graph([(lambda i=i, mb=mb: sequence(i, mb << 20)) for i in range(8)])
             * 1e6 for mb in [0, *megabytes]}
    del copies_a, copies_b
    return {"first": name_a, "second": name_b, "gap": gap,
            "us": {str(mb): us for mb, us in timed.items()}}


def _plans_to_try(k: int, rows_list: list[int], best=None) -> list:
    from engine.quant.gemv_cuda import plan_for

    if best is None:
        return [plan_for(k, rows=r) for r in rows_list]
    tries = []
    if best.threads > 64:
        tries.append(plan_for(k, rows=best.rows, slots=best.slots * 2))
        if best.rows > 1:  # the same registers a thread, half the threads
            tries.append(plan_for(k, rows=best.rows // 2, slots=best.slots * 2))
    tries += [plan_for(k, rows=best.rows, slots=best.slots, blocks_per_sm=b) for b in (1, 2, 3)]
    tries += [plan_for(k, rows=best.rows, slots=best.slots, blocks_per_sm=best.blocks_per_sm,
                       flush=f) for f in (2, 4, 8, 16) if f * best.rows <= best.threads]
    return tries


def _stages_to_try(k: int, best, stages_list: list[int]) -> list:
    """The best register plan's tiles through a ring of each stage count, at
    flush 1 and at the best's flush, and at 4 rows whatever the best's."""
    from engine.quant.gemv_cuda import plan_for

    tries = []
    for stages in stages_list:
        for rows, flush in {(best.rows, 1), (best.rows, best.flush), (4, 1)}:
            tries.append(plan_for(k, rows=rows, slots=best.slots,
                                  blocks_per_sm=best.blocks_per_sm, flush=flush, stages=stages))
    return tries


def sweep_shape(name: str, n: int, k: int, fmt, rows_list: list[int], bandwidth: float,
                device, stages_list: list[int] = ()) -> dict:
    copies = _copies(fmt, n, k, device)
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    floor = (copies[0].nbytes + k * 2 + n * 2) / bandwidth
    triton_s = _time_gemv(x, copies)
    timed = []
    for plan in _plans_to_try(k, rows_list):
        timed.append((_time_cuda(x, copies, plan), plan))
    best = min(timed, key=lambda t: t[0])[1]
    for plan in _plans_to_try(k, rows_list, best):
        timed.append((_time_cuda(x, copies, plan), plan))
    registers = min(timed, key=lambda t: t[0])
    from engine.quant.gemv_cuda import bulk_copyable

    for plan in _stages_to_try(k, registers[1], stages_list):
        if bulk_copyable(plan, copies[0]):
            timed.append((_time_cuda(x, copies, plan), plan))
    seconds, best = min(timed, key=lambda t: t[0])
    del copies
    return {"matrix": name, "N": n, "K": k, "floor_us": floor * 1e6,
            "triton_us": triton_s * 1e6, "cuda_us": seconds * 1e6,
            "registers_us": registers[0] * 1e6,
            "best": {**best.spec(), "threads": best.threads},
            "all": [{**p.spec(), "us": s * 1e6 if s != float("inf") else None}  # None: spills
                    for s, p in timed]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gemv_cuda",
                                description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--only", nargs="+", help="matrix names as bench.quant prints them")
    p.add_argument("--no-sweep", action="store_true",
                   help="skip the plan sweep: only the comparisons asked for")
    p.add_argument("--plans-out", help="write the best plan per shape (TANDEM_GEMV_CUDA_PLANS)")
    p.add_argument("--json", help="write every timing")
    p.add_argument("--stages", type=int, nargs="*",
                   help="also time each shape's best plan through a shared-memory ring of "
                        "these stage counts (none given: 2 3 4 6)")
    p.add_argument("--norm", action="store_true",
                   help="also time the norm prologue against a norm launch and the GEMV")
    p.add_argument("--silu", action="store_true",
                   help="also time down's SiLU prologue against a silu_mul launch and the GEMV")
    p.add_argument("--gated", action="store_true",
                   help="also time gdn out's gated norm prologue against its launch and the GEMV")
    p.add_argument("--read-ahead", type=int, nargs="*", metavar="MB",
                   help="also time GEMV pairs with the first reading the second ahead "
                        "(MB each; none given: 8 16 32)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gemv_cuda needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    bandwidth = _copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", file=sys.stderr)
    results = []
    for name, fmt, n, k, per_step in model_shapes():
        if fmt.name != "Q4_K" or not (per_step or name == "lm_head"):
            continue
        if (args.only and name not in args.only) or args.no_sweep:
            continue
        stages = [] if args.stages is None else args.stages or [2, 3, 4, 6]
        r = sweep_shape(name, n, k, fmt, args.rows, bandwidth, device, stages)
        r["per_step"] = per_step
        results.append(r)
        print(f"{name}: triton {r['triton_us']:.1f} us, cuda {r['cuda_us']:.1f} us "
              f"({r['best']}), floor {r['floor_us']:.1f}", file=sys.stderr, flush=True)
    if results:
        print_table("one-row Q4_K GEMV: Triton (picked) against the CUDA kernel (best plan), us",
                    ["matrix", "N", "K", "triton", "of floor", "registers", "cuda", "of floor",
                     "plan"],
                    [[r["matrix"], r["N"], r["K"], f"{r['triton_us']:.1f}",
                      f"{100 * r['floor_us'] / r['triton_us']:.0f}%", f"{r['registers_us']:.1f}",
                      f"{r['cuda_us']:.1f}", f"{100 * r['floor_us'] / r['cuda_us']:.0f}%",
                      "r{rows} s{slots} t{threads} b{blocks_per_sm} f{flush} st{stages}".format(
                          **r["best"])]
                     for r in results])
        for key in ("triton_us", "registers_us", "cuda_us", "floor_us"):
            total = sum(r["per_step"] * r[key] for r in results)
            print(f"27B step GEMVs ({key[:-3]}): {total / 1e3:.2f} ms")
    norms = []
    wanted = {**({m: "norm" for m in ("gate_up", "gdn in_proj", "attn qkv")} if args.norm else {}),
              **({"down": "silu"} if args.silu else {}),
              **({"gdn out": "gated"} if args.gated else {})}
    for name, fmt, n, k, per_step in model_shapes():
        if fmt.name == "Q4_K" and name in wanted:
            norms.append({**prologue_pair(name, n, k, fmt, device, wanted[name]),
                          "per_step": per_step})
    if norms:
        print_table("the op before the GEMV and the GEMV, apart against the GEMV's prologue, us",
                    ["matrix", "prologue", "N", "K", "apart", "fused", "saved ms/step",
                     "GEMV alone", "fused, no pending"],
                    [[r["matrix"], r["prologue"], r["N"], r["K"], f"{r['apart_us']:.1f}",
                      f"{r['fused_us']:.1f}",
                      f"{(r['apart_us'] - r['fused_us']) * r['per_step'] / 1e3:.2f}",
                      *(f"{r[key]:.1f}" if key in r else "-"
                        for key in ("plain_us", "fused_without_pending_us"))]
                     for r in norms])
    aheads = []
    if args.read_ahead is not None:
        shapes = {name: (name, fmt, n, k) for name, fmt, n, k, _ in model_shapes()
                  if fmt.name == "Q4_K"}
        sizes = args.read_ahead or [8, 16, 32]
        for first, second, gap in READ_AHEAD_PAIRS:
            aheads.append(read_ahead_pair(shapes[first], shapes[second], gap, sizes, device))
        print_table("first GEMV, small launches, second GEMV: us, the first reading the "
                    "second's leading MB into L2",
                    ["first", "second", "gap", "none", *(f"{mb} MB" for mb in sizes)],
                    [[r["first"], r["second"], r["gap"],
                      *(f"{r['us'][str(mb)]:.1f}" for mb in [0, *sizes])] for r in aheads])
    if args.plans_out:
        with open(args.plans_out, "w") as f:
            json.dump({f"{r['N']},{r['K']}": r["best"] for r in results}, f, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth_GBps": bandwidth / 1e9, "shapes": results, "norm": norms,
                       "read_ahead": aheads}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
