#!/usr/bin/env bash
# The GPU fast path after fusing the small ops (issues 5, 6, 7), in one call
# (~6 min): the compiled tests of every new kernel and of the graph-captured
# decode and verify steps; the 27B-shape decode step (bf16 weights, int8 KV,
# batch 1 and 4 at 4K) with all fused kernels and with none; where the fused
# step's time goes; the int4 step; the k=1..3 verify step against the plain
# step, both replayed from graphs; rk4p's kernels and its 27B step. scripts/device_fused.sh and
# scripts/device_gdn.sh are the per-helper versions with more A/B detail.
set -uo pipefail
source scripts/device_env.sh
step pytest_gpu 170 python3 -m pytest -q -p no:cacheprovider tests/test_fused.py \
  tests/test_gdn_kernels.py tests/test_gdn_batched.py tests/test_cuda_graphs.py tests/test_cuda.py \
  "tests/test_speculative.py::test_graph_replayed_verify_keeps_greedy_parity_on_cuda" \
  tests/test_quant_kernels.py::test_tuned_configs_compute_the_product
M=qwen3.5-27b
step decode_fused 70 python3 -m bench.decode --model $M --device cuda --kv-format int8 \
  --batch 1 4 --context 4096 --steps 24 --json "$OUT/decode_fused.json"
step decode_unfused 70 env TANDEM_FUSED_GDN=0 TANDEM_FUSED_NORMS=0 python3 -m bench.decode \
  --model $M --device cuda --kv-format int8 --batch 1 4 --context 4096 --steps 24 \
  --json "$OUT/decode_unfused.json"
step verify 80 python3 -m bench.speculative --device cuda --verify-model $M --context 4096 \
  --ks 1 2 3 --repeats 20 --json "$OUT/verify.json"
step profile_bf16 60 python3 -m bench.profile_step --weights bf16 --top 20 \
  --json "$OUT/profile_bf16.json"
step quant_int4 60 python3 -m bench.quant --rows 1 --decode-steps 16 --json "$OUT/quant_int4.json"
step pytest_rk4p 60 python3 -m pytest -q -p no:cacheprovider tests/test_kv_rk4p.py \
  tests/test_attention_rk4p.py
step decode_rk4p 60 python3 -m bench.decode --model $M --device cuda --kv-format rk4p \
  --batch 1 --context 4096 --steps 16 --json "$OUT/decode_rk4p.json"
