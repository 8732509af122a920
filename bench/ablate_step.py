"""What fusing each small op of the decode step could save, at most.

Times the batch-1 decode step (CUDA graphs, PDL as configured) with one kind
of small kernel removed at a time: its wrapper returns an uninitialised
tensor of the right shape (no kernel, garbage values), so the step's other
kernels run unchanged. The drop in step time is an upper bound on what
fusing that op into its neighbours could win: a fused op still does its
arithmetic, only its launch, ramp and the dependency hop go. Values are
meaningless under an ablation, speed is not: the GEMVs and attention read
the same bytes whatever the activations hold. CUDA only.

    python -m bench.ablate_step --weights int4 --kv-format rk4 --context 4096
"""
from __future__ import annotations

import argparse
import contextlib
import sys

import torch

from bench.common import median, print_table, write_json
from bench.decode import decode_steps


def _no_kernel(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


def _replacements(name: str) -> list[tuple[object, str, object]]:
    """(module, attribute, stand-in) pairs that remove op `name`'s kernels."""
    from engine import gdn_kernels
    from engine.cache import PagedKVCache
    from engine.fused import load_kernels

    fused = load_kernels()
    table = {
        "rms_norm": [
            (fused, "rms_norm", lambda x, w, eps, zc: _no_kernel(x)),
            (fused, "add_rms_norm", lambda x, h, w, eps, zc: (_no_kernel(x), _no_kernel(x))),
        ],
        "silu_mul": [(fused, "silu_mul", lambda gate, up: _no_kernel(gate))],
        "gated_rms_norm": [(fused, "gated_rms_norm", lambda x, gate, w, eps: _no_kernel(x))],
        "sigmoid_gate": [(fused, "sigmoid_gate", lambda out, gate: _no_kernel(out))],
        "norm_rope": [(fused, "norm_rope", lambda x, w, cos, sin, rd, eps, zc, keep_normed=False:
                       (_no_kernel(x), _no_kernel(x) if keep_normed else None)),
                      (fused, "norm_rope_pair",
                       lambda q, k, qw, kw, cos, sin, rd, eps, zc, keep_k_normed=False:
                       (_no_kernel(q), _no_kernel(k), _no_kernel(k) if keep_k_normed else None))],
        "gdn_conv": [(gdn_kernels, "conv_step", lambda mixed, *a, **k: _no_kernel(mixed))],
        "gdn_recurrence": [(gdn_kernels, "recurrence_step",
                            lambda q, k, v, *a, **kw: _no_kernel(v))],
        "kv_write": [(PagedKVCache, "write_kv", lambda self, layer, slots, k, v: None)],
        "attention": [(PagedKVCache, "attend",
                       lambda self, layer, q, meta, scale, output_gate=None: _no_kernel(q))],
    }
    if name == "all_small":
        return [r for key in ("rms_norm", "silu_mul", "gated_rms_norm", "sigmoid_gate",
                              "norm_rope") for r in table[key]]
    return table[name]


ABLATIONS = ("none", "rms_norm", "silu_mul", "gated_rms_norm", "sigmoid_gate", "norm_rope",
             "gdn_conv", "gdn_recurrence", "kv_write", "attention", "all_small")


@contextlib.contextmanager
def ablated(name: str):
    """Op `name`'s wrappers replaced for the duration ("none": nothing)."""
    pairs = [] if name == "none" else _replacements(name)
    saved = [(module, attr, getattr(module, attr)) for module, attr, _ in pairs]
    try:
        for module, attr, stand_in in pairs:
            setattr(module, attr, stand_in)
        yield
    finally:
        for module, attr, original in saved:
            setattr(module, attr, original)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ablate_step",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3.5-27b")
    p.add_argument("--weights", default="int4")
    p.add_argument("--kv-format", default="rk4")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--ablations", nargs="+", default=list(ABLATIONS), choices=ABLATIONS)
    p.add_argument("--rounds", type=int, default=2, help="each ablation timed this many times, "
                   "interleaved (the H200's step time drifts between runs)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("CUDA only: the CPU path runs the references, which this does not ablate")

    from engine.loader import load_model

    loaded = load_model(args.model, device="cuda", weights=args.weights, progress=False)
    times: dict[str, list[float]] = {name: [] for name in args.ablations}
    for _ in range(args.rounds):
        for name in args.ablations:
            with ablated(name):
                steps = decode_steps(loaded, args.kv_format, 1, args.context, args.steps)
            times[name].append(median(steps[len(steps) // 3:]) * 1e3)
    base = min(times["none"]) if "none" in times else None
    rows, results = [], []
    for name, ms in times.items():
        best = min(ms)
        saved = None if base is None else base - best
        rows.append([name, " / ".join(f"{t:.2f}" for t in ms), best,
                     "" if saved is None else f"{saved:.3f}"])
        results.append({"ablation": name, "step_ms": ms, "best_ms": best, "saved_ms": saved})
    write_json(args.json, {"args": vars(args), "results": results})
    print_table(f"decode step without each op ({args.model}, {args.weights} weights, "
                f"{args.kv_format} KV, context {args.context}, batch 1)",
                ["removed", "step ms (rounds)", "best ms", "saved ms (at most)"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
