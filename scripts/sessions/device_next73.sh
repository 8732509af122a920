#!/usr/bin/env bash
# The next device call (written 12-07 18:20, eighth session), owed to an H200:
# what bounds down's single 17-warp block there. 25% more bytes in flight (5
# rows a tile, the card plan since 12-07) bought 3% (15.63 -> 15.13 us a
# launch in the step; BENCHMARKS.md 2026-12-07 17:52), where the
# bytes-in-flight model forecast ~15%. Nsight Compute on one down launch at
# 5 rows and at 4, and on gate_up (95% of its floor) beside them.
#   bash scripts/sessions/device_next73.sh h200  (carry .whl; ~3 min)
set -uo pipefail
call=${1:?h200}
source scripts/device_env.sh
case "$call" in
  h200)
    grep -q H200 "$OUT/date.txt" || { echo "not an H200: nothing owed here"; exit 3; }
    echo '{"5120,17408": {"rows": 4, "flush": 16}}' > /tmp/plans_down4.json
    TANDEM_GEMV_CUDA_PLANS=/tmp/plans_down4.json ncu_gemv down
    mv "$OUT/ncu_gemv_down.log" "$OUT/ncu_gemv_down4.log" 2>/dev/null
    ncu_gemv down
    ncu_gemv gate_up
    for f in "$OUT"/ncu_gemv_*.log; do
      echo "== $f"
      grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Stall|Issue Slots|L2 Hit|One or More Eligible|No Eligible" "$f" | head -24
    done ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
