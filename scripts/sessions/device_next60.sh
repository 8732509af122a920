#!/usr/bin/env bash
# 12-06 (sixth session): the early L2 tiles for gate_up's SiLU epilogue, and
# the out projections' plans inside the step.
#   bash scripts/sessions/device_next60.sh tiles  (carry .whl): the GEMV tests
#     of the early tiles, the read-ahead, the SiLU epilogue and the streamed
#     tiles, then the int4 27B step of this tree against BASE (8c0af64) and
#     with the early tiles' distance kept ahead through the loop
#     (TANDEM_GEMV_STREAM_L2=1), alternating (ROUNDS, 2); then, while device
#     time lasts, one round of the tree, streamed at distance 2 and without
#     early tiles, and the critical path. Run it from a checkout of the
#     branch silu-early, which asks gate_up's two ranges early: on main the
#     tree and BASE build the same kernels
#   bash scripts/sessions/device_next60.sh outplans  (carry .whl): the step
#     with the out projections (gdn out, attn o: 5120 x 6144, plan_for's rows
#     4 and flush 1 on every card) at other rows and flushes through a plans
#     file (TANDEM_GEMV_CUDA_PLANS), alternating (ROUNDS, 2). At 78 registers
#     the plain build runs four 192-thread blocks an SM, 528 on 132 SMs: 4 rows
#     make 1,280 tiles, 2.42 a block, so a quarter of the blocks take a third
#     tile; 5 rows (1,024 tiles), 2 (2,560) and 1 (5,120) come out even within
#     3%, as do 4 rows at two blocks an SM (gdn out's gated build runs two
#     an SM anyway)
set -uo pipefail
call=${1:?tiles or outplans}
source scripts/device_env.sh
base() { step_27b_at "${BASE:-8c0af64}" "$1"; }  # BASE's step, from its worktree
case "$call" in
  tiles)
    STEP_TAIL=6 step tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_gemv_cuda.py \
      -k "early_l2 or tiles_asked or l2_prefetch or read_ahead or silu_epilogue or stream"
    for round in $(seq "${ROUNDS:-2}"); do
      step_27b t${round}_a_tree
      base t${round}_b_base
      TANDEM_GEMV_STREAM_L2=1 step_27b t${round}_c_stream1
    done
    step_cols t
    step_27b u_a_tree   # the rest while device time lasts
    TANDEM_GEMV_STREAM_L2=1 TANDEM_GEMV_EARLY_L2_TILES=2 step_27b u_b_stream2
    TANDEM_GEMV_EARLY_L2_TILES=0 step_27b u_c_no_early
    step_cols u
    critical_path critical ;;
  outplans)
    for round in $(seq "${ROUNDS:-2}"); do
      step_27b o${round}_a_default
      out_plan o${round}_b_r4f4 4 4
      out_plan o${round}_c_r5f2 5 2
      out_plan o${round}_d_r2f5 2 5
      out_plan o${round}_e_r1f10 1 10
      out_plan o${round}_f_r4f4b2 4 4 2
    done
    step_cols o ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
