#!/usr/bin/env bash
# The GPU-host benchmark behind docs/BENCHMARKS.md. Run from the repo root on the GPU machine:
#   bash benchmarks/bench_gpu_host.sh 1    # Llama-3-8B 32K/128K: top-k vs HF dense vs HF offloaded, prefill vs HF, search floor
#   bash benchmarks/bench_gpu_host.sh 2    # 512K / 1M: Llama-3-8B and Qwen2.5-7B on synthetic KV; Llama-3.2-1B 32K/128K
#   bash benchmarks/bench_gpu_host.sh all  # 1 then 2
#   bash benchmarks/bench_gpu_host.sh nographs  # Llama-3-8B top-k rows without CUDA graphs (the comparison)
#   bash benchmarks/bench_gpu_host.sh scan      # DRAM floor vs flat / routed scan per layer (Llama-3-8B at 128K)
#   bash benchmarks/bench_gpu_host.sh scan1m    # the same at Qwen2.5-7B's shape at 1M
#   bash benchmarks/bench_gpu_host.sh routed    # flat and routed side by side: Llama-3-8B 128K (prefill KV)
#   bash benchmarks/bench_gpu_host.sh routed1m  # routed at Qwen2.5-7B 1M (synthetic KV)
#   bash benchmarks/bench_gpu_host.sh device    # routed with routing on the GPU (index/routed/device.py): its GPU tests, then
#                                          # flat and routed beside HF dense at 32K/128K
#   bash benchmarks/bench_gpu_host.sh device_cpu  # the CPU side alone at 128K, CPU- vs device-routed (bench_step_cpu.py)
# The phases of the dated runs that decided a default (flat_ab, dots_*, fused, huge, team, threads, parts, scan32,
# route) are in this script's history, as scripts/device_bench.sh until 21fad64 (docs/BENCHMARKS.md names each run's
# commit; docs/history/README.md lists the scripts removed).
# Results (JSON, PNG, logs) go to $RES (default ./bench-results); with SNAP=file.tgz the folder is also
# archived there after every step (a run cut short keeps what it measured). Needs faiss-cpu, typer, rich.
set -o pipefail
OUT=${RES:-bench-results}
mkdir -p "$OUT"
snap() { if [ -n "$SNAP" ]; then tar czf "$SNAP" -C "$OUT" .; fi; }
trap snap EXIT
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
phase=${1:-1}
budget=${GPU_BUDGET:-16GiB}
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; free -g; $PY -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.get_num_threads())"; } 2>&1 | tee "$OUT/env_$phase.txt"
if [ "$phase" = 1 ] || [ "$phase" = all ]; then
  $PY -m topk_decode bench --model llama-3-8b --context 32K,128K --gpu-memory "$budget" --k 1024 --steps 16 \
      --out "$OUT" 2>&1 | tee "$OUT/log_llama8b.txt"; snap
fi
if [ "$phase" = 1 ] || [ "$phase" = all ]; then
  $PY -m topk_decode.bench.search 131072 2>&1 | tee "$OUT/search_floor.txt"; snap
fi
if [ "$phase" = 2 ] || [ "$phase" = all ]; then
  $PY -m topk_decode bench --model qwen2.5-7b --context 1M --gpu-memory "$budget" --k 1024 --steps 4 --warmup 1 \
      --no-offload-prefill --out "$OUT" 2>&1 | tee "$OUT/log_qwen7b.txt"; snap
  $PY -m topk_decode bench --model llama-3-8b --context 512K,1M --gpu-memory "$budget" --k 1024 --steps 4 --warmup 1 \
      --no-offload-prefill --out "$OUT/long" 2>&1 | tee "$OUT/log_llama8b_long.txt"; snap
  $PY -m topk_decode bench --model llama-3.2-1b --context 32K,128K --gpu-memory "$budget" --k 1024 --steps 16 \
      --out "$OUT" 2>&1 | tee "$OUT/log_llama1b.txt"; snap
fi
if [ "$phase" = scan ]; then
  $PY benchmarks/bench_scan.py --n 131072 --kv-heads 8 --group 4 --k 1024 --probe-fraction 0.04 0.02 --profile --layers 32 \
      --out "$OUT/scan_bandwidth.jsonl" 2>&1 | tee "$OUT/log_scan.txt"; snap
fi
if [ "$phase" = scan1m ]; then
  $PY benchmarks/bench_scan.py --n 1048576 --kv-heads 4 --group 7 --k 1024 --probe-fraction 0.02 --skip dram \
      --out "$OUT/scan_bandwidth.jsonl" 2>&1 | tee "$OUT/log_scan1m.txt"; snap
fi
# Through run_bench directly (no CLI): the same as `topk bench --strategy flat,routed --systems topk ...`.
bench() {  # model contexts strategies steps extra-python-kwargs
  $PY -c "from topk_decode.bench.run import BenchConfig, run_bench
run_bench(BenchConfig(model='$1', contexts=[$2], systems=['topk'], strategy='$3', steps=$4, warmup=2,
                      gpu_memory=int('${budget%GiB}') << 30, offload_prefill=False, out='$OUT/routed', $5))"
}
if [ "$phase" = routed ]; then
  bench llama-3-8b 131072 flat,routed 8 "" 2>&1 | tee "$OUT/log_routed_llama8b.txt"; snap
fi
if [ "$phase" = routed1m ]; then
  bench qwen2.5-7b 1048576 routed 8 "strategy_options={'probe_fraction': 0.02, 'store_values': False}" \
      2>&1 | tee "$OUT/log_routed_qwen7b.txt"; snap
fi
if [ "$phase" = device ]; then
  $PY -m pytest -q -m gpu tests/test_routed_device.py tests/test_host_embedding.py 2>&1 | tail -3 \
      | tee "$OUT/log_device_tests.txt"
  $PY -m topk_decode bench --model llama-3-8b --context 32K,128K --gpu-memory "$budget" --k 1024 --steps 16 \
      --strategy flat,routed --systems topk,hf-dense --no-offload-prefill --out "$OUT/device" 2>&1 \
      | tee "$OUT/log_device.txt"; snap
fi
if [ "$phase" = device_cpu ]; then   # the CPU side alone at 128K, CPU- vs device-routed
  $PY benchmarks/bench_step_cpu.py --n 131072 --layers 32 --configs routed:kernel=numba routed:kernel=numba,device_route=true \
      --out "$OUT/step_cpu.jsonl" 2>&1 | tee "$OUT/log_step_cpu.txt"; snap
fi
if [ "$phase" = nographs ]; then
  $PY -m topk_decode bench --model llama-3-8b --context 32K,128K --systems topk --no-graphs --no-offload-prefill \
      --gpu-memory "$budget" --k 1024 --steps 8 --out "$OUT/nographs" 2>&1 | tee "$OUT/log_llama8b_nographs.txt"
fi
