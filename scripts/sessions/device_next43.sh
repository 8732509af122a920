#!/usr/bin/env bash
# Head D and the CUDA GEMV's new variants in one session's device time,
# chained calls (the machine goes back after 30 s idle; /tmp survives while it
# stays warm; the GGUF's three 32 MB parts travel one a call beside .whl):
#   bash scripts/sessions/device_next43.sh gemv   (carry .whl .device/gguf.part.aa)
#   bash scripts/sessions/device_next39.sh park   (carry .whl .device/gguf.part.ab)
#   bash scripts/sessions/device_next43.sh gen    (carry .whl .device/gguf.part.ac .device/mtp_corpus.pt)
#   bash scripts/sessions/device_next43.sh train  (carry .whl)
# gemv: parks the first part and uses the call: the CUDA GEMV's GPU tests (the
#   tile queue and the norm prologue never ran on a GPU) and bench.gemv_cuda
#   --norm (device_next42.sh a without the Triton suites).
# gen: device_next39.sh gen for the 42,636 prompts, then the whole corpus
#   comes back in 15 MiB parts (a file back is at most 16 MiB), so that later
#   sessions need not answer again.
# train: device_next39.sh train with BUDGET s (default 400), then its bench in
#   the same call.
set -uo pipefail
call=${1:?gemv, gen or train}
case "$call" in
  gemv)
    mkdir -p /tmp/gguf && cp .device/gguf.part.* /tmp/gguf/
    source scripts/device_env.sh
    STEP_TAIL=12 step tests_gemv 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_gemv_cuda.py
    STEP_TAIL=40 step sweep 170 python3 -m bench.gemv_cuda --norm --plans-out /tmp/plans.json \
      --json "$OUT/sweep.json"
    cp /tmp/plans.json "$OUT/" ;;
  gen)
    bash scripts/sessions/device_next39.sh gen
    OUT=${OUT:-/tmp/out}
    ls -la /tmp/mtp_corpus.pt* && split -b 15m -d /tmp/mtp_corpus.pt "$OUT/mtp_corpus.pt.part" ;;
  train)
    BUDGET=${BUDGET:-400} TRAIN_LIMIT=${TRAIN_LIMIT:-460} bash scripts/sessions/device_next39.sh train
    bash scripts/sessions/device_next39.sh bench ;;
esac
