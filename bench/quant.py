"""W4A16 GEMV speed for the Qwen3.5-27B matrix shapes against the memory
bandwidth limit, and the 27B dummy's decode step with int4 weights.

    python -m bench.quant [--rows 1 4] [--decode-steps 16] [--sweep] [--json FILE]

GPU only. Bandwidth is measured here (a device-to-device copy of 1 GiB); a
GEMV's floor is (packed weight bytes + activations) / bandwidth. GEMVs are
timed inside a CUDA graph of back-to-back calls (as decode runs them), each
call on another copy of the weights so no copy is still in L2 (the H200's
L2 holds a whole 5120x6144 Q4_K matrix). `--sweep` times every candidate
GEMV config (engine/quant/gemv.py CANDIDATES, and DOT_CANDIDATES for rows >
1, each with split-K 1/2/4/8; the best then with 1 and 3 stages) on each
shape, prints the best per shape with its share of the floor and the TUNED
lines to paste into engine/quant/gemv.py, and estimates the GEMV part of a
27B decode step from the per-step count of each shape. The decode step runs
the offline engine on `qwen3.5-27b` with `--weights int4` and bf16 KV at a
short context, timing steps after a warm-up, and reports the peak memory
torch allocated. Its step is the engine's whole loop a token (scheduling,
the batch's copies, the graph, sampling, the token to the host); beside it,
`back_to_back_ms` is one decode batch's graph replayed with no wait
between: the GPU's own step, which a loop that kept the next token on the
device and ran ahead of the host would approach."""
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


L2_FLUSH_BYTES = 256 << 20  # weight copies cycled per timing: several times the L2


def _time(fn, repeats=50) -> float:
    """Median seconds per call of events around single eager calls."""
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


def _time_graph(calls, replays: int = 5) -> float:
    """Seconds per call of `calls` (a list of no-argument functions) captured
    back to back in one CUDA graph; the median of `replays` replays."""
    for fn in calls[:2]:
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    del graph
    return median(times)


def model_shapes() -> list[tuple[str, object, int, int, int]]:
    """(name, format, N, K, uses per decode step) of the 27B's quantized
    matmuls (the int4 recipe: Q4_K everywhere; down also as Q6_K, which
    q4_k_m gives some layers). The model runs the merged projections
    (gate_up, gdn in_proj, attn qkv); their checkpoint parts are timed too,
    at 0 uses per step, so each merged launch can be set against the
    launches it replaced (`merged_vs_parts`)."""
    from engine.config import ModelConfig, shape_hf_config
    from engine.quant.recipes import Q4_K, Q6_K

    cfg = ModelConfig.from_hf(shape_hf_config("qwen3.5-27b"))
    h, i = cfg.hidden_size, cfg.intermediate_size
    layers = cfg.num_layers
    attn = sum(1 for t in cfg.layer_types if t == "full_attention") if getattr(
        cfg, "layer_types", None) else layers // 4
    gdn = layers - attn
    v = cfg.linear_num_v_heads * cfg.linear_v_head_dim
    q_out, kv_out = 2 * cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [("gate_up", Q4_K, 2 * i, h, layers), ("down", Q4_K, h, i, layers),
            ("down", Q6_K, h, i, 0),
            ("gdn in_proj", Q4_K, cfg.linear_conv_dim + v + 2 * cfg.linear_num_v_heads, h, gdn),
            ("gdn out", Q4_K, h, v, gdn),
            ("attn qkv", Q4_K, q_out + 2 * kv_out, h, attn),
            ("attn o", Q4_K, h, cfg.num_heads * cfg.head_dim, attn),
            ("lm_head", Q4_K, cfg.vocab_size, h, 1),
            # the checkpoint parts the merged launches replaced
            ("gate/up", Q4_K, i, h, 0), ("gdn qkv", Q4_K, cfg.linear_conv_dim, h, 0),
            ("gdn z", Q4_K, v, h, 0), ("gdn a/b", Q4_K, cfg.linear_num_v_heads, h, 0),
            ("attn q+gate", Q4_K, q_out, h, 0), ("attn k/v", Q4_K, kv_out, h, 0)]


