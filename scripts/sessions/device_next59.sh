#!/usr/bin/env bash
# 12-06 (fifth session): the last three sessions' changes timed on an H200,
# and the short-context decode attention.
#   bash scripts/sessions/device_next59.sh h200  (carry .whl): the int4 27B step
#     of this tree against ebe4577's (before the dense KV write, the int8 codes
#     and the two fusions), and with both fusions off, alternating (ROUNDS, 2);
#     then the fused step's critical path, and what removing the norms,
#     attention, the KV write, q/k norm + rotary or the output gate would
#     save at most (bench.ablate_step over the headline's bf16 KV at 256)
#     (18:36, H100: tree 6.50 ms twice, ebe4577 6.62 twice, fusions off 6.53
#     twice; removing every norm saves at most 0.198 ms, attention 0.093,
#     the KV write and q/k norm + rotary nothing)
#   bash scripts/sessions/device_next59.sh epilogue  (carry .whl): the GEMV
#     tests, then the step by default, with the norm in the last block of the
#     GEMV before it (TANDEM_NORM_EPILOGUE, since removed: the variable now
#     does nothing) and with 1 / 2 tiles into L2 before the wait
#     (TANDEM_GEMV_EARLY_L2_TILES), alternating; the epilogue's critical path
#     (19:42, H100: default 6.40-6.41, epilogue 6.63-6.65, early 1 6.34, early
#     2 6.34-6.35; 19:46: 34 passed, the epilogue's graph test failed; 19:48,
#     two more rounds: default 6.41, early 1 6.33)
#   (since 19:48 the h200 call also times TANDEM_GEMV_EARLY_L2_TILES=0 against
#     the default 1: the next session's first call on an H200)
#   bash scripts/sessions/device_next59.sh readahead  (carry .whl; not run):
#     TANDEM_GEMV_L2_PREFETCH_MB at 0, 4, 8, 16 on top of the early tiles
set -uo pipefail
call=${1:?h200, epilogue or readahead}
source scripts/device_env.sh
base() { step_27b_at "${BASE:-ebe4577}" "$1"; }  # BASE's step, from its worktree
case "$call" in
  h200)
    for round in $(seq "${ROUNDS:-2}"); do
      step_27b s${round}_a_tree
      base s${round}_b_base
      TANDEM_NORM_ROPE_PAIR=0 TANDEM_COMBINE_GATE=0 step_27b s${round}_c_apart
      TANDEM_GEMV_EARLY_L2_TILES=0 step_27b s${round}_d_no_early_tiles
    done
    step_cols s
    critical_path critical
    STEP_TAIL=16 step ablate 250 python3 -m bench.ablate_step --weights int4 --kv-format bf16 \
      --context 256 --rounds 2 --ablations none rms_norm attention kv_write norm_rope ;;
  epilogue)
    STEP_TAIL=6 step tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_gemv_cuda.py \
      -k "norm_epilogue or add_and_norm or decode_steps_with_an_epilogue or every_flag or early_l2"
    for round in $(seq "${ROUNDS:-2}"); do
      TANDEM_NORM_EPILOGUE=0 step_27b e${round}_a_apart
      TANDEM_NORM_EPILOGUE=1 step_27b e${round}_b_epilogue
      TANDEM_GEMV_EARLY_L2_TILES=1 step_27b e${round}_c_early1
      TANDEM_GEMV_EARLY_L2_TILES=2 step_27b e${round}_d_early2
    done
    step_cols e
    TANDEM_NORM_EPILOGUE=1 critical_path critical_epilogue ;;
  readahead)
    for round in $(seq "${ROUNDS:-1}"); do
      for mb in 0 4 8 16; do
        TANDEM_GEMV_L2_PREFETCH_MB=$mb step_27b r${round}_${mb}mb
      done
    done
    step_cols r ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
