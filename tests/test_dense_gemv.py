"""The bf16 GEMV (engine/dense_gemv.py) against its PyTorch reference under
the Triton interpreter (CPU) or compiled (GPU): rows 1..8, N and K tails,
split-K, bias, NaN-poisoned outputs; a row's numbers do not depend on the
rows beside it; the model swap reaches every projection and the head."""
import os

import pytest
import torch
from torch import nn

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from engine.dense_gemv import (TUNED, DenseGemvConfig, dense_gemv,  # noqa: E402
                               dense_gemv_forced, dense_gemv_reference, dense_gemv_shapes,
                               dense_linear, pick_dense_config, pick_split, takes_dense_gemv,
                               use_dense_gemv)
from tests.sm90 import run_sm90_script  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] not in ("", "0")
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("compiled Triton kernels need CUDA", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"
# the interpreter's dots run in fp32 (bf16 tensors are not numpy types)
DTYPE = torch.float32 if INTERPRET else torch.bfloat16


def _case(rows: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(DEVICE, DTYPE)
    w = torch.randn(n, k, generator=g).to(DEVICE, DTYPE) * k ** -0.5
    return x, w


def _close(y, expected):
    scale = expected.abs().max()
    tol = 2e-6 if DTYPE == torch.float32 else 8e-3  # bf16 output: half an ulp of the largest
    torch.testing.assert_close(y.float() / scale, expected / scale, rtol=0, atol=tol)


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("config", [DenseGemvConfig(16, 32, split_k=1),
                                    DenseGemvConfig(32, 64, split_k=3),
                                    DenseGemvConfig(16, 32)], ids=["one", "split3", "auto"])
@pytest.mark.parametrize("early", ["0", "1"])
def test_dense_gemv_matches_reference(rows, config, early, monkeypatch):
    """N = 45 and K = 200: a partial feature block and a partial K tile; with
    the first weight tile loaded ahead of the loop (TANDEM_GEMV_EARLY) too."""
    monkeypatch.setenv("TANDEM_GEMV_EARLY", early)
    x, w = _case(rows, 45, 200, seed=rows)
    bias = torch.randn(45).to(DEVICE, DTYPE)
    for b in (None, bias):
        out = torch.full((rows, 45), float("nan"), dtype=DTYPE, device=DEVICE)
        y = dense_gemv(x, w, bias=b, out=out, config=config)
        assert not y.isnan().any()
        _close(y, dense_gemv_reference(x, w, b))


def test_a_rows_numbers_do_not_depend_on_the_rows_beside_it():
    """decode (1 row) and a verify step (k+1 rows) must compute the same
    numbers for the same row: speculative parity."""
    x, w = _case(5, 40, 160, seed=7)
    config = DenseGemvConfig(16, 32, split_k=2)
    together = dense_gemv(x, w, config=config)
    for i in range(5):
        assert torch.equal(dense_gemv(x[i:i + 1], w, config=config), together[i:i + 1])


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("split", [2, 5])
def test_split_fixup_gives_the_sum_kernels_numbers_and_leaves_its_counters_zero(
        rows, split, monkeypatch):
    """TANDEM_SPLIT_FIXUP=1: the last program per tile adds the partials in
    the sum kernel's order (bitwise its numbers), writes a strided output's
    rows where they belong, and leaves every counter at zero."""
    from engine.quant.gemv import split_counters

    x, w = _case(rows, 45, 320, seed=31)
    config = DenseGemvConfig(16, 32, split_k=split)
    monkeypatch.setenv("TANDEM_SPLIT_FIXUP", "0")
    summed = dense_gemv(x, w, config=config)
    monkeypatch.setenv("TANDEM_SPLIT_FIXUP", "1")
    for _ in range(2):
        wide = torch.full((rows, 64), float("nan"), dtype=DTYPE, device=DEVICE)
        fixed = dense_gemv(x, w, out=wide[:, :45], config=config)
        assert torch.equal(fixed, summed) and wide[:, 45:].isnan().all()
    assert not split_counters(torch.device(DEVICE)).any()


def test_split_k_fills_the_gpu_and_keeps_two_tiles_per_split():
    # 27B down projection: 80 blocks of 64 features, 68 tiles of 256
    assert pick_split(5120, 17408, DenseGemvConfig(64, 256), 132) == 8
    assert pick_split(248320, 5120, DenseGemvConfig(64, 256), 132) == 1
    assert pick_split(64, 512, DenseGemvConfig(64, 256), 132) == 1  # two tiles: no split
    assert pick_split(5120, 17408, DenseGemvConfig(64, 256, split_k=3), 132) == 3


def test_rejects_what_it_cannot_run():
    x, w = _case(9, 16, 64, seed=1)
    with pytest.raises(ValueError, match="1..8 rows"):
        dense_gemv(x, w)
    with pytest.raises(ValueError, match="power of two"):
        DenseGemvConfig(block_n=48)


def test_the_switch_reads_0_or_1(monkeypatch):
    monkeypatch.delenv("TANDEM_DENSE_GEMV", raising=False)
    assert dense_gemv_forced() is None
    assert dense_gemv_shapes(torch.device("cpu")) == frozenset()  # never off the GPU
    monkeypatch.setenv("TANDEM_DENSE_GEMV", "1")
    assert dense_gemv_forced() is True and dense_gemv_shapes(torch.device("cpu")) is None
    monkeypatch.setenv("TANDEM_DENSE_GEMV", "0")
    assert dense_gemv_shapes(torch.device("cpu")) == frozenset()
    monkeypatch.setenv("TANDEM_DENSE_GEMV", "on")
    with pytest.raises(ValueError, match="TANDEM_DENSE_GEMV='on'"):
        dense_gemv_forced()


def test_tuned_shapes_pick_their_config_and_others_the_default():
    assert pick_dense_config(5120, 17408) == TUNED[(5120, 17408)]
    assert pick_dense_config(4096, 4096) == DenseGemvConfig()


def test_a_shape_filter_swaps_only_those_layers():
    """The default on sm_90 swaps only the tuned shapes: a tiny Qwen3.5 with
    one shape named keeps every other layer (and its head) on nn.Linear."""
    from engine.loader import load_model

    model = load_model("tiny-qwen3.5", device="cpu", dtype=torch.float32, seed=4).model
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    shape = tuple(linears[0].weight.shape)
    same = sum(tuple(m.weight.shape) == shape for m in linears)
    head = tuple(model.output_embedding.shape) == shape
    assert 0 < same < len(linears)
    assert use_dense_gemv(model, frozenset({shape})) == same + head
    assert all((type(m).__name__ == "GemvLinear") == (tuple(m.weight.shape) == shape)
               for m in linears)
    assert (model.head_linear is dense_linear) == head


def test_the_swap_reaches_every_projection_and_the_head(monkeypatch):
    """A tiny Qwen3.5 after use_dense_gemv: every nn.Linear is a GemvLinear
    sharing its parameters, and the forward's logits match the model's own
    (on the CPU, dense_linear passes to F.linear; the GPU run of this file
    goes through the kernel)."""
    from engine.batch import ForwardBatch, SequenceInput
    from engine.cache import CacheShape, PagedKVCache
    from engine.kv import make_format
    from engine.loader import load_model

    loaded = load_model("tiny-qwen3.5", device=DEVICE, dtype=DTYPE, seed=4)
    model = loaded.model
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    weights = [m.weight for m in linears]

    def logits():
        cache = PagedKVCache(loaded.config, CacheShape(4, 16, 1), DEVICE, make_format("int8"))
        prompt = SequenceInput(tuple(range(3, 20)), 0, (0, 1), 0)
        model(ForwardBatch.build([prompt], 16, DEVICE), cache)
        step = SequenceInput((21,), 17, (0, 1), 0)
        return model(ForwardBatch.build([step], 16, DEVICE), cache)

    before = logits()
    assert use_dense_gemv(model) == len(linears) + 1
    assert all(type(m).__name__ == "GemvLinear" for m in linears)
    assert all(m.weight is w for m, w in zip(linears, weights))
    assert model.head_linear is dense_linear
    after = logits()
    torch.testing.assert_close(after.float(), before.float(), rtol=2e-2, atol=2e-2)
    # what takes the kernel: a GPU weight, at most 8 rows
    x, w = _case(2, 8, 32, seed=2)
    assert takes_dense_gemv(x, w) == (DEVICE == "cuda" and DTYPE == torch.bfloat16)


_COMPILE_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.dense_gemv import _dense_gemv_kernel
signature = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*fp32", final_ptr="*bf16",
                 counter_ptr="*i32", M="i32", N="i32", K="i32", stride_xm="i32",
                 stride_wn="i32", stride_os="i32", stride_om="i32", stride_fm="i32",
                 TILES="i32", BLOCK_N="constexpr", BLOCK_K="constexpr", PDL="constexpr",
                 EARLY="constexpr", SPLIT_K="constexpr", FIXUP="constexpr")
compiled = triton.compile(ASTSource(fn=_dense_gemv_kernel, signature=signature,
                                    constexprs=dict(BLOCK_N=64, BLOCK_K=256, PDL=True,
                                                    EARLY=True, SPLIT_K=2, FIXUP=True)),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4,
                                                                         num_stages=4))
