#!/usr/bin/env bash
# Speculative decoding on the GPU (run on the device machine from the repo
# root; ~4 min): the 27B dummy shape's k=1..3 verify step vs a plain decode
# step at 4K context (goal: k=3 <= 1.15x), then tokens/s and mean accepted
# length with and without speculation on the embedded model. Logs and JSON
# under $OUT.
set -uo pipefail
source scripts/device_env.sh
python -m bench.speculative --device cuda --verify-model qwen3.5-27b --context 4096 --ks 1 2 3 \
  --repeats 20 --json "$OUT/spec_verify_27b.json" 2>&1 | tee "$OUT/spec_verify.log" | tail -5
python -m bench.speculative --device cuda --tokens-model embedded --methods none ngram mtp \
  --ks 1 2 3 --new-tokens 96 --json "$OUT/spec_tokens.json" 2>&1 | tee "$OUT/spec_tokens.log" | tail -16

