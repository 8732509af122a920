#!/usr/bin/env bash
# Head F trained jointly, and the CUDA GEMV's GPU tests again; chained calls
# (the machine goes back after 30 s idle; /tmp survives while it stays warm):
#   bash scripts/sessions/device_next47.sh gemv   (carry .whl .device/gguf.part.aa)
#   bash scripts/sessions/device_next47.sh park   (carry .device/gguf.part.ac .device/corpus.xz)
#   bash scripts/sessions/device_next47.sh train  (carry .device/gguf.part.ab .device/head_f2.safetensors)
#   bash scripts/sessions/device_next39.sh bench
# gemv: all of tests/test_gemv_cuda.py. On 12-05 `-x` stopped at the guard
#   refusing an 8-byte stack frame, which it now allows (LOCAL_BYTES_ALLOWED 16),
#   so the read-ahead's bitwise tests have still never run on a GPU (~60 s).
# train: head F (12-05 03:31: D grown to two layers, only the new one
#   trained; dev chat 2.052, benchmark flat) continued with every parameter
#   training at a low rate (INIT_LR_SCALE 1, LR 5e-5), so D's layer can
#   adapt to the one after it; ~150 s of reading and features before step 0.
#   Ship only if the H200 benchmark's chat passes D's 1.95 (docs/MTP_HEAD.md).
set -uo pipefail
call=${1:?gemv, park or train}
source scripts/device_env.sh
park_parts
case "$call" in
  gemv)
    STEP_TAIL=12 step tests_gemv 200 python3 -m pytest -q -p no:cacheprovider tests/test_gemv_cuda.py ;;
  park) ;;
  train)
    INIT=${INIT:-.device/head_f2.safetensors} train_from_head "${TRAIN_LIMIT:-570}" \
      "${BUDGET:-340}" "${LR:-5e-5}" --head-layers "${HEAD_LAYERS:-2}" \
      --init-lr-scale "${INIT_LR_SCALE:-1}" ;;
esac
