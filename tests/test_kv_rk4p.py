"""rk4p (4-bit KV in 32-token pages, K per channel before RoPE, V rotated per
token, open pages in bf16 staging): the reference quantizers' error bounds, the
Triton write kernels against the reference bit for bit (TRITON_INTERPRET=1 on
the CPU), sealing, and the open-page rules."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import triton
import triton.language as tl

from engine.kv.formats import (K_STEP_BIAS, PagedRk4Format, k_page_dequantize,
                               k_page_quantize, k_step_decode, k_step_encode, make_format)
from engine.kv.kernels import _k_step_decode, _k_step_encode
from engine.kv.open_pages import OpenPages, OpenPagesError, staging_per_sequence

INTERPRET = os.environ["TRITON_INTERPRET"] not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
PAGE = 32


def _k_like(tokens: int, heads: int, dim: int, seed: int = 0) -> torch.Tensor:
    """K-like data: per-channel offsets and scales that differ by 100x, plus an outlier."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, dim, generator=g) * torch.logspace(-1, 1, dim)
    x = x + torch.linspace(-20, 20, dim)
    x[3, 0, 5] = 300.0
    return x


def _poisoned(fmt, pages: int, staging: int, heads: int, dim: int):
    """Buffers whose every byte is garbage (NaN for floats) before the write."""
    buffers = fmt.allocate(pages, PAGE, heads, dim, DEVICE)
    buffers.update(fmt.allocate_staging(staging, PAGE, heads, dim, DEVICE))
    for t in buffers.values():
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        else:
            t.fill_(0xA5)
    return buffers


def _same_bits(a: dict, b: dict) -> None:
    for name in a:
        x, y = a[name], b[name]
        if x.dtype.is_floating_point:
            x, y = x.view(torch.int16), y.view(torch.int16)
        assert torch.equal(x, y), f"{name} differs"


def test_k_page_error_is_within_half_a_step_per_channel():
    x = _k_like(2 * PAGE, 2, 64).reshape(2, PAGE, 2, 64)
    codes, lo, step = k_page_quantize(x)
    back = k_page_dequantize(codes, lo[:, None], step[:, None])
    step_value = k_step_decode(step)
    span = x.amax(1) - lo.float()
    # the e5m3 step wastes at most 1/8 of the levels (e8m0 wasted up to half)
    assert (span <= 15 * step_value).all() and (span * 1.125 >= 15 * step_value).all()
    # half a step, plus the fp16 rounding of the minimum (values below it clip)
    bound = step_value / 2 + (x.amin(1) - lo.float()).abs()
    assert ((back - x).abs() <= bound[:, None] * (1 + 1e-6)).all()


def test_k_step_is_the_least_covering_e5m3_value():
    """span <= 15 s for the least s with 3 mantissa bits; every code decodes to
    a distinct increasing value; out-of-range spans take the end codes."""
    values = k_step_decode(torch.arange(256, dtype=torch.uint8))
    assert (values[1:] > values[:-1]).all() and values[0] == 2.0 ** -K_STEP_BIAS
    assert torch.equal(k_step_encode(15 * values), torch.arange(256, dtype=torch.uint8))
    span = torch.rand(10000, generator=torch.Generator().manual_seed(0)) * 1e3
    code = k_step_encode(span)
    step = k_step_decode(code)
    below = k_step_decode((code.to(torch.int32) - 1).clamp(min=0))
    assert (span <= 15 * step).all() and ((15 * below < span) | (code == 0)).all()
    edge = torch.tensor([0.0, 1e-45, 1e-30, 2 * 65504.0, 1e30, float("inf")])
    assert k_step_encode(edge).tolist() == [0, 0, 0, k_step_encode(edge[3:4]).item(), 255, 255]
    assert 15 * k_step_decode(k_step_encode(edge[3:4])) >= 2 * 65504.0  # any fp16 span fits


@triton.jit
def _k_step_roundtrip(span_ptr, code_ptr, value_ptr, n, BLOCK: tl.constexpr):
    """The kernels' e5m3 helpers on their own, for the bit-for-bit test."""
    i = tl.arange(0, BLOCK)
    ok = i < n
    code = _k_step_encode(tl.load(span_ptr + i, mask=ok, other=0.0))
    tl.store(code_ptr + i, code, mask=ok)
    tl.store(value_ptr + i, _k_step_decode(code), mask=ok)


