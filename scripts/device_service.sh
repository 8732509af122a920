#!/usr/bin/env bash
# GPU checks of the service (run on the device machine from the repo root, with
# the wheels in .whl carried): CUDA tests of the engine and the kvstore's CUDA
# IPC, the hybrid service end to end on CUDA, and the Qwen3.5-27B dummy shape
# served by `tandem serve` within a memory budget. Logs under $OUT.
set -uo pipefail
source scripts/device_env.sh
python -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_kvstore_process.py -k "cuda or Cuda" \
  2>&1 | tee "$OUT/pytest_cuda.log" | tail -4
TANDEM_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider tests/test_service_hybrid.py \
  2>&1 | tee "$OUT/pytest_service_cuda.log" | tail -4
python -m bench.serve_smoke --model qwen3.5-27b --device cuda --prompt-tokens 2048 --new-tokens 32 \
  --max-context-tokens 32768 --gpu-memory-budget 80GiB --json "$OUT/serve_27b.json" \
  2>&1 | tee "$OUT/serve_27b.log" | tail -25

