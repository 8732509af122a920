#!/usr/bin/env bash
# 2026-12-04 GPU session: four chained calls (each within the machine's 30 s
# idle release; /tmp survives between them while it stays warm):
#   bash scripts/sessions/device_next37.sh 1   (carry .whl .device/gguf.part.aa)
#   bash scripts/sessions/device_next37.sh 2   (carry .whl .device/gguf.part.ab)
#   bash scripts/sessions/device_next37.sh 3   (carry .whl .device/gguf.part.ac .device/mtp_corpus.pt)
#   bash scripts/sessions/device_next37.sh 4   (carry .whl)
# 1-2: tandem's prefill and transformers' on one host (device_next36.sh calls 1-2).
# 3: an MTP head on --varied 9000 (the 1,280 code-task prompts' answers came
#    from the CPU into the carried corpus), measured on the dev answers every
#    400 steps and the best head kept (train-mtp --dev-every); left in /tmp.
# 4: the H200 benchmark of call 3's head and of the shipped one (12-03 22:42).
# Ran 12-04 03:35-04:07 (BENCHMARKS.md). "park" only brings a part. Next session
# (train-mtp's start-up is ~35 s now, so training and benchmark fit one call):
#   park (aa), park (ab), then BUDGET=340 TRAIN_LIMIT=440 BENCH_NEW=1 ... 3 (ac + corpus)
set -uo pipefail
call=${1:?call 1, 2, 3 or 4}
mkdir -p /tmp/gguf && cp .device/gguf.part.* /tmp/gguf/ 2>/dev/null; ls /tmp/gguf
source scripts/device_env.sh
spec_bench() {  # spec_bench NAME: the benchmark at k=3 with the head now in engine/heads
  STEP_TAIL=10 step "spec_$1" 220 python3 -m bench.speculative --device cuda \
    --tokens-model embedded --methods $METHODS --ks 3 --new-tokens 96 --json "$OUT/spec_$1.json"
}
HEAD=engine/heads/smollm2-135m-instruct.q4_1.mtp.safetensors
case "$call" in
  park) ;;  # only brings its GGUF part to /tmp/gguf
  1) STEP_TAIL=8 step prefill_tandem 200 python3 -m bench.prefill --model qwen3.5-27b \
       --device cuda --kv-format rk4 --tokens 4096 32768 --chunk 4096 --repeats 1 ;;
  2) STEP_TAIL=8 step transformers_floor 280 python3 -m bench.transformers_floor \
       --prompt-tokens 4096 32768 101000 --new-tokens 8 --json "$OUT/transformers_floor.json" ;;
  3) assemble_gguf
     cp .device/mtp_corpus.pt /tmp/mtp_corpus.pt
     STEP_TAIL=12 step train "${TRAIN_LIMIT:-540}" python3 -m tandem.cli train-mtp --device cuda --max-batch 128 \
       --samples-per-prompt 1 --new-tokens 160 --varied 9000 --max-prompts 100 \
       --time-budget "${BUDGET:-300}" --dev-every 400 --corpus /tmp/mtp_corpus.pt \
       --out /tmp/new_head.safetensors
     grep -v "train-mtp: step" "$OUT/train.log" > "$OUT/train_short.log"
     cp /tmp/new_head.safetensors "$OUT/"
     if [ -n "${BENCH_NEW:-}" ]; then cp /tmp/new_head.safetensors "$HEAD"; METHODS="none mtp" spec_bench new; fi ;;
  4) assemble_gguf
     METHODS="none mtp" spec_bench shipped
     cp /tmp/new_head.safetensors "$HEAD" && METHODS=mtp spec_bench new ;;
esac
