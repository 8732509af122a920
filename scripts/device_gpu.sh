#!/usr/bin/env bash
# GPU fast path on the device machine (run from the repo root, .whl carried
# with fla_core-0.6.0-py3-none-any.whl in it): the kernel, GDN and CUDA-graph
# tests compiled for the GPU, then every `tandem bench` on the Qwen3.5-27B
# dummy shape at small-but-meaningful settings. Tables on stdout, JSON and
# logs under $OUT. Each step has its own time limit so the whole run stays
# under ~8 minutes and one failure does not hide the rest.
set -uo pipefail
source scripts/device_env.sh
python3 -c "import torch, triton; import importlib.util as u; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', bool(u.find_spec('fla')))"


step pytest_gpu 120 python3 -m pytest -q -p no:cacheprovider -x tests/test_attention.py \
  tests/test_gdn_batched.py tests/test_cuda_graphs.py tests/test_cuda.py
M=qwen3.5-27b
step bench_decode 70 python3 -m bench.decode --model $M --device cuda --kv-format rk4 \
  --batch 1 4 --context 4096 --steps 24 --json "$OUT/decode.json"
step bench_decode_long 50 python3 -m bench.decode --model $M --device cuda --kv-format rk4 \
  --batch 1 --context 131072 --steps 16 --json "$OUT/decode_128k.json"
step bench_prefill 60 python3 -m bench.prefill --model $M --device cuda --kv-format rk4 \
  --tokens 4096 32768 --chunk 4096 --repeats 1 --json "$OUT/prefill.json"
step bench_agent_loop 80 python3 -m bench.agent_loop --model $M --device cuda --kv-format rk4 \
  --turns 8 --new-tokens 1024 --output-tokens 16 --max-context-tokens 32768 --json "$OUT/agent.json"
step bench_interference 70 python3 -m bench.interference --model $M --device cuda --kv-format rk4 \
  --prefill-tokens 32768 --prefill-chunk 2048 --decode-tokens 400 --json "$OUT/interference.json"
step bench_memory 50 python3 -m bench.memory --model $M --device cuda --kv-format rk4 \
  --max-context-tokens 262144 --prompt-tokens 8192 --new-tokens 64 --json "$OUT/memory.json"
