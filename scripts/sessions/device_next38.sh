#!/usr/bin/env bash
# 2026-12-04 (third) GPU session: chained calls, each within the machine's 30 s
# idle release (/tmp survives between them while it stays warm):
#   bash scripts/sessions/device_next38.sh park   (carry .whl .device/gguf.part.aa)
#   bash scripts/sessions/device_next38.sh park   (carry .whl .device/gguf.part.ab)
#   bash scripts/sessions/device_next38.sh gen    (carry .whl .device/gguf.part.ac .device/mtp_corpus.pt)
#   bash scripts/sessions/device_next38.sh train  (carry .whl)
#   bash scripts/sessions/device_next38.sh bench  (carry .whl)
# gen: the H200 answers every varied prompt the carried corpus lacks (4,000 new
#   chat requests in chat_requests/) and sends the grown corpus back;
# train: a head on all of it, dev-chosen (the 12-04 05:30 plateau: ~9 epochs);
# bench: its H200 benchmark, then interference uncapped and at 70:40 on one host.
# Ran 12-04 11:24-11:38 (BENCHMARKS.md; the benchmark ran by hand, the
# interference had run at 10:55). Next session, with the 8 request files
# written after it: park, park, gen (their ~4,000 answers, ~210 s; a no-op if
# .device/mtp_corpus.pt already holds them), train, then train2 (the same
# corpus for 470 s more from train's head, --init-head, lr 3e-4), bench.
set -uo pipefail
call=${1:?park, gen, train, train2 or bench}
mkdir -p /tmp/gguf && cp .device/gguf.part.* /tmp/gguf/ 2>/dev/null; ls /tmp/gguf
source scripts/device_env.sh
RECIPE=(--samples-per-prompt 1 --new-tokens 160 --varied 100000 --max-prompts 100
        --corpus /tmp/mtp_corpus.pt)
HEAD=engine/heads/smollm2-135m-instruct.q4_1.mtp.safetensors
train_head() {  # train_head NAME [FLAGS...]: a dev-chosen head on the corpus, to $OUT
  STEP_TAIL=12 step "$1" "${TRAIN_LIMIT:-585}" python3 -m tandem.cli train-mtp --device cuda \
    --max-batch 256 "${RECIPE[@]}" --time-budget "${BUDGET:-470}" --dev-every 400 \
    --out /tmp/new_head.safetensors "${@:2}"
  grep -v "train-mtp: step" "$OUT/$1.log" > "$OUT/$1_short.log"
  cp /tmp/new_head.safetensors "$OUT/"
}
case "$call" in
  park) ;;  # only brings its GGUF part to /tmp/gguf
  gen) assemble_gguf
       [ -f /tmp/mtp_corpus.pt ] || cp .device/mtp_corpus.pt /tmp/mtp_corpus.pt
       STEP_TAIL=6 step gen "${GEN_LIMIT:-540}" python3 -m tandem.cli train-mtp --device cuda \
         --max-batch "${GEN_BATCH:-256}" --corpus-only "${RECIPE[@]}"
       cp /tmp/mtp_corpus.pt "$OUT/" ;;
  train) assemble_gguf; train_head train ;;
  train2) assemble_gguf
          cp /tmp/new_head.safetensors /tmp/first_head.safetensors
          train_head train2 --init-head /tmp/first_head.safetensors --lr "${LR:-3e-4}" ;;
  bench) assemble_gguf
         cp /tmp/new_head.safetensors "$HEAD"
         STEP_TAIL=10 step spec_new 220 python3 -m bench.speculative --device cuda \
           --tokens-model embedded --methods none mtp --ks 3 --new-tokens 96 \
           --json "$OUT/spec_new.json"
         # the interference pair (run by hand at 10:55) only when asked: MPS=1
         [ -n "${MPS:-}" ] && SHARES="${SHARES:-100 70:40}" LIMIT=185 DECODE_TOKENS=600 \
           bash scripts/device_mps.sh ;;
esac
