"""Kernels launched by one eager decode step, with the fused small ops
(TANDEM_FUSED_NORMS=1) and without (=0): the launch count the fused kernels
exist to cut. Run on the device: `python scripts/count_kernels.py
[--model tiny-qwen3.5] [--device cuda]` (on the CPU it counts aten ops of the
plain path both times, a check of the script only)."""
from __future__ import annotations

import argparse
import os
from collections import Counter

import torch


def decode_step_kernels(loaded, device: str) -> Counter:
    from engine.batch import ForwardBatch, SequenceInput
    from engine.cache import CacheShape, PagedKVCache
    from engine.kv import make_format

    cache = PagedKVCache(loaded.config, CacheShape(8, 16, 1), device, make_format("int8"))
    pages = tuple(range(4))
    prompt = tuple((7 * i + 3) % loaded.config.vocab_size for i in range(32))
    with torch.inference_mode():
        loaded.model(ForwardBatch.build([SequenceInput(prompt, 0, pages, 0)], 16, device), cache)
        step = ForwardBatch.build([SequenceInput((5,), 32, pages, 0)], 16, device)
        loaded.model(step, cache)  # warm-up: Triton compiles here
        if device == "cuda":
            torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            loaded.model(step, cache)
            if device == "cuda":
                torch.cuda.synchronize()
    wanted = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU
    return Counter(e.name for e in prof.events()
                   if e.device_type == wanted and (device == "cuda" or e.cpu_parent is None))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-qwen3.5")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    from engine.loader import load_model

    loaded = load_model(args.model, device=args.device, dtype=torch.bfloat16, progress=False)
    layers = loaded.config.num_layers
    for switch in ("0", "1"):
        os.environ["TANDEM_FUSED_NORMS"] = switch
        counts = decode_step_kernels(loaded, args.device)
        total = sum(counts.values())
        print(f"TANDEM_FUSED_NORMS={switch}: {total} kernels per decode step "
              f"({total / layers:.1f} per layer, {layers} layers)")
        for name, n in counts.most_common(12):
            print(f"  {n:5d}  {name[:100]}")


if __name__ == "__main__":
    main()
