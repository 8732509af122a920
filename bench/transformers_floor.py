"""transformers on a dummy shape: the floor issue 6 asks tandem to beat by a wide margin.

Builds transformers' own model for one of tandem's dummy shapes (the shape
is an HF config, engine/shapes: Qwen3.5-27B is Qwen3_5ForCausalLM), with
random bf16 weights made on the device, and times what `tandem bench
prefill` and `tandem bench decode` time for tandem: one prompt's prefill
(tokens/s, the logits of its last position only) and batch-1 decode after
that prompt through `generate` and its cache (ms per token: N new tokens
minus one, so the prompt's prefill cancels out). transformers picks its own
kernels: fla-core's GDN when it is importable (the GPU machines carry it),
its PyTorch form otherwise.

transformers keeps no cache across requests, so an agent turn that resends
a 100K-token conversation with 1K new tokens costs it the whole prefill: a
prompt of 101,000 tokens here is its time to first token for the turn that
`tandem bench agent-loop` serves from its prefix cache. Decode is timed only
for prompts up to --decode-max-prompt (each decode sample prefills twice).

    python -m bench.transformers_floor --device cuda --prompt-tokens 4096 --new-tokens 32
    python -m bench.transformers_floor --device cuda --prompt-tokens 4096 32768 101000
"""
from __future__ import annotations

import argparse
import sys

import torch

from bench.common import environment, median, now, print_table, write_json
from bench.limits import sync

_MODELS = {"qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
           "llama": ("LlamaConfig", "LlamaForCausalLM"),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def build_model(shape: str, device: torch.device, seed: int = 0):
    """transformers' model of a dummy shape, random weights in bf16 on `device`."""
    import transformers

    from engine.config import shape_hf_config

    hf = shape_hf_config(shape)
    model_type = hf.pop("model_type")
    if model_type not in _MODELS:
        raise SystemExit(f"no transformers class known for {shape!r} ({model_type})")
    config_name, model_name = _MODELS[model_type]
    config = getattr(transformers, config_name)(**hf)
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs: a 27B never visits the host
        model = getattr(transformers, model_name)._from_config(config, dtype=torch.bfloat16)
    return model.eval()


def prompt_ids(length: int, vocab: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([[(7 * i + 3) % vocab for i in range(length)]], device=device)


def prefill_seconds(model, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        sync(ids.device)
        t0 = now()
        model(input_ids=ids, logits_to_keep=1)
        sync(ids.device)
    return now() - t0


def generate_seconds(model, ids: torch.Tensor, new_tokens: int) -> float:
    with torch.inference_mode():
        sync(ids.device)
        t0 = now()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False)
        sync(ids.device)
    return now() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.transformers_floor",
                                description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3.5-27b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[4096])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--decode-max-prompt", type=int, default=32768,
                   help="time decode only after prompts of at most this many tokens")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.new_tokens < 2 or args.repeats < 1 or min(args.prompt_tokens) < 1:
        p.error("--new-tokens >= 2, --repeats >= 1 and prompts of at least one token")

    device = torch.device(args.device)
    model = build_model(args.shape, device)
    vocab = model.config.vocab_size
    # the first calls compile and autotune (fla-core's kernels): not timed
    generate_seconds(model, prompt_ids(min(args.prompt_tokens), vocab, device), 2)
    rows, results = [], []
    for length in args.prompt_tokens:
        ids = prompt_ids(length, vocab, device)
        prefill = median([prefill_seconds(model, ids) for _ in range(args.repeats)])
        result = {"prompt_tokens": length, "prefill_s": prefill,
                  "prefill_tok_s": length / prefill, "decode_ms": None, "decode_tok_s": None}
        if length <= args.decode_max_prompt:
            per_token = median([(generate_seconds(model, ids, args.new_tokens)
                                 - generate_seconds(model, ids, 1)) / (args.new_tokens - 1)
                                for _ in range(args.repeats)])
            result.update(decode_ms=per_token * 1e3, decode_tok_s=1 / per_token)
        results.append(result)
        rows.append([length, f"{prefill:.4f}", f"{length / prefill:.1f}",
                     "-" if result["decode_ms"] is None else f"{result['decode_ms']:.2f}",
                     "-" if result["decode_tok_s"] is None else f"{result['decode_tok_s']:.2f}"])
    import transformers

    write_json(args.json, {"env": environment(), "transformers": transformers.__version__,
                           "args": vars(args), "results": results})
    print_table(f"transformers {transformers.__version__} on {args.shape} ({args.device}, "
                f"bf16, batch 1)",
                ["prompt", "prefill s", "prefill tok/s", "decode ms/token", "decode tok/s"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
