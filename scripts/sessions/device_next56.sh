#!/usr/bin/env bash
# 12-06 (second session): run-ahead's step on the card that comes, where its
# graph's time goes now, and GDN's state read before the dependent-launch wait.
#   bash scripts/sessions/device_next56.sh where  (carry .whl): the run-ahead and
#     GDN kernel GPU tests (the state-early switch on), the critical path of a
#     step with the state read after the wait (default) and before it, then
#     the engine's step: default / state early alternating, and the plain loop
#     (08:11, H100: early 6.62 / 6.62 against 6.66 / 6.67 ms, plain 6.99;
#     the recurrence's charge 5.23 -> 3.83 us a layer)
#   bash scripts/sessions/device_next56.sh attn   (carry .whl): why the KV write
#     (~6 us) and the attention (~14 us) advance a 4K step so far beyond
#     their work: the attention chain's charges with dependent launches off,
#     and with 1 / 4 key-split programs an SM against the default 2
#     (08:18, H100: without dependent launches the write kernel alone takes
#     6.3 us and the attention 14.1, so the charges are their own time; the
#     per-SM switch left the split count at 64 either way: no change)
#   bash scripts/sessions/device_next56.sh early  (carry .whl): attention reading
#     q and the stored keys before its wait (TANDEM_ATTN_KEYS_EARLY=1): its GPU
#     tests with both early switches on, the attention chain's charges and the
#     step against the state-early default, alternating; then Nsight Compute
#     on one int8 KV write (08:25, the first H200 of the day: keys early
#     lost every pair, 5.37-5.38 against 5.30-5.32 ms, and were taken out;
#     ncu found no write kernel to profile; 08:45: state early 5.32 in three
#     runs against 5.34-5.36, the plain loop 6.15)
#   bash scripts/sessions/device_next56.sh write  (carry .whl): K's norm and
#     rotary inside the int8 KV write (TANDEM_KV_WRITE_PREPARED, on): its GPU
#     tests and run-ahead's, the step against the two launches, alternating,
#     and the attention chain's charges with it (08:50, H100: 25 tests passed;
#     6.62-6.63 ms both ways in three pairs, the attention after the write
#     took the 2.5 us a layer the chain lost: kept off main, on the local
#     branch kv-write-prepared; this call needs that branch's code)
set -uo pipefail
call=${1:?where, attn, early or write}
source scripts/device_env.sh
case "$call" in
  where)
    TANDEM_GDN_STATE_EARLY=1 STEP_TAIL=6 step tests 200 python3 -m pytest -q -p no:cacheprovider \
      tests/test_run_ahead.py tests/test_gdn_kernels.py
    for round in 1 2; do
      step_27b w${round}_a_default
      TANDEM_GDN_STATE_EARLY=1 step_27b w${round}_b_early
    done
    TANDEM_RUN_AHEAD=0 step_27b w3_c_plain
    step_cols w
    STEP_TAIL=40 step critical 150 python3 -m bench.profile_step --weights int4 --critical-path --top 30
    TANDEM_GDN_STATE_EARLY=1 STEP_TAIL=40 step critical_early 150 \
      python3 -m bench.profile_step --weights int4 --critical-path --top 30 ;;
  attn)
    export TANDEM_GDN_STATE_EARLY=1
    chain() {  # chain NAME: the attention chain's kernels and hops of a profiled step
      STEP_TAIL=0 step "$1" 150 python3 -m bench.profile_step --weights int4 --critical-path --top 40
      grep -e "^step" -e "critical path" -e attention -e write -e combine -e norm_rope \
        -e sigmoid "$OUT/$1.log"
    }
    chain p_default
    TANDEM_PDL=0 chain p_nopdl
    for per in 1 4; do
      TANDEM_DECODE_PROGRAMS_PER_SM=$per chain p_per$per
      TANDEM_DECODE_PROGRAMS_PER_SM=$per step_27b s_per$per
    done
    step_27b s_default
    step_cols s_ ;;
  early)
    export TANDEM_GDN_STATE_EARLY=1
    TANDEM_ATTN_KEYS_EARLY=1 STEP_TAIL=6 step tests 300 python3 -m pytest -q -p no:cacheprovider \
      tests/test_attention.py tests/test_cuda_graphs.py tests/test_gdn_kernels.py
    chain() {  # chain NAME: the attention chain's kernels and hops of a profiled step
      STEP_TAIL=0 step "$1" 150 python3 -m bench.profile_step --weights int4 --critical-path --top 40
      grep -e "^step" -e "critical path" -e attention -e write -e combine -e norm_rope \
        -e sigmoid -e recurrence "$OUT/$1.log"
    }
    chain p_state
    TANDEM_ATTN_KEYS_EARLY=1 chain p_keys
    for round in 1 2 3; do
      step_27b e${round}_a_state
      TANDEM_ATTN_KEYS_EARLY=1 step_27b e${round}_b_keys
    done
    step_cols e
    STEP_TAIL=60 step ncu_write 150 ncu --clock-control none --kernel-name regex:_int8_write \
      --launch-skip 40 --launch-count 1 --section SpeedOfLight --section LaunchStats \
      --section WarpStateStats --section MemoryWorkloadAnalysis \
      python3 -m bench.quant --rows 1 --only lm_head --decode-steps 4 ;;
  write)
    STEP_TAIL=4 step tests 120 python3 -m pytest -q -p no:cacheprovider \
      tests/test_kv_write_prepared.py tests/test_run_ahead.py
    for round in 1 2 3; do
      step_27b k${round}_a_prepared
      TANDEM_KV_WRITE_PREPARED=0 step_27b k${round}_b_two
    done
    step_cols k
    STEP_TAIL=0 step chain 100 python3 -m bench.profile_step --weights int4 --critical-path --top 40
    grep -e "^step" -e "critical path" -e attention -e write -e combine -e norm_rope \
      -e sigmoid "$OUT/chain.log" ;;
esac
