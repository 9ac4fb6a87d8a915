"""A one-token decode step as replayable segments, one per layer boundary.

A one-token step runs, per layer, ~25 small kernels of the HF modules (norms, projections, RoPE,
MLP) and must stop at every layer to send the query to the CPU. Launched from Python one by one,
those kernels cost more CPU time than the GPU spends on them. Here they are cut into L+1 segments:

    segment 0:      embedding, RoPE cos/sin, the window mask; layer 0's q/k/v, q → host,
                    k/v → window, window part of layer 0's attention
    segment l:      context part of layer l-1 host → device, merge it with the window part,
                    finish layer l-1 (o_proj, residual, MLP); layer l as in segment 0  (1 ≤ l < L)
    segment L:      the same for layer L-1, then final norm and LM head

Between segments l and l+1 the CPU searches and computes the context part (decode/context.py) into
`part_o[l]` and `part_mz[l]`, while the GPU finishes the window part of layer l: the segment marks,
with an event recorded inside the graph, the moment the query has reached the host. Each segment
reads and writes fixed tensors (the transfers included: pinned host buffers), so on CUDA it is
captured once as a CUDA graph and replayed (one launch instead of ~35). The part of a segment on the
critical path, `layer_boundary`, is compiled with torch.compile, which fuses its small kernels.
The window lives in fixed-capacity buffers owned here and lent to the conversation being decoded
(`bind`); the step's length is a device tensor and slots past it are masked. Without capture (CPU,
or a failed capture) the same segments run eagerly, which is what the CPU tests exercise.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from topk_decode.errors import TopkWarning
from topk_decode.decode.merge import fixed_window_attention, merge_with_context
from topk_decode.decode.window import Window
from topk_decode.model.blocks import ModelShape, attention_inputs, final_logits, finish_block, rope


def start_layer(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, shape: ModelShape):
    """Layer `layer`'s attention inputs for one token, with the query also as fp32 grouped by KV head.

    Returns:
        q (1, H, 1, D) in the model's dtype, the same q as (Hkv, G, D) float32, k and v (1, Hkv, 1, D).
    """
    q, k, v = attention_inputs(layer, x, cos, sin, shape)
    return q, q.float().reshape(shape.n_kv_heads, shape.group_size, shape.head_dim), k, v


def finish_layer(layer, x: torch.Tensor, win_out: torch.Tensor, win_lse: torch.Tensor, o: torch.Tensor,
                 mz: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """Merge a layer's window and context parts and finish the layer: (1, T, C) residual leaving it.

    Args:
        layer: the layer; x: (1, T, C) residual entering it.
        win_out, win_lse: (H, [T,] D), (H, [T]) float32 window part; o, mz: (H, [T,] D), (H, [T,] 2)
            context part (merge.context_part).
        shape: the model's ModelShape.
    """
    attn = merge_with_context(win_out, win_lse, o, mz)                        # (H, [T,] D) fp32
    attn = attn.to(x.dtype).view(1, shape.n_heads, -1, shape.head_dim)
    return finish_block(layer, x, attn)


def layer_boundary(prev, layer, x: torch.Tensor, win_out: torch.Tensor, win_lse: torch.Tensor, o: torch.Tensor,
                   mz: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, shape: ModelShape):
    """The critical path of segment l: finish layer l-1 (`prev`), then layer l's attention inputs.

    Every layer runs this same function with its own modules, so one `torch.compile` of it (weights
    are graph inputs, not constants) serves all layers: its ~25 small kernels (merge, residuals,
    norms, SiLU, RoPE, casts) fuse into a few, between the projections' GEMMs.

    Args:
        prev, layer: model.model.layers[l-1] and [l].
        x: (1, 1, C) residual entering layer l-1.
        win_out, win_lse, o, mz: layer l-1's two attention parts (see `finish_layer`).
        cos, sin: (1, 1, D) rotary embedding at the token's position.
        shape: the model's ModelShape.
    Returns:
        x (1, 1, C) entering layer l, then `start_layer`'s q, q32, k, v for layer l.
    """
    x = finish_layer(prev, x, win_out, win_lse, o, mz, shape)
    return (x, *start_layer(layer, x, cos, sin, shape))


def compiled_boundary():
    """`layer_boundary` under torch.compile: one graph for all layers (the modules' weights are inputs)."""
    import torch._inductor.config as inductor_config

    # keep eager's intermediate roundings to the model's dtype (HF's norms round before the weight)
    options = {"emulate_precision_casts": True} if hasattr(inductor_config, "emulate_precision_casts") else {}
    return torch.compile(layer_boundary, dynamic=False, options=options)


class StepSegments:
    """Fixed-buffer segments of a one-token step.

    Args:
        model: the HF causal LM on `device`.
        shape: its ModelShape.
        device: the decode device.
        capture: capture CUDA graphs (CUDA only); otherwise run eagerly.
        scale: softmax scale.
        compile: with capture, compile `layer_boundary` with torch.compile (falls back to the plain
            function, with a warning, where compilation fails).
        context_dtype: dtype of the context part's output o (the cache values' dtype).
    """

    # smallest window capacity (slots per layer); it doubles as conversations grow past it
    min_capacity: int = 256

    def __init__(self, model, shape: ModelShape, device: torch.device, capture: bool, scale: float,
                 compile: bool = False, context_dtype: torch.dtype = torch.float32) -> None:
        self.model, self.shape, self.device, self.scale = model, shape, device, scale
        self.capture = capture and device.type == "cuda"
        self.compiled = compile and self.capture
        self._boundary = compiled_boundary() if self.compiled else layer_boundary
        self.dtype = next(model.parameters()).dtype
        self.token = torch.zeros((1, 1), dtype=torch.int64, device=device)
        self.position = torch.zeros((1,), dtype=torch.int64, device=device)
        H, hkv, D, L = shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.n_layers
        pin = device.type == "cuda"
        # per layer, written by the engine before segment l+1 runs: the window part (device) ...
        self.win_out = [torch.zeros((H, D), dtype=torch.float32, device=device) for _ in range(L)]
        self.win_lse = [torch.zeros((H,), dtype=torch.float32, device=device) for _ in range(L)]
        # ... and the context part, o (H, D) and (m, z) (H, 2), on the host (pinned: copied inside the graph)
        self.part_o = [torch.zeros((H, D), dtype=context_dtype, pin_memory=pin) for _ in range(L)]
        self.part_mz = [torch.zeros((H, 2), dtype=torch.float32, pin_memory=pin) for _ in range(L)]
        self.part_o_dev = [t.to(device) for t in self.part_o]
        self.part_mz_dev = [t.to(device) for t in self.part_mz]
        # layer l's queries grouped by KV head, (Hkv, G, D) fp32, copied to the host by segment l
        self.q_host = [torch.zeros((hkv, shape.group_size, D), dtype=torch.float32, pin_memory=pin)
                       for _ in range(L)]
        self.win_len = torch.zeros((1,), dtype=torch.int64, device=device)   # valid window slots before this step
        self.capacity = 0
        self.win_k: list[torch.Tensor] = []
        self.win_v: list[torch.Tensor] = []
        self._owner: weakref.ref | None = None              # the Window the buffers are lent to
        # per layer: the query has reached the host. Recorded inside the graph when this torch can
        # (an external event node), so the window part after it overlaps the CPU's search.
        self.q_ready: list[torch.cuda.Event] = []
        self.events_in_graph = False
        if self.capture:
            try:
                self.q_ready = [torch.cuda.Event(external=True) for _ in range(L)]
                self.events_in_graph = True
            except TypeError:   # an older torch: recorded after each replay instead
                self.q_ready = [torch.cuda.Event() for _ in range(L)]
        self.xs: list[torch.Tensor | None] = [None] * (shape.n_layers + 1)    # residual entering layer l
        self.logits: torch.Tensor | None = None
        self.cos = self.sin = None
        self.graphs: list[torch.cuda.CUDAGraph] | None = None

    def bind(self, window: Window) -> None:
        """Lend the window buffers to `window` (moving its contents in) with room for one more token.

        The previous borrower, if alive, moves back into buffers of its own. The buffers grow
        (doubling, and the graphs are captured again) when the window would not fit.
        """
        need = window.length + 1
        if window.k is self.win_k and need <= self.capacity:
            return
        owner = self._owner() if self._owner is not None else None
        if owner is not None and owner is not window and owner.k is self.win_k:
            owner.detach()
        if need > self.capacity:
            cap = max(self.min_capacity, self.capacity)
            while cap < need:
                cap *= 2
            self._allocate(cap, window)
        window.move_into(self.win_k, self.win_v)
        self._owner = weakref.ref(window)

    def _allocate(self, capacity: int, like: Window) -> None:
        """New window buffers of `capacity` slots (zeros: masked slots must hold finite values)."""
        self.graphs = None
        hkv, D, L = self.shape.n_kv_heads, self.shape.head_dim, self.shape.n_layers
        k0 = like.k[0]
        self.win_k = [torch.zeros((hkv, capacity, D), dtype=k0.dtype, device=self.device) for _ in range(L)]
        self.win_v = [torch.zeros((hkv, capacity, D), dtype=k0.dtype, device=self.device) for _ in range(L)]
        self.capacity = capacity
        self.visible = torch.zeros((1, capacity), dtype=torch.bool, device=self.device)
        self.bias = torch.zeros((1, 1, 1, capacity), dtype=self.dtype, device=self.device)
        self._slots = torch.arange(capacity, device=self.device)
        if self.capture:
            self._capture()

    def _segment(self, l: int) -> None:
        """Run segment l eagerly, leaving its outputs in self.xs / q_host / win_out / win_lse / self.logits."""
        layers, L = self.model.model.layers, self.shape.n_layers
        if l == 0:
            x = self.model.model.embed_tokens(self.token)                      # (1, 1, C)
            self.cos, self.sin = rope(self.model, x, self.position)
            torch.le(self._slots, self.win_len, out=self.visible[0])           # old slots and this token's
            self.bias.masked_fill_(self.visible, 0.0).masked_fill_(~self.visible, float("-inf"))
            q, q32, k, v = start_layer(layers[0], x, self.cos, self.sin, self.shape)
        else:
            if self.part_o_dev[l - 1] is not self.part_o[l - 1]:      # (on the CPU they are the same)
                self.part_o_dev[l - 1].copy_(self.part_o[l - 1], non_blocking=True)
                self.part_mz_dev[l - 1].copy_(self.part_mz[l - 1], non_blocking=True)
            ends = (self.xs[l - 1], self.win_out[l - 1], self.win_lse[l - 1], self.part_o_dev[l - 1],
                    self.part_mz_dev[l - 1])
            if l == L:
                x = finish_layer(layers[l - 1], *ends, self.shape)
                self.logits = final_logits(self.model, x)                      # (1, V) fp32
                return
            x, q, q32, k, v = self._boundary(layers[l - 1], layers[l], *ends, self.cos, self.sin, self.shape)
        self.xs[l] = x
        # the critical path ends here: the query goes to the host and the CPU searches, while the
        # GPU appends k/v to the window and computes the window part
        self.q_host[l].copy_(q32, non_blocking=True)
        if self.events_in_graph:
            self.q_ready[l].record()
        self.win_k[l].index_copy_(1, self.win_len, k[0])                      # (Hkv, C, D) ← (Hkv, 1, D)
        self.win_v[l].index_copy_(1, self.win_len, v[0])
        out_w, lse_w = fixed_window_attention(q[0], self.win_k[l], self.win_v[l], self.bias, self.visible,
                                              self.scale)                 # (H, 1, D), (H, 1)
        self.win_out[l].copy_(out_w.view_as(self.win_out[l]))
        self.win_lse[l].copy_(lse_w.view_as(self.win_lse[l]))

    def _warm_up(self) -> None:
        """Two eager passes over all segments: lazy inits, cuBLAS workspaces, the compilation."""
        for _ in range(2):
            for l in range(self.shape.n_layers + 1):
                self._segment(l)

    def _capture(self) -> None:
        L = self.shape.n_layers
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                try:
                    self._warm_up()
                except Exception as e:  # noqa: BLE001 - compilation is an optimisation too
                    if not self.compiled:
                        raise
                    warnings.warn(f"torch.compile of the decode step failed ({type(e).__name__}: {e}); "
                                  "running it uncompiled", TopkWarning, stacklevel=3)
                    self.compiled, self._boundary = False, layer_boundary
                    self._warm_up()
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
        if self.q_ready and not self.events_in_graph and l < self.shape.n_layers:
            self.q_ready[l].record()

    def wait_query(self, l: int) -> None:
        """Block until layer l's query is in `q_host[l]` (the rest of the segment may still run)."""
        if self.q_ready:
            self.q_ready[l].synchronize()

    def start(self, token: int, position: int, window: Window) -> None:
        """Set the step's token, position and window length (no host sync: device-side fills)."""
        self.token.fill_(token)
        self.position.fill_(position)
        self.win_len.fill_(window.length)
