#!/usr/bin/env bash
# The product path on the GPU host in one go (docs/EVAL.md): what users run, measured on a real model.
#
#   bash benchmarks/bench_product_gpu.sh MODEL [RES]     # MODEL: a GGUF file or an HF checkpoint directory
#
# Converts a GGUF once (topk_decode.model.gguf), then, in this order:
#   gpu_real      alone: tests/test_gpu_real.py, the real-model GPU tests that gate changes to index/ decode/ prefill/
#                 model/ (first, so that a short device session gets the gate's verdict before anything else)
#   bench         alone: one `topk bench` row on the real checkpoint (its tokens checked against HF dense's)
# then side by side, each in its own process (fidelity does not depend on what else runs; no timing of them is quoted):
#   dense_<len>   dense's answers, once per length (the jobs below take them: `--dense-from`, not asked again)
#   p_<length>    the suite (topk_decode.eval.product): auto, flat at auto's k, auto as placed under Llama-3-8B's
#                 16 GiB budget at 128K, ≥ 100 held-out questions per cell with the defaults below
#   p_seeds_k     the seed strategies (quest, duo, tokenselect, ivf, hnsw) at k = 256 and at auto's read budget
# The whole default run outlasts one 30-minute device session (durations measured: docs/EVAL.md).
# Results go to RES (default ./product-results), one log and one folder per job; SNAP=file.tgz archives RES after
# every job (a run cut short keeps what it measured). `python -m topk_decode.eval.product --merge RES/p_*/product.json
# --out RES/all` tables the suites together. Needs faiss-cpu (routed's codes) and, for a GGUF, gguf.
#
# Environment: LENGTHS (16384,32000), SEEDS (200-202), PER_TASK (7: 5 tasks × 7 × 3 seeds = 105 questions per
# cell), THREADS (CPU threads per job, TOPK_THREADS; default: cores / jobs), JOBS (gpu_real,suite,seeds,bench),
# DEVICE (cuda), TIMEOUT (s per job, 3000), DUO_STEPS (calibrate-duo's steps, 200), PY (python3), REV (the commit
# measured, written to env.txt, where the tree is a copy without its git history).
set -o pipefail
MODEL=${1:?usage: bench_product_gpu.sh MODEL [RES]}
RES=${2:-product-results}
PY=${PY:-python3}
LENGTHS=${LENGTHS:-16384,32000}
SEEDS=${SEEDS:-200-202}
PER_TASK=${PER_TASK:-7}
JOBS=${JOBS:-gpu_real,suite,seeds,bench}
DEVICE=${DEVICE:-cuda}
TIMEOUT=${TIMEOUT:-3000}
mkdir -p "$RES"
RES=$(cd "$RES" && pwd)
export PYTHONUNBUFFERED=1
snap() { if [ -n "$SNAP" ]; then tar czf "$SNAP" -C "$RES" .; fi; }
want() { [[ ",$JOBS," == *",$1,"* ]]; }

{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; echo "commit ${REV:-$(git rev-parse --short HEAD)}"
  date -u; } > "$RES/env.txt" 2>&1
if [[ "$MODEL" == *.gguf ]]; then  # converted once into the user cache; the directory is what every job opens
  MODEL=$($PY -c "import sys; from topk_decode.model.gguf import converted_dir; print(converted_dir(sys.argv[1]))" \
    "$MODEL" 2>>"$RES/convert.log" | tail -1) || { echo "error: converting the GGUF failed (see $RES/convert.log)"; exit 1; }
fi
echo "model: $MODEL" | tee -a "$RES/env.txt"

if want gpu_real; then  # the gate, alone and first
  TOPK_REAL_GGUF="$MODEL" TOPK_REAL_WORK="$RES/work_gpu_real" timeout "$TIMEOUT" $PY -m pytest -m gpu -q -rA \
    tests/test_gpu_real.py -p no:cacheprovider > "$RES/gpu_real.log" 2>&1
  rm -rf "$RES/work_gpu_real"
  snap
fi
if want bench; then  # alone, so its timing means something; k = 256 at 16K as in docs/BENCHMARKS.md
  timeout "$TIMEOUT" $PY -m topk_decode bench --model "$MODEL" --context 16K --systems topk --strategy auto --k 256 \
    --steps 48 --warmup 4 --no-offload-prefill --out "$RES/bench" > "$RES/bench.log" 2>&1
  snap
fi

lengths=${LENGTHS//,/ }
n_jobs=0
want suite && n_jobs=$((n_jobs + $(wc -w <<< "$lengths")))
want seeds && n_jobs=$((n_jobs + 2))
export TOPK_THREADS=${THREADS:-$(( $(nproc) / (n_jobs > 0 ? n_jobs : 1) > 0 ? $(nproc) / (n_jobs > 0 ? n_jobs : 1) : 1 ))}

suite() {  # $1 job name, then the suite's own arguments; dense's answers from the dense jobs where they hold them
  timeout "$TIMEOUT" $PY -m topk_decode.eval.product --model "$MODEL" --device "$DEVICE" --seeds "$SEEDS" \
    --per-task "$PER_TASK" --work "$RES/work_$1" --out "$RES/$1" "${@:2}" ${DENSE_FROM:+--dense-from $DENSE_FROM} \
    > "$RES/$1.log" 2>&1
  rm -rf "$RES/work_$1"
  snap
}
if want suite || want seeds; then  # dense once per length, before the jobs that compare with it
  want suite || lengths=${lengths%% *}  # (the seed strategies run at the first length only)
  for n in $lengths; do suite "dense_$n" --lengths "$n" --settings dense & done
  wait
  DENSE_FROM=$(ls "$RES"/dense_*/product.json 2> /dev/null | tr '\n' ' ')
fi
if want suite; then
  for n in $lengths; do
    suite "p_$n" --lengths "$n" --settings dense,auto,flat --as-budget llama-3-8b@128K:16GiB &
  done
fi
if want seeds; then  # at k = 256 and at auto's read budget: min(4 % of the keys, 16·k) at the first length
  first=${lengths%% *}
  read_k=$(( first * 4 / 100 < 16 * 256 ? first * 4 / 100 : 16 * 256 ))
  (  # duo reads its retrieval heads from a pattern: learned once for the model (`topk calibrate-duo`)
    timeout "$TIMEOUT" $PY -m topk_decode calibrate-duo "$MODEL" --out "$RES/duo_heads.tsv" --device "$DEVICE" --steps "${DUO_STEPS:-200}" \
      > "$RES/calibrate_duo.log" 2>&1
    duo="duo:pattern=$RES/duo_heads.tsv"
    suite p_seeds_256 --lengths "$first" --k 256 --settings "dense,quest,$duo,tokenselect,ivf,hnsw" &
    at="k=$read_k"  # in each setting's name, so that --merge keeps the two k apart
    suite "p_seeds_$read_k" --lengths "$first" \
      --settings "dense,quest:$at,$duo:$at,tokenselect:$at,ivf:$at,hnsw:$at,flat:$at" &
    wait
  ) &
fi
wait
ls "$RES"/p_*/product.json > /dev/null 2>&1 && \
  $PY -m topk_decode.eval.product --merge "$RES"/p_*/product.json --out "$RES/all" > "$RES/all.log" 2>&1
snap
echo "== $RES"
grep -hE "passed|failed" "$RES/gpu_real.log" 2>/dev/null | tail -1
grep -h "tokens" "$RES/bench.log" 2>/dev/null | tail -3
cat "$RES/all/product.md" 2>/dev/null
