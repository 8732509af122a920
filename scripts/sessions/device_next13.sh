#!/usr/bin/env bash
# After the 14:10 run (~9 min; carry .whl):
#  1. decode with 64-key attention tiles (TANDEM_DECODE_BLOCK_N=64; 14:13:
#     decode's attention alone at 128K 0.307 -> 0.256 ms a layer) against the
#     default 32, the whole step at 4K and 128K (11:53: 15.06 / 18.48 ms,
#     81.3% / 71.6% of the roofline, goals 85% / 75%);
#  2. with 64-key tiles, the GPU parity tests: speculative verify against
#     plain decode, graph replay against eager, and the MTP drafts' new
#     graphs (engine/cuda_graphs.py DraftForward, never run on a GPU yet); if
#     they pass and (1) is faster, decode_block_n's default becomes 64 at
#     head_dim 256;
#  3. tokens/s with and without MTP on the 27B shape (dummy weights: drafts
#     are rarely accepted, so the MTP row is the cost of drafting and
#     verifying against a plain step's one token).
# Then, a call of its own (~7 min): the rk4p offline turn (no result within
# 70 and 110 s at 13:50 / 14:10; 0.288 s at 12:04) and the agent loop with
# rk4p KV, the issue's 4-bit format (int8's median TTFT 0.299 s at 14:15):
#   STEP_SIGNAL=ABRT bash -c 'source scripts/device_env.sh; step prefill_99k_rk4p 200 env \
#     TANDEM_PREFILL_WORKSPACE_TOKENS=131072 python3 -m bench.prefill --model qwen3.5-27b \
#     --device cuda --kv-format rk4p --cached-tokens 99000 --tokens 1100 --chunk 4096 --repeats 3'
#   KV=rk4p PROFILE_EVERY=10 bash scripts/device_agent_loop.sh
# (its log should show "decode: warmed up" and no "a decode step ... waited":
# the decode warm-up, decode/warmup.py, has not run on a GPU yet); then
# SHARES="70 80" bash scripts/device_mps.sh; bash scripts/device_memory24.sh;
# and, the GGUF carried in three parts, the embedded model's MTP tokens/s
# with the draft graphs (14:18: 73 chat / 151 code tok/s against 234 plain):
#   python -m bench.speculative --device cuda --tokens-model embedded \
#     --methods none mtp --ks 3 --new-tokens 96
set -uo pipefail
source scripts/device_env.sh
M=qwen3.5-27b
for n in 32 64; do
  STEP_TAIL=6 step decode_tiles_$n 100 env TANDEM_DECODE_BLOCK_N=$n python3 -m bench.decode \
    --model $M --device cuda --kv-format int8 --batch 1 --context 4096 131072 --steps 16
done
STEP_SIGNAL=ABRT STEP_TAIL=20 step parity_tiles_64 200 env TANDEM_DECODE_BLOCK_N=64 \
  python3 -m pytest -q -p no:cacheprovider tests/test_speculative.py tests/test_cuda_graphs.py \
  tests/test_attention.py -k "cuda or graph or parity or decode or draft"
STEP_TAIL=8 step spec_tokens_27b 150 python3 -m bench.speculative --device cuda \
  --tokens-model $M --methods none mtp --ks 3 --new-tokens 48
