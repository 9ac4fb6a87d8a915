"""topk-decode: question answering over a million tokens on one commodity GPU.

Prefill once to disk; decode with per-head top-k retrieval from a CPU-side KV store merged exactly
with a GPU window of the tokens generated since.
"""

from topk_decode.config import DecodeConfig
from topk_decode.errors import TopkError, TopkWarning

__version__ = "0.1.0"


def __getattr__(name: str):
    # KVStore pulls in torch/transformers/faiss: import it on first use, so `topk --help` stays fast.
    if name in ("KVStore", "ChatSession"):
        from topk_decode import api

        return getattr(api, name)
    raise AttributeError(name)


__all__ = ["KVStore", "ChatSession", "DecodeConfig", "TopkError", "TopkWarning", "__version__"]
