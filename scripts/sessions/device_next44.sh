#!/usr/bin/env bash
# Head E and the norm prologue's second build, chained calls (the machine goes
# back after 30 s idle; /tmp survives while it stays warm). The GGUF (three
# 32 MB parts) and the 85,470-answer corpus (34 MB packed: .device/corpus.part00,
# 01 of 15 MiB, 02 of 2.6 MB) travel a part of each a call beside .whl:
#   bash scripts/sessions/device_next44.sh gemv   (carry .whl .device/gguf.part.aa .device/corpus.part00)
#   bash scripts/sessions/device_next44.sh park   (carry .whl .device/gguf.part.ab .device/corpus.part01)
#   bash scripts/sessions/device_next44.sh gen    (carry .whl .device/gguf.part.ac .device/corpus.part02)
#   bash scripts/sessions/device_next44.sh train  (carry .whl; again with INIT=/tmp/new_head.safetensors)
#   bash scripts/sessions/device_next39.sh bench  (carry .whl)
# gemv: the CUDA GEMV's GPU tests and bench.gemv_cuda --norm: the norm weight
#   now staged in shared memory by cp.async before griddepcontrol.wait (the
#   12-04 18:58 build loaded it as scalars after the wait and lost 3 us a
#   GEMV), and the sweep's new flush plans (the cross-warp sums of 2-16 tiles
#   reduced at one barrier pair: down runs one 17-warp block an SM, which
#   loads nothing while it waits at a barrier every tile); STEP_AB=1 also
#   times the int4 27B step: the default, the sweep's plans,
#   TANDEM_NORM_PROLOGUE=1, TANDEM_SILU_PROLOGUE=1 (new: the MLP's silu_mul
#   in down's prologue, --silu in the sweep) and TANDEM_GATED_PROLOGUE=1
#   (new: GDN's gated norm in out_proj's, --gated), ROUNDS (3) alternating
#   rounds (a step run took ~24 s on 12-04: 15 of them, the tests and the
#   sweep come to ~450 s).
# gen: the prompts the corpus lacks (the 64 request files written 12-04
#   19:30-20:10: 32,000 prompts, 64,000 answers greedy and sampled, ~9.3 M
#   tokens, ~330 s at 19:00's ~28,000 tok/s plus the loads); the whole corpus
#   (~149,000 samples, ~57 MB packed) comes back in 15 MiB parts: keep them
#   as .device/corpus.part0*.
# train: BUDGET s (default 420) from INIT (default the shipped head); each new
#   dev best is written at once, so the step's limit loses nothing. The first
#   call of 12-04 19:06 spent ~113 s reading 85,470 samples before step 0:
#   expect ~200 s for ~149,000, so BUDGET=360 in a 600 s call.
set -uo pipefail
call=${1:?gemv, park, gen or train}
source scripts/device_env.sh
park_parts
case "$call" in
  gemv)
    STEP_TAIL=12 step tests_gemv 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_gemv_cuda.py
    STEP_TAIL=30 step sweep 170 python3 -m bench.gemv_cuda --norm --silu --gated --json "$OUT/sweep.json" \
      --plans-out /tmp/plans.json
    cp /tmp/plans.json "$OUT/"
    if [ "${STEP_AB:-0}" = 1 ]; then
      for round in $(seq "${ROUNDS:-3}"); do
        step_27b "step_default_$round"
        TANDEM_GEMV_CUDA_PLANS=/tmp/plans.json step_27b "step_swept_$round"
        TANDEM_NORM_PROLOGUE=1 step_27b "step_norm_$round"
        TANDEM_SILU_PROLOGUE=1 step_27b "step_silu_$round"
        TANDEM_GATED_PROLOGUE=1 step_27b "step_gated_$round"
      done
    fi ;;
  park) ;;
  gen)
    [ -f /tmp/mtp_corpus.pt ] || cat /tmp/corpus/corpus.part* > /tmp/mtp_corpus.pt
    ls -la /tmp/mtp_corpus.pt
    bash scripts/sessions/device_next39.sh gen
    split -b 15m -d /tmp/mtp_corpus.pt "$OUT/corpus.part" ;;
  train)
    train_from_head "${TRAIN_LIMIT:-580}" "${BUDGET:-420}" "${LR:-3e-4}" ;;
esac
