#!/usr/bin/env bash
# The next device calls (written 12-07 18:20-18:40; the chain widened to the
# 27B's own boundaries 12-07 20:50-21:40, a session that got no machine):
#   chain: the resident-chain probe (bench/chain_probe.py, bench/q4_chain.cu;
#      never run on a GPU yet): a GEMV, the add_rms_norm and the next GEMV
#      as three launches, as two (the norm prologue) and as ONE persistent
#      launch whose blocks wait at a grid counter with the second GEMV's
#      first tile in registers. Seven pairs: a 5120 x 5120 stand-in before
#      each K = 5120 projection (the premise), then the step's own
#      boundaries: gdn out before gate_up (192-thread blocks, or 160 at two
#      groups a thread) and down before gdn in_proj / attn qkv (544 threads,
#      the second GEMV in three 160-thread parts), each second GEMV with the
#      step's epilogue (SiLU * up after gate_up, the conv after in_proj).
#      Its GPU test first (the outputs against the launches'; it also runs
#      the GEMV's own flush, now a helper the chain shares, through the
#      launches it compares with), then the timings. Worth building into
#      the step if the step's own pairs save >= ~2.5 us each on the H200
#      (docs/ARCHITECTURE.md, the decode step's item 4). An H100 runs this
#      part too (same premise, Hopper).
#   ncu (H200 only): what bounds down's single 17-warp block. 25% more bytes
#      in flight (5 rows a tile, the card plan since 12-07) bought 3% (15.63 ->
#      15.13 us a launch in the step; BENCHMARKS.md 2026-12-07 17:52) where the
#      bytes-in-flight model forecast ~15%. Nsight Compute on one down launch
#      at 4 rows and at 5 (flush 1, the sweep's first plan), and on gate_up
#      (95% of its floor) beside them: `ncu_cuda_gemv` in scripts/device_env.sh.
#   flush: the GEMV's conv / SiLU / epilogue tests, since its flush is now a
#      helper the chain shares (PTX identical but the conv builds' preamble).
#   bash scripts/sessions/device_next73.sh chain  (carry .whl; ~4-6 min, under 450 s)
#   bash scripts/sessions/device_next73.sh flush  (carry .whl; ~2-3 min)
#   bash scripts/sessions/device_next73.sh ncu    (carry .whl; ~3 min, H200)
set -uo pipefail
call=${1:?chain, flush or ncu}
source scripts/device_env.sh
case "$call" in
  chain)
    STEP_TAIL=4 STEP_SIGNAL=ABRT step chain_test 200 python3 -m pytest -q -p no:cacheprovider \
      -rf tests/test_chain_probe.py
    grep -E "^(FAILED|E  )" "$OUT/chain_test.log" | head -20
    STEP_TAIL=20 STEP_SIGNAL=ABRT step chain 240 python3 -m bench.chain_probe --check ;;
  flush)
    # the GEMV's flush moved into a helper (PTX identical but for the conv builds'
    # preamble): its epilogue and prologue tests on the GPU
    STEP_TAIL=4 STEP_SIGNAL=ABRT step gemv_flush 200 python3 -m pytest -q -p no:cacheprovider \
      -rf tests/test_gemv_cuda.py -k "conv or silu or epilogue" ;;
  ncu)
    grep -q H200 "$OUT/date.txt" || { echo "not an H200: the ncu part is the H200's"; exit 3; }
    ncu_cuda_gemv down 4
    ncu_cuda_gemv down 5
    ncu_cuda_gemv gate_up 4 ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