ptx = compiled.asm["ptx"]
print("griddepcontrol.wait" in ptx, "mma" in ptx, "atom.global.gpu.acq_rel.add" in ptx,
      "ld.global.cg" in ptx)
"""


def test_compiles_for_sm90_with_its_dependent_launch_prologue():
    """Triton's own ptxas, no GPU: the kernel builds for the H200 with PDL,
    runs its tile products on tensor cores, and its split-K fix-up counts
    arrivals with an acquire-release atomic and reads partials through L2."""
    out = run_sm90_script(_COMPILE_SM90)
    assert out.split() == ["True"] * 4, out


def test_quantized_weights_are_never_swapped_nor_dequantized(monkeypatch):
    """A 4-bit model keeps its own GEMV everywhere, the head included, and
    asking whether a QuantWeight takes the kernel must not dequantize it (it
    did, per call, on the H200: 10-20 GiB more in each worker)."""
    from engine.loader import load_model
    from engine.quant.tensor import QuantTensor

    model = load_model("tiny-qwen3.5", weights="q4_k_m", progress=False).model

    def no_dequantize(*args, **kwargs):
        raise AssertionError("a QuantWeight was dequantized")

    monkeypatch.setattr(QuantTensor, "dequantize", no_dequantize)
    head = model.output_embedding
    assert type(head).__name__ == "QuantWeight"
    assert not takes_dense_gemv(torch.zeros(1, head.shape[1]), head)
    assert use_dense_gemv(model) == sum(type(m) is nn.Linear for m in model.modules())
    assert model.head_linear is not dense_linear
