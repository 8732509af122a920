#!/usr/bin/env bash
# Prefill after the bf16-dot attention tiles, with GDN through fla-core and
# without (issue 6's MFU at 32K), in one call (~7 min): why decode graph
# replays disagreed with eager steps (scripts/device_graphdiag.py); fla's
# chunked rule against ours; the compiled attention tests; rk4p's prefill
# tiles; the 27B prefill at 4K and 32K with and without fla (profiled with).
set -uo pipefail
TANDEM_FLA=1 source scripts/device_env.sh
STEP_TAIL=20 step graphdiag 120 env TANDEM_FLA=0 python3 scripts/device_graphdiag.py
step pytest_gpu 150 python3 -m pytest -q -p no:cacheprovider tests/test_gdn_fla.py \
  tests/test_attention.py tests/test_attention_rk4p.py \
  "tests/test_speculative.py::test_graph_replayed_verify_keeps_greedy_parity_on_cuda"
STEP_TAIL=16 step attention_rk4p 60 python3 -m bench.attention --context 32768 --new 4096 \
  --kv-format rk4p --json "$OUT/attention_rk4p.json"
STEP_TAIL=8 step prefill_torch_gdn 90 env TANDEM_FLA=0 python3 -m bench.prefill \
  --model qwen3.5-27b --device cuda --kv-format int8 --tokens 4096 32768 --chunk 4096 \
  --repeats 1 --json "$OUT/prefill_torch_gdn.json"
STEP_TAIL=40 step prefill_fla 120 env TANDEM_FLA=1 python3 -m bench.prefill \
  --model qwen3.5-27b --device cuda --kv-format int8 --tokens 4096 32768 --chunk 4096 \
  --repeats 1 --profile --json "$OUT/prefill_fla.json"
