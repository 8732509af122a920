"""Paged attention over rk4p pages: the Triton kernel (RoPE applied to each
dequantized K tile, staging pages read as bf16) against the PyTorch reference
(dense read, RoPE, SDPA), with GQA, partial rotary, decode splits and prefill.

TRITON_INTERPRET=1 on the CPU; with TRITON_INTERPRET=0 on a CUDA machine the
same tests run the compiled kernel (wider tolerances: tf32 dots)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import importlib.util  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.kv.attention import (AttentionMetadata, paged_attention_reference,  # noqa: E402
                                 paged_attention_triton)
from engine.kv.formats import make_format  # noqa: E402
from engine.rotary import Rotary  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton not installed")
PAGE = 32


def rotary_of(head_dim: int, rotary_dim: int) -> Rotary:
    return Rotary(SimpleNamespace(rotary_dim=rotary_dim, rope_theta=10000.0, rope_scaling=None))


def build_case(seqs, q_heads, kv_heads, head_dim, staged_pages, seed, sink=False, page=PAGE):
    """seqs [(cached, new)]: each sequence's last `staged_pages` pages (of those
    its keys reach) live in staging, and with `sink` its first page too (rk4p's
    exact first page), the rest in real pages; every other real and staging
    page holds unrelated data, so a wrong lookup reads garbage."""
    fmt = make_format("rk4p", page_size=page)
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // page) for c, n in seqs]
    num_pages, num_staging = sum(need) + 2, (staged_pages + sink) * len(seqs) + 1
    buffers = fmt.allocate(num_pages, page, kv_heads, head_dim, DEVICE)
    buffers.update(fmt.allocate_staging(num_staging, page, kv_heads, head_dim, DEVICE))
    offsets_k = torch.linspace(-8, 8, head_dim)
    # channels of unlike spreads: their steps differ, even next to each other
    spread_k = 0.25 + 4 * torch.rand(head_dim, generator=g)

    def fill(slots):
        k = torch.randn(slots.numel(), kv_heads, head_dim, generator=g) * spread_k + offsets_k
        v = torch.randn(slots.numel(), kv_heads, head_dim, generator=g)
        fmt.write(buffers, slots.to(DEVICE), k.to(DEVICE), v.to(DEVICE), use_triton=False)

    fill(torch.arange(num_pages * page))  # every real page, whole
    fill(num_pages * page + torch.arange(num_staging * page))  # every staging page
    order = torch.randperm(num_pages, generator=g)
    tables, used, staging_used = [], 0, 0
    for pages in need:
        table = order[used:used + pages].clone()
        used += pages
        for j in range(min(staged_pages, pages)):
            table[pages - 1 - j] = num_pages + staging_used
            staging_used += 1
        if sink and pages > staged_pages:
            table[0] = num_pages + staging_used
            staging_used += 1
        tables.append(table.to(DEVICE))
    offsets = [0]
    for _, n in seqs:
        offsets.append(offsets[-1] + n)
    q = torch.randn(offsets[-1], q_heads, head_dim, generator=g).to(DEVICE)
    meta = AttentionMetadata.build(offsets, [c + n for c, n in seqs], tables, DEVICE)
    return fmt, buffers, q, meta


def tolerance():
    return dict(rtol=1e-4, atol=1e-4) if DEVICE == "cpu" else dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rotary_dim,staged,splits,sink", [(64, 0, 1, False), (16, 1, 3, True),
                                                           (64, 2, 2, False)])
def test_decode_matches_reference(rotary_dim, staged, splits, sink):
    """Full and partial rotary (Qwen3.5: a quarter of the head), no, one and
    two staged pages per sequence (and the first, the sinks), one and several
    key splits."""
    seqs = [(70, 1), (31, 1), (95, 1)]
    fmt, buffers, q, meta = build_case(seqs, 4, 2, 64, staged, seed=rotary_dim + staged,
                                       sink=sink)
    rotary = rotary_of(64, rotary_dim)
    scale = 64 ** -0.5
    expected = paged_attention_reference(fmt, buffers, q, meta, scale, rotary=rotary)
    actual = paged_attention_triton(fmt, buffers, q, meta, scale, num_splits=splits,
                                    rotary=rotary)
    torch.testing.assert_close(actual, expected, **tolerance())


def test_prefill_matches_reference_with_gqa_and_partial_rotary():
    seqs = [(32, 40), (0, 17)]
    fmt, buffers, q, meta = build_case(seqs, 6, 2, 64, 1, seed=7, sink=True)
    rotary = rotary_of(64, 32)
    scale = 64 ** -0.5
    expected = paged_attention_reference(fmt, buffers, q, meta, scale, rotary=rotary)
    actual = paged_attention_triton(fmt, buffers, q, meta, scale, rotary=rotary)
    torch.testing.assert_close(actual, expected, **tolerance())


def test_rope_after_dequant_equals_attention_over_roped_keys():
    """The reference itself: attention over pre-RoPE pages with RoPE applied on
    read equals SDPA over RoPE'd bf16 keys, up to the 4-bit error."""
    seqs = [(64, 1)]
    fmt, buffers, q, meta = build_case(seqs, 2, 2, 64, 2, seed=3)
    rotary = rotary_of(64, 64)
    k, v = fmt.read(buffers, meta.page_tables[0], 65, torch.float32)  # both staged pages: exact
    pos = torch.arange(65, device=DEVICE)
    k_roped = rotary.apply(k, *rotary.cos_sin(pos, torch.float32))
    out = paged_attention_reference(fmt, buffers, q, meta, 0.125, rotary=rotary)
    scores = torch.einsum("hd,khd->hk", q[0], k_roped) * 0.125
    expected = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
    torch.testing.assert_close(out[0], expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="rotary"):
        paged_attention_reference(fmt, buffers, q, meta, 0.125)


