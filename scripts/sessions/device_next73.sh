#!/usr/bin/env bash
# The next device call (written 12-07 18:20, eighth session), owed to an H200:
# what bounds down's single 17-warp block there. 25% more bytes in flight (5
# rows a tile, the card plan since 12-07) bought 3% (15.63 -> 15.13 us a
# launch in the step; BENCHMARKS.md 2026-12-07 17:52), where the
# bytes-in-flight model forecast ~15%. Nsight Compute on one down launch at
# 5 rows and at 4 (flush 1, the sweep's first plan), and on gate_up (95% of its
# floor) beside them: `ncu_cuda_gemv` in scripts/device_env.sh.
#   bash scripts/sessions/device_next73.sh h200  (carry .whl; ~2-3 min)
set -uo pipefail
call=${1:?h200}
source scripts/device_env.sh
case "$call" in
  h200)
    grep -q H200 "$OUT/date.txt" || { echo "not an H200: nothing owed here"; exit 3; }
    ncu_cuda_gemv down 4
    ncu_cuda_gemv down 5
    ncu_cuda_gemv gate_up 4 ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
