#!/usr/bin/env bash
# One call for this session's GPU checks (~9 min; fla carried): the 27B
# prefill with fla GDN + the Triton prefill conv + bf16-dot attention
# (profiled); decode and int4 GEMVs after the merged projections
# (scripts/device_merge.sh's benches); the compiled tests of every kernel
# changed; the extended prefill-attention tile sweep.
set -uo pipefail
source scripts/device_env.sh
M=qwen3.5-27b
STEP_TAIL=30 step prefill 80 python3 -m bench.prefill --model $M --device cuda \
  --kv-format int8 --tokens 4096 32768 --chunk 4096 --repeats 1 --profile \
  --json "$OUT/prefill.json"
STEP_TAIL=10 step decode_bf16 70 python3 -m bench.decode --model $M --device cuda \
  --kv-format int8 --batch 1 4 --context 4096 --steps 24 --json "$OUT/decode_bf16.json"
STEP_TAIL=45 step quant 90 python3 -m bench.quant --rows 1 --decode-steps 16 \
  --json "$OUT/quant.json"
step pytest_kernels 170 python3 -m pytest -q -p no:cacheprovider tests/test_gdn_fla.py \
  tests/test_cuda_graphs.py tests/test_cuda.py "tests/test_gdn_kernels.py::test_conv_chunk_matches_reference" \
  tests/test_attention.py::test_prefill_with_bf16_dot_operands_matches_reference \
  tests/test_fused.py
step pytest_gemv 110 python3 -m pytest -q -p no:cacheprovider tests/test_quant_kernels.py -k gemv
STEP_TAIL=20 step attention 60 python3 -m bench.attention --context 32768 --new 4096 \
  --kv-format int8 --json "$OUT/attention.json"
