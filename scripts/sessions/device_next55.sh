#!/usr/bin/env bash
# 12-06: where the int4 step's time goes with dependent launches on, and the
# epilogues on the card that comes (the H200 never ran them).
#   bash scripts/sessions/device_next55.sh probe   (carry .whl): the critical
#     path of a step (bench.profile_step --critical-path, PDL on), then two
#     rounds of both epilogues (the default) / neither / the default with
#     GDN's gated norm in out_proj's prologue
#   bash scripts/sessions/device_next55.sh norm    (carry .whl): the layer
#     norms in the prologue of the GEMV after them, with the epilogues
#     (TANDEM_NORM_PROLOGUE=1): its GPU tests, then rounds against the default
#   bash scripts/sessions/device_next55.sh host    (carry .whl): the engine's
#     step against its graph replayed back to back (bench.quant's
#     back_to_back_ms: the host's share of a token), with both epilogues
#     and with neither, alternating
#   bash scripts/sessions/device_next55.sh ahead   (carry .whl): the run-ahead
#     decode's GPU tests, then the engine's step with TANDEM_RUN_AHEAD=1
#     against the plain loop, alternating; then the real service on CUDA
#     with the decode worker's scheduler running ahead (12-06 04:48, H100:
#     plain 6.97-6.99 ms, ahead 6.65-6.66, back to back 6.62-6.63; the
#     service step needs the embedded GGUF for tests/test_service.py, so
#     only test_service_hybrid.py ran, in a second call, and passed)
#   bash scripts/sessions/device_next55.sh ahead2  (carry .whl): run-ahead now the
#     default on CUDA and for sampled rows too: its GPU tests (the draw under
#     torch's sync check), then the step greedy and at temperature 0.7, each
#     run ahead (the default) and plain, and the hybrid service on CUDA
#     (12-06 05:02, H100: greedy 6.55 against 7.08-7.42 ms, T 0.7 6.90 against
#     7.55-7.90, back to back 6.53-6.55; the next call to make on an H200)
#   bash scripts/sessions/device_next55.sh all     (carry .whl): the norm
#     tests, the critical path, then two rounds of the default / neither
#     epilogue / the norm prologue / 8 MB read-ahead
set -uo pipefail
call=${1:?probe, norm, host, ahead, ahead2 or all}
source scripts/device_env.sh
steps() {  # steps PREFIX...: each log's step times on one line
  for prefix in "$@"; do
    for f in "$OUT"/${prefix}*.log; do
      echo "$(basename "$f" .log) $(grep -A2 step_ms "$f" | grep -v -e step_ms -e -- | awk '{print $2}' | paste -sd' ')"
    done
  done
}
case "$call" in
  probe)
    STEP_TAIL=45 step critical 200 python3 -m bench.profile_step --weights int4 --critical-path --top 30
    for round in 1 2; do
      step_27b r${round}_a_both
      TANDEM_SILU_EPILOGUE=0 TANDEM_CONV_EPILOGUE=0 step_27b r${round}_b_neither
      TANDEM_GATED_PROLOGUE=1 step_27b r${round}_c_gated
    done
    steps r1_ r2_ ;;
  norm)
    STEP_TAIL=6 step norm_tests 300 python3 -m pytest -q -p no:cacheprovider \
      tests/test_gemv_cuda.py tests/test_cuda_graphs.py tests/test_cuda.py \
      -k "norm or prologue or epilogue or graph or greedy or matches_the_reference"
    for round in 1 2 3; do
      step_27b n${round}_a_default
      TANDEM_NORM_PROLOGUE=1 step_27b n${round}_b_norm
    done
    steps n1_ n2_ n3_
    TANDEM_NORM_PROLOGUE=1 STEP_TAIL=45 step critical_norm 200 \
      python3 -m bench.profile_step --weights int4 --critical-path --top 30 ;;
  all)   # most wanted first: a timed-out call still brings back $OUT's logs
    STEP_TAIL=45 step critical 150 python3 -m bench.profile_step --weights int4 --critical-path --top 30
    step_27b r1_a_default
    TANDEM_NORM_PROLOGUE=1 step_27b r1_c_norm
    TANDEM_GEMV_L2_PREFETCH_MB=8 step_27b r1_e_l2
    TANDEM_SILU_EPILOGUE=0 TANDEM_CONV_EPILOGUE=0 step_27b r1_b_neither
    STEP_TAIL=6 step norm_tests 150 python3 -m pytest -q -p no:cacheprovider \
      tests/test_gemv_cuda.py -k "norm_prologue_and or layer_norm_in"
    step_27b r2_a_default
    TANDEM_NORM_PROLOGUE=1 step_27b r2_c_norm
    TANDEM_GEMV_L2_PREFETCH_MB=8 step_27b r2_e_l2
    steps r1_ r2_ ;;
  ahead)
    STEP_TAIL=6 step ahead_tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_run_ahead.py
    for round in 1 2 3; do
      TANDEM_RUN_AHEAD=0 step_27b a${round}_a_plain
      TANDEM_RUN_AHEAD=1 step_27b a${round}_b_ahead
    done
    for f in "$OUT"/a*_*.log; do   # step_ms and back_to_back_ms
      echo "$(basename "$f" .log) $(grep -A2 step_ms "$f" | grep -v -e step_ms -e -- | awk '{print $2, $3}')"
    done
    # the decode worker's scheduler queueing ahead inside the real service
    TANDEM_TEST_DEVICE=cuda TANDEM_RUN_AHEAD=1 STEP_TAIL=6 step ahead_service 200 \
      python3 -m pytest -q -p no:cacheprovider tests/test_service.py tests/test_service_hybrid.py ;;
  ahead2)   # run-ahead the default on CUDA, now for sampled rows too
    STEP_TAIL=6 step ahead_tests 240 python3 -m pytest -q -p no:cacheprovider \
      tests/test_run_ahead.py tests/test_sampling.py
    for round in 1 2; do
      step_27b g${round}_a_ahead
      TANDEM_RUN_AHEAD=0 step_27b g${round}_b_plain
      STEP_TAIL=3 step s${round}_a_ahead 100 python3 -m bench.quant --rows 1 --only lm_head \
        --decode-steps 16 --decode-temperature 0.7
      TANDEM_RUN_AHEAD=0 STEP_TAIL=3 step s${round}_b_plain 100 python3 -m bench.quant --rows 1 \
        --only lm_head --decode-steps 16 --decode-temperature 0.7
    done
    for f in "$OUT"/[gs][12]_*.log; do   # step_ms and back_to_back_ms
      echo "$(basename "$f" .log) $(grep -A2 step_ms "$f" | grep -v -e step_ms -e -- | awk '{print $2, $3}')"
    done
    TANDEM_TEST_DEVICE=cuda STEP_TAIL=6 step ahead_service 200 \
      python3 -m pytest -q -p no:cacheprovider tests/test_service_hybrid.py tests/test_decode_warmup.py ;;
  host)
    for round in ${ROUNDS:-1 2}; do
      step_27b h${round}_a_default
      TANDEM_SILU_EPILOGUE=0 TANDEM_CONV_EPILOGUE=0 step_27b h${round}_b_neither
    done
    for f in "$OUT"/h*.log; do   # step_ms and back_to_back_ms
      echo "$(basename "$f" .log) $(grep -A2 step_ms "$f" | grep -v -e step_ms -e -- | awk '{print $2, $3}')"
    done ;;
esac
