#!/usr/bin/env bash
# 12-07 (third session): today's defaults on an H200 (device_next62.sh's
# call, which this replaces: it never ran, no H200 came) and the read-ahead into the mixers' out
# projections (TANDEM_GEMV_L2_PREFETCH_MIXER_MB, new).
#   bash scripts/sessions/device_next63.sh h200  (carry .whl):
#     1. the GEMV GPU tests of the early, streamed and read-ahead paths;
#     2. the int4 27B step alternating (ROUNDS, 3): this tree, without the
#        read-ahead (TANDEM_GEMV_L2_PREFETCH_MB=0), BASE (def1aa3: neither
#        the read-ahead nor gate_up's early tiles), streamed
#        (TANDEM_GEMV_STREAM_L2=1), the whole out projection read ahead
#        across the mixer (MIXER_MB=24: its ~17 MB) and 16 MB of it;
#     3. once: no early tiles, read-ahead 8 MB, mixer 24 MB streamed, mixer
#        24 MB with no other link (MB=0);
#     4. the critical path of this tree and with MIXER_MB=24.
#   auto: h200 on an H200, else h100; lean: lean_h200 or lean_h100, the
#     same comparisons in two rounds (ROUNDS), no tests, one critical path.
#   bash scripts/sessions/device_next63.sh h100: the mixer's read-ahead alone
#     on whatever card comes (today's defaults ran on an H100 at 02:13):
#     alternating (ROUNDS, 3) this tree, MIXER_MB=24, 16, 8; once 24 with
#     no other link; both critical paths.
#   (12-07 02:13-02:27, H100: tree 6.36-6.38 ms, no read-ahead 6.46,
#   def1aa3 6.43-6.44, streamed 6.48, read-ahead 8 MB 6.46-6.47)
#   (12-07 05:21-05:28, H200, `lean` and two calls by hand on the warm
#   machine: tree 5.10-5.11 ms, no read-ahead 5.08-5.10, def1aa3 5.11-5.13,
#   mixer 24 MB 5.22-5.23, 8 MB 5.13-5.14, streamed 5.21-5.23, early tiles 2
#   5.15, 0 5.27-5.28. The mixer switch and the streamed tiles were removed
#   after it, so `h200`, `h100` and `lean` no longer run as written.
#   BENCHMARKS.md 2026-12-07, third session.)
set -uo pipefail
call=${1:?h200}
source scripts/device_env.sh
base() { step_27b_at "${BASE:-def1aa3}" "$1"; }  # BASE's step, from its worktree
if [ "$call" = auto ] || [ "$call" = lean ]; then   # what came: the H200 call on an H200
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && card=h200 || card=h100
  [ "$call" = lean ] && call=lean_$card || call=$card
  echo "call: $call"
fi
case "$call" in
  h200)
    STEP_TAIL=6 step tests 240 python3 -m pytest -q -p no:cacheprovider tests/test_gemv_cuda.py \
      -k "early_l2 or tiles_asked or l2_prefetch or read_ahead or silu_epilogue or stream or mixer"
    for round in $(seq "${ROUNDS:-3}"); do
      step_27b h${round}_a_tree
      TANDEM_GEMV_L2_PREFETCH_MB=0 step_27b h${round}_b_no_read_ahead
      base h${round}_c_base
      TANDEM_GEMV_STREAM_L2=1 step_27b h${round}_d_stream
      TANDEM_GEMV_L2_PREFETCH_MIXER_MB=24 step_27b h${round}_e_mixer24
      TANDEM_GEMV_L2_PREFETCH_MIXER_MB=16 step_27b h${round}_f_mixer16
    done
    TANDEM_GEMV_EARLY_L2_TILES=0 step_27b h9_no_early
    TANDEM_GEMV_L2_PREFETCH_MB=8 step_27b h9_read_ahead_8mb
    TANDEM_GEMV_L2_PREFETCH_MIXER_MB=24 TANDEM_GEMV_STREAM_L2=1 step_27b h9_mixer24_stream
    TANDEM_GEMV_L2_PREFETCH_MB=0 TANDEM_GEMV_L2_PREFETCH_MIXER_MB=24 step_27b h9_mixer24_only
    step_cols h
    critical_path critical
    TANDEM_GEMV_L2_PREFETCH_MIXER_MB=24 critical_path critical_mixer24 ;;
  lean_h200)   # what a short budget allows: no tests, one critical path
    for round in $(seq "${ROUNDS:-2}"); do
      step_27b l${round}_a_tree
      TANDEM_GEMV_L2_PREFETCH_MB=0 step_27b l${round}_b_no_read_ahead
      base l${round}_c_base
      TANDEM_GEMV_L2_PREFETCH_MIXER_MB=24 step_27b l${round}_d_mixer24
      TANDEM_GEMV_STREAM_L2=1 step_27b l${round}_e_stream
    done
    step_cols l
    TANDEM_GEMV_L2_PREFETCH_MIXER_MB=24 critical_path critical_mixer24 ;;
  lean_h100)
    for round in $(seq "${ROUNDS:-2}"); do
      step_27b l${round}_a_tree
      TANDEM_GEMV_L2_PREFETCH_MIXER_MB=24 step_27b l${round}_b_mixer24
      TANDEM_GEMV_L2_PREFETCH_MIXER_MB=16 step_27b l${round}_c_mixer16
      TANDEM_GEMV_L2_PREFETCH_MIXER_MB=8 step_27b l${round}_d_mixer8
    done
    step_cols l
    TANDEM_GEMV_L2_PREFETCH_MIXER_MB=24 critical_path critical_mixer24 ;;
  h100)
    for round in $(seq "${ROUNDS:-3}"); do
      step_27b m${round}_a_tree
      TANDEM_GEMV_L2_PREFETCH_MIXER_MB=24 step_27b m${round}_b_mixer24
      TANDEM_GEMV_L2_PREFETCH_MIXER_MB=16 step_27b m${round}_c_mixer16
      TANDEM_GEMV_L2_PREFETCH_MIXER_MB=8 step_27b m${round}_d_mixer8
    done
    TANDEM_GEMV_L2_PREFETCH_MB=0 TANDEM_GEMV_L2_PREFETCH_MIXER_MB=24 step_27b m9_mixer24_only
    step_cols m
    critical_path critical
    TANDEM_GEMV_L2_PREFETCH_MIXER_MB=24 critical_path critical_mixer24 ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
