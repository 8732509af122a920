#!/usr/bin/env bash
# Decode attention without I2F (carry .whl). With bf16 dot operands the
# 131K decode attention takes ~0.185 ms a layer over rk4 and int8 pages where
# its bytes need ~0.05: per-tile instructions are the limit, and each K and V
# element took an int-to-float conversion (1/8 of FADD's rate on sm_90).
#  - TANDEM_RK4_PAIRS (default 1): rk4 on even/odd channel-pair tiles, nibbles
#    made fp32 by PRMT (rk4p's way), one stage (static sm_90 build: 2,152 ->
#    1,869 loop instructions a thread and tile, 256 I2F -> 0, 245 registers,
#    no stack); 0 is the channel-order tiles.
#  - TANDEM_INT8_NO_I2F (default 1): int8 codes as 2**23 + code + 128 from
#    their bits (256 I2F -> 256 PRMT + 256 FADD a tile); bit-identical.
# Nothing below has run on a GPU yet. Two calls of ~5 min each (all of it
# passes 6 minutes): `bash scripts/sessions/device_next26.sh`, then
# `PART=2 bash scripts/sessions/device_next26.sh`.
#  1. GPU tests: rk4 and int8 attention against the reference, both sides of
#     each switch against each other (int8 bit for bit), the compiled PRMT
#     paths on every code (~1.5 min);
#  2. bench.attention, decode at 131,072 tokens, 64 splits, both switches off
#     then on: candidates 19 (4 warps, Triton's stages: today's rk4 and int8
#     decode tiles), 21 (8 warps) and 25 (4 warps, one stage: the pair
#     program's tiles) (~1.5 min);
#  3. the int8 decode step, TANDEM_INT8_NO_I2F 0 / 1, one pair, 4K and 128K
#     (~2 min); PART=2: the rk4 step, TANDEM_RK4_PAIRS 0 / 1, two pairs.
# What decides the defaults: each switch stays on only if every pair's 128K
# step is faster with it on (and 4K no slower) and its tests pass; else set
# its default to off in engine/kv/attention.py and say why. For rk4, if
# bench.attention has the pairs faster at 25 than 19 and 21, one stage is
# right; if 21 beats 25, tiles_for's rk4 decode tiles should take 8 warps.
set -uo pipefail
M=qwen3.5-27b
source scripts/device_env.sh
if [ "${PART:-1}" = "1" ]; then
  STEP_TAIL=4 step no_i2f_tests 150 python3 -m pytest -q -p no:cacheprovider \
    tests/test_attention.py -k "rk4 or int8 or i2f"
  for s in 0 1; do
    STEP_TAIL=12 step attention_switches$s 100 env TANDEM_RK4_PAIRS=$s TANDEM_INT8_NO_I2F=$s \
      python3 -m bench.attention --new 1 --context 131072 --kv-format rk4 int8 \
      --candidates 19 21 25 --splits 64
  done
  for s in 0 1; do
    STEP_TAIL=2 step int8_no_i2f${s} 90 env TANDEM_INT8_NO_I2F=$s python3 -m bench.decode \
      --model $M --device cuda --kv-format int8 --batch 1 --context 4096 131072 --steps 16
  done
else
  for pair in 1 2; do
    for s in 0 1; do
      STEP_TAIL=2 step rk4_pairs${s}_$pair 90 env TANDEM_RK4_PAIRS=$s python3 -m bench.decode \
        --model $M --device cuda --kv-format rk4 --batch 1 --context 4096 131072 --steps 16
    done
  done
fi
tar czf /tmp/next26.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/next26.tgz "$OUT/"
