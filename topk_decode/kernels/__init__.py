"""The compiled (numba/LLVM) kernels of the strategies, torch-free: numpy arrays in, numpy arrays out.

- jit.py: the one loader (jit flags, shared intrinsics, the dot products' instruction set, chosen once);
- kernels/dots.py: one bf16 key row against four queries (AVX512-BF16 or exact fp32 widening);
- topk.py: exact top-k of a row of fp32 scores (radix select);
- flat_scan.py, kernels/flat_sample.py: flat's exact scan in (head, block of keys) tasks and its sampled cuts;
- routed_scan.py, routed_route.py, kernels/routed_split.py: routed's per-layer calls (scan, CPU routing, the
  device-routed layer split over the thread team);
- pq_codes.py: routed's residual codes of one dimension per sub-vector, encoded at build time.

The Python sides that turn a strategy's tensors into these arrays are index/flat/compiled.py and
index/routed/compiled.py.
"""
