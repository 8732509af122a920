#!/usr/bin/env bash
# The disaggregated topology on ONE GPU (run on the device machine from the
# repo root; at most ~9 min: each step has its own timeout, 220+70+70+190 s). Two stores share the
# one device, so "peer copies" are CUDA IPC device-to-device copies into the
# other store's memory, and torch.distributed runs with gloo (through host
# memory) because NCCL refuses two ranks on one GPU (step 2 records what it
# says). Logs and JSON under $OUT.
#   1. transfer unit tests and the disaggregated service tests on CUDA (gloo
#      and peer copies, embedded model, tiny-llama 2+2, tiny-qwen3.5 state)
#   2. raw link bandwidth on synthetic bf16 pages (2 GiB per transfer):
#      peer copy cuda:0 -> cuda:0 vs the device copy bandwidth; NCCL two
#      ranks on cuda:0 (expected: refused); gloo via host
#   3. TTFT / time-to-second-token, shared vs disaggregated (peer copies),
#      on the Qwen3.5-27B dummy shape with int4 weights
set -uo pipefail
source scripts/device_env.sh
TANDEM_TEST_DEVICE=cuda TANDEM_TRANSFER_BACKEND=gloo timeout 220 python -m pytest -q \
  -p no:cacheprovider tests/test_transfer.py tests/test_service_disagg.py 2>&1 \
  | tee "$OUT/pytest_disagg_cuda.log" | tail -15
RAW="--raw --device cuda --raw-pages 4096 --raw-move 2048 --raw-layers 16 --repeats 5"
timeout 70 python -m bench.disagg $RAW --json "$OUT/raw_nccl.json" 2>&1 \
  | tee "$OUT/raw_nccl.log" | tail -6
TANDEM_TRANSFER_BACKEND=gloo timeout 70 python -m bench.disagg $RAW --json "$OUT/raw_gloo.json" \
  2>&1 | tee "$OUT/raw_gloo.log" | tail -6
timeout 190 python -m bench.disagg --model qwen3.5-27b --weights int4 --device cuda \
  --kv-transfer peer --prompt-tokens 1024 8192 --repeats 2 --max-context-tokens 32768 \
  --prefill-chunk 2048 --gpu-memory-budget 60GiB --serve-args "--live-slots 2 --snapshot-slots 8" \
  --json "$OUT/service_27b_peer.json" 2>&1 | tee "$OUT/service_27b_peer.log" | tail -8
