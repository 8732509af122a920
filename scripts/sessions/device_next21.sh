#!/usr/bin/env bash
# Next GPU session, first call (~8 min; carry .whl). After 2026-12-03 03:58:
#  1. the split-K fix-up (TANDEM_SPLIT_FIXUP, off by default): the last
#     program of each output tile sums the partials instead of a second
#     launch. GPU tests first (bitwise equal to the sum kernel, counters left
#     at zero: this is the first run of its acquire-release ordering on a
#     GPU), then alternating A/B pairs on the int4 step (128 sums a step) and
#     the bf16 step at 4K / 128K (64 sums). Make it the default only if both
#     pairs win; the 4K bf16 step stood at 14.42 ms = 84.93% (85% = 14.41).
#  2. where the rk4p decode step's time goes (never profiled; 4K 75.7%, 128K
#     54% on 12-02 05:13, before PDL), and its step now.
#  2b. rk4 decode with its bytes and scales loaded once per tile (sm_90
#     build: 1,267 loop instructions per 64-key tile and thread, was 2,191;
#     128 registers, was 255; 03:56: 15.72 / 47.60 ms at 4K / 128K);
#  3. the GPU tests of the prefill's own q/k L2 norm ahead of fla-core's
#     chunked rule (gdn_kernels.l2_normalize_heads: fla's norm autotuned
#     through configs with 808 B of stack, which kept the prefill worker's
#     local memory ~210 MiB up; the 32K run of 03:55, at 192 B, most likely
#     found fla's autotune results cached by the 8K run before it).
# Second call: `bash scripts/device_memory24.sh` (the prefill worker's stack
# line should stay <= 224 B in both runs) and `bash scripts/device_ncu_attention.sh`
# (why decode attention at 128K runs at a third of the bandwidth), then the rk4p prefill at 99K and
# agent loop (device_next13.sh's header), the embedded MTP with the GGUF in
# three chained calls (device_mtp.sh).
set -uo pipefail
M=qwen3.5-27b
source scripts/device_env.sh
STEP_TAIL=4 step fixup_tests 150 python3 -m pytest -q -p no:cacheprovider \
  tests/test_dense_gemv.py tests/test_quant_kernels.py tests/test_gdn_fla.py \
  tests/test_gdn_kernels.py tests/test_attention.py \
  -k "fixup or split or int8_activation or tuned or fla or l2 or rk4 or decode"
for pair in 1 2; do
  for f in 0 1; do
    STEP_TAIL=1 step int4_fixup${f}_$pair 120 env TANDEM_SPLIT_FIXUP=$f python3 -m bench.quant \
      --rows 1 --only lm_head --decode-steps 16
  done
done
for pair in 1 2; do
  for f in 0 1; do
    STEP_TAIL=2 step bf16_fixup${f}_$pair 90 env TANDEM_SPLIT_FIXUP=$f python3 -m bench.decode \
      --model $M --device cuda --kv-format int8 --batch 1 --context 4096 131072 --steps 16
  done
done
STEP_TAIL=30 step profile_rk4p 150 env TANDEM_PDL=0 python3 -m bench.profile_step \
  --weights bf16 --kv-format rk4p --context 4096
for kv in rk4p rk4; do
  STEP_TAIL=3 step ${kv}_decode 120 python3 -m bench.decode --model $M --device cuda \
    --kv-format $kv --batch 1 --context 4096 131072 --steps 16
done
tar czf /tmp/next21.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/next21.tgz "$OUT/"
