#!/usr/bin/env bash
# 12-05 afternoon: the service's CUDA checks after the review's fixes, then
# issue 5's benchmark of record (36 chat / 24 code held-out prompts, decided
# on 12-05) on the H200. Chained calls on one warm machine (it goes back after
# 30 s idle; /tmp survives while it stays warm):
#   bash scripts/sessions/device_next49.sh checks  (carry .whl .device/gguf.part.aa)
#   bash scripts/sessions/device_next49.sh park    (carry .device/gguf.part.ab; the service checks)
#   bash scripts/sessions/device_next49.sh bench   (carry .device/gguf.part.ac)
# checks: the workers' page/slot id checks and the router's fixes through the
#   real service on CUDA (tests/test_service.py, test_service_hybrid.py with
#   TANDEM_TEST_DEVICE=cuda), GPTQ plan-against-load and the graph-replayed
#   verify's greedy parity on CUDA.
# bench: bench.speculative --prompts record (and six, for the old figure) with
#   the shipped head, greedy, k=3; then the embedded model's speculative
#   parity tests on CUDA (the GGUF is whole by then).
set -uo pipefail
call=${1:?checks, park or bench}
source scripts/device_env.sh
park_parts
case "$call" in
  checks)
    STEP_TAIL=6 step pytest_cuda 150 python3 -m pytest -q -p no:cacheprovider \
      tests/test_loading_gptq.py tests/test_speculative.py -k "cuda or plan_counts" ;;
  park)
    [ "${SERVICE:-1}" = 1 ] && STEP_TAIL=6 step service_cuda "${SERVICE_LIMIT:-240}" env TANDEM_TEST_DEVICE=cuda python3 -m pytest -q \
      -p no:cacheprovider tests/test_service.py tests/test_service_hybrid.py ;;
  bench)
    assemble_gguf
    STEP_TAIL=8 step spec_record 300 python3 -m bench.speculative --device cuda \
      --tokens-model embedded --methods none mtp --ks 3 --new-tokens 96 --per-prompt \
      --prompts record --json "$OUT/spec_record.json"
    STEP_TAIL=6 step parity_cuda 200 python3 -m pytest -q -p no:cacheprovider \
      tests/test_speculative.py -k "embedded" ;;
esac
