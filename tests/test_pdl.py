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


def test_the_release_switch_reads_0_1_or_2(monkeypatch):
    monkeypatch.delenv("TANDEM_PDL_RELEASE", raising=False)
    assert pdl.pdl_release() == pdl.RELEASE_AFTER_WAIT
    for value, meant in (("1", pdl.RELEASE_FIRST), ("2", pdl.RELEASE_FIRST_EVERYWHERE),
                         ("0", pdl.RELEASE_AFTER_WAIT)):
        monkeypatch.setenv("TANDEM_PDL_RELEASE", value)
        assert pdl.pdl_release() == meant
    monkeypatch.setenv("TANDEM_PDL_RELEASE", "first")
    with pytest.raises(ValueError, match="TANDEM_PDL_RELEASE='first'.*0, 1 or 2"):
        pdl.pdl_release()
    monkeypatch.setenv("TANDEM_PDL_RELEASE", "1")  # nothing to release off the GPU
    assert pdl.pdl_launch(torch.device("cpu")) == {"PDL": False}


# The order of the two instructions in the sm_90 PTX of a Triton kernel
# (the RMSNorm, twice a layer) for each PDL constexpr pdl_launch gives.
_ORDER = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.fused.kernels import _rms_norm_kernel
import triton

sig = dict(x_ptr="*bf16", h_ptr="*bf16", w_ptr="*bf16", sum_ptr="*bf16", out_ptr="*bf16",
           N="i32", x_stride="i32", h_stride="i32", sum_stride="i32", out_stride="i32",
           eps="fp32")
for flag in (False, True, 2):
    consts = dict(HAS_RESIDUAL=True, ZERO_CENTERED=True, BLOCK=8192, PDL=flag)
    ptx = triton.compile(ASTSource(fn=_rms_norm_kernel,
                                   signature=dict(sig, **{k: "constexpr" for k in consts}),
                                   constexprs=consts),
                         target=GPUTarget("cuda", 90, 32), options=dict(num_warps=16)).asm["ptx"]
    wait, release = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    # the weight's loads come before either (no kernel writes it)
    first_load, gate = ptx.find("ld.global"), min([i for i in (wait, release) if i >= 0] or [len(ptx)])
    print(flag, wait >= 0, release >= 0, release < wait, 0 <= first_load < gate)
"""


def test_released_first_means_before_the_wait_in_the_sm90_build():
    """PDL True waits, then releases the next kernel; PDL 2 (TANDEM_PDL_RELEASE
    1 or 2) releases it first; False has neither instruction."""
    out = run_sm90_script(_ORDER).split("\n")
    assert out[:3] == ["False False False False True", "True True True False True",
                       "2 True True True True"], out


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("weights", ["bf16", "int4"])
def test_decode_graphs_give_the_same_numbers_with_dependent_launches(weights, monkeypatch):
    """Every Triton kernel of the step waits for its predecessor before it
    touches memory, so overlapping launches may change the time, never a
    number: replays with and without PDL, and with each kernel releasing the
    next one after its wait or before it (TANDEM_PDL_RELEASE), are bitwise
    equal."""
    from engine.loader import load_model
    from tests.test_cuda_graphs import GRAPH_DTYPE, _decode_logits

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90 or newer")
    loaded = load_model("tiny-qwen3.5", device="cuda", dtype=GRAPH_DTYPE, seed=3, weights=weights)
    runs = {}
    # (TANDEM_PDL, TANDEM_PDL_RELEASE, the kernels' PDL constexpr)
    for switch, release, flag in (("0", "0", False), ("1", "0", True), ("1", "1", 2),
                                  ("1", "2", 2)):
        monkeypatch.setenv("TANDEM_PDL", switch)
        monkeypatch.setenv("TANDEM_PDL_RELEASE", release)
        assert repr(pdl.pdl_launch(torch.device("cuda"))["PDL"]) == repr(flag)
        runs[switch, release] = _decode_logits(loaded, "int8", graphs=True)
    for key, logits in runs.items():
        assert torch.equal(logits, runs["0", "0"]), key