# merged matrix -> (part, how many of that part it replaces)
MERGED_FROM = {"gate_up": (("gate/up", 2),),
               "gdn in_proj": (("gdn qkv", 1), ("gdn z", 1), ("gdn a/b", 2)),
               "attn qkv": (("attn q+gate", 1), ("attn k/v", 2))}


def merged_vs_parts(rows: list[dict]) -> list[dict]:
    """Per merged matrix and batch: its one launch against the launches of
    its parts (their tuned configs), per layer and per 27B decode step."""
    by = {(r["matrix"], r["format"], r["rows"]): r for r in rows}
    out = []
    for name, parts in MERGED_FROM.items():
        for batch in sorted({r["rows"] for r in rows}):
            merged = by.get((name, "Q4_K", batch))
            split = [(by.get((part, "Q4_K", batch)), count) for part, count in parts]
            if merged is None or any(r is None for r, _ in split):
                continue
            parts_us = sum(r["us"] * count for r, count in split)
            out.append({"matrix": name, "rows": batch, "merged_us": merged["us"],
                        "parts_us": parts_us, "launches_replaced": sum(c for _, c in parts),
                        "merged_roofline": merged["roofline"],
                        "saved_ms_per_step": (parts_us - merged["us"]) * merged["per_step"] / 1e3})
    return out


def _random_quant(fmt, n: int, k: int, device):
    qt = fmt.meta(n, k)
    return type(qt)(**{f: (None if t is None else torch.randint(
        0, 60, t.shape, device=device).to(t.dtype)) for f, t in qt._fields().items()})


