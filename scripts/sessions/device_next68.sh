#!/usr/bin/env bash
# A RECORD: ran 12-07 15:17 (an H100 came for an nvidia-h200 call; 483 s) and
# a follow-up by hand on the warm machine at 15:25. Every lever lost and was
# removed (BENCHMARKS.md 2026-12-07 15:17): this no longer runs as written.
# The next device call (written 12-07, seventh session): the GEMV's release of
# the next kernel moved from after its prologue to its last tile
# (TANDEM_GEMV_LATE_RELEASE=1, q4_gemv.cu LATE_RELEASE), alone and with the
# norm prologue. Why: with the norm prologue the GEMV after an out projection
# follows it directly, is released right after the out projection's prologue,
# and its blocks load 5-10 MB of first and early tiles while the out
# projection (2-3 tiles a block) still streams; the out projections lost ~1 us
# each beside the prologue on an H100 (10:28). Released at the last tile, those
# loads meet only the tail. On an H200 the call also times what it owes (the
# deferred norm prologue and the out projections at 3 blocks an SM have never
# run there).
# Also new: GDN's gated output norm as the fused recurrence's last op
# (TANDEM_GDN_NORM_IN_RECURRENCE=1: one 16-warp program a value head instead
# of four of 32 columns, and no norm launch: 48 hops of ~0.9 us a step); the
# norms and the split combine releasing the GEMV after them before their own
# wait (TANDEM_PDL_RELEASE_BEFORE_GEMV=1), so that with the late release the
# GEMV after a norm loads its first tiles during the GEMV before's last tile,
# as the norm prologue would have it, with the norm's launch kept.
#   bash scripts/sessions/device_next68.sh main  (carry .whl; ~6 min; ROUNDS=1 ~4)
#     0. the GPU tests of both and of the 48 KB opt-in (never run);
#     1. the int4 27B step alternating (ROUNDS, 2): the tree; the norm prologue;
#        the late release; both; the norm in the recurrence; the late release with
#        the norms released first; that and the norm in the recurrence;
#     2. CRITICAL=1 (default 0): the critical path with the last, then the tree's.
set -uo pipefail
call=${1:?main}
source scripts/device_env.sh

round() {  # round N
  step_27b r$1_a_tree
  TANDEM_NORM_PROLOGUE=1 step_27b r$1_b_norm
  TANDEM_GEMV_LATE_RELEASE=1 step_27b r$1_c_late
  TANDEM_NORM_PROLOGUE=1 TANDEM_GEMV_LATE_RELEASE=1 step_27b r$1_d_norm_late
  TANDEM_GDN_NORM_IN_RECURRENCE=1 step_27b r$1_f_recur
  TANDEM_GEMV_LATE_RELEASE=1 TANDEM_PDL_RELEASE_BEFORE_GEMV=1 step_27b r$1_h_late_first
  TANDEM_GEMV_LATE_RELEASE=1 TANDEM_PDL_RELEASE_BEFORE_GEMV=1 TANDEM_GDN_NORM_IN_RECURRENCE=1 \
    step_27b r$1_i_late_first_recur
}

case "$call" in
  main)
    STEP_TAIL=6 step tests 240 python3 -m pytest -q -p no:cacheprovider -rf \
      tests/test_gemv_cuda.py tests/test_gdn_kernels.py tests/test_pdl.py \
      -k "late_release or 48_kb or norm_prologue or gated_norm or model_matches or graphs"
    grep -E "^(FAILED|E  )" "$OUT/tests.log" | head -20
    for r in $(seq "${ROUNDS:-2}"); do round "$r"; done
    step_cols r
    if [ "${CRITICAL:-0}" != "0" ]; then
      TANDEM_GEMV_LATE_RELEASE=1 TANDEM_PDL_RELEASE_BEFORE_GEMV=1 \
        TANDEM_GDN_NORM_IN_RECURRENCE=1 critical_path critical_late_first_recur
      critical_path critical_tree
    fi ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
