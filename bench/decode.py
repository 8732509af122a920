"""Decode speed: tokens/s of the offline engine at batch 1 (and more), next to
transformers' `generate` on the same weights where it can load them.

On the CPU this is the engine-core baseline; the GPU roofline version (bytes
per step over copy bandwidth) extends it in the GPU fast-path work."""
from __future__ import annotations

import argparse
import sys

import torch

from bench.common import environment, median, now, print_table, write_json


def _engine_decode(model_spec, device, prompt_len, new_tokens, batch, repeats):
    from engine.llm import EngineConfig, OfflineEngine
    from engine.loader import load_model
    from engine.sampling import SamplingParams

    loaded = load_model(model_spec, device=device, progress=False)
    engine = OfflineEngine(loaded, EngineConfig(max_batch=batch,
                                                max_context=prompt_len + new_tokens + 16))
    prompt = [(7 * i + 3) % loaded.config.vocab_size for i in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    rates = []
    for _ in range(repeats):
        stamps = []
        for _event in engine.generate([prompt] * batch, params):
            stamps.append(now())
        # the first `batch` events come from prefill; time only the decode steps
        steps = (len(stamps) - batch) / batch
        rates.append(steps * batch / (stamps[-1] - stamps[batch - 1]))
    return median(rates), loaded


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
        # subtract the prefill (+ first token) so both sides count decode steps only
        rates.append((new_tokens - 1) / ((t2 - t1) - (t1 - t0)))
    return median(rates)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem bench decode", description=__doc__)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vs-transformers", action="store_true",
                   help="also time transformers.generate on the same GGUF (CPU)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    rows, results = [], []
    loaded = None
    for batch in args.batch:
        rate, loaded = _engine_decode(args.model, args.device, args.prompt_tokens,
                                      args.new_tokens, batch, args.repeats)
        rows.append(["tandem", batch, args.prompt_tokens, rate])
        results.append({"engine": "tandem", "batch": batch, "tok_s": rate})
    if args.vs_transformers:
        from engine.weights.gguf import embedded_model_path

        gguf = args.model or str(embedded_model_path())
        rate = _transformers_decode(gguf, args.prompt_tokens, args.new_tokens, args.repeats)
        rows.append(["transformers", 1, args.prompt_tokens, rate])
        results.append({"engine": "transformers", "batch": 1, "tok_s": rate})
    write_json(args.json, {"env": environment(), "model": loaded.source if loaded else None,
                           "args": vars(args), "results": results})
    print_table(f"decode tokens/s ({loaded.source}, {args.device}, {torch.get_num_threads()} threads)",
                ["engine", "batch", "context", "tok/s"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
