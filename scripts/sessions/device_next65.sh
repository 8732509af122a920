#!/usr/bin/env bash
# The next H200 call (written 12-07, fourth session). device_next64.sh's plan,
# which never ran (no machine came), plus one kernel A/B. `h200` ran on an
# H100 at 07:45 (asked for as nvidia-h200; BENCHMARKS.md 2026-12-07, every
# variant level or lost): an H200 still owes it, `prologues` never ran.
#   bash scripts/sessions/device_next65.sh h200  (carry .whl .device; ~7-9 min)
# The A/B: with early L2 tiles on (the default since 12-07) every build loaded
# the scales (sc, d, m, dmin) with plain ld.global, not ld.global.nc: the
# prefetch's asm takes those pointers under a memory clobber, and nvcc then no
# longer proves them read-only (PTX of the NVRTC builds, here). load_tile now
# asks for the non-coherent path with __ldg. The step alternates this tree
# with .device/q4_gemv_head.cu (393d2e1's kernel, swapped in between runs:
# the kernel is read from disk by each process).
#     0. tests/test_gemv_cuda.py whole (every build's loads changed);
#     1. bench.gemv_cuda's sweep of down and the out projections (rows 2 4 8),
#        its best plans into /tmp/plans_h200.json;
#     2. the int4 27B step alternating (ROUNDS, 2): this tree, 393d2e1's
#        kernel, the sweep's plans, the norm and gated prologues
#        (TANDEM_NORM_PROLOGUE=1 / TANDEM_GATED_PROLOGUE=1), the out
#        projections at early tiles 2 (4 rows) and 3 (2 rows);
#     3. the critical path with this tree's defaults.
#   bash scripts/sessions/device_next65.sh prologues  (carry .whl; ~2 min): the
#     norm and gated prologues apart against fused, graph-timed alone
#     (bench.gemv_cuda --norm --gated), then the step's critical path with
#     each, to set beside the tree's (both lost on the H100 at 07:45: where
#     the time goes)
#   bash scripts/sessions/device_next65.sh lean  (~4 min, when device time is
#     short): the GPU tests of the tiles, no sweep, and two rounds of the
#     tree, 393d2e1's kernel, the two prologues and the out projections at
#     early tiles 2.
set -uo pipefail
call=${1:?h200}
source scripts/device_env.sh

tree_and_head_kernel() {  # tree_and_head_kernel ROUND: the step with this tree's kernel,
  # then with 393d2e1's (each process reads the kernel source from disk)
  step_27b p$1_a_tree
  cp .device/q4_gemv_head.cu engine/quant/q4_gemv.cu
  step_27b p$1_b_head_kernel
  cp /tmp/q4_tree.cu engine/quant/q4_gemv.cu
}

prologues_and_out_early() {  # prologues_and_out_early ROUND
  TANDEM_NORM_PROLOGUE=1 step_27b p$1_d_norm_prologue
  TANDEM_GATED_PROLOGUE=1 step_27b p$1_e_gated_prologue
  out_plan p$1_f_out_early2 4 1 0 2
}

cp engine/quant/q4_gemv.cu /tmp/q4_tree.cu
case "$call" in
  h200)
    STEP_TAIL=6 step tests 240 python3 -m pytest -q -p no:cacheprovider tests/test_gemv_cuda.py
    STEP_TAIL=30 step sweep 240 python3 -m bench.gemv_cuda --only down "gdn out" --rows 2 4 8 \
      --plans-out /tmp/plans_h200.json --json "$OUT/sweep.json"
    cat /tmp/plans_h200.json
    for round in $(seq "${ROUNDS:-2}"); do
      tree_and_head_kernel "$round"
      TANDEM_GEMV_CUDA_PLANS=/tmp/plans_h200.json step_27b p${round}_c_swept
      prologues_and_out_early "$round"
      out_plan p${round}_g_out_r2_early3 2 1 0 3
    done
    step_cols p
    critical_path critical_tree ;;
  prologues)
    STEP_TAIL=12 step prologue_pairs 120 python3 -m bench.gemv_cuda --only gate_up "gdn in_proj" \
      "attn qkv" "gdn out" --rows 4 --norm --gated
    TANDEM_NORM_PROLOGUE=1 critical_path critical_norm_prologue
    TANDEM_GATED_PROLOGUE=1 critical_path critical_gated_prologue
    for f in critical_norm_prologue critical_gated_prologue; do
      echo "== $f"; sed -n '/by kind/,/^step /p' "$OUT/$f.log"
    done ;;
  lean)
    STEP_TAIL=6 step tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_gemv_cuda.py \
      -k "tiles_asked or early or matches_the_reference or silu_epilogue"
    for round in 1 2; do
      tree_and_head_kernel "$round"
      prologues_and_out_early "$round"
    done
    step_cols p
    critical_path critical_tree ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
