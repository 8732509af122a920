#!/usr/bin/env bash
# The next H200 call (written 12-07, third session): the step is 5.10-5.11 ms,
# 0.3 ms from issue 7's 4.8; its GEMVs run at 81% of their floor, down at 79%
# and the out projections at 62-73% (BENCHMARKS.md 2026-12-07, H200). Levers
# that need no new kernel, untimed on the H200 since its runs steadied:
#   bash scripts/sessions/device_next64.sh h200  (carry .whl; ~6-8 min):
#     0. the GPU tests of the early tiles, a plan's own early count among them
#        (CudaGemvPlan.early_tiles, new: bitwise the plain GEMV);
#     1. bench.gemv_cuda's sweep of down and the out projections (rows 2 4 8,
#        the flush and grid variants), its best plans into /tmp/plans_h200.json
#        (the card plans were swept on 12-05, before the early tiles);
#     2. the int4 27B step alternating (ROUNDS, 2): this tree, the sweep's
#        plans (TANDEM_GEMV_CUDA_PLANS), the layer norms in the GEMV
#        prologues (TANDEM_NORM_PROLOGUE=1: 128 launches fewer; lost on the
#        H200 in its noisy era, 12-06 03:08), GDN's gated norm in out_proj's
#        (TANDEM_GATED_PROLOGUE=1), the out projections (5120 x 6144, whose
#        blocks walk 2-3 tiles and which sat at 6.7 us against a 4.3 floor
#        with their weight already in L2) asking all their tiles of L2
#        before the wait (4 rows a tile, 528 blocks: early_tiles 2 covers
#        all; 2 rows, ~4 tiles a block: 3 does), where the switch's 2 for
#        every shape lost (5.15 against 5.10 ms);
#     3. the critical path with the sweep's plans.
set -uo pipefail
call=${1:?h200}
source scripts/device_env.sh
case "$call" in
  h200)
    STEP_TAIL=6 step tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_gemv_cuda.py \
      -k "tiles_asked or early or read_ahead"
    STEP_TAIL=30 step sweep 240 python3 -m bench.gemv_cuda --only down "gdn out" --rows 2 4 8 \
      --plans-out /tmp/plans_h200.json --json "$OUT/sweep.json"
    cat /tmp/plans_h200.json
    for round in $(seq "${ROUNDS:-2}"); do
      step_27b p${round}_a_tree
      TANDEM_GEMV_CUDA_PLANS=/tmp/plans_h200.json step_27b p${round}_b_swept
      TANDEM_NORM_PROLOGUE=1 step_27b p${round}_c_norm_prologue
      TANDEM_GATED_PROLOGUE=1 step_27b p${round}_d_gated_prologue
      out_plan p${round}_e_out_early2 4 1 0 2
      out_plan p${round}_f_out_r2_early3 2 1 0 3
    done
    step_cols p
    TANDEM_GEMV_CUDA_PLANS=/tmp/plans_h200.json critical_path critical_swept ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