def test_k_step_kernel_helpers_match_reference_bit_for_bit():
    g = torch.Generator().manual_seed(5)
    span = torch.cat([torch.rand(200, generator=g) * 10.0 ** torch.randint(-8, 6, (200,),
                                                                           generator=g),
                      torch.tensor([0.0, 1e-45, 15 * 2.0 ** -K_STEP_BIAS, 1e30])]).to(DEVICE)
    code = torch.full(span.shape, -1, dtype=torch.int32, device=DEVICE)
    value = torch.full(span.shape, float("nan"), device=DEVICE)
    _k_step_roundtrip[(1,)](span, code, value, span.numel(), BLOCK=256)
    assert torch.equal(code, k_step_encode(span).to(torch.int32))
    assert torch.equal(value.view(torch.int32), k_step_decode(k_step_encode(span)).view(torch.int32))


def test_rk4p_bits_and_budget():
    fmt = PagedRk4Format()
    assert fmt.k_bits() == 4.75 and fmt.v_bits() == 4.25 and fmt.bits_per_element() == 4.5
    with pytest.raises(ValueError, match="budget"):
        PagedRk4Format(page_size=16)
    with pytest.raises(ValueError, match="32-token pages"):
        fmt.allocate(4, 16, 2, 64, "cpu")
    # sink page + three newest + one to spill into
    assert (fmt.exact_first_pages, fmt.exact_recent_pages) == (1, 3)
    assert staging_per_sequence(fmt) == 5
    assert staging_per_sequence(make_format("rk4p", exact_first_pages=0,
                                            exact_recent_pages=1)) == 2
    assert staging_per_sequence(make_format("int8")) == 0
    with pytest.raises(ValueError, match="exact_first_pages"):
        PagedRk4Format(exact_first_pages=-1)
    with pytest.raises(ValueError, match="exact_recent_pages"):
        PagedRk4Format(exact_recent_pages=0)


@pytest.mark.parametrize("heads,dim", [(2, 64), (1, 128)])
def test_write_kernel_matches_reference_bit_for_bit(heads, dim, reference_rotation):
    fmt = make_format("rk4p", use_triton=False)
    k = _k_like(2 * PAGE + 7, heads, dim, seed=1)
    v = torch.randn(2 * PAGE + 7, heads, dim)
    # page 2 whole, 5 tokens into staging page 1, 2 into staging page 0
    # (ids 4 + s), then page 0 whole: pages 1 and 3 stay unwritten
    slots = torch.cat([torch.arange(2 * PAGE, 3 * PAGE), 4 * PAGE + PAGE + torch.arange(5),
                       4 * PAGE + torch.tensor([7, 3]), torch.arange(0, PAGE)])
    k, v, slots = k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE)
    expected = _poisoned(fmt, 4, 2, heads, dim)
    actual = _poisoned(fmt, 4, 2, heads, dim)
    fmt.write(expected, slots, k, v, use_triton=False)
    fmt.write(actual, slots, k, v, use_triton=True)
    _same_bits(expected, actual)
    assert not torch.isnan(expected["k_min"][[0, 2]]).any()
    assert torch.isnan(expected["k_min"][[1, 3]]).all()  # never written


