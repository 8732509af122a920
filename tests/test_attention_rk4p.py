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


def build_case(seqs, q_heads, kv_heads, head_dim, staged_pages, seed, sink=False):
    """seqs [(cached, new)]: each sequence's last `staged_pages` pages (of those
    its keys reach) live in staging, and with `sink` its first page too (rk4p's
    exact first page), the rest in real pages; every other real and staging
    page holds unrelated data, so a wrong lookup reads garbage."""
    fmt = make_format("rk4p")
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // PAGE) for c, n in seqs]
    num_pages, num_staging = sum(need) + 2, (staged_pages + sink) * len(seqs) + 1
    buffers = fmt.allocate(num_pages, PAGE, kv_heads, head_dim, DEVICE)
    buffers.update(fmt.allocate_staging(num_staging, PAGE, kv_heads, head_dim, DEVICE))
    offsets_k = torch.linspace(-8, 8, head_dim)

    def fill(slots):
        k = torch.randn(slots.numel(), kv_heads, head_dim, generator=g) * 2 + offsets_k
        v = torch.randn(slots.numel(), kv_heads, head_dim, generator=g)
        fmt.write(buffers, slots.to(DEVICE), k.to(DEVICE), v.to(DEVICE), use_triton=False)

    fill(torch.arange(num_pages * PAGE))  # every real page, whole
    fill(num_pages * PAGE + torch.arange(num_staging * PAGE))  # every staging page
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
