"""The resident-chain probe (bench/chain_probe.py, bench/q4_chain.cu): two
GEMVs and the norm between them in one persistent launch, in one block
shape or, for the 27B's own boundaries, two (the out projections' 192
threads before gate_up's 160; down's 544 before three 160-thread parts).
Without a GPU its sm_90 builds are compiled by NVRTC (no spill, the blocks
an SM it asks for, the first GEMV's output read back through L2 only); on
a GPU its three outputs are checked against the launches it replaces."""
from __future__ import annotations

import re

import pytest
import torch

from bench.chain_probe import PAIRS, ChainPlan, chain_options, chain_source, step_epilogue
from bench.quant import model_shapes
from engine.quant.gemv_cuda import NormPrologue, picked_plan, plan_for
from engine.quant.sm90_builds import SUPERBLOCK, compile_sm90

CARDS = ("NVIDIA H200", "NVIDIA H100 80GB HBM3")
REGISTERS = 65536


def _entry_registers(log: str) -> dict[str, int]:
    """ptxas -v's registers by kernel (the module holds the GEMV and the chain)."""
    return {m.group(1): int(m.group(2)) for m in re.finditer(
        r"Compiling entry function '(\w+)'.*?Used (\d+) registers", log, re.S)}


def _norm() -> NormPrologue:
    residual = torch.zeros(1, 5120, dtype=torch.bfloat16)
    return NormPrologue(torch.zeros(5120, dtype=torch.bfloat16), 1e-6, True, residual,
                        residual.clone())


def _chain(name: str, card: str) -> ChainPlan:
    shapes = {s: (n, k) for s, fmt, n, k, _ in model_shapes() if fmt.name == "Q4_K"}
    pair = PAIRS[name]
    return pair.chain(picked_plan(*shapes[pair.second], card), card)


def _build(name: str, chain: ChainPlan, label: str, nvrtc):
    """The chain of pair `name` with its second GEMV's epilogue in the step."""
    epilogue = step_epilogue(PAIRS[name].second, "cpu")
    return compile_sm90(label, chain_options(chain, SUPERBLOCK, True, False, True, _norm(),
                                             epilogue), nvrtc, chain_source())


@pytest.mark.parametrize("card", CARDS)
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_each_chain_builds_for_sm90_without_spills_at_the_blocks_it_asks(nvrtc, name, card):
    chain = _chain(name, card)
    build = _build(name, chain, f"{card}: {name}", nvrtc)
    assert build.result == 0, build.log[-2000:]
    assert build.spill_bytes == 0, build.log
    registers = _entry_registers(build.log)["tandem_q4_chain"]
    # the chain is worth timing only if its blocks stay resident as the GEMVs'
    assert REGISTERS // (registers * chain.threads) >= chain.blocks_per_sm, registers


@pytest.mark.parametrize("name", ["5120 > gate_up", "gdn out > gate_up", "down > attn qkv"])
def test_the_chain_reads_what_other_blocks_wrote_through_l2_only(nvrtc, name):
    """The first GEMV's output and the residual come back by ld.global.cg:
    a non-coherent (.nc) load may serve them stale or be hoisted above the
    grid wait. Four 16-byte loads a group of each; parts flush at their own
    named barriers where the part is not the whole block."""
    chain = _chain(name, CARDS[0])
    ptx = _build(name, chain, name, nvrtc).ptx
    chain_ptx = ptx[ptx.index(".entry tandem_q4_chain"):]
    assert len(re.findall(r"ld\.global\.cg\.v4\.u32", chain_ptx)) == 8
    assert "ld.acquire.gpu.global.u32" in chain_ptx and "atom.global.add.u32" in chain_ptx
    named = re.findall(r"bar\.sync\s+%r\d+, %r\d+", chain_ptx)
    assert bool(named) == (chain.parts * chain.second.threads != chain.threads), named


def test_a_chain_plan_refuses_parts_that_do_not_fit_its_block():
    second = plan_for(5120)
    with pytest.raises(ValueError, match="exceed the block"):
        ChainPlan(plan_for(17408), second, parts=4)     # 4 x 160 > 544
    with pytest.raises(ValueError, match="parts must be"):
        ChainPlan(plan_for(17408), second, parts=0)
    with pytest.raises(ValueError, match="min_blocks"):
        ChainPlan(second, second, min_blocks=-1)


def test_a_chain_grid_is_resident_and_no_larger_than_either_phase_needs():
    down = ChainPlan(plan_for(17408, rows=5), plan_for(5120), parts=3)
    assert down.blocks_per_sm == 1 and ChainPlan(plan_for(6144), plan_for(5120)).blocks_per_sm == 3
    assert down.grid(5120, 14336, sms=132, resident_per_sm=1) == 132   # all resident
    # qkv's 3584 tiles of 4 rows in three parts a block: 1195 blocks, past
    # down's 1024 tiles of 5
    assert down.grid(5120, 14336, sms=132, resident_per_sm=16) == 1195
    one_row = ChainPlan(plan_for(5120, rows=1), plan_for(5120))
    assert one_row.grid(450, 1600, sms=132, resident_per_sm=4) == 450     # the first's tiles


def test_the_probed_boundaries_are_the_steps_gemv_to_gemv_hops_but_the_last():
    """Every layer's out projection before its gate_up, every down but the
    last before the next layer's first projection: 2 x 64 - 1 hops, each
    probed pair counted from the 27B's layer pattern (3 GDN, 1 attention)."""
    from bench.chain_probe import boundaries_per_step

    uses = boundaries_per_step()
    assert uses == {("gdn out", "gate_up"): 64, ("down", "gdn in_proj"): 47,
                    ("down", "attn qkv"): 16}
    assert all((first, second) in {(p.first, p.second) for p in PAIRS.values()}
               for first, second in uses)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the chain runs on a GPU only")
@pytest.mark.parametrize("name", ["5120 > gdn in_proj", "gdn out > gate_up",
                                  "gdn out (160 threads) > gate_up", "down > gdn in_proj",
                                  "down > attn qkv"])
def test_the_chain_matches_the_launches_it_replaces(name):
    from bench.chain_probe import time_pair

    result = time_pair(name, torch.device("cuda"), check=True)
    assert result["first_equal"] and result["residual_equal"], result
    assert result["second_max_diff"] <= 0.02 * result["second_scale"], result  # NaN fails too
    # the conv's rewritten windows (gdn in_proj's epilogue): from those rows
    assert result["windows_max_diff"] <= 0.02 * max(result["windows_scale"], 1.0), result
    assert all(result[f"{v}_us"] > 0 for v in ("apart", "prologue", "chain")), result
