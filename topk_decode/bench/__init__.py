"""`topk bench`: decode and prefill speed of top-k decoding beside HF transformers, in one run."""
