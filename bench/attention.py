"""The prefill attention kernel alone: one chunk of new queries over a long
paged context, per tile configuration, against torch's own SDPA.

Prefill MFU at 32K (issue 6) is set by this kernel: causal attention is ~11%
of the 27B's FLOPs at 32K and ~50% at 128K. The bench lays out one
full-attention layer of the given shape in a KV format, writes random K/V for
`--context` tokens, and times the last `--new` tokens attending causally
(exactly what the last prefill chunk does), for each (rows, block_n, warps,
stages, bf16 dots) candidate. FLOPs count 4 * head_dim * q_heads per visible
(query, key) pair. torch's scaled_dot_product_attention on the same K/V as
contiguous bf16 (lower-right causal) is printed beside it as the bar a
dedicated flash kernel sets. CUDA only.

    python -m bench.attention --context 32768 --new 4096 --kv-format int8 bf16

With `--new 1 --candidates 13` it times decode's attention (one query per
KV-head group over the whole context) by key splits: the GB/s column is the
layer's KV bytes over the time, against the card's ~4.2 TB/s.

The kernel's A/B switches are read at each launch, so they apply here from
the environment, e.g. rk4's channel-pair program and int8 without I2F:

    TANDEM_RK4_PAIRS=0 TANDEM_INT8_NO_I2F=0 python -m bench.attention --new 1 \
        --context 131072 --kv-format rk4 int8 --candidates 19 21 25 --splits 64
"""
from __future__ import annotations

import argparse
import sys

import torch

from bench.common import print_table, write_json
from bench.limits import sync

# (rows, block_n, num_warps, num_stages, dot_bf16); the first is today's default
CANDIDATES = ((64, 32, 4, None, False), (64, 32, 4, None, True), (64, 64, 4, None, True),
              (128, 32, 8, None, True), (128, 64, 8, None, True), (128, 64, 8, 2, True),
              (64, 64, 4, 3, True), (128, 32, 4, None, True), (64, 128, 8, 2, True),
              (128, 64, 8, 3, True), (128, 128, 8, 2, True), (128, 64, 4, 2, True),
              (64, 64, 8, 2, True),
              (16, 32, 4, None, False),  # 13: decode's tiles at the 27B's shape (--new 1)
              # 14-19: decode alternatives (128K int8 decode read its KV at ~0.9 TB/s)
              (16, 64, 4, None, False), (16, 64, 8, None, False), (16, 32, 4, 4, False),
              (16, 32, 8, 3, False), (16, 128, 8, 3, False), (16, 64, 4, None, True),
              # 20-24: rk4's decode tiles (20; 8 warps) and bf16 dot operands on
              # them (Nsight Compute, 12-03: rk4's 128K decode is bound by shared
              # memory, where the fp32 K and V tiles pass into the dots)
              (16, 64, 8, None, False), (16, 64, 8, None, True), (16, 64, 8, 1, True),
              (16, 128, 8, 2, True), (16, 64, 8, 1, False),
              # 25: rk4's pair program's decode tiles (TANDEM_RK4_PAIRS, one
              # stage: Triton's default three spilled, static sm_90 build)
              (16, 64, 4, 1, True),
              # 26-33: decode at short contexts (one 64-key tile a split at 4K):
              # fewer keys, warps or stages a program
              (16, 32, 4, None, True), (16, 16, 4, None, True), (16, 64, 2, None, True),
              (16, 64, 4, 2, True), (16, 32, 2, 1, True), (16, 128, 4, 1, True),
              (16, 128, 8, 1, True), (16, 32, 4, 1, True))


def visible_pairs(context: int, new: int) -> int:
    """(query, key) pairs of the last `new` queries attending causally."""
    return new * (context - new) + new * (new + 1) // 2


