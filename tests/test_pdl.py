"""Programmatic dependent launch (engine/pdl.py): off wherever there is no
sm_90 GPU, the switch, the prologue compiled for sm_90 (Triton's own ptxas,
no GPU needed), and on a GPU a decode step's CUDA graph that gives the same
numbers with and without it."""
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from engine import pdl  # noqa: E402
from tests.sm90 import run_sm90_script  # noqa: E402


def test_off_on_the_cpu_and_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TANDEM_PDL", "1")
    assert pdl.pdl_launch(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.pdl_capable(torch.device("cuda"))


def test_the_switch_reads_0_or_1(monkeypatch):
    monkeypatch.delenv("TANDEM_PDL", raising=False)
    assert pdl.pdl_wanted()
    monkeypatch.setenv("TANDEM_PDL", "0")
    assert not pdl.pdl_wanted()
    monkeypatch.setenv("TANDEM_PDL", "yes")
    with pytest.raises(ValueError, match="TANDEM_PDL='yes'"):
        pdl.pdl_wanted()


_COMPILE = """
from bench.gemv_sass import _compile
from engine.quant.gemv_configs import GemvConfig
for pdl in (False, True):
    ptx = _compile(GemvConfig(32, 1024, 1, 4, 2, int8_x=True), 4, 1, pdl=pdl).asm["ptx"]
    print(pdl, "griddepcontrol.wait" in ptx, "griddepcontrol.launch_dependents" in ptx)
"""


def test_the_prologue_compiles_for_sm90_only_when_asked():
    """The DP4A GEMV (most of an int4 decode step's launches) for sm_90: with
    PDL its PTX waits for the grid before and releases the next one; without,
    neither instruction is there (the GDN steps: test_gdn_kernels)."""
    out = run_sm90_script(_COMPILE)
    assert out.split("\n")[:2] == ["False False False", "True True True"], out


def test_release_first_is_off_by_default_and_needs_dependent_launches(monkeypatch):
    monkeypatch.delenv(pdl.RELEASE_FIRST_ENV, raising=False)
    assert pdl.release_first_launch(torch.device("cpu")) == {"PDL": False, "RELEASE_FIRST": False}
    monkeypatch.setenv(pdl.RELEASE_FIRST_ENV, "1")
    assert pdl.release_first_launch(torch.device("cpu")) == {"PDL": False, "RELEASE_FIRST": False}
    monkeypatch.setenv(pdl.RELEASE_FIRST_ENV, "2")
    with pytest.raises(ValueError, match=pdl.RELEASE_FIRST_ENV):
        pdl.release_first_launch(torch.device("cpu"))


_COMPILE_NORM = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.fused import kernels as FK
for first in (False, True):
    consts = dict(HAS_RESIDUAL=True, ZERO_CENTERED=True, BLOCK=8192, PDL=True,
                  RELEASE_FIRST=first)
    signature = {p.name: "constexpr" if p.name in consts
                 else "*bf16" if p.name.endswith("_ptr") else "fp32" if p.name == "eps" else "i32"
                 for p in FK._rms_norm_kernel.params}
    ptx = triton.compile(ASTSource(fn=FK._rms_norm_kernel, signature=signature, constexprs=consts),
                         target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8)).asm["ptx"]
    print(first, ptx.index("griddepcontrol.launch_dependents") < ptx.index("griddepcontrol.wait"))
"""


def test_a_norm_released_first_releases_before_it_waits_on_sm90():
    out = run_sm90_script(_COMPILE_NORM)
    assert out.split("\n")[:2] == ["False False", "True True"], out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("weights", ["bf16", "int4"])
def test_decode_graphs_give_the_same_numbers_with_dependent_launches(weights, monkeypatch):
    """Every Triton kernel of the step waits for its predecessor before it
    touches memory, so overlapping launches may change the time, never a
    number: replays with and without PDL are bitwise equal."""
    from engine.loader import load_model
    from tests.test_cuda_graphs import GRAPH_DTYPE, _decode_logits

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90 or newer")
    loaded = load_model("tiny-qwen3.5", device="cuda", dtype=GRAPH_DTYPE, seed=3, weights=weights)
    runs = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("TANDEM_PDL", switch)
        assert pdl.pdl_launch(torch.device("cuda"))["PDL"] == (switch == "1")
        runs[switch] = _decode_logits(loaded, "int8", graphs=True)
    assert torch.equal(runs["1"], runs["0"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_graphs_give_the_same_numbers_when_the_norms_release_first(monkeypatch):
    """The norms and the combine releasing the GEMV after them before their
    wait move launches, never a number: int4 replays are bitwise the
    defaults'."""
    from engine.loader import load_model
    from tests.test_cuda_graphs import GRAPH_DTYPE, _decode_logits

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90 or newer")
    loaded = load_model("tiny-qwen3.5", device="cuda", dtype=GRAPH_DTYPE, seed=3, weights="int4")
    monkeypatch.delenv(pdl.RELEASE_FIRST_ENV, raising=False)
    default = _decode_logits(loaded, "int8", graphs=True)
    monkeypatch.setenv(pdl.RELEASE_FIRST_ENV, "1")
    assert torch.equal(_decode_logits(loaded, "int8", graphs=True), default)
