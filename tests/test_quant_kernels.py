"""W4A16 / W8A16 Triton kernels against their PyTorch reference.

Runs on the CPU with the Triton interpreter; on a CUDA machine with
TRITON_INTERPRET=0 the same tests run the compiled kernels on the GPU.
Outputs are NaN-poisoned first, so a row or column the kernel skips fails."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.quant.gemv import check_gemv_layout, gemv_x8_reference  # noqa: E402
from engine.quant.gemv_configs import (CANDIDATES, DOT_CANDIDATES, MAX_SPLIT_K,  # noqa: E402
                                       STREAM_CANDIDATES, TUNED, TUNED_FILE_ENV, GemvConfig,
                                       pick_config)
from engine.quant import kernels as quant_kernels  # noqa: E402
from engine.quant import workspace  # noqa: E402
from engine.quant.kernels import (dequantize_rows, gemm, gemv, reference_matmul,  # noqa: E402
                                  triton_matmul, workspace_matmul)
from engine.quant.linear import QuantEmbedding, QuantLinear  # noqa: E402
from engine.quant.tensor import QuantTensor  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] not in ("", "0")
DEVICE = "cpu" if INTERPRET else "cuda"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("compiled Triton kernels need CUDA", allow_module_level=True)

# (bits, group, superblock, asymmetric): Q4_K, Q6_K, Q8_0, GPTQ-int4 (group 64 here), Q5_K
FORMATS = [(4, 32, 256, True), (8, 16, 256, False), (8, 32, 32, False), (4, 64, 64, True),
           (8, 32, 256, True)]
FORMAT_IDS = ["q4_k", "q6_k", "q8_0", "gptq", "q5_k"]


@pytest.fixture(autouse=True)
def _float_activations_unless_a_test_asks(monkeypatch):
    """The float kernels' tests compare at fp32 tolerance: unset, their one-row
    4-bit GEMVs would pick the DP4A kernel, whose tests unset this."""
    monkeypatch.setenv("TANDEM_GEMV_INT8_X", "0")


def random_quant(n: int, k: int, bits: int, group: int, superblock: int, asym: bool,
                 seed: int = 0) -> QuantTensor:
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        codes = torch.randint(0, 16, (n, k), generator=g)
    else:
        codes = torch.randint(-128, 128, (n, k), generator=g)
    d = (torch.rand(n, k // superblock, generator=g) * 0.02 / (8 if bits == 8 else 1)).half()
    sc = torch.randint(1, 64, (n, k // group), generator=g)
    dmin = (torch.rand(n, k // superblock, generator=g) * 0.02).half() if asym else None
    m = torch.randint(0, 64, (n, k // group), generator=g) if asym else None
    return QuantTensor.from_codes(codes, bits, d, sc, dmin, m).to(DEVICE)


def _tolerance(dtype):
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def _expected(x, qt):
    return reference_matmul(x.float(), qt)  # fp32 everywhere: the kernels accumulate in fp32


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_gemv_matches_reference(fmt, rows):
    # N not a multiple of the block, K not a multiple of BLOCK_K (256): tails are masked
    qt = random_quant(40, 768 if fmt[2] == 256 else 576, *fmt)
    x = torch.randn(rows, qt.in_features, device=DEVICE)
    out = torch.full((rows, qt.out_features), float("nan"), device=DEVICE)
    y = gemv(x, qt, out=out)
    assert y.data_ptr() == out.data_ptr()
    torch.testing.assert_close(y, _expected(x, qt), **_tolerance(torch.float32))


# 4-bit formats with groups of 32, the int8-activation kernel's reach: Q4_K, Q4_1-like
# (superblock = group, with a minimum), symmetric 4-bit
X8_FORMATS = [(4, 32, 256, True), (4, 32, 32, True), (4, 32, 32, False)]


def _activation_with_outliers(k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g)
    x[0, 3] = 40.0  # one group's scale set by an outlier, as real activations have
    x[0, 64:96] = 0.0  # an all-zero group: scale 0, codes 0, no division by zero
    return x.to(DEVICE)


@pytest.mark.parametrize("fmt", X8_FORMATS, ids=["q4_k", "q4_1", "sym4"])
@pytest.mark.parametrize("config", [GemvConfig(16, 256, 1, int8_x=True),
                                    GemvConfig(8, 128, 3, int8_x=True),
                                    GemvConfig(16, 256, 1, int8_x=True, prefetch=True),
                                    GemvConfig(8, 128, 3, int8_x=True, prefetch=True)],
                         ids=["even", "split3", "even-prefetch", "split3-prefetch"])
@pytest.mark.parametrize("early", ["0", "1"])
def test_int8_activation_gemv_matches_its_reference(fmt, config, early, monkeypatch):
    """The DP4A kernel (int8 activations per weight group) against its PyTorch
    reference: N and K tails, split-K, bias, NaN-poisoned output; with the
    first weight tile loaded ahead of the loop (TANDEM_GEMV_EARLY) too, and
    with every tile loaded one ahead (prefetch)."""
    monkeypatch.setenv("TANDEM_GEMV_EARLY", early)
    qt = random_quant(37, 768, *fmt, seed=11)
    x = _activation_with_outliers(768, seed=12)
    bias = torch.randn(37, device=DEVICE)
    out = torch.full((1, 37), float("nan"), device=DEVICE)
    y = gemv(x, qt, out=out, bias=bias, config=config)
    expected = gemv_x8_reference(x.cpu(), qt.to("cpu")).to(DEVICE) + bias
    assert not y.isnan().any()
    scale = expected.abs().max()
    torch.testing.assert_close(y / scale, expected / scale, rtol=0, atol=2e-6)


@pytest.mark.parametrize("fmt", X8_FORMATS[:2], ids=["q4_k", "q4_1"])
@pytest.mark.parametrize("split", [2, 3, 8])
def test_split_fixup_gives_the_sum_kernels_numbers_and_leaves_its_counters_zero(
        fmt, split, monkeypatch):
    """TANDEM_SPLIT_FIXUP=1: the last program of each output tile sums the
    split-K partials in the sum kernel's order, so the numbers are bitwise
    those of the two-launch path (a decode and its verify must agree), and
    every arrival counter is back at zero for the next launch."""
    from engine.quant.gemv import split_counters

    qt = random_quant(45, 768, *fmt, seed=21)
    x = _activation_with_outliers(768, seed=22)
    config = GemvConfig(8, 64, split, int8_x=True)
    monkeypatch.setenv("TANDEM_SPLIT_FIXUP", "0")
    summed = gemv(x, qt, config=config)
    monkeypatch.setenv("TANDEM_SPLIT_FIXUP", "1")
    for _ in range(2):  # a second launch reads the counters the first left
        out = torch.full((1, 45), float("nan"), device=DEVICE)
        fixed = gemv(x, qt, out=out, config=config)
        assert fixed.data_ptr() == out.data_ptr() and torch.equal(fixed, summed)
    assert not split_counters(torch.device(DEVICE)).any()


@pytest.mark.parametrize("fmt", X8_FORMATS[:2], ids=["q4_k", "q4_1"])
@pytest.mark.parametrize("block_n,block_k,stream_k,sms,most_parts", [
    (8, 128, 1, 5, 2),   # 8 units a program: a whole block, then part of the next
    (8, 64, 1, 11, 3),   # 12 tiles a block over 7-unit programs, the last one 2 units
    (8, 64, 3, 5, 4),    # 5-unit programs, the last 2: a block in up to four parts
    (16, 512, 1, 2, 2),  # a K tail (768 = 512 + 256), N tail, a whole block after a part
], ids=["whole-then-part", "parts3", "parts4", "k-tail"])
def test_stream_k_gemv_matches_its_reference_and_leaves_its_counters_zero(
        fmt, block_n, block_k, stream_k, sms, most_parts, monkeypatch):
    """The stream-K DP4A launch (GemvConfig.stream_k) against the int8
    reference, with programs whose runs of K tiles start and end inside
    output blocks (the partial sums the last arrival adds), an N tail and a
    K tail, into NaN-poisoned output; a second launch gives the same bits
    (the parts are added in a fixed order) and the counters end at zero."""
    from engine.quant.gemv import split_counters, stream_k_plan

    monkeypatch.setattr("engine.quant.gemv._sm_count", lambda device: sms)
    qt = random_quant(45, 768, *fmt, seed=31)
    x = _activation_with_outliers(768, seed=32)
    config = GemvConfig(block_n, block_k, 1, int8_x=True, prefetch=True, stream_k=stream_k)
    blocks, k_tiles, per_program, programs, max_parts = stream_k_plan(
        45, 768, block_n, block_k, stream_k, sms)
    assert max_parts == most_parts
    expected = gemv_x8_reference(x.cpu(), qt.to("cpu")).to(DEVICE)
    scale = expected.abs().max()
    results = []
    for _ in range(2):
        out = torch.full((1, 45), float("nan"), device=DEVICE)
        y = gemv(x, qt, out=out, config=config)
        assert y.data_ptr() == out.data_ptr() and not y.isnan().any()
        torch.testing.assert_close(y / scale, expected / scale, rtol=0, atol=2e-6)
        results.append(y)
    assert torch.equal(results[0], results[1])
    assert not split_counters(torch.device(DEVICE)).any()


def test_stream_k_needs_the_dp4a_kernel_and_leaves_bias_to_the_split_launch():
    with pytest.raises(ValueError, match="stream_k"):
        GemvConfig(32, 1024, 1, stream_k=4)  # not int8_x
    qt = random_quant(37, 768, 4, 32, 256, True, seed=33)
    x = _activation_with_outliers(768, seed=34)
    bias = torch.randn(37, device=DEVICE)
    y = gemv(x, qt, bias=bias, config=GemvConfig(8, 128, 1, int8_x=True, stream_k=2))
    expected = gemv_x8_reference(x.cpu(), qt.to("cpu")).to(DEVICE) + bias
    scale = expected.abs().max()
    torch.testing.assert_close(y / scale, expected / scale, rtol=0, atol=2e-6)


def test_int8_activations_err_within_half_a_code_per_element():
    """The reference's only error against the exact product: each activation
    moves by at most half its group's step, so |err| <= sum over K of
    |w| * step / 2 (a bound we derive, not the kernel's own output)."""
    qt = random_quant(24, 512, 4, 32, 256, True, seed=5).to("cpu")
    x = _activation_with_outliers(512, seed=6).cpu()
    w = qt.dequantize(torch.float32)
    exact = x @ w.t()
    got = gemv_x8_reference(x, qt)
    step = x.reshape(1, -1, 32).abs().amax(-1) / 127                     # [1, K/32]
    bound = (w.abs().reshape(24, -1, 32).sum(-1) * step / 2).sum(-1)      # [24]
    assert ((got - exact).abs()[0] <= bound * 1.001 + 1e-4).all()
    assert (got - exact).abs().max() > 0  # it does quantize


def test_picked_one_row_4bit_configs_take_int8_activations_and_the_switch_turns_them_off(
        monkeypatch):
    """Unset, a one-row 4-bit GEMV in groups of 32 runs the DP4A kernel (the
    picked config, TUNED or heuristic); TANDEM_GEMV_INT8_X=0 gives the float
    kernel's numbers, =1 forces DP4A onto a config that does not name it."""
    qt = random_quant(40, 512, 4, 32, 256, True, seed=9)
    x = _activation_with_outliers(512, seed=10)
    expected = gemv_x8_reference(x.cpu(), qt.to("cpu")).to(DEVICE)
    scale = expected.abs().max()
    monkeypatch.delenv("TANDEM_GEMV_INT8_X", raising=False)
    assert pick_config(4, 40, 512, 1, 32, 132).int8_x
    picked = gemv(x, qt)
    torch.testing.assert_close(picked / scale, expected / scale, rtol=0, atol=2e-6)
    monkeypatch.setenv("TANDEM_GEMV_INT8_X", "0")
    plain = gemv(x, qt)
    torch.testing.assert_close(plain, _expected(x, qt), **_tolerance(torch.float32))
    assert (picked - plain).abs().max() > 1e-3 * scale  # the activations were quantized
    monkeypatch.setitem(TUNED, (4, 32, 40, 512, 1), GemvConfig(16, 256, 1))  # a float config
    monkeypatch.setenv("TANDEM_GEMV_INT8_X", "1")
    forced = gemv(x, qt)
    torch.testing.assert_close(forced / scale, expected / scale, rtol=0, atol=2e-6)


def test_a_sweep_file_overrides_the_picked_config_and_a_bad_one_says_what_to_give(
        tmp_path, monkeypatch):
    """TANDEM_GEMV_TUNED names a sweep's JSON (bench.quant --sweep --json):
    its best config for a shape replaces the pick. Here it names a float
    config where the pick is DP4A, so the product has the float kernel's
    numbers; a file without sweep results is a ValueError naming the switch."""
    import json

    qt = random_quant(40, 512, 4, 32, 256, True, seed=11)
    x = _activation_with_outliers(512, seed=12)
    monkeypatch.delenv("TANDEM_GEMV_INT8_X", raising=False)
    monkeypatch.delenv(TUNED_FILE_ENV, raising=False)
    assert pick_config(4, 40, 512, 1, 32, 132).int8_x
    swept = tmp_path / "sweep.json"
    swept.write_text(json.dumps({"sweep": [
        {"bits": 4, "group": 32, "N": 40, "K": 512, "bucket": 1,
         "best_config": [8, 128, 2, 4, 1, False, True, False]}]}))
    monkeypatch.setenv(TUNED_FILE_ENV, str(swept))
    assert pick_config(4, 40, 512, 1, 32, 132) == GemvConfig(8, 128, 2, 4, 1, prefetch=True)
    assert pick_config(4, 48, 512, 1, 32, 132).int8_x  # a shape the file lacks
    y = gemv(x, qt)
    torch.testing.assert_close(y, _expected(x, qt), **_tolerance(torch.float32))
    dp4a = gemv_x8_reference(x.cpu(), qt.to("cpu")).to(DEVICE)
    assert (y - dp4a).abs().max() > 1e-3 * dp4a.abs().max()
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"sweep": None}))
    monkeypatch.setenv(TUNED_FILE_ENV, str(empty))
    with pytest.raises(ValueError, match=TUNED_FILE_ENV):
        pick_config(4, 40, 512, 1, 32, 132)
    monkeypatch.setenv(TUNED_FILE_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="cannot read"):
        pick_config(4, 40, 512, 1, 32, 132)


