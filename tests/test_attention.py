"""Paged attention kernels (engine/kv/attention_kernels.py) against the PyTorch
reference (engine/kv/attention.py), which is SDPA over the formats' reference
reads.

Runs on the CPU with the Triton interpreter; on a CUDA machine with
TRITON_INTERPRET=0 the same tests run the compiled kernels on the GPU (with
tf32 tensor-core dots, hence the wider GPU tolerances).
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import dataclasses  # noqa: E402
import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.kv import formats as F  # noqa: E402
from engine.kv.attention import (AttentionMetadata, paged_attention,  # noqa: E402
                                 paged_attention_reference, paged_attention_triton)
from engine.kv.formats import make_format  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton not installed")

FORMATS = [
    ("bf16", dict(dtype=torch.float32)),
    ("bf16", dict(dtype=torch.bfloat16)),
    ("int8", {}),
    ("rk4", {}),  # fp16 scales, block 32
    ("rk4", dict(scale_format="e8m0", block=16)),
]
FORMAT_IDS = ["f32", "bf16", "int8", "rk4", "rk4-e8m0-16"]


def build_case(fmt, seqs, q_heads, kv_heads, head_dim, page_size, q_dtype, seed):
    """Pages filled for `seqs` [(cached, new)], shuffled page tables and spare
    pages holding other data; returns (buffers, q, meta)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // page_size) for c, n in seqs]
    num_pages = 2 * sum(need) + 3
    buffers = fmt.allocate(num_pages, page_size, kv_heads, head_dim, DEVICE)
    # every slot holds something (also pages no sequence uses), so a wrong
    # page lookup reads wrong data, not zeros
    every = torch.arange(num_pages * page_size, device=DEVICE)
    kv = torch.randn(2, every.numel(), kv_heads, head_dim, generator=g).to(DEVICE)
    kv[0, :, :, :2] *= 6.0  # a few outlier channels in K, as in real models
    fmt.write(buffers, every, kv[0], kv[1], use_triton=False)
    order = torch.randperm(num_pages, generator=g)
    tables, used = [], 0
    for pages in need:
        tables.append(order[used:used + pages].to(DEVICE))
        used += pages
    offsets = [0]
    for _, n in seqs:
        offsets.append(offsets[-1] + n)
    q = torch.randn(offsets[-1], q_heads, head_dim, generator=g).to(DEVICE, q_dtype)
    meta = AttentionMetadata.build(offsets, [c + n for c, n in seqs], tables, DEVICE)
    return buffers, q, meta


def tolerance(q_dtype):
    if q_dtype == torch.bfloat16:
        return dict(rtol=2e-2, atol=2e-2)
    # the GPU's dots run in tf32 (10-bit mantissa) on logits up to ~10 here
    return dict(rtol=1e-4, atol=1e-4) if DEVICE == "cpu" else dict(rtol=2e-2, atol=2e-2)


def run_both(fmt, buffers, q, meta, num_splits=None):
    scale = q.shape[-1] ** -0.5
    expected = paged_attention_reference(fmt, buffers, q.float(), meta, scale)
    actual = paged_attention_triton(fmt, buffers, q, meta, scale, num_splits=num_splits)
    return actual, expected