def test_seal_kernel_matches_reference_and_reads_back(reference_rotation):
    fmt = make_format("rk4p")
    heads, dim = 2, 64
    k = _k_like(PAGE, heads, dim, seed=2).to(DEVICE)
    v = torch.randn(PAGE, heads, dim).to(DEVICE)
    bufs = [_poisoned(fmt, 3, 2, heads, dim) for _ in range(2)]
    for buffers, triton in zip(bufs, (False, True)):
        fmt.write(buffers, 3 * PAGE + PAGE + torch.arange(PAGE, device=DEVICE), k, v,
                  use_triton=triton)
        staged_k, staged_v = fmt.read(buffers, torch.tensor([3 + 1], device=DEVICE), PAGE,
                                      torch.float32)
        fmt.seal(buffers, torch.tensor([1], device=DEVICE), torch.tensor([2], device=DEVICE),
                 use_triton=triton)
    _same_bits(bufs[0], bufs[1])
    sealed_k, sealed_v = fmt.read(bufs[0], torch.tensor([2], device=DEVICE), PAGE, torch.float32)
    # staged: bf16; sealed: 4-bit, within the quantizers' bounds
    torch.testing.assert_close(staged_k, k, atol=0.2, rtol=1e-2)
    torch.testing.assert_close(staged_v, v, atol=0.02, rtol=1e-2)
    assert (sealed_k - k).abs().amax() < (k.amax(0) - k.amin(0)).amax() / 15
    rel = (sealed_v - v).norm() / v.norm()
    assert 0.02 < rel < 0.15  # 4-bit per-token V: visible, bounded


def test_partial_real_page_write_is_refused():
    fmt = make_format("rk4p")
    buffers = _poisoned(fmt, 2, 2, 1, 64)
    with pytest.raises(ValueError, match="whole"):
        fmt.write(buffers, torch.arange(5), torch.randn(5, 1, 64), torch.randn(5, 1, 64),
                  use_triton=False)


class _Recorder:
    def __init__(self):
        self.sealed = []

    def seal(self, staging_ids, page_ids):
        self.sealed += list(zip(staging_ids, page_ids))


def test_open_pages_rules():
    rec = _Recorder()
    pages = [10, 11, 12, 13, 14]
    open_pages = OpenPages((0, 1), num_pages=100, page_size=PAGE)
    # prefill of 70 tokens: pages 0, 1 whole -> real; page 2 (6 tokens) staged
    table = open_pages.prepare(rec, pages, 0, 70, prefill=True)
    assert table == (10, 11, 100, 13, 14) and rec.sealed == []
    # decode up to the page's end, then a verify with 3 drafts crossing into page 3
    table = open_pages.prepare(rec, pages, 94, 98, prefill=False)
    assert table == (10, 11, 100, 101, 14)
    # two drafts rejected: the next step starts at 96, page 2 is committed
    table = open_pages.prepare(rec, pages, 96, 97, prefill=False)
    assert rec.sealed == [(0, 12)] and table == (10, 11, 12, 101, 14)
    # a forward spanning three open pages cannot be staged
    with pytest.raises(OpenPagesError):
        open_pages.prepare(rec, pages, 97, 97 + 2 * PAGE, prefill=False)


def test_exact_first_pages_stay_staged_and_are_never_sealed():
    rec = _Recorder()
    pages = [10, 11, 12, 13, 14]
    open_pages = OpenPages((5, 6, 7), num_pages=100, page_size=PAGE, exact_first_pages=1)
    # a prefill of 70 tokens: page 0 (whole) is the sink -> staged; page 1
    # whole -> real; page 2 (6 tokens) staged
    table = open_pages.prepare(rec, pages, 0, 70, prefill=True)
    assert table == (105, 11, 106, 13, 14) and rec.sealed == []
    # decode past page 2: it is sealed, the sink page is not
    table = open_pages.prepare(rec, pages, 96, 97, prefill=False)
    assert rec.sealed == [(6, 12)] and table == (105, 11, 12, 106, 14)
    open_pages.seal_committed(rec, pages, 5 * PAGE)
    assert rec.sealed == [(6, 12), (6, 13)] and open_pages.table(pages)[0] == 105
    # the sink takes one staging page for good: two open pages remain
    with pytest.raises(OpenPagesError, match="1 exact first"):
        open_pages.prepare(rec, pages, 97, 97 + 2 * PAGE, prefill=False)
    with pytest.raises(ValueError, match="at least 2 staging pages"):
        OpenPages((0,), 100, PAGE, exact_first_pages=1)