# ------------------------------------------- the rotary-halves path (27B shape)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from engine.kv import attention_kernels as K  # noqa: E402
from engine.kv.attention import Tiles  # noqa: E402


@triton.jit
def _sin_cos_probe(pos_ptr, freq_ptr, sin_ptr, cos_ptr, n,
                   HALF: tl.constexpr, BLOCK: tl.constexpr, COMPILED: tl.constexpr):
    """The kernel's RoPE angle (fp32 position * inv_freq) and its sin/cos."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < n
    pos = tl.load(pos_ptr + rows, mask=ok, other=0).to(tl.float32)
    j = tl.arange(0, HALF)
    freq = tl.load(freq_ptr + j)
    shape: tl.constexpr = [BLOCK, HALF]
    angle = K._mul_rn(tl.broadcast_to(pos[:, None], shape), tl.broadcast_to(freq[None, :], shape),
                      COMPILED)
    sin, cos = K._sin_cos(angle)
    at = rows[:, None] * HALF + j[None, :]
    tl.store(sin_ptr + at, sin, mask=ok[:, None])
    tl.store(cos_ptr + at, cos, mask=ok[:, None])


@pytest.mark.parametrize("theta", [1e7, 1e4])
def test_rope_sin_cos_match_torch_up_to_a_million_positions(theta):
    """The kernel's range-reduced sin/cos against torch's (rotary.cos_sin, the
    reference) of the same fp32 angles: every position up to 262,144 (the 27B's
    context; angles to 2.6e5 rad at inv_freq 1) and samples up to 2**20, with
    the 27B's inverse frequencies (rotary_dim 64, theta 1e7) and a classic theta."""
    rotary = Rotary(SimpleNamespace(rotary_dim=64, rope_theta=theta, rope_scaling=None))
    g = torch.Generator().manual_seed(0)
    pos = torch.cat([torch.arange(262_145), torch.randint(262_145, 1 << 20, (20_000,),
                                                          generator=g),
                     torch.arange((1 << 20) - 64, 1 << 20)]).to(torch.int32).to(DEVICE)
    inv_freq = rotary.inv_freq_on(DEVICE)
    half = inv_freq.numel()
    sin = torch.full((pos.numel(), half), float("nan"), device=DEVICE)
    cos = torch.full_like(sin, float("nan"))
    block = 4096
    _sin_cos_probe[(triton.cdiv(pos.numel(), block),)](
        pos, inv_freq, sin, cos, pos.numel(), HALF=half, BLOCK=block, COMPILED=not INTERPRET)
    expected_cos, expected_sin = rotary.cos_sin(pos, torch.float32)
    # a few fp32 ulps of values <= 1 (torch's own sin/cos are within ~1 ulp)
    torch.testing.assert_close(sin, expected_sin[:, :half], rtol=0, atol=4e-7)
    torch.testing.assert_close(cos, expected_cos[:, :half], rtol=0, atol=4e-7)


