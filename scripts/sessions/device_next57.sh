#!/usr/bin/env bash
# 12-06 (third session): the decode attention at short contexts, where a 4K
# attention layer costs ~25 us of latency for ~2 us of KV bytes.
#   bash scripts/sessions/device_next57.sh sweep  (carry .whl): decode attention
#     + split combine alone at 4K (int8, the 27B's shape) in CUDA graphs of 20
#     launches, by tiles and key splits, the combine by columns a program;
#     the same at 32K / 128K for the candidates that win; Nsight Compute on
#     one 4K attention launch and one combine (11:21, H100: the default tiles
#     12.2 us a layer with the combine, (16, 32, 4, 1) 10.1, 32 combine
#     columns 10.0; the attention alone 14.1 us under ncu at 255 registers
#     with spills, 2 programs an SM, ~19 instructions per K/V element)
#   bash scripts/sessions/device_next57.sh codes  (carry .whl): int8 codes in the
#     dots with the scales outside (TANDEM_INT8_CODES_DOT=1) against the
#     dequantized tiles at 4K, 32K, 128K; ncu on its 4K launch; the int4
#     27B step both ways, alternating (11:31, H100: the codes' variant failed
#     to compile, a constexpr if without else; the step, bf16 KV at 256
#     tokens, does not run int8 attention: 6.62-6.63 ms both ways)
#   bash scripts/sessions/device_next57.sh codes2  (carry .whl): the codes in
#     the dots at 4K, 32K and 128K against the dequantized tiles; Nsight
#     Compute on its 4K launch; the headline step's own attention (bf16 KV
#     over 256 tokens) by tiles and splits, and its critical path (11:38, H100:
#     codes in the dots 4K 11.3 / 32K 46.2 / 128K 150.1 us against 12.2 /
#     51.8 / 172.8, 202 registers; the headline step's attention chain spends
#     ~5 us a layer in torch's two scatters of the bf16 KV write)
#   bash scripts/sessions/device_next57.sh ab  (carry .whl): the int4 27B step of
#     this tree (one dependent launch for the bf16 KV write, int8 codes in the
#     dots) against HEAD's (a worktree), alternating, and this tree's
#     critical path (11:48 and 12:01, two H100 starts: 6.42-6.44 ms against
#     HEAD's 6.50-6.52, four pairs; the write's hop 1.1 us a layer)
#   bash scripts/sessions/device_next57.sh int8  (carry .whl; next session): the
#     bf16-weight 27B step over int8 KV at 4K and 128K (issue 6's rows) with
#     int8's codes in the dots and without, alternating
#   bash scripts/sessions/device_next57.sh tests  (carry .whl): the GPU tests
#     of the changed kernels and of the engine on CUDA (11:48, H100: the
#     step 6.42-6.43 ms against HEAD's 6.50-6.52 in two pairs, the write's
#     hop 1.1 us a layer where torch's two scatters took ~5; 11:50: 65
#     passed, then the codes test's fp32 case held tf32 to 2**-10: 3.3e-3)
set -uo pipefail
call=${1:?sweep, codes, codes2, ab, int8 or tests}
source scripts/device_env.sh
attn() {  # attn NAME ARGS...: bench.attention for one query token in graphs of 20
  STEP_TAIL=60 step "$1" 300 python3 -m bench.attention --new 1 --graph 20 --repeats 20 \
    --kv-format int8 "${@:2}"
}
ncu_codes() {  # Nsight Compute on one 4K int8 attention launch with the codes in the dots
  TANDEM_INT8_CODES_DOT=1 STEP_TAIL=0 step ncu_codes 200 ncu --clock-control none \
    --kernel-name regex:_paged_attention_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats python3 -m bench.attention --new 1 --context 4096 \
    --kv-format int8 --candidates 19 --splits 64 --repeats 5
  grep -e Duration -e "Registers Per" -e Spilling -e "Issued Warp" -e "Block Limit Reg" \
    "$OUT/ncu_codes.log"
}
case "$call" in
  sweep)
    attn a4k --context 4096 --candidates 19 26 27 28 29 30 31 32 33 --splits 16 32 64 128
    for cols in 128 64 32; do
      TANDEM_COMBINE_COLS=$cols attn c4k_$cols --context 4096 --candidates 19 26 --splits 32 64
    done
    TANDEM_PDL=0 attn n4k --context 4096 --candidates 19 26 --splits 16 32 64
    attn a32k --context 32768 131072 --candidates 19 26 28 --splits 32 64
    ncu_one() {  # ncu_one NAME KERNEL_REGEX
      STEP_TAIL=80 step "$1" 200 ncu --clock-control none --kernel-name "regex:$2" \
        --launch-skip 3 --launch-count 1 --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
        --section SchedulerStats \
        python3 -m bench.attention --new 1 --context 4096 --kv-format int8 --candidates 19 \
        --splits 64 --repeats 5
    }
    ncu_one ncu_attn _paged_attention_kernel
    ncu_one ncu_combine _combine_splits_kernel ;;
  codes)
    TANDEM_INT8_CODES_DOT=1 attn k4k --context 4096 --candidates 19 26 29 33 31 32 --splits 32 64
    attn d4k --context 4096 --candidates 19 33 --splits 64
    TANDEM_INT8_CODES_DOT=1 attn klong --context 32768 131072 --candidates 19 26 --splits 64
    ncu_codes
    for round in 1 2; do
      step_27b s${round}_a_default
      TANDEM_INT8_CODES_DOT=1 step_27b s${round}_b_codes
    done
    step_cols s ;;
  codes2)
    for ctx in 4096 32768 131072; do
      attn d$ctx --context $ctx --candidates 19 33 31 --splits 64
      TANDEM_INT8_CODES_DOT=1 attn k$ctx --context $ctx --candidates 19 33 31 26 --splits 64
    done
    grep -h "int8 " "$OUT"/d*.log "$OUT"/k*.log > "$OUT/codes_all.txt"
    ncu_codes | tee -a "$OUT/codes_all.txt"
    STEP_TAIL=30 step b256 300 python3 -m bench.attention --new 1 --graph 20 --repeats 20 \
      --kv-format bf16 --context 256 --candidates 19 33 26 --splits 4 8 16
    STEP_TAIL=0 step critical256 200 python3 -m bench.profile_step --weights int4 \
      --kv-format bf16 --context 256 --critical-path --top 40
    sed -n '/critical path/,$p' "$OUT/critical256.log" | head -60 ;;
  ab)
    [ -d /tmp/base ] || git worktree add -f /tmp/base "${BASE:-HEAD}" > /dev/null 2>&1
    base() {  # base NAME: HEAD's step, from its worktree
      (cd /tmp/base && OUT=$OUT PYTHONPATH=/tmp/base:/tmp/site step_27b "$1")
    }
    for round in 1 2; do
      step_27b s${round}_a_tree
      base s${round}_b_head
    done
    step_cols s
    STEP_TAIL=0 step critical 200 python3 -m bench.profile_step --weights int4 \
      --kv-format bf16 --context 256 --critical-path --top 40
    sed -n '/critical path/,$p' "$OUT/critical.log" | grep -e dense -e index -e attention \
      -e norm_rope -e "critical path" ;;
  int8)  # ROUNDS=2 for a second pair (each run loads the 54 GB dummy weights)
    for round in $(seq "${ROUNDS:-1}"); do
      for codes in 1 0; do
        TANDEM_INT8_CODES_DOT=$codes STEP_TAIL=6 step i${round}_codes$codes 280 \
          python3 -m bench.decode --model qwen3.5-27b --device cuda --kv-format int8 \
          --context 4096 131072 --steps 16
      done
    done ;;
  tests)
    STEP_TAIL=4 step tests_attention 250 python3 -m pytest -q -p no:cacheprovider \
      tests/test_attention.py -k "codes or int8"
    STEP_TAIL=4 step tests_engine 300 python3 -m pytest -q -p no:cacheprovider \
      tests/test_kv_formats.py tests/test_cuda_graphs.py tests/test_run_ahead.py \
      tests/test_cuda.py::test_cuda_engine_matches_cpu_engine_greedy ;;
  *) echo "unknown call $call"; exit 2 ;;
esac
