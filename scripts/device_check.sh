#!/usr/bin/env bash
# One GPU session's checks for the engine core (run on the device machine from
# the repo root): CUDA tests against transformers, then the 27B dummy shape
# decoding on the GPU. Writes logs and JSON under $OUT.
set -uo pipefail
source scripts/device_env.sh
python -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
python -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_gdn.py 2>&1 | tee "$OUT/pytest_cuda.log" | tail -5
python -m bench.decode --model qwen3.5-27b --device cuda --prompt-tokens 512 --new-tokens 16 \
  --repeats 1 --json "$OUT/decode_27b_dummy.json" 2>&1 | tee "$OUT/decode_27b.log" | tail -8
python -m bench.decode --model tiny-qwen3.5 --device cuda --prompt-tokens 128 --new-tokens 32 \
  --batch 1 4 --repeats 2 2>&1 | tail -6