@pytest.mark.parametrize("name, options", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("page_size", [16, 32])
def test_decode_matches_reference(name, options, page_size):
    fmt = make_format(name, **options)
    # ragged contexts: inside the first page, at a page boundary, a few pages
    seqs = [(4, 1), (page_size - 1, 1), (2 * page_size + 5, 1), (47, 1)]
    buffers, q, meta = build_case(fmt, seqs, q_heads=6, kv_heads=2, head_dim=32,
                                  page_size=page_size, q_dtype=torch.float32, seed=page_size)
    for splits in (1, 3):  # 3 leaves some splits empty for the short sequences
        actual, expected = run_both(fmt, buffers, q, meta, num_splits=splits)
        assert not actual.isnan().any()
        torch.testing.assert_close(actual, expected, **tolerance(torch.float32))


@pytest.mark.parametrize("options", [{}, dict(scale_format="e8m0", block=16)],
                         ids=["fp16", "e8m0-16"])
def test_rk4_decode_with_a_padded_head_dim_matches_reference(options):
    """head_dim 96 pads to 128 channels in the kernel: rk4's nibble pairs and
    per-block scales past the real channels must stay masked."""
    fmt = make_format("rk4", **options)
    buffers, q, meta = build_case(fmt, [(4, 1), (37, 1)], q_heads=4, kv_heads=2, head_dim=96,
                                  page_size=16, q_dtype=torch.float32, seed=3)
    actual, expected = run_both(fmt, buffers, q, meta, num_splits=2)
    assert not actual.isnan().any()
    torch.testing.assert_close(actual, expected, **tolerance(torch.float32))


def test_decode_and_verify_share_key_tiles_at_head_dim_256(monkeypatch):
    """64-key tiles for decode and verify at the 27B's head_dim (rk4p's wide
    tiles keep 32); a prefill chunk keeps its own."""
    from engine.kv.attention import tiles_for

    monkeypatch.delenv("TANDEM_DECODE_BLOCK_N", raising=False)
    int8, rk4p = make_format("int8"), make_format("rk4p")
    for fmt, keys in ((int8, 64), (rk4p, 32)):
        decode = tiles_for(256, 6, decode=True, on_gpu=True, fmt=fmt)
        verify = tiles_for(256, 6, decode=False, on_gpu=True, fmt=fmt, new_tokens=4)
        assert decode.block_n == verify.block_n == keys
    chunk = tiles_for(256, 6, decode=False, on_gpu=True, fmt=int8, q_dtype=torch.float32,
                      new_tokens=512)
    assert chunk.block_n == 32


@pytest.mark.parametrize("block_n", [32, 64])
def test_decode_with_wider_key_tiles_matches_reference(block_n, monkeypatch):
    """TANDEM_DECODE_BLOCK_N (the A/B of decode's key tiles): tiles of 64 keys
    span four 16-token pages, a context that ends inside one; the override
    reaches tiles_for's decode tiles and rejects sizes it has no tiles for."""
    from engine.kv.attention import Tiles, tiles_for

    monkeypatch.setenv("TANDEM_DECODE_BLOCK_N", str(block_n))
    assert tiles_for(256, 6, decode=True, on_gpu=True).block_n == block_n
    # a verify batch takes decode's key tiles (the same sums: speculative parity)
    assert tiles_for(256, 6, decode=False, on_gpu=True, new_tokens=4).block_n == block_n
    fmt = make_format("int8")
    seqs = [(5, 1), (70, 1), (200, 1)]
    buffers, q, meta = build_case(fmt, seqs, q_heads=6, kv_heads=2, head_dim=32,
                                  page_size=16, q_dtype=torch.float32, seed=block_n)
    scale = q.shape[-1] ** -0.5
    expected = paged_attention_reference(fmt, buffers, q.float(), meta, scale)
    for splits in (1, 2):
        actual = paged_attention_triton(fmt, buffers, q, meta, scale, num_splits=splits,
                                        tiles=Tiles(rows=16, block_n=block_n, num_warps=4))
        assert not actual.isnan().any()
        torch.testing.assert_close(actual, expected, **tolerance(torch.float32))
    monkeypatch.setenv("TANDEM_DECODE_BLOCK_N", "48")
    with pytest.raises(ValueError, match="16, 32, 64 or 128"):
        tiles_for(256, 6, decode=True, on_gpu=True)


def test_verify_width_queries_with_key_splits():
    """Speculative verify graphs (engine/cuda_graphs.py VerifyForward) split the
    keys of multi-token queries as decode does: causal rows whose later splits
    see no key must still combine to the reference."""
    fmt = make_format("int8")
    seqs = [(20, 4), (47, 4), (3, 3)]
    buffers, q, meta = build_case(fmt, seqs, q_heads=6, kv_heads=2, head_dim=32, page_size=16,
                                  q_dtype=torch.float32, seed=7)
    actual, expected = run_both(fmt, buffers, q, meta, num_splits=3)
    assert not actual.isnan().any()
    torch.testing.assert_close(actual, expected, **tolerance(torch.float32))


@pytest.mark.parametrize("q_heads, kv_heads", [(4, 4), (4, 1), (8, 2)])
def test_decode_gqa_ratios_and_bf16_queries(q_heads, kv_heads):
    fmt = make_format("int8")
    seqs = [(20, 1), (37, 1), (3, 1)]
    buffers, q, meta = build_case(fmt, seqs, q_heads, kv_heads, head_dim=64, page_size=16,
                                  q_dtype=torch.bfloat16, seed=q_heads * 10 + kv_heads)
    actual, expected = run_both(fmt, buffers, q, meta)
    assert actual.dtype == torch.bfloat16 and not actual.isnan().any()
    torch.testing.assert_close(actual.float(), expected, **tolerance(torch.bfloat16))


@pytest.mark.parametrize("name, options", FORMATS, ids=FORMAT_IDS)
def test_prefill_over_cached_prefix_matches_reference(name, options):
    fmt = make_format(name, **options)
    # a fresh prompt, a chunk after a cached prefix, a decode row in the same
    # batch, and a chunk that ends mid-page: causal masks inside each chunk
    seqs = [(0, 21), (35, 12), (18, 1), (16, 9)]
    buffers, q, meta = build_case(fmt, seqs, q_heads=6, kv_heads=3, head_dim=32,
                                  page_size=16, q_dtype=torch.float32, seed=99)
    actual, expected = run_both(fmt, buffers, q, meta)
    assert not actual.isnan().any()
    torch.testing.assert_close(actual, expected, **tolerance(torch.float32))


@pytest.mark.parametrize("name, options", FORMATS[1:4], ids=FORMAT_IDS[1:4])
def test_prefill_with_bf16_dot_operands_matches_reference(name, options):
    """Tiles.dot_bf16 (the prefill's fast dots): K, P and V rounded to bf16
    before the dots, fp32 softmax; within bf16 tolerance of the reference."""
    from engine.kv.attention import Tiles

    fmt = make_format(name, **options)
    seqs = [(0, 21), (35, 12), (18, 1)]
    buffers, q, meta = build_case(fmt, seqs, q_heads=6, kv_heads=3, head_dim=32,
                                  page_size=16, q_dtype=torch.bfloat16, seed=31)
    scale = q.shape[-1] ** -0.5
    expected = paged_attention_reference(fmt, buffers, q.float(), meta, scale)
    tiles = Tiles(rows=16, block_n=16, dot_bf16=True) if DEVICE == "cpu" else \
        Tiles(rows=64, block_n=32, num_warps=4, dot_bf16=True)
    actual = paged_attention_triton(fmt, buffers, q, meta, scale, tiles=tiles)
    assert actual.dtype == torch.bfloat16 and not actual.isnan().any()
    # P and V each rounded to 8 bits of mantissa, on top of the bf16 output
    torch.testing.assert_close(actual.float(), expected, rtol=4e-2, atol=4e-2)
    assert (actual.float() - expected).abs().mean() < 4e-3


@pytest.mark.parametrize("name, options", FORMATS[2:4], ids=FORMAT_IDS[2:4])
def test_decode_and_verify_with_bf16_dots_match_reference(name, options, monkeypatch):
    """Decode's bf16 dot operands (TANDEM_DECODE_DOT_BF16, on unless 0):
    decode and verify tiles both take them (speculative parity needs the same sums),
    and a decode and a verify batch at the 27B's head_dim and GQA group stay
    within bf16 tolerance of the reference; on a GPU through tiles_for's own
    tiles."""
    from engine.kv.attention import Tiles, tiles_for

    fmt = make_format(name, **options)
    monkeypatch.delenv("TANDEM_DECODE_DOT_BF16", raising=False)
    assert tiles_for(256, 6, decode=True, on_gpu=True, fmt=fmt).dot_bf16
    assert tiles_for(256, 6, decode=False, on_gpu=True, fmt=fmt, new_tokens=4).dot_bf16
    # rk4 decode at head_dim 256: 4 warps with bf16 operands, 8 with fp32 ones
    # (which spilled on 4: tests/test_kernel_stacks.py compiles the default)
    warps = {"int8": (4, 4), "rk4": (4, 8)}[name]
    assert tiles_for(256, 6, decode=True, on_gpu=True, fmt=fmt).num_warps == warps[0]
    monkeypatch.setenv("TANDEM_DECODE_DOT_BF16", "0")
    decode_fp32 = tiles_for(256, 6, decode=True, on_gpu=True, fmt=fmt)
    assert not decode_fp32.dot_bf16 and decode_fp32.num_warps == warps[1]
    monkeypatch.setenv("TANDEM_DECODE_DOT_BF16", "1")
    for seqs in ([(70, 1), (200, 1)], [(70, 4), (131, 3)]):
        buffers, q, meta = build_case(fmt, seqs, q_heads=12, kv_heads=2, head_dim=256,
                                      page_size=16, q_dtype=torch.bfloat16, seed=len(seqs))
        scale = q.shape[-1] ** -0.5
        expected = paged_attention_reference(fmt, buffers, q.float(), meta, scale)
        tiles = Tiles(rows=16, block_n=16, dot_bf16=True) if DEVICE == "cpu" else None
        actual = paged_attention_triton(fmt, buffers, q, meta, scale, tiles=tiles)
        assert not actual.isnan().any()
        torch.testing.assert_close(actual.float(), expected, rtol=4e-2, atol=4e-2)
        assert (actual.float() - expected).abs().mean() < 4e-3


def test_prefill_key_splits_fill_the_last_wave_of_programs():
    """The H200 case the policy was measured on (27B, 1,100 queries x 100K
    keys: 208 programs on 132 SMs) splits; 2K and 4K chunks' programs
    already fill their waves, and a short context keeps each split's work
    large."""
    from engine.kv.attention import (PREFILL_KEY_SPLITS, PREFILL_MIN_TILES_PER_SPLIT,
                                     prefill_key_splits)

    assert PREFILL_KEY_SPLITS > 1
    assert prefill_key_splits(208, 100_000, 64, 132) == PREFILL_KEY_SPLITS
    assert prefill_key_splits(768, 100_000, 64, 132) == 1  # 4,096 queries
    assert prefill_key_splits(384, 100_000, 64, 132) == 1  # 2,048: 2.9 full waves
    assert prefill_key_splits(48, 100_000, 64, 132) == PREFILL_KEY_SPLITS  # a third of the SMs
    shortest = PREFILL_KEY_SPLITS * PREFILL_MIN_TILES_PER_SPLIT * 64
    assert prefill_key_splits(208, shortest, 64, 132) == PREFILL_KEY_SPLITS
    assert prefill_key_splits(208, shortest - 1, 64, 132) == 1


@pytest.mark.parametrize("name, options", FORMATS[1:4], ids=FORMAT_IDS[1:4])
def test_a_short_prefill_over_a_long_context_splits_its_keys(name, options, monkeypatch):
    """A prefill chunk whose programs leave the last wave part-empty runs
    with its keys split (attention.prefill_key_splits) and combines to the
    reference, on the fast bf16 dots."""
    from engine.kv import attention_kernels as K
    from engine.kv.attention import PREFILL_KEY_SPLITS

    splits_seen = []
    real_launch = K.launch

    def recording(*args, **kwargs):
        splits_seen.append(args[10])
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(K, "launch", recording)
    fmt = make_format(name, **options)
    # interpreter tiles (16 keys): 8 splits of 8 tiles need 1,024 keys;
    # a second sequence ends inside the first split only
    seqs = [(1030, 24), (40, 20)]
    buffers, q, meta = build_case(fmt, seqs, q_heads=4, kv_heads=2, head_dim=32,
                                  page_size=16, q_dtype=torch.bfloat16, seed=41)
    actual, expected = run_both(fmt, buffers, q, meta)
    assert DEVICE != "cpu" or splits_seen == [PREFILL_KEY_SPLITS]
    assert actual.dtype == torch.bfloat16 and not actual.isnan().any()
    torch.testing.assert_close(actual.float(), expected, rtol=4e-2, atol=4e-2)


def test_kernel_writes_every_output_row_and_reads_only_its_pages():
    fmt = make_format("int8")
    seqs = [(9, 1), (30, 1)]
    buffers, q, meta = build_case(fmt, seqs, q_heads=4, kv_heads=2, head_dim=32, page_size=16,
                                  q_dtype=torch.float32, seed=5)
    # poison every page that no sequence's table names: a stray read shows up
    named = torch.cat(meta.page_tables).cpu()
    unused = torch.tensor([p for p in range(buffers["k_scales"].shape[0])
                           if p not in set(named.tolist())])
    for key in ("k_scales", "v_scales"):
        buffers[key][unused.to(DEVICE)] = float("nan")
    from engine.kv import attention_kernels as K
    out = torch.full_like(q, float("nan"))
    kind_args = (K.INT8, buffers["k_codes"], buffers["k_scales"], buffers["v_codes"],
                 buffers["v_scales"], 1, False)
    K.launch(kind_args, q, meta.q_offsets, meta.kv_lens, meta.page_table, 16, 2, 1,
             32 ** -0.5, out, 2, 16, 16)
    assert not out.isnan().any()
    expected = paged_attention_reference(fmt, buffers, q, meta, 32 ** -0.5)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))


