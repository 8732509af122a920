#!/usr/bin/env bash
# One GPU session for the decode GEMV (issue 7, decode speed), from the repo
# root on the device machine; installs nothing (torch, triton and the repo are
# what scripts/device_quant.sh uses). In order:
#   1. the quant kernel tests compiled for CUDA (TRITON_INTERPRET=0): both GEMV
#      kernels with the inline-PTX LOP3, split-K, tails, fused bias, rows 1..8;
#   2. static facts of the sm_90 GEMV build (registers, spills, loop
#      instructions per weight) for the candidate block configs;
#   3. bench.quant with the picked configs on every 27B matrix shape (rows 1
#      and 4) and the 27B int4 decode step (16 steps, CUDA graphs);
#   4. bench.quant --sweep: every candidate config per shape, the best with
#      its share of the bandwidth floor, TUNED lines to paste into
#      engine/quant/gemv.py, and the GEMV time of a 27B decode step.
# Logs and JSON under $OUT. Budget: ~7 minutes, 8.5 at worst (step timeouts);
# a sweep cut short still leaves each finished shape's TUNED line in the log.
set -uo pipefail
source scripts/device_env.sh
python -c "import torch, triton; print(torch.__version__, triton.__version__)"
echo "== quant kernel tests on CUDA (compiled Triton)"
TRITON_INTERPRET=0 timeout 180 python -m pytest -q -p no:cacheprovider tests/test_quant_kernels.py \
  2>&1 | tee "$OUT/pytest_quant_cuda.log" | tail -5
echo "== sm_90 build of the GEMV: registers and loop instructions per weight"
timeout 45 python -m bench.gemv_sass --rows 1 4 2>&1 | tee "$OUT/gemv_sass.txt" | tail -20
echo "== GEMV with the picked configs, then the 27B int4 decode step"
timeout 120 python -m bench.quant --rows 1 4 --decode-steps 16 --json "$OUT/quant.json" \
  2>&1 | tee "$OUT/bench_quant.log" | tail -32
echo "== GEMV sweep over the 27B shapes"
timeout 165 python -m bench.quant --rows 1 4 --sweep --decode-steps 0 --json "$OUT/sweep.json" \
  2>&1 | tee "$OUT/bench_sweep.log" | tail -70
