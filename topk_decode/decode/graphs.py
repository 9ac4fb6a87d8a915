"""The dense part of a one-token decode step, between two attentions, as replayable segments.

A one-token step runs, per layer, ~25 small kernels of the HF modules (norms, projections, RoPE,
MLP) and must stop at every layer to send the query to the CPU. Launched from Python one by one,
those kernels cost more CPU time than the GPU spends on them. Here they are cut into L+1 segments:

    segment 0:      embedding, RoPE cos/sin, layer 0's q/k/v
    segment l:      finish layer l-1 (o_proj, residual, MLP) and layer l's q/k/v      (1 ≤ l < L)
    segment L:      finish layer L-1, final norm, LM head

Each segment reads and writes fixed tensors, so on CUDA it is captured once as a CUDA graph and
replayed (one launch instead of ~25). Without capture (CPU, or a failed capture) the same segments
run eagerly, which is what the CPU tests exercise.
"""

from __future__ import annotations

import warnings

import torch

from topk_decode.errors import TopkWarning
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
        dtype = next(model.parameters()).dtype
        self.token = torch.zeros((1, 1), dtype=torch.int64, device=device)
        self.position = torch.zeros((1,), dtype=torch.int64, device=device)
        # attention outputs, written by the engine's merge before segment l+1 runs
        self.attn = [torch.zeros((1, shape.n_heads, 1, shape.head_dim), dtype=dtype, device=device)
                     for _ in range(shape.n_layers)]
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
            x = finish_block(layers[l - 1], self.xs[l - 1], self.attn[l - 1])
        self.xs[l] = x
        if l < self.shape.n_layers:
            self.qkv[l] = attention_inputs(layers[l], x, self.cos, self.sin, self.shape)
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
