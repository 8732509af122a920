#!/usr/bin/env bash
# 2026-12-03 evening: the MTP head on 3,000 more natural chat requests
# (engine/speculative/chat_requests/*.txt, six subject domains), three chained
# calls, each carrying one part of the embedded GGUF; the calls must follow each
# other within the machine's 30 s idle release:
#   bash scripts/sessions/device_next35.sh 1   (carry .device/gguf.part.aa)
#   bash scripts/sessions/device_next35.sh 2   (carry .device/gguf.part.ab)
#   bash scripts/sessions/device_next35.sh 3   (carry .device/gguf.part.ac .device/mtp_corpus.pt .whl)
# Calls 1-2 only park their part (the session had ~950 s of device time for all
# three). The CPU answered most of the new prompts beforehand (fp32 greedy, into
# .device/mtp_corpus.pt, the cache train-mtp --corpus reads), so call 3 spends its
# time training: every varied prompt (6,856 with the files), one greedy answer of
# 160 tokens each, a fresh head for BUDGETS s, then the GPU benchmark at k=3.
# Ran 12-03 22:42 with BUDGETS=320: training and the held-out measure fit, the
# benchmark did not (600 s limit); measure heads in a call of their own
# (device_next36.sh call 3).
set -uo pipefail
call=${1:?call 1, 2 or 3}
mkdir -p /tmp/gguf && cp .device/gguf.part.* /tmp/gguf/ && ls -la /tmp/gguf
[ "$call" = 3 ] || exit 0
VARIED=${VARIED:-8000} BUDGETS=${BUDGETS:-300} DEADLINE=${DEADLINE:-560} \
  bash scripts/device_chain_mtp.sh 3
