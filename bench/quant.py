"""W4A16 GEMV speed for the Qwen3.5-27B matrix shapes against the memory
bandwidth limit, and the 27B dummy's decode step with int4 weights.

    python -m bench.quant [--rows 1 4] [--decode-steps 16] [--json FILE]

GPU only. Bandwidth is measured here (a device-to-device copy of 1 GiB); a
GEMV's floor is (packed weight bytes + activations) / bandwidth. The decode
step runs the offline engine on `qwen3.5-27b` with `--weights int4` and bf16
KV at a short context, timing steps after a warm-up, and reports the peak
memory torch allocated."""
from __future__ import annotations

import argparse
import sys

import torch

from bench.common import environment, median, print_table, write_json


def _copy_bandwidth(device) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(end) / 1e3 / 10
    return 2 * src.numel() / seconds  # read + write


def _time(fn, repeats=50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return median(times)


def gemv_rows(rows_list, device) -> list[dict]:
    from engine.config import ModelConfig, shape_hf_config
    from engine.quant.kernels import triton_matmul
    from engine.quant.recipes import Q4_K, Q6_K

    cfg = ModelConfig.from_hf(shape_hf_config("qwen3.5-27b"))
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = {"gate/up": (i, h), "down": (h, i), "gdn qkv": (cfg.linear_conv_dim, h),
              "gdn z": (cfg.linear_num_v_heads * cfg.linear_v_head_dim, h),
              "gdn out": (h, cfg.linear_num_v_heads * cfg.linear_v_head_dim),
              "attn q+gate": (2 * cfg.num_heads * cfg.head_dim, h),
              "lm_head": (cfg.vocab_size, h)}
    bandwidth = _copy_bandwidth(device)
    out = []
    for name, (n, k) in shapes.items():
        for fmt in (Q4_K, Q6_K) if name == "down" else (Q4_K,):
            qt = fmt.meta(n, k)
            qt = type(qt)(**{f: (None if t is None else torch.randint(
                0, 60, t.shape, device=device).to(t.dtype)) for f, t in qt._fields().items()})
            for rows in rows_list:
                x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
                seconds = _time(lambda: triton_matmul(x, qt))
                floor = (qt.nbytes + x.numel() * 2 + rows * n * 2) / bandwidth
                out.append({"matrix": name, "format": fmt.name, "N": n, "K": k, "rows": rows,
                            "us": seconds * 1e6, "floor_us": floor * 1e6,
                            "roofline": floor / seconds,
                            "GBps": qt.nbytes / seconds / 1e9})
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", file=sys.stderr)
    return out


def decode_27b(steps: int, device) -> dict:
    from engine.llm import EngineConfig, OfflineEngine
    from engine.loader import load_model
    from engine.sampling import SamplingParams

    torch.cuda.reset_peak_memory_stats(device)
    loaded = load_model("qwen3.5-27b", device=device, weights="int4", progress=False)
    weights = sum(t.numel() * t.element_size() for t in loaded.model.state_dict().values())
    engine = OfflineEngine(loaded, EngineConfig(max_batch=1, max_context=1024))
    prompt = [(7 * i + 3) % 256 for i in range(256)]
    params = SamplingParams(temperature=0.0, max_new_tokens=steps, ignore_eos=True)
    stamps = []
    for _ in engine.generate([prompt], params):
        torch.cuda.synchronize(device)
        stamps.append(torch.cuda.Event(enable_timing=True))
        stamps[-1].record()
    torch.cuda.synchronize(device)
    gaps = [a.elapsed_time(b) / 1e3 for a, b in zip(stamps[1:], stamps[2:])]
    return {"weights_GiB": weights / 2**30, "step_ms": median(gaps) * 1e3,
            "tok_s": 1 / median(gaps), "peak_alloc_GiB": torch.cuda.max_memory_allocated() / 2**30}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.quant", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    p.add_argument("--decode-steps", type=int, default=16, help="0 skips the 27B decode")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.quant needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    rows = gemv_rows(args.rows, device)
    print_table("W4A16/W8A16 GEMV, Qwen3.5-27B shapes", ["matrix", "format", "N", "K", "rows", "us", "floor_us", "roofline"],
                [[r["matrix"], r["format"], r["N"], r["K"], r["rows"], f"{r['us']:.1f}",
                  f"{r['floor_us']:.1f}", f"{r['roofline']:.2f}"] for r in rows])
    decode = decode_27b(args.decode_steps, device) if args.decode_steps else None
    if decode:
        print_table("27B dummy, int4 weights, batch-1 decode", list(decode),
                    [[f"{v:.2f}" for v in decode.values()]])
    if args.json:
        write_json(args.json, {"environment": environment(), "gemv": rows, "decode_27b": decode})
    return 0


if __name__ == "__main__":
    sys.exit(main())
