#!/usr/bin/env bash
# 2026-12-03, second call (~6 min; carry .whl). The 03:25 run of
# device_next18.sh: the decode worker still at 1.50 GiB under NVML (12-01
# 18:00: 0.79) though its PyTorch reserve peaked at only 350 MiB, so ~0.7 GiB
# of it is outside PyTorch. Suspect: a kernel added since 12-01 18:00 (the
# fused GDN steps, PDL, the early first tile) that spills or keeps a local
# array, raising the context's stack limit and with it the local-memory
# reservation (limit x 2,048 threads x 132 SMs: 2.7 KiB a thread is 0.7 GiB).
#  1. the 8K demonstration with a fresh Triton cache: the workers' lines now
#     give NVML's figure and the stack limit; scripts/kernel_stacks.py then
#     lists every compiled kernel that needs a stack;
#  2. where the int4 and bf16 steps' time goes, kernels timed without PDL.
set -uo pipefail
source scripts/device_env.sh
export TRITON_CACHE_DIR=/tmp/tc19; rm -rf "$TRITON_CACHE_DIR"
timeout 220 python -m bench.memory --model qwen3.5-27b --weights int4 --kv-format rk4 \
  --speculative mtp --draft-tokens 3 --device cuda --max-context-tokens 262144 \
  --prefill-chunk 512 --gpu-memory-budget 24GiB --prompt-tokens 8192 --new-tokens 64 \
  --serve-args "--live-slots 1 --snapshot-slots 2 --max-batch 1" \
  --json "$OUT/memory_8192.json" > "$OUT/memory_8192.log" 2>&1
grep -e "reserve" -e "compile" "$OUT/memory_8192.log"; grep -v "^\[" "$OUT/memory_8192.log" | tail -8
python scripts/kernel_stacks.py "$TRITON_CACHE_DIR" 2>&1 | tee "$OUT/stacks.txt"
python scripts/kernel_stacks.py "$TRITON_CACHE_DIR" --all > "$OUT/kernels_all.txt" 2>&1
unset TRITON_CACHE_DIR
STEP_TAIL=40 step profile_int4 150 env TANDEM_PDL=0 python3 -m bench.profile_step \
  --weights int4 --kv-format int8 --context 4096
STEP_TAIL=40 step profile_bf16 150 env TANDEM_PDL=0 python3 -m bench.profile_step \
  --weights bf16 --kv-format int8 --context 4096
tar czf /tmp/next19.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/next19.tgz "$OUT/"