@pytest.mark.parametrize("name,kwargs", [FORMATS[0], FORMATS[1], FORMATS[2], FORMATS[3]],
                         ids=FORMAT_IDS[:4])
@pytest.mark.parametrize("seqs", [[(40, 1)], [(21, 4), (3, 2)]], ids=["decode", "verify"])
def test_the_split_combine_gates_as_the_separate_gate_does(name, kwargs, seqs, monkeypatch):
    """The gated attention's output gate in the split combine (rk4's rotated
    output back in the same combine) against the ungated kernel path then
    engine/fused's gate kernel: to an ulp of the dtype (the same rounding
    steps; the fp32 sums of two kernels may round otherwise), bf16 almost
    all bitwise on the GPU; every output row written (NaN-poisoned);
    one split or the switch off gate after the kernel, to the same bits."""
    from engine import fused
    from engine.kv import attention as A
    from engine.kv import attention_kernels as K

    monkeypatch.setattr(fused, "_FORCE_ON_CPU", True)
    fmt = make_format(name, **kwargs)
    q_dtype = torch.float32 if kwargs.get("dtype") == torch.float32 else torch.bfloat16
    buffers, q, meta = build_case(fmt, seqs, q_heads=4, kv_heads=2, head_dim=32,
                                  page_size=16, q_dtype=q_dtype, seed=11)
    g = torch.Generator().manual_seed(12)
    # the gate as the model has it: the second half of each head's [query | gate]
    projected = (torch.randn(q.shape[0], 4, 64, generator=g) * 3).to(DEVICE, q_dtype)
    gate = projected[..., 32:]
    real_kernel_output = A.kernel_output
    monkeypatch.setattr(A, "kernel_output", lambda *a: real_kernel_output(*a).fill_(float("nan")))
    launched = []
    real_launch = K.launch
    # launch's last argument: the gate its combine applies, or None
    monkeypatch.setattr(K, "launch", lambda *a, **k: launched.append(a[-1]) or
                        real_launch(*a, **k))
    scale = 32 ** -0.5
    apart = A.gated_output(paged_attention_triton(fmt, buffers, q, meta, scale, num_splits=2),
                           gate)
    fused_gate = paged_attention_triton(fmt, buffers, q, meta, scale, num_splits=2,
                                        output_gate=gate)
    # the combine took it, unless rk4's rotation back runs after the combine
    in_combine = not isinstance(fmt, F.RotatedInt4Format) or fmt.rotates_in_kernels(q, "combine")
    assert (launched[-1] is gate) == in_combine
    assert fused_gate.dtype == q_dtype and not fused_gate.isnan().any()
    rtol = 2 ** -7 if q_dtype == torch.bfloat16 else 2 ** -20  # an ulp of the dtype
    torch.testing.assert_close(fused_gate.float(), apart.float(), rtol=rtol, atol=1e-6)
    if DEVICE == "cuda" and q_dtype == torch.bfloat16:
        # fp32 sums may contract otherwise in the two kernels (fp32 ulps); a
        # bf16 store tips on one only rarely (none in this case on an H100)
        assert (fused_gate != apart).float().mean() <= 0.01
    one_split = paged_attention_triton(fmt, buffers, q, meta, scale, num_splits=1,
                                       output_gate=gate)
    assert launched[-1] is None
    ungated_one = paged_attention_triton(fmt, buffers, q, meta, scale, num_splits=1)
    assert torch.equal(one_split, A.gated_output(ungated_one, gate))
    monkeypatch.setenv(A.COMBINE_GATE_ENV, "0")
    switched_off = paged_attention_triton(fmt, buffers, q, meta, scale, num_splits=2,
                                          output_gate=gate)
    assert launched[-1] is None and torch.equal(switched_off, apart)