def layout(kv_format: str, context: int, new: int, model: str, device: torch.device):
    """(fmt, buffers, q, meta, rotary, dense k, dense v) for one attention layer."""
    from engine.cache import CacheShape, PagedKVCache
    from engine.config import ModelConfig
    from engine.kv import make_format
    from engine.kv.attention import AttentionMetadata
    from engine.config import shape_hf_config

    config = ModelConfig.from_hf(shape_hf_config(model))
    page_size = 32 if kv_format == "rk4p" else 16
    pages = -(-context // page_size)
    options = {"dtype": torch.bfloat16} if kv_format == "bf16" else {}
    fmt = make_format(kv_format, **options)
    shape = CacheShape(pages, page_size, 1, staging_pages=8 if fmt.uses_staging else 0)
    cache = PagedKVCache(config, shape, device, fmt)
    layer = config.attention_layers[0]
    gen = torch.Generator(device=device).manual_seed(0)
    kv_heads, d = config.num_kv_heads, config.head_dim
    k = torch.randn(context, kv_heads, d, generator=gen, device=device, dtype=torch.bfloat16)
    v = torch.randn(context, kv_heads, d, generator=gen, device=device, dtype=torch.bfloat16)
    q = torch.randn(new, config.num_heads, d, generator=gen, device=device, dtype=torch.bfloat16)
    table = torch.arange(pages, dtype=torch.int32)
    for lo in range(0, context, 4096):  # bounded temporaries while writing
        hi = min(context, lo + 4096)
        cache.write_kv(layer, torch.arange(lo, hi, device=device), k[lo:hi], v[lo:hi])
    meta = AttentionMetadata.build([0, new], [context], [table], device)
    index = cache._attn_index[layer]
    return fmt, cache.kv[index], q, meta, cache.rotary, k, v


def time_ms(fn, repeats: int, graph: int = 0) -> float:
    """ms a call: `repeats` calls back to back, or with `graph` > 0 a CUDA
    graph of `graph` calls replayed `repeats` times (no host launch cost
    between them, dependent launches as the step's graph has them)."""
    fn()
    sync(torch.device("cuda"))
    if graph > 0:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(g, stream=stream):
            for _ in range(graph):
                fn()
        g.replay()
        sync(torch.device("cuda"))
        fn, per_call = g.replay, graph
    else:
        per_call = 1
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats / per_call


def kernel_call(fmt, buffers, q, meta, rotary, candidate, splits: int = 1):
    from engine.kv import attention_kernels as K
    from engine.kv.attention import _kind_args
    from engine.kv.formats import PagedRk4Format

    rows, block_n, warps, stages, dot_bf16 = candidate
    if isinstance(fmt, PagedRk4Format) and stages is None:
        stages = 1  # its default (tiles_for says why)
    args = _kind_args(fmt, buffers, rotary)
    out = torch.empty(q.shape, dtype=torch.float32 if isinstance(fmt, PagedRk4Format)
                      else q.dtype, device=q.device)
    page_size = next(iter(buffers.values())).shape[1]
    kv_heads = next(iter(buffers.values())).shape[2]

    def call():
        K.launch(args, q, meta.q_offsets, meta.kv_lens, meta.page_table, page_size, kv_heads,
                 meta.max_new_tokens, q.shape[-1] ** -0.5, out, splits, rows, block_n, warps,
                 stages, dot_bf16)
    return call, out


def sdpa_call(q, k, v):
    from torch.nn.attention.bias import causal_lower_right
    import torch.nn.functional as F

    qt = q.transpose(0, 1)[None]          # [1, Hq, new, D]
    kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    mask = causal_lower_right(qt.shape[-2], kt.shape[-2])

    def call():
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)
    return call


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3.5-27b")
    p.add_argument("--context", type=int, nargs="+", default=[32768])
    p.add_argument("--new", type=int, default=4096, help="new query tokens (the chunk)")
    p.add_argument("--kv-format", nargs="+", default=["int8", "bf16"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--candidates", type=int, nargs="+", default=None,
                   help="indices into CANDIDATES (default: all)")
    p.add_argument("--splits", type=int, nargs="+", default=[1],
                   help="key splits per candidate: a short chunk over a long context "
                        "has few row blocks to fill the GPU with")
    p.add_argument("--graph", type=int, default=0,
                   help="time a CUDA graph of this many calls (decode's short launches: "
                        "the host's launch cost would hide the kernel)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.candidates and not all(0 <= i < len(CANDIDATES) for i in args.candidates):
        p.error(f"--candidates are indices in [0, {len(CANDIDATES)})")
    if not all(1 <= s <= 1024 for s in args.splits):
        p.error("--splits must be in [1, 1024]")
    if not torch.cuda.is_available():
        p.error("bench.attention needs a CUDA device")
    device = torch.device("cuda")
    chosen = [CANDIDATES[i] for i in args.candidates] if args.candidates else CANDIDATES
    candidates = [(c, s) for c in chosen for s in args.splits]
    rows, results = [], []
    for context in args.context:
        for name in args.kv_format:
            fmt, buffers, q, meta, rotary, k, v = layout(name, context, args.new, args.model,
                                                         device)
            flops = 4 * q.shape[-1] * q.shape[1] * visible_pairs(context, args.new)
            kv_bytes = sum(t.numel() * t.element_size() for t in buffers.values())
            reference = None
            for candidate, splits in candidates:
                label = str(candidate) + (f" x{splits} splits" if splits > 1 else "")
                try:
                    call, out = kernel_call(fmt, buffers, q, meta, rotary, candidate, splits)
                    ms = time_ms(call, args.repeats, args.graph)
                    if reference is None:
                        reference = out.float().clone()
                    err = (out.float() - reference).abs().max().item()
                except Exception as e:  # a tile that does not fit: reported, not fatal
                    rows.append([context, name, label, "failed", str(e)[:60], "", ""])
                    continue
                tflops, gb_s = flops / ms / 1e9, kv_bytes / ms / 1e6
                rows.append([context, name, label, ms, tflops, gb_s, err])
                results.append({"context": context, "format": name, "tiles": candidate,
                                "splits": splits, "ms": ms, "tflops": tflops, "kv_gb_s": gb_s,
                                "max_diff_vs_default": err})
            del buffers
            torch.cuda.empty_cache()
        try:
            ms = time_ms(sdpa_call(q, k, v), args.repeats)
            rows.append([context, "sdpa bf16", "torch", ms, flops / ms / 1e9, "", ""])
            results.append({"context": context, "format": "sdpa", "ms": ms,
                            "tflops": flops / ms / 1e9})
        except Exception as e:
            rows.append([context, "sdpa bf16", "torch", "failed", str(e)[:60], "", ""])
    from engine.kv.attention import int8_no_i2f, rk4_pairs

    switches = f"TANDEM_RK4_PAIRS={int(rk4_pairs())} TANDEM_INT8_NO_I2F={int(int8_no_i2f())}"
    print_table(f"attention, {args.new} new tokens ({args.model}; {switches})",
                ["context", "kv", "rows, block_n, warps, stages, bf16", "ms", "TFLOP/s",
                 "KV GB/s", "max diff"], rows)
    write_json(args.json, {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
