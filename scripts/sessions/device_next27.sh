#!/usr/bin/env bash
# Ran 2026-12-03 11:12 (217 s; BENCHMARKS.md, "MTP heads on 492 natural chat requests").
# Next GPU session, first call (~4 min; carry .whl). After 2026-12-03 08:46:
#  1. the rest of the I2F-free paths' GPU tests: 08:45 stopped at
#     test_rk4_pairs_and_int8_without_i2f_match_reference_and_the_old_path's
#     fp32 old-against-new check (tf32 rounding; the check now allows 2^-10 on a
#     GPU), so its later parametrizations and the compiled PRMT exactness tests
#     (test_codes_become_exact_floats_without_i2f) have not run on a GPU;
#  2. int8 decode tiles on one stage (TANDEM_DECODE_STAGES=1): bench.attention
#     had them 0.266-0.274 ms a 128K layer against 0.304-0.308 on Triton's
#     stages (08:24, a noisy host); two alternating whole-step pairs, default
#     to one stage only if both win at 128K and neither loses at 4K;
#  3. two more TANDEM_RK4_PAIRS pairs (08:28: 128K faster in both, 4K split)
#     on what is hopefully a steadier host.
# Second call: the agent loop with rk4 KV, the goal's format (int8's median
# TTFT was 0.299 s at 12-02 14:15): `KV=rk4 PROFILE_EVERY=10 bash
# scripts/device_agent_loop.sh`. Third: the MTP head's next lever is chat
# subjects (dev chat first-draft accuracy 0.38 against 0.66 on held-out
# varied answers): scripts/device_chain_mtp.sh with more chat topics.
set -uo pipefail
M=qwen3.5-27b
source scripts/device_env.sh
STEP_TAIL=4 step no_i2f_tests 200 python3 -m pytest -q -p no:cacheprovider \
  tests/test_attention.py -k "pairs_and_int8 or exact_floats or i2f or stage"
decode() {  # decode NAME KV ENV...: the step at 4K and 128K
  local name=$1 kv=$2; shift 2
  STEP_TAIL=2 step "$name" 90 env "$@" python3 -m bench.decode --model $M --device cuda \
    --kv-format "$kv" --batch 1 --context 4096 131072 --steps 16
}
for pair in 1 2; do
  # a pair's four runs take ~4 x 45 s: start one only if it ends inside the call
  if [ $((SECONDS + 200)) -gt "${DEADLINE:-580}" ]; then echo "pair $pair skipped: ${SECONDS}s gone"; break; fi
  decode int8_stages_default_$pair int8 TANDEM_DECODE_STAGES=
  decode int8_stages1_$pair int8 TANDEM_DECODE_STAGES=1
  decode rk4_pairs0_$pair rk4 TANDEM_RK4_PAIRS=0
  decode rk4_pairs1_$pair rk4 TANDEM_RK4_PAIRS=1
done
tar czf /tmp/next27.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/next27.tgz "$OUT/"
