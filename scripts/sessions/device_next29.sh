#!/usr/bin/env bash
# GPU session of 2026-12-03 13:27-14:31, all six calls run (BENCHMARKS.md,
# "the agent loop's slow last turn was the profiler's"; next: device_next32.sh, which took
# over the plan of device_next30.sh, never run).
# (The checkout was new: the MTP corpus of
# .device/ was lost, so the head's training waits for answers generated on the
# CPU meanwhile and runs last, in its own chain: scripts/device_chain_mtp.sh).
#   bash scripts/sessions/device_next29.sh 1    then, chained,    bash scripts/sessions/device_next29.sh 2
# Call 1: Nsight Compute on the DP4A GEMV (issue 7: ~5.2 ms of the int4
#   step's 7.1-7.8 against a 3.3 ms floor; the static counts of 12-02 17:00 put
#   it at half the issue rate, so bytes in flight per SM were the suspect) on
#   three 27B shapes: gate_up (66% of its floor), down (57%) and gdn out /
#   attn o (45%); then device_next28.sh's call 1, trimmed: the prefill
#   attention at the agent loop's shape (1,100 new over 100K) over rk4, int8
#   and bf16 pages, 128 x 64 tiles (4) against 128 x 32 (3), and the 32K
#   prefill's MFU with rk4 on TANDEM_PREFILL_BLOCK_N=64 and 32.
# Call 2: the agent loop with int8 and then rk4 KV back to back, every turn's
#   prefill now logged with its chunks' wall times, the garbage collector's
#   pauses and the SM clock (engine.profiling.Timeline): rk4's 7 of 19 turns
#   at 0.32-0.41 s (12-03 11:16) had no cause.
# Calls 3 and 4 carry the GGUF's first two parts (scripts/device_chain_mtp.sh 1|2),
#   call 5 trains the MTP head (device_chain_mtp.sh 3 with the CPU's corpus):
# Call 3: the rk4 agent loop again with the timeline alone (PROFILE_EVERY=1000):
#   call 2's profiled turns 9 and 19 ran 50-66 ms slower under the profiler,
#   and turn 20 waited 93 ms for turn 19's trace report (rk4's 0.392 s; 12-03
#   11:16's 0.411 s at the same turn was likely the same).
# Call 4: the DP4A GEMV's configs again, now with prefetch (tile i+1's loads
#   before tile i's arithmetic), on the five merged 27B shapes, then the int4
#   step with today's TUNED for a same-host baseline.
set -uo pipefail
M=qwen3.5-27b
source scripts/device_env.sh
case "${1:?call 1, 2, 3 or 4}" in
  1)
    for only in gate_up down "gdn out"; do ncu_gemv "$only"; done
    STEP_TAIL=30 step prefill_attention 240 python3 -m bench.attention --context 100352 \
      --new 1100 --kv-format rk4 int8 bf16 --candidates 3 4 --splits 1 8 --repeats 2
    for bn in 64 32; do
      STEP_TAIL=6 step prefill_rk4_bn$bn 120 env TANDEM_PREFILL_BLOCK_N=$bn python3 -m \
        bench.prefill --model $M --device cuda --kv-format rk4 --tokens 32768 --chunk 4096 --repeats 1
    done
    (cd "$OUT" && tar czf ncu.tgz ncu_*.log && rm ncu_*.log)
    ;;
  3)
    KV=rk4 PROFILE_EVERY=1000 AGENT_LIMIT=270 bash scripts/device_agent_loop.sh
    ;;
  4)
    STEP_TAIL=40 step gemv_sweep 420 python3 -m bench.quant --rows 1 --sweep --int8-x-only \
      --decode-steps 0 --only gate_up down "gdn in_proj" "gdn out" "attn qkv" --json "$OUT/sweep.json"
    STEP_TAIL=4 step int4_step 120 python3 -m bench.quant --rows 1 --only lm_head --decode-steps 16
    ;;
  2)
    for kv in int8 rk4; do
      KV=$kv PROFILE_EVERY=10 AGENT_LIMIT=270 bash scripts/device_agent_loop.sh
      mv "$OUT/agent_loop.log" "$OUT/agent_loop_$kv.log"; mv "$OUT/agent_loop.json" "$OUT/agent_loop_$kv.json"
    done
    ;;
esac
