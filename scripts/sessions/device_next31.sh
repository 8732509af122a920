#!/usr/bin/env bash
# GPU session of 2026-12-03 15:52-16:33, all five calls run (BENCHMARKS.md,
# "where the decode step's small kernels go"; next: device_next33.sh).
# Call 1: where the int4 and bf16 steps go now (bench.profile_step with
#   TANDEM_PDL=0, the only way its kernel times add up; the int4 step had
#   ~2.5 ms outside its 4.66 ms of GEMVs at 14:31), then the int4 step and
#   rk4 decode at 4K / 128K twice each with PDL on (the defaults).
set -uo pipefail
M=qwen3.5-27b
source scripts/device_env.sh
case "${1:?call 1 or 2}" in
  1)
    for weights in int4 bf16; do
      STEP_TAIL=60 TANDEM_PDL=0 step "profile_$weights" 150 python3 -m bench.profile_step \
        --weights "$weights" --top 40 --json "$OUT/profile_$weights.json"
    done
    for i in 1 2; do
      STEP_TAIL=4 step int4_step_$i 100 python3 -m bench.quant --rows 1 --only lm_head --decode-steps 16
      STEP_TAIL=6 step rk4_decode_$i 150 python3 -m bench.decode --model $M --device cuda \
        --kv-format rk4 --batch 1 --context 4096 131072 --steps 16
    done
    ;;
esac
# Call 2: the step without each kind of small kernel (bench.ablate_step: an
#   upper bound on what fusing it away could save), int4 and bf16 weights,
#   rk4 KV at 4K.
if [ "$1" = 2 ]; then
  for weights in int4 bf16; do
    STEP_TAIL=16 step "ablate_$weights" 280 python3 -m bench.ablate_step --weights "$weights" \
      --kv-format rk4 --context 4096 --json "$OUT/ablate_$weights.json"
  done
fi
# Call 3: rk4's rotations folded into the kernels beside them (q into the
#   attention kernel, the output's way back into the split combine, K and V
#   into the KV write: TANDEM_RK4_FUSED_ROTATION) and the norms' weights read
#   before the dependent-launch wait. GPU tests first, then the rk4 decode
#   step at 4K / 128K with the fused rotations off and on, alternating, and
#   the int4 step twice.
if [ "$1" = 3 ]; then
  STEP_TAIL=6 step gpu_tests 300 python3 -m pytest -q -p no:cacheprovider -x \
    tests/test_hadamard.py tests/test_fused.py tests/test_pdl.py tests/test_cuda_graphs.py
  STEP_TAIL=4 step gpu_attention_tests 200 python3 -m pytest -q -p no:cacheprovider \
    tests/test_attention.py -k rk4
  for i in 1 2; do
    for fused in 0 1; do
      STEP_TAIL=6 TANDEM_RK4_FUSED_ROTATION=$fused step "rk4_fused${fused}_$i" 150 \
        python3 -m bench.decode --model $M --device cuda --kv-format rk4 --batch 1 \
        --context 4096 131072 --steps 16
    done
  done
  for i in 1 2; do
    STEP_TAIL=4 step int4_step_$i 100 python3 -m bench.quant --rows 1 --only lm_head --decode-steps 16
  done
fi
# Call 4: call 3 found the three fused rotations together no faster (4K
#   14.45 / 14.34 ms against 14.13 / 14.23 with none): each site alone,
#   alternating, to see which one costs.
if [ "$1" = 4 ]; then
  STEP_TAIL=4 step gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -x \
    tests/test_hadamard.py -k "attention or rotating_write or sites"
  for i in 1 2; do
    for sites in none write combine query all; do
      STEP_TAIL=3 TANDEM_RK4_FUSED_ROTATION=$sites step "rk4_${sites}_$i" 100 \
        python3 -m bench.decode --model $M --device cuda --kv-format rk4 --batch 1 \
        --context 4096 131072 --steps 16
    done
  done
fi
# Call 5: the GDN decode steps' tile widths (bench.ablate_step, 15:58: the
#   recurrence step's kernels cost up to 0.37 ms of the int4 step, the conv
#   step's 0.25): conv channels per program (TANDEM_GDN_CONV_BLOCK, 128) and
#   recurrence value columns (TANDEM_GDN_BLOCK_V, 32), alternating.
if [ "$1" = 5 ]; then
  STEP_TAIL=3 step gpu_tests 120 python3 -m pytest -q -p no:cacheprovider -x \
    tests/test_gdn_kernels.py
  for i in 1 2; do
    for cfg in 128:32 64:32 256:32 128:16 128:64; do
      conv=${cfg%:*} cols=${cfg#*:}
      STEP_TAIL=3 TANDEM_GDN_CONV_BLOCK=$conv TANDEM_GDN_BLOCK_V=$cols step \
        "gdn_c${conv}_v${cols}_$i" 100 python3 -m bench.decode --model $M --device cuda \
        --kv-format rk4 --batch 1 --context 4096 131072 --steps 16
    done
  done
fi
