#!/usr/bin/env bash
# Speculative decoding through `tandem serve` on the GPU (run on the device
# machine from the repo root; ~5 min): the service test module on CUDA (MTP
# and n-gram, greedy parity with the offline engine, counters, cancellation),
# then the Qwen3.5-27B dummy shape served with --speculative mtp inside a
# memory budget (the kvstore's plan, printed at start, has the "mtp kv pages"
# and "gdn draft slots" lines). Logs and JSON under $OUT.
set -uo pipefail
source scripts/device_env.sh
TANDEM_TEST_DEVICE=cuda timeout 330 python -m pytest -q -p no:cacheprovider \
  tests/test_service_speculative.py 2>&1 | tee "$OUT/pytest_service_speculative_cuda.log" | tail -15
for method in none mtp; do
  timeout 200 python -m bench.serve_smoke --model qwen3.5-27b --device cuda --prompt-tokens 2048 \
    --new-tokens 32 --max-context-tokens 32768 --gpu-memory-budget 80GiB --speculative "$method" \
    --draft-tokens 3 --json "$OUT/serve_27b_$method.json" 2>&1 | tee "$OUT/serve_27b_$method.log" | tail -12
done

