#!/usr/bin/env bash
# The fidelity suite (docs/history/eval-2026-11.md) sharded over the GPUs of one host: one scripts/measure_real.py per GPU, the
# contexts (seeds) split among them, each process pinned to its share of the cores; then the paired table of all the
# shards (scripts/pool_suite.py). Without a GPU it runs one shard on the CPU. Run from the repo root:
#   bash scripts/device_suite.sh MODEL LENGTH FIRST_SEED SEEDS OUT_DIR [measure_real.py options ...]
#   bash scripts/device_suite.sh Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf 16384 10 14 suite16k --questions 3 \
#       --tasks real_needle,real_multi_key,real_qa --k 1% --fidelity-steps 0 --duo-steps 0 \
#       --strategies routed:rank=keys:pq_values=32
# A .gguf model is converted once before the shards start. Each shard writes OUT_DIR/seedsA-B/ and its log
# OUT_DIR/seedsA-B.log; the exit status is non-zero if any shard failed.
set -euo pipefail
if [ $# -lt 5 ]; then
    echo "usage: $0 MODEL LENGTH FIRST_SEED SEEDS OUT_DIR [measure_real.py options ...]" >&2
    exit 2
fi
model=$1 length=$2 first=$3 seeds=$4 out=$5
shift 5
PY=${PY:-python3}
gpus=$($PY -c "import torch; print(torch.cuda.device_count())")
shards=$((gpus > 0 ? gpus : 1))
cores=$(nproc)
per=$((cores / shards > 0 ? cores / shards : 1))
mkdir -p "$out"
$PY -c "import sys; from topk_decode.model.gguf import converted_dir, is_gguf_file
if is_gguf_file(sys.argv[1]): converted_dir(sys.argv[1])" "$model"
export PYTHONUNBUFFERED=1
pids=()
for ((g = 0; g < shards; g++)); do
    a=$((first + seeds * g / shards))
    b=$((first + seeds * (g + 1) / shards))
    ((b > a)) || continue
    name="seeds$a-$((b - 1))"
    device=$([ "$gpus" -gt 0 ] && echo cuda || echo cpu)
    CUDA_VISIBLE_DEVICES=$g TOPK_THREADS=$per NUMBA_NUM_THREADS=$per \
        taskset -c "$((g * per))-$((g * per + per - 1))" \
        $PY scripts/measure_real.py --model "$model" --lengths "$length" --first-seed "$a" --seeds "$((b - a))" \
        --threads "$per" --device "$device" --out-dir "$out/$name" "$@" >"$out/$name.log" 2>&1 &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
$PY scripts/pool_suite.py "$out"/seeds*/*_"$length".json || rc=1
exit $rc
