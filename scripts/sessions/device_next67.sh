#!/usr/bin/env bash
# The next device call (written 12-07, sixth session): each thread's copies of
# its next tiles (q4_gemv.cu COPY_TILES, TANDEM_GEMV_COPY_TILES, off). The
# H200's GEMVs sit at 81% of their floor in the step where the H100's reach
# ~96%: one tile ahead a thread in registers is too few bytes in flight for
# 4.8 TB/s. Each thread now cp.async-copies its own entries of the block's
# next C tiles into shared memory and reads back only its own: no barrier, no
# mbarrier, 56 registers against 86-92 (NVRTC).
#   bash scripts/sessions/device_next67.sh copies  (carry .whl; ~5 min, either card)
#     0. the GPU tests of the copies and of the Q4_K headers (never run);
#     1. bench.gemv_cuda --no-sweep --copies 2 3 4 --headers: every shape, its
#        plan through registers against 2-4 tiles of copies at 4, 2 and 8 rows,
#        and the header experiment;
#     2. the int4 27B step, two rounds: the tree, TANDEM_GEMV_COPY_TILES=2, =3.
#   then on an H200 only: device_next66.sh h200 (ROUNDS=1 CRITICAL=0; carry .device)
set -uo pipefail
call=${1:?copies}
source scripts/device_env.sh

case "$call" in
  copies)
    STEP_TAIL=6 step tests 240 python3 -m pytest -q -p no:cacheprovider -rf tests/test_gemv_cuda.py \
      -k "copies or copy_tiles or headers"
    grep -E "^(FAILED|E  )" "$OUT/tests.log" | head -20
    STEP_TAIL=40 step copies 240 python3 -m bench.gemv_cuda --no-sweep --copies 2 3 4 --headers
    for r in 1 2; do
      step_27b c${r}_a_tree
      TANDEM_GEMV_COPY_TILES=2 step_27b c${r}_b_copies2
      TANDEM_GEMV_COPY_TILES=3 step_27b c${r}_c_copies3
    done
    step_cols c ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