def test_half_pi_parts_are_short_and_sum_to_half_pi():
    """n * part stays exact in fp32 for quadrants n < 2**20 (4-bit parts), the
    last part is fp32, and together they carry pi/2 to ~1e-15."""
    import math

    *short, last = K._HALF_PI
    for part in short:
        mantissa = part / 2.0 ** (math.floor(math.log2(abs(part))) - 3)
        assert mantissa == int(mantissa)  # at most 4 significant bits
    assert torch.tensor(last, dtype=torch.float32).item() == last
    assert abs(sum(K._HALF_PI) - math.pi / 2) < 1e-14
    # rotary tiles: the channel pairs of one half (rotary_dim / 4), padded
    assert [K.rope_pad(r) for r in (0, 8, 48, 64, 128, 256)] == [16, 16, 16, 16, 32, 64]


def _run_case(seqs, q_heads, kv_heads, head_dim, rotary_dim, staged, splits, seed, sink=False,
              tiles=None, q_dtype=torch.float32, page=PAGE):
    fmt, buffers, q, meta = build_case(seqs, q_heads, kv_heads, head_dim, staged, seed=seed,
                                       sink=sink, page=page)
    q = q.to(q_dtype)
    rotary = rotary_of(head_dim, rotary_dim)
    scale = head_dim ** -0.5
    expected = paged_attention_reference(fmt, buffers, q.float(), meta, scale, rotary=rotary)
    actual = paged_attention_triton(fmt, buffers, q, meta, scale, num_splits=splits,
                                    rotary=rotary, tiles=tiles)
    assert not actual.isnan().any()
    return actual.float(), expected


@pytest.mark.parametrize("seqs,splits", [([(70, 1), (33, 1)], 2),  # decode
                                         ([(40, 5), (61, 9)], 1),  # speculative verify
                                         ([(0, 45)], 1)])  # a prefill chunk
def test_27b_shape_matches_reference(seqs, splits):
    """head_dim 256 with RoPE on the first 64 (the 27B: half = 32, the rotary
    dots' inner width), GQA group 6, staged pages and the sink."""
    actual, expected = _run_case(seqs, 12, 2, 256, 64, staged=1, splits=splits, seed=11,
                                 sink=True)
    torch.testing.assert_close(actual, expected, **tolerance())


def test_27b_shape_decode_over_thousands_of_positions():
    """One sequence of 1,000 cached keys: the angles wrap the circle ~160
    times at the highest frequency (larger angles: the sin/cos test above)."""
    actual, expected = _run_case([(1000, 1)], 6, 1, 256, 64, staged=2, splits=4, seed=12,
                                 sink=True)
    torch.testing.assert_close(actual, expected, **tolerance())


@pytest.mark.parametrize("head_dim,rotary_dim", [(32, 8), (64, 48), (128, 128)])
def test_padded_rotary_halves_match_reference(head_dim, rotary_dim):
    """Halves narrower than tl.dot's 16 (tiny-qwen3.5: 8 of 32 rotate, half 4)
    or not a power of two (48: half 24) run zero-padded to ROPE_PAD; full
    rotary leaves no other channels."""
    actual, expected = _run_case([(50, 1), (20, 3)], 4, 2, head_dim, rotary_dim, staged=1,
                                 splits=2, seed=head_dim + rotary_dim)
    torch.testing.assert_close(actual, expected, **tolerance())


def test_prefill_with_bf16_dot_operands_keeps_bf16_semantics():
    """Tiles.dot_bf16 (prefill chunks): the rotary halves enter their dots as
    bf16 too; within bf16 tolerance of the reference."""
    tiles = Tiles(rows=16, block_n=16, dot_bf16=True) if DEVICE == "cpu" else \
        Tiles(rows=64, block_n=32, num_warps=4, dot_bf16=True)
    actual, expected = _run_case([(32, 40), (0, 17)], 12, 2, 256, 64, staged=1, splits=1,
                                 seed=13, tiles=tiles, q_dtype=torch.bfloat16)
    torch.testing.assert_close(actual, expected, rtol=4e-2, atol=4e-2)
    assert (actual - expected).abs().mean() < 4e-3


# ------------------------------------------- per-page tiles and per-key tiles

