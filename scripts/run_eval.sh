#!/usr/bin/env bash
# The runs behind docs/history/eval-2026-11.md: flat top-k vs dense on the shipped demo model, on the CPU.
# Usage: scripts/run_eval.sh [OUT_DIR]   (default: eval_results/)
set -euo pipefail
out="${1:-eval_results}"
mkdir -p "$out"
ks=1,4,16,64,256,1024
topk eval --tasks single_needle,multi_key --lengths 4096 --depths 0.1,0.5,0.9 --seeds 2 \
    --strategies flat --k "$ks" --device cpu --fidelity-steps 8 \
    --out "$out/eval_4k.json" --plot "$out/plots_4k" --markdown | tee "$out/eval_4k.txt"
topk eval --tasks single_needle,multi_key --lengths 16384 --depths 0.1,0.5,0.9 --seeds 1 \
    --strategies flat --k "$ks" --device cpu --fidelity-steps 8 \
    --out "$out/eval_16k.json" --plot "$out/plots_16k" --markdown | tee "$out/eval_16k.txt"

# Real models over real text (docs/history/eval-2026-11.md, "Real models"): one prefill per length serves every question.
# Usage: REAL_MODELS="/path/smollm2-135m /path/qwen2.5-coder-0.5b" scripts/run_eval.sh [OUT_DIR]
for m in ${REAL_MODELS:-}; do
    python scripts/measure_real.py --model "$m" --lengths "${REAL_LENGTHS:-4096}" \
        --strategies flat,ivf,hnsw,quest,duo,tokenselect,routed --k 0.5%,1%,2%,5% --questions 1 \
        --device cpu --out-dir "$out/real" | tee "$out/real_$(basename "$m").txt"
done
