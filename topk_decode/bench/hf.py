"""The baselines a user already has: HF transformers decoding with `DynamicCache` (KV on the GPU) and
`DynamicCache(offloading=True)` (KV in CPU RAM, one layer at a time brought back), measured in the
same process and conditions as top-k decoding.
"""

from __future__ import annotations

import time

import torch

from topk_decode.bench.measure import GIB, cpu_rss, free_gpu, peak_gpu, release, sync


def weights_bytes(model) -> int:
    """Bytes of the model's parameters."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def forward_activation_bytes(config, n_tokens: int, dtype: torch.dtype) -> int:
    """Rough peak activations of one full HF forward over n tokens (MLP intermediates dominate).

    Args:
        config: the model config.
        n_tokens: tokens in the forward.
        dtype: activation dtype.
    """
    elt = torch.empty((), dtype=dtype).element_size()
    return n_tokens * (3 * config.intermediate_size + 8 * config.hidden_size) * elt


def fits_hf(model, kv: int, n_tokens: int, offloading: bool, device: torch.device) -> tuple[bool, str]:
    """Estimate whether an HF run at this context fits the device, before trying it.

    Args:
        model: the HF model (on the device).
        kv: bytes of the whole context's KV.
        n_tokens: context length.
        offloading: the offloaded cache keeps about two layers' KV on the device.
        device: the device.
    Returns:
        (fits, a one-line explanation with the numbers).
    """
    free = free_gpu(device)
    if free is None:
        return True, "cpu"
    dtype = next(model.parameters()).dtype
    on_device = 2 * kv // model.config.num_hidden_layers if offloading else kv
    need = on_device + forward_activation_bytes(model.config, n_tokens, dtype)
    msg = (
        f"needs ~{need / GIB:.1f} GiB beside the weights (KV {on_device / GIB:.1f} + one full forward's "
        f"activations), {free / GIB:.1f} GiB free"
    )
    return need < 0.95 * free, msg


@torch.inference_mode()
def hf_decode(model, tokens: list[int], steps: int, warmup: int, offloading: bool, device: torch.device) -> dict:
    """Prefill `tokens` with one HF forward, then greedy-decode `warmup + steps` tokens; time both.

    Args:
        model: the HF causal LM on `device`.
        tokens: the context token ids.
        steps: timed decode steps.
        warmup: untimed decode steps first.
        offloading: `DynamicCache(offloading=True)` instead of `DynamicCache()`.
        device: the device.
    Returns:
        prefill and decode timings, peak device memory and CPU RSS.
    """
    from transformers import DynamicCache

    release(device)
    cache = DynamicCache(config=model.config, offloading=offloading)
    ids = torch.tensor([tokens], device=device)
    sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    tok = out.logits[0, -1].argmax()
    sync(device)
    prefill_s = time.perf_counter() - t0
    del out, ids
    t_dec = time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup:
            sync(device)
            t_dec = time.perf_counter()
        out = model(input_ids=tok.view(1, 1), past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[0, -1].argmax()
        int(tok)  # a chat app needs each token on the host (stop tokens, streaming), as generate() does
    decode_s = time.perf_counter() - t_dec
    rss, hwm = cpu_rss()
    result = {
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": len(tokens) / prefill_s,
        "steps": steps,
        "ms_per_step": 1e3 * decode_s / steps,
        "tokens_per_s": steps / decode_s,
        "peak_gpu_bytes": peak_gpu(device),
        "cpu_rss_bytes": rss,
        "cpu_peak_rss_bytes": hwm,
    }
    del cache
    release(device)
    return result


@torch.inference_mode()
def hf_greedy_tokens(model, tokens: list[int], first: int, n_new: int, device: torch.device) -> list[int]:
    """HF dense greedy decoding (`DynamicCache`, KV on the device): the `n_new` tokens that follow `tokens`
    and then `first`, the reference top-k decoding's tokens are compared with.

    Args:
        model: the HF causal LM on `device`.
        tokens: the context token ids.
        first: the first decoded input after the context (the top-k rows feed the same one).
        n_new: tokens to generate.
        device: the device.
    """
    from transformers import DynamicCache

    release(device)
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=torch.tensor([[*tokens, first]], device=device),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    generated = [int(out.logits[0, -1].argmax())]
    while len(generated) < n_new:
        ids = torch.tensor([[generated[-1]]], device=device)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        generated.append(int(out.logits[0, -1].argmax()))
    del out, cache
    release(device)
    return generated
