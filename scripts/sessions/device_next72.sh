#!/usr/bin/env bash
# A record (ran 12-07 17:58; BENCHMARKS.md 2026-12-07 17:52-18:08). Follow-up on the warm H200 of device_next71.sh (12-07 17:52): the swept rows-6
# plans (flush 1) lost in the step (5.16 against 5.11-5.12 ms) while down at 5
# rows (flush 16) led by 0.01-0.02. Here each K = 5120 shape at 6 rows, 3 blocks
# an SM, keeps its card plan's flush, one at a time on top of down5, then all
# three; and the critical paths of the tree and of all three.
set -uo pipefail
source scripts/device_env.sh
D='"5120,17408": {"rows": 5, "flush": 16}'
G='"34816,5120": {"rows": 6, "flush": 16, "blocks_per_sm": 3}'
I='"16480,5120": {"rows": 6, "flush": 8, "blocks_per_sm": 3}'
Q='"14336,5120": {"rows": 6, "flush": 16, "blocks_per_sm": 3}'
for r in 1 2; do
  step_27b r${r}_a_tree > /dev/null
  plans_step r${r}_c_down5 "{$D}" > /dev/null
  plans_step r${r}_g_gate6 "{$D, $G}" > /dev/null
  plans_step r${r}_i_inproj6 "{$D, $I}" > /dev/null
  plans_step r${r}_q_qkv6 "{$D, $Q}" > /dev/null
  plans_step r${r}_k_all6 "{$D, $G, $I, $Q}" > /dev/null
done
step_cols r
critical_path cp_tree > /dev/null
echo "{$D, $G, $I, $Q}" > /tmp/plans_all6.json
TANDEM_GEMV_CUDA_PLANS=/tmp/plans_all6.json critical_path cp_all6 > /dev/null
for f in cp_tree cp_all6; do echo "== $f"; sed -n '/critical path/,$p' "$OUT/$f.log" | head -24; done
