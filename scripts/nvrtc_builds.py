"""Compile the CUDA GEMV's builds (engine/quant/q4_gemv.cu) for sm_90 on a
machine without a GPU, and print what ptxas says of each: registers, stack,
spills. NVRTC compiles without a device; this takes it from the
`nvidia-cuda-nvrtc` wheel (pip install --target DIR nvidia-cuda-nvrtc==13.0.88,
then LD_LIBRARY_PATH=DIR/nvidia/cu13/lib), so a kernel edit is checked before
it costs device time.

    python scripts/nvrtc_builds.py            # the 27B's projections
"""
from __future__ import annotations

import ctypes
import sys

from engine.quant import gemv_cuda
from engine.quant.gemv_cuda import (CARD_PLANS, SiluMulEpilogue, build_options, picked_plan,
                                    plan_for)


def compile_sm90(options: tuple[str, ...], nvrtc: ctypes.CDLL) -> tuple[int, str]:
    """(NVRTC's result, its log with ptxas -v) of q4_gemv.cu under `options`."""
    prog = ctypes.c_void_p()
    source = gemv_cuda.SOURCE.read_text().encode()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source, b"q4_gemv.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    args = [b"--gpu-architecture=sm_90", b"--ptxas-options=-v", *(o.encode() for o in options)]
    result = nvrtc.nvrtcCompileProgram(prog, len(args), (ctypes.c_char_p * len(args))(*args))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return result, log.value.decode()


def _cases():
    """(name, options): the H200's card plans for the 27B's shapes, and
    plan_for's for its out projections (gdn out, attn o: 5120 x 6144), with
    and without the next tile asked of L2 before the wait; gate_up (its
    widest shape) also with its SiLU epilogue, whose early tiles are two
    ranges."""
    card = "NVIDIA H200"
    for n, k in [*CARD_PLANS[card], (5120, 6144)]:
        plan = picked_plan(n, k, card)
        for early in (0, 1):
            yield f"{n} x {k}, early L2 tiles {early}", build_options(
                plan, 256, True, False, True, early_l2_tiles=early)
    yield "gate_up 34816 x 5120 with the SiLU epilogue", build_options(
        picked_plan(34816, 5120, card), 256, True, False, True,
        epilogue=SiluMulEpilogue(), early_l2_tiles=1)
    yield "5120 x 6144, early L2 tiles 3 (its plan's own)", build_options(
        plan_for(6144, early_tiles=3), 256, True, False, True, early_l2_tiles=3)
    yield "tests' 3001 x 768, one row a tile", build_options(
        plan_for(768, rows=1, blocks_per_sm=1), 256, True, False, True, early_l2_tiles=2)


def main() -> int:
    nvrtc = ctypes.CDLL("libnvrtc.so.13")
    failed = 0
    for name, options in _cases():
        result, log = compile_sm90(options, nvrtc)
        lines = [line for line in log.splitlines() if "Used" in line or "spill" in line
                 or "error" in line]
        print(f"{name}: {'ok' if result == 0 else f'FAILED ({result})'}")
        print("\n".join("    " + line.strip() for line in lines))
        failed += result != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
