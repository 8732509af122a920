#!/usr/bin/env bash
# MTP head sessions, chained calls (the machine goes back after 30 s idle;
# /tmp survives between calls while it stays warm; the GGUF's three 32 MB
# parts travel one a call, beside .whl):
#   bash scripts/sessions/device_next39.sh park   (carry .whl .device/gguf.part.aa)
#   bash scripts/sessions/device_next39.sh park   (carry .whl .device/gguf.part.ab)
#   bash scripts/sessions/device_next39.sh gen    (carry .whl .device/gguf.part.ac .device/mtp_corpus.pt)
#   bash scripts/sessions/device_next39.sh train  (carry .whl)
#   bash scripts/sessions/device_next39.sh bench  (carry .whl)
# gen: every prompt the carried corpus lacks, answered by 8 processes under MPS
#   (train-mtp --gen-processes: one process is Python-bound at ~3,000 tok/s,
#   eight made ~12,300); SAMPLES=2 also a second answer per prompt sampled at
#   T = 0.8. The corpus comes back only at SAMPLES=1 (the two-sample file,
#   18 MB, is over what a call returns).
# train: the shipped head trained on (--init-head, lr 3e-4) for BUDGET s.
# bench: the new head's H200 benchmark.
# Ran 2026-12-04 14:09-14:30 (BENCHMARKS.md) as gen, train (SAMPLES=1, 470 s),
# then by hand gen and train at SAMPLES=2 (250 s from the first head), bench:
# the head shipped at 14:40. Ran again 16:15-16:30 as park, park, gen (SAMPLES=2,
# 32,735 answers in ~205 s: ~23,000 tok/s with the padded graphs), train, bench:
# head C, shipped at 16:29. The 49,470-sample corpus stayed on the device;
# the next round answers again from the carried greedy corpus. Next (head D):
# the same calls, with the 36 request files written at 16:55-17:50
# (42,636 prompts): ~68,500 missing answers (greedy for the 25,901 prompts the
# carried corpus lacks, a sampled one for all), ~9.9 M tokens, ~430 s at
# 16:20's rate plus the loads: if gen stops at GEN_LIMIT, call gen again (the
# shards it left are read back and not asked again), then train.
set -uo pipefail
call=${1:?park, gen, train or bench}
mkdir -p /tmp/gguf && cp .device/gguf.part.* /tmp/gguf/ 2>/dev/null; ls /tmp/gguf
source scripts/device_env.sh
RECIPE=(--samples-per-prompt "${SAMPLES:-2}" --new-tokens 160 --varied 100000 --max-prompts 100
        --corpus /tmp/mtp_corpus.pt)
HEAD=engine/heads/smollm2-135m-instruct.q4_1.mtp.safetensors

start_mps() {  # a private MPS daemon, so that the processes' kernels share the GPU
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/tandem-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/tandem-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    trap 'echo quit | nvidia-cuda-mps-control; sleep 2' EXIT
  else
    echo "no MPS daemon: the processes time-slice"
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
}

case "$call" in
  park) ;;  # only brings its GGUF part to /tmp/gguf
  gen)
    assemble_gguf
    [ -f /tmp/mtp_corpus.pt ] || cp .device/mtp_corpus.pt /tmp/mtp_corpus.pt
    start_mps
    STEP_TAIL=12 step gen "${GEN_LIMIT:-540}" python3 -m tandem.cli train-mtp --device cuda \
      --max-batch "${GEN_BATCH:-128}" --gen-processes "${GEN_PROCESSES:-8}" --corpus-only \
      "${RECIPE[@]}"
    [ "${SAMPLES:-2}" = 1 ] && cp /tmp/mtp_corpus.pt "$OUT/" ;;
  train)
    assemble_gguf
    cp "$HEAD" /tmp/start_head.safetensors
    STEP_TAIL=12 step train "${TRAIN_LIMIT:-585}" python3 -m tandem.cli train-mtp --device cuda \
      --max-batch 256 "${RECIPE[@]}" --time-budget "${BUDGET:-470}" --dev-every 400 \
      --init-head /tmp/start_head.safetensors --lr "${LR:-3e-4}" --out /tmp/new_head.safetensors
    grep -v "train-mtp: step" "$OUT/train.log" > "$OUT/train_short.log"
    cp /tmp/new_head.safetensors "$OUT/" ;;
  bench)
    assemble_gguf
    cp /tmp/new_head.safetensors "$HEAD"
    STEP_TAIL=10 step spec_new 220 python3 -m bench.speculative --device cuda \
      --tokens-model embedded --methods none mtp --ks 3 --new-tokens 96 --per-prompt \
      --json "$OUT/spec_new.json" ;;
esac
