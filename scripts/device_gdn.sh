#!/usr/bin/env bash
# Fused Gated DeltaNet steps and the graph-captured speculative verify (issues
# 6, 5, 7) on the device machine, from the repo root; installs nothing (torch,
# triton and transformers are there; the 27B dummy weights are made on the
# device). In order, each step with its own time limit:
#   1. tests/test_gdn_kernels.py compiled (TRITON_INTERPRET=0): conv and
#      recurrence kernels vs their references, and the model's fused path vs
#      the old CUDA path (TANDEM_FUSED_GDN=0);
#   2. the CUDA tests of the GDN paths, CUDA graphs (decode and verify replay
#      vs eager) and the engine, and speculative greedy parity with replayed
#      verify graphs;
#   3. the 27B-shape decode step (int8 KV, batch 1 and 4, 4K context, CUDA
#      graphs) with the fused GDN steps on and off;
#   4. the 27B-shape verify step for k=1..3 vs the plain decode step, both
#      replayed from graphs (goal: k=3 <= 1.15x); then the old path's k=3
#      (TANDEM_FUSED_GDN=0: verify runs eagerly) for comparison.
# Logs and JSON under $OUT. Typical ~5-6 minutes; the limits add up to 9.5.
set -uo pipefail
source scripts/device_env.sh
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"


step pytest_gdn_kernels 100 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider \
  tests/test_gdn_kernels.py
step pytest_gpu 140 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider \
  tests/test_gdn_batched.py tests/test_cuda_graphs.py tests/test_cuda.py \
  "tests/test_speculative.py::test_graph_replayed_verify_keeps_greedy_parity_on_cuda"
M=qwen3.5-27b
step bench_decode_fused 80 env TANDEM_FUSED_GDN=1 python3 -m bench.decode --model $M \
  --device cuda --kv-format int8 --batch 1 4 --context 4096 --steps 24 \
  --json "$OUT/decode_fused.json"
step bench_decode_unfused 80 env TANDEM_FUSED_GDN=0 python3 -m bench.decode --model $M \
  --device cuda --kv-format int8 --batch 1 4 --context 4096 --steps 24 \
  --json "$OUT/decode_unfused.json"
step bench_verify_fused 90 env TANDEM_FUSED_GDN=1 python3 -m bench.speculative --device cuda \
  --verify-model $M --context 4096 --ks 1 2 3 --repeats 20 --json "$OUT/verify_fused.json"
step bench_verify_unfused 70 env TANDEM_FUSED_GDN=0 python3 -m bench.speculative --device cuda \
  --verify-model $M --context 4096 --ks 3 --repeats 5 --json "$OUT/verify_unfused.json"
