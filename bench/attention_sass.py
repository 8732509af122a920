"""Static facts of the paged attention kernel's sm_90 build, no GPU needed:
registers per thread, stack bytes (spills and local arrays), shared memory,
and the machine instructions of the key loop (per key tile: all of them,
and those on its longest path, which a tile over a real page runs), for the
27B's attention shape (head_dim 256, rotary_dim 64, 4 KV heads, GQA group 6)
over int8, rk4 and rk4p pages, with the tiles tiles_for picks (or --block-n /
--rows / --warps instead) for a decode step, a speculative verify (5 new
tokens) or a bf16 prefill chunk, at the stage counts asked for. A stack
above the service's trimmed 64 bytes raises a process's local-memory
reservation by stack x 2,048 x 132 SMs (engine/cuda_context.py).

    python -m bench.attention_sass [--kv-format int8 rk4 rk4p] [--step decode verify]
                                   [--stages 1 2 default tiles] [--block-n 32 64] [--rows R]
                                   [--warps W]

The kernel's A/B switches come from the environment as at a launch
(TANDEM_RK4_PAIRS=0 builds rk4's channel-order tiles, TANDEM_INT8_NO_I2F=0
int8's I2F; attention_kernels.program_switches).

Compiles with Triton for GPUTarget("cuda", 90) and reads the cubin with the
cuobjdump that ships in Triton's wheel (the approach of bench.gemv_sass)."""
from __future__ import annotations

import argparse
import re
import sys

from bench.common import print_table
from bench.gemv_sass import _cuobjdump, _loop_ops

# The 27B's attention layer (Qwen3.5-27B: partial rotary 0.25).
HEAD_DIM, ROTARY_DIM, KV_HEADS, GROUP, PAGE = 256, 64, 4, 6, 32

_POINTER_TYPES = dict(
    q_ptr="*i16", q_offsets_ptr="*i32", kv_lens_ptr="*i32", page_table_ptr="*i32",
    k_codes_ptr="*u8", v_codes_ptr="*u8", k_open_ptr="*i16", v_open_ptr="*i16",
    inv_freq_ptr="*fp32", part_out_ptr="*fp32", part_lse_ptr="*fp32", signs_ptr="*fp32")


def _signature(kernel, kind: int, out_bf16: bool) -> dict:
    """Types of the kernel's runtime arguments, whatever constexprs it has."""
    from engine.kv import attention_kernels as K

    types = dict(_POINTER_TYPES,
                 k_scales_ptr="*fp16", v_scales_ptr="*fp16",
                 k_step_ptr="*u8", out_ptr="*i16" if out_bf16 else "*fp32",
                 page_table_stride="i32", first_staged="i32", qk_scale="fp32")
    if kind == K.INT8:
        types.update(k_scales_ptr="*fp16", v_scales_ptr="*fp16", k_codes_ptr="*i8",
                     v_codes_ptr="*i8")
    elif kind == K.RK4P:
        # rk4p reads channel pairs (attention._kind_args): k_min as int32,
        # k_step as int16, the bf16 staging pages as int32
        types.update(k_scales_ptr="*i32", k_step_ptr="*i16", k_open_ptr="*i32",
                     v_open_ptr="*i32")
    names = [p.name for p in kernel.params]
    return {n: types.get(n, "constexpr") for n in names}


# new tokens per sequence for each step kind (tiles_for's new_tokens)
STEPS = {"decode": 1, "verify": 5, "prefill": 4096}


