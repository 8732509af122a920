"""Compile the CUDA GEMV's builds (engine/quant/q4_gemv.cu) for sm_90 on a
machine without a GPU, and print what ptxas says of each: registers, stack,
spills, and any global load off the read-only path. NVRTC comes from the
`nvidia-cuda-nvrtc` wheel of the test extra (engine/quant/sm90_builds.py
finds it); tests/test_gemv_builds.py asserts the same in CI.

    python scripts/nvrtc_builds.py                      # the H200's step
    python scripts/nvrtc_builds.py --card "NVIDIA H100 80GB HBM3"
"""
from __future__ import annotations

import argparse
import sys

from engine.quant.gemv_cuda import CARD_PLANS
from engine.quant.sm90_builds import compile_sm90, load_nvrtc, step_cases


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--card", default="NVIDIA H200", choices=sorted(CARD_PLANS))
    args = p.parse_args()
    nvrtc = load_nvrtc()
    if nvrtc is None:
        print("no NVRTC 13: pip install nvidia-cuda-nvrtc (the test extra has it)",
              file=sys.stderr)
        return 2
    failed = 0
    for name, options in step_cases(args.card):
        build = compile_sm90(name, options, nvrtc)
        print(f"{name}: {'ok' if build.result == 0 else f'FAILED ({build.result})'}")
        for line in build.log.splitlines():
            if "Used" in line or "spill" in line or "error" in line:
                print("    " + line.strip())
        coherent = build.coherent_global_loads()
        if coherent:
            print(f"    {len(coherent)} global loads off the read-only path, e.g. {coherent[0]}")
        failed += build.result != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
