"""Does a resident chain pay? Two one-row Q4_K GEMVs of K = 5120 with the
add_rms_norm between them, as the int4 step runs them (three dependent
launches: GEMV, norm, GEMV) against the norm in the second GEMV's prologue
(two launches) and against bench/q4_chain.cu, all three in ONE persistent
launch whose blocks wait at a grid counter, the second GEMV's first tile
already in registers (docs/ARCHITECTURE.md, the decode step's item 4):

    python -m bench.chain_probe [--second gate_up "gdn in_proj" "attn qkv"] [--check]

The first GEMV is 5120 x 5120 (an out projection's N; the 27B's have K =
6144, a block shape the chain cannot share with K = 5120's yet). Each
variant is graph-timed 16 pairs back to back, weight copies cycled past L2,
PDL on. --check also compares the chain's outputs with the launches'. A
probe: nothing in the engine calls it. GPU only (sm_90: PDL and the grid
counter's acquire loads).
"""
from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

CHAIN_SOURCE = Path(__file__).with_name("q4_chain.cu")
CHAIN_KERNEL = "tandem_q4_chain"
FIRST_N = 5120
K = 5120


@functools.lru_cache(maxsize=1)
def chain_source() -> str:
    """q4_gemv.cu's helpers, then the chain kernel (read once: every launch
    keys its build by it)."""
    from engine.quant.gemv_cuda import SOURCE

    return SOURCE.read_text() + "\n" + CHAIN_SOURCE.read_text()


def chain_options(plan, superblock: int, asymmetric: bool, d_fp32: bool, pdl: bool,
                  norm) -> tuple[str, ...]:
    """The GEMV's build constants with the norm prologue's flags (its helpers),
    no ring, no read-ahead, no early tiles (the chain walks its tiles through
    registers whatever the plan says): what the chain kernel compiles under."""
    from engine.quant.gemv_cuda import build_options

    return build_options(replace(plan, stages=0), superblock, asymmetric, d_fp32, pdl,
                         prologue=norm)


@dataclass
class Chain:
    """Launches of the chain kernel; keeps one grid counter per (device,
    grid size): zeroed once, it only ever grows by a launch's grid."""
    counters: dict = field(default_factory=dict)

    def __call__(self, x_a, qt_a, out_a, qt_b, out_b, residual, norm, plan,
                 pdl: bool = True) -> None:
        """out_a = qt_a x_a; out_b = qt_b RMSNorm(residual + out_a), the sum
        stored to norm.residual_out (norm.pending must be out_a)."""
        from engine.quant.gemv_cuda import _compiled, _launch, launchable

        if qt_a.shape[1] != K or qt_b.shape[1] != K or qt_a.shape[0] != K:
            raise ValueError(f"the chain takes a {K} x {K} first GEMV and a second of K = {K}")
        if qt_a.asymmetric != qt_b.asymmetric or qt_a.d.dtype != qt_b.d.dtype:
            raise ValueError("both weights must share one format (one build)")
        if norm.pending is not out_a or norm.residual_out is None:
            raise ValueError("the chain's norm adds out_a: NormPrologue(..., pending=out_a, "
                             "residual_out=...)")
        device = x_a.device.index if x_a.device.index is not None else torch.cuda.current_device()
        compiled = _compiled(chain_options(plan, qt_a.superblock, qt_a.asymmetric,
                                           qt_a.d.dtype == torch.float32, pdl, norm),
                             device, plan.threads, 0, chain_source(), CHAIN_KERNEL)
        if not launchable(compiled.local_bytes):
            raise ValueError(f"the chain's build spills {compiled.local_bytes} bytes a thread")
        sms = torch.cuda.get_device_properties(x_a.device).multi_processor_count
        # every block resident at once, or the grid counter waits forever
        grid = min(sms * compiled.resident_per_sm,
                   max(plan.tiles(qt_a.shape[0]), plan.tiles(qt_b.shape[0])))
        key = (device, grid)
        if key not in self.counters:
            self.counters[key] = torch.zeros(1, dtype=torch.int32, device=x_a.device)
        _, weight, eps, residual_out = norm.operands(residual, K)

        def arrays(qt):
            return [qt.qweight, qt.d, qt.sc, qt.dmin if qt.asymmetric else qt.d,
                    qt.m if qt.asymmetric else qt.sc]

        _launch(compiled, grid, plan.threads,
                [x_a, *arrays(qt_a), out_a, qt_a.shape[0], *arrays(qt_b), out_b, qt_b.shape[0],
                 residual, weight, eps, residual_out, self.counters[key]], pdl)


