#!/usr/bin/env bash
# After the 16:36 run (~9 min; carry .whl). Two A/B switches built at 17:00
# without a GPU, both off by default until this runs:
#  1. TANDEM_GEMV_EARLY=1: the DP4A GEMV loads its first weight tile before
#     the dependent-launch wait (its sm_90 build puts the loads ahead of the
#     wait): the int4 27B step, alternating (16:36-16:45 with PDL: 7.30-7.85
#     ms); if faster, engine/quant/gemv.py early_weights' default becomes 1;
#  2. TANDEM_DENSE_GEMV=1: the bf16 weights' decode-width matmuls on our
#     Triton GEMV (engine/dense_gemv.py) instead of cuBLAS, so that the
#     dependent launches reach every kernel of the bf16 step: its GPU tests,
#     bench.dense_gemv (every candidate config against cuBLAS per 27B shape),
#     then the whole bf16 step at 4K and 128K both ways (16:36-16:46:
#     14.59-14.78 / 17.68-18.04 ms, 83.6-84.7% / 74.1-74.6% against 85% /
#     75%), and with TANDEM_GEMV_EARLY=1 too (its first weight tile before
#     the wait, as in 1). If the step is faster, paste the best configs into
#     the picking and make it the default on sm_90.
# Then: the EARLY parity tests (tests/test_quant_kernels.py -k "int8 or tuned"
# with TANDEM_GEMV_EARLY=1), `TANDEM_PDL=0 python -m bench.profile_step
# --weights int4` (a PDL step cannot be split by the profiler), and the calls
# of device_next13.sh's header (rk4p turn and agent loop, MPS 70/80%, the 24
# GiB demonstration, the embedded model's MTP with the GGUF in three parts).
set -uo pipefail
source scripts/device_env.sh
M=qwen3.5-27b
for e in 1 0 1 0; do
  STEP_TAIL=1 step int4_early$e 70 env TANDEM_GEMV_EARLY=$e python3 -m bench.quant --rows 1 \
    --only lm_head --decode-steps 16
done
STEP_SIGNAL=ABRT STEP_TAIL=4 step dense_tests 120 python3 -m pytest -q -p no:cacheprovider \
  tests/test_dense_gemv.py
STEP_TAIL=24 step dense_bench 200 python3 -m bench.dense_gemv --rows 1 4
for d in 1 0; do
  STEP_TAIL=3 step bf16_dense$d 90 env TANDEM_DENSE_GEMV=$d python3 -m bench.decode --model $M \
    --device cuda --kv-format int8 --batch 1 --context 4096 131072 --steps 16
done
STEP_TAIL=3 step bf16_dense_early 90 env TANDEM_DENSE_GEMV=1 TANDEM_GEMV_EARLY=1 \
  python3 -m bench.decode --model $M --device cuda --kv-format int8 --batch 1 \
  --context 4096 131072 --steps 16
