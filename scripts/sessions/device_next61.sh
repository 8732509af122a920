#!/usr/bin/env bash
# 12-07 (first session): everything the GEMV work of 12-06 left untimed, in
# one call from main (a start costs more than the call; few starts succeed).
#   bash scripts/sessions/device_next61.sh all  (carry .whl):
#     1. the GEMV GPU tests of the early and streamed tiles, gate_up's too,
#        from a worktree of the branch silu-early (SILU), whose kernel is
#        main's with gate_up's tiles added;
#     2. the int4 27B step, alternating (ROUNDS, 2): main, SILU (gate_up's
#        early tiles too), main streamed (TANDEM_GEMV_STREAM_L2=1);
#     3. one run each of: the out projections (5120 x 6144) at other plans
#        (device_next60.sh outplans' r5f2, r2f5, r1f10, r4f4b2), the
#        read-ahead at 4 / 8 / 16 MB (TANDEM_GEMV_L2_PREFETCH_MB), streamed at
#        distance 2, no early tiles; then main once more;
#     4. the step's critical path.
#   (12-07 02:13, H100, 280 s: main 6.44, SILU 6.46-6.47, streamed 6.48,
#     read-ahead 4 MB 6.38; the tests' 2000 x 1056 case failed in QuantTensor,
#     not the kernel, and runs at K = 1280 since. BENCHMARKS.md 2026-12-07)
set -uo pipefail
call=${1:?all}
source scripts/device_env.sh
SILU=${SILU:-8cf787c}   # the branch silu-early
silu() { step_27b_at "$SILU" "$1"; }
gemv_tests() {  # gemv_tests NAME: the early / streamed / SiLU-epilogue GEMV tests of the cwd's tree
  STEP_TAIL=6 step "$1" 240 python3 -m pytest -q -p no:cacheprovider tests/test_gemv_cuda.py \
    -k "early_l2 or tiles_asked or l2_prefetch or read_ahead or silu_epilogue or stream"
}
case "$call" in
  all)
    git worktree add -f "/tmp/rev_$SILU" "$SILU" > /dev/null 2>&1
    (cd "/tmp/rev_$SILU" && PYTHONPATH="/tmp/rev_$SILU:/tmp/site" gemv_tests tests_silu)
    for round in $(seq "${ROUNDS:-2}"); do
      step_27b t${round}_a_main
      silu t${round}_b_silu
      TANDEM_GEMV_STREAM_L2=1 step_27b t${round}_c_stream1
    done
    step_cols t
    out_plan u_r5f2 5 2
    out_plan u_r2f5 2 5
    out_plan u_r1f10 1 10
    out_plan u_r4f4b2 4 4 2
    for mb in 4 8 16; do TANDEM_GEMV_L2_PREFETCH_MB=$mb step_27b u_ra${mb}mb; done
    TANDEM_GEMV_STREAM_L2=1 TANDEM_GEMV_EARLY_L2_TILES=2 step_27b u_stream2
    TANDEM_GEMV_EARLY_L2_TILES=0 step_27b u_no_early
    step_27b u_z_main
    step_cols u
    critical_path critical ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