def test_two_exact_recent_pages_follow_the_first_scored_query():
    """With a sink page and two newest pages (the first rk4p v3 default; now
    three): the newest pages as seen from the first query whose logits count
    are bf16; staging never needs more than sink + 2 + 1."""
    rec = _Recorder()
    pages = list(range(100, 140))
    fmt = make_format("rk4p", exact_recent_pages=2)
    open_pages = OpenPages.for_format(fmt, range(staging_per_sequence(fmt)), 1000, PAGE)
    staged = lambda table: sorted(i for i, t in enumerate(table) if t >= 1000)  # noqa: E731
    # prefill [0, 500): its last query (499, page 15) reads pages 14, 15 exact;
    # pages 1..13 go straight to real pages
    table = open_pages.prepare(rec, pages, 0, 500, prefill=True)
    assert staged(table) == [0, 14, 15] and rec.sealed == []
    # the next chunk [500, 1012) starts inside page 15: 14 is sealed, 15 stays
    # (its last tokens come now), 16..29 go real, 30 and 31 are the newest
    table = open_pages.prepare(rec, pages, 500, 1012, prefill=True)
    assert rec.sealed == [(1, 114)] and staged(table) == [0, 15, 30, 31]
    # decode at 1012 (page 31): page 30 is still among the two newest; page
    # 15 is sealed
    table = open_pages.prepare(rec, pages, 1012, 1013, prefill=False)
    assert rec.sealed[1:] == [(2, 115)] and staged(table) == [0, 30, 31]
    # a verify at 1054 (page 32): page 30 is sealed, 31 and 32 are exact;
    # a verify with drafts crossing into page 33 fits in the spill page
    table = open_pages.prepare(rec, pages, 1054, 1058, prefill=False)
    assert rec.sealed[2:] == [(1, 130)] and staged(table) == [0, 31, 32, 33]
    assert open_pages.sealed_pages(1054) == 31  # pages 0..30 final (0 in staging)


def test_store_placed_sinks_flush_and_resume_across_processes():
    """The KV store's way: the sink page is a staging id in the page table
    (shared through the prefix cache), OpenPages stages only the open pages;
    flush makes every whole committed page final in its real page while the
    forward keeps reading it in bf16, and the decode resumes from `held`."""
    fmt = make_format("rk4p", exact_recent_pages=2)
    rec = _Recorder()
    pages = [1000 + 7, 11, 12, 13, 14, 15]  # page 0: staging page 7, the sink
    prefill = OpenPages.for_format(fmt, (4, 5, 6), 1000, PAGE)
    # a 100-token prompt: page 1 goes straight to its real page; 2 and 3 are the
    # newest as seen from query 99 and are staged
    table = prefill.prepare(rec, pages, 0, 100, prefill=True)
    assert table == (1007, 11, 1004, 1005, 14, 15) and rec.sealed == []
    prefill.flush(rec, pages, 100)  # page 2 is whole and committed; 3 is not
    assert rec.sealed == [(4, 12)] and prefill.held == [2, 3, -1]
    decode = OpenPages.resumed(fmt, (4, 5, 6), 1000, PAGE, prefill.held, committed=100)
    assert decode.flushed == {2} and decode.table(pages) == table
    # decode at page 4: page 2 leaves the newest two and is unstaged without a
    # second write (its real page may be the prefix cache's by now); at page 5
    # page 3 is sealed
    table = decode.prepare(rec, pages, 128, 129, prefill=False)
    assert rec.sealed == [(4, 12)] and table == (1007, 11, 12, 1005, 1004, 15)
    table = decode.prepare(rec, pages, 160, 161, prefill=False)
    assert rec.sealed == [(4, 12), (5, 13)] and table[0] == 1007


def test_page_size_defaults_to_what_the_format_fits():
    """rk4p's per-page K scales fit the 4.5-bit budget from 32 tokens on: the
    offline engine and the store default to 32 for it and 16 otherwise, and
    an explicit 16 is refused with the reason."""
    from engine.llm import EngineConfig
    from kvstore.server import ServerOptions

    assert EngineConfig(kv_format="rk4p").page_size == 32
    assert EngineConfig(kv_format="int8").page_size == 16
    assert ServerOptions(socket="/tmp/x.sock", kv_format="rk4p").page_size == 32
    assert ServerOptions(socket="/tmp/x.sock").page_size == 16
    with pytest.raises(ValueError, match="over the 4.5-bit budget"):
        EngineConfig(kv_format="rk4p", page_size=16)
