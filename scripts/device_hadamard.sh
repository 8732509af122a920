#!/usr/bin/env bash
# The rk4/rk4p rotation as a Triton FWHT (engine/kv/hadamard_kernels.py,
# TANDEM_HADAMARD_KERNEL, off by default) against today's fp32 cuBLAS matmul
# by R (~5-7 us each, 3-4 per attention layer at decode: ~0.2-0.4 ms of a
# 15 ms step). Carry .whl.
#  1. GPU tests: the compiled kernel against the PyTorch reference bit for
#     bit, the formats' wiring, rk4 attention (~1-2 min);
#  2. bench.hadamard: the rotation alone, matmul against the kernel by rows
#     per program, at 4 / 24 / 96 / 49,152 rows (~1 min; with the tests);
#  3. the decode step with the kernel off / on in alternating pairs (PAIRS,
#     default 2), 4K and 128K, bf16 weights (~1 min a run), for KV (rk4).
# Two calls (~7 and ~5 min; both formats in one would pass the 10-minute
# call and the 8 files that come back): `bash scripts/device_hadamard.sh`,
# then `KV=rk4p TESTS=0 bash scripts/device_hadamard.sh`. Turn the kernel on
# by default only if every pair agrees that it is faster.
set -uo pipefail
M=qwen3.5-27b
source scripts/device_env.sh
if [ "${TESTS:-1}" = "1" ]; then
  STEP_TAIL=4 step hadamard_tests 150 python3 -m pytest -q -p no:cacheprovider \
    tests/test_hadamard.py tests/test_attention.py -k "rk4 or hadamard"
  STEP_TAIL=16 step hadamard_bench 120 python3 -m bench.hadamard
fi
for kv in ${KV:-rk4}; do
  for pair in $(seq "${PAIRS:-2}"); do
    for h in 0 1; do
      STEP_TAIL=2 step ${kv}_hadamard${h}_$pair 90 env TANDEM_HADAMARD_KERNEL=$h python3 -m \
        bench.decode --model $M --device cuda --kv-format $kv --batch 1 \
        --context 4096 131072 --steps 16
    done
  done
done
