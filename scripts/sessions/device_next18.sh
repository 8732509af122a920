#!/usr/bin/env bash
# Next GPU session, first call (~9 min; carry .whl). After 12-02 22:08:
#  1. issue 7's 24 GiB demonstration, which regressed to 0.58 / 0.09 GiB spare
#     (20:33) and whose 21:58 re-run was void (the dense GEMV's default
#     dequantized the int4 head per call; fixed since). Since 20:33 the
#     decode warm-up prefills in the fused GDN steps' chunks (no fla autotune
#     in the decode worker) and the prefill worker empties its cache after
#     its warm-up. The worker lines ("[decode] ... reserve", "[prefill] ...")
#     say where each process's PyTorch reserve peaked: compare with the
#     plan's "decode activations" / "cuda graphs" / "activation reserve";
#  2. the int4 step with the fixed default (no head swap: must be ~7.0-7.3 ms,
#     as at 20:33), and the bf16 step at 4K / 128K with the Triton GEMV by
#     default (20:33: 14.53-14.78 / 17.51-17.70 ms) and TANDEM_DENSE_GEMV=0;
#  3. the uncapped solo prefill beside MPS 70% (SHARES="100 70"), so the
#     interference goal's "solo" can be read both ways.
# Then: the rk4p lines of device_next13.sh's header (prefill at 99K, agent
# loop), bench.profile_step --weights int4 with TANDEM_PDL=0, and the
# embedded MTP with the GGUF in three chained calls.
set -uo pipefail
M=qwen3.5-27b
bash scripts/device_memory24.sh
source scripts/device_env.sh
STEP_TAIL=1 step int4_warm 120 python3 -m bench.quant --rows 1 --only lm_head --decode-steps 16
STEP_TAIL=1 step int4_step 70 python3 -m bench.quant --rows 1 --only lm_head --decode-steps 16
for d in "" 0; do
  STEP_TAIL=3 step bf16_dense${d:-default} 90 env TANDEM_DENSE_GEMV=$d python3 -m bench.decode \
    --model $M --device cuda --kv-format int8 --batch 1 --context 4096 131072 --steps 16
done
SHARES="100" bash scripts/device_mps.sh
# more than the 8 files a call brings back: one archive
tar czf /tmp/next18.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/next18.tgz "$OUT/"
