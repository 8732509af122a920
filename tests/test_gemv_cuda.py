"""The CUDA DP4A GEMV (engine/quant/gemv_cuda.py, q4_gemv.cu).

On the CPU (CI): the launch plan, the kernel's reach, the plans file and the
switch. On a GPU: the kernel against gemv.py's PyTorch reference of the same
numerics (int8 activations per group of 32), with NaN-poisoned outputs, N
not a multiple of the rows per tile, K whose groups leave threads idle,
fp16 and fp32 scales, with and without a minimum, more tiles than blocks,
programmatic dependent launch inside a CUDA graph, and gemv()'s switch."""
from __future__ import annotations

import json

import pytest
import torch

from engine.quant import gemv_cuda
from engine.quant.gemv_cuda import CudaGemvPlan, picked_plan, plan_for, takes
from engine.quant.tensor import QuantTensor

GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="the CUDA GEMV runs on a GPU only")


# ------------------------------------------------------------------ CPU


@pytest.mark.parametrize("k, threads, slots", [(5120, 160, 1), (17408, 544, 1), (6144, 192, 1),
                                               (1056, 64, 1), (65536, 1024, 2)])
def test_plan_covers_every_group_with_whole_warps(k, threads, slots):
    plan = plan_for(k)
    assert (plan.threads, plan.slots, plan.groups) == (threads, slots, k // 32)
    assert plan.threads % 32 == 0 and plan.slots * plan.threads >= plan.groups


def test_plan_grid_is_one_persistent_wave_and_never_more_than_the_tiles():
    plan = plan_for(5120, rows=4)
    assert plan.tiles(34816) == 8704 and plan.tiles(5) == 2
    assert plan.grid(34816, sms=132, resident_per_sm=6) == 792
    assert plan.grid(5, sms=132, resident_per_sm=6) == 2
    capped = plan_for(5120, rows=4, blocks_per_sm=2)
    assert capped.grid(34816, sms=132, resident_per_sm=6) == 264


def test_bad_plans_say_what_is_wrong():
    with pytest.raises(ValueError, match="whole groups of 32"):
        plan_for(5000)
    with pytest.raises(ValueError, match="multiple of 32"):
        CudaGemvPlan(rows=2, slots=1, threads=100, groups=100)
    with pytest.raises(ValueError, match="cover fewer"):
        CudaGemvPlan(rows=2, slots=1, threads=64, groups=100)
    with pytest.raises(ValueError, match="rows, slots and groups"):
        CudaGemvPlan(rows=0, slots=1, threads=64, groups=64)
    with pytest.raises(ValueError, match="flush x rows <= threads"):
        plan_for(2048, rows=8, flush=16)   # 64 threads cannot sum 128 held rows
    with pytest.raises(ValueError, match="flush must be >= 1"):
        plan_for(2048, flush=0)


def _quant(n, k, asym=True, d_dtype=torch.float16, superblock=256, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    d = (torch.rand(n, k // superblock, generator=g) * 0.02).to(d_dtype)
    sc = torch.randint(1, 64, (n, k // 32), generator=g)
    dmin = (torch.rand(n, k // superblock, generator=g) * 0.02).to(d_dtype) if asym else None
    m = torch.randint(0, 64, (n, k // 32), generator=g) if asym else None
    return QuantTensor.from_codes(codes, 4, d, sc, dmin, m).to(device)


def test_the_kernel_takes_only_one_bf16_gpu_row_of_4bit_groups_of_32_without_bias():
    qt = _quant(8, 256)
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    assert not takes(x, qt, None)  # a CPU tensor
    g64 = QuantTensor.from_codes(torch.randint(0, 16, (8, 256)), 4, torch.rand(8, 4).half(),
                                 torch.randint(1, 64, (8, 4)))
    assert g64.group == 64 and not takes(x, g64, None)


def test_the_switch_is_on_by_default_where_nvrtc_loads_and_a_bad_value_names_it(monkeypatch):
    monkeypatch.delenv(gemv_cuda.CUDA_ENV, raising=False)
    monkeypatch.setattr(gemv_cuda, "nvrtc_available", lambda: True)
    assert gemv_cuda.wanted() is True
    monkeypatch.setenv(gemv_cuda.CUDA_ENV, "0")
    assert gemv_cuda.wanted() is False
    monkeypatch.setenv(gemv_cuda.CUDA_ENV, "yes")
    with pytest.raises(ValueError, match=gemv_cuda.CUDA_ENV):
        gemv_cuda.wanted()
    monkeypatch.setenv(gemv_cuda.CUDA_ENV, "1")
    monkeypatch.setattr(gemv_cuda, "nvrtc_available", lambda: False)
    assert gemv_cuda.wanted() is False  # no NVRTC: the Triton kernel runs


def test_a_card_with_swept_plans_gets_them_unless_a_switch_says_otherwise(tmp_path, monkeypatch):
    """CARD_PLANS: the 27B's shapes on the cards they were swept on get the
    sweep's plans; other shapes and cards plan_for's; a plans file, or any
    TANDEM_GEMV_CUDA_STAGES (0 included), replaces them."""
    monkeypatch.delenv(gemv_cuda.PLANS_ENV, raising=False)
    monkeypatch.delenv(gemv_cuda.STAGES_ENV, raising=False)
    h200 = "NVIDIA H200"
    assert picked_plan(248320, 5120, h200) == plan_for(5120, rows=4, flush=1, stages=3)
    assert picked_plan(34816, 5120, h200) == plan_for(5120, rows=4, flush=16)
    assert picked_plan(5120, 6144, h200) == plan_for(6144, rows=gemv_cuda.DEFAULT_ROWS)
    assert picked_plan(248320, 5120, "NVIDIA GeForce RTX 4090") == \
        picked_plan(248320, 5120) == plan_for(5120, rows=gemv_cuda.DEFAULT_ROWS)
    for card, plans in gemv_cuda.CARD_PLANS.items():  # every entry as written
        for (n, k), entry in plans.items():
            assert picked_plan(n, k, card) == plan_for(k, rows=entry.rows, flush=entry.flush,
                                                       stages=entry.stages)
    assert gemv_cuda.CardPlan(8) == (8, 0, gemv_cuda.DEFAULT_ROWS)
    monkeypatch.setenv(gemv_cuda.STAGES_ENV, "0")
    assert picked_plan(248320, 5120, h200) == plan_for(5120, rows=gemv_cuda.DEFAULT_ROWS)
    monkeypatch.setenv(gemv_cuda.STAGES_ENV, "2")
    assert picked_plan(248320, 5120, h200) == plan_for(5120, rows=4, stages=2)
    monkeypatch.delenv(gemv_cuda.STAGES_ENV)
    path = tmp_path / "plans.json"
    path.write_text(json.dumps({"248320,5120": {"rows": 2, "flush": 4}}))
    monkeypatch.setenv(gemv_cuda.PLANS_ENV, str(path))
    assert picked_plan(248320, 5120, h200) == plan_for(5120, rows=2, flush=4)
    assert picked_plan(34816, 5120, h200) == plan_for(5120, rows=4, flush=16)  # not in the file


def test_a_plans_file_picks_per_shape_and_other_shapes_get_the_default(tmp_path, monkeypatch):
    path = tmp_path / "plans.json"
    # "queue": a key of files written before the tile queue was removed
    path.write_text(json.dumps({"34816,5120": {"rows": 4, "slots": 2, "blocks_per_sm": 3,
                                               "queue": False},
                                "5120,6144": {"rows": 4, "flush": 8}}))
    monkeypatch.setenv(gemv_cuda.PLANS_ENV, str(path))
    assert picked_plan(34816, 5120) == CudaGemvPlan(rows=4, slots=2, threads=96, groups=160,
                                                    blocks_per_sm=3)
    assert picked_plan(5120, 6144) == CudaGemvPlan(rows=4, slots=1, threads=192, groups=192,
                                                   flush=8)
    assert picked_plan(5120, 17408) == plan_for(17408, rows=gemv_cuda.DEFAULT_ROWS)
    written = plan_for(6144, rows=2, slots=2, blocks_per_sm=1, flush=4, stages=3)
    path.write_text(json.dumps({"5120,6144": written.spec()}))   # what --plans-out writes
    monkeypatch.setenv(gemv_cuda.PLANS_ENV, str(tmp_path / "again.json"))
    (tmp_path / "again.json").write_text(path.read_text())
    assert picked_plan(5120, 6144) == written


def test_a_plan_may_carry_its_own_early_tile_count(tmp_path, monkeypatch):
    """A plans file's early_tiles (a block walking 2-3 tiles may want all of
    them asked of L2 before the wait) beats the switch for its shape only;
    a plan without one follows TANDEM_GEMV_EARLY_L2_TILES, and a count the
    kernel does not take is refused with the choices."""
    import json

    from engine.quant.gemv_cuda import plan_early_tiles

    path = tmp_path / "plans.json"
    path.write_text(json.dumps({"5120,6144": {"rows": 4, "flush": 1, "early_tiles": 3},
                                "5120,17408": {"rows": 4, "flush": 16}}))
    monkeypatch.setenv(gemv_cuda.PLANS_ENV, str(path))
    monkeypatch.setenv(gemv_cuda.EARLY_L2_TILES_ENV, "0")
    out, down = picked_plan(5120, 6144), picked_plan(5120, 17408)
    assert out == plan_for(6144, early_tiles=3) and down.early_tiles is None
    assert (plan_early_tiles(out), plan_early_tiles(down)) == (3, 0)
    monkeypatch.setenv(gemv_cuda.EARLY_L2_TILES_ENV, "2")
    assert (plan_early_tiles(out), plan_early_tiles(down)) == (3, 2)
    monkeypatch.setenv(gemv_cuda.PLANS_ENV, str(tmp_path / "again.json"))
    (tmp_path / "again.json").write_text(json.dumps({"5120,6144": out.spec()}))
    assert out.spec()["early_tiles"] == 3 and picked_plan(5120, 6144) == out
    assert "early_tiles" not in down.spec()      # files stay as they were without one
    with pytest.raises(ValueError, match="early_tiles must be None"):
        plan_for(6144, early_tiles=5)


@pytest.mark.parametrize("k, stage", [(5120, 11840), (17408, 40256), (6144, 14208)])
def test_a_ring_stage_holds_a_tiles_codes_and_scales(k, stage):
    """The 27B's Q4_K shapes at 4 rows: 4 x K/2 bytes of codes, 4 x K/32 of
    sc and of m, 4 x K/256 fp16 d and dmin (q4_gemv.cu STAGE_BYTES)."""
    plan = plan_for(k, stages=4)
    assert plan.stage_bytes(256, True, False) == stage == 2 * k + 2 * (k // 8 + k // 32)
    assert plan.ring_bytes(256, True, False) == 4 * stage
    assert plan.stage_bytes(32, False, True) == 2 * k + k // 8 + k // 8 * 4
    assert plan_for(k).ring_bytes(256, True, False) == 0


def test_bulk_copies_take_only_whole_tiles_of_whole_16_byte_arrays():
    from engine.quant.gemv_cuda import bulk_copyable

    assert bulk_copyable(plan_for(5120, stages=4), _quant(64, 5120))
    assert bulk_copyable(plan_for(17408, stages=4), _quant(8, 17408))
    assert not bulk_copyable(plan_for(5120, stages=4), _quant(66, 5120))   # a partial tile
    # K = 1056: 4 x 33 bytes of sc a stage is no whole number of 16-byte units
    assert not bulk_copyable(plan_for(1056, stages=2), _quant(64, 1056, superblock=32))
    assert not bulk_copyable(plan_for(17408, stages=8), _quant(8, 17408))  # 315 KB
    with pytest.raises(ValueError, match="stages"):
        plan_for(5120, stages=9)


def _fp32_normed_product(s, weight, zero_centered, qt):
    """RMSNorm(s) against the dequantized weight, all fp32: no activation
    quantization, no intermediate rounding."""
    s = s.float()
    w = weight.float()
    scaled = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (scaled * (1.0 + w if zero_centered else w)) @ qt.dequantize(torch.float32).t()


@pytest.mark.parametrize("zero_centered, weight_dtype", [(True, torch.bfloat16),
                                                         (True, torch.float32),
                                                         (False, torch.bfloat16)])
@pytest.mark.parametrize("seed", range(4))
def test_the_norm_prologue_reference_is_as_accurate_as_the_norm_launch(zero_centered,
                                                                       weight_dtype, seed):
    """gemv.normed_gemv_x8_reference (the prologue's numerics: x's codes taken
    before the norm's rstd) against the fp32 truth: within 2% of the largest
    output, as engine/fused's norm rounded to bf16 then the int8 GEMV is;
    the two differ (a code moves here and there), yet both are that close."""
    from engine.fused import reference
    from engine.quant.gemv import gemv_x8_reference, normed_gemv_x8_reference

    k = 768
    qt = _quant(96, k, seed=seed)
    g = torch.Generator().manual_seed(seed + 50)
    s = (torch.randn(1, k, generator=g) * 3).to(torch.bfloat16)
    weight = (torch.randn(k, generator=g) * 0.1 + (0.0 if zero_centered else 1.0))
    weight = weight.to(weight_dtype)
    truth = _fp32_normed_product(s, weight, zero_centered, qt)
    deferred = normed_gemv_x8_reference(s, weight, 1e-6, zero_centered, qt)
    launched = gemv_x8_reference(reference.rms_norm(s, weight, 1e-6, zero_centered).float(), qt)
    for product in (deferred, launched):
        assert (product - truth).abs().max() <= 0.02 * truth.abs().max()
    assert not torch.equal(deferred, launched)   # the two roundings are not the same


def test_a_norm_prologue_refuses_what_the_kernel_cannot_do():
    from engine.quant.gemv_cuda import NormPrologue

    k = 256
    x = torch.randn(1, k, dtype=torch.bfloat16)
    w = torch.randn(k, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="together"):
        NormPrologue(w, 1e-6, True, pending=torch.randn(1, k, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16 weight"):
        NormPrologue(w.float(), 1e-6, False)
    pending = torch.randn(1, k, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="alias"):
        NormPrologue(w, 1e-6, True, pending=pending, residual_out=x).operands(x, k)
    with pytest.raises(ValueError, match="256 elements"):
        NormPrologue(w[:128], 1e-6, True).operands(x, k)
    with pytest.raises(ValueError, match=r"\[1, 512\] row"):
        NormPrologue(w, 1e-6, True).operands(x, 512)
    out = torch.empty(1, k, dtype=torch.bfloat16)
    ops = NormPrologue(w, 1e-6, True, pending=pending, residual_out=out).operands(x, k)
    assert ops[0] is pending and ops[1] is w and ops[2] == 1e-6 and ops[3] is out


# ------------------------------------------------------------------ GPU


def _run(qt, x, plan, pdl=False):
    out = torch.full((1, qt.out_features), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = gemv_cuda.gemv_cuda(x, qt, out=out, plan=plan, pdl=pdl)
    assert y.data_ptr() == out.data_ptr()
    return y


def _expected(x, qt):
    from engine.quant.gemv import gemv_x8_reference

    return gemv_x8_reference(x.float().cpu(), qt.to("cpu"))


def _activation(k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g)
    x[0, 3] = 40.0       # an outlier sets one group's scale
    x[0, 64:96] = 0.0    # an all-zero group: scale 0, no division by zero
    return x.to(torch.bfloat16).cuda()


def _recorded_prologues(monkeypatch) -> list:
    """The prologue of every gemv_cuda call from here on (None: a plain GEMV)."""
    calls = []
    real = gemv_cuda.gemv_cuda
    monkeypatch.setattr(gemv_cuda, "gemv_cuda",
                        lambda *a, **kw: calls.append(kw.get("prologue")) or real(*a, **kw))
    return calls


def _chained_in_a_graph(x, a, b, plan=None):
    """(mid, out): mid = GEMV(x, a), out = GEMV(mid, b) with `plan`, both
    with PDL, captured in a CUDA graph (after one run outside it, which
    compiles and loads) and replayed three times into NaN-poisoned outputs."""
    mid = torch.full((1, a.out_features), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = torch.full((1, b.out_features), float("nan"), dtype=torch.bfloat16, device="cuda")

    def both():
        gemv_cuda.gemv_cuda(x, a, out=mid, pdl=True)
        gemv_cuda.gemv_cuda(mid, b, out=out, plan=plan, pdl=True)

    with torch.cuda.stream(torch.cuda.Stream()):
        both()
    torch.cuda.synchronize()
    mid.fill_(float("nan"))
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        both()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return mid, out


def _assert_close(y, expected):
    assert not y.isnan().any()
    scale = expected.abs().max()
    # the output is bf16: half an ulp of the largest value, plus fp32 ordering
    torch.testing.assert_close(y.float().cpu() / scale, expected / scale, rtol=0, atol=8e-3)


@needs_gpu
@pytest.mark.parametrize("n, k", [(37, 768), (64, 1056), (5, 5120), (133, 17408)])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 6, 8])
@pytest.mark.parametrize("kind", ["q4_k", "q4_1", "sym", "fp32-scales"])
def test_cuda_gemv_matches_the_reference(n, k, rows, kind):
    """Rows 5 and 6 too: tiles of any height, a last one past N (37 rows
    at 5 and 6, 133 at 5), which down (5 rows: 1,024 whole tiles of its 5,120)
    and the K = 5120 projections may run."""
    if k == 17408 and rows in (6, 8):
        pytest.skip("6 and 8 rows at 544 threads spill: "
                    "test_a_plan_whose_build_spills_is_never_launched")
    superblock = 256 if kind in ("q4_k", "fp32-scales") and k % 256 == 0 else 32
    qt = _quant(n, k, asym=kind != "sym", superblock=superblock, seed=n + k,
                d_dtype=torch.float32 if kind == "fp32-scales" else torch.float16, device="cuda")
    x = _activation(k, seed=k)
    _assert_close(_run(qt, x, plan_for(k, rows=rows)), _expected(x, qt))


@needs_gpu
@pytest.mark.parametrize("n, k, superblock", [(64, 5120, 256), (256, 17408, 256),
                                              (96, 6144, 256), (40, 1024, 32)])
@pytest.mark.parametrize("rows", [1, 2, 4, 8])
@pytest.mark.parametrize("stages", [1, 2, 4])
@pytest.mark.parametrize("kind", ["q4_k", "sym", "fp32-scales"])
def test_tiles_through_the_shared_memory_ring_give_the_register_pipelines_bits(
        n, k, superblock, rows, stages, kind):
    """The ring only moves where a tile's words wait: the same group dots
    and sums in the same order, so the output is bitwise the register
    pipeline's, and the reference's within bf16."""
    qt = _quant(n, k, asym=kind != "sym", superblock=superblock, seed=n + k + rows,
                d_dtype=torch.float32 if kind == "fp32-scales" else torch.float16, device="cuda")
    x = _activation(k, seed=k + stages)
    plan = plan_for(k, rows=rows, stages=stages)
    if not gemv_cuda.bulk_copyable(plan, qt):
        pytest.skip("not a shape the ring takes")
    if k == 17408 and rows == 8:
        pytest.skip("8 rows at 544 threads spill")
    staged = _run(qt, x, plan)
    assert torch.equal(staged, _run(qt, x, plan_for(k, rows=rows)))
    _assert_close(staged, _expected(x, qt))


@needs_gpu
@pytest.mark.parametrize("stages, flush", [(2, 1), (3, 1), (2, 4), (5, 16)])
def test_a_block_walking_many_tiles_reuses_each_stage_in_turn(stages, flush):
    """500 tiles over one block an SM: each stage is refilled several
    times, so a wrong parity or an early refill shows in the output; with
    PDL and inside a CUDA graph, chained after a GEMV that writes its x."""
    a = _quant(2048, 1024, seed=stages, device="cuda")
    b = _quant(2000, 2048, seed=stages + 1, device="cuda")
    x = _activation(1024, seed=flush)
    plan = plan_for(2048, rows=4, blocks_per_sm=1, flush=flush, stages=stages)
    mid, out = _chained_in_a_graph(x, a, b, plan)
    assert torch.equal(out, _run(b, mid, plan_for(2048, rows=4, blocks_per_sm=1)))
    _assert_close(out, _expected(mid, b))



@needs_gpu
def test_a_ring_within_48_kb_beside_static_arrays_past_it_launches():
    """K = 5120 at 4 stages is a 47,360-byte ring, under the 48 KB a block
    has without opting in, but the norm prologue's weight stash (10 KB of
    static arrays) takes the block past it: the opt-in must count both (it
    counted the dynamic bytes alone until 12-07, when a 48 KB copy ring
    beside 96 bytes of static arrays failed to launch with
    CUDA_ERROR_INVALID_VALUE). Bitwise the register pipeline's output."""
    from engine.quant.gemv_cuda import NormPrologue

    plan = plan_for(5120, stages=4)
    qt = _quant(256, 5120, seed=14, device="cuda")
    assert plan.ring_bytes(qt.superblock, qt.asymmetric, False) <= 48 * 1024
    x = _activation(5120, seed=15)
    norm = NormPrologue(torch.ones(5120, dtype=torch.bfloat16, device="cuda"), 1e-6, True)
    ring = gemv_cuda.gemv_cuda(x, qt, plan=plan, prologue=norm)
    assert torch.equal(ring, gemv_cuda.gemv_cuda(x, qt, plan=plan_for(5120), prologue=norm))


@needs_gpu
def test_a_ring_plan_the_shape_cannot_take_is_refused_given_and_dropped_from_a_file(
        tmp_path, monkeypatch):
    qt = _quant(66, 5120, seed=9, device="cuda")   # 66 rows: a partial 4-row tile
    x = _activation(5120, seed=9)
    with pytest.raises(ValueError, match="stages=0"):
        gemv_cuda.gemv_cuda(x, qt, plan=plan_for(5120, stages=4))
    path = tmp_path / "plans.json"
    path.write_text(json.dumps({"66,5120": plan_for(5120, stages=4).spec()}))
    monkeypatch.setenv(gemv_cuda.PLANS_ENV, str(path))
    assert torch.equal(gemv_cuda.gemv_cuda(x, qt), _run(qt, x, plan_for(5120)))


@needs_gpu
def test_a_ring_past_a_blocks_shared_memory_with_the_static_arrays_is_never_launched(
        tmp_path, monkeypatch):
    """down's K at 5 stages is a 197 KB ring, within the 227 KB a block may
    hold alone, but the norm prologue's weight stash (35 KB of static
    arrays: 16 bytes x 4 x 544 threads) takes it past: given, it is refused
    before any launch; from a plans file the register pipeline runs
    instead."""
    from engine.quant.gemv_cuda import NormPrologue

    qt = _quant(256, 17408, seed=12, device="cuda")
    x = _activation(17408, seed=13)
    norm = NormPrologue(torch.ones(17408, dtype=torch.bfloat16, device="cuda"), 1e-6, True)
    plan = plan_for(17408, stages=5)
    assert gemv_cuda.bulk_copyable(plan, qt)
    out = torch.full((1, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="fewer stages"):
        gemv_cuda.gemv_cuda(x, qt, out=out, plan=plan, prologue=norm)
    assert out.isnan().all()          # nothing ran
    path = tmp_path / "plans.json"
    path.write_text(json.dumps({"256,17408": plan.spec()}))
    monkeypatch.setenv(gemv_cuda.PLANS_ENV, str(path))
    assert torch.equal(gemv_cuda.gemv_cuda(x, qt, prologue=norm),
                       gemv_cuda.gemv_cuda(x, qt, plan=plan_for(17408), prologue=norm))


@needs_gpu
def test_a_plan_whose_build_spills_is_never_launched(tmp_path, monkeypatch):
    """8 rows a tile at down's 544 threads spill (nvcc 13 for sm_90: 96
    registers, 100 bytes a thread; the 12-04 sweep picked it for down): given
    explicitly it is refused before any launch; from a plans file the
    default plan runs instead, so a worker never launches a spilling kernel."""
    qt = _quant(133, 17408, seed=31, device="cuda")
    x = _activation(17408, seed=32)
    out = torch.full((1, 133), float("nan"), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(gemv_cuda.SpillingPlan, match="spills"):
        gemv_cuda.gemv_cuda(x, qt, out=out, plan=plan_for(17408, rows=8))
    assert out.isnan().all()          # nothing ran
    path = tmp_path / "plans.json"
    path.write_text(json.dumps({"133,17408": {"rows": 8, "slots": 1}}))
    monkeypatch.setenv(gemv_cuda.PLANS_ENV, str(path))
    assert torch.equal(gemv_cuda.gemv_cuda(x, qt), _run(qt, x, plan_for(17408)))


@needs_gpu
@pytest.mark.parametrize("slots", [2, 3])
def test_more_slots_per_thread_and_one_block_per_sm_walking_many_tiles(slots):
    qt = _quant(1000, 2048, seed=3, device="cuda")
    x = _activation(2048, seed=4)
    plan = plan_for(2048, rows=2, slots=slots, blocks_per_sm=1)
    _assert_close(_run(qt, x, plan), _expected(x, qt))


@needs_gpu
@pytest.mark.parametrize("n, rows, flush, blocks_per_sm", [
    (2000, 4, 8, 1),    # 500 tiles over one block an SM: flushes of 8 and a short last one
    (2000, 4, 16, 0),   # a full grid: some blocks hold fewer tiles than a flush
    (37, 1, 4, 0),      # fewer tiles than blocks
    (133, 8, 2, 1),     # a partial last tile inside a held batch
])
def test_sums_held_across_tiles_give_the_per_tile_bits(n, rows, flush, blocks_per_sm):
    """flush only moves the barrier: each tile's cross-warp sum is the same
    fp32 adds in the same order, so the output is bitwise flush 1's."""
    qt = _quant(n, 2048, seed=n + flush, device="cuda")
    x = _activation(2048, seed=flush)
    every_tile = _run(qt, x, plan_for(2048, rows=rows, blocks_per_sm=blocks_per_sm))
    held = _run(qt, x, plan_for(2048, rows=rows, blocks_per_sm=blocks_per_sm, flush=flush),
                pdl=True)
    assert torch.equal(held, every_tile)
    _assert_close(held, _expected(x, qt))


@needs_gpu
def test_dependent_launches_in_a_cuda_graph_read_what_the_kernel_before_wrote():
    """Two GEMVs chained in a graph with PDL: the second's x is the first's
    output, so a missing griddepcontrol.wait reads stale or NaN values."""
    a, b = _quant(512, 1024, seed=5, device="cuda"), _quant(256, 512, seed=6, device="cuda")
    x = _activation(1024, seed=7)
    mid, out = _chained_in_a_graph(x, a, b)
    _assert_close(mid, _expected(x, a))
    _assert_close(out, _expected(mid, b))


@needs_gpu
def test_gemv_runs_the_cuda_kernel_when_switched_on_and_the_triton_one_otherwise(monkeypatch):
    from engine.quant.gemv import gemv

    qt = _quant(96, 1024, seed=8, device="cuda")
    x = _activation(1024, seed=9)
    monkeypatch.setenv(gemv_cuda.CUDA_ENV, "1")
    calls = []
    real = gemv_cuda.gemv_cuda
    monkeypatch.setattr(gemv_cuda, "gemv_cuda", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    on = gemv(x, qt)
    assert calls == [1]
    monkeypatch.setenv(gemv_cuda.CUDA_ENV, "0")
    off = gemv(x, qt)
    assert calls == [1]
    _assert_close(on, _expected(x, qt))
    torch.testing.assert_close(on.float(), off.float(), rtol=0, atol=float(off.abs().max()) * 8e-3)


@needs_gpu
def test_gemv_leaves_an_output_the_kernel_cannot_write_to_the_triton_kernels(monkeypatch):
    """An fp32 out for a bf16 row: gemv() takes the Triton path, not an error."""
    from engine.quant.gemv import gemv

    qt = _quant(64, 512, seed=10, device="cuda")
    x = _activation(512, seed=11)
    monkeypatch.setenv(gemv_cuda.CUDA_ENV, "1")
    assert gemv_cuda.runs(x, qt) and not gemv_cuda.runs(
        x, qt, out=torch.empty(1, 64, device="cuda"))
    out = torch.full((1, 64), float("nan"), device="cuda")
    y = gemv(x, qt, out=out)
    assert y.data_ptr() == out.data_ptr()
    _assert_close(y, _expected(x, qt))


@needs_gpu
def test_bad_operands_are_refused_with_what_to_give():
    qt = _quant(16, 256, device="cuda")
    with pytest.raises(ValueError, match="bf16 row"):
        gemv_cuda.gemv_cuda(torch.randn(1, 256, device="cuda"), qt)
    with pytest.raises(ValueError, match="out must be"):
        gemv_cuda.gemv_cuda(torch.randn(1, 256, device="cuda", dtype=torch.bfloat16), qt,
                            out=torch.empty(1, 8, device="cuda", dtype=torch.bfloat16))


def test_the_kernel_source_ships_with_the_package_and_names_its_entry_point():
    import tomllib
    from pathlib import Path

    text = gemv_cuda.SOURCE.read_text()
    assert f'extern "C" __global__' in text and gemv_cuda.KERNEL in text
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "quant/*.cu" in project["tool"]["setuptools"]["package-data"]["engine"]


@needs_gpu
@pytest.mark.parametrize("k", [768, 5120])
@pytest.mark.parametrize("zero_centered, weight_dtype", [(True, torch.bfloat16),
                                                         (True, torch.float32),
                                                         (False, torch.bfloat16)])
@pytest.mark.parametrize("with_pending", [True, False])
def test_the_norm_prologue_gives_the_norm_then_the_gemv(k, zero_centered, weight_dtype,
                                                        with_pending):
    """The fused add_rms_norm: the stored residual is bitwise torch's
    round(x + pending); the product is the prologue's PyTorch reference
    (rstd deferred to the flush) within the output's rounding, and as close
    to the fp32 truth (no activation quantization) as the norm's launch then
    the reference GEMV of its bf16 output (engine/fused/reference.py) is:
    within 2% of the largest output, what int8 activations allow."""
    from engine.fused import reference
    from engine.quant.gemv import normed_gemv_x8_reference
    from engine.quant.gemv_cuda import NormPrologue

    qt = _quant(300, k, seed=k, device="cuda")
    g = torch.Generator().manual_seed(k + 1)
    x = (torch.randn(1, k, generator=g) * 3).to(torch.bfloat16).cuda()
    pending = (torch.randn(1, k, generator=g)).to(torch.bfloat16).cuda() if with_pending else None
    weight = (torch.randn(k, generator=g) * 0.1 + (0.0 if zero_centered else 1.0))
    weight = weight.to(weight_dtype).cuda()
    residual = torch.full((1, k), float("nan"), dtype=torch.bfloat16, device="cuda") \
        if with_pending else None
    norm = NormPrologue(weight, 1e-6, zero_centered, pending, residual)
    out = torch.full((1, 300), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = gemv_cuda.gemv_cuda(x, qt, out=out, plan=plan_for(k, rows=4), prologue=norm)
    if with_pending:
        s_ref, normed = reference.add_rms_norm(x, pending, weight, 1e-6, zero_centered)
        assert torch.equal(residual, s_ref)
    else:
        s_ref, normed = x, reference.rms_norm(x, weight, 1e-6, zero_centered)
    assert normed.dtype == torch.bfloat16
    s_ref, weight, qt = s_ref.cpu(), weight.cpu(), qt.to("cpu")
    _assert_close(y, normed_gemv_x8_reference(s_ref, weight, 1e-6, zero_centered, qt))
    truth = _fp32_normed_product(s_ref, weight, zero_centered, qt)
    for product in (y.float().cpu(), _expected(normed, qt)):
        assert (product - truth).abs().max() <= 0.02 * truth.abs().max()


# ------------------------------------------------------- the model's use


def test_the_norm_prologue_switch_is_off_by_default_and_cpu_layers_take_the_norm_launch(
        monkeypatch):
    """norm_then_project on the CPU (or with the switch off) is the norm then
    the projection, bit for bit."""
    from engine.fused import reference
    from engine.model import RMSNorm, norm_then_project
    from engine.quant.linear import NORM_PROLOGUE_ENV

    monkeypatch.setenv(NORM_PROLOGUE_ENV, "1")
    norm = RMSNorm(64, 1e-6, zero_centered=True)
    torch.nn.init.normal_(norm.weight, std=0.1)
    linear = torch.nn.Linear(64, 48, bias=False)
    x, pending = torch.randn(1, 64), torch.randn(1, 64)
    from engine.quant.linear import QuantLinear

    quantized = QuantLinear(_quant(48, 64, superblock=32), None, torch.float32)
    with torch.inference_mode():
        s, normed = reference.add_rms_norm(x, pending, norm.weight, 1e-6, True)
        for projection in (linear, quantized):
            residual, projected = norm_then_project(norm, x, pending, projection)
            assert torch.equal(residual, s) and torch.equal(projected, projection(normed))


@needs_gpu
@pytest.mark.parametrize("with_pending", [True, False])
def test_a_layer_norm_in_the_gemv_prologue_matches_the_norm_launch(with_pending, monkeypatch):
    """The 27B-like tiny Qwen3.5 in int4 on the GPU: norm_then_project with
    TANDEM_NORM_PROLOGUE=1 runs the prologue (one GEMV, no norm launch) and
    agrees with the norm kernel then the GEMV: the residual bitwise, the
    projection within the output's rounding."""
    from engine.loader import load_model
    from engine.model import norm_then_project
    from engine.quant.linear import NORM_PROLOGUE_ENV

    loaded = load_model("tiny-qwen3.5", device="cuda", weights="int4", progress=False)
    layer = loaded.model.model.layers[0]
    norm = layer.input_layernorm
    first = layer.linear_attn.in_proj if layer.is_linear else layer.self_attn.qkv_proj
    k = first.quant.in_features
    g = torch.Generator().manual_seed(31)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16).cuda()
    pending = torch.randn(1, k, generator=g).to(torch.bfloat16).cuda() if with_pending else None
    calls = _recorded_prologues(monkeypatch)
    with torch.inference_mode():
        monkeypatch.setenv(NORM_PROLOGUE_ENV, "0")
        residual_apart, projected_apart = norm_then_project(norm, x, pending, first)
        monkeypatch.setenv(NORM_PROLOGUE_ENV, "1")
        residual, projected = norm_then_project(norm, x, pending, first)
    assert calls and calls[-1] is not None  # the prologue ran
    assert torch.equal(residual, residual_apart)
    _assert_close(projected, projected_apart.float().cpu())


# ------------------------------------------------------ the SiLU prologue


def test_the_silu_prologue_switch_is_off_by_default_and_cpu_mlps_take_the_activation_launch(
        monkeypatch):
    """MLP.finish on the CPU (or with the switch off) is silu_mul then the
    down projection, bit for bit; a bad switch value names the variable."""
    from engine.fused import reference
    from engine.loader import load_model
    from engine.quant.linear import SILU_PROLOGUE_ENV, QuantLinear, prologue_wanted

    _assert_switch(monkeypatch, SILU_PROLOGUE_ENV, prologue_wanted, default=False)
    monkeypatch.setenv(SILU_PROLOGUE_ENV, "1")
    mlp = load_model("tiny-llama", device="cpu", progress=False).model.model.layers[0].mlp
    h, i = mlp.down_proj.out_features, mlp.down_proj.in_features
    mlp.down_proj = QuantLinear(_quant(h, i, superblock=32), None, torch.float32)
    gate_up = torch.randn(1, 2 * i)
    with torch.inference_mode():
        assert mlp.down_proj.forward_activated(gate_up) is None   # a CPU tensor
        gate, up = gate_up.split(i, dim=-1)
        assert torch.equal(mlp.finish(gate_up), mlp.down_proj(reference.silu_mul(gate, up)))


@needs_gpu
@pytest.mark.parametrize("k", [768, 17408])
def test_the_silu_prologue_gives_the_activation_then_the_gemv(k):
    """SiLU(gate) * up in the prologue: the reference GEMV of the reference
    activation's bf16 output, within the output's rounding (the exp may move
    an activation by an ulp, a code by one); a gate_up row of the wrong width
    is refused."""
    from engine.fused import reference

    qt = _quant(300, k, seed=k + 5, device="cuda")
    g = torch.Generator().manual_seed(k + 6)
    gate_up = (torch.randn(1, 2 * k, generator=g) * 2).to(torch.bfloat16).cuda()
    out = torch.full((1, 300), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = gemv_cuda.gemv_cuda(gate_up, qt, out=out, plan=plan_for(k, rows=4),
                            prologue=gemv_cuda.SiluPrologue())
    gate, up = gate_up.split(k, dim=-1)
    act = reference.silu_mul(gate, up)
    assert act.dtype == torch.bfloat16
    _assert_close(y, _expected(act, qt))
    with pytest.raises(ValueError, match="gate_up row"):
        gemv_cuda.gemv_cuda(gate_up[:, :k].contiguous(), qt, prologue=gemv_cuda.SiluPrologue())


@needs_gpu
def test_an_mlp_activation_in_the_gemv_prologue_matches_the_activation_launch(monkeypatch):
    """The tiny Qwen3.5 in int4 on the GPU: MLP.finish with
    TANDEM_SILU_PROLOGUE=1 runs one GEMV with the prologue (no silu_mul
    launch) and agrees with silu_mul then the GEMV within the output's
    rounding."""
    from engine.loader import load_model
    from engine.quant.linear import SILU_PROLOGUE_ENV

    loaded = load_model("tiny-qwen3.5", device="cuda", weights="int4", progress=False)
    mlp = loaded.model.model.layers[0].mlp
    k = mlp.down_proj.quant.in_features
    g = torch.Generator().manual_seed(41)
    gate_up = torch.randn(1, 2 * k, generator=g).to(torch.bfloat16).cuda()
    calls = _recorded_prologues(monkeypatch)
    with torch.inference_mode():
        monkeypatch.setenv(SILU_PROLOGUE_ENV, "0")
        apart = mlp.finish(gate_up)
        monkeypatch.setenv(SILU_PROLOGUE_ENV, "1")
        fused = mlp.finish(gate_up)
    assert calls and isinstance(calls[-1], gemv_cuda.SiluPrologue)  # the prologue ran
    _assert_close(fused, apart.float().cpu())


# ------------------------------------------------- the gated norm prologue


def test_a_gated_norm_prologue_refuses_what_the_kernel_cannot_do():
    from engine.quant.gemv_cuda import GatedNormPrologue

    gate = torch.randn(1, 512, dtype=torch.bfloat16)
    w = torch.randn(128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim of 32 x a power of two"):
        GatedNormPrologue(gate, torch.randn(96, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="gate must be bf16"):
        GatedNormPrologue(gate.float(), w, 1e-6)
    prologue = GatedNormPrologue(gate, w, 1e-6)
    assert prologue.flags() == {"GATED": 1, "HEAD_GROUPS": 4, "W_F32": 0, "ROUND": 1}
    assert GatedNormPrologue(gate, w.float(), 1e-6).flags()["ROUND"] == 0
    with pytest.raises(ValueError, match="whole 128-wide heads"):
        prologue.operands(torch.randn(1, 512, dtype=torch.bfloat16), 448)
    with pytest.raises(ValueError, match="gate must be a contiguous"):
        GatedNormPrologue(gate[:, :256], w, 1e-6).operands(gate, 512)


def test_the_gated_prologue_switch_is_off_by_default_and_cpu_layers_take_the_norm_launch(
        monkeypatch):
    """gated_norm_then_project on the CPU (or with the switch off) is the
    gated norm then the projection, bit for bit."""
    from engine.model import GatedRMSNorm, gated_norm_then_project
    from engine.quant.linear import GATED_PROLOGUE_ENV, QuantLinear, prologue_wanted

    _assert_switch(monkeypatch, GATED_PROLOGUE_ENV, prologue_wanted, default=False)
    monkeypatch.setenv(GATED_PROLOGUE_ENV, "1")
    norm = GatedRMSNorm(64, 1e-6)
    torch.nn.init.normal_(norm.weight, mean=1.0, std=0.1)
    x, z = torch.randn(1, 4, 64), torch.randn(1, 4, 64)
    quantized = QuantLinear(_quant(48, 256, superblock=32), None, torch.float32)
    with torch.inference_mode():
        assert quantized.forward_gated_normed(x, z, norm.weight, 1e-6) is None  # the CPU
        assert torch.equal(gated_norm_then_project(norm, x, z, quantized),
                           quantized(norm(x, z).reshape(1, -1)))


@needs_gpu
@pytest.mark.parametrize("heads, head_dim", [(48, 128), (6, 64), (3, 32)])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_the_gated_prologue_gives_the_gated_norm_then_the_gemv(heads, head_dim, weight_dtype):
    """GDN's gated norm in the prologue: the reference GEMV of the reference
    gated_rms_norm's bf16 output, within the output's rounding (the rsqrt
    and the exp may move a value by an ulp, a code by one)."""
    from engine.fused import reference
    from engine.quant.gemv_cuda import GatedNormPrologue

    k = heads * head_dim
    qt = _quant(300, k, superblock=32, seed=k + 7, device="cuda")
    g = torch.Generator().manual_seed(k + 8)
    x = (torch.randn(1, heads, head_dim, generator=g) * 2).to(torch.bfloat16).cuda()
    z = torch.randn(1, heads, head_dim, generator=g).to(torch.bfloat16).cuda()
    weight = (torch.randn(head_dim, generator=g) * 0.1 + 1.0).to(weight_dtype).cuda()
    out = torch.full((1, 300), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = gemv_cuda.gemv_cuda(x.reshape(1, k), qt, out=out, plan=plan_for(k, rows=4),
                            prologue=GatedNormPrologue(z.reshape(1, k), weight, 1e-6))
    normed = reference.gated_rms_norm(x, z, weight, 1e-6)
    assert normed.dtype == torch.bfloat16
    _assert_close(y, _expected(normed.reshape(1, k), qt))


@needs_gpu
def test_a_gdn_gated_norm_in_the_gemv_prologue_matches_the_norm_launch(monkeypatch):
    """gated_norm_then_project (what GatedDeltaNet.forward_projected ends
    with) on the GPU with TANDEM_GATED_PROLOGUE=1: one GEMV with the
    prologue, z a view of a merged in_proj row as the layer passes it, in
    agreement with the gated norm kernel then the GEMV within the output's
    rounding. (The tiny Qwen3.5's heads are 16 wide, under a group of 32:
    they keep the norm launch, so the 27B's 128-wide heads are built here.)"""
    from engine.model import GatedRMSNorm, gated_norm_then_project
    from engine.quant.linear import GATED_PROLOGUE_ENV, QuantLinear

    heads, head_dim = 6, 128
    norm = GatedRMSNorm(head_dim, 1e-6).cuda()
    torch.nn.init.normal_(norm.weight, mean=1.0, std=0.1)
    norm = norm.to(torch.bfloat16)
    out_proj = QuantLinear(_quant(200, heads * head_dim, seed=61, device="cuda"), None,
                           torch.bfloat16)
    g = torch.Generator().manual_seed(62)
    projected = torch.randn(1, 1024 + heads * head_dim + 2 * heads, generator=g)
    projected = projected.to(torch.bfloat16).cuda()
    z = projected[:, 1024:1024 + heads * head_dim].view(1, heads, head_dim)
    out = torch.randn(1, heads, head_dim, generator=g).to(torch.bfloat16).cuda()
    small = GatedRMSNorm(16, 1e-6).cuda().to(torch.bfloat16)
    calls = _recorded_prologues(monkeypatch)
    with torch.inference_mode():
        monkeypatch.setenv(GATED_PROLOGUE_ENV, "0")
        apart = gated_norm_then_project(norm, out, z, out_proj)
        monkeypatch.setenv(GATED_PROLOGUE_ENV, "1")
        fused = gated_norm_then_project(norm, out, z, out_proj)
        assert isinstance(calls[-1], gemv_cuda.GatedNormPrologue)  # the prologue ran
        calls.clear()
        narrow = gated_norm_then_project(small, out.view(1, -1, 16), z.view(1, -1, 16), out_proj)
        assert calls == [None]  # 16-wide heads: the norm launch, then a plain GEMV
    _assert_close(fused, apart.float().cpu())
    assert narrow.shape == (1, 200) and not narrow.isnan().any()


@pytest.mark.parametrize("prologue", [None, "norm", "silu", "gated"])
@pytest.mark.parametrize("epilogue", [None, "conv", "silu_mul"])
def test_every_flag_the_kernel_tests_is_defined_by_the_build_options(prologue, epilogue):
    """An undefined macro reads as 0 in #if, silently: every name the source
    tests in #if / #elif gets a -D from build_options, whatever the prologue
    and epilogue."""
    import re

    from engine.quant.gemv_cuda import (GatedNormPrologue, NormPrologue, SiluPrologue,
                                        build_options)

    w = torch.randn(128, dtype=torch.bfloat16)
    prologues = {None: None, "norm": NormPrologue(w, 1e-6, True), "silu": SiluPrologue(),
                 "gated": GatedNormPrologue(torch.randn(1, 512, dtype=torch.bfloat16), w, 1e-6)}
    options = build_options(plan_for(5120), 256, True, False, True, prologues[prologue],
                            epilogue={None: None, "conv": _conv_epilogue(64, 4, 2)[0],
                                      "silu_mul": gemv_cuda.SiluMulEpilogue()}[epilogue])
    defined = {o[2:].split("=")[0] for o in options if o.startswith("-D")}
    source = gemv_cuda.SOURCE.read_text()
    tested = {name for line in re.findall(r"^#\s*(?:el)?if\s+(.*)$", source, re.M)
              for name in re.findall(r"[A-Z_][A-Z0-9_]*", line)}
    assert tested <= defined, tested - defined
    assert len([o for o in options if o.startswith("-D")]) == len(defined)  # each once


def test_a_ring_build_has_one_key_whatever_early_tiles_are_asked():
    """The ring fills its stages before the wait and the kernel ignores
    EARLY_L2_TILES under STAGES, so its options name 0 early tiles: asking
    for one no longer compiles the same binary twice. The register
    pipeline keeps the count it is given."""
    from engine.quant.gemv_cuda import build_options

    def options(plan, early):
        return build_options(plan, 256, True, False, True, early_l2_tiles=early)

    ring = plan_for(5120, stages=3)
    assert options(ring, 1) == options(ring, 0)
    assert "-DEARLY_L2_TILES=0" in options(ring, 2)
    assert "-DEARLY_L2_TILES=2" in options(plan_for(5120), 2)



# ------------------------------------------------- GDN's conv in in_proj's epilogue


def _conv_epilogue(channels, width, slots, position=5, in_slot=1, write_slot=1,
                   weight_dtype=torch.bfloat16, window_dtype=torch.float32, device="cpu",
                   seed=0):
    """(ConvEpilogue, its windows): random weights, windows of bf16 values
    (what the conv ever writes: the projection's bf16 outputs), one token at
    `position` reading slot `in_slot` and writing `write_slot`."""
    from engine.quant.gemv_cuda import ConvEpilogue

    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(channels, width, generator=g) * 0.5).to(weight_dtype).to(device)
    windows = torch.randn(slots, channels, width - 1, generator=g).to(torch.bfloat16)
    windows = windows.to(window_dtype).to(device)

    def index(value):
        return torch.tensor([value], dtype=torch.long, device=device)

    return ConvEpilogue(weight, windows, index(position), index(in_slot), index(write_slot)), windows


def test_a_conv_epilogue_refuses_what_the_kernel_cannot_do():
    from engine.quant.gemv_cuda import ConvEpilogue

    conv, windows = _conv_epilogue(64, 4, 2)
    assert conv.flags() == {"CONV": 1, "CONV_K": 4, "CONV_W_F32": 0, "CONV_WIN_F32": 1}
    assert conv.channels == 64
    one = conv.position
    with pytest.raises(ValueError, match="contiguous \\[channels, width\\]"):
        ConvEpilogue(conv.weight.to(torch.float16), windows, one, one, one)
    with pytest.raises(ValueError, match="windows must be \\[slots, 64, 3\\]"):
        ConvEpilogue(conv.weight, windows[:, :32], one, one, one)
    with pytest.raises(ValueError, match="each slot's windows contiguous"):
        ConvEpilogue(conv.weight, windows.transpose(1, 2).contiguous().transpose(1, 2),
                     one, one, one)
    with pytest.raises(ValueError, match="in_slot must be an int64"):
        ConvEpilogue(conv.weight, windows, one, one.int(), one)
    # a slot of a bigger arena (the stride from one slot to the next is the kernel's)
    arena = torch.zeros(3, 64 * 3 + 5)
    ConvEpilogue(conv.weight, arena[:, :64 * 3].view(3, 64, 3), one, one, one)
    with pytest.raises(ValueError, match="64 channels are more than the GEMV's 32"):
        conv.operands(torch.zeros(1, 16), 32)


def test_the_conv_step_parameter_matches_the_kernels_struct():
    """_ConvStep is passed by value as q4_gemv.cu's ConvStep: its fields in
    the source's order, and the C layout (5 pointers, a long long, an int,
    padded to 8)."""
    import ctypes
    import re

    from engine.quant.gemv_cuda import _ConvStep

    source = gemv_cuda.SOURCE.read_text()
    body = re.search(r"struct ConvStep \{(.*?)\};", source, re.S).group(1)
    fields = re.findall(r"(\w+);", re.sub(r"//[^\n]*", "", body))
    assert fields == [name for name, _ in _ConvStep._fields_]
    assert ctypes.sizeof(_ConvStep) == 56 and _ConvStep.channels.offset == 48
    conv, windows = _conv_epilogue(64, 4, 3)
    step = conv.operands(torch.zeros(1, 16), 100)
    assert (step.windows, step.slot_stride, step.channels) == (windows.data_ptr(), 192, 64)


def test_the_conv_epilogue_switch_is_on_by_default_and_cpu_layers_take_the_conv_launch(
        monkeypatch):
    """GatedDeltaNet.project on the CPU is the norm then in_proj, bit for
    bit, and says the conv is still to run; a bad switch value names itself."""
    from engine.loader import load_model
    from engine.model import norm_then_project
    from engine.quant.linear import CONV_EPILOGUE_ENV

    _assert_on_by_default_and_a_bad_value_named(monkeypatch, CONV_EPILOGUE_ENV)
    loaded = load_model("tiny-qwen3.5", weights="int4", progress=False)
    layer = next(layer for layer in loaded.model.model.layers if layer.is_linear)
    k = layer.linear_attn.in_proj.quant.in_features
    x, pending = torch.randn(1, k), torch.randn(1, k)
    with torch.inference_mode():
        residual, projected, convolved = layer.linear_attn.project(
            layer.input_layernorm, x, pending, None, None)
        expected = norm_then_project(layer.input_layernorm, x, pending, layer.linear_attn.in_proj)
    assert convolved is False
    assert torch.equal(residual, expected[0]) and torch.equal(projected, expected[1])
    assert not layer.linear_attn.in_proj.epilogue_applies(x, _conv_epilogue(64, 4, 2)[0])


def _assert_switch(monkeypatch, switch, wanted, default: bool):
    """wanted(switch) is `default` unset, the other value at its digit, and
    a bad value's error names the variable; leaves the switch unset."""
    monkeypatch.delenv(switch, raising=False)
    assert wanted(switch) is default
    monkeypatch.setenv(switch, "yes")
    with pytest.raises(ValueError, match=switch):
        wanted(switch)
    monkeypatch.setenv(switch, "1" if not default else "0")
    assert wanted(switch) is not default
    monkeypatch.delenv(switch)


def _assert_on_by_default_and_a_bad_value_named(monkeypatch, switch):
    from engine.quant.linear import epilogue_wanted

    _assert_switch(monkeypatch, switch, epilogue_wanted, default=True)


def test_a_projection_with_an_epilogue_is_the_norm_then_the_fused_call_or_the_plain_one(
        monkeypatch):
    """model.norm_then_project_in_epilogue on the CPU, and GatedDeltaNet.project
    handing in_proj the normed row and the layer's conv (its GPU gates
    forced open): where the GEMV cannot end with the epilogue, the plain
    projection of the same normed row, bit for bit; where the norm prologue
    may run, the norm, the projection and its epilogue in one call."""
    from engine.batch import ForwardBatch, SequenceInput
    from engine.cache import CacheShape, PagedKVCache
    from engine.kv import make_format
    from engine.loader import load_model
    from engine.model import norm_then_project, norm_then_project_in_epilogue

    loaded = load_model("tiny-qwen3.5", weights="int4", progress=False)
    layer = next(layer for layer in loaded.model.model.layers if layer.is_linear)
    norm, in_proj = layer.input_layernorm, layer.linear_attn.in_proj
    x, pending = torch.randn(1, in_proj.in_features), torch.randn(1, in_proj.in_features)
    epilogue, marker, seen = object(), torch.full((1, 3), 7.0), []
    with torch.inference_mode():
        residual, plain = norm_then_project(norm, x, pending, in_proj)
        got = norm_then_project_in_epilogue(norm, x, pending, in_proj, None)
        assert got[0].equal(residual) and got[1].equal(plain) and got[2] is False
        got = norm_then_project_in_epilogue(norm, x, pending, in_proj, epilogue)  # the CPU: no
        assert got[0].equal(residual) and got[1].equal(plain) and got[2] is False

        monkeypatch.setattr(in_proj, "epilogue_applies", lambda x, e: e is epilogue, raising=False)
        monkeypatch.setattr(in_proj, "forward_in_epilogue",
                            lambda h, e: seen.append((h, e)) or marker, raising=False)
        got = norm_then_project_in_epilogue(norm, x, pending, in_proj, epilogue)
        assert got[0].equal(residual) and got[1] is marker and got[2] is True
        assert seen[0][1] is epilogue and torch.equal(in_proj(seen[0][0]), plain)  # normed row

        monkeypatch.setattr("engine.model.use_fused", lambda x: True)
        monkeypatch.setattr(in_proj, "forward_normed",
                            lambda x_, p, w, eps, zc, epilogue=None:
                            (residual, marker) if epilogue is not None else None, raising=False)
        got = norm_then_project_in_epilogue(norm, x, pending, in_proj, epilogue)
        assert got[0] is residual and got[1] is marker and got[2] is True and len(seen) == 1
        monkeypatch.undo()

        cache = PagedKVCache(loaded.config, CacheShape(4, 16, 2), "cpu",
                             make_format("bf16", dtype=torch.float32))
        batch = ForwardBatch.build([SequenceInput((7,), 3, (0,), 1)], 16, "cpu")
        mixer = layer.linear_attn
        monkeypatch.setattr(mixer, "_one_fused_token", lambda *_: True)
        monkeypatch.setattr(in_proj, "epilogue_applies", lambda x, e: True, raising=False)
        monkeypatch.setattr(in_proj, "forward_in_epilogue",
                            lambda h, e: seen.append((h, e)) or marker, raising=False)
        got = mixer.project(norm, x, pending, batch, cache)
    assert got[1] is marker and got[2] is True
    conv = seen[-1][1]
    assert conv.windows is cache.conv_window(mixer.layer)
    assert conv.weight.equal(mixer.conv1d.weight[:, 0, :])
    assert conv.in_slot.tolist() == [1] and conv.position.tolist() == [3]


def _conv_reference(plain, conv, windows):
    """gdn_kernels.conv_step_reference of the plain GEMV's conv rows, on
    copies of the windows: (SiLU(conv) rows, the windows after)."""
    from engine.gdn_kernels import conv_step_reference

    after = windows.clone()
    offsets = torch.tensor([0, 1], dtype=torch.int32, device=plain.device)
    rows = conv_step_reference(plain[:, :conv.channels].clone(), after, conv.weight, offsets,
                               conv.position, conv.in_slot, conv.write_slot, 1)
    return rows, after


@needs_gpu
@pytest.mark.parametrize("case", ["warm", "fresh", "elsewhere", "nowhere", "padding"])
@pytest.mark.parametrize("weight_dtype, window_dtype", [
    (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16,
                                                                       torch.bfloat16)])
@pytest.mark.parametrize("flush, blocks_per_sm", [(1, 0), (8, 1)])
def test_the_conv_epilogue_gives_the_gemv_then_the_conv_step(case, weight_dtype, window_dtype,
                                                             flush, blocks_per_sm):
    """Rows past the conv's channels are the plain GEMV's bits; the conv rows
    the reference conv step of the plain GEMV's rows within the output's
    rounding, and the windows it leaves bit for bit: warm (reading and
    writing the token's own slot, decode's case), fresh (position 0: a zero
    window), writing another slot, writing none, and a padding copy (slot
    -1: nothing convolved, no window touched). 2,000 rows at one block an SM
    walk several tiles a block, flushed 8 at a time."""
    n, k, channels = 2000, 768, 1500
    position, in_slot, write_slot = {"warm": (5, 1, 1), "fresh": (0, 1, 1),
                                     "elsewhere": (5, 1, 2), "nowhere": (5, 1, -1),
                                     "padding": (5, -1, 1)}[case]
    qt = _quant(n, k, seed=71, device="cuda")
    x = _activation(k, seed=72)
    conv, windows = _conv_epilogue(channels, 4, 3, position, in_slot, write_slot, weight_dtype,
                                   window_dtype, device="cuda", seed=73)
    plan = plan_for(k, rows=4, flush=flush, blocks_per_sm=blocks_per_sm)
    plain = _run(qt, x, plan)
    expected_rows, expected_windows = _conv_reference(plain, conv, windows)
    before = windows.clone()
    out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = gemv_cuda.gemv_cuda(x, qt, out=out, plan=plan, epilogue=conv)
    assert torch.equal(y[:, channels:], plain[:, channels:])
    if case == "padding":
        assert torch.equal(y, plain) and torch.equal(windows, before)
        return
    _assert_close(y[:, :channels], expected_rows.float().cpu())
    assert torch.equal(windows, expected_windows)


@needs_gpu
def test_a_conv_epilogue_in_a_cuda_graph_reads_the_slots_each_replay_hands_it():
    """Captured once after a GEMV that writes its x, with PDL; replayed with
    new position and slots in the same index tensors (as the decode graph
    does): each replay convolves from the window its slot holds then."""
    a = _quant(768, 1024, seed=81, device="cuda")
    b = _quant(900, 768, seed=82, device="cuda")
    x = _activation(1024, seed=83)
    conv, windows = _conv_epilogue(600, 4, 4, device="cuda", seed=84)
    mid = torch.full((1, 768), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = torch.full((1, 900), float("nan"), dtype=torch.bfloat16, device="cuda")

    def both():
        gemv_cuda.gemv_cuda(x, a, out=mid, pdl=True)
        gemv_cuda.gemv_cuda(mid, b, out=out, pdl=True, epilogue=conv)

    state = windows.clone()
    with torch.cuda.stream(torch.cuda.Stream()):
        both()   # compiles and loads
    torch.cuda.synchronize()
    windows.copy_(state)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        both()
    windows.copy_(state)
    plain = _run(b, gemv_cuda.gemv_cuda(x, a), plan_for(768))
    for position, in_slot, write_slot in [(0, 2, 2), (1, 2, 2), (7, 3, 0)]:
        for t, value in ((conv.position, position), (conv.in_slot, in_slot),
                         (conv.write_slot, write_slot)):
            t.fill_(value)
        expected_rows, expected_windows = _conv_reference(plain, conv, windows)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_close(out[:, :600], expected_rows.float().cpu())
        assert torch.equal(out[:, 600:], plain[:, 600:])
        assert torch.equal(windows, expected_windows)


def _prompt_then_four_steps(loaded, tokens=None):
    """(the last logits of four greedy decode steps after a 3-token prompt,
    stacked; the cache; the four tokens fed) of a model on the GPU, in a
    fresh bf16 cache; with `tokens`, those are fed instead of each step's
    argmax."""
    from engine.batch import ForwardBatch, SequenceInput
    from engine.cache import CacheShape, PagedKVCache
    from engine.kv import make_format

    model = loaded.model
    cache = PagedKVCache(loaded.config, CacheShape(4, 16, 2), "cuda",
                         make_format("bf16", dtype=torch.bfloat16))
    steps, fed = [], []
    with torch.inference_mode():
        logits = model(ForwardBatch.build([SequenceInput((5, 9, 200), 0, (0,), 1)], 16,
                                          "cuda"), cache)
        for step, position in enumerate(range(3, 7)):
            token = int(logits[-1].argmax()) if tokens is None else int(tokens[step])
            fed.append(token)
            logits = model(ForwardBatch.build([SequenceInput((token,), position, (0,), 1)],
                                              16, "cuda"), cache)
            steps.append(logits[-1].float())
    return torch.stack(steps), cache, fed


@needs_gpu
@pytest.mark.parametrize("switch", ["TANDEM_CONV_EPILOGUE", "TANDEM_SILU_EPILOGUE"])
def test_decode_steps_with_an_epilogue_match_the_ops_own_launch(switch, monkeypatch):
    """The tiny Qwen3.5 in int4 on the GPU, a prompt then four decode steps
    on two caches: with the switch on, every GDN layer's decode conv runs in
    in_proj's GEMV (TANDEM_CONV_EPILOGUE), or every layer's MLP activation
    in gate_up's (TANDEM_SILU_EPILOGUE), as recorded; the logits, the
    argmax, the conv windows and the recurrent states agree with the op's
    own launch (the switch at 0) within bf16 rounding."""
    from engine.loader import load_model
    from engine.quant.linear import CONV_EPILOGUE_ENV, SILU_EPILOGUE_ENV

    loaded = load_model("tiny-qwen3.5", device="cuda", weights="int4", progress=False)
    model = loaded.model
    kind, layers = {CONV_EPILOGUE_ENV: (gemv_cuda.ConvEpilogue,
                                        sum(layer.is_linear for layer in model.model.layers)),
                    SILU_EPILOGUE_ENV: (gemv_cuda.SiluMulEpilogue, len(model.model.layers))}[switch]
    other = SILU_EPILOGUE_ENV if switch == CONV_EPILOGUE_ENV else CONV_EPILOGUE_ENV
    monkeypatch.setenv(other, "0")
    epilogues = []
    real = gemv_cuda.gemv_cuda
    monkeypatch.setattr(gemv_cuda, "gemv_cuda",
                        lambda *a, **kw: epilogues.append(kw.get("epilogue")) or real(*a, **kw))

    def decode(on):
        monkeypatch.setenv(switch, on)
        return _prompt_then_four_steps(loaded)[:2]

    apart, cache_apart = decode("0")
    assert not any(epilogues)
    fused, cache_fused = decode("1")
    assert sum(isinstance(e, kind) for e in epilogues) == 4 * layers
    assert all(e is None or isinstance(e, kind) for e in epilogues)
    assert torch.equal(apart.argmax(-1), fused.argmax(-1))
    torch.testing.assert_close(fused, apart, rtol=0.02, atol=0.05 * apart.abs().max().item())
    for w_fused, w_apart in zip(cache_fused.conv, cache_apart.conv):
        torch.testing.assert_close(w_fused, w_apart, rtol=0.02, atol=0.02)
    for s_fused, s_apart in zip(cache_fused.recurrent, cache_apart.recurrent):
        torch.testing.assert_close(s_fused, s_apart, rtol=0.05, atol=0.02)


@needs_gpu
@pytest.mark.parametrize("kind", ["conv", "silu_mul"])
@pytest.mark.parametrize("flush", [1, 8])
def test_a_norm_prologue_and_an_epilogue_in_one_gemv_give_the_three_ops(kind, flush):
    """The layer norm in the prologue and the op after the projection in the
    epilogue of one launch: the stored residual bitwise the norm prologue's
    alone; the output the epilogue's reference of the prologue-only GEMV's
    rows (the same normed row, the same sums) within the output's rounding,
    and the conv windows bit for bit."""
    from engine.fused import reference
    from engine.quant.gemv_cuda import NormPrologue, SiluMulEpilogue

    n, k = 2000, 768
    qt = _quant(n, k, seed=81, device="cuda")
    g = torch.Generator().manual_seed(82)
    x = (torch.randn(1, k, generator=g) * 3).to(torch.bfloat16).cuda()
    pending = torch.randn(1, k, generator=g).to(torch.bfloat16).cuda()
    weight = (torch.randn(k, generator=g) * 0.1).to(torch.bfloat16).cuda()
    plan = plan_for(k, rows=4, flush=flush)

    def norm():
        residual = torch.full((1, k), float("nan"), dtype=torch.bfloat16, device="cuda")
        return NormPrologue(weight, 1e-6, True, pending, residual), residual

    prologue, residual_alone = norm()
    normed_rows = gemv_cuda.gemv_cuda(x, qt, plan=plan, prologue=prologue)
    assert torch.equal(residual_alone, reference.add_rms_norm(x, pending, weight, 1e-6, True)[0])
    prologue, residual = norm()
    if kind == "conv":
        conv, windows = _conv_epilogue(1500, 4, 3, device="cuda", seed=83)
        expected, expected_windows = _conv_reference(normed_rows, conv, windows)
        y = gemv_cuda.gemv_cuda(x, qt, plan=plan, prologue=prologue, epilogue=conv)
        assert torch.equal(y[:, conv.channels:], normed_rows[:, conv.channels:])
        assert torch.equal(windows, expected_windows)
        y = y[:, :conv.channels]
    else:
        expected = reference.silu_mul(normed_rows[:, :n // 2], normed_rows[:, n // 2:])
        y = gemv_cuda.gemv_cuda(x, qt, plan=plan, prologue=prologue, epilogue=SiluMulEpilogue())
    assert torch.equal(residual, residual_alone)
    _assert_close(y, expected.float().cpu())


@needs_gpu
def test_decode_steps_with_the_norm_prologue_and_the_epilogues_match_the_launches(monkeypatch):
    """The tiny Qwen3.5 in int4 on the GPU, a prompt then four decode steps:
    with TANDEM_NORM_PROLOGUE=1 and both epilogues, in_proj and gate_up take
    the layer norm in their prologue and the op after them in their
    epilogue (recorded), and the logits agree with every op in its own
    launch within what int8 activations move: the prologue takes x's codes
    before the norm's rstd, so a code moves here and there, and in this
    model (K = 64: two groups a row) that moves logits as much as int8
    activations themselves do (a CPU emulation with the PyTorch references,
    12-07: 0.98 against 0.42 for float activations, at a largest logit of
    3.3). So the launches with float activations (TANDEM_GEMV_INT8_X=0) set
    the scale: the fused run lies within 3x their distance from the int8
    launches. Every run is fed the int8 launches' tokens, and the argmax
    must match wherever their top two logits are further apart than that."""
    from engine.loader import load_model
    from engine.quant.linear import CONV_EPILOGUE_ENV, NORM_PROLOGUE_ENV, SILU_EPILOGUE_ENV

    loaded = load_model("tiny-qwen3.5", device="cuda", weights="int4", progress=False)
    model = loaded.model
    calls = []
    real = gemv_cuda.gemv_cuda
    monkeypatch.setattr(gemv_cuda, "gemv_cuda", lambda *a, **kw: calls.append(
        (kw.get("prologue"), kw.get("epilogue"))) or real(*a, **kw))

    def decode(on, tokens=None):
        for switch in (NORM_PROLOGUE_ENV, CONV_EPILOGUE_ENV, SILU_EPILOGUE_ENV):
            monkeypatch.setenv(switch, on)
        logits, _, fed = _prompt_then_four_steps(loaded, tokens)
        return logits, fed

    apart, fed = decode("0")
    assert not any(p or e for p, e in calls)
    calls.clear()
    fused, _ = decode("1", tokens=fed)
    both = [(p, e) for p, e in calls if p is not None and e is not None]
    linear = sum(layer.is_linear for layer in model.model.layers)
    assert sum(isinstance(e, gemv_cuda.SiluMulEpilogue) for _, e in both) == \
        4 * len(model.model.layers)   # every gate_up
    assert sum(isinstance(e, gemv_cuda.ConvEpilogue) for _, e in both) == 4 * linear
    monkeypatch.setenv("TANDEM_GEMV_INT8_X", "0")
    float_x, _ = decode("0", tokens=fed)
    atol = 3 * (float_x - apart).abs().max().item()
    assert 0 < atol < apart.abs().max().item()   # int8 moves the logits, a little
    torch.testing.assert_close(fused, apart, rtol=0, atol=atol)
    top2 = apart.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * atol
    assert torch.equal(apart.argmax(-1)[clear], fused.argmax(-1)[clear])


# ------------------------------------------------- the MLP's activation in gate_up's epilogue


def test_the_silu_epilogue_takes_even_tiles_dividing_n_without_a_ring_and_its_switch(
        monkeypatch):
    """Its plans, its switch, and MLP.project on the CPU: the norm then
    gate_up bit for bit, the activation still to launch."""
    from engine.loader import load_model
    from engine.model import norm_then_project
    from engine.quant.gemv_cuda import SiluMulEpilogue
    from engine.quant.linear import SILU_EPILOGUE_ENV

    fits = SiluMulEpilogue.fits
    assert fits(plan_for(5120, rows=4), 34816) and fits(plan_for(5120, rows=2), 6)
    assert not fits(plan_for(5120, rows=1), 34816)            # no pair in a tile
    assert not fits(plan_for(5120, rows=4), 34818)            # a tile past N
    assert not fits(plan_for(5120, rows=4, stages=2), 34816)  # a ring copies contiguous rows
    _assert_on_by_default_and_a_bad_value_named(monkeypatch, SILU_EPILOGUE_ENV)
    layer = load_model("tiny-qwen3.5", weights="int4", progress=False).model.model.layers[0]
    k = layer.mlp.gate_up_proj.quant.in_features
    x, pending = torch.randn(1, k), torch.randn(1, k)
    with torch.inference_mode():
        residual, projected, activated = layer.mlp.project(layer.post_attention_layernorm, x,
                                                           pending)
        expected = norm_then_project(layer.post_attention_layernorm, x, pending,
                                     layer.mlp.gate_up_proj)
        assert not layer.mlp.gate_up_proj.epilogue_applies(x, SiluMulEpilogue())   # the CPU
    assert activated is False
    assert torch.equal(residual, expected[0]) and torch.equal(projected, expected[1])


@needs_gpu
@pytest.mark.parametrize("rows, flush, blocks_per_sm", [(2, 1, 0), (4, 1, 0), (4, 8, 1),
                                                        (8, 4, 1)])
def test_the_silu_epilogue_gives_the_gemv_then_silu_mul(rows, flush, blocks_per_sm):
    """[1, N / 2] from a [gate; up] weight: silu_mul of the plain GEMV's
    gate and up halves within the output's rounding (its exp may move an
    ulp); 3,000 rows at one block an SM walk several tiles a block."""
    from engine.fused import reference
    from engine.quant.gemv_cuda import SiluMulEpilogue

    n, k = 3000, 768
    qt = _quant(n, k, seed=91, device="cuda")
    x = _activation(k, seed=92)
    plan = plan_for(k, rows=rows, flush=flush, blocks_per_sm=blocks_per_sm)
    plain = _run(qt, x, plan)
    out = torch.full((1, n // 2), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = gemv_cuda.gemv_cuda(x, qt, out=out, plan=plan, epilogue=SiluMulEpilogue())
    assert y.data_ptr() == out.data_ptr()
    expected = reference.silu_mul(plain[:, :n // 2], plain[:, n // 2:])
    _assert_close(y, expected.float().cpu())


@needs_gpu
def test_a_silu_epilogue_plan_it_cannot_take_is_refused_given_and_replaced_picked(
        tmp_path, monkeypatch):
    from engine.quant.gemv_cuda import PLANS_ENV, SiluMulEpilogue

    qt = _quant(64, 768, seed=93, device="cuda")
    x = _activation(768, seed=94)
    with pytest.raises(ValueError, match="pairs gate and up rows"):
        gemv_cuda.gemv_cuda(x, qt, plan=plan_for(768, rows=1), epilogue=SiluMulEpilogue())
    path = tmp_path / "plans.json"
    path.write_text(json.dumps({"64,768": plan_for(768, rows=1).spec()}))
    monkeypatch.setenv(PLANS_ENV, str(path))
    y = gemv_cuda.gemv_cuda(x, qt, epilogue=SiluMulEpilogue())   # the file's plan: dropped
    assert torch.equal(y, gemv_cuda.gemv_cuda(x, qt, plan=plan_for(768),
                                              epilogue=SiluMulEpilogue()))


# ------------------------------------------------- reading the next weight ahead into L2


def test_a_read_ahead_takes_the_leading_rows_of_each_aligned_tensor_within_its_budget():
    from engine.quant.gemv_cuda import L2Prefetch

    qt = _quant(300, 512)   # Q4_K-like: codes 256 B a row, sc and m 16, d and dmin 4
    per_row = 256 + 16 + 16 + 4 + 4
    got = L2Prefetch.of(qt, 100 * per_row + 7)
    assert got.rows == 100
    sizes = {t.data_ptr(): size for t, size in got.ranges}
    assert sizes[qt.qweight.data_ptr()] == 100 * 256
    assert sizes[qt.sc.data_ptr()] == sizes[qt.m.data_ptr()] == 1600
    assert sizes[qt.d.data_ptr()] == 400 // 16 * 16   # rounded down to whole 16-byte units
    assert all(size % 16 == 0 for size in sizes.values()) and got.nbytes <= 100 * per_row
    assert L2Prefetch.of(qt, 10 ** 9).rows == 300           # never past the weight
    assert L2Prefetch.of(qt, 1).rows == 1                   # at least one row
    # a range that does not start on 16 bytes is left to the GEMV's own loads
    storage = torch.empty(qt.sc.numel() + 1, dtype=qt.sc.dtype)
    storage[1:] = qt.sc.reshape(-1)
    odd_sc = storage[1:].view(qt.sc.shape)
    got = L2Prefetch.of(QuantTensor(qt.qweight, qt.d, odd_sc, qt.dmin, qt.m), 100 * per_row)
    assert got.rows == 100 and len(got.ranges) == 4
    assert odd_sc.data_ptr() not in {t.data_ptr() for t, _ in got.ranges}


def test_the_read_ahead_parameter_matches_the_kernels_struct():
    """_Regions is passed by value as q4_gemv.cu's L2Regions: the same count
    of ranges, and the C layout (5 pointers, then 5 unsigned, padded to 8)."""
    import ctypes
    import re

    from engine.quant.gemv_cuda import L2_REGIONS, L2Prefetch, _Regions

    source = gemv_cuda.SOURCE.read_text()
    assert int(re.search(r"constexpr int L2_REGIONS = (\d+);", source).group(1)) == L2_REGIONS
    assert ctypes.sizeof(_Regions) == 64 and _Regions.bytes.offset == 8 * L2_REGIONS
    qt = _quant(64, 512)
    regions = L2Prefetch.of(qt, 1 << 20).regions()
    assert list(regions.bytes) == [64 * 256, 64 * 4, 64 * 16, 64 * 4, 64 * 16]
    assert regions.base[0] == qt.qweight.data_ptr()


def test_the_read_ahead_chain_follows_the_order_a_decode_step_calls_the_projections(
        monkeypatch):
    """decode_projections against the calls of a real forward (hooks on
    every projection of the decoder layers), and the chain links each
    QuantLinear to the next without adding anything to the state dict."""
    from engine.batch import ForwardBatch, SequenceInput
    from engine.cache import CacheShape, PagedKVCache
    from engine.kv import make_format
    from engine.loader import load_model
    from engine.quant.linear import QuantLinear, SplitLinear, read_ahead_chain
    from torch import nn

    loaded = load_model("tiny-qwen3.5", weights="q4_k_m", progress=False)
    model = loaded.model
    projections = model.decode_projections()
    assert len(projections) == 4 * len(model.model.layers)
    called = []
    parts = {id(p) for m in model.modules() if isinstance(m, SplitLinear) for p in m.parts}
    hooks = [m.register_forward_hook(lambda module, *_: called.append(module))
             for layer in model.model.layers for m in layer.modules()
             if isinstance(m, (QuantLinear, nn.Linear, SplitLinear)) and id(m) not in parts]
    cache = PagedKVCache(loaded.config, CacheShape(4, 16, 1), "cpu",
                         make_format("bf16", dtype=torch.float32))
    with torch.inference_mode():
        model(ForwardBatch.build([SequenceInput((5, 9, 200), 0, (0,), 0)], 16, "cpu"), cache)
    for hook in hooks:
        hook.remove()
    assert [id(m) for m in called] == [id(m) for m in projections]
    keys = set(model.state_dict())
    quant = [m for m in projections if isinstance(m, QuantLinear)]
    linked = read_ahead_chain(projections, 8 << 20)
    pairs = list(zip(projections, projections[1:]))
    assert linked == sum(isinstance(a, QuantLinear) and isinstance(b, QuantLinear)
                         for a, b in pairs) > 0
    for a, b in pairs:
        if isinstance(a, QuantLinear):
            assert a._read_ahead == ((b, 8 << 20) if isinstance(b, QuantLinear) else None)
    assert not isinstance(projections[-1], QuantLinear) or projections[-1]._read_ahead is None
    assert set(model.state_dict()) == keys      # the link is no child module
    assert read_ahead_chain(projections, 0) == 0
    assert all(m._read_ahead is None for m in quant)


def test_the_read_ahead_switch_names_itself_and_reads_4mb_ahead_by_default(monkeypatch):
    from engine.loader import load_model
    from engine.quant.linear import L2_PREFETCH_ENV, QuantLinear, adopt_read_ahead

    model = load_model("tiny-qwen3.5", weights="q4_k_m", progress=False).model
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    monkeypatch.delenv(L2_PREFETCH_ENV, raising=False)
    assert adopt_read_ahead(model) > 0
    assert {m._read_ahead[1] for m in quant if m._read_ahead is not None} == {4 << 20}
    monkeypatch.setenv(L2_PREFETCH_ENV, "0")
    assert adopt_read_ahead(model) == 0
    assert all(m._read_ahead is None for m in quant)
    monkeypatch.setenv(L2_PREFETCH_ENV, "12")
    with pytest.raises(ValueError, match=L2_PREFETCH_ENV):
        adopt_read_ahead(model)
    monkeypatch.setenv(L2_PREFETCH_ENV, "16")
    assert adopt_read_ahead(model) > 0


@needs_gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_a_gemv_that_reads_the_next_weight_ahead_gives_the_same_bits(pdl):
    """The read-ahead only warms L2: the output is bitwise the plain GEMV's,
    eager and in a graph where the weight it read ahead is the next GEMV's."""
    from engine.quant.gemv_cuda import L2Prefetch

    a = _quant(1024, 2048, seed=21, device="cuda")
    b = _quant(512, 1024, seed=22, device="cuda")
    x = _activation(2048, seed=23)
    plan_a, plan_b = plan_for(2048), plan_for(1024)
    plain = _run(a, x, plan_a, pdl=pdl)
    ahead = gemv_cuda.gemv_cuda(x, a, plan=plan_a, pdl=pdl,
                                l2_prefetch=L2Prefetch.of(b, 1 << 20))
    assert torch.equal(ahead, plain)
    mid = torch.full((1, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = torch.full((1, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv_cuda.gemv_cuda(x, a, out=mid, plan=plan_a, pdl=pdl,
                            l2_prefetch=L2Prefetch.of(b, 256 << 10))
        gemv_cuda.gemv_cuda(mid, b, out=out, plan=plan_b, pdl=pdl)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(mid, plain)
    assert torch.equal(out, _run(b, plain, plan_b, pdl=pdl))


@needs_gpu
def test_the_model_with_read_ahead_decodes_the_same_logits(monkeypatch):
    """TANDEM_GEMV_L2_PREFETCH_MB links the loaded int4 model's projections;
    its decode step's logits are bitwise those of the model without."""
    from engine.batch import ForwardBatch, SequenceInput
    from engine.cache import CacheShape, PagedKVCache
    from engine.kv import make_format
    from engine.loader import load_model
    from engine.quant.linear import L2_PREFETCH_ENV, read_ahead_chain

    monkeypatch.setenv(L2_PREFETCH_ENV, "8")
    loaded = load_model("tiny-qwen3.5", device="cuda", weights="int4", progress=False)
    model = loaded.model
    linked = [m for m in model.decode_projections() if getattr(m, "_read_ahead", None)]
    assert linked

    def step():
        cache = PagedKVCache(loaded.config, CacheShape(4, 16, 1), "cuda",
                             make_format("bf16", dtype=torch.bfloat16))
        with torch.inference_mode():
            model(ForwardBatch.build([SequenceInput((5, 9, 200), 0, (0,), 0)], 16, "cuda"),
                  cache)
            return model(ForwardBatch.build([SequenceInput((7,), 3, (0,), 0)], 16, "cuda"),
                         cache)

    ahead = step()
    read_ahead_chain(model.decode_projections(), 0)
    assert torch.equal(step(), ahead)


@pytest.mark.parametrize("local_bytes, ok", [(0, True), (8, True), (16, True), (24, False),
                                             (100, False), (244, False)])
def test_a_small_stack_frame_launches_and_a_spill_does_not(local_bytes, ok):
    """8 bytes: the stack frame ptxas gives 2 rows at 64 threads (K = 1056),
    no spill, refused on the H200 on 12-05; 100 and 244: down's 8-row build
    without and with flush, real spills."""
    assert gemv_cuda.launchable(local_bytes) is ok


# ------------------------------------------- the next tiles into L2 before the wait


def test_the_early_l2_tiles_switch_is_one_by_default_and_names_a_bad_value(monkeypatch):
    monkeypatch.delenv(gemv_cuda.EARLY_L2_TILES_ENV, raising=False)
    assert gemv_cuda.early_l2_tiles() == 1
    monkeypatch.setenv(gemv_cuda.EARLY_L2_TILES_ENV, "2")
    assert gemv_cuda.early_l2_tiles() == 2
    monkeypatch.setenv(gemv_cuda.EARLY_L2_TILES_ENV, "9")
    with pytest.raises(ValueError, match=gemv_cuda.EARLY_L2_TILES_ENV):
        gemv_cuda.early_l2_tiles()


@needs_gpu
@pytest.mark.parametrize("n, k, rows, blocks_per_sm", [(5120, 6144, 4, 0), (3001, 768, 1, 1),
                                                       (2000, 1280, 2, 1)])
def test_tiles_asked_of_l2_before_the_wait_change_no_bit(n, k, rows, blocks_per_sm,
                                                         monkeypatch):
    """A prefetch binds no value: the GEMV with each block's next two tiles
    asked of L2 before the wait is bitwise the one without, over grids of
    several tiles a block, a last tile past N and scale arrays whose tile
    ranges start off 16-byte boundaries (the prefetch takes their whole
    16-byte units only)."""
    qt = _quant(n, k, seed=n, device="cuda")
    x = _activation(k, seed=k)
    plan = plan_for(k, rows=rows, blocks_per_sm=blocks_per_sm)
    monkeypatch.setenv(gemv_cuda.EARLY_L2_TILES_ENV, "0")
    plain = _run(qt, x, plan, pdl=True)
    monkeypatch.setenv(gemv_cuda.EARLY_L2_TILES_ENV, "2")
    early = _run(qt, x, plan, pdl=True)
    monkeypatch.setenv(gemv_cuda.EARLY_L2_TILES_ENV, "0")
    own = _run(qt, x, plan_for(k, rows=rows, blocks_per_sm=blocks_per_sm, early_tiles=4),
               pdl=True)   # the plan's count, past the last tile of most blocks
    torch.cuda.synchronize()
    assert torch.equal(early, plain) and torch.equal(own, plain)


@needs_gpu
@pytest.mark.parametrize("rows, blocks_per_sm", [(2, 1), (4, 1), (8, 0)])
def test_silu_epilogue_tiles_asked_of_l2_before_the_wait_change_no_bit(rows, blocks_per_sm,
                                                                       monkeypatch):
    """gate_up's tile is two ranges (its gate rows and the up rows N / 2
    further on): asking both of L2 before the wait binds no value either,
    so the epilogue's output is bitwise the one without."""
    from engine.quant.gemv_cuda import SiluMulEpilogue

    n, k = 3000, 768
    qt = _quant(n, k, seed=93, device="cuda")
    x = _activation(k, seed=94)
    plan = plan_for(k, rows=rows, blocks_per_sm=blocks_per_sm)

    def activated() -> torch.Tensor:
        out = torch.full((1, n // 2), float("nan"), dtype=torch.bfloat16, device="cuda")
        return gemv_cuda.gemv_cuda(x, qt, out=out, plan=plan, pdl=True,
                                   epilogue=SiluMulEpilogue()).cpu()

    monkeypatch.setenv(gemv_cuda.EARLY_L2_TILES_ENV, "0")
    plain = activated()
    monkeypatch.setenv(gemv_cuda.EARLY_L2_TILES_ENV, "2")
    early = activated()
    assert not plain.isnan().any()
    assert torch.equal(early, plain)