def test_the_combine_refuses_a_gate_it_cannot_apply():
    from engine.kv import attention_kernels as K

    out = torch.zeros(2, 4, 32)
    assert K.gate_refusal(out.clone(), out, 2) == ""
    assert "num_splits > 1" in K.gate_refusal(out.clone(), out, 1)
    assert "must be (2, 4, 32) torch.float32" in K.gate_refusal(
        torch.zeros(2, 4, 64)[..., ::2], out, 2)
    fmt = make_format("bf16", dtype=torch.float32)
    buffers, q, meta = build_case(fmt, [(5, 1)], q_heads=4, kv_heads=2, head_dim=32,
                                  page_size=16, q_dtype=torch.float32, seed=1)
    from engine.kv.attention import _kind_args
    kind_args = _kind_args(fmt, buffers)
    with pytest.raises(ValueError, match="num_splits > 1"):  # launch refuses, says why
        K.launch(kind_args, q, meta.q_offsets, meta.kv_lens, meta.page_table, 16, 2, 1,
                 32 ** -0.5, torch.empty_like(q), 1, 16, 16, output_gate=q.clone())


def test_dispatch_uses_the_reference_on_cpu_tensors_unless_forced():
    fmt = make_format("bf16", dtype=torch.float32)
    buffers, q, meta = build_case(fmt, [(5, 3)], q_heads=2, kv_heads=1, head_dim=32,
                                  page_size=16, q_dtype=torch.float32, seed=1)
    scale = 32 ** -0.5
    reference = paged_attention_reference(fmt, buffers, q, meta, scale)
    if DEVICE == "cpu":
        assert torch.equal(paged_attention(fmt, buffers, q, meta, scale), reference)
    forced = paged_attention(fmt, buffers, q, meta, scale, use_triton=True)
    torch.testing.assert_close(forced, reference, **tolerance(torch.float32))


