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
#        and the header experiment (ran 12:23 on an H100; the headers were
#        removed after it, so this call no longer runs as written);
#     2. the int4 27B step, two rounds: the tree, TANDEM_GEMV_COPY_TILES=2, =3.
#   then on an H200 only: device_next66.sh h200 (ROUNDS=1 CRITICAL=0; carry .device)
# Both calls ran (12-07 12:23 and 13:39-13:41, H100s); the copies and the Q4_K headers lost and
# were removed after them (BENCHMARKS.md 2026-12-07 13:40), so this script no longer runs as
# written: a record of what ran. `fix` used scripts/sessions/gemv_variant.py (removed with them).
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
  fix)  # after `copies` (12:23, H100): 48 KB rings launched without the opt-in (fixed), 3
    # tiles of copies 8.35 ms against 6.40. Lean (the session's device time nearly spent):
    # the bench per shape first, Nsight Compute on gate_up through registers and through 3
    # tiles of copies, then the tests (~3 min)
    STEP_TAIL=8 step copies 100 python3 -m bench.gemv_cuda --no-sweep --copies 2 3 \
      --only gate_up down "gdn out"
    for v in arrays copies3; do
      STEP_TAIL=0 step "ncu_gate_up_$v" 60 ncu --clock-control none --kernel-name tandem_q4_gemv \
        --launch-skip 20 --launch-count 1 --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats \
        python3 scripts/sessions/gemv_variant.py gate_up $v
      grep -E "Duration|DRAM Throughput|L1/TEX Hit|Achieved Occupancy|Registers Per|Dynamic Shared|Stall|Issue Slots Busy|L1/TEX Cache Throughput|Block Limit|Warp Cycles Per Issued" \
        "$OUT/ncu_gate_up_$v.log" | head -20
    done
    STEP_TAIL=4 step tests 60 python3 -m pytest -q -p no:cacheprovider -rf tests/test_gemv_cuda.py \
      -k "copies or copy_tiles"
    grep -E "^(FAILED|E  )" "$OUT/tests.log" | head -10 ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
