#!/usr/bin/env bash
# Where the 27B prefill's time goes (issue 6's 55% MFU at 32K) and the fast
# path's compiled tests, in one call (~8 min): the GPU tests of the fused
# kernels, graphs and attention (incl. the bf16-dot prefill tiles); the
# prefill attention kernel alone per tile config against torch SDPA; a 4K and
# a 32K prefill with the 32K one profiled by kernel kind; the int4 decode
# step's kernels.
set -uo pipefail
source scripts/device_env.sh
step pytest_gpu 200 python3 -m pytest -q -p no:cacheprovider tests/test_fused.py \
  tests/test_gdn_kernels.py tests/test_gdn_batched.py tests/test_cuda_graphs.py tests/test_cuda.py \
  tests/test_attention.py \
  "tests/test_speculative.py::test_graph_replayed_verify_keeps_greedy_parity_on_cuda" \
  tests/test_quant_kernels.py::test_tuned_configs_compute_the_product
STEP_TAIL=30 step attention 90 python3 -m bench.attention --context 32768 --new 4096 \
  --kv-format int8 bf16 --json "$OUT/attention.json"
STEP_TAIL=60 step prefill 150 python3 -m bench.prefill --model qwen3.5-27b --device cuda \
  --kv-format int8 --tokens 4096 32768 --chunk 4096 --repeats 1 --profile \
  --json "$OUT/prefill.json"
STEP_TAIL=40 step profile_int4 80 python3 -m bench.profile_step --weights int4 --top 25 \
  --json "$OUT/profile_int4.json"
