"""Does a resident chain pay? Two one-row Q4_K GEMVs with the add_rms_norm
between them, as the int4 step runs them (three dependent launches: GEMV,
norm, GEMV) against the norm in the second GEMV's prologue (two launches)
and against bench/q4_chain.cu, all three in ONE persistent launch whose
blocks wait at a grid counter, the second GEMV's first tile already in
registers (docs/ARCHITECTURE.md, the decode step's item 4):

    python -m bench.chain_probe [--pairs NAME ...] [--check]

The pairs (PAIRS): a 5120 x 5120 GEMV before each K = 5120 projection (one
block shape for both: the premise alone), then the 27B's own boundaries:
gdn out (K = 6144) before gate_up, in 192-thread blocks whose sixth warp
idles in gate_up's phase or in 160-thread blocks at two groups a thread,
and down (K = 17408, 544 threads) before gdn in_proj or attn qkv, whose
phase runs in three 160-thread parts a block. Each variant is graph-timed
16 pairs back to back, weight copies cycled past L2, PDL on. --check also
compares the chain's outputs with the launches'. A probe: nothing in the
engine calls it. GPU only (sm_90: PDL and the grid counter's acquire loads).
"""
from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from engine.quant.gemv_cuda import CudaGemvPlan, picked_plan, plan_for

CHAIN_SOURCE = Path(__file__).with_name("q4_chain.cu")
CHAIN_KERNEL = "tandem_q4_chain"
HIDDEN = 5120          # the 27B's: K of the second GEMV, N of the first
MAX_PARTS = 15         # named barriers 1..15
SM_REGISTERS = 65536
GEMV_REGISTERS = 96    # the most a 160-thread GEMV may take for 4 blocks an SM


@functools.lru_cache(maxsize=1)
def chain_source() -> str:
    """q4_gemv.cu's helpers, then the chain kernel (read once: every launch
    keys its build by it)."""
    from engine.quant.gemv_cuda import SOURCE

    return SOURCE.read_text() + "\n" + CHAIN_SOURCE.read_text()


