"""Can a worker move its own work between all SMs and a part of them, step by
step? The question behind a decode SM share that follows the prefill: MPS
fixes a process's share at start-up (`tandem serve --decode-sm-percent`), so
an idle decode stays capped (23.8 ms a step at 40% against 14.8 ms at 100%
on the H200, 12-04). A green context is a share inside one process, chosen
per launch by the stream: if a CUDA graph captured on an ordinary stream
replays inside a green context's SMs, the decode worker can pick the share
for each step.

Run on the device (`python scripts/device_green.py`, ~1 min; under MPS too,
with CUDA_MPS_PIPE_DIRECTORY set). It prints, for a bandwidth-bound graph (a
decode step's shape: bf16 GEMVs over 1 GiB of weights) and a compute-bound
one (bf16 GEMMs): the replay time on an ordinary stream, on a green stream of
each SM count, eagerly inside the green context, and of a graph captured inside
it (on its stream and on an ordinary one), so that a limit that does not hold
shows as equal times.

H200, 12-04 11:46: a graph captured on an ordinary stream ignores the green
stream's partition (GEMMs at 16 SMs as fast as at 132); eager launches inside
the green context keep it (16 SMs: 6.6x slower), under MPS too. GEMVs inside
48 SMs drew 80% of the bandwidth, inside 64 SMs 91%. A graph captured inside
the green context keeps its partition on any stream."""
import argparse
import json

import torch


def timed(fn, repeats: int, stream) -> float:
    """Mean milliseconds of fn() on `stream`, after two warm-up calls."""
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(repeats):
            fn()
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / repeats


def captured(work, side=None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of work(), captured on `side` (default: a new ordinary stream)."""
    side = side or torch.cuda.Stream()
    with torch.cuda.stream(side):
        work()  # warm-up: cuBLAS picks its kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        work()
    return graph


def workloads():
    """(name, work) pairs: one bandwidth-bound, one compute-bound."""
    weights = [torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
    x = torch.randn(8192, 1, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def gemvs():  # 8 x 128 MiB read once each: what a decode step does
        for w in weights:
            torch.mm(w, x)

    def gemms():  # 2 x 1.1 TFLOP
        for _ in range(2):
            torch.mm(a, b)
    return [("gemv 1 GiB", gemvs, 2**30), ("gemm 2x8192^3", gemms, 0),
            ("triton copy 1 GiB", triton_copy(), 2**31)]


def triton_copy():
    """A Triton copy of 1 GiB, compiled and loaded in the primary context: the
    decode step is mostly Triton kernels, whose modules a green context must
    be able to launch."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offsets, tl.load(src + offsets, mask=offsets < n), mask=offsets < n)

    src = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)

    def work():
        copy[(triton.cdiv(src.numel(), 4096),)](src, dst, src.numel(), BLOCK=4096)
    return work


def green_rows(name: str, work, graph, sms: int, repeats: int) -> list[dict]:
    """The graph replayed on a green context's stream, and the work launched
    eagerly with the green context current."""
    from torch.cuda.green_contexts import GreenContext

    green = GreenContext.create(num_sms=sms, device_id=0)
    stream = green.Stream()
    rows = [{"work": name, "sms": sms, "how": "graph, green stream",
             "ms": timed(graph.replay, repeats, stream)}]
    green.set_context()
    try:
        rows.append({"work": name, "sms": sms, "how": "eager, in the green context",
                     "ms": timed(work, repeats, stream)})
        inside = captured(work, stream)
        rows.append({"work": name, "sms": sms, "how": "graph captured in it, green stream",
                     "ms": timed(inside.replay, repeats, stream)})
    finally:
        green.pop_context()
    # is the partition a property of the graph (captured in the green context)?
    rows.append({"work": name, "sms": sms, "how": "graph captured in it, ordinary stream",
                 "ms": timed(inside.replay, repeats, torch.cuda.current_stream())})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sms", type=int, nargs="+", default=[16, 32, 48, 64, 96])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    total = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}: {total} SMs, torch {torch.__version__}")
    rows = []
    for name, work, nbytes in workloads():
        graph = captured(work)
        base = timed(graph.replay, a.repeats, torch.cuda.current_stream())
        rows.append({"work": name, "sms": total, "how": "graph, ordinary stream", "ms": base})
        for sms in a.sms:
            try:
                rows += green_rows(name, work, graph, sms, a.repeats)
            except Exception as e:  # noqa: BLE001 - the probe reports what the driver says
                rows.append({"work": name, "sms": sms, "how": "failed", "error": repr(e)})
        for r in rows:
            if r["work"] == name and "ms" in r and nbytes:
                r["GB/s"] = nbytes / r["ms"] / 1e6
    for r in rows:
        print(json.dumps(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
