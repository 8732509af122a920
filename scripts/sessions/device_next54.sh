#!/usr/bin/env bash
# 12-05/06 night: GDN's decode conv in in_proj's GEMV epilogue (q4_gemv.cu
# CONV; TANDEM_CONV_EPILOGUE, on by default): its GPU tests, then the int4
# 27B step with it against the conv's own launch, alternating on one machine.
#   bash scripts/sessions/device_next54.sh conv   (carry .whl): tests + 2 pairs
#   bash scripts/sessions/device_next54.sh ab     (carry .whl): 2 more pairs,
#     one pair of the per-card plans against plan_for's (never run as the
#     default), and where the step goes with the epilogue
#   bash scripts/sessions/device_next54.sh silu   (carry .whl): the MLP's
#     activation in gate_up's epilogue too (TANDEM_SILU_EPILOGUE): its GPU
#     tests, then rounds of both epilogues / the conv's alone / neither
#   bash scripts/sessions/device_next54.sh h200   (carry .whl): both epilogues
#     (the default) against neither, two rounds, on whatever card comes
set -uo pipefail
call=${1:?conv, ab, silu or h200}
source scripts/device_env.sh
pairs() {  # pairs ROUNDS PREFIX
  for round in $(seq 1 "$1"); do
    TANDEM_CONV_EPILOGUE=1 step_27b ${2}${round}_epilogue
    TANDEM_CONV_EPILOGUE=0 step_27b ${2}${round}_launch
  done
  for f in "$OUT"/${2}*_epilogue.log "$OUT"/${2}*_launch.log; do
    echo "$(basename "$f" .log) $(grep -A2 step_ms "$f" | grep -v -e step_ms -e -- | awk '{print $2}' | paste -sd' ')"
  done
}
case "$call" in
  conv)
    STEP_TAIL=6 step conv_tests 300 python3 -m pytest -q -p no:cacheprovider \
      tests/test_gemv_cuda.py tests/test_cuda_graphs.py tests/test_gdn_kernels.py \
      -k "conv or every_flag or card or matches_the_reference or dependent or prologue or graph or fused or step"
    pairs 2 ab ;;
  ab)
    pairs 2 ba
    step_27b cp_cardplans
    TANDEM_GEMV_CUDA_STAGES=0 step_27b cp_planfor
    grep -h -A2 step_ms "$OUT"/cp*.log | grep -v -e step_ms -e -- | awk '{print $2}' | paste -sd' '
    TANDEM_PDL=0 STEP_TAIL=40 step profile_int4 200 python3 -m bench.profile_step --weights int4 ;;
  silu)
    STEP_TAIL=6 step silu_tests 300 python3 -m pytest -q -p no:cacheprovider \
      tests/test_gemv_cuda.py tests/test_cuda_graphs.py tests/test_cuda.py \
      -k "silu or conv or epilogue or every_flag or graph or greedy or matches_the_reference"
    for round in 1 2 3; do
      TANDEM_SILU_EPILOGUE=1 step_27b s${round}_both
      TANDEM_SILU_EPILOGUE=0 step_27b s${round}_conv
      TANDEM_SILU_EPILOGUE=0 TANDEM_CONV_EPILOGUE=0 step_27b s${round}_neither
    done
    for f in "$OUT"/s*_both.log "$OUT"/s*_conv.log "$OUT"/s*_neither.log; do
      echo "$(basename "$f" .log) $(grep -A2 step_ms "$f" | grep -v -e step_ms -e -- | awk '{print $2}')"
    done
    TANDEM_PDL=0 STEP_TAIL=30 step profile_both 200 python3 -m bench.profile_step --weights int4 ;;
  h200)
    for round in 1 2; do
      step_27b h${round}_both
      TANDEM_SILU_EPILOGUE=0 TANDEM_CONV_EPILOGUE=0 step_27b h${round}_neither
    done
    for f in "$OUT"/h*_both.log "$OUT"/h*_neither.log; do
      echo "$(basename "$f" .log) $(grep -A2 step_ms "$f" | grep -v -e step_ms -e -- | awk '{print $2}')"
    done ;;
esac
