"""Evaluation helpers: seeded long-context retrieval tasks (see :mod:`topk_decode.eval.tasks`)."""
