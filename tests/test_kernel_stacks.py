"""Kernels that run in every GPU worker must need no thread stack on sm_90:
a launch of one that spills raises its context's stack limit for good, and
with it the local-memory reservation (stack x 2,048 threads x 132 SMs on an
H200). The 24 GiB run of 2026-12-03 found the decode worker's limit at
2,448 B (631 MiB) from the 64-row verify tiles, and the prefill worker's at
1,776 B (fla-core's q/k norm autotune among its causes: 808 B, so the
prefill norms q/k itself). Compiled for sm_90 with Triton's own ptxas (no GPU needed) and read
with its cuobjdump, as bench.attention_sass does, in a child process: the
tests' interpreter mode (conftest) has no compiler."""
import json
import os
import subprocess
import sys

import pytest

from engine.cuda_context import STACK_BYTES

pytest.importorskip("triton")

_STACKS = r"""
import json, os, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from bench.attention_sass import describe
from bench.gemv_sass import _cuobjdump
from engine import gdn_kernels

stacks = {f"attention {f} {s}": describe(f, s, stages="tiles")[5]
          for f in ("int8", "rk4", "rk4p") for s in ("decode", "verify")}
# the A/B switches' other side (TANDEM_RK4_PAIRS, TANDEM_INT8_NO_I2F) runs in
# workers too
os.environ.update(TANDEM_RK4_PAIRS="0", TANDEM_INT8_NO_I2F="0")
stacks.update({f"attention {f} {s} switched off": describe(f, s, stages="tiles")[5]
               for f in ("int8", "rk4") for s in ("decode", "verify")})
kernel = gdn_kernels._conv_chunk_kernel
block_t, block_c = gdn_kernels.conv_chunk.__defaults__[-2:]
pointers = dict(row_seq_ptr="*i32", offsets_ptr="*i32", slots_ptr="*i64", positions_ptr="*i64")
constants = dict(KERNEL=4, BLOCK_T=block_t, BLOCK_C=block_c, X_BF16=True, WIN_BF16=False,
                 W_BF16=True)
signature = {p.name: "constexpr" if p.name in constants
             else pointers.get(p.name, "*i16") if p.name.endswith("_ptr") else "i32"
             for p in kernel.params}
names = list(signature)
attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
         if signature[n].startswith("*")}
compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants,
                                    attrs=attrs), target=GPUTarget("cuda", 90, 32))
usage = _cuobjdump(compiled.asm["cubin"], "-res-usage")
stacks["gdn conv chunk"] = int(re.search(r"STACK:(\d+)", usage).group(1))
consts = dict(HEADS=16, D=128, ROWS=16, X_BF16=True)
compiled = triton.compile(ASTSource(fn=gdn_kernels._l2_normalize_kernel,
                                    signature=dict(x_ptr="*i16", out_ptr="*i16", rows="i32",
                                                   token_stride="i32",
                                                   **{k: "constexpr" for k in consts}),
                                    constexprs=consts), target=GPUTarget("cuda", 90, 32))
usage = _cuobjdump(compiled.asm["cubin"], "-res-usage")
stacks["gdn q/k l2 norm"] = int(re.search(r"STACK:(\d+)", usage).group(1))


def stack_of(kernel, pointers, constants, warps=4):
    signature = {p.name: "constexpr" if p.name in constants else pointers.get(p.name, "i32")
                 for p in kernel.params}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    usage = _cuobjdump(compiled.asm["cubin"], "-res-usage")
    return int(re.search(r"STACK:(\d+)", usage).group(1))


# rk4's rotations folded into the KV write and the split combine (27B: 4 KV
# heads of 256, 64 splits; fused_rotation_sites)
from engine.kv import attention_kernels as A, kernels as KV
from engine.kv.rotation import hadamard_scale
stacks["rk4 rotating write"] = stack_of(
    KV._rk4_rotate_write_kernel,
    dict(k_ptr="*i16", v_ptr="*i16", signs_ptr="*fp32", slots_ptr="*i64", k_codes_ptr="*u8",
         k_scales_ptr="*fp16", v_codes_ptr="*u8", v_scales_ptr="*fp16"),
    dict(H=4, D=256, LOG2_D=8, SCALE=hadamard_scale(256), HEAD_ROWS=KV._rows_per_program(256),
         ROWS_PER_TOKEN=32, HALF=16, E8M0=False, X_BF16=True, PDL=True))
for gated in (False, True):  # gated: the output gate too, Qwen3.5's attention
    stacks[f"attention combine rotating back{' and gating' if gated else ''}"] = stack_of(
        A._combine_splits_kernel,
        dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*i16", signs_ptr="*fp32",
             gate_ptr="*i16"),
        dict(D=256, D_PAD=256, NUM_SPLITS=64, SPLITS_PAD=64, OUT_BF16=True, ROTATE_BACK=True,
             LOG2_D=8, SCALE=hadamard_scale(256), GATED=gated, Q_HEADS=24, PDL=True,
             RELEASE_FIRST=gated))
# q's and k's norm + rotary in one launch (27B: 24 + 4 heads of 256, rotary 64)
from engine.fused import kernels as FK
stacks["q and k norm rope"] = stack_of(
    FK._norm_rope_pair_kernel,
    {name: "*bf16" for name in ("q_ptr", "qw_ptr", "k_ptr", "kw_ptr", "cos_ptr", "sin_ptr",
                                "q_out_ptr", "k_out_ptr", "k_normed_ptr")} | dict(eps="fp32"),
    dict(HAS_NORM=True, ZERO_CENTERED=True, STORE_NORMED=True, HALF_BLOCK=32,
         REST_BLOCK=256, PDL=True), warps=1)
# the DP4A GEMV a sweep file (TANDEM_GEMV_TUNED) may pick, stream-K included
from bench.gemv_sass import describe as describe_gemv
from engine.quant.gemv_configs import STREAM_CANDIDATES, TUNED
for config in {c for c in TUNED.values() if c.int8_x} | set(STREAM_CANDIDATES):
    stacks[f"gemv {config.key()}"] = describe_gemv(config, 4, 1)[4]
print(json.dumps(stacks))
"""


@pytest.fixture(scope="module")
def stacks() -> dict[str, int]:
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", _STACKS], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kernel", [f"attention {f} {s}" for f in ("int8", "rk4", "rk4p")
                                    for s in ("decode", "verify")]
                         + [f"attention {f} {s} switched off" for f in ("int8", "rk4")
                            for s in ("decode", "verify")]
                         + ["gdn conv chunk", "gdn q/k l2 norm", "rk4 rotating write",
                            "attention combine rotating back",
                            "attention combine rotating back and gating",
                            "q and k norm rope"])
def test_a_workers_kernel_needs_no_stack_on_sm90(stacks, kernel):
    assert stacks[kernel] <= STACK_BYTES, f"{kernel}: {stacks[kernel]} B of stack a thread"


def test_the_dp4a_gemvs_a_worker_may_run_need_no_stack_on_sm90(stacks):
    gemvs = {name: stack for name, stack in stacks.items() if name.startswith("gemv ")}
    assert any("-sk" in name for name in gemvs) and len(gemvs) >= 6
    assert all(stack <= STACK_BYTES for stack in gemvs.values()), gemvs
