#!/usr/bin/env bash
# The weight read-ahead into L2, the prologues' copies through L1, and a
# two-layer head grown from D; chained calls (the machine goes back after
# 30 s idle; /tmp survives while it stays warm). Carry (64 MiB a call with
# the tracked tree's ~16 MB; .whl stays on the machine once carried):
#   bash scripts/sessions/device_next46.sh gemv   (carry .whl .device/gguf.part.aa)
#   bash scripts/sessions/device_next46.sh park   (carry .device/gguf.part.ac .device/corpus.xz)
#   bash scripts/sessions/device_next46.sh train  (carry .device/gguf.part.ab)
#   bash scripts/sessions/device_next39.sh bench
# (.device/corpus.xz: `cat .device/corpus.part0* | xz -9e -T2 > .device/corpus.xz`;
# gguf.part.ab with it is 50 KB over a call's 64 MiB, gguf.part.ac fits)
# gemv: the CUDA GEMV's GPU tests (new: a GEMV that reads the next weight
#   ahead gives the same bits, eager, in a graph and through the model),
#   the prologue probe (the norm weight's cp.async now .ca: GATED ran 74.9 us
#   against 8.8 with .cg at 21:16), bench.gemv_cuda --read-ahead (GEMV pairs
#   with tiny launches between: does the read-ahead shorten the pair, or does
#   the first GEMV's end wait for its prefetch?), then the int4 27B step in ROUNDS (2)
#   alternating rounds: the default, TANDEM_GEMV_L2_PREFETCH_MB 8 / 16 / 32
#   (each projection's GEMV asks L2 for the next one's leading rows after
#   its last tile, so DRAM streams them through the small kernels between),
#   TANDEM_GATED_PROLOGUE=1 and TANDEM_NORM_PROLOGUE=1 (~22 s a run: ~400 s).
# train: from head D (INIT) grown to HEAD_LAYERS decoder layers (default 2:
#   D's layer, then one that starts as an identity, so step 0 is D exactly;
#   HEAD_LAYERS=1 continues D as it is) at LR (default 3e-4) with D's own
#   parameters frozen (INIT_LR_SCALE 0: at 3e-4 the 21:27 run moving D fell
#   from its dev 2.021 to 1.922 by step 400 and peaked at 2.018; frozen, the
#   new layer can only add) on the 149,470-sample corpus (~190 s of reading and features
#   before step 0). The 2-layer head file is ~15 MiB, under what a call
#   returns. Then `device_next39.sh bench` benchmarks /tmp/new_head.
# Ran 12-05 03:20-03:37 (BENCHMARKS.md) with less device time than planned:
# park_parts and the draft-graph tests, park, train, bench, then the int4 step
# A/B of the read-ahead as commands typed into the calls (no prologue runs).
set -uo pipefail
call=${1:?gemv, park or train}
source scripts/device_env.sh
park_parts
case "$call" in
  gemv)
    STEP_TAIL=12 step tests_gemv 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_gemv_cuda.py
    STEP_TAIL=6 step tests_draft_graphs 150 python3 -m pytest -q -x -p no:cacheprovider \
      tests/test_cuda_graphs.py -k draft
    STEP_TAIL=14 step probe 90 python3 scripts/sessions/prologue_probe.py
    STEP_TAIL=12 step ahead 120 python3 -m bench.gemv_cuda --only "gdn out" --read-ahead \
      --json "$OUT/ahead.json"
    for round in $(seq "${ROUNDS:-2}"); do
      step_27b "step_default_$round"
      for mb in 8 16 32; do
        TANDEM_GEMV_L2_PREFETCH_MB=$mb step_27b "step_ahead${mb}_$round"
      done
      TANDEM_GATED_PROLOGUE=1 step_27b "step_gated_$round"
      TANDEM_NORM_PROLOGUE=1 step_27b "step_norm_$round"
    done ;;
  park) ;;
  train)
    train_from_head "${TRAIN_LIMIT:-570}" "${BUDGET:-340}" "${LR:-3e-4}" \
      --head-layers "${HEAD_LAYERS:-2}" --init-lr-scale "${INIT_LR_SCALE:-0}" ;;
esac
