"""Static facts of the decode GEMV's sm_90 build, no GPU needed: for each
candidate block config (and the tensor-core ones for rows > 1), registers
per thread, stack bytes (spills), shared memory, and the machine
instructions of the K loop per weight element
(every instruction counts against the issue rate; near 4 per weight a
thread cannot feed the H200's HBM at rows=1).

    python -m bench.gemv_sass [--bits 4 8] [--rows 1 4]

Compiles with Triton for GPUTarget("cuda", 90) and reads the cubin with the
cuobjdump that ships in Triton's wheel."""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

from bench.common import print_table


def _compile(config, bits: int, rows: int, pdl: bool = False):
    """pdl: with the dependent-launch prologue (engine/pdl.py), and for the
    DP4A kernel its first weight tile loaded before it (EARLY); the K loop's
    counts are the same either way."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.quant.gemv import (_gemv_dot_kernel, _gemv_kernel, _gemv_x8_kernel,
                                   _gemv_x8_stream_kernel)

    signature = dict(x_ptr="*bf16", qw_ptr="*i32", d_ptr="*fp16", sc_ptr="*i8",
                     dmin_ptr="*fp16", m_ptr="*i8", out_ptr="*bf16", bias_ptr="*bf16",
                     M="i32", N="i32", stride_xm="i32", stride_os="i32", stride_om="i32",
                     ROW_WORDS="i32", GROUPS="i32", SUPERS="i32", TILES="i32")
    group = 32 if bits == 4 else 16  # Q4_K, Q6_K
    constants = dict(BITS=bits, G=group, S=256, ASYM=bits == 4, HAS_BIAS=False,
                     BLOCK_N=config.block_n, BLOCK_K=config.block_k, ASM=True, PDL=pdl)
    if config.stream_k:
        # 5 units a program and up to 3 parts a block: down's plan at 4 an SM
        kernel = _gemv_x8_stream_kernel
        signature = dict(x_ptr="*bf16", qw_ptr="*i32", d_ptr="*fp16", sc_ptr="*i8",
                         dmin_ptr="*fp16", m_ptr="*i8", out_ptr="*bf16", part_ptr="*fp32",
                         counter_ptr="*i32", N="i32", ROW_WORDS="i32", GROUPS="i32",
                         SUPERS="i32", K_TILES="i32", UNITS="i32")
        del constants["BITS"], constants["HAS_BIAS"]
        constants.update(EARLY=pdl, UNITS_PER_PROGRAM=5, MAX_PARTS=3)
    elif config.int8_x:
        kernel = _gemv_x8_kernel
        for name in ("M", "stride_xm", "stride_om"):
            del signature[name]
        # the split-K fix-up's pointers come after bias_ptr (off here: its
        # loop is the same, the fix-up runs once after it)
        at = list(signature).index("bias_ptr") + 1
        items = list(signature.items())
        signature = dict(items[:at] + [("final_ptr", "*bf16"), ("counter_ptr", "*i32")]
                         + items[at:])
        del constants["BITS"]
        constants.update(EARLY=pdl, SPLIT_K=1, FIXUP=False, PREFETCH=config.prefetch)
    elif config.tensor_cores:
        kernel = _gemv_dot_kernel
        constants.update(IEEE=False)
    else:
        kernel = _gemv_kernel
        constants.update(BLOCK_M=triton.next_power_of_2(rows), EVEN=True,
                         PREFETCH=config.prefetch)
    signature.update({k: "constexpr" for k in constants})
    names = list(signature)
    aligned = {"stride_xm", "stride_om", "stride_os", "ROW_WORDS", "GROUPS", "SUPERS"}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if signature[n].startswith("*") or n in aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=config.num_warps, num_stages=config.num_stages))


def _cuobjdump(cubin: bytes, flag: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout


def _loop_ops(sass: str) -> collections.Counter:
    """Opcodes of the longest backward branch's body: the K loop."""
    lines = sass.splitlines()
    at = {}
    for i, line in enumerate(lines):
        m = re.match(r"\s+/\*([0-9a-f]+)\*/", line)
        if m:
            at[int(m.group(1), 16)] = i
    loop = None
    for i, line in enumerate(lines):
        m = re.search(r"BRA 0x([0-9a-f]+)", line)
        if m and at.get(int(m.group(1), 16), i) < i:
            start = at[int(m.group(1), 16)]
            if loop is None or i - start > loop[1] - loop[0]:
                loop = (start, i)
    ops = collections.Counter()
    for line in lines[loop[0]:loop[1] + 1] if loop else []:
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def describe(config, bits: int, rows: int) -> list:
    compiled = _compile(config, bits, rows)
    usage = _cuobjdump(compiled.asm["cubin"], "-res-usage")
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    regs, stack, _, _ = (int(v) for v in m.groups()) if m else (0, 0, 0, 0)
    ops = _loop_ops(_cuobjdump(compiled.asm["cubin"], "-sass"))
    per_thread = config.block_n * config.block_k / (32 * config.num_warps)
    total = sum(ops.values())
    top = " ".join(f"{k}:{v / per_thread:.2f}" for k, v in ops.most_common(6))
    return [config.key(), bits, rows, regs, stack, compiled.metadata.shared,
            f"{total / per_thread:.2f}", top]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gemv_sass",
                                description=__doc__.splitlines()[0])
    p.add_argument("--bits", type=int, nargs="+", default=[4])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    args = p.parse_args(argv)
    from engine.quant.gemv_configs import (CANDIDATES, DOT_CANDIDATES, STREAM_CANDIDATES,
                                           X8_CANDIDATES)

    table = []
    for bits in args.bits:
        for rows in args.rows:
            extra = DOT_CANDIDATES if rows > 1 else \
                X8_CANDIDATES + STREAM_CANDIDATES if bits == 4 else ()
            for config in CANDIDATES + extra:
                try:
                    table.append(describe(config, bits, rows))
                except Exception as exc:  # report and go on: one config must not hide the rest
                    print(f"{config.key()} bits={bits} rows={rows}: {exc}", file=sys.stderr)
    print_table("GEMV sm_90 build: loop instructions per weight element and thread",
                ["config", "bits", "rows", "regs", "stack", "smem", "instr/w", "top opcodes /w"],
                table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
