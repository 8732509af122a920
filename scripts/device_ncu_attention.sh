#!/usr/bin/env bash
# Why decode attention at 128K runs at a third of the bandwidth (~4 min;
# carry .whl). The bf16 step grows 14.42 -> 17.41 ms from 4K to 128K with
# int8 KV (2026-12-03) for ~1 ms more of bytes; rk4p's grows ~7.5 ms for
# fewer bytes (12-02 05:13). Static counts (bench.attention_sass) put the
# int8 loop near its I2F rate and the bandwidth share alike, which explains
# ~1.1x, not 3x: so latency (2 programs of 4 warps per SM at 255 / 212
# registers) or something else. Nsight Compute on one decode attention
# launch at 131,072 tokens per format: speed of light, occupancy, warp
# stalls, memory workload. `--clock-control none` (H200.md: leave the
# clocks alone); ncu reads counters on Firecracker hosts only; the first
# step says whether this one does.
set -uo pipefail
source scripts/device_env.sh
for kv in ${KVS:-int8 rk4p}; do  # KVS="rk4 int8": other formats
  STEP_TAIL=60 step ncu_attention_$kv 240 ncu --clock-control none \
    --kernel-name regex:_paged_attention_kernel --launch-skip 40 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section InstructionStats \
    python3 -m bench.decode --model qwen3.5-27b --device cuda --kv-format $kv --batch 1 \
    --context 131072 --steps 4 --no-cuda-graphs
done
