#!/usr/bin/env bash
# The GPU-host benchmark behind docs/BENCHMARKS.md. Run from the repo root on the GPU machine:
#   bash scripts/device_bench.sh 1    # Llama-3-8B 32K/128K: top-k vs HF dense vs HF offloaded, prefill vs HF, search floor
#   bash scripts/device_bench.sh 2    # 512K / 1M: Llama-3-8B and Qwen2.5-7B on synthetic KV; Llama-3.2-1B 32K/128K
#   bash scripts/device_bench.sh all  # 1 then 2
#   bash scripts/device_bench.sh nographs  # Llama-3-8B top-k rows without CUDA graphs (the comparison)
#   bash scripts/device_bench.sh scan      # DRAM floor vs flat / routed scan per layer (Llama-3-8B at 128K, Qwen2.5-7B at 1M)
#   bash scripts/device_bench.sh routed    # flat and routed side by side: Llama-3-8B 128K (prefill KV), Qwen2.5-7B 1M (synthetic)
#   bash scripts/device_bench.sh device    # routed with routing on the GPU (routed_device.py): its GPU tests, then
#                                          # flat and routed beside HF dense at 32K/128K
#   bash scripts/device_bench.sh device_cpu  # the CPU side alone at 128K, CPU- vs device-routed (step_cpu.py)
#   bash scripts/device_bench.sh huge      # routed with and without its huge-page copies (option hugepages): the CPU
#                                          # side alone (step_cpu.py), then tok/s at 128K, and the 1M row
#   bash scripts/device_bench.sh team      # what an empty parallel round of numba's team costs (team_overhead.py)
#   bash scripts/device_bench.sh route     # the device routing of one layer as a captured graph (route_gpu_speed.py),
                                         # Llama-3-8B at 128K and Qwen2.5-7B at 1M
#   bash scripts/device_bench.sh dots_scan  # flat's numba scan with bf16 dot products (index/dots.py) against torch and
#                                          # the DRAM floor, fp32 dots beside it, the randn/synthetic harness probe
#   bash scripts/device_bench.sh dots_bench # GPU tests; flat and routed tok/s at 128K with bf16 dots, routed with
#                                          # fp32 dots, routed at 1M
#   OLD=dir bash scripts/device_bench.sh flat_ab  # the flat kernel's tests here, then its search against the
#                                          # checkout in dir (a folder holding its topk_decode)
#                                          # alternately (flat_ab.py), beside torch, then dots_scan's scans
#   bash scripts/device_bench.sh flat_parts # flat's numba search by pass (flat_search_parts.py), then scan_bandwidth's
#                                          # flat rows at 128K
#   bash scripts/device_bench.sh fused     # routed's compiled path (search + context part in one kernel) vs its torch
#                                          # path: the CPU side alone over 32 layers (step_cpu.py), then tok/s at 32K/128K
#                                          # (needs numba: pip install the carried numba + llvmlite wheels first)
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
  $PY scripts/scan_bandwidth.py --n 131072 --kv-heads 8 --group 4 --k 1024 --probe-fraction 0.04 0.02 --profile --layers 32 \
      --out "$OUT/scan_bandwidth.jsonl" 2>&1 | tee "$OUT/log_scan.txt"; snap
fi
if [ "$phase" = scan32 ]; then   # routed with clusters of 32 (finer routing, twice the centroids)
  $PY scripts/scan_bandwidth.py --n 131072 --kv-heads 8 --group 4 --k 1024 --probe-fraction 0.04 --cluster-size 32 \
      --skip dram flat variants --out "$OUT/scan_bandwidth.jsonl" 2>&1 | tee "$OUT/log_scan32.txt"; snap
fi
if [ "$phase" = scan1m ]; then
  $PY scripts/scan_bandwidth.py --n 1048576 --kv-heads 4 --group 7 --k 1024 --probe-fraction 0.02 --skip dram variants \
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
if [ "$phase" = flat_ab ]; then   # docs/BENCHMARKS.md run 20
  $PY -m pytest -q -p no:cacheprovider tests/test_dots.py tests/test_flat_kernel.py 2>&1 | tail -2 \
      | tee "$OUT/log_flat_tests.txt"
  for rep in 1 2; do
    for pkg in "$OLD" .; do $PY scripts/flat_ab.py "$pkg" 131072 numba 2>&1 | tee -a "$OUT/flat_ab.txt"; snap; done
  done
  $PY scripts/flat_ab.py . 131072 torch 2>&1 | tee -a "$OUT/flat_ab.txt"; snap
  for pkg in "$OLD" .; do $PY scripts/flat_thread_cost.py "$pkg" 2>&1 | tee -a "$OUT/flat_thread_cost.jsonl"; done; snap
  phase=dots_scan
