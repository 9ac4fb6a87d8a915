"""A one-token decode step as replayable segments, one per layer boundary.

A one-token step runs, per layer, ~25 small kernels of the HF modules (norms, projections, RoPE,
MLP) and must stop at every layer to send the query to the CPU. Launched from Python one by one,
those kernels cost more CPU time than the GPU spends on them. Here they are cut into L+1 segments:

    segment 0:      embedding, RoPE cos/sin, layer 0's q/k/v, q → host
    segment l:      context part of layer l-1 host → device, merge it with the window part,
                    finish layer l-1 (o_proj, residual, MLP), layer l's q/k/v, q → host   (1 ≤ l < L)
    segment L:      the same for layer L-1, then final norm and LM head

Between segments l and l+1 the engine runs the window attention of layer l (its length grows, so it
stays outside the graphs) and the CPU computes the context part (decode/context.py) into `ctx_host[l]`.
Each segment reads and writes fixed tensors (the two 16 KiB transfers included: pinned host buffers),
so on CUDA it is captured once as a CUDA graph and replayed (one launch instead of ~30). Without
capture (CPU, or a failed capture) the same segments run eagerly, which is what the CPU tests exercise.
"""

from __future__ import annotations

import warnings

import torch

from topk_decode.errors import TopkWarning
from topk_decode.decode.merge import merge_with_context
from topk_decode.model.blocks import ModelShape, attention_inputs, final_logits, finish_block, rope


class StepSegments:
    """Fixed-buffer segments of a one-token step.

    Args:
        model: the HF causal LM on `device`.
        shape: its ModelShape.
        device: the decode device.
        capture: capture CUDA graphs (CUDA only); otherwise run eagerly.
    """

    def __init__(self, model, shape: ModelShape, device: torch.device, capture: bool) -> None:
        self.model, self.shape, self.device = model, shape, device
        self.dtype = next(model.parameters()).dtype
        self.token = torch.zeros((1, 1), dtype=torch.int64, device=device)
        self.position = torch.zeros((1,), dtype=torch.int64, device=device)
        H, hkv, D, L = shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.n_layers
        pin = device.type == "cuda"
        # per layer, written by the engine before segment l+1 runs: the window part (device) ...
        self.win_out = [torch.zeros((H, D), dtype=torch.float32, device=device) for _ in range(L)]
        self.win_lse = [torch.zeros((H,), dtype=torch.float32, device=device) for _ in range(L)]
        # ... and the context part, (H, D+1) = output | lse, on the host (pinned: copied inside the graph)
        self.ctx_host = [torch.zeros((H, D + 1), dtype=torch.float32, pin_memory=pin) for _ in range(L)]
        self.ctx_dev = [torch.zeros((H, D + 1), dtype=torch.float32, device=device) for _ in range(L)] \
            if pin else self.ctx_host
        # layer l's queries grouped by KV head, (Hkv, G, D) fp32, copied to the host by segment l
        self.q_host = [torch.zeros((hkv, shape.group_size, D), dtype=torch.float32, pin_memory=pin)
                       for _ in range(L)]
        self.xs: list[torch.Tensor | None] = [None] * (shape.n_layers + 1)    # residual entering layer l
        self.qkv: list[tuple | None] = [None] * shape.n_layers
        self.logits: torch.Tensor | None = None
        self.cos = self.sin = None
        self.graphs: list[torch.cuda.CUDAGraph] | None = None
        if capture and device.type == "cuda":
            self._capture()

    def _segment(self, l: int) -> None:
        """Run segment l eagerly, leaving its outputs in self.xs / self.qkv / self.logits."""
        layers = self.model.model.layers
        if l == 0:
            x = self.model.model.embed_tokens(self.token)                      # (1, 1, C)
            self.cos, self.sin = rope(self.model, x, self.position)
        else:
            if self.ctx_dev is not self.ctx_host:
                self.ctx_dev[l - 1].copy_(self.ctx_host[l - 1], non_blocking=True)
            attn = merge_with_context(self.win_out[l - 1], self.win_lse[l - 1], self.ctx_dev[l - 1])   # (H, D)
            attn = attn.to(self.dtype).view(1, self.shape.n_heads, 1, self.shape.head_dim)
            x = finish_block(layers[l - 1], self.xs[l - 1], attn)
        self.xs[l] = x
        if l < self.shape.n_layers:
            q, k, v = attention_inputs(layers[l], x, self.cos, self.sin, self.shape)
            self.qkv[l] = (q, k, v)
            self.q_host[l].copy_(q.float().reshape(self.q_host[l].shape), non_blocking=True)
        else:
            self.logits = final_logits(self.model, x)                          # (1, V) fp32

    def _capture(self) -> None:
        L = self.shape.n_layers
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):                      # warm-up (lazy inits, cuBLAS workspaces)
                    for l in range(L + 1):
                        self._segment(l)
            torch.cuda.current_stream(self.device).wait_stream(side)
            pool = torch.cuda.graph_pool_handle()
            graphs = []
            for l in range(L + 1):                      # captured in replay order, sharing one pool
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self._segment(l)
                graphs.append(g)
            self.graphs = graphs
        except Exception as e:  # noqa: BLE001 - graphs are an optimisation: fall back to eager
            self.graphs = None
            warnings.warn(f"CUDA graph capture failed ({type(e).__name__}: {e}); decoding eagerly",
                          TopkWarning, stacklevel=2)

    def run(self, l: int) -> None:
        """Run (replay) segment l."""
        if self.graphs is not None:
            self.graphs[l].replay()
        else:
            self._segment(l)

    def start(self, token: int, position: int) -> None:
        """Set the step's token and position (no host sync: device-side fills)."""
        self.token.fill_(token)
        self.position.fill_(position)