def test_metadata_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="do not match"):
        AttentionMetadata.build([0, 1], [1, 2], [torch.tensor([0])], "cpu")


@pytest.mark.parametrize("name", ["int8", "rk4"])
def test_model_forward_with_kernels_matches_reference_path(name):
    """tiny-qwen3.5 (gated attention, GQA, partial rotary): a prefill in two
    chunks over two sequences, then batched decode steps, through the kernels
    and through the reference; the logits agree to fp32 rounding."""
    from engine.batch import ForwardBatch, SequenceInput
    from engine.cache import CacheShape, PagedKVCache
    from engine.loader import load_model

    loaded = load_model("tiny-qwen3.5", device=DEVICE, dtype=torch.float32, seed=4)
    ids = [[(7 * i + 3) % 512 for i in range(29)], [(5 * i + 1) % 512 for i in range(18)]]
    tables = [tuple(range(0, 5))[::-1], tuple(range(5, 10))]
    logits = {}
    for use_triton in (False, True):
        cache = PagedKVCache(loaded.config, CacheShape(12, 8, 2), DEVICE,
                             make_format(name, use_triton=use_triton))
        steps = [[SequenceInput(tuple(ids[0][:13]), 0, tables[0], 0),
                  SequenceInput(tuple(ids[1][:17]), 0, tables[1], 1)],
                 [SequenceInput(tuple(ids[0][13:28]), 13, tables[0], 0),
                  SequenceInput((ids[1][17],), 17, tables[1], 1)],
                 [SequenceInput((ids[0][28],), 28, tables[0], 0),
                  SequenceInput((ids[1][0],), 18, tables[1], 1)]]
        logits[use_triton] = torch.cat([
            loaded.model(ForwardBatch.build(step, 8, DEVICE), cache, all_logits=True)
            for step in steps])
    assert not logits[True].isnan().any()
    torch.testing.assert_close(logits[True], logits[False], **tolerance(torch.float32))


def _poisoned_workspace(shape, device):
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)


def _run_dense_prefill(monkeypatch, fmt, buffers, q, meta, rotary=None):
    """paged_attention's dispatch on a bf16 prefill chunk, with the workspace
    NaN-poisoned and reads in one-page slices; returns (output, dense calls)."""
    from engine.kv import attention

    calls = []
    dense = attention.dense_prefill_attention
    monkeypatch.setattr(attention, "workspace", _poisoned_workspace)
    monkeypatch.setattr(attention, "DENSE_READ_SLICE_TOKENS", 1)
    monkeypatch.setattr(attention, "dense_prefill_attention",
                        lambda *a, **kw: calls.append(1) or dense(*a, **kw))
    scale = q.shape[-1] ** -0.5
    out = paged_attention(fmt, buffers, q, meta, scale, use_triton=True, rotary=rotary)
    return out, len(calls)


@pytest.mark.parametrize("name, options", FORMATS[2:], ids=FORMAT_IDS[2:])
def test_dense_prefill_chunks_match_reference(name, options, monkeypatch):
    """Prefill chunks over quantized pages go through the bf16 workspace (the
    padding between sequences left NaN) and the bf16-page kernel, within
    bf16 tolerance of the reference; TANDEM_PREFILL_ATTENTION=paged keeps
    the in-kernel dequantization."""
    fmt = make_format(name, **options)
    seqs = [(0, 21), (35, 20), (18, 1)]  # 21 new tokens > PREFILL_DOT_BF16_FROM
    buffers, q, meta = build_case(fmt, seqs, q_heads=6, kv_heads=3, head_dim=32,
                                  page_size=16, q_dtype=torch.bfloat16, seed=41)
    expected = paged_attention_reference(fmt, buffers, q.float(), meta, q.shape[-1] ** -0.5)
    actual, dense_calls = _run_dense_prefill(monkeypatch, fmt, buffers, q, meta)
    assert dense_calls == 1 and actual.dtype == torch.bfloat16 and not actual.isnan().any()
    torch.testing.assert_close(actual.float(), expected, rtol=4e-2, atol=4e-2)
    assert (actual.float() - expected).abs().mean() < 4e-3
    monkeypatch.setenv("TANDEM_PREFILL_ATTENTION", "paged")
    assert _run_dense_prefill(monkeypatch, fmt, buffers, q, meta)[1] == 0


def test_dense_prefill_over_rk4p_pages_applies_rope_to_keys(monkeypatch):
    """rk4p stores K before RoPE and keeps staging pages in bf16: the
    workspace gets the keys rotated at their positions, slice by slice."""
    from tests.test_attention_rk4p import build_case as build_rk4p_case
    from tests.test_attention_rk4p import rotary_of

    fmt, buffers, q, meta = build_rk4p_case([(40, 24), (70, 17)], q_heads=4, kv_heads=2,
                                            head_dim=32, staged_pages=1, seed=5, sink=True)
    q = q.to(torch.bfloat16)
    rotary = rotary_of(32, 16)
    expected = paged_attention_reference(fmt, buffers, q.float(), meta, 32 ** -0.5,
                                         rotary=rotary)
    actual, dense_calls = _run_dense_prefill(monkeypatch, fmt, buffers, q, meta, rotary)
    assert dense_calls == 1 and not actual.isnan().any()
    torch.testing.assert_close(actual.float(), expected, rtol=4e-2, atol=4e-2)
    assert (actual.float() - expected).abs().mean() < 4e-3


