#!/usr/bin/env bash
# `ring` ran 12-07 23:47 on an H100 and lost (BENCHMARKS.md 2026-12-07 23:47); `ncu` is still
# owed (an H200), and with it the removed resident-chain probe, run once on the H200 from a
# git archive of 7efd4b0: on the H100 the boundary it fuses costs 0.3-2.3 us, but in the H200's
# step a GEMV after a norm runs 2.6 us over its isolated time (the H100's: 0.8), so the H100
# may have tested the premise where it is weakest. First, issue 7's roofline goal at 4K with
# rk4 KV (bench.quant --decode-context / --decode-kv-format, 12-07): never measured.
# The next device calls (written 12-07 23:10, after the resident-chain probe lost on an
# H100 at 22:50 and was removed):
#   ring (any Hopper, the H200's figure is the one that counts): the out projections (gdn out, attn o: 5120 x 6144) through a
#      shared-memory ring of bulk copies, in the step. Their tiles (1,280 over 528 blocks,
#      2-3 a block) are a chain of dependent loads in the register pipeline (62-73% of the
#      floor); a ring of 2-3 stages asks for every tile of the matrix before the
#      dependent-launch wait, while the recurrence / attention ahead leave DRAM mostly idle.
#      The sweep never picks it (12-05: back to back, the GEMV ahead saturates DRAM, so
#      nothing is gained there), and the step has not timed it on the out projections
#      alone. Builds (NVRTC sm_90, 12-07): 4 rows, 2 stages 53 registers / 28.4 KB a block;
#      3 stages 53 / 42.6 KB (5 blocks an SM); capped at 4 blocks an SM, 3 stages still
#      cover all 1,280 tiles. Rounds alternate tree / ring3 / ring2 / ring3 at 4 an SM.
#   ncu (H200 only): what bounds down's single 17-warp block. 25% more bytes in flight
#      (5 rows a tile) bought 3% (15.63 -> 15.13 us a launch in the step; BENCHMARKS.md
#      2026-12-07 17:52) where the bytes-in-flight model forecast ~15%. Nsight Compute on
#      one down launch at 4 rows and at 5 (flush 1, the sweep's first plan), and gate_up
#      (95% of its floor) beside them: `ncu_cuda_gemv` in scripts/device_env.sh.
#   release (H200 only): TANDEM_PDL_RELEASE_BEFORE_GEMV=1, back behind its switch (12-07 23:59):
#      the norms and the combine let the GEMV after them launch before their own wait. On
#      the H100 it lost 0.22 ms (15:25), where a GEMV after a norm runs ~0.8 us over its
#      back-to-back time; on the H200 the GEMV -> norm -> GEMV boundary costs ~4.5 us against
#      ~0.4 for GEMV -> GEMV (17:58's critical path), which is what an earlier placement of
#      the GEMV after a norm would attack. Its GPU test (bitwise decode graphs), two rounds
#      tree / first, and the critical path with it.
#   bash scripts/sessions/device_next74.sh release (carry .whl; ~3 min)
#   bash scripts/sessions/device_next74.sh ring  (carry .whl; ~4-5 min)
#   bash scripts/sessions/device_next74.sh ncu   (carry .whl; ~5-6 min)
set -uo pipefail
call=${1:?release, ring or ncu}
source scripts/device_env.sh
case "$call" in
  release)   # H200: the norms and the combine releasing the GEMV after them first
    grep -q H200 "$OUT/date.txt" || { echo "not an H200: the H100 ran this (12-07 15:25)"; exit 3; }
    STEP_TAIL=4 STEP_SIGNAL=ABRT step release_test 150 python3 -m pytest -q -p no:cacheprovider \
      -rf tests/test_pdl.py
    for r in 1 2; do
      step_27b r${r}_a_tree > /dev/null
      TANDEM_PDL_RELEASE_BEFORE_GEMV=1 step_27b r${r}_b_first > /dev/null
    done
    step_cols r
    TANDEM_PDL_RELEASE_BEFORE_GEMV=1 critical_path cp_first > /dev/null
    sed -n '/critical path/,$p' "$OUT/cp_first.log" | head -16 ;;
  ring)   # any Hopper: the premise (DRAM idle under the recurrence) holds on both
    R3='"5120,6144": {"rows": 4, "flush": 1, "stages": 3}'
    R2='"5120,6144": {"rows": 4, "flush": 1, "stages": 2}'
    R34='"5120,6144": {"rows": 4, "flush": 1, "stages": 3, "blocks_per_sm": 4}'
    STEP_TAIL=4 STEP_SIGNAL=ABRT step ring_test 120 python3 -m pytest -q -p no:cacheprovider \
      -rf tests/test_gemv_cuda.py -k "shared_memory_ring and 6144 or walking_many_tiles"
    for r in 1 2; do
      step_27b r${r}_a_tree > /dev/null
      plans_step r${r}_b_ring3 "{$R3}" > /dev/null
      plans_step r${r}_c_ring2 "{$R2}" > /dev/null
      plans_step r${r}_d_ring3_4 "{$R34}" > /dev/null
    done
    step_cols r
    TANDEM_GEMV_CUDA_PLANS=/tmp/plans_r1_b_ring3.json critical_path cp_ring3 > /dev/null
    sed -n '/critical path/,$p' "$OUT/cp_ring3.log" | head -24 ;;
  ncu)
    grep -q H200 "$OUT/date.txt" || { echo "not an H200: the ncu part is the H200's"; exit 3; }
    # issue 7's roofline goal (>= 75% at 4K, rk4 KV), never measured for the int4 step
    STEP_TAIL=4 step roofline_4k 240 python3 -m bench.quant --rows 1 --only lm_head \
      --decode-steps 16 --decode-context 4096 --decode-kv-format rk4
    ncu_cuda_gemv down 4
    ncu_cuda_gemv down 5
    ncu_cuda_gemv gate_up 4
    # the removed probe (bench/chain_probe.py, bench/q4_chain.cu at 7efd4b0) on this H200
    rm -rf /tmp/chain && mkdir -p /tmp/chain
    git archive 7efd4b0 | tar -x -C /tmp/chain || { echo "7efd4b0 is not in this copy's git"; exit 4; }
    (cd /tmp/chain && PYTHONPATH=/tmp/chain:/tmp/site STEP_TAIL=12 step chain_h200 200 \
      python3 -m bench.chain_probe --check) ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
