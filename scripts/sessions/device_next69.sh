#!/usr/bin/env bash
# Superseded by device_next71.sh h200, which runs what this owes in one call.
# The next device call (written 12-07 15:35, seventh session): only what an H200
# owes, and only on one. Why the norm prologue may pay there when it is level
# on an H100: against the sweep's back-to-back timings of the same plans, a GEMV
# after a norm costs 2.45 us more in the H200's step (2,916 against ~2,600 us over
# 129 launches, 12-05 21:57 and 12-07 05:28) but 0.76 us more in the H100's
# (3,746 against ~3,648, 12-07 07:45 and 12:23), and the early tiles, which
# hide the same cold start, were worth 0.17 ms on the H200 against 0.07 on an
# H100. The prologue (rstd deferred to the flush, 12-07 09:52) has never run on
# an H200.
#   bash scripts/sessions/device_next69.sh h200  (carry .whl; ~4 min on an H200; on
#     an H100 it stops at once, exit 3)
#     1. the int4 27B step alternating (ROUNDS, 2): the tree; the norm prologue;
#        the out projections asking L2 for all their 2-3 tiles before the wait
#        (their own early count 3: lost 0.07 ms on an H100, never run on an
#        H200, whose cold starts cost more); the GEMVs after a norm asking for
#        two (two everywhere lost on the H200, 5.15 against 5.10 ms, but the
#        cold start is theirs);
#     2. CRITICAL=1 (default): the critical path with the prologue (the tree's
#        is 12-07 05:28's).
set -uo pipefail
call=${1:?h200}
source scripts/device_env.sh

round() {  # round N
  step_27b n$1_a_tree
  TANDEM_NORM_PROLOGUE=1 step_27b n$1_b_norm
  out_plan n$1_c_out_early3 4 1 0 3
  after_norm_early2 n$1_d_after_norm_early2
}

case "$call" in
  h200)
    grep -q H200 "$OUT/date.txt" || { echo "not an H200: nothing owed here"; exit 3; }
    for r in $(seq "${ROUNDS:-2}"); do round "$r" > /dev/null; done
    step_cols n
    if [ "${CRITICAL:-1}" != "0" ]; then
      TANDEM_NORM_PROLOGUE=1 critical_path critical_norm
    fi ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
