"""routed: clustered keys, routing by the clusters' estimated attention mass, an exact top-k of what was read.

- strategy.py: `RoutedStrategy` (options, build, the search entry points);
- index/routed/cluster.py, layout.py: k-means per (layer, KV head) and the cluster-contiguous layout on disk;
- index/routed/estimate.py: the clusters' statistics and the estimate of the attention a selection leaves out;
- compiled.py: the compiled path's Python side, one call per layer (its kernels: topk_decode/kernels/routed_*.py);
- torch_path.py: the same search as tensor ops (the exact reference, and the path for fp32/fp16 caches);
- device.py: routing and the estimate on the decode device, inside the captured one-token step.
"""

from topk_decode.index.routed.strategy import RoutedStrategy

__all__ = ["RoutedStrategy"]
