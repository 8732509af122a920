#!/usr/bin/env bash
# 12-07 (third session): today's defaults on an H200 and the read-ahead into
# the mixers' out projections (TANDEM_GEMV_L2_PREFETCH_MIXER_MB, cb165cf).
#   bash scripts/sessions/device_next63.sh lean  (carry .whl; ~210 s): the
#     int4 27B step alternating (ROUNDS, 2): this tree, without the read-ahead
#     (TANDEM_GEMV_L2_PREFETCH_MB=0), BASE (def1aa3: neither the read-ahead
#     nor gate_up's early tiles), the out projection read ahead whole across
#     the mixer (MIXER_MB=24), streamed tiles (TANDEM_GEMV_STREAM_L2=1); then
#     the critical path with MIXER_MB=24.
#   (12-07 05:21-05:28, H200, this call and two by hand on the warm machine:
#   tree 5.10-5.11 ms, no read-ahead 5.08-5.10, def1aa3 5.11-5.13, mixer 24 MB
#   5.22-5.23, 8 MB 5.13-5.14, streamed 5.21-5.23, early tiles 2 5.15, 0
#   5.27-5.28. The mixer switch and the streamed tiles were removed after
#   it, so their runs now time the tree. BENCHMARKS.md 2026-12-07, H200.)
# (It also had full `h200` and `h100` calls, which never ran: no machine came.)
set -uo pipefail
call=${1:?lean}
source scripts/device_env.sh
base() { step_27b_at "${BASE:-def1aa3}" "$1"; }  # BASE's step, from its worktree
case "$call" in
  lean)
    for round in $(seq "${ROUNDS:-2}"); do
      step_27b l${round}_a_tree
      TANDEM_GEMV_L2_PREFETCH_MB=0 step_27b l${round}_b_no_read_ahead
      base l${round}_c_base
      TANDEM_GEMV_L2_PREFETCH_MIXER_MB=24 step_27b l${round}_d_mixer24
      TANDEM_GEMV_STREAM_L2=1 step_27b l${round}_e_stream
    done
    step_cols l
    TANDEM_GEMV_L2_PREFETCH_MIXER_MB=24 critical_path critical_mixer24 ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
