#!/usr/bin/env bash
# Three chained calls that bring the embedded GGUF (98 MB, split in
# .device/gguf.part.a{a,b,c}) to the device machine for the MTP head's
# training, each call carrying `.whl` and one part; the first two give the
# machine real work meanwhile (it is released after 30 s idle, and /tmp with it):
#   bash scripts/device_chain_mtp.sh 1 bash scripts/sessions/device_next27.sh      (part aa)
#   bash scripts/device_chain_mtp.sh 2 env KV=rk4 PROFILE_EVERY=10 \
#     bash scripts/device_agent_loop.sh                                   (part ab)
#   bash scripts/device_chain_mtp.sh 3                                    (part ac)
# Call 3 runs scripts/device_mtp.sh. A corpus carried in .device/mtp_corpus.pt
# (an earlier call 3's, returned in $OUT) is a cache: only prompts it lacks
# are answered (train-mtp --corpus), so the call's time goes to training.
# 2026-12-03 14:21: VARIED=5000 BUDGETS=270 (all 1,021 natural chat requests;
# 1,536 answers came from the CPU, 2,420 generated in the call: 161 s).
set -uo pipefail
call=${1:?call 1, 2 or 3}; shift
mkdir -p /tmp/gguf && cp .device/gguf.part.* /tmp/gguf/ && ls /tmp/gguf
case "$call" in
  1|2) "$@" ;;
  3)
    [ -f .device/mtp_corpus.pt ] && cp .device/mtp_corpus.pt /tmp/mtp_corpus.pt
    VARIED=${VARIED:-4000} MAX_PROMPTS=${MAX_PROMPTS:-100} SAMPLES=${SAMPLES:-1} NEW=${NEW:-160} \
      BUDGETS=${BUDGETS:-340} OLD_HEAD=0 METHODS=mtp KS=3 CORPUS=/tmp/mtp_corpus.pt \
      bash scripts/device_mtp.sh
    cp /tmp/mtp_corpus.pt "$OUT/" 2>/dev/null
    ;;
esac