@dataclass(frozen=True)
class ChainPlan:
    """The chain's two tile shapes: phase A walks `first`'s tiles in blocks
    of first.threads threads; phase B walks `second`'s in `parts` parts of
    second.threads threads a block (the block's other threads idle there).
    Both through registers: the chain has no ring and no read-ahead, and
    one early tile, whatever the plans say. min_blocks: the blocks an SM the build
    asks ptxas to fit (__launch_bounds__; 0: as many as fit at the GEMV's
    96 registers, 4 of 160 threads). Left alone ptxas gave the 160-thread
    chain 110 registers, 3 blocks an SM; asked for 4 it takes 94 and spills
    nothing (NVRTC sm_90, 12-07)."""
    first: CudaGemvPlan
    second: CudaGemvPlan
    parts: int = 1
    min_blocks: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.parts <= MAX_PARTS:
            raise ValueError(f"parts must be 1..{MAX_PARTS} (a named barrier each): {self}")
        if self.parts * self.second.threads > self.first.threads:
            raise ValueError(f"{self.parts} parts of {self.second.threads} threads exceed the "
                             f"block's {self.first.threads}: {self}")
        if self.first.flush * self.first.rows > self.first.threads:
            raise ValueError(f"the first GEMV's flush x rows exceeds its threads: {self}")
        if self.min_blocks < 0:
            raise ValueError(f"min_blocks must be >= 0: {self}")

    @property
    def blocks_per_sm(self) -> int:
        """What the build asks ptxas to fit an SM."""
        return self.min_blocks or max(1, SM_REGISTERS // (GEMV_REGISTERS * self.threads))

    @property
    def threads(self) -> int:
        return self.first.threads

    def grid(self, n_a: int, n_b: int, sms: int, resident_per_sm: int) -> int:
        """Every block resident at once (or the grid counter waits forever),
        never more than either phase has work for."""
        per_block_b = -(-self.second.tiles(n_b) // self.parts)
        return max(1, min(sms * resident_per_sm, max(self.first.tiles(n_a), per_block_b)))


def chain_options(chain: ChainPlan, superblock: int, asymmetric: bool, d_fp32: bool, pdl: bool,
                  norm, epilogue=None) -> tuple[str, ...]:
    """The second GEMV's build constants with the norm prologue's flags (its
    helpers) and its epilogue's (the step's: SiLU * up after gate_up, the
    conv after gdn in_proj), no ring, no read-ahead, one early tile (each
    phase asks L2 for its second tile before its wait, as the step's GEMVs
    do); then the block's threads, the first GEMV's tile shape and the
    second's parts."""
    from engine.quant.gemv_cuda import build_options

    first = chain.first
    return (*build_options(replace(chain.second, stages=0), superblock, asymmetric, d_fp32, pdl,
                           prologue=norm, epilogue=epilogue, early_l2_tiles=1),
            f"-DCHAIN_THREADS={chain.threads}", f"-DA_ROWS={first.rows}",
            f"-DA_SLOTS={first.slots}", f"-DA_GROUPS={first.groups}",
            f"-DA_FLUSH={first.flush}", f"-DPARTS={chain.parts}",
            f"-DCHAIN_MIN_BLOCKS={chain.blocks_per_sm}")


@dataclass
class Chain:
    """Launches of the chain kernel; keeps one grid counter per (device,
    grid size): zeroed once, it only ever grows by a launch's grid."""
    counters: dict = field(default_factory=dict)

    def __call__(self, x_a, qt_a, out_a, qt_b, out_b, residual, norm, chain: ChainPlan,
                 epilogue=None, pdl: bool = True) -> None:
        """out_a = qt_a x_a; out_b = qt_b RMSNorm(residual + out_a), the sum
        stored to norm.residual_out (norm.pending must be out_a), then
        `epilogue` (gemv_cuda's) on out_b's rows."""
        from engine.quant.gemv_cuda import (SiluMulEpilogue, _compiled, _launch, conv_operand,
                                            launchable, weight_operands)

        if qt_a.shape[0] != qt_b.shape[1]:
            raise ValueError(f"the first GEMV's {qt_a.shape[0]} rows are not the second's "
                             f"K = {qt_b.shape[1]}")
        if qt_a.shape[1] != chain.first.groups * 32 or qt_b.shape[1] != chain.second.groups * 32:
            raise ValueError(f"the plans' K ({chain.first.groups * 32}, "
                             f"{chain.second.groups * 32}) are not the weights' "
                             f"({qt_a.shape[1]}, {qt_b.shape[1]})")
        if qt_a.asymmetric != qt_b.asymmetric or qt_a.d.dtype != qt_b.d.dtype:
            raise ValueError("both weights must share one format (one build)")
        if norm.pending is not out_a or norm.residual_out is None:
            raise ValueError("the chain's norm adds out_a: NormPrologue(..., pending=out_a, "
                             "residual_out=...)")
        if isinstance(epilogue, SiluMulEpilogue) and not epilogue.fits(chain.second,
                                                                      qt_b.shape[0]):
            raise ValueError(f"the SiLU epilogue pairs rows in tiles of an even row count "
                             f"dividing N: {chain.second.spec()} cannot")
        device = x_a.device.index if x_a.device.index is not None else torch.cuda.current_device()
        compiled = _compiled(chain_options(chain, qt_a.superblock, qt_a.asymmetric,
                                           qt_a.d.dtype == torch.float32, pdl, norm, epilogue),
                             device, chain.threads, 0, chain_source(), CHAIN_KERNEL)
        if not launchable(compiled.local_bytes):
            raise ValueError(f"the chain's build spills {compiled.local_bytes} bytes a thread")
        sms = torch.cuda.get_device_properties(x_a.device).multi_processor_count
        grid = chain.grid(qt_a.shape[0], qt_b.shape[0], sms, compiled.resident_per_sm)
        key = (device, grid)
        if key not in self.counters:
            self.counters[key] = torch.zeros(1, dtype=torch.int32, device=x_a.device)
        _, weight, eps, residual_out = norm.operands(residual, qt_b.shape[1])
        _launch(compiled, grid, chain.threads,
                [x_a, *weight_operands(qt_a), out_a, qt_a.shape[0], *weight_operands(qt_b),
                 out_b, qt_b.shape[0], residual, weight, eps, residual_out, self.counters[key],
                 conv_operand(epilogue, x_a, qt_b.shape[0])], pdl)


class Pair(NamedTuple):
    """A boundary to time: the first GEMV's shape (bench.quant's name, or
    None: a 5120 x 5120 stand-in), the second's, and the chain's shapes
    from the second's plan (the card's, as the step picks it)."""
    first: str | None
    second: str
    chain: Callable[[CudaGemvPlan, str], ChainPlan]


def boundaries_per_step() -> dict[tuple[str, str], int]:
    """How often the 27B's int4 decode step crosses each probed boundary:
    every layer's out projection (gdn out or attn o, one 5120 x 6144
    shape) before its gate_up; each down before the next layer's first
    projection (the last one's before the final norm and lm_head, not
    probed)."""
    from engine.config import ModelConfig, shape_hf_config

    types = ModelConfig.from_hf(shape_hf_config("qwen3.5-27b")).layer_types
    after_down = [types[i + 1] for i in range(len(types) - 1)]
    return {("gdn out", "gate_up"): len(types),
            ("down", "gdn in_proj"): after_down.count("linear_attention"),
            ("down", "attn qkv"): after_down.count("full_attention")}


def _same_shape(second: CudaGemvPlan, card: str) -> ChainPlan:
    return ChainPlan(second, second)


def _out_projection(second: CudaGemvPlan, card: str) -> ChainPlan:
    """192 threads, one group each; gate_up's phase leaves the sixth warp idle.
    The out projection's block walks ~3 tiles: one flush at its end."""
    return ChainPlan(plan_for(6144, flush=16), second)


def _out_projection_at_160(second: CudaGemvPlan, card: str) -> ChainPlan:
    """gate_up's 160 threads; the out projection at two groups a thread
    (warp 0's second slot: groups 160..191) and two rows a tile."""
    return ChainPlan(CudaGemvPlan(rows=2, slots=2, threads=160, groups=192, flush=16), second,
                     min_blocks=3)   # at 4, ptxas spills 192 bytes a thread


def _down(second: CudaGemvPlan, card: str) -> ChainPlan:
    """down's block as the card runs it (544 threads); the second GEMV in
    three parts of 160 threads, two warps idle."""
    return ChainPlan(picked_plan(HIDDEN, 17408, card), second, parts=3)


def _down_before_in_proj(second: CudaGemvPlan, card: str) -> ChainPlan:
    """As _down, in_proj's parts at 2 rows a tile: at its 4, with the conv
    epilogue, the chain spills 36 bytes at 96 registers, the most a
    544-thread block may take (17 warps on 4 schedulers, 5 on one: 16384 /
    160 rounds down to 96; NVRTC sm_90, 12-07)."""
    return _down(replace(second, rows=2), card)


PAIRS = {
    "5120 > gate_up": Pair(None, "gate_up", _same_shape),
    "5120 > gdn in_proj": Pair(None, "gdn in_proj", _same_shape),
    "5120 > attn qkv": Pair(None, "attn qkv", _same_shape),
    "gdn out > gate_up": Pair("gdn out", "gate_up", _out_projection),
    "gdn out (160 threads) > gate_up": Pair("gdn out", "gate_up", _out_projection_at_160),
    "down > gdn in_proj": Pair("down", "gdn in_proj", _down_before_in_proj),
    "down > attn qkv": Pair("down", "attn qkv", _down),
}


def step_epilogue(second: str, device):
    """The epilogue the int4 step runs after `second` (gemv_cuda's): SiLU(gate)
    * up after gate_up; GDN's conv after gdn in_proj, over the 27B's conv
    channels with random weights and windows, reading slot 0 and writing
    slot 1 (so a rerun reads what the first run read); none after attn qkv."""
    from engine.config import ModelConfig, shape_hf_config
    from engine.quant.gemv_cuda import ConvEpilogue, SiluMulEpilogue

    if second == "gate_up":
        return SiluMulEpilogue()
    if second != "gdn in_proj":
        return None
    cfg = ModelConfig.from_hf(shape_hf_config("qwen3.5-27b"))
    channels, width = cfg.linear_conv_dim, cfg.linear_conv_kernel

    def index(value: int) -> torch.Tensor:
        return torch.full((1,), value, dtype=torch.int64, device=device)

    return ConvEpilogue(torch.randn(channels, width, device=device, dtype=torch.bfloat16),
                        torch.randn(2, channels, width - 1, device=device),
                        index(7), index(0), index(1))


def time_pair(name: str, device, check: bool) -> dict:
    """us per pair for the three variants (and each GEMV alone)."""
    from bench.quant import _copies, _time_graph, model_shapes
    from engine.fused import load_kernels
    from engine.quant.gemv_cuda import ConvEpilogue, NormPrologue, gemv_cuda, output_width

    pair = PAIRS[name]
    shapes = {shape: (fmt, n, k) for shape, fmt, n, k, _ in model_shapes() if fmt.name == "Q4_K"}
    epilogue = step_epilogue(pair.second, device)
    fmt, n_b, k_b = shapes[pair.second]
    n_a, k_a = (HIDDEN, HIDDEN) if pair.first is None else shapes[pair.first][1:]
    card = torch.cuda.get_device_name(device)
    plan_b = picked_plan(n_b, k_b, card)
    chain_plan = pair.chain(plan_b, card)
    # the first GEMV apart as the step runs it (the stand-in: in the second's shape)
    plan_a = chain_plan.first if pair.first is None else picked_plan(n_a, k_a, card)
    copies_a, copies_b = _copies(fmt, n_a, k_a, device), _copies(fmt, n_b, k_b, device)
    kernels = load_kernels()
    x_a = torch.randn(1, k_a, device=device, dtype=torch.bfloat16)
    residual = torch.randn(1, n_a, device=device, dtype=torch.bfloat16)
    weight = torch.randn(n_a, device=device, dtype=torch.bfloat16) * 0.1
    out_a = torch.empty(1, n_a, device=device, dtype=torch.bfloat16)
    out_b = torch.empty(1, output_width(epilogue, n_b), device=device, dtype=torch.bfloat16)
    residual_out = torch.empty(1, n_a, device=device, dtype=torch.bfloat16)
    norm = NormPrologue(weight, 1e-6, True, out_a, residual_out)
    chain = Chain()

    def first(a, plan=plan_a):
        gemv_cuda(x_a, a, out=out_a, plan=plan, pdl=True)

    def apart(a, b):
        first(a)
        _, normed = kernels.add_rms_norm(residual, out_a, weight, 1e-6, True)
        gemv_cuda(normed, b, out=out_b, plan=plan_b, pdl=True, epilogue=epilogue)

    def prologue(a, b, plan=plan_a):
        first(a, plan)
        gemv_cuda(residual, b, out=out_b, plan=plan_b, pdl=True, prologue=norm,
                  epilogue=epilogue)

    def chained(a, b):
        chain(x_a, a, out_a, b, out_b, residual, norm, chain_plan, epilogue)

    def second_alone(a, b):
        gemv_cuda(residual, b, out=out_b, plan=plan_b, pdl=True, epilogue=epilogue)

    variants = {"apart": apart, "prologue": prologue, "chain": chained,
                "first_alone": lambda a, b: first(a), "second_alone": second_alone}
    result = {"pair": name, "N_a": n_a, "K_a": k_a, "N_b": n_b, "threads": chain_plan.threads,
              "parts": chain_plan.parts, "first_plan": chain_plan.first.spec(),
              "second_plan": plan_b.spec()}
    for label, fn in variants.items():
        calls = [(lambda a=copies_a[i % len(copies_a)], b=copies_b[i % len(copies_b)]:
                  fn(a, b)) for i in range(16)]
        result[f"{label}_us"] = _time_graph(calls) * 1e6
    if check:
        # the reference's first GEMV in the chain's own tile shape: the same sums
        reference = functools.partial(prologue, plan=chain_plan.first)
        written = [epilogue.windows[1]] if isinstance(epilogue, ConvEpilogue) else []
        result.update(compare(chained, reference, copies_a[0], copies_b[0],
                              (out_a, out_b, residual_out, *written)))
    return result


def compare(chained, reference, a, b, outputs) -> dict:
    """The chain's outputs (out_a, out_b, residual_out, and the conv's
    rewritten windows where it has them) against two launches' (the first
    GEMV, then the second with the norm in its prologue: the same
    deferred-rstd numerics), the outputs NaN-poisoned before the chain
    runs."""
    reference(a, b)
    want = [t.clone() for t in outputs]
    for t in outputs:
        t.fill_(float("nan"))
    chained(a, b)
    torch.cuda.synchronize()
    return {"first_equal": bool(torch.equal(outputs[0], want[0])),
            "second_equal": bool(torch.equal(outputs[1], want[1])),
            "second_max_diff": float((outputs[1].float() - want[1].float()).abs().max()),
            "second_scale": float(want[1].float().abs().max()),
            "residual_equal": bool(torch.equal(outputs[2], want[2])),
            "windows_max_diff": max((float((o.float() - w.float()).abs().max())
                                     for o, w in zip(outputs[3:], want[3:])), default=0.0),
            "windows_scale": max((float(w.float().abs().max()) for w in want[3:]), default=0.0)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chain_probe",
                                description=__doc__.splitlines()[0])
    p.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS),
                   metavar="PAIR", help=f"the boundaries to time (default all: {', '.join(PAIRS)})")
    p.add_argument("--check", action="store_true", help="also compare the chain's outputs")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.chain_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    from bench.quant import print_table

    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for name in args.pairs:
        rows.append(time_pair(name, device, args.check))
        print(rows[-1], file=sys.stderr, flush=True)
    uses = boundaries_per_step()

    def step_ms(r) -> str:   # what the chain would save a step at this boundary's count
        count = uses.get((PAIRS[r["pair"]].first, PAIRS[r["pair"]].second), 0)
        return f"{(r['apart_us'] - r['chain_us']) * count / 1e3:.2f} x{count}" if count else "-"

    print_table("first GEMV, add_rms_norm, second GEMV: us a pair",
                ["pair", "threads x parts", "apart", "prologue", "chain", "first alone",
                 "second alone", "chain saves", "step ms"],
                [[r["pair"], f"{r['threads']} x {r['parts']}", *(f"{r[k]:.1f}" for k in (
                    "apart_us", "prologue_us", "chain_us", "first_alone_us", "second_alone_us")),
                  f"{r['apart_us'] - r['chain_us']:.1f}", step_ms(r)] for r in rows])
    for r in rows:
        if args.check:
            print(f"{r['pair']}: first equal {r['first_equal']}, residual equal "
                  f"{r['residual_equal']}, second equal {r['second_equal']} (max diff "
                  f"{r['second_max_diff']:.4g} of {r['second_scale']:.4g}), conv windows max "
                  f"diff {r['windows_max_diff']:.4g} of {r['windows_scale']:.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