@pytest.mark.parametrize("page,block_n,splits", [
    (32, 16, 2),  # tiles on one page; (200, 1)'s second split starts mid-page (key 112)
    (32, 16, 3),
    (32, 64, 2),  # a tile spans two pages (the staged sink and a real one): per key
    (48, 16, 2),  # 48-token pages: 16 divides them, one page a tile
    (48, 32, 2),  # 32 does not: tiles [32, 64), [64, 96), ... straddle pages, per key
])
def test_decode_per_page_and_per_key_tiles_match_reference(page, block_n, splits):
    """The kernel loads a tile's page, K min and step once when BLOCK_N divides
    the page size (tiles start at multiples of BLOCK_N, so each lies on one
    page) and per key otherwise; both over real and staged pages, the sink
    among them, and splits whose boundaries fall inside a page."""
    tiles = Tiles(rows=16, block_n=block_n, num_warps=4, num_stages=1)
    actual, expected = _run_case([(200, 1), (130, 1), (31, 1)], 12, 2, 256, 64, staged=1,
                                 splits=splits, seed=page + block_n, sink=True, tiles=tiles,
                                 page=page)
    torch.testing.assert_close(actual, expected, **tolerance())


def test_prefill_with_tiles_across_pages_matches_reference():
    """Prefill rows over 48-token pages with 32-key tiles (per-key page
    lookups), the partial rotary of a 64-dim head."""
    actual, expected = _run_case([(100, 40), (0, 17)], 6, 2, 64, 16, staged=1, splits=1, seed=21,
                                 sink=True, tiles=Tiles(rows=16, block_n=32, num_warps=4), page=48)
    torch.testing.assert_close(actual, expected, **tolerance())


def test_rotary_dim_not_a_multiple_of_four_is_refused():
    """Channel c and its rotate-half partner c + half must share parity for the
    even/odd tiles: a rotary_dim of 2 mod 4 is refused with a clear error."""
    fmt, buffers, q, meta = build_case([(40, 1)], 2, 2, 64, 1, seed=5)
    with pytest.raises(ValueError, match="multiple of 4"):
        paged_attention_triton(fmt, buffers, q, meta, 0.125, rotary=rotary_of(64, 18))


# ------------------------------------------- rk4p pages into a dense workspace

def _dense_pair(fmt, buffers, table, kv_len, kv_heads, head_dim, rotary, use_triton, page):
    from engine.kv.attention import dequantize_into

    k = torch.full((kv_len, kv_heads, head_dim), float("nan"), dtype=torch.bfloat16,
                   device=DEVICE)
    v = torch.full_like(k, float("nan"))
    dequantize_into(fmt, buffers, table, kv_len, k, v, rotary, slice_tokens=page,
                    use_triton=use_triton)
    return k, v


@pytest.mark.parametrize("head_dim, rotary_dim, kv_len, page", [
    (32, 16, 75, PAGE), (64, 64, 96, PAGE), (64, 16, 33, PAGE),
    (32, 16, 91, 40)])  # pages that are no multiple of the key tile: a page per key
def test_the_dense_read_kernel_matches_its_reference(head_dim, rotary_dim, kv_len, page):
    """attention_kernels.rk4p_dense against dequantize_into's PyTorch path:
    K roped at its positions (partial and full rotary), V as stored, staging
    pages (the sink and the newest) in bf16, a length that ends mid-page,
    NaN-poisoned outputs; equal up to the fp32 arithmetic's order (sin/cos
    by a different reduction), i.e. within a bf16 rounding."""
    fmt, buffers, _, meta = build_case([(kv_len - 1, 1)], q_heads=2, kv_heads=2,
                                       head_dim=head_dim, staged_pages=1, seed=head_dim + kv_len,
                                       sink=True, page=page)
    rotary = rotary_of(head_dim, rotary_dim)
    table = meta.page_tables[0]
    k, v = _dense_pair(fmt, buffers, table, kv_len, 2, head_dim, rotary, True, page)
    k_ref, v_ref = _dense_pair(fmt, buffers, table, kv_len, 2, head_dim, rotary, False, page)
    assert not k.isnan().any() and not v.isnan().any()
    torch.testing.assert_close(v, v_ref, rtol=0, atol=0)  # exact products, one rounding
    torch.testing.assert_close(k.float(), k_ref.float(), rtol=2 ** -7, atol=1e-3)
    # the channels RoPE leaves alone are exact too
    torch.testing.assert_close(k[..., rotary_dim:], k_ref[..., rotary_dim:], rtol=0, atol=0)
    # and the kernel really roped the rotary channels (position 0 aside)
    unroped = torch.full_like(k, float("nan"))
    fmt.read_rotated_into(buffers, table, kv_len, unroped, torch.empty_like(unroped),
                          use_triton=False)
    assert not torch.allclose(k[1:, :, :rotary_dim].float(), unroped[1:, :, :rotary_dim].float(),
                              atol=0.1)