def _loop_path(sass: str) -> int:
    """Instructions on the longest path through the key loop (the longest
    backward branch's body, as _loop_ops), forward branches taken or not:
    rk4p's loop branches on whether a tile's page is staged, and the real
    page's side, the longer one, is what nearly every tile runs."""
    ins = []  # (address, instruction)
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?)\s*;", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    at = {address: i for i, (address, _) in enumerate(ins)}
    loop = None
    for i, (address, text) in enumerate(ins):
        m = re.search(r"BRA 0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < address:
            start = at[int(m.group(1), 16)]
            if loop is None or i - start > loop[1] - loop[0]:
                loop = (start, i)
    if loop is None:
        return 0
    start, end = loop
    longest = [0] * (end - start + 2)  # from instruction start + k to the back branch
    longest[end - start] = 1
    for i in range(end - 1, start - 1, -1):
        text = ins[i][1]
        m = re.search(r"BRA 0x([0-9a-f]+)", text)
        target = at.get(int(m.group(1), 16)) if m else None
        if target is not None and i < target <= end:  # a forward branch inside the loop
            taken = longest[target - start]
            longest[i - start] = 1 + (max(taken, longest[i + 1 - start])
                                      if text.startswith("@") else taken)
        else:
            longest[i - start] = 1 + longest[i + 1 - start]
    return longest[0]


def _compile(kv_format: str, stages: int | None, tiles, splits: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.kv import attention_kernels as K
    from engine.kv.formats import fused_rotation_sites, make_format
    from engine.kv.rotation import hadamard_scale

    kernel = K._paged_attention_kernel
    rk4p = kv_format == "rk4p"
    kind = {"rk4p": K.RK4P, "rk4": K.RK4, "int8": K.INT8}[kv_format]
    scale_block = (make_format("rk4p").v_block_for(HEAD_DIM) if rk4p
                   else make_format("rk4").block if kind == K.RK4 else 1)
    rotary_dim = ROTARY_DIM if rk4p else 0
    constants = dict(
        Q_HEADS=KV_HEADS * GROUP, KV_HEADS=KV_HEADS, GROUP=GROUP, D=HEAD_DIM, D_PAD=HEAD_DIM,
        PAGE_SIZE=PAGE if rk4p else 16, KIND=kind, SCALE_BLOCK=scale_block, E8M0=False,
        ROTARY_DIM=rotary_dim, Q_BF16=True, OUT_BF16=not rk4p, ROWS=tiles.rows,
        BLOCK_N=tiles.block_n, NUM_SPLITS=splits, FOR_LOOP=True,
        DOT_BF16=1 if tiles.dot_bf16 else 0, PDL=True, **K.program_switches(kind, HEAD_DIM),
        # rk4's q rotated in the kernel as the workers run it (fused_rotation_sites)
        ROTATE_Q=K.rotates_q_in_kernel(kind, HEAD_DIM) and "query" in fused_rotation_sites(),
        LOG2_D=HEAD_DIM.bit_length() - 1, R_SCALE=hadamard_scale(HEAD_DIM))
    params = {p.name for p in kernel.params}
    if "ROPE_PAD" in params:
        constants["ROPE_PAD"] = K.rope_pad(rotary_dim)
    signature = _signature(kernel, kind, not rk4p)
    signature.update({k: "constexpr" for k in constants})
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if signature[n].startswith("*") or n == "first_staged"}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    options = dict(num_warps=tiles.num_warps or 4)
    if stages is not None:
        options["num_stages"] = stages
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


# --stages value for the stage count tiles_for picks (None there: Triton's)
TILES = "tiles"


def describe(kv_format: str, step: str, stages: int | str | None, block_n: int | None = None,
             rows: int | None = None, warps: int | None = None) -> list:
    import dataclasses

    import torch

    from engine.kv.attention import tiles_for
    from engine.kv.formats import make_format

    new = STEPS[step]
    tiles = tiles_for(HEAD_DIM, GROUP, decode=new == 1, on_gpu=True, fmt=make_format(kv_format),
                      q_dtype=torch.bfloat16, new_tokens=new)
    tiles = dataclasses.replace(tiles, block_n=block_n or tiles.block_n, rows=rows or tiles.rows,
                                num_warps=warps or tiles.num_warps)
    # decode and verify at 131K context, batch 1: splits_for's 64 key splits
    label = "default" if stages is None else stages
    if stages == TILES:
        stages = tiles.num_stages
        label = f"tiles ({'default' if stages is None else stages})"
    compiled = _compile(kv_format, stages, tiles, 64 if step != "prefill" else 1)
    usage = _cuobjdump(compiled.asm["cubin"], "-res-usage")
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    regs, stack, _, local = (int(v) for v in m.groups()) if m else (0, 0, 0, 0)
    sass = _cuobjdump(compiled.asm["cubin"], "-sass")
    ops = _loop_ops(sass)
    spills = len(re.findall(r"\bSTL\b", sass)), len(re.findall(r"\bLDL\b", sass))
    top = " ".join(f"{k}:{v}" for k, v in ops.most_common(8))
    tile = f"{tiles.rows}x{tiles.block_n}/{tiles.num_warps}w" + (" bf16" if tiles.dot_bf16 else "")
    return [kv_format, step, tile, label,
            regs, stack, local, f"{spills[0]}/{spills[1]}", compiled.metadata.shared,
            sum(ops.values()), _loop_path(sass), top]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.attention_sass",
                                description=__doc__.splitlines()[0])
    p.add_argument("--kv-format", nargs="+", default=["int8", "rk4p"],
                   choices=["int8", "rk4", "rk4p"])
    p.add_argument("--block-n", type=int, nargs="+", default=[None],
                   help="keys per tile instead of tiles_for's")
    p.add_argument("--rows", type=int, default=None, help="rows per tile instead of tiles_for's")
    p.add_argument("--warps", type=int, default=None, help="warps instead of tiles_for's")
    p.add_argument("--step", nargs="+", default=["decode"], choices=list(STEPS))
    p.add_argument("--stages", nargs="+", default=["1", "2", "default"],
                   help="num_stages values ('default': Triton's, 'tiles': tiles_for's)")
    args = p.parse_args(argv)
    table = []
    for kv_format in args.kv_format:
        for step in args.step:
            for s in args.stages:
                stages = None if s == "default" else s if s == TILES else int(s)
                for block_n in args.block_n:
                    try:
                        table.append(describe(kv_format, step, stages, block_n, args.rows,
                                              args.warps))
                    except Exception as exc:  # report and go on: one must not hide the rest
                        print(f"{kv_format} {step} stages={s} block_n={block_n}: "
                              f"{type(exc).__name__}: {exc}"[:400], file=sys.stderr)
    from engine.kv.attention import int8_no_i2f, rk4_pairs

    switches = f"TANDEM_RK4_PAIRS={int(rk4_pairs())} TANDEM_INT8_NO_I2F={int(int8_no_i2f())}"
    print_table(f"Paged attention sm_90 build, 27B attention shape (static; {switches})",
                ["format", "step", "tile (rows x keys/warps)", "stages", "regs", "stack",
                 "local", "STL/LDL", "smem", "loop instr", "longest path", "top loop opcodes"],
                table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
