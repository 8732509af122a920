"""The CUDA GEMV's sm_90 builds, compiled by NVRTC without a GPU
(engine/quant/sm90_builds.py): a kernel edit that breaks a build of the
27B's decode step, makes it spill, or sends a load of never-written data off
the read-only path fails here, in CI, before any device time. The builds'
bits and speed are tests/test_gemv_cuda.py's, on a GPU."""
from __future__ import annotations

import pytest

from engine.quant.gemv_cuda import CARD_PLANS
from engine.quant.sm90_builds import (compile_sm90, reads_only_unwritten_arrays,
                                      step_cases)

CASES = [case for card in sorted(CARD_PLANS) for case in step_cases(card)]


@pytest.fixture(scope="module")
def builds(nvrtc):
    return {name: compile_sm90(name, options, nvrtc) for name, options in CASES}


def test_the_cases_cover_every_card_plan_the_prologues_and_the_epilogues():
    names = [name for name, _ in CASES]
    assert len(names) == len(set(names))
    for card, plans in CARD_PLANS.items():
        for n, k in plans:
            assert f"{card}: {n} x {k}, early L2 tiles 1" in names
    joined = " ".join(" ".join(options) for _, options in CASES)
    for flag in ("-DNORM=1", "-DSILU=1", "-DGATED=1", "-DCONV=1", "-DSILU_MUL=1", "-DSTAGES=3",
                 "-DEARLY_L2_TILES=3", "-DL2_PREFETCH=1"):
        assert flag in joined, flag


@pytest.mark.parametrize("name", [name for name, _ in CASES])
def test_every_build_of_the_step_compiles_for_sm90_without_spilling(builds, name):
    build = builds[name]
    assert build.result == 0, build.log
    assert build.registers is not None, build.log   # ptxas -v reported on it
    assert build.spill_bytes == 0, build.log   # gemv_cuda would refuse to launch it


@pytest.mark.parametrize("name", [name for name, options in CASES
                                  if reads_only_unwritten_arrays(options)])
def test_what_no_kernel_writes_is_loaded_through_the_read_only_path(builds, name):
    """Weights, scales, x and the norm weights take ld.global.nc. The early
    tiles' prefetch once cost the scales theirs: its asm takes the weight
    pointers under a memory clobber, and nvcc then stops proving them
    read-only (12-07; load_tile now asks with __ldg)."""
    build = builds[name]
    assert build.result == 0, build.log
    assert build.coherent_global_loads() == []

