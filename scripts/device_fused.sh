#!/usr/bin/env bash
# Fused norms / activations / rotary on the GPU (issues 6, 7): run from the repo
# root on the device machine with .whl carried. In order:
#   1. tests/test_fused.py compiled: every kernel against its PyTorch reference
#      in bf16 and fp32, and a tiny Qwen3.5 on CUDA with TANDEM_FUSED_NORMS=1
#      against =0;
#   2. tests/test_cuda.py: logits on CUDA (the fused path, the default)
#      against transformers, and the offline engine;
#   3. the 27B dummy decode step, bf16 weights, int8 KV, batch 1 and 4 at 4K,
#      with the fused kernels and without (A/B: step ms and roofline %);
#   4. where the fused bf16 step's time goes (bench.profile_step: launches and
#      ms by kind, to set beside BENCHMARKS.md's 6,166-launch profile);
#   5. the 27B int4 decode step (bench.quant --rows 1), fused and not.
# Logs and JSON under $OUT. About 5-6 minutes; each step has its own limit.
set -uo pipefail
source scripts/device_env.sh
python3 -c "import torch, triton; import importlib.util as u; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', bool(u.find_spec('fla')))"


step pytest_fused_cuda 90 python3 -m pytest -q -p no:cacheprovider tests/test_fused.py
step pytest_cuda 90 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
M=qwen3.5-27b
for fused in 1 0; do
  step "bench_decode_fused$fused" 75 env TANDEM_FUSED_NORMS=$fused python3 -m bench.decode \
    --model $M --device cuda --kv-format int8 --batch 1 4 --context 4096 --steps 24 \
    --json "$OUT/decode_fused$fused.json"
done
step profile_bf16_fused1 90 env TANDEM_FUSED_NORMS=1 python3 -m bench.profile_step --weights bf16 \
  --top 20 --json "$OUT/profile_bf16_fused1.json"
for fused in 1 0; do
  step "bench_quant_fused$fused" 60 env TANDEM_FUSED_NORMS=$fused python3 -m bench.quant --rows 1 \
    --decode-steps 16 --json "$OUT/quant_fused$fused.json"
done