fi
if [ "$phase" = flat_parts ]; then   # docs/BENCHMARKS.md run 20
  $PY scripts/flat_search_parts.py --layers 16 2>&1 | tee "$OUT/flat_parts.jsonl"; snap
  $PY scripts/scan_bandwidth.py --k 1024 --skip variants routed routed_layers --reps 5 --n 131072 --kv-heads 8 --group 4 \
      --flat-backends torch numba --layers 32 --out "$OUT/flat_parts_scan.jsonl" 2>&1 | tee "$OUT/log_flat_parts_scan.txt"; snap
fi
if [ "$phase" = dots_scan ]; then   # docs/BENCHMARKS.md run 19's open questions, on the GPU host
  S="$PY scripts/scan_bandwidth.py --k 1024 --skip variants routed routed_layers --reps 5"
  $S --n 131072 --kv-heads 8 --group 4 --flat-backends torch numba --layers 32 --out "$OUT/dots_scan.jsonl" \
      2>&1 | tee "$OUT/log_dots_scan.txt"; snap
  $S --n 1048576 --kv-heads 4 --group 7 --flat-backends torch numba --out "$OUT/dots_scan.jsonl" \
      2>&1 | tee -a "$OUT/log_dots_scan.txt"; snap
  $PY scripts/flat_dot_floor.py --threads 16 2>&1 | tee "$OUT/dots_floor.jsonl"; snap
  $PY scripts/flat_dot_ab.py --threads 16 --layers 16 2>&1 | tee "$OUT/dots_ab.jsonl"; snap   # fp32 vs bf16 dots
  $PY scripts/flat_harness_probe.py --layers 16 2>&1 | tee "$OUT/dots_harness.jsonl"; snap
fi
if [ "$phase" = dots_bench ]; then   # GPU tests, then flat (default backend) and routed with bf16 dots, routed with fp32 dots
  $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_routed_device.py tests/test_host_embedding.py \
      2>&1 | tail -3 | tee "$OUT/log_gpu_tests.txt"
  for dot in bf16 fp32; do
    env $([ $dot = fp32 ] && echo TOPK_NO_BF16_DOT=1) $PY -m topk_decode bench --model llama-3-8b --context 128K \
        --gpu-memory "$budget" --k 1024 --steps 16 --strategy $([ $dot = bf16 ] && echo flat,routed || echo routed) \
        --systems topk --no-offload-prefill --out "$OUT/dots_$dot" 2>&1 | tee "$OUT/log_dots_$dot.txt"; snap
  done
  bench qwen2.5-7b 1048576 routed 12 "strategy_options={'probe_fraction': 0.02, 'store_values': False}" \
      2>&1 | tee "$OUT/log_dots_qwen7b_1m.txt"; snap
fi
if [ "$phase" = fused ]; then
  $PY scripts/step_cpu.py --n 131072 --layers 32 --configs flat routed:kernel=torch routed:kernel=numba \
      --out "$OUT/step_cpu.jsonl" 2>&1 | tee "$OUT/log_step_cpu.txt"; snap
  for kernel in numba torch; do
    $PY -m topk_decode bench --model llama-3-8b --context 32K,128K --gpu-memory "$budget" --k 1024 --steps 16 \
        --strategy routed --systems topk --no-offload-prefill --opt kernel=$kernel --out "$OUT/fused_$kernel" \
        2>&1 | tee "$OUT/log_fused_$kernel.txt"; snap
  done
fi
if [ "$phase" = device ]; then
  $PY -m pytest -q -m gpu tests/test_routed_device.py tests/test_host_embedding.py 2>&1 | tail -3 \
      | tee "$OUT/log_device_tests.txt"
  $PY -m topk_decode bench --model llama-3-8b --context 32K,128K --gpu-memory "$budget" --k 1024 --steps 16 \
      --strategy flat,routed --systems topk,hf-dense --no-offload-prefill --out "$OUT/device" 2>&1 \
      | tee "$OUT/log_device.txt"; snap
