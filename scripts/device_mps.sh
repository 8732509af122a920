#!/usr/bin/env bash
# Issue 6's interference goal under CUDA MPS (~8 min; carry .whl): without
# MPS the prefill and decode processes are time-sliced (2026-12-02: decode
# ITL p99 2.38x its idle p50, prefill kept 47%). Starts a private MPS
# daemon (pipes under /tmp, quit on exit; the card's compute mode is left
# as it is), checks a client can start, then runs the interference bench
# with the prefill worker's SM share uncapped and capped
# (`tandem serve --prefill-sm-percent`).
set -uo pipefail
source scripts/device_env.sh
export CUDA_MPS_PIPE_DIRECTORY=/tmp/tandem-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/tandem-mps/log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || { echo "the MPS daemon did not start"; exit 1; }
trap 'echo quit | nvidia-cuda-mps-control; sleep 2' EXIT
timeout 60 python3 -c "import torch; torch.ones(1, device='cuda').sum().item(); print('MPS client ok')" \
  || { echo "no MPS client"; tail -5 "$CUDA_MPS_LOG_DIRECTORY"/control.log; exit 1; }
# 2026-12-02 05:00: 100/60/40 gave p99 2.95x/1.82x/1.35x of idle p50 and
# prefill 5875/3769/2651 tok/s (uncapped solo 6491): SHARES="70 80" next.
# CHUNKS: the prefill chunk sizes to try at each share (issue 6 asks for the
# trade-off of chunk size against decode ITL and prefill throughput).
# A share is P (the prefill worker's) or P:D (the decode worker's too,
# `--decode-sm-percent`: decode is bound by bandwidth, which fewer SMs may
# still draw, and every SM it leaves is the compute-bound prefill's).
for share in ${SHARES:-100 60 40}; do
  prefill_share=${share%%:*}
  serve_args="--prefill-sm-percent $prefill_share"
  [[ $share == *:* ]] && serve_args+=" --decode-sm-percent ${share##*:}"
  for chunk in ${CHUNKS:-2048}; do
    echo "== SM shares $share (prefill[:decode]), chunk $chunk"
    timeout "${LIMIT:-170}" python -m bench.interference --model qwen3.5-27b --device cuda \
      --kv-format int8 --gpu-memory-budget 130GiB --max-context-tokens 65536 \
      --prefill-chunk "$chunk" --prefill-tokens 32768 --decode-tokens "${DECODE_TOKENS:-1200}" \
      --serve-args "$serve_args" \
      --json "$OUT/interference_mps_${share/:/_}_$chunk.json" 2>&1 | grep -v "^\[" | tail -7
  done
done