def test_heuristic_picks_dp4a_for_the_27b_one_row_shapes(monkeypatch):
    """Untuned, the heuristic lands on the block shape the H200 sweep found
    best for every merged 27B projection (TUNED's int8_x entries)."""
    tuned = {key: cfg for key, cfg in TUNED.items() if cfg.int8_x}
    assert len(tuned) >= 5
    monkeypatch.setattr("engine.quant.gemv_configs.TUNED", {})
    for (bits, group, n, k, _), cfg in tuned.items():
        picked = pick_config(bits, n, k, 1, group, 132)
        assert picked.int8_x and (picked.block_n, picked.block_k) == (cfg.block_n, cfg.block_k)


def test_heuristic_keeps_float_activations_outside_the_dp4a_reach():
    assert not pick_config(8, 40, 512, 1, 16, 132).int8_x      # Q6_K
    assert not pick_config(4, 40, 512, 1, 128, 132).int8_x     # GPTQ groups of 128
    assert not pick_config(4, 40, 512, 4, 32, 132).int8_x      # several rows


@pytest.mark.parametrize("fmt,rows", [((8, 16, 256, False), 1), ((4, 64, 64, True), 1),
                                      ((4, 32, 256, True), 3)], ids=["q6_k", "gptq", "3rows"])
def test_int8_activation_config_falls_back_outside_its_reach(fmt, rows):
    """8-bit codes, groups other than 32 and several rows run the float kernel."""
    qt = random_quant(24, 512, *fmt, seed=3)
    x = torch.randn(rows, 512, device=DEVICE)
    y = gemv(x, qt, config=GemvConfig(16, 256, 1, int8_x=True))
    torch.testing.assert_close(y, _expected(x, qt), **_tolerance(torch.float32))


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("config,rows", [(GemvConfig(16, 256, 1), 1), (GemvConfig(8, 128, 3), 5),
                                         (GemvConfig(32, 64, 4), 2),
                                         (GemvConfig(8, 128, 2, prefetch=True), 1)],
                         ids=["even-1row", "split3-5rows", "split4-2rows", "prefetch-split2"])
