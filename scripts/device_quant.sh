#!/usr/bin/env bash
# One GPU session for the 4-bit weights (issue 7), from the repo root on the
# device machine: the quant kernel tests compiled for CUDA, W4A16 GEMV times
# for the Qwen3.5-27B matrix shapes (rows 1 and 4) against the copy-bandwidth
# floor, the 27B dummy's decode step with int4 weights, and `tandem plan` for
# the 24 GiB demonstration. Logs and JSON under $OUT. Budget: ~6 minutes.
set -uo pipefail
source scripts/device_env.sh
python -c "import torch, triton; print(torch.__version__, triton.__version__)"
echo "== quant kernel tests on CUDA (compiled Triton)"
TRITON_INTERPRET=0 timeout 240 python -m pytest -q -p no:cacheprovider tests/test_quant_kernels.py \
  2>&1 | tee "$OUT/pytest_quant_cuda.log" | tail -5
echo "== W4A16 GEMV vs bandwidth, and the 27B int4 decode step"
timeout 300 python -m bench.quant --rows 1 4 --decode-steps 16 --json "$OUT/quant.json" \
  2>&1 | tee "$OUT/bench_quant.log" | tail -30
echo "== memory plan of the demonstration"
python -m tandem.cli plan --model qwen3.5-27b --weights int4 --kv-format rk4 --context 262144 \
  --speculative mtp --draft-tokens 3 --snapshot-slots 4 --gpu-memory-budget 24GiB 2>&1 | tee "$OUT/plan.txt"
