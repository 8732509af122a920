#!/usr/bin/env bash
# Fused norms / activations / rotary on the GPU (issues 6, 7): run from the repo
# root on the device machine with .whl carried (fla_core + einops: the GDN
# layers' CUDA path). In order:
#   1. tests/test_fused.py compiled (TRITON_INTERPRET=0): every kernel against
#      its PyTorch reference in bf16 and fp32, and a tiny Qwen3.5 on CUDA with
#      TANDEM_FUSED_NORMS=1 against =0;
#   2. tests/test_cuda.py: logits on CUDA (fused path, the default) against
#      transformers, and the offline engine; then the kernels one eager decode
#      step of tiny-qwen3.5 launches with and without the fused ops (profiler);
#   3. the 27B dummy decode step, bf16 weights, int8 KV, batch 1 and 4 at 4K,
#      with the fused kernels and without (A/B: the step time and roofline %);
#   4. the 27B int4 decode step (bench.quant), fused and not.
# Logs and JSON under $OUT. About 4-5 minutes; each step has its own limit
# (8 minutes if every one ran to it).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/fla_core*.whl .whl/einops*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
date -u +%FT%TZ | tee "$OUT/date.txt"; git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/date.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/date.txt"
python3 -c "import torch, triton; import importlib.util as u; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', bool(u.find_spec('fla')))"

step() {  # step NAME SECONDS CMD...: run with a limit, keep the log, show its tail
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  tail -n 30 "$OUT/$name.log"; echo "=== $name rc=$rc"
}

step pytest_fused_cuda 90 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider \
  tests/test_fused.py
step pytest_cuda 90 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
step count_kernels 45 env TRITON_INTERPRET=0 python3 scripts/count_kernels.py --model tiny-qwen3.5
M=qwen3.5-27b
for fused in 1 0; do
  step "bench_decode_fused$fused" 75 env TANDEM_FUSED_NORMS=$fused TRITON_INTERPRET=0 \
    python3 -m bench.decode --model $M --device cuda --kv-format int8 --batch 1 4 --context 4096 \
    --steps 24 --json "$OUT/decode_fused$fused.json"
done
for fused in 1 0; do
  step "bench_quant_fused$fused" 60 env TANDEM_FUSED_NORMS=$fused TRITON_INTERPRET=0 \
    python3 -m bench.quant --rows 1 --decode-steps 16 --json "$OUT/quant_fused$fused.json"
done
