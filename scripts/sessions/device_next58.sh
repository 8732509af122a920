#!/usr/bin/env bash
# 12-06 (fourth session): when a kernel lets the next one launch
# (TANDEM_PDL_RELEASE, engine/pdl.py): after its wait (0, the default so
# far), before it in the Triton kernels (1), and in the CUDA GEMVs too (2);
# and two launches fewer an attention layer (q and k norm + rotary in one,
# TANDEM_NORM_ROPE_PAIR; the output gate in the split combine,
# TANDEM_COMBINE_GATE).
#   bash scripts/sessions/device_next58.sh release  (carry .whl): the int4 27B
#     step in alternating rounds (ROUNDS, 3) of: HEAD's launches (neither
#     fusion, release 0), the fusions, the fusions with release 1 and 2
#   bash scripts/sessions/device_next58.sh critical  (carry .whl): each mode's
#     critical path (MODES, "0 2") over the headline's bf16 KV at 256 tokens
#   bash scripts/sessions/device_next58.sh tests  (carry .whl): the GPU tests that
#     replay decode graphs with every release mode (bitwise equal logits),
#     and the graph, run-ahead and CUDA GEMV tests with release 2
set -uo pipefail
call=${1:?release, critical or tests}
source scripts/device_env.sh
critical() {  # critical NAME: the step's critical path, bf16 KV over 256 tokens
  STEP_TAIL=0 step "$1" 200 python3 -m bench.profile_step --weights int4 \
    --kv-format bf16 --context 256 --critical-path --top 40
  sed -n '/critical path/,$p' "$OUT/$1.log" | head -45
}
case "$call" in
  release)
    for round in $(seq "${ROUNDS:-3}"); do
      TANDEM_NORM_ROPE_PAIR=0 TANDEM_COMBINE_GATE=0 TANDEM_PDL_RELEASE=0 step_27b s${round}_a_head
      TANDEM_PDL_RELEASE=0 step_27b s${round}_b_fused
      for mode in 1 2; do
        TANDEM_PDL_RELEASE=$mode step_27b s${round}_c_fused_r$mode
      done
    done
    step_cols s ;;
  critical)
    for mode in ${MODES:-0 2}; do TANDEM_PDL_RELEASE=$mode critical critical_r$mode; done ;;
  tests)
    STEP_TAIL=4 step tests_pdl 300 python3 -m pytest -q -p no:cacheprovider tests/test_pdl.py \
      tests/test_fused.py tests/test_attention.py -k "pdl or release or norm_rope or gate"
    TANDEM_PDL_RELEASE=2 STEP_TAIL=4 step tests_r2 400 python3 -m pytest -q -p no:cacheprovider \
      tests/test_cuda_graphs.py tests/test_run_ahead.py tests/test_gemv_cuda.py \
      -k "graph or run_ahead or dependent or chained or epilogue or conv" ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
