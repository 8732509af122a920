"""Decode speed against the memory roofline.

For each batch size and context length, sequences of that context decode
`--steps` tokens through the engine's decode forward (CUDA graphs on a GPU
unless --no-cuda-graphs). The context is synthetic: page tables and lengths
say `context` tokens are cached and their pages hold zeros, which costs the
same reads as real KV (speed does not depend on values), so a 128K context
needs no 128K prefill. The roofline is the bytes a step must move (weights +
each sequence's KV at its context + GDN state read and written) over the
measured copy bandwidth; `roofline %` is that time over the measured step.

`--vs-transformers` also times transformers' generate on the same GGUF (CPU),
the floor every engine must beat.
"""
from __future__ import annotations

import argparse
import sys

import torch

from bench.common import environment, median, now, print_table, write_json
from bench.limits import copy_bandwidth, decode_step_bytes, sync


def decode_steps(loaded, kv_format_name: str, batch: int, context: int, steps: int,
                 page_size: int = 16, cuda_graphs: bool | None = None,
                 after_step=None) -> list[float]:
    """Seconds of each of `steps` decode steps of `batch` sequences at `context`;
    `after_step()` runs after each (the profiler's step marker)."""
    from engine.batch import ForwardBatch, SequenceInput
    from engine.cache import CacheShape, PagedKVCache
    from engine.cuda_graphs import DecodeForward
    from engine.kv import make_format

    from engine.kv.open_pages import OpenPages, staging_per_sequence

    options = {"dtype": loaded.dtype} if kv_format_name == "bf16" else {}
    kv_format = make_format(kv_format_name, **options)
    page_size = getattr(kv_format, "page_size", page_size)  # rk4p: its own page size
    per_seq = staging_per_sequence(kv_format)
    staging = per_seq * batch
    pages_per_seq = -(-(context + steps) // page_size)
    num_pages = pages_per_seq * batch
    cache = PagedKVCache(loaded.config, CacheShape(num_pages, page_size, batch,
                                                   staging_pages=staging),
                         loaded.device, kv_format)
    forward = DecodeForward(loaded.model, cache, max_context=context + steps, enabled=cuda_graphs)
    tables = [tuple(range(i * pages_per_seq, (i + 1) * pages_per_seq)) for i in range(batch)]
    # rk4p: each sequence's newest page is open (staged), sealed when filled;
    # its first page (sinks) stays staged
    open_pages = [OpenPages.for_format(kv_format, range(i * per_seq, (i + 1) * per_seq),
                                       num_pages, page_size) for i in range(batch)] \
        if staging else None
    times = []
    with torch.inference_mode():
        for step in range(steps):
            position = context - 1 + step
            if open_pages is not None:
                step_tables = [o.prepare(cache, tables[i], position, position + 1, prefill=False)
                               for i, o in enumerate(open_pages)]
            else:
                step_tables = tables
            seqs = [SequenceInput(((step + i) % loaded.config.vocab_size,), position,
                                  step_tables[i], i) for i in range(batch)]
            fb = ForwardBatch.build(seqs, page_size, loaded.device)
            sync(loaded.device)
            t0 = now()
            forward(fb).argmax(-1).tolist()  # the token reaches the host, as when serving
            times.append(now() - t0)
            if after_step is not None:
                after_step()
    return times


def _transformers_decode(gguf_path, prompt_len, new_tokens, repeats):
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    ids = torch.tensor([[(7 * i + 3) % model.config.vocab_size for i in range(prompt_len)]])
    rates = []
    for _ in range(repeats):
        with torch.inference_mode():
            t0 = now()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            t1 = now()
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            t2 = now()
        rates.append((new_tokens - 1) / ((t2 - t1) - (t1 - t0)))
    return median(rates)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem bench decode", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    p.add_argument("--device", default="cpu")
    p.add_argument("--context", "--prompt-tokens", type=int, nargs="+", default=[128],
                   help="context lengths (tokens already cached)")
    p.add_argument("--steps", "--new-tokens", type=int, default=16,
                   help="decode steps timed per point (the first ones warm up)")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--kv-format", default="int8")
    p.add_argument("--weights", default="auto",
                   help="weight format (tandem serve's --weights; e.g. int4 for the dummy 27B, "
                        "whose packed codes and scales the roofline then counts)")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--repeats", type=int, default=1, help="(kept for old scripts; unused)")
    p.add_argument("--vs-transformers", action="store_true",
                   help="also time transformers.generate on the same GGUF (CPU)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.steps < 4:
        p.error("--steps must be >= 4 (the first steps warm up)")

    from engine.kv import make_format
    from engine.loader import load_model

    loaded = load_model(args.model, device=args.device, progress=False, weights=args.weights)
    bandwidth = copy_bandwidth(loaded.device)
    options = {"dtype": loaded.dtype} if args.kv_format == "bf16" else {}
    kv_format = make_format(args.kv_format, **options)
    graphs = False if args.no_cuda_graphs else None
    rows, results = [], []
    for batch in args.batch:
        for context in args.context:
            times = decode_steps(loaded, args.kv_format, batch, context, args.steps,
                                 cuda_graphs=graphs)
            step_s = median(times[len(times) // 4:])  # past the warm-up and graph capture
            moved = decode_step_bytes(loaded.model, loaded.config, kv_format, batch, context)
            floor_s = moved / bandwidth
            rows.append([batch, context, step_s * 1e3, batch / step_s, moved / 1e9, floor_s * 1e3,
                         100 * floor_s / step_s])
            results.append({"batch": batch, "context": context, "step_ms": step_s * 1e3,
                            "tok_s": batch / step_s, "bytes_per_step": moved,
                            "roofline_ms": floor_s * 1e3, "roofline_pct": 100 * floor_s / step_s})
    transformers_rate = None
    if args.vs_transformers:
        from engine.weights.gguf import embedded_model_path

        gguf = args.model or str(embedded_model_path())
        transformers_rate = _transformers_decode(gguf, args.context[0], args.steps, 3)
    write_json(args.json, {"env": environment(), "model": loaded.source, "args": vars(args),
                           "copy_bandwidth_gb_s": bandwidth / 1e9, "results": results,
                           "transformers_tok_s": transformers_rate})
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; {args.kv_format} KV; weights {args.weights}; "
          f"CUDA graphs {'off' if args.no_cuda_graphs or args.device == 'cpu' else 'on'}")
    print_table(f"decode ({loaded.source}, {args.device}, {torch.get_num_threads()} threads)",
                ["batch", "context", "step ms", "tok/s", "GB/step", "floor ms", "roofline %"],
                rows)
    if transformers_rate is not None:
        print(f"transformers generate (batch 1, context {args.context[0]}): "
              f"{transformers_rate:.2f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