def time_pair(second: str, device, check: bool) -> dict:
    """us per pair for the three variants (and each GEMV alone)."""
    from bench.quant import _copies, _time_graph, model_shapes
    from engine.fused import load_kernels
    from engine.quant.gemv_cuda import NormPrologue, gemv_cuda, picked_plan

    shapes = {name: (fmt, n, k) for name, fmt, n, k, _ in model_shapes() if fmt.name == "Q4_K"}
    fmt, n_b, k_b = shapes[second]
    if k_b != K:
        raise ValueError(f"{second} has K = {k_b}; the chain takes K = {K}")
    copies_a, copies_b = _copies(fmt, FIRST_N, K, device), _copies(fmt, n_b, K, device)
    plan = picked_plan(n_b, K, torch.cuda.get_device_name(device))
    kernels = load_kernels()
    x_a = torch.randn(1, K, device=device, dtype=torch.bfloat16)
    residual = torch.randn(1, K, device=device, dtype=torch.bfloat16)
    weight = torch.randn(K, device=device, dtype=torch.bfloat16) * 0.1
    out_a = torch.empty(1, FIRST_N, device=device, dtype=torch.bfloat16)
    out_b = torch.empty(1, n_b, device=device, dtype=torch.bfloat16)
    residual_out = torch.empty(1, K, device=device, dtype=torch.bfloat16)
    norm = NormPrologue(weight, 1e-6, True, out_a, residual_out)
    chain = Chain()

    def first(a):
        gemv_cuda(x_a, a, out=out_a, plan=plan, pdl=True)

    def apart(a, b):
        first(a)
        _, normed = kernels.add_rms_norm(residual, out_a, weight, 1e-6, True)
        gemv_cuda(normed, b, out=out_b, plan=plan, pdl=True)

    def prologue(a, b):
        first(a)
        gemv_cuda(residual, b, out=out_b, plan=plan, pdl=True, prologue=norm)

    def chained(a, b):
        chain(x_a, a, out_a, b, out_b, residual, norm, plan)

    def second_alone(a, b):
        gemv_cuda(residual, b, out=out_b, plan=plan, pdl=True)

    variants = {"apart": apart, "prologue": prologue, "chain": chained,
                "first_alone": lambda a, b: first(a), "second_alone": second_alone}
    result = {"second": second, "N": n_b, "plan": plan.spec()}
    for label, fn in variants.items():
        calls = [(lambda a=copies_a[i % len(copies_a)], b=copies_b[i % len(copies_b)]:
                  fn(a, b)) for i in range(16)]
        result[f"{label}_us"] = _time_graph(calls) * 1e6
    if check:
        result.update(compare(chained, prologue, copies_a[0], copies_b[0],
                              (out_a, out_b, residual_out)))
    return result


def compare(chained, prologue, a, b, outputs) -> dict:
    """The chain's three outputs (out_a, out_b, residual_out) against the
    two launches' (the prologue variant: the same deferred-rstd numerics),
    the outputs NaN-poisoned before the chain runs."""
    prologue(a, b)
    want = [t.clone() for t in outputs]
    for t in outputs:
        t.fill_(float("nan"))
    chained(a, b)
    torch.cuda.synchronize()
    return {"first_equal": bool(torch.equal(outputs[0], want[0])),
            "second_max_diff": float((outputs[1].float() - want[1].float()).abs().max()),
            "second_scale": float(want[1].float().abs().max()),
            "residual_equal": bool(torch.equal(outputs[2], want[2]))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chain_probe",
                                description=__doc__.splitlines()[0])
    p.add_argument("--second", nargs="+", default=["gate_up", "gdn in_proj", "attn qkv"],
                   help="the second GEMV's shapes (bench.quant's names, K = 5120)")
    p.add_argument("--check", action="store_true", help="also compare the chain's outputs")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.chain_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    from bench.quant import print_table

    device = torch.device("cuda", torch.cuda.current_device())
    rows = [time_pair(name, device, args.check) for name in args.second]
    print_table("5120 x 5120 GEMV, add_rms_norm, second GEMV: us a pair",
                ["second", "N", "apart", "prologue", "chain", "first alone", "second alone",
                 "chain saves"],
                [[r["second"], r["N"], *(f"{r[k]:.1f}" for k in (
                    "apart_us", "prologue_us", "chain_us", "first_alone_us", "second_alone_us")),
                  f"{r['apart_us'] - r['chain_us']:.1f}"] for r in rows])
    for r in rows:
        if args.check:
            print(f"{r['second']}: first equal {r['first_equal']}, residual equal "
                  f"{r['residual_equal']}, second max diff {r['second_max_diff']:.4g} "
                  f"of {r['second_scale']:.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
