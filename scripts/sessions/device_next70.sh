#!/usr/bin/env bash
# A RECORD of its `lean` call (ran 12-07 16:06 on an H100); its `main` moved
# into device_next71.sh h200, which runs what an H200 owes in one call.
# Written 12-07 16:05 (seventh session): taller tiles
# where registers allow them. On the H200 a GEMV's rate follows its bytes in
# flight an SM over a ~1.5 us round trip: gate_up's 4 blocks x 160 threads x 4
# rows (~47 KB) reach 97% of the floor back to back, down's one 544-thread
# block x 4 rows (~39 KB) 81% (12-05 21:57), about 39/47 of it. NVRTC (12-07,
# sm_90): down at 5 rows takes 89 registers against 88 at 4 (no spill, still
# one block an SM), so ~49 KB in flight and 8 tiles a block instead of 10;
# 1,024 whole tiles of its 5,120 rows. in_proj and qkv at 6 rows: 118
# registers, 3 blocks an SM, ~52 KB against ~46. Never swept: rows 1/2/4/8 only.
#   bash scripts/sessions/device_next70.sh lean  (~2-3 min): down only. (Ran 12-07
#     16:06 on an H100: 4 tests passed, down's best 5 rows flush 2 at 17.9 us, the
#     step 6.36 against 6.37-6.38 ms; the H200's run is device_next71.sh's. A win
#     there is one line: down's CARD_PLANS entry on the H200 as CardPlan(16, rows=5).)
set -uo pipefail
call=${1:?lean}
source scripts/device_env.sh

case "$call" in
  lean)  # down only (~2-3 min): its reference tests, rows 4 and 5, the step with each
    STEP_TAIL=4 step tests 120 python3 -m pytest -q -p no:cacheprovider -rf \
      tests/test_gemv_cuda.py -k "cuda_gemv_matches_the_reference and q4_k and 17408"
    grep -E "^(FAILED|E  )" "$OUT/tests.log" | head -20
    STEP_TAIL=10 step rows 150 python3 -m bench.gemv_cuda --rows 4 5 --only down
    step_27b t1_a_tree > /dev/null
    down5 t1_c_down5 > /dev/null
    step_27b t2_a_tree > /dev/null
    down5 t2_c_down5 > /dev/null
    step_cols t ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
