"""flat: the exact top-k of every query head over the whole searchable range (strategy.py).

- strategy.py: `FlatStrategy` and its torch backend (a half-precision scan with an exact rescoring);
- compiled.py: the numba backend's Python side (its kernels: topk_decode/kernels/flat_scan.py);
- index/flat/select_topk.py: the torch backend's sampled-threshold top-k for few cores.
"""

from topk_decode.index.flat.strategy import NUMBA_MIN_KEYS, FlatStrategy, add_in_blocks, auto_backend, new_flat_index

__all__ = ["FlatStrategy", "NUMBA_MIN_KEYS", "add_in_blocks", "auto_backend", "new_flat_index"]
