#!/usr/bin/env bash
# Next GPU session, first call (~8 min; carry .whl). Since 2026-12-03 06:33
# nothing below has run on a GPU:
#  1. int8 and rk4 KV's K and V quantized in one launch (a decode step had
#     two ~6 us launches a layer): the bitwise GPU tests and the bf16 step at
#     4K / 128K, int8 KV (06:28: 14.52 / 16.97 ms; today's 4K runs 14.22-14.52;
#     the rk4 steps come with the Hadamard A/B below);
#  2. the rk4 rotation as a Triton FWHT (TANDEM_HADAMARD_KERNEL, off):
#     scripts/device_hadamard.sh's tests, bench.hadamard and two A/B pairs
#     of the rk4 step (06:28: 15.12 / 18.74 ms). Default it on only if both
#     pairs agree. Second call: `KV=rk4p TESTS=0 bash scripts/device_hadamard.sh`.
# Then, from device_next21.sh's header: the rk4p prefill at 99K and the agent
# loop (device_next13.sh), the embedded MTP with the GGUF in three chained
# calls (device_mtp.sh), and an MTP head trained on the H200 with
# `train-mtp --varied 2000 --samples-per-prompt 2`, chosen on the dev set
# (`bench.mtp_gap --prompts dev`).
set -uo pipefail
M=qwen3.5-27b
source scripts/device_env.sh
STEP_TAIL=3 step int8_write_tests 90 python3 -m pytest -q -p no:cacheprovider \
  tests/test_kv_formats.py -k "int8 or rk4"
for run in 1 2; do
  STEP_TAIL=2 step int8_decode_$run 90 python3 -m bench.decode --model $M --device cuda \
    --kv-format int8 --batch 1 --context 4096 131072 --steps 16
done
bash scripts/device_hadamard.sh
tar czf /tmp/next25.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/next25.tgz "$OUT/"