@pytest.mark.parametrize("name, options", FORMATS[2:], ids=FORMAT_IDS[2:])
def test_reads_into_the_workspace_match_the_dense_reads(name, options):
    """read_rotated_into (the dense prefill's dequantization): the Triton read
    writes the NaN-poisoned bf16 outputs in place, equal to read_rotated."""
    fmt = make_format(name, **options)
    buffers, _, meta = build_case(fmt, [(37, 1)], q_heads=2, kv_heads=2, head_dim=32,
                                  page_size=16, q_dtype=torch.bfloat16, seed=8)
    table = meta.page_tables[0]
    k = torch.full((38, 2, 32), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    v = torch.full_like(k, float("nan"))
    fmt.read_rotated_into(buffers, table, 38, k, v, use_triton=True)
    k_ref, v_ref = fmt.read_rotated(buffers, table, 38, torch.float32, use_triton=False)
    torch.testing.assert_close(k.float(), k_ref, rtol=2 ** -8, atol=1e-6)
    torch.testing.assert_close(v.float(), v_ref, rtol=2 ** -8, atol=1e-6)


# rk4 on channel-pair tiles (TANDEM_RK4_PAIRS) and int8 codes made fp32
# without I2F (TANDEM_INT8_NO_I2F): each switch's two sides, at a small head
# and at the 27B's (head_dim 256, GQA group 6, bf16 queries and dots)
NO_I2F_FORMATS = [("rk4", {}), ("rk4", dict(scale_format="e8m0", block=16)), ("int8", {})]
NO_I2F_IDS = ["rk4", "rk4-e8m0-16", "int8"]
NO_I2F_SWITCHES = {"rk4": "TANDEM_RK4_PAIRS", "int8": "TANDEM_INT8_NO_I2F"}
# decode, a verify batch and a prefill chunk over cached prefixes (with a
# decode row beside it); contexts end inside pages and tiles
NO_I2F_STEPS = {"decode": [(70, 1), (33, 1), (5, 1)],
                "verify": [(70, 4), (131, 3), (9, 5)],
                "prefill": [(0, 21), (35, 24), (18, 1)]}
# head_dim: (q_heads, kv_heads, query dtype)
NO_I2F_SHAPES = {64: (8, 2, torch.float32), 256: (12, 2, torch.bfloat16)}


def _poisoned_output(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _switch_outputs(fmt, name, head_dim, seqs, seed, monkeypatch,
                    switch_env: str | None = None):
    """(reference, {switch value: {splits: output}}) over one batch; the
    kernel's output buffer NaN-poisoned, so a channel it leaves unwritten
    shows. switch_env: the switch flipped (NO_I2F_SWITCHES[name] unless
    given)."""
    from engine.kv import attention
    from engine.kv.attention import Tiles

    q_heads, kv_heads, q_dtype = NO_I2F_SHAPES[head_dim]
    buffers, q, meta = build_case(fmt, seqs, q_heads, kv_heads, head_dim, page_size=16,
                                  q_dtype=q_dtype, seed=seed)
    scale = head_dim ** -0.5
    expected = paged_attention_reference(fmt, buffers, q.float(), meta, scale)
    # the interpreter's smallest tiles; on a GPU tiles_for's
    tiles = Tiles(rows=16, block_n=16, dot_bf16=q_dtype == torch.bfloat16) \
        if DEVICE == "cpu" else None
    monkeypatch.setattr(attention, "kernel_output", _poisoned_output)
    outputs = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(switch_env or NO_I2F_SWITCHES[name], switch)
        outputs[switch] = {splits: paged_attention_triton(fmt, buffers, q, meta, scale,
                                                          num_splits=splits, tiles=tiles)
                           for splits in (1, 3)}
    return expected, outputs


def _assert_every_side_near_reference(outputs, expected, bf16: bool) -> None:
    """Each switch side's outputs, at each split count: written whole and
    within the reference's tolerance (the existing rk4 and int8 ones: fp32
    queries, or bf16 queries and dots)."""
    for switch, by_splits in outputs.items():
        for splits, actual in by_splits.items():
            assert not actual.isnan().any(), (switch, splits)
            if bf16:
                torch.testing.assert_close(actual.float(), expected, rtol=4e-2, atol=4e-2)
                assert (actual.float() - expected).abs().mean() < 4e-3
            else:
                torch.testing.assert_close(actual, expected, **tolerance(torch.float32))


@pytest.mark.parametrize("head_dim", sorted(NO_I2F_SHAPES))
@pytest.mark.parametrize("name, options", NO_I2F_FORMATS, ids=NO_I2F_IDS)
@pytest.mark.parametrize("step", list(NO_I2F_STEPS))
def test_rk4_pairs_and_int8_without_i2f_match_reference_and_the_old_path(
        step, name, options, head_dim, monkeypatch):
    """Both sides of each switch within the reference's tolerance (the
    existing rk4 and int8 ones: fp32 queries, or bf16 queries and dots),
    with 1 and 3 key splits. Against each other: int8's codes are exact
    either way (code * scale in fp32), so the outputs are the same bits;
    rk4's K and V values are the same too, but its scores sum two dots of
    half the channels, so they agree to fp32 rounding (tf32 on a GPU; bf16 queries: to a
    bf16 ulp of the output, where a rounded P may flip)."""
    fmt = make_format(name, **options)
    # int8's codes are made fp32 only on the dequantized tiles' path
    monkeypatch.setenv(INT8_CODES_DOT_ENV, "0")
    expected, outputs = _switch_outputs(fmt, name, head_dim, NO_I2F_STEPS[step],
                                        seed=head_dim + len(step), monkeypatch=monkeypatch)
    bf16 = NO_I2F_SHAPES[head_dim][2] == torch.bfloat16
    _assert_every_side_near_reference(outputs, expected, bf16)
    for splits in (1, 3):
        old, new = outputs["0"][splits].float(), outputs["1"][splits].float()
        if name == "int8":
            assert torch.equal(old, new), splits
        elif bf16:
            torch.testing.assert_close(new, old, rtol=2 ** -7, atol=2 ** -7)
            assert (new - old).abs().mean() < 1e-4
        else:  # the GPU's fp32 dots run in tf32: the two sums agree to its rounding
            # (H200, 12-03 08:45: at most 6.4e-5 apart, prefill at head_dim 64)
            agree = 1e-5 if DEVICE == "cpu" else 2 ** -10
            torch.testing.assert_close(new, old, rtol=agree, atol=agree)


INT8_CODES_DOT_ENV = "TANDEM_INT8_CODES_DOT"


@pytest.mark.parametrize("head_dim", sorted(NO_I2F_SHAPES))
@pytest.mark.parametrize("step", list(NO_I2F_STEPS))
def test_int8_codes_in_the_dots_match_reference_and_the_dequantized_tiles(
        step, head_dim, monkeypatch):
    """int8 with its codes as dot operands and each key's scales on the
    scores and probabilities (TANDEM_INT8_CODES_DOT, on by default) against
    the reference and the dequantized tiles, with 1 and 3 key splits, the
    output NaN-poisoned. The two paths round differently only where bf16
    dots round (K and V scaled before rounding, or p s rounded): fp32
    queries agree to fp32 rounding (on a GPU their dots round K or P V to
    tf32 differently: H100, 12-06, 3.3e-3 apart at most), bf16 ones to a
    bf16 ulp. The codes path rounds K not at all, so it is no further from
    the reference than the dequantized tiles (mean error, with a margin)."""
    fmt = make_format("int8")
    expected, outputs = _switch_outputs(fmt, "int8", head_dim, NO_I2F_STEPS[step],
                                        seed=3 * head_dim + len(step), monkeypatch=monkeypatch,
                                        switch_env=INT8_CODES_DOT_ENV)
    bf16 = NO_I2F_SHAPES[head_dim][2] == torch.bfloat16
    _assert_every_side_near_reference(outputs, expected, bf16)
    for splits in (1, 3):
        tiles, codes = outputs["0"][splits].float(), outputs["1"][splits].float()
        if bf16 or DEVICE != "cpu":
            agree = 2 ** -6 if bf16 else 2 ** -7
            torch.testing.assert_close(codes, tiles, rtol=agree, atol=agree)
            error = {side: (out - expected).abs().mean().item()
                     for side, out in (("tiles", tiles), ("codes", codes))}
            assert error["codes"] <= 1.25 * error["tiles"] + 1e-5, error
        else:
            torch.testing.assert_close(codes, tiles, rtol=1e-5, atol=1e-5)


def test_int8_codes_dot_switch_is_on_by_default_and_int8_only(monkeypatch):
    """TANDEM_INT8_CODES_DOT: on unless "0", read at every launch, int8's
    constexpr only (the other formats compile one variant), a mistyped
    value refused by name."""
    from engine.kv import attention_kernels as K

    monkeypatch.delenv(INT8_CODES_DOT_ENV, raising=False)
    assert K.program_switches(K.INT8, 256)["INT8_CODES_DOT"]
    assert not any(K.program_switches(k, 256)["INT8_CODES_DOT"]
                   for k in (K.DENSE, K.DENSE_BF16, K.RK4, K.RK4P))
    monkeypatch.setenv(INT8_CODES_DOT_ENV, "0")
    assert not K.program_switches(K.INT8, 256)["INT8_CODES_DOT"]
    monkeypatch.setenv(INT8_CODES_DOT_ENV, "on")
    with pytest.raises(ValueError, match=f"{INT8_CODES_DOT_ENV}='on'"):
        K.program_switches(K.DENSE, 256)


@pytest.mark.parametrize("name", ["rk4", "int8"])
def test_no_i2f_switches_are_on_by_default_and_reject_other_values(name, monkeypatch):
    """TANDEM_RK4_PAIRS and TANDEM_INT8_NO_I2F: on unless "0", read at every
    launch (so bench.attention's A/B takes them), and each sets its own
    format's constexpr only (the other formats compile one variant)."""
    from engine.kv import attention_kernels as K
    from engine.kv.attention import int8_no_i2f, rk4_pairs

    env, wanted = NO_I2F_SWITCHES[name], {"rk4": rk4_pairs, "int8": int8_no_i2f}[name]
    kind, flag = {"rk4": (K.RK4, "RK4_PAIRS"), "int8": (K.INT8, "INT8_NO_I2F")}[name]
    for other in NO_I2F_SWITCHES.values():
        monkeypatch.delenv(other, raising=False)
    assert wanted() and K.program_switches(kind, 256)[flag]
    others = [k for k in (K.DENSE, K.DENSE_BF16, K.INT8, K.RK4, K.RK4P) if k != kind]
    assert not any(K.program_switches(k, 256)[flag] for k in others)
    monkeypatch.setenv(env, "0")
    assert not wanted() and not K.program_switches(kind, 256)[flag]
    monkeypatch.setenv(env, "1")
    assert wanted()
    monkeypatch.setenv(env, "yes")
    with pytest.raises(ValueError, match=f"{env}='yes'"):
        wanted()
    with pytest.raises(ValueError, match=f"{env}='yes'"):  # a launch of any format reads it
        K.program_switches(K.DENSE, 256)


def test_rk4_pairs_need_tl_dots_of_sixteen_channels(monkeypatch):
    """Pair tiles are D_PAD / 2 wide and tl.dot takes 16 at least: a head
    under 32 channels keeps the channel-order tiles."""
    from engine.kv import attention_kernels as K

    monkeypatch.delenv("TANDEM_RK4_PAIRS", raising=False)
    assert K.program_switches(K.RK4, 32)["RK4_PAIRS"]
    assert K.program_switches(K.RK4, 24)["RK4_PAIRS"]  # pads to 32
    assert not K.program_switches(K.RK4, 16)["RK4_PAIRS"]


def test_rk4_pair_decode_tiles_take_one_stage(monkeypatch):
    """rk4's pair program at head_dim 256 with bf16 dots: one stage, 4 warps
    (Triton's default 3 stages spilled; tests/test_kernel_stacks.py compiles
    these tiles); the channel-order tiles keep Triton's default."""
    from engine.kv.attention import tiles_for

    fmt = make_format("rk4")
    monkeypatch.delenv("TANDEM_DECODE_DOT_BF16", raising=False)
    monkeypatch.delenv("TANDEM_RK4_PAIRS", raising=False)
    tiles = tiles_for(256, 6, decode=True, on_gpu=True, fmt=fmt)
    assert (tiles.num_warps, tiles.num_stages) == (4, 1)
    monkeypatch.setenv("TANDEM_RK4_PAIRS", "0")
    tiles = tiles_for(256, 6, decode=True, on_gpu=True, fmt=fmt)
    assert (tiles.num_warps, tiles.num_stages) == (4, None)


def test_decode_stages_override_changes_decode_tiles_only(monkeypatch):
    """TANDEM_DECODE_STAGES, the int8 one-stage A/B: decode tiles take it,
    verify and prefill tiles keep theirs, and a bad value names the choices."""
    from engine.kv.attention import tiles_for

    fmt = make_format("int8")
    monkeypatch.delenv("TANDEM_DECODE_STAGES", raising=False)
    default = tiles_for(256, 6, decode=True, on_gpu=True, fmt=fmt)
    verify = tiles_for(256, 6, decode=False, on_gpu=True, fmt=fmt, new_tokens=4)
    assert default.num_stages is None
    monkeypatch.setenv("TANDEM_DECODE_STAGES", "1")
    assert tiles_for(256, 6, decode=True, on_gpu=True, fmt=fmt) == \
        dataclasses.replace(default, num_stages=1)
    assert tiles_for(256, 6, decode=False, on_gpu=True, fmt=fmt, new_tokens=4) == verify
    monkeypatch.setenv("TANDEM_DECODE_STAGES", "8")
    with pytest.raises(ValueError, match="TANDEM_DECODE_STAGES='8': give 1, 2, 3 or 4"):
        tiles_for(256, 6, decode=True, on_gpu=True, fmt=fmt)


def test_prefill_block_n_override_changes_bf16_prefill_tiles_only(monkeypatch):
    """TANDEM_PREFILL_BLOCK_N, the agent loop's tile A/B: bf16 prefill chunks
    take it; decode, verify and fp32 chunks keep theirs."""
    from engine.kv.attention import tiles_for

    fmt = make_format("rk4")
    monkeypatch.delenv("TANDEM_PREFILL_BLOCK_N", raising=False)

    def every_tile():
        return [tiles_for(256, 6, decode=True, on_gpu=True, fmt=fmt),
                tiles_for(256, 6, decode=False, on_gpu=True, fmt=fmt, new_tokens=4),
                tiles_for(256, 6, decode=False, on_gpu=True, fmt=fmt, new_tokens=1100,
                          q_dtype=torch.float32)]

    others = every_tile()
    chunk = tiles_for(256, 6, decode=False, on_gpu=True, fmt=fmt, new_tokens=1100,
                      q_dtype=torch.bfloat16)
    assert chunk.rows == 128 and chunk.block_n == 64
    monkeypatch.setenv("TANDEM_PREFILL_BLOCK_N", "32")
    assert tiles_for(256, 6, decode=False, on_gpu=True, fmt=fmt, new_tokens=1100,
                     q_dtype=torch.bfloat16) == dataclasses.replace(chunk, block_n=32)
    assert every_tile() == others
    monkeypatch.setenv("TANDEM_PREFILL_BLOCK_N", "48")
    with pytest.raises(ValueError, match="TANDEM_PREFILL_BLOCK_N='48': give 32 or 64"):
        tiles_for(256, 6, decode=False, on_gpu=True, fmt=fmt, new_tokens=1100,
                  q_dtype=torch.bfloat16)


if importlib.util.find_spec("triton") is not None:
    import triton  # noqa: E402
    import triton.language as tl  # noqa: E402

    from engine.kv.attention_kernels import _int8_values, _nibble_values  # noqa: E402

    @triton.jit
    def _code_values_kernel(codes_ptr, out_ptr, INT8: tl.constexpr, COMPILED: tl.constexpr):
        i = tl.arange(0, 256)
        codes = tl.load(codes_ptr + i)
        if INT8:
            tl.store(out_ptr + i, _int8_values(codes, COMPILED))
        else:
            low, high16 = _nibble_values(codes, 8, COMPILED)
            tl.store(out_ptr + 2 * i, low)
            tl.store(out_ptr + 2 * i + 1, high16)


@pytest.mark.parametrize("kind", ["int8", "nibbles"])
def test_codes_become_exact_floats_without_i2f(kind):
    """Every int8 code and every byte's nibbles through the bit tricks that
    replace I2F: compiled (a GPU with TRITON_INTERPRET=0), the PRMT inline
    asm on four codes a register; in the interpreter, the bit-op fallback."""
    dtype = torch.int8 if kind == "int8" else torch.uint8
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(DEVICE)
    out = torch.full((256 if kind == "int8" else 512,), float("nan"), device=DEVICE)
    _code_values_kernel[(1,)](codes, out, INT8=kind == "int8", COMPILED=not INTERPRET)
    if kind == "int8":
        expected = codes.float()
    else:
        byte = codes.to(torch.int32)
        expected = torch.stack([(byte & 15) - 8, 16 * (byte >> 4)], dim=1).flatten().float()
    assert torch.equal(out, expected)
