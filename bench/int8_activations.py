"""What int8 activations (the DP4A GEMV, engine/quant/gemv.py `int8_x`) do
to the embedded model's decoding, measured on the CPU with the kernel's
PyTorch reference numerics.

Every 4-bit matmul of a one-row batch (a decode step at batch 1: what the
DP4A kernel serves) runs through `gemv_x8_reference`, the activation
quantized to int8 per 32-element group; prefill keeps the float path, as on
the GPU. For the bench's chat and code prompts it reports how many of the
greedy tokens equal the float path's, the first divergence, and, teacher
forced along the float path's tokens, the top-1 agreement and largest logit
difference of every decode step.

    python -m bench.int8_activations --new-tokens 32
"""
from __future__ import annotations

import argparse
import contextlib
import sys

import torch

from bench.common import print_table, write_json
from bench.speculative import CHAT, CODE


@contextlib.contextmanager
def int8_activations():
    """4-bit matmuls of one-row batches through the int8-activation reference."""
    from engine.quant import linear
    from engine.quant.gemv import gemv_x8_reference, takes_int8_x

    plain = linear.quant_matmul

    def matmul(x, qt, bias=None):
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] != 1 or not takes_int8_x(qt, 1):
            return plain(x, qt, bias)
        y = gemv_x8_reference(rows, qt).to(x.dtype).reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias
    linear.quant_matmul = matmul
    try:
        yield
    finally:
        linear.quant_matmul = plain


def decode_logits(engine, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits of each decode step along `tokens` (teacher forced), batch 1."""
    from engine.batch import ForwardBatch, SequenceInput
    from engine.cache import CacheShape, PagedKVCache
    from engine.kv import make_format

    loaded = engine.loaded
    page = 16
    pages = -(-(len(prompt) + len(tokens)) // page)
    cache = PagedKVCache(loaded.config, CacheShape(pages, page, 1), loaded.device,
                         make_format("bf16", dtype=loaded.dtype))
    table = tuple(range(pages))
    out = []
    with torch.inference_mode():
        loaded.model(ForwardBatch.build([SequenceInput(tuple(prompt), 0, table, 0)], page,
                                        loaded.device), cache)
        position = len(prompt)
        for token in tokens[:-1]:
            batch = ForwardBatch.build([SequenceInput((token,), position, table, 0)], page,
                                       loaded.device)
            out.append(loaded.model(batch, cache)[-1].float())
            position += 1
    return torch.stack(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.int8_activations",
                                description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from engine.llm import EngineConfig, OfflineEngine
    from engine.loader import load_model
    from engine.sampling import SamplingParams

    loaded = load_model(None, "cpu", weights="native", progress=False)
    engine = OfflineEngine(loaded, EngineConfig(max_batch=1))
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True)
    rows, results = [], []
    for kind, texts in (("chat", CHAT), ("code", CODE)):
        for text in texts:
            prompt = engine.chat_prompt([{"role": "user", "content": text}])
            plain = engine.generate_ids(prompt, params)
            with int8_activations():
                quantized = engine.generate_ids(prompt, params)
                forced_q = decode_logits(engine, prompt, plain)
            forced = decode_logits(engine, prompt, plain)
            same = sum(a == b for a, b in zip(plain, quantized))
            first = next((i for i, (a, b) in enumerate(zip(plain, quantized)) if a != b), None)
            top1 = (forced_q.argmax(-1) == forced.argmax(-1)).float().mean().item()
            diff = (forced_q - forced).abs().max().item()
            rows.append([kind, text[:40], f"{same}/{len(plain)}",
                         "-" if first is None else first, f"{100 * top1:.1f}", f"{diff:.3f}"])
            results.append({"kind": kind, "prompt": text, "same_tokens": same,
                            "tokens": len(plain), "first_divergence": first,
                            "forced_top1": top1, "forced_max_logit_diff": diff})
    print_table("int8 activations vs float, embedded model, greedy, decode at batch 1",
                ["prompts", "prompt", "same tokens", "first diff", "top-1 %", "max |dlogit|"],
                rows)
    identical = sum(r["first_divergence"] is None for r in results)
    print(f"{identical} of {len(results)} continuations identical over {args.new_tokens} tokens")
    write_json(args.json, {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
