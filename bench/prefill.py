"""Prefill throughput and model FLOP utilisation.

Each prompt length runs as the prefill worker runs it: one sequence in
bounded chunks of `--chunk` tokens into paged KV (and GDN state); with
`--cached-tokens N` the timed tokens follow N already in the cache (an agent
turn: new text after a cached conversation). MFU is the
model FLOPs of the prompt (matmuls, causal attention, GDN; bench/limits.py)
over the time, against the measured matmul rate of this device in the
compute dtype (`--peak-tflops` to use a spec-sheet figure instead)."""
from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager, nullcontext

import torch

from bench.common import environment, median, now, print_table, write_json
from bench.limits import matmul_flops, prefill_flops, sync


def prefill_seconds(loaded, kv_format_name: str, tokens: int, chunk: int,
                    page_size: int = 16, cached: int = 0, timed_in=nullcontext) -> float:
    """Seconds to prefill `tokens` new tokens after `cached` ones (those
    prefilled first, untimed); `timed_in()` is entered around the timed part."""
    from engine.batch import ForwardBatch, SequenceInput
    from engine.cache import CacheShape, PagedKVCache
    from engine.chunking import prefill_chunks
    from engine.kv import make_format
    from engine.kv.open_pages import OpenPages, staging_per_sequence

    options = {"dtype": loaded.dtype} if kv_format_name == "bf16" else {}
    kv_format = make_format(kv_format_name, **options)
    page_size = getattr(kv_format, "page_size", page_size)  # rk4p: its own page size
    staging = staging_per_sequence(kv_format)
    total = cached + tokens
    pages = -(-total // page_size)
    cache = PagedKVCache(loaded.config, CacheShape(pages, page_size, 1, staging_pages=staging),
                         loaded.device, kv_format)
    table = tuple(range(pages))
    # rk4p: the sink page and the newest pages stay staged, as the prefill worker keeps them
    open_pages = OpenPages.for_format(kv_format, range(staging), pages, page_size) \
        if staging else None
    prompt = [(7 * i + 3) % loaded.config.vocab_size for i in range(total)]

    def run(start: int, end: int) -> None:
        for c in prefill_chunks(start, end, chunk, []):
            step_table = table if open_pages is None else \
                open_pages.prepare(cache, table, c.start, c.end, prefill=True)
            batch = ForwardBatch.build([SequenceInput(tuple(prompt[c.start:c.end]), c.start,
                                                      step_table, 0)], page_size, loaded.device)
            logits = loaded.model(batch, cache)
        logits.argmax(-1).tolist()

    with torch.inference_mode():
        if cached:
            run(0, cached)
        sync(loaded.device)
        with timed_in():
            t0 = now()
            run(cached, total)
            return now() - t0


def profile_prefill(loaded, args, tokens: int) -> dict:
    """Where one prefill's GPU time goes (bench.profile_step's kinds); only
    the timed tokens are profiled, not the cached part before them."""
    from bench.profile_step import summarize
    from engine.profiling import profiled

    runs = []

    @contextmanager
    def timed_in():
        with profiled(loaded.device) as profile:
            yield
        runs.append(profile)

    seconds = prefill_seconds(loaded, args.kv_format, tokens, args.chunk,
                              cached=args.cached_tokens, timed_in=timed_in)
    title = (f"one {tokens}-token prefill after {args.cached_tokens} cached, in chunks of "
             f"{args.chunk}, {seconds:.2f} s profiled")
    print(f"profiled: {runs[0].describe()}")
    return summarize(runs[0].units, 1, title, 25)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem bench prefill", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, nargs="+", default=[256])
    p.add_argument("--chunk", type=int, default=512, help="tokens per prefill forward")
    p.add_argument("--kv-format", default="int8")
    p.add_argument("--weights", default="auto",
                   help="weight format (tandem serve's --weights; e.g. int4 for the dummy 27B)")
    p.add_argument("--cached-tokens", type=int, default=0,
                   help="tokens already in the cache before each timed prompt")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per length (after one warm-up)")
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--profile", action="store_true",
                   help="one more prefill of the longest prompt under torch.profiler "
                        "(its timed part only), its kernels (CPU: aten ops) summed by kind")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.cached_tokens < 0:
        p.error(f"--cached-tokens must be >= 0, got {args.cached_tokens}")

    from engine.loader import load_model

    loaded = load_model(args.model, device=args.device, progress=False, weights=args.weights)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else matmul_flops(loaded.device,
                                                                         loaded.dtype)
    cached = args.cached_tokens
    prefill_seconds(loaded, args.kv_format, min(args.tokens), args.chunk,
                    cached=min(cached, args.chunk))  # warm-up
    rows, results = [], []
    for tokens in args.tokens:
        seconds = median([prefill_seconds(loaded, args.kv_format, tokens, args.chunk,
                                          cached=cached) for _ in range(args.repeats)])
        flops = prefill_flops(loaded.model, loaded.config, tokens, start=cached)
        mfu = 100 * flops / seconds / peak
        rows.append([cached, tokens, args.chunk, seconds, tokens / seconds,
                     flops / seconds / 1e12, mfu])
        results.append({"cached": cached, "tokens": tokens, "chunk": args.chunk,
                        "seconds": seconds,
                        "tok_s": tokens / seconds, "tflops": flops / seconds / 1e12,
                        "mfu_pct": mfu})
    profile = profile_prefill(loaded, args, max(args.tokens)) if args.profile else None
    write_json(args.json, {"env": environment(), "model": loaded.source, "args": vars(args),
                           "peak_tflops": peak / 1e12, "results": results, "profile": profile})
    print(f"peak {peak / 1e12:.1f} TFLOP/s ({'given' if args.peak_tflops else 'measured matmul'},"
          f" {loaded.dtype}); {args.kv_format} KV; weights {args.weights}")
    print_table(f"prefill ({loaded.source}, {args.device})",
                ["cached", "tokens", "chunk", "seconds", "tok/s", "TFLOP/s", "MFU %"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
