#!/usr/bin/env bash
# A record: it ran on an H200 at 12-07 17:52 (BENCHMARKS.md 2026-12-07 17:52-18:08);
# down at 5 rows is the card plan since, so its tree and down5 setups now match.
# Written 12-07 16:15, seventh session: everything an
# H200 owes in one call (~6-7 min), so that one H200 start answers it all.
# (It merges two calls written earlier that session, the norm prologue's and the
# taller tiles'; device_next70.sh's header and BENCHMARKS.md 2026-12-07 say why:)
#   - down in tiles of 5 rows (89 registers against 88, ~25% more bytes in
#     flight; the H100's sweep's best, 17.9 us, and the step 0.01-0.02 ms
#     ahead there); in_proj and qkv at 6 rows (3 blocks an SM, ~52 KB);
#   - the norm prologue (a GEMV after a norm pays ~2.45 us of cold start in the
#     H200's step, ~0.8 on an H100, where the prologue is level);
#   - the out projections asking L2 for all 2-3 of their tiles early, and the
#     GEMVs after a norm for two.
#   bash scripts/sessions/device_next71.sh h200  (carry .whl; on an H100 it runs only
#   the rows reference tests of every kind, then stops)
#     0. the rows 4/5/6 reference tests (Q4_K);
#     1. bench.gemv_cuda --rows 4 5 6 on down, gdn in_proj, attn qkv, gate_up (--plans-out);
#     2. the int4 27B step alternating (ROUNDS, 2): the tree; the sweep's plans;
#        down alone at 5 rows; the norm prologue; the out projections' early 3;
#        the GEMVs after a norm at early 2.
# A win for down at 5 rows is one line: the H200's CARD_PLANS entry for down
# as CardPlan(16, rows=5).
set -uo pipefail
call=${1:?h200}
source scripts/device_env.sh

round() {  # round N
  step_27b h$1_a_tree
  TANDEM_GEMV_CUDA_PLANS=/tmp/plans_rows.json step_27b h$1_b_swept
  down5 h$1_c_down5
  TANDEM_NORM_PROLOGUE=1 step_27b h$1_d_norm
  out_plan h$1_e_out_early3 4 1 0 3
  after_norm_early2 h$1_f_after_norm_early2
}

case "$call" in
  h200)
    if ! grep -q H200 "$OUT/date.txt"; then  # an H100 still owes the other kinds' taller tiles
      STEP_TAIL=4 step tests_all 300 python3 -m pytest -q -p no:cacheprovider -rf \
        tests/test_gemv_cuda.py -k "cuda_gemv_matches_the_reference"
      grep -E "^(FAILED|E  )" "$OUT/tests_all.log" | head -20
      echo "not an H200: no step timings here"; exit 3
    fi
    STEP_TAIL=4 step tests 200 python3 -m pytest -q -p no:cacheprovider -rf \
      tests/test_gemv_cuda.py -k "cuda_gemv_matches_the_reference and q4_k"
    grep -E "^(FAILED|E  )" "$OUT/tests.log" | head -20
    STEP_TAIL=14 step rows 240 python3 -m bench.gemv_cuda --rows 4 5 6 \
      --only down "gdn in_proj" "attn qkv" gate_up --plans-out /tmp/plans_rows.json
    cat /tmp/plans_rows.json
    for r in $(seq "${ROUNDS:-2}"); do round "$r" > /dev/null; done
    step_cols h ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
