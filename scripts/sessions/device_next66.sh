#!/usr/bin/env bash
# The next device call (written 12-07, fifth session): the norm prologue with
# its rstd deferred to the flush. The prologue's int8 codes of x per group do
# not depend on the row's rstd (one factor common to all of K), so rstd now
# multiplies the finished sums and the prologue has no barrier of its own
# (q4_gemv.cu NORM). Every other build's PTX is unchanged (NVRTC, here).
#   bash scripts/sessions/device_next66.sh main  (carry .whl .device; ~5 min)
#     0. the norm prologue's GPU tests;
#     1. bench.gemv_cuda --norm on the three shapes after a norm: the norm's
#        launch + GEMV, the fused GEMV, the GEMV alone, the fused GEMV
#        without the pending residual (what every block's second read of a
#        row costs);
#     2. the int4 27B step alternating (ROUNDS, 2): this tree; this tree
#        with TANDEM_NORM_PROLOGUE=1 (deferred rstd); the kernel before
#        (.device/q4_gemv_prev.cu, 9dbeb5f: the barrier before the loop) with
#        TANDEM_NORM_PROLOGUE=1; 393d2e1's kernel (.device/q4_gemv_head.cu:
#        the scales off the read-only path, owed to an H200 since 12-07 07:45);
#     3. the critical path with the deferred prologue, then the tree's.
#   bash scripts/sessions/device_next66.sh lean  (~3 min): 1 and 2 at one round.
#   bash scripts/sessions/device_next66.sh model  (carry .whl .device; ~3 min): the
#     model-level prologue test after `verify` (10:00) failed it on int8 noise; two
#     rounds of the tree / the deferred prologue / each with the out projections at 3
#     blocks an SM; the two critical paths again, the tree's first.
#   bash scripts/sessions/device_next66.sh h200  (carry .whl .device; ~4 min, on an H200
#     only: what it owes; on an H100 everything in it has been timed; ROUNDS=1
#     CRITICAL=0 for ~1.5 min)
#   bash scripts/sessions/device_next66.sh headers  (carry .whl; ~3-5 min, either card):
#     the Q4_K header experiment's GPU tests and bench.gemv_cuda --headers
#   bash scripts/sessions/device_next66.sh verify  (carry .whl .device; ~2 min): `main`
#     ran on an H100 at 09:52 and two of its tests failed on the new numerics
#     (a code moved; the tests now take the prologue's own reference and the
#     launches' tokens): those tests again, with the GEMV's reference tests,
#     then one round of this tree against the deferred prologue.
# .device/q4_gemv_prev.cu: git show 9dbeb5f:engine/quant/q4_gemv.cu
# .device/q4_gemv_head.cu: git show 393d2e1:engine/quant/q4_gemv.cu
set -uo pipefail
call=${1:?main}
source scripts/device_env.sh

with_kernel() {  # with_kernel FILE NAME: the step with FILE as the kernel (read from disk
  # by each process), the tree's put back after
  cp "$1" engine/quant/q4_gemv.cu
  step_27b "$2"
  cp /tmp/q4_tree.cu engine/quant/q4_gemv.cu
}

round() {  # round N
  step_27b p$1_a_tree
  TANDEM_NORM_PROLOGUE=1 step_27b p$1_b_norm_deferred
  TANDEM_NORM_PROLOGUE=1 with_kernel .device/q4_gemv_prev.cu p$1_c_norm_barrier
  with_kernel .device/q4_gemv_head.cu p$1_d_393d2e1
}

norm_pairs() {
  STEP_TAIL=8 step norm_pairs 150 python3 -m bench.gemv_cuda --only gate_up "gdn in_proj" \
    "attn qkv" --rows 4 --norm
}

cp engine/quant/q4_gemv.cu /tmp/q4_tree.cu
case "$call" in
  main)
    STEP_TAIL=6 step tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_gemv_cuda.py \
      -k "norm_prologue or layer_norm_in_the_gemv_prologue"
    norm_pairs
    for r in $(seq "${ROUNDS:-2}"); do round "$r"; done
    step_cols p
    TANDEM_NORM_PROLOGUE=1 critical_path critical_norm_deferred
    critical_path critical_tree ;;
  verify)
    STEP_TAIL=6 step tests 200 python3 -m pytest -q -p no:cacheprovider -rf tests/test_gemv_cuda.py \
      -k "norm_prologue or layer_norm_in_the_gemv_prologue or matches_the_reference"
    grep -E "^(FAILED|E  )" "$OUT/tests.log" | head -20
    step_27b p1_a_tree
    TANDEM_NORM_PROLOGUE=1 step_27b p1_b_norm_deferred
    step_cols p ;;
  model)  # the model-level test again (its tolerance now set by float activations), two
    # rounds of the tree, the deferred prologue, and each with the out projections at 3
    # blocks an SM (room for one block of the GEMV after them, which with the prologue
    # has no norm launch in between to load its first tiles in), and both critical
    # paths in the other order (09:52's put gdn out 1 us slower with the prologue)
    STEP_TAIL=6 step tests 150 python3 -m pytest -q -p no:cacheprovider -rf tests/test_gemv_cuda.py \
      -k "decode_steps"
    grep -E "^(FAILED|E  )" "$OUT/tests.log" | head -20
    for r in 1 2; do
      step_27b w${r}_a_tree
      TANDEM_NORM_PROLOGUE=1 step_27b w${r}_b_norm_deferred
      TANDEM_NORM_PROLOGUE=1 out_plan w${r}_c_norm_out3 4 1 3
      out_plan w${r}_d_out3 4 1 3
    done
    step_cols w
    critical_path critical_tree
    TANDEM_NORM_PROLOGUE=1 critical_path critical_norm_deferred ;;
  h200)  # the A/Bs an H200 still owes (~4 min), steps only: the tree, the deferred
    # prologue, the out projections at 3 blocks an SM (H100 10:12-10:28: level, five pairs),
    # both, 393d2e1's kernel; then the tree's critical path. An H100 has timed all of it:
    # there the call stops at once, to save the device time
    grep -q H200 "$OUT/date.txt" || { echo "not an H200: nothing owed here"; exit 3; }
    for r in $(seq "${ROUNDS:-2}"); do
      step_27b h${r}_a_tree
      TANDEM_NORM_PROLOGUE=1 step_27b h${r}_b_norm_deferred
      out_plan h${r}_c_out3 4 1 3
      TANDEM_NORM_PROLOGUE=1 out_plan h${r}_d_norm_out3 4 1 3
      with_kernel .device/q4_gemv_head.cu h${r}_e_393d2e1
    done
    step_cols h
    [ "${CRITICAL:-1}" = "0" ] || critical_path critical_tree ;;
  headers)  # the Q4_K header experiment (built 12-07 10:45, never run on a GPU): its GPU
    # tests, then every shape reading the headers against the four scale arrays
    STEP_TAIL=6 step tests 150 python3 -m pytest -q -p no:cacheprovider -rf tests/test_gemv_cuda.py \
      -k "headers"
    grep -E "^(FAILED|E  )" "$OUT/tests.log" | head -20
    STEP_TAIL=16 step headers 300 python3 -m bench.gemv_cuda --rows 4 --headers ;;
  lean)
    norm_pairs
    round 1
    step_cols p ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
