#!/usr/bin/env bash
# 12-06 (fourth session): two launches fewer an attention layer (q and k norm
# + rotary in one, TANDEM_NORM_ROPE_PAIR; the output gate in the split
# combine, TANDEM_COMBINE_GATE), and when a kernel releases the next one.
#   release  (15:45, H100; the switch TANDEM_PDL_RELEASE is gone since): the
#     int4 27B step in three alternating rounds: both fusions off 6.53-6.55 ms,
#     on 6.50-6.51; on, with every Triton kernel releasing its dependents
#     before its wait 6.69-6.71, and the CUDA GEMVs too 6.77-6.78
#   critical, tests  (15:53, H100): the critical path of the fused step (595
#     launches, was 627), the combine 2.73 us a layer (gate inside, splits
#     without keys skipped by a dependent load: since reverted); the gate's
#     fp32 case not bitwise on the GPU (ulps of contracted sums)
#   bash scripts/sessions/device_next58.sh ab  (carry .whl): both fusions off
#     against on, alternating (ROUNDS, 2), the kernels' GPU tests, and the fused
#     step's critical path over the headline's bf16 KV at 256 tokens (16:10-16:11,
#     H100, run as its steps one by one: off 6.53-6.54 ms, on 6.50 in two pairs;
#     the gate test passed; the chain a layer: q/k 1.31, write 1.17, attention
#     6.46, combine with the gate 2.98 us)
set -uo pipefail
call=${1:?ab}
source scripts/device_env.sh
case "$call" in
  ab)
    for round in $(seq "${ROUNDS:-2}"); do
      TANDEM_NORM_ROPE_PAIR=0 TANDEM_COMBINE_GATE=0 step_27b s${round}_a_apart
      step_27b s${round}_b_fused
    done
    step_cols s
    STEP_TAIL=4 step tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_fused.py \
      tests/test_attention.py -k "norm_rope or gate"
    STEP_TAIL=0 step critical 200 python3 -m bench.profile_step --weights int4 \
      --kv-format bf16 --context 256 --critical-path --top 40
    sed -n '/critical path/,$p' "$OUT/critical.log" | head -24 ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
