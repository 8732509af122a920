"""Which compiled Triton kernels need a thread stack or local memory, and what
each would cost a context's local-memory reservation (stack x 2,048 resident
threads x SMs): the driver raises a context's stack limit to the largest
stack a launched kernel needs and never lowers it (engine/cuda_context.py).
Reads every cubin under a Triton cache directory with the cuobjdump that
ships in Triton's wheel, so it runs anywhere:

    TRITON_CACHE_DIR=/tmp/tc <run the workload>; python scripts/kernel_stacks.py /tmp/tc
"""
from __future__ import annotations

import argparse
import pathlib
import re

from bench.common import print_table
from bench.gemv_sass import _cuobjdump

_FUNCTION = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def kernel_resources(cache: pathlib.Path) -> list[dict]:
    """One row per kernel function in the cache's cubins."""
    rows = []
    for cubin in sorted(cache.rglob("*.cubin")):
        usage = _cuobjdump(cubin.read_bytes(), "-res-usage")
        for name, reg, stack, shared, local in _FUNCTION.findall(usage):
            rows.append(dict(kernel=name, cache_key=cubin.parent.name[:12], regs=int(reg),
                             stack_B=int(stack), local_B=int(local), shared_B=int(shared)))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/kernel_stacks.py")
    p.add_argument("cache", type=pathlib.Path, help="a TRITON_CACHE_DIR")
    p.add_argument("--sms", type=int, default=132, help="the card's SMs (H200: 132)")
    p.add_argument("--all", action="store_true", help="also the kernels with no stack")
    args = p.parse_args(argv)
    rows = kernel_resources(args.cache)
    for row in rows:
        row["reservation_MiB"] = round(row["stack_B"] * 2048 * args.sms / 2**20, 1)
    shown = sorted((r for r in rows if args.all or r["stack_B"] or r["local_B"]),
                   key=lambda r: -r["stack_B"])
    headers = list(rows[0]) if rows else []
    print_table(f"{len(rows)} kernels compiled, {sum(1 for r in rows if r['stack_B'])} with a "
                f"stack", headers, [[r[h] for h in headers] for r in shown])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
