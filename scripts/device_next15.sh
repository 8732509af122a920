#!/usr/bin/env bash
# After the 16:36 run (~8 min; carry .whl):
#  1. the DP4A GEMV's first weight tile loaded before the dependent-launch
#     wait (TANDEM_GEMV_EARLY=1, engine/quant/gemv.py early_weights; its
#     sm_90 build puts the weight loads ahead of the wait, CPU-checked):
#     the int4 27B step against EARLY=0 (16:36-16:45 with PDL: 7.30-7.85
#     ms), alternating, and its parity (the quant kernel tests compiled);
#     if faster, early_weights' default becomes 1;
#  2. the int4 step's kernels with PDL off (the profiler cannot split a
#     PDL step: each kernel's time then includes its wait);
#  3. the bf16 step at 4K and 128K again (83.6-84.7% / 74.1-74.6% at
#     16:36-16:46 against 85% / 75%).
# Then, calls of their own: the rk4p offline turn and agent loop, MPS at
# 70/80%, the 24 GiB demonstration (device_next13.sh's header has the
# commands), and the embedded model's MTP with the GGUF in three parts.
set -uo pipefail
source scripts/device_env.sh
for e in 1 0 1 0; do
  STEP_TAIL=1 step int4_early$e 70 env TANDEM_GEMV_EARLY=$e python3 -m bench.quant --rows 1 \
    --only lm_head --decode-steps 16
done
STEP_SIGNAL=ABRT STEP_TAIL=6 step early_parity 200 env TANDEM_GEMV_EARLY=1 python3 -m pytest -q \
  -p no:cacheprovider tests/test_quant_kernels.py tests/test_pdl.py -k "int8 or tuned or pdl or dependent"
STEP_TAIL=40 step profile_int4_nopdl 90 env TANDEM_PDL=0 python3 -m bench.profile_step \
  --weights int4 --top 16
STEP_TAIL=4 step bf16_step 100 python3 -m bench.decode --model qwen3.5-27b --device cuda \
  --kv-format int8 --batch 1 --context 4096 131072 --steps 16
