#!/usr/bin/env bash
# The next device calls (written 12-07 23:10, after the resident-chain probe lost on an
# H100 at 22:50 and was removed):
#   ncu (H200 only): what bounds down's single 17-warp block. 25% more bytes in flight
#      (5 rows a tile, the card plan since 12-07) bought 3% (15.63 -> 15.13 us a launch in
#      the step; BENCHMARKS.md 2026-12-07 17:52) where the bytes-in-flight model forecast
#      ~15%. Nsight Compute on one down launch at 4 rows and at 5 (flush 1, the sweep's
#      first plan), and on gate_up (95% of its floor) beside them: `ncu_cuda_gemv` in
#      scripts/device_env.sh. Then the step once, so the call also says which H200 it was.
#   bash scripts/sessions/device_next74.sh ncu  (carry .whl; ~3-4 min, H200)
set -uo pipefail
call=${1:?ncu}
source scripts/device_env.sh
case "$call" in
  ncu)
    grep -q H200 "$OUT/date.txt" || { echo "not an H200: the ncu part is the H200's"; exit 3; }
    ncu_cuda_gemv down 4
    ncu_cuda_gemv down 5
    ncu_cuda_gemv gate_up 4
    step_27b step_tree ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
