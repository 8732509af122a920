#!/usr/bin/env bash
# Issue 7's 24 GiB demonstration with today's defaults, and the multi-layer
# feature probe at scale; chained calls (the machine goes back after 30 s
# idle; /tmp survives while it stays warm). Carry:
#   bash scripts/sessions/device_next48.sh mem    (carry .whl .device/gguf.part.aa)
#   bash scripts/sessions/device_next48.sh park   (carry .device/gguf.part.ac .device/corpus.xz)
#   bash scripts/sessions/device_next48.sh probe  (carry .device/gguf.part.ab)
#   bash scripts/sessions/device_next48.sh ekv    (after probe, same machine)
#   bash scripts/sessions/device_next39.sh bench  (the new head's H200 benchmark)
# mem: scripts/device_memory24.sh (int4, rk4, MTP k=3, 262,144 tokens laid
#   out, --gpu-memory-budget 24GiB, NVML over every process; ~4 min), never
#   run since the CUDA GEMV (NVRTC builds) became the default on 12-04, then
#   the int4 27B step. Any card: the budget is the plan's, not the card's.
#   12-05 05:50 this call was lost with its machine.
# probe: bench.mtp_features on the H200 over SAMPLES (default 20,000) of the
#   149,470-sample corpus, BUDGET (default 150) s a variant: does a fusion of
#   layers 2/15/27 lift head D's depth-1 input past a control that reads the
#   final hidden only? (12-05, CPU, 960 samples: BENCHMARKS.md.) ~3.8M tokens
#   of features, kept in bf16 (hidden and three streams, 4.6 KB a token): ~18 GB.
# ekv: head D continued with --engine-kv (train.EngineKV: deeper drafts
#   attend as the engine's do, the depth-1 keys of verified tokens and the
#   chain's own drafts, not other chains' depth-r keys as every head so far
#   trained) at LR (default 5e-5, G's rate; 3e-4 lost dev chat on a warm
#   restart) for BUDGET (default 340) s; train-mtp's dev figure is the
#   engine's now (EngineKV), so its step-0 reading is D's engine figure.
#   Ship only if the H200 benchmark's chat passes D's 1.95 (docs/MTP_HEAD.md).
set -uo pipefail
call=${1:?mem, park, probe or ekv}
source scripts/device_env.sh
park_parts
case "$call" in
  mem)
    STEP_TAIL=40 step mem24 330 bash scripts/device_memory24.sh
    step_27b int4_step ;;
  park) ;;
  probe)
    assemble_gguf
    STEP_TAIL=12 step probe 560 python3 -m bench.mtp_features --device cuda \
      --corpus /tmp/mtp_corpus.pt --samples "${SAMPLES:-20000}" \
      --time-budget "${BUDGET:-150}" --json "$OUT/probe.json" ;;
  ekv)
    train_from_head "${TRAIN_LIMIT:-570}" "${BUDGET:-340}" "${LR:-5e-5}" --engine-kv ;;
esac
