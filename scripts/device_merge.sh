#!/usr/bin/env bash
# Merged input projections on the GPU (MLP gate_up_proj, attention qkv_proj,
# GDN in_proj: one weight launch where the model made 2-4), from the repo
# root on the device machine, .whl carried (only the test step needs more
# than torch/triton). In order:
#   1. the compiled GEMV tests (tests/test_quant_kernels.py -k gemv): every
#      kernel against its reference, the TUNED configs, merged packed parts
#      against the parts, and the 27B merged widths (gate_up N=34816, attn
#      qkv N=14336, gdn in_proj N=16480, K=5120) on the heuristic's configs;
#   2. tests/test_cuda.py: the merged model on CUDA (fused strided silu_mul /
#      gated norm included) against transformers, and the offline engine;
#   3. the 27B dummy decode step, bf16 weights, int8 KV, batch 1 and 4 at 4K;
#   4. bench.quant rows 1: every 27B GEMV shape (merged ones and the parts
#      they replaced), the merged-vs-parts table, and the 27B int4 decode step.
# Logs and JSON under $OUT. About 4-5 minutes; 6 at worst (step limits).
set -uo pipefail
source scripts/device_env.sh
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

step pytest_gemv_cuda 120 python3 -m pytest -q -p no:cacheprovider tests/test_quant_kernels.py -k gemv
step pytest_cuda 75 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
step bench_decode_bf16 75 python3 -m bench.decode --model qwen3.5-27b --device cuda \
  --kv-format int8 --batch 1 4 --context 4096 --steps 24 --json "$OUT/decode_bf16.json"
STEP_TAIL=40 step bench_quant 90 python3 -m bench.quant --rows 1 --decode-steps 16 \
  --json "$OUT/quant.json"
