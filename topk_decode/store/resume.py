"""Resume checkpoints inside a prefill's partial directory (`topk prefill ... --resume`).

A layer-wise prefill can continue from layer L only with the residual stream that enters layer L,
so a checkpoint is: that residual stream (N, C) in `resume/hidden.LLL.bin`, and `resume/state.json`
(written last, atomically: a kill between the two leaves the previous checkpoint whole) naming L,
the sizes + blake2b checksums of the layer files 0..L−1 and of the residual stream, and a key of
everything the numbers depend on (model fingerprint, token ids, chunk size, dtype, device kind).
Layers written after the last checkpoint are computed again on resume (a checkpoint costs a write
of N·C values, so it is taken at most every few minutes by default, see build.py).
The directory holds no manifest, so it never opens as a cache.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for annotations: imported where used, so start-up does without it
    import torch

from topk_decode.store.format import as_torch, blake2_file, dtype_name, layer_files, numpy_storage

STATE = "resume/state.json"


def _hidden_file(next_layer: int) -> str:
    return f"resume/hidden.{next_layer:03d}.bin"


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write JSON to `path` through a temporary file and one rename (readers see old or new)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(partial: Path, key: dict, next_layer: int, files: dict[str, dict], hidden: torch.Tensor) -> None:
    """Record that layers 0..next_layer−1 are on disk, with the residual stream entering `next_layer`.

    Args:
        partial: the partial cache directory.
        key: what the prefill's numbers depend on (compared on resume).
        next_layer: the first layer not covered by this checkpoint.
        files: the writer's size/checksum table (layers below next_layer must be in it).
        hidden: (N, C) CPU residual stream entering `next_layer`.
    """
    import numpy as np  # here, not at the top: the store opens caches without numpy and torch (`topk info`)
    import torch

    (partial / "resume").mkdir(exist_ok=True)
    t = hidden.detach().contiguous()
    raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    hidden_rel = _hidden_file(next_layer)
    with open(partial / hidden_rel, "wb") as f:
        f.write(raw.reshape(-1).view(np.uint8).data)  # not tofile: a full disk must keep its errno
    kept = {rel: files[rel] for layer in range(next_layer) for rel in layer_files(layer) if rel in files}
    write_json_atomic(
        partial / STATE,
        {
            "key": key,
            "next_layer": next_layer,
            "files": kept,
            "hidden": {
                "file": hidden_rel,
                "shape": list(t.shape),
                "dtype": dtype_name(t.dtype),
                "blake2b": hashlib.blake2b(raw.reshape(-1).view(np.uint8).data, digest_size=16).hexdigest(),
            },
        },
    )
    for old in (partial / "resume").glob("hidden.*.bin"):  # earlier checkpoints' residual streams
        if old.name != Path(hidden_rel).name:
            old.unlink(missing_ok=True)


def checkpoint_layers(partial: Path) -> int:
    """Layers a checkpoint in `partial` covers (0 when there is none or it is unreadable)."""
    try:
        return int(json.loads((partial / STATE).read_text())["next_layer"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def load_checkpoint(partial: Path, key: dict) -> tuple[int, dict[str, dict], torch.Tensor | None, str]:
    """Check a checkpoint against `key` and against every recorded checksum.

    Args:
        partial: the partial cache directory.
        key: the key of the prefill about to run.
    Returns:
        (next_layer, files kept, residual stream entering next_layer, "") when it can be used, else
        (0, {}, None, why not).
    """
    try:
        return _load_checkpoint(partial, key)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0, {}, None, "it holds no readable checkpoint"


def _load_checkpoint(partial: Path, key: dict) -> tuple[int, dict[str, dict], torch.Tensor | None, str]:
    try:
        state = json.loads((partial / STATE).read_text())
        next_layer, files, meta = int(state["next_layer"]), dict(state["files"]), state["hidden"]
    except (OSError, ValueError, KeyError, TypeError):
        return 0, {}, None, "it holds no readable checkpoint"
    recorded = state.get("key") if isinstance(state.get("key"), dict) else {}
    if recorded != key:
        diff = sorted(k for k in set(key) | set(recorded) if key.get(k) != recorded.get(k))
        return 0, {}, None, f"it was made with other inputs ({', '.join(diff)} differ)"
    for rel, rec in files.items():
        p = partial / rel
        if not p.is_file() or p.stat().st_size != rec["bytes"] or blake2_file(p) != rec["blake2b"]:
            return 0, {}, None, f"{rel} does not match its recorded checksum"
    p = partial / str(meta.get("file", ""))
    if not p.is_file() or blake2_file(p) != meta["blake2b"]:
        return 0, {}, None, "its residual stream does not match its recorded checksum"
    import numpy as np

    shape = tuple(meta["shape"])
    arr = np.fromfile(p, dtype=numpy_storage(meta["dtype"]))
    if arr.size != int(np.prod(shape)):
        return 0, {}, None, "its residual stream has the wrong size"
    hidden = as_torch(arr.reshape(shape), meta["dtype"]).clone()
    return next_layer, files, hidden, ""


def drop_checkpoint(partial: Path) -> None:
    """Remove the checkpoint files before the partial directory becomes the cache."""
    import shutil

    shutil.rmtree(partial / "resume", ignore_errors=True)


__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "checkpoint_layers",
    "drop_checkpoint",
    "blake2_file",
    "write_json_atomic",
]
