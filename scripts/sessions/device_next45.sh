#!/usr/bin/env bash
# One short call (12-04 21:45, 378 s of device time left): why the CUDA
# GEMV's gated-norm and add_rms_norm prologues lose (21:16: 74.9 against
# 8.8 us, 36.3 against 28.1): each build's registers, local and shared
# bytes, blocks an SM and graph time (scripts/sessions/prologue_probe.py),
# then Nsight Compute on the gated build against the plain one.
#   bash scripts/sessions/device_next45.sh   (carry .whl)
set -uo pipefail
source scripts/device_env.sh
STEP_TAIL=14 step probe 90 python3 scripts/sessions/prologue_probe.py
STEP_TAIL=60 step ncu_gated 120 ncu --clock-control none --kernel-name regex:tandem_q4_gemv \
  --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy \
  --section LaunchStats --section WarpStateStats \
  python3 scripts/sessions/prologue_probe.py gated --few
