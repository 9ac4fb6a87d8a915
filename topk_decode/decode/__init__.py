"""The decoder: exact GPU window + top-k retrieval from the CPU store, merged in one softmax."""

from topk_decode.decode.engine import Conversation, StepStats, TopKDecoder
from topk_decode.decode.merge import lse_merge
from topk_decode.decode.window import Window

__all__ = ["Conversation", "StepStats", "TopKDecoder", "Window", "lse_merge"]
