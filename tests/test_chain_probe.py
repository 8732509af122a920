"""The resident-chain probe (bench/chain_probe.py, bench/q4_chain.cu): two
GEMVs and the norm between them in one persistent launch. Without a GPU its
sm_90 builds are compiled by NVRTC (no spill, the GEMV's blocks an SM, the
first GEMV's output read back through L2 only); on a GPU its three outputs
are checked against the launches it replaces."""
from __future__ import annotations

import re

import pytest
import torch

from bench.chain_probe import chain_options, chain_source
from engine.quant.gemv_cuda import NormPrologue, card_plan, plan_for
from engine.quant.sm90_builds import SUPERBLOCK, compile_sm90

H200 = "NVIDIA H200"
PLANS = {"plan_for": plan_for(5120), "H200 gate_up": card_plan(H200, 34816, 5120),
         "H200 in_proj": card_plan(H200, 16480, 5120)}
REGISTERS = 65536


def _entry_registers(log: str) -> dict[str, int]:
    """ptxas -v's registers by kernel (the module holds the GEMV and the chain)."""
    return {m.group(1): int(m.group(2)) for m in re.finditer(
        r"Compiling entry function '(\w+)'.*?Used (\d+) registers", log, re.S)}


def _norm() -> NormPrologue:
    residual = torch.zeros(1, 5120, dtype=torch.bfloat16)
    return NormPrologue(torch.zeros(5120, dtype=torch.bfloat16), 1e-6, True, residual,
                        residual.clone())


@pytest.mark.parametrize("label", sorted(PLANS))
def test_the_chain_builds_for_sm90_without_spills_at_the_gemvs_blocks_an_sm(nvrtc, label):
    plan = PLANS[label]
    build = compile_sm90(label, chain_options(plan, SUPERBLOCK, True, False, True, _norm()),
                         nvrtc, chain_source())
    assert build.result == 0, build.log[-2000:]
    assert build.spill_bytes == 0, build.log
    registers = _entry_registers(build.log)
    blocks = {name: REGISTERS // (regs * plan.threads) for name, regs in registers.items()}
    # the chain is worth timing only if it keeps the GEMV's resident blocks
    assert blocks["tandem_q4_chain"] >= blocks["tandem_q4_gemv"] >= 3, registers


def test_the_chain_reads_what_other_blocks_wrote_through_l2_only(nvrtc):
    """The first GEMV's output and the residual come back by ld.global.cg:
    a non-coherent (.nc) load may serve them stale or be hoisted above the
    grid wait. Four 16-byte loads a group of each."""
    build = compile_sm90("chain", chain_options(plan_for(5120), SUPERBLOCK, True, False, True,
                                                _norm()), nvrtc, chain_source())
    chain_ptx = build.ptx[build.ptx.index(".entry tandem_q4_chain"):]
    assert len(re.findall(r"ld\.global\.cg\.v4\.u32", chain_ptx)) == 8
    assert "ld.acquire.gpu.global.u32" in chain_ptx and "atom.global.add.u32" in chain_ptx


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the chain runs on a GPU only")
@pytest.mark.parametrize("second", ["gdn in_proj", "gate_up"])
def test_the_chain_matches_the_launches_it_replaces(second):
    from bench.chain_probe import time_pair

    result = time_pair(second, torch.device("cuda"), check=True)
    assert result["first_equal"] and result["residual_equal"], result
    assert result["second_max_diff"] <= 0.02 * result["second_scale"], result  # NaN fails too
    assert all(result[f"{v}_us"] > 0 for v in ("apart", "prologue", "chain")), result