def _copies(fmt, n: int, k: int, device) -> list:
    one = _random_quant(fmt, n, k, device)
    count = max(1, min(8, -(-L2_FLUSH_BYTES // one.nbytes)))
    return [one] + [_random_quant(fmt, n, k, device) for _ in range(count - 1)]


def _time_gemv(x, copies, config=None, calls: int = 16) -> float:
    from engine.quant.gemv import gemv

    out = torch.empty(x.shape[0], copies[0].out_features, dtype=x.dtype, device=x.device)
    fns = [(lambda qt=copies[i % len(copies)]: gemv(x, qt, out=out, config=config))
           for i in range(calls)]
    return _time_graph(fns)


def selected_shapes(only: list[str] | None) -> list[tuple[str, object, int, int, int]]:
    """model_shapes(), or those whose matrix name is in `only`."""
    shapes = model_shapes()
    return shapes if not only else [s for s in shapes if s[0] in only]


def gemv_rows(rows_list, device, bandwidth: float, only: list[str] | None = None) -> list[dict]:
    out = []
    for name, fmt, n, k, per_step in selected_shapes(only):
        copies = _copies(fmt, n, k, device)
        qt = copies[0]
        for rows in rows_list:
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            seconds = _time_gemv(x, copies)
            floor = (qt.nbytes + x.numel() * 2 + rows * n * 2) / bandwidth
            out.append({"matrix": name, "format": fmt.name, "N": n, "K": k, "rows": rows,
                        "per_step": per_step, "us": seconds * 1e6, "floor_us": floor * 1e6,
                        "roofline": floor / seconds, "GBps": qt.nbytes / seconds / 1e9})
        del copies
    return out


def sweep(rows_list, device, bandwidth: float, only: list[str] | None = None,
          int8_x: bool = False, int8_x_only: bool = False,
          candidates: list[str] | None = None, splits: tuple[int, ...] = (1, 2, 4, 8)
          ) -> list[dict]:
    """Every candidate config (x each split-K of `splits`) on every shape;
    the best block config is then retried with 1 and 3 stages. int8_x: the
    int8-activation configs too, where they apply (their numerics differ:
    bench.int8_activations); int8_x_only: only those there (the picked
    config is timed all the same). candidates: only the block shapes of
    these names (block_shape_name), beside the picked config."""
    from dataclasses import replace

    from engine.quant.gemv import _sm_count, takes_int8_x
    from engine.quant.gemv_configs import (CANDIDATES, DOT_CANDIDATES, STREAM_CANDIDATES,
                                           X8_CANDIDATES, pick_config, rows_bucket)

    sms = _sm_count(device)
    results = []
    for name, fmt, n, k, per_step in selected_shapes(only):
        copies = _copies(fmt, n, k, device)
        qt = copies[0]
        for rows in rows_list:
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            floor = (qt.nbytes + x.numel() * 2 + rows * n * 2) / bandwidth
            picked = pick_config(qt.bits, n, k, rows, qt.group, sms)
            timed: dict[str, tuple[float, object]] = {}

            def run(cfg):
                if cfg.key() in timed:
                    return
                try:
                    timed[cfg.key()] = (_time_gemv(x, copies, cfg), cfg)
                except Exception as exc:  # a config that cannot compile/launch here
                    print(f"  {name} rows={rows} {cfg.key()}: {type(exc).__name__}: "
                          f"{str(exc)[:120]}", file=sys.stderr)
            run(picked)
            picked_s = timed[picked.key()][0] if picked.key() in timed else float("nan")
            # rows > 1: the CUDA-core loop pays per row, so only its middle sizes
            block_configs = CANDIDATES if rows == 1 else CANDIDATES[1:4] + DOT_CANDIDATES
            streams = ()
            if int8_x and takes_int8_x(qt, rows):
                block_configs = X8_CANDIDATES if int8_x_only else block_configs + X8_CANDIDATES
                streams = STREAM_CANDIDATES
            if candidates:
                block_configs = [c for c in block_configs if block_shape_name(c) in candidates]
                streams = [c for c in streams if block_shape_name(c) in candidates]
            for cfg in streams:  # no split-K: the launch spreads the tiles itself
                run(cfg)
            for cfg in block_configs:
                for split in splits:
                    if -(-n // cfg.block_n) * split > 64 * sms:
                        continue  # far more programs than the GPU holds
                    run(replace(cfg, split_k=split))
            best_s, best = min(timed.values(), key=lambda v: v[0])
            for stages in (1, 3) if rows == 1 else ():
                run(replace(best, num_stages=stages))
            best_s, best = min(timed.values(), key=lambda v: v[0])
            ranked = sorted(timed.values(), key=lambda v: v[0])
            cuda_cores = [v for v in ranked if not v[1].tensor_cores]
            tensor_cores = [v for v in ranked if v[1].tensor_cores]
            results.append({"matrix": name, "format": fmt.name, "bits": qt.bits,
                            "group": qt.group, "N": n, "K": k,
                            "rows": rows, "bucket": rows_bucket(rows), "per_step": per_step,
                            "floor_us": floor * 1e6, "picked": picked.key(),
                            "picked_us": picked_s * 1e6, "best": best.key(),
                            "best_config": config_fields(best),
                            "best_us": best_s * 1e6, "best_roofline": floor / best_s,
                            "top5": [[c.key(), t * 1e6] for t, c in ranked[:5]],
                            "best_cuda_cores": [cuda_cores[0][1].key(), cuda_cores[0][0] * 1e6]
                            if cuda_cores else None,
                            "best_tensor_cores": [tensor_cores[0][1].key(),
                                                  tensor_cores[0][0] * 1e6]
                            if tensor_cores else None,
                            "configs_timed": len(timed)})
            r = results[-1]
            print(f"  {name:12s} {fmt.name:5s} rows={rows} picked {r['picked']} "
                  f"{r['picked_us']:.1f} us, best {r['best']} {r['best_us']:.1f} us "
                  f"(floor {r['floor_us']:.1f}, {100 * r['best_roofline']:.0f}%)\n"
                  f"  {_tuned_line(r)}", file=sys.stderr)
        del copies
    return results


def config_fields(cfg) -> list:
    """A GemvConfig as the sweep's JSON stores it ("best_config"), the order
    engine.quant.gemv_configs.tuned_from_sweep reads back (TANDEM_GEMV_TUNED)."""
    return [cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps, cfg.num_stages,
            cfg.tensor_cores, cfg.prefetch, cfg.int8_x, cfg.stream_k]


def block_shape_name(cfg) -> str:
    """A candidate's block shape as --candidates names it: x8-n32-k1024-w4-pf,
    x8-n32-k1024-w4-pf-sk3 (stream-K, 3 programs an SM)."""
    return (f"{'tc-' if cfg.tensor_cores else ''}{'x8-' if cfg.int8_x else ''}"
            f"n{cfg.block_n}-k{cfg.block_k}-w{cfg.num_warps}{'-pf' if cfg.prefetch else ''}"
            f"{f'-sk{cfg.stream_k}' if cfg.stream_k else ''}")


def candidate_names() -> list[str]:
    from engine.quant.gemv_configs import (CANDIDATES, DOT_CANDIDATES, STREAM_CANDIDATES,
                                           X8_CANDIDATES)

    return [block_shape_name(c)
            for c in CANDIDATES + DOT_CANDIDATES + X8_CANDIDATES + STREAM_CANDIDATES]


def _tuned_line(r: dict) -> str:
    bn, bk, sk, nw, ns, tc, pf, x8, stream = r["best_config"]
    flags = (", tensor_cores=True" if tc else "") + (", prefetch=True" if pf else "") + \
        (", int8_x=True" if x8 else "") + (f", stream_k={stream}" if stream else "")
    return (f"    ({r['bits']}, {r['group']}, {r['N']}, {r['K']}, {r['bucket']}): "
            f"GemvConfig({bn}, {bk}, {sk}, {nw}, {ns}{flags}),"
            f"  # {r['matrix']} {r['format']} {r['best_us']:.1f} us, "
            f"{100 * r['best_roofline']:.0f}% of floor")


def print_sweep(results: list[dict]) -> None:
    print_table("GEMV sweep: best config per shape (graph-timed, weights cycled past L2)",
                ["matrix", "format", "N", "K", "rows", "picked", "picked_us", "best", "best_us",
                 "floor_us", "of floor"],
                [[r["matrix"], r["format"], r["N"], r["K"], r["rows"], r["picked"],
                  f"{r['picked_us']:.1f}", r["best"], f"{r['best_us']:.1f}",
                  f"{r['floor_us']:.1f}", f"{100 * r['best_roofline']:.0f}%"] for r in results])
    print("\nTUNED lines for engine/quant/gemv_configs.py:")
    for r in results:
        print(_tuned_line(r))
    both = [r for r in results if r["best_tensor_cores"] and r["best_cuda_cores"]]
    if both:
        print_table("rows > 1: best CUDA-core config vs best tensor-core config",
                    ["matrix", "format", "rows", "cuda cores", "us", "tensor cores", "us"],
                    [[r["matrix"], r["format"], r["rows"], r["best_cuda_cores"][0],
                      f"{r['best_cuda_cores'][1]:.1f}", r["best_tensor_cores"][0],
                      f"{r['best_tensor_cores'][1]:.1f}"] for r in both])
    for rows in sorted({r["rows"] for r in results}):
        sel = [r for r in results if r["rows"] == rows and r["per_step"]]
        best = sum(r["per_step"] * r["best_us"] for r in sel)
        picked = sum(r["per_step"] * r["picked_us"] for r in sel)
        floor = sum(r["per_step"] * r["floor_us"] for r in sel)
        print(f"27B decode step, GEMVs only, rows={rows}: best {best / 1e3:.2f} ms, picked "
              f"{picked / 1e3:.2f} ms, floor {floor / 1e3:.2f} ms")


def back_to_back_seconds(engine, position: int, replays: int = 16) -> float:
    """Seconds a decode step of one sequence at `position` takes when
    `replays` of them are queued with no host wait between (the same batch
    each time: its K/V and state are rewritten, which timing does not mind),
    after one that warms up. Any device: elsewhere than CUDA the host runs
    each step itself, so this is the plain step."""
    from bench.common import now
    from bench.limits import sync
    from engine.batch import ForwardBatch, SequenceInput

    page = engine.config.page_size
    table = tuple(range(position // page + 1))
    batch = ForwardBatch.build([SequenceInput((5,), position, table, 0)], page,
                               engine.loaded.device)
    engine.decode_forward(batch)
    sync(engine.loaded.device)
    began = now()
    for _ in range(replays):
        engine.decode_forward(batch)
    sync(engine.loaded.device)
    return (now() - began) / replays


def decode_27b(steps: int, device, temperature: float = 0.0, context: int = 256,
               kv_format: str = "bf16", bandwidth: float | None = None) -> dict:
    """The int4 27B's batch-1 decode step after a `context`-token prompt with
    `kv_format` KV; with `bandwidth` (bytes/s) also its floor, the bytes the
    step must move at the prompt's length (bench.limits.decode_step_bytes)
    over that bandwidth, and the step's share of it (issue 7's roofline
    goal: >= 75% at 4K with rk4)."""
    from bench.common import now
    from bench.limits import decode_step_bytes
    from engine.llm import EngineConfig, OfflineEngine, kv_format_for
    from engine.loader import load_model
    from engine.quant.gemv_cuda import _compiled
    from engine.sampling import SamplingParams

    torch.cuda.reset_peak_memory_stats(device)
    loaded = load_model("qwen3.5-27b", device=device, weights="int4", progress=False)
    weights = sum(t.numel() * t.element_size() for t in loaded.model.state_dict().values())
    config = EngineConfig(max_batch=1, max_context=max(1024, context + steps + 64),
                          kv_format=kv_format)
    engine = OfflineEngine(loaded, config)
    prompt = [(7 * i + 3) % 256 for i in range(context)]
    params = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0, seed=1,
                            max_new_tokens=steps, ignore_eos=True)
    # when each token reaches the host, with no wait of the bench's own (one
    # would hold TANDEM_RUN_AHEAD's queued step back to the host's pace)
    stamps = [now() for _ in engine.generate([prompt], params)]
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]
    forward = engine.decode_forward
    floor = {}
    if bandwidth:
        moved = decode_step_bytes(loaded.model, loaded.config,
                                  kv_format_for(kv_format, config.page_size, loaded.dtype), 1,
                                  context)
        floor = {"floor_ms": moved / bandwidth * 1e3,
                 "roofline_pct": 100 * moved / bandwidth / median(gaps)}
    return {"weights_GiB": weights / 2**30, "step_ms": median(gaps) * 1e3,
            "back_to_back_ms": back_to_back_seconds(engine, position=len(prompt)) * 1e3,
            "tok_s": 1 / median(gaps), "peak_alloc_GiB": torch.cuda.max_memory_allocated() / 2**30,
            "graph_replays": float(forward.replays),
            "eager_buckets": float(len(forward.capture_errors)),
            # shapes the CUDA GEMV was built for (TANDEM_GEMV_CUDA=1: it ran there)
            "cuda_gemv_builds": float(_compiled.cache_info().currsize), **floor}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.quant", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    p.add_argument("--decode-steps", type=int, default=16, help="0 skips the 27B decode")
    p.add_argument("--decode-context", type=int, default=256,
                   help="the 27B decode's prompt length (issue 7's roofline goal: 4096)")
    p.add_argument("--decode-kv-format", default="bf16",
                   help="the 27B decode's KV format (issue 7's roofline goal: rk4)")
    p.add_argument("--decode-temperature", type=float, default=0.0,
                   help="the 27B decode's sampling temperature (0: greedy; above it, seeded "
                        "with top-p 0.95, the draw a chat request makes)")
    p.add_argument("--sweep", action="store_true",
                   help="time every candidate GEMV config per shape and print the best")
    p.add_argument("--int8-x", action="store_true",
                   help="sweep the int8-activation (DP4A) configs too, for one row of 4-bit "
                        "codes in groups of 32")
    p.add_argument("--int8-x-only", action="store_true",
                   help="with --sweep: time only the DP4A configs where they apply (not the "
                        "float ones, which lost every one-row Q4_K shape on the H200)")
    p.add_argument("--only", nargs="+", default=None, metavar="MATRIX",
                   help="time only these matrices (names as printed, e.g. gate_up 'attn qkv')")
    p.add_argument("--candidates", nargs="+", default=None, metavar="SHAPE",
                   help="with --sweep: only these block shapes (e.g. x8-n32-k1024-w8-pf)")
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="with --sweep: the split-K counts each block shape is timed with")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    known = {s[0] for s in model_shapes()}
    if args.only and not set(args.only) <= known:
        print(f"--only takes matrix names among {sorted(known)}", file=sys.stderr)
        return 2
    if args.candidates and not set(args.candidates) <= set(candidate_names()):
        print(f"--candidates takes block shapes among {candidate_names()}", file=sys.stderr)
        return 2
    if any(not 1 <= s <= 16 for s in args.splits):
        print("--splits takes split-K counts 1..16", file=sys.stderr)
        return 2
    if args.decode_context < 1:
        print("--decode-context takes a prompt length >= 1", file=sys.stderr)
        return 2
    from engine.kv.formats import FORMATS
    if args.decode_kv_format not in FORMATS:
        print(f"--decode-kv-format takes one of {sorted(FORMATS)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench.quant needs a CUDA GPU", file=sys.stderr)
        return 2
    if any(not 1 <= r <= 8 for r in args.rows):
        print("--rows takes 1..8 (the GEMV's batch)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    bandwidth = _copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", file=sys.stderr)
    rows = gemv_rows(args.rows, device, bandwidth, args.only)
    print_table("W4A16/W8A16 GEMV, Qwen3.5-27B shapes (picked configs)",
                ["matrix", "format", "N", "K", "rows", "us", "floor_us", "roofline"],
                [[r["matrix"], r["format"], r["N"], r["K"], r["rows"], f"{r['us']:.1f}",
                  f"{r['floor_us']:.1f}", f"{r['roofline']:.2f}"] for r in rows])
    merges = merged_vs_parts(rows)
    print_table("merged projections (heuristic config) vs the launches they replaced (tuned)",
                ["matrix", "rows", "merged us", "parts us", "launches", "of floor",
                 "saved ms/step"],
                [[r["matrix"], r["rows"], f"{r['merged_us']:.1f}", f"{r['parts_us']:.1f}",
                  r["launches_replaced"], f"{100 * r['merged_roofline']:.0f}%",
                  f"{r['saved_ms_per_step']:.2f}"] for r in merges])
    for rr in sorted({r["rows"] for r in rows}) if not args.only else ():  # a whole step only
        sel = [r for r in rows if r["rows"] == rr]
        print(f"27B decode step, GEMVs only, rows={rr}: "
              f"{sum(r['per_step'] * r['us'] for r in sel) / 1e3:.2f} ms (floor "
              f"{sum(r['per_step'] * r['floor_us'] for r in sel) / 1e3:.2f} ms, "
              f"{sum(r['per_step'] for r in sel)} launches)")
    swept = sweep(args.rows, device, bandwidth, args.only, args.int8_x or args.int8_x_only,
                  args.int8_x_only, args.candidates, tuple(args.splits)) if args.sweep else None
    if swept:
        print_sweep(swept)
    if args.decode_temperature < 0:
        print("--decode-temperature takes 0 (greedy) or more", file=sys.stderr)
        return 2
    decode = (decode_27b(args.decode_steps, device, args.decode_temperature,
                         args.decode_context, args.decode_kv_format, bandwidth)
              if args.decode_steps else None)
    if decode:
        print_table("27B dummy, int4 weights, batch-1 decode", list(decode),
                    [[f"{v:.2f}" for v in decode.values()]])
    if args.json:
        write_json(args.json, {"environment": environment(), "bandwidth_GBps": bandwidth / 1e9,
                               "gemv": rows, "merged_vs_parts": merges, "sweep": swept,
                               "decode_27b": decode})
    return 0


if __name__ == "__main__":
    sys.exit(main())