fi
if [ "$phase" = device_cpu ]; then   # the CPU side alone at 128K, CPU- vs device-routed
  $PY scripts/step_cpu.py --n 131072 --layers 32 --configs routed:kernel=numba routed:kernel=numba,device_route=true \
      --out "$OUT/step_cpu.jsonl" 2>&1 | tee "$OUT/log_step_cpu.txt"; snap
fi
if [ "$phase" = threads ]; then   # the device-routed CPU side by numba thread count and OpenMP settings
  $PY -m topk_decode bench --model llama-3-8b --context 32K --gpu-memory "$budget" --k 1024 --steps 16 \
      --strategy routed --systems topk --no-offload-prefill --out "$OUT/device32" 2>&1 | tee "$OUT/log_device32.txt"; snap
  cfg=routed:kernel=numba,device_route=true
  $PY scripts/step_cpu.py --n 131072 --layers 8 --configs $cfg --threads 16 8 4 1 --out "$OUT/threads.jsonl"; snap
  OMP_WAIT_POLICY=passive $PY scripts/step_cpu.py --n 131072 --layers 8 --configs $cfg --out "$OUT/threads_passive.jsonl"; snap
  NUMBA_THREADING_LAYER=workqueue $PY scripts/step_cpu.py --n 131072 --layers 8 --configs $cfg \
      --out "$OUT/threads_workqueue.jsonl"; snap
fi
if [ "$phase" = parts ]; then   # a head's device-routed layer by part (scan, top-k, context part), then 32K decode
  $PY scripts/kernel_parts.py --n 131072 --rows 2624 2>&1 | tee "$OUT/kernel_parts.jsonl"
  $PY scripts/kernel_parts.py --n 32768 --rows 1900 2>&1 | tee -a "$OUT/kernel_parts.jsonl"; snap
  for kv in prefill synthetic; do
    $PY -m topk_decode bench --model llama-3-8b --context 32K --gpu-memory "$budget" --k 1024 --steps 16 --kv $kv \
        --strategy routed --systems topk --no-offload-prefill --out "$OUT/parts_$kv" 2>&1 | tee "$OUT/log_parts_$kv.txt"; snap
  done
fi
if [ "$phase" = huge ]; then   # run 16's open question: huge pages over a whole decode step
  $PY scripts/step_cpu.py --n 131072 --layers 16 --reps 3 --configs routed:kernel=numba,device_route=true,hugepages=false \
      routed:kernel=numba,device_route=true,hugepages=true --out "$OUT/step_cpu_huge.jsonl" 2>&1 \
      | tee "$OUT/log_step_cpu_huge.txt"; snap
  for huge in true false; do
    $PY -m topk_decode bench --model llama-3-8b --context 128K --gpu-memory "$budget" --k 1024 --steps 16 \
        --strategy routed --systems topk --no-offload-prefill --opt hugepages=$huge --out "$OUT/huge_$huge" \
        2>&1 | tee "$OUT/log_huge_$huge.txt"; snap
  done
  bench qwen2.5-7b 1048576 routed 16 "strategy_options={'probe_fraction': 0.02, 'store_values': False}" \
      2>&1 | tee "$OUT/log_huge_qwen7b_1m.txt"; snap
fi
if [ "$phase" = route ]; then
  $PY scripts/route_gpu_speed.py --n 131072 --kv-heads 8 --group 4 2>&1 | tee "$OUT/route_gpu.jsonl"
  $PY scripts/route_gpu_speed.py --n 1048576 --kv-heads 4 --group 7 --probe-fraction 0.02 --values fp8 2>&1 \
      | tee -a "$OUT/route_gpu.jsonl"; snap
fi
if [ "$phase" = team ]; then
  $PY scripts/team_overhead.py --threads 15 --rounds 1 5 --gap-us 0 500 2>&1 | tee "$OUT/team_overhead.jsonl"; snap
fi
if [ "$phase" = nographs ]; then
  $PY -m topk_decode bench --model llama-3-8b --context 32K,128K --systems topk --no-graphs --no-offload-prefill \
      --gpu-memory "$budget" --k 1024 --steps 8 --out "$OUT/nographs" 2>&1 | tee "$OUT/log_llama8b_nographs.txt"
fi