def test_gemv_configs_with_tails_bias_and_split_k(fmt, config, rows):
    # N = 37 is no multiple of any BLOCK_N; K = 768 / 576 leaves a partial last
    # tile for some BLOCK_K and splits that do not divide the tiles evenly
    k = 768 if fmt[2] == 256 else 576
    qt = random_quant(37, k, *fmt, seed=7)
    x = torch.randn(rows, k, device=DEVICE)
    bias = torch.randn(37, device=DEVICE)
    out = torch.full((rows, 37), float("nan"), device=DEVICE)
    y = gemv(x, qt, out=out, bias=bias, config=config)
    assert y.data_ptr() == out.data_ptr()
    torch.testing.assert_close(y, _expected(x, qt) + bias, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("config,rows", [(GemvConfig(16, 256, 1, tensor_cores=True), 2),
                                         (GemvConfig(32, 128, 3, tensor_cores=True), 8)],
                         ids=["tc-2rows", "tc-split3-8rows"])
def test_gemv_tensor_cores_with_tails_bias_and_split_k(fmt, config, rows):
    k = 768 if fmt[2] == 256 else 576
    qt = random_quant(37, k, *fmt, seed=9)
    x = torch.randn(rows, k, device=DEVICE)
    bias = torch.randn(37, device=DEVICE)
    out = torch.full((rows, 37), float("nan"), device=DEVICE)
    y = gemv(x, qt, out=out, bias=bias, config=config)
    torch.testing.assert_close(y, _expected(x, qt) + bias, rtol=1e-4, atol=1e-4)


def test_gemv_bf16_rows_up_to_8():
    qt = random_quant(16, 256, 4, 32, 256, True, seed=8)
    for rows in range(1, 9):
        x = torch.randn(rows, 256, device=DEVICE).to(torch.bfloat16)
        out = torch.full((rows, 16), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        expected = _expected(x, qt)
        for config in (GemvConfig(8, 128, 2), GemvConfig(16, 128, 2, tensor_cores=True)):
            out.fill_(float("nan"))
            y = gemv(x, qt, out=out, config=config)
            torch.testing.assert_close(y.float(), expected, rtol=1e-2,
                                       atol=1e-2 * expected.abs().max().item())


def test_gemv_rejects_what_it_cannot_run():
    qt = random_quant(16, 256, 4, 32, 256, True)
    with pytest.raises(ValueError, match="rows"):
        gemv(torch.randn(9, 256, device=DEVICE), qt)
    with pytest.raises(ValueError, match="features"):
        gemv(torch.randn(1, 128, device=DEVICE), qt)
    with pytest.raises(ValueError, match="power of two"):
        GemvConfig(block_n=24)
    odd = QuantTensor.from_codes(torch.randint(-8, 8, (4, 24)), 8, torch.ones(4, 1).half(),
                                 torch.ones(4, 4))  # 8-bit, group 6: no whole words
    with pytest.raises(ValueError, match="whole words"):
        check_gemv_layout(odd)


def test_pick_config_fills_the_gpu(monkeypatch):
    # the heuristic, for shapes the sweep has not tuned, with float activations
    # (the DP4A block shape, 32 x 1024, trades fill for half the instructions)
    monkeypatch.setattr("engine.quant.gemv_configs.TUNED", {})
    monkeypatch.setattr("engine.quant.gemv_configs.ROW1_X8_SHAPES", ())
    sms = 132
    for n, k in ((17408, 5120), (5120, 17408), (5120, 6144), (1024, 5120), (48, 5120)):
        for rows in (1, 4, 8):
            cfg = pick_config(4, n, k, rows, 32, sms)
            n_blocks, tiles = -(-n // cfg.block_n), -(-k // cfg.block_k)
            assert cfg.split_k <= tiles and cfg.block_k % 32 == 0
            # (nearly) every SM gets work when the shape has enough of it
            enough = min(sms, n_blocks * tiles, n_blocks * MAX_SPLIT_K)
            assert n_blocks * cfg.split_k >= 0.9 * enough, (n, k, rows, cfg)
    assert not pick_config(4, 5120, 5120, 1, 32, sms).tensor_cores
    assert pick_config(4, 5120, 5120, 4, 32, sms).tensor_cores
    assert len({c.key() for c in CANDIDATES + DOT_CANDIDATES}) == len(CANDIDATES) + \
        len(DOT_CANDIDATES)


@pytest.mark.parametrize("fmt", FORMATS[:2], ids=FORMAT_IDS[:2])
def test_gemv_split_k_adds_partial_sums(fmt):
    qt = random_quant(24, 1024, *fmt, seed=1)
    x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    out = torch.full((2, 24), float("nan"), device=DEVICE)
    y = gemv(x, qt, out=out, split_k=3)  # 3 splits of 512 (rounded to BLOCK_K): one is empty
    # against fp64: outputs reach ~400 here, where fp32's own reference is off
    # by up to 2e-4 (the kernel by under 1e-4); a lost split is off by O(100)
    exact = (x.double().cpu() @ qt.to("cpu").dequantize(torch.float64).t()).to(DEVICE)
    scale = exact.abs().max()
    torch.testing.assert_close(y.double() / scale, exact / scale, rtol=0, atol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemm_matches_reference(fmt, dtype):
    qt = random_quant(40, 512, *fmt, seed=2)
    x = torch.randn(20, 512, device=DEVICE).to(dtype)
    out = torch.full((20, 40), float("nan"), device=DEVICE, dtype=dtype)
    y = gemm(x, qt, block_m=16, block_n=16, block_k=64, out=out)
    assert not torch.isnan(y).any()
    expected = _expected(x, qt)
    if dtype == torch.float32:
        torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
    else:  # bf16 output (and on the GPU bf16 weight tiles): 1% of the output's scale
        scale = expected.abs().max().item()
        torch.testing.assert_close(y.float(), expected, rtol=1e-2, atol=1e-2 * scale)


def test_dispatch_picks_gemv_up_to_8_rows_and_gemm_above():
    qt = random_quant(32, 256, 4, 32, 256, True, seed=3)
    for rows in (8, 18):
        x = torch.randn(2, rows // 2, 256, device=DEVICE)  # leading dims are flattened
        y = triton_matmul(x, qt)
        assert y.shape == (*x.shape[:-1], 32)
        torch.testing.assert_close(y, _expected(x, qt), rtol=1e-4, atol=1e-4)



def _within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to one unit in the last place of got's dtype: the GPU may
    contract d*sc*q - dmin*m into an FMA, and the interpreter rounds fp32 to
    bf16 toward zero (numpy has no bf16)."""
    ulp = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=ulp * want.abs().max().item())


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_dequantize_rows_writes_exactly_the_rows_asked_for(fmt, dtype):
    qt = random_quant(70, 2048, *fmt, seed=6)
    out = torch.full((44, 2048), float("nan"), device=DEVICE, dtype=dtype)
    dequantize_rows(qt, 25, out[2:42])  # rows 25..64 into the middle of the buffer
    assert torch.isnan(out[:2]).all() and torch.isnan(out[42:]).all()
    assert not torch.isnan(out[2:42]).any()
    _within_one_ulp(out[2:42], qt.dequantize(torch.float32)[25:65].to(dtype))


def test_dequantize_rows_refuses_rows_outside_the_weight():
    qt = random_quant(40, 256, 4, 32, 256, True, seed=7)
    with pytest.raises(ValueError, match="not inside"):
        dequantize_rows(qt, 30, torch.empty(16, 256, device=DEVICE))
    with pytest.raises(ValueError, match="not inside"):
        dequantize_rows(qt, 0, torch.empty(16, 128, device=DEVICE))


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_workspace_matmul_fills_every_column_slice(fmt, dtype):
    """70 output features through a workspace of 32 rows: three slices, the
    last one partial; every column is written and equals the reference."""
    qt = random_quant(70, 512, *fmt, seed=8)
    x = torch.randn(20, 512, device=DEVICE).to(dtype)
    out = torch.full((20, 70), float("nan"), device=DEVICE, dtype=dtype)
    y = workspace_matmul(x, qt, budget_bytes=32 * 512 * x.element_size(), out=out)
    assert y is out and not torch.isnan(y).any()
    expected = _expected(x, qt)
    if dtype == torch.float32:
        torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
    else:  # bf16 weights and output: 1% of the output's scale
        scale = expected.abs().max().item()
        torch.testing.assert_close(y.float(), expected, rtol=1e-2, atol=1e-2 * scale)


def test_dispatch_runs_the_workspace_from_its_row_threshold(monkeypatch):
    qt = random_quant(48, 256, 4, 32, 256, True, seed=9)
    x = torch.randn(18, 256, device=DEVICE)
    monkeypatch.setenv(workspace.MIN_ROWS_ENV, "16")
    monkeypatch.setattr(quant_kernels, "gemm", lambda *a, **k: pytest.fail("took the fused gemm"))
    torch.testing.assert_close(triton_matmul(x, qt), _expected(x, qt), rtol=1e-4, atol=1e-4)
    monkeypatch.setenv(workspace.WORKSPACE_ENV, "0")  # off: the fused gemm
    with pytest.raises(pytest.fail.Exception, match="fused gemm"):
        triton_matmul(x, qt)
    monkeypatch.setenv(workspace.WORKSPACE_ENV, "3")
    with pytest.raises(ValueError, match=workspace.WORKSPACE_ENV):
        triton_matmul(x, qt)


@pytest.mark.parametrize("in_features", [256, 5120, 6144, 17408, 100_000])
def test_the_planned_workspace_holds_every_narrower_weights_slice(in_features):
    """The plan's workspace bounds what workspace_matmul allocates for any
    packed weight up to the widest K (a narrower K can take the larger slice:
    rows round down to whole tiles by K)."""
    planned = workspace.planned_workspace_bytes(in_features, 2)
    budget = workspace.workspace_bytes()
    for k in range(32, in_features + 1, 32):
        assert workspace.slice_rows(k, budget, 2) * k * 2 <= planned, k


    qt = random_quant(48, 256, 4, 32, 256, True, seed=4).to("cpu")
    layer = QuantLinear(qt, torch.randn(48), torch.float32)
    x = torch.randn(3, 256)
    with torch.inference_mode():
        via_module = layer(x)
        via_weight = F.linear(x, layer.weight, layer.bias)  # what the output head does
        dense = layer.weight.float()  # any other use dequantizes
    torch.testing.assert_close(via_module, via_weight, rtol=0, atol=0)
    # the module sums even and odd columns separately: fp32 rounding differs
    torch.testing.assert_close(via_module, F.linear(x, qt.dequantize(), layer.bias),
                               rtol=1e-5, atol=1e-4)
    assert torch.equal(dense, qt.dequantize())
    assert set(layer.state_dict()) == {"qweight", "qd", "qsc", "qdmin", "qm", "bias"}


def test_quant_embedding_dequantizes_only_the_rows_it_reads():
    qt = random_quant(64, 128, 8, 32, 32, False, seed=5).to("cpu")
    emb = QuantEmbedding(qt, torch.float32)
    ids = torch.tensor([[3, 63], [0, 3]])
    assert torch.equal(emb(ids), qt.dequantize()[ids])


@pytest.mark.skipif(INTERPRET, reason="the real 27B widths: compiled kernels only")
@pytest.mark.parametrize("key", sorted(TUNED), ids=lambda k: "-".join(map(str, k)))
def test_tuned_configs_compute_the_product(key):
    # every swept config on its real K (splits, tails and prefetch as timed);
    # N is cut to 4096 + a tail, which only drops whole programs
    bits, group, n, k, rows = key
    fmt = next(f for f in FORMATS if f[:2] == (bits, group) and f[2] == 256)
    qt = random_quant(min(n, 4096 + 24), k, *fmt, seed=11)
    x = torch.randn(rows, k, device=DEVICE)
    out = torch.full((rows, qt.out_features), float("nan"), device=DEVICE)
    config = TUNED[key]
    y = gemv(x, qt, out=out, config=config)
    # a DP4A config quantizes the activations: its oracle is the int8 reference
    # (fp32 would be ~1e-2 away, the H200 run of 2026-12-03 05:56)
    expected = (gemv_x8_reference(x.cpu(), qt.to("cpu")).to(DEVICE) if config.int8_x
                else _expected(x, qt))
    # fp32 sums over up to 17,408 terms in another order (H200: up to 1.7e-3
    # apart at outputs of ~1); a wrong tile or split is off by O(1)
    torch.testing.assert_close(y, expected, rtol=1e-3, atol=1e-3 * expected.abs().max().item())


@pytest.mark.skipif(INTERPRET, reason="the real 27B widths: compiled kernels only")
@pytest.mark.parametrize("key", sorted(k for k, c in TUNED.items() if c.int8_x),
                         ids=lambda k: "-".join(map(str, k)))
@pytest.mark.parametrize("config", STREAM_CANDIDATES, ids=lambda c: c.key())
def test_stream_k_candidates_compute_the_product_on_the_27b_widths(key, config):
    """Each stream-K sweep candidate on a DP4A-tuned 27B shape (N cut to
    4096 + a tail): the split kernel's oracle and tolerance, with the GPU's
    real program counts, so runs cross blocks as they will in the sweep."""
    bits, group, n, k, rows = key
    fmt = next(f for f in FORMATS if f[:2] == (bits, group) and f[2] == 256)
    qt = random_quant(min(n, 4096 + 24), k, *fmt, seed=13)
    x = torch.randn(rows, k, device=DEVICE)
    out = torch.full((rows, qt.out_features), float("nan"), device=DEVICE)
    y = gemv(x, qt, out=out, config=config)
    expected = gemv_x8_reference(x.cpu(), qt.to("cpu")).to(DEVICE)
    torch.testing.assert_close(y, expected, rtol=1e-3, atol=1e-3 * expected.abs().max().item())


def _merged(parts: list[QuantTensor]) -> QuantTensor:
    """The parts joined by the loader's merge (engine/weights/merge.py), as
    a checkpoint's q/k/v or gate/up are."""
    from engine.weights.merge import MergeGroup, merge_checkpoint

    names = tuple(f"layer.part{i}" for i in range(len(parts)))
    tensors = {}
    for name, qt in zip(names, parts):
        tensors.update(qt.state(name))
    group = MergeGroup("layer.merged", names, tuple(p.out_features for p in parts),
                       parts[0].in_features, False)
    merge_checkpoint(tensors, [group], torch.float32, "test")
    assert set(tensors) == {f"layer.merged.{s}" for s in parts[0].tensors()}  # parts freed
    return QuantTensor.from_state(tensors, "layer.merged")


@pytest.mark.parametrize("fmt", FORMATS[:4], ids=FORMAT_IDS[:4])
@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_of_merged_parts_equals_the_parts(fmt, rows):
    """Packed parts of one layout, concatenated component by component: the
    same codes and scales (dequantized bit for bit), and gemv / the reference
    matmul of the merged matrix give the parts' outputs side by side."""
    k = 768 if fmt[2] == 256 else 576
    parts = [random_quant(n, k, *fmt, seed=20 + i) for i, n in enumerate((40, 16, 8))]
    merged = _merged(parts)
    assert merged.shape == (64, k) and merged.describe() == parts[0].describe()
    assert torch.equal(merged.dequantize(), torch.cat([p.dequantize() for p in parts]))
    x = torch.randn(rows, k, device=DEVICE)
    torch.testing.assert_close(reference_matmul(x, merged),
                               torch.cat([reference_matmul(x, p) for p in parts], dim=-1),
                               rtol=1e-5, atol=1e-5)
    out = torch.full((rows, 64), float("nan"), device=DEVICE)
    y = gemv(x, merged, out=out)
    torch.testing.assert_close(y, torch.cat([gemv(x, p) for p in parts], dim=-1),
                               rtol=1e-4, atol=1e-4)


def _random_packed(n: int, k: int, seed: int) -> QuantTensor:
    """A random Q4_K-layout matrix drawn on the device (27B widths are too big
    to draw codes on the host one by one)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def ints(shape, lo, hi, dtype):
        return torch.randint(lo, hi, shape, generator=g, device=DEVICE).to(dtype)
    d = (torch.rand(n, k // 256, generator=g, device=DEVICE) * 0.02).half()
    dmin = (torch.rand(n, k // 256, generator=g, device=DEVICE) * 0.02).half()
    return QuantTensor(ints((n, k // 2), 0, 256, torch.uint8), d,
                       ints((n, k // 32), 1, 64, torch.int8), dmin,
                       ints((n, k // 32), 0, 64, torch.int8))


# The 27B's merged projections (Q4_K, K = 5120): MLP gate_up, attention
# q+gate/k/v, GDN qkv/z/b/a. Not in TUNED yet: they run the heuristic's pick.
MERGED_27B = {"gate_up": (17408, 17408), "attn_qkv": (12288, 1024, 1024),
              "gdn_in_proj": (10240, 6144, 48, 48)}


@pytest.mark.skipif(INTERPRET, reason="the real 27B widths: compiled kernels only")
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("shape", sorted(MERGED_27B))
def test_gemv_of_merged_27b_shapes_equals_the_parts(shape, rows):
    parts = [_random_packed(n, 5120, seed=40 + i) for i, n in enumerate(MERGED_27B[shape])]
    merged = _merged(parts)
    x = torch.randn(rows, 5120, device=DEVICE)
    out = torch.full((rows, merged.out_features), float("nan"), device=DEVICE)
    y = gemv(x, merged, out=out)
    expected = torch.cat([gemv(x, p) for p in parts], dim=-1)
    # fp32 sums over 5,120 terms in another split order; a wrong tile is off by O(1)
    torch.testing.assert_close(y, expected, rtol=1e-3, atol=1e-3 * expected.abs().max().item())
    torch.testing.assert_close(y, _expected(x, merged), rtol=1e-3,
                               atol=1e-3 * expected.abs().max().item())
