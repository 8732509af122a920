#!/usr/bin/env bash
# The next H200 call (written 12-07, fourth session). device_next64.sh's plan,
# which never ran (no machine came), plus one kernel A/B:
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
set -uo pipefail
call=${1:?h200}
source scripts/device_env.sh
case "$call" in
  h200)
    cp engine/quant/q4_gemv.cu /tmp/q4_tree.cu
    STEP_TAIL=6 step tests 240 python3 -m pytest -q -p no:cacheprovider tests/test_gemv_cuda.py
    STEP_TAIL=30 step sweep 240 python3 -m bench.gemv_cuda --only down "gdn out" --rows 2 4 8 \
      --plans-out /tmp/plans_h200.json --json "$OUT/sweep.json"
    cat /tmp/plans_h200.json
    for round in $(seq "${ROUNDS:-2}"); do
      step_27b p${round}_a_tree
      cp .device/q4_gemv_head.cu engine/quant/q4_gemv.cu
      step_27b p${round}_b_head_kernel
      cp /tmp/q4_tree.cu engine/quant/q4_gemv.cu
      TANDEM_GEMV_CUDA_PLANS=/tmp/plans_h200.json step_27b p${round}_c_swept
      TANDEM_NORM_PROLOGUE=1 step_27b p${round}_d_norm_prologue
      TANDEM_GATED_PROLOGUE=1 step_27b p${round}_e_gated_prologue
      out_plan p${round}_f_out_early2 4 1 0 2
      out_plan p${round}_g_out_r2_early3 2 1 0 3
    done
    step_cols p
    critical_path critical_tree ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
