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
`part_o[l]` and `part_mz[l]` (unless the device stage computes it itself, `DeviceStage.attends`: then nothing runs
between the segments), while the GPU finishes the window part of layer l: the segment marks,
with an event recorded inside the graph, the moment the query has reached the host. Each segment
reads and writes fixed tensors (the transfers included: pinned host buffers), so on CUDA it is
captured once as a CUDA graph and replayed (one launch instead of ~35). The part of a segment on the
critical path, `layer_boundary` (layer.py), is compiled with torch.compile, which fuses its small
kernels. The step owns one window of fixed capacity and the conversation being decoded is resident
in it (`activate`; window.py says who owns which buffer); the step's length is a device tensor and
slots past it are masked. Without capture (CPU, or a failed capture) the same segments run eagerly,
which is what the CPU tests exercise.
"""

from __future__ import annotations

import warnings

import torch

from topk_decode.decode import layer as layer_math
from topk_decode.decode.embedding import HostEmbedding
from topk_decode.decode.layer import finish_layer, layer_boundary, start_layer
from topk_decode.decode.merge import fixed_window_attention, lse_merge
from topk_decode.decode.window import Window, new_buffers, window_capacity
from topk_decode.errors import TopkWarning
from topk_decode.model.blocks import ModelShape, final_logits, rope


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
        routes: the strategy's device stage (`DeviceStaged.device_routes`, index/base.py `DeviceStage`), or None: for the layers
            it handles, each segment also ranks the context's clusters and sends the ranking to the host
            with the query, and merges the device's estimate of the unread clusters into the window part.
    """

    # fewest window slots per layer (window.py's rule doubles it as conversations grow past it)
    min_capacity: int = 256

    def __init__(
        self,
        model,
        shape: ModelShape,
        device: torch.device,
        capture: bool,
        scale: float,
        compile: bool = False,
        context_dtype: torch.dtype = torch.float32,
        routes=None,
    ) -> None:
        self.model, self.shape, self.device, self.scale = model, shape, device, scale
        self.routes = routes
        self.capture = capture and device.type == "cuda"
        self.compiled = compile and self.capture
        self._boundary = layer_math.compiled_boundary() if self.compiled else layer_boundary
        self.dtype = next(model.parameters()).dtype
        self.token = torch.zeros((1, 1), dtype=torch.int64, device=device)
        # an input embedding in CPU RAM (decode/embedding.py) writes the token's row here before each step
        self.host_embedding = model.model.embed_tokens if isinstance(model.model.embed_tokens, HostEmbedding) else None
        self.x_in = (
            torch.zeros((1, 1, shape.hidden_size), dtype=self.dtype, device=device)
            if self.host_embedding is not None
            else None
        )
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
        self.q_host = [torch.zeros((hkv, shape.group_size, D), dtype=torch.float32, pin_memory=pin) for _ in range(L)]
        self.win_len = torch.zeros((1,), dtype=torch.int64, device=device)  # valid window slots before this step
        # the step's own window buffers, per layer (Hkv, capacity, D), and the window resident in them
        self.capacity = 0
        self.win_k: list[torch.Tensor] = []
        self.win_v: list[torch.Tensor] = []
        self.resident: Window | None = None
        # per layer: the query has reached the host. Recorded inside the graph when this torch can
        # (an external event node), so the window part after it overlaps the CPU's search.
        self.q_ready: list[torch.cuda.Event] = []
        self.events_in_graph = False
        if self.capture:
            try:
                self.q_ready = [torch.cuda.Event(external=True) for _ in range(L)]
                self.events_in_graph = True
            except TypeError:  # an older torch: recorded after each replay instead
                self.q_ready = [torch.cuda.Event() for _ in range(L)]
        self.xs: list[torch.Tensor | None] = [None] * (shape.n_layers + 1)  # residual entering layer l
        self.logits: torch.Tensor | None = None
        self.cos = self.sin = None
        self.graphs: list[torch.cuda.CUDAGraph] | None = None

    def activate(self, window: Window) -> None:
        """Make `window` the resident one, with room for one more token: its contents move into the step's
        buffers, after the previous resident, if any, moves out into buffers of its own. The step's buffers
        grow (window.py's rule; the graphs are captured again) when the window would not fit.
        """
        need = window.length + 1
        if window.host is self and need <= self.capacity:
            return
        if window.host is not None and window.host is not self:
            window.host.park()  # resident in earlier segments (reset_segments)
        if self.resident is not None and self.resident is not window:
            self.park()
        if need > self.capacity:
            self._allocate(window_capacity(need, self.min_capacity), window)
        window.move_into(self.win_k, self.win_v, host=self)
        self.resident = window

    def park(self) -> None:
        """Move the resident window, if it still lives here, into buffers of its own."""
        window, self.resident = self.resident, None
        if window is not None and window.host is self:
            window.relocate()

    def _allocate(self, capacity: int, like: Window) -> None:
        """New window buffers of `capacity` slots, and the graphs captured on them."""
        self.graphs = None
        self.win_k, self.win_v = new_buffers(like.k[0], self.shape.n_layers, capacity)
        self.capacity = capacity
        self.visible = torch.zeros((1, capacity), dtype=torch.bool, device=self.device)
        self.bias = torch.zeros((1, 1, 1, capacity), dtype=self.dtype, device=self.device)
        self._slots = torch.arange(capacity, device=self.device)
        if self.capture:
            self._capture()

    # ---- the segments: first (l = 0), boundary (1 ≤ l < L), last (l = L) ---------------------------
    def _first(self) -> None:
        """Segment 0: embedding, RoPE, the window mask, then layer 0's attention inputs and window part."""
        x = self.x_in if self.host_embedding is not None else self.model.model.embed_tokens(self.token)  # (1, 1, C)
        self.cos, self.sin = rope(self.model, x, self.position)
        torch.le(self._slots, self.win_len, out=self.visible[0])  # old slots and this token's
        self.bias.masked_fill_(self.visible, 0.0).masked_fill_(~self.visible, float("-inf"))
        self._attend_window(0, x, *start_layer(self.model.model.layers[0], x, self.cos, self.sin, self.shape))

    def _boundary_segment(self, l: int) -> None:
        """Segment l (1 ≤ l < L): finish layer l-1 with its context part, then layer l as in `_first`."""
        layers = self.model.model.layers
        out = self._boundary(layers[l - 1], layers[l], *self._ends(l - 1), self.cos, self.sin, self.shape)
        self._attend_window(l, *out)

    def _last(self) -> None:
        """Segment L: finish the last layer with its context part, final norm and LM head."""
        L = self.shape.n_layers
        x = finish_layer(self.model.model.layers[L - 1], *self._ends(L - 1), self.shape)
        self.logits = final_logits(self.model, x)  # (1, V) fp32

    def _ends(self, l: int) -> tuple[torch.Tensor, ...]:
        """Layer l's residual and both attention parts, the context part copied in from the host first."""
        attended = self.routes is not None and self.routes.attends(l)  # the device wrote the part itself
        if self.part_o_dev[l] is not self.part_o[l] and not attended:  # (on the CPU they are the same tensors)
            self.part_o_dev[l].copy_(self.part_o[l], non_blocking=True)
            self.part_mz_dev[l].copy_(self.part_mz[l], non_blocking=True)
        win_out, win_lse = self.win_out[l], self.win_lse[l]
        rest = self.routes.read_part(l) if self.routes is not None else None
        if rest is not None:  # the rows read outside the top-k (routed's estimate_read): one more disjoint part
            win_out, win_lse = lse_merge(win_out, win_lse, rest[0].view_as(win_out), rest[1].view_as(win_lse))
        return self.xs[l], win_out, win_lse, self.part_o_dev[l], self.part_mz_dev[l]

    def _attend_window(
        self, l: int, x: torch.Tensor, q: torch.Tensor, q32: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Layer l after its attention inputs: the query to the host (the critical path ends here: the CPU
        searches meanwhile), this token's k/v into the window, and the window part of the attention."""
        self.xs[l] = x
        self.q_host[l].copy_(q32, non_blocking=True)
        routed = self.routes is not None and self.routes.handles(l)
        if routed:
            self.routes.route(l, q32)  # the ranking follows the query to the host
            if self.routes.attends(l):  # or the device reads the rows itself: the context part, no host work
                self.routes.attend(l, self.part_o_dev[l], self.part_mz_dev[l])
        if self.events_in_graph:
            self.q_ready[l].record()
        self.win_k[l].index_copy_(1, self.win_len, k[0])  # (Hkv, C, D) ← (Hkv, 1, D)
        self.win_v[l].index_copy_(1, self.win_len, v[0])
        out_w, lse_w = fixed_window_attention(
            q[0], self.win_k[l], self.win_v[l], self.bias, self.visible, self.scale
        )  # (H, 1, D), (H, 1)
        out_w, lse_w = out_w.view_as(self.win_out[l]), lse_w.view_as(self.win_lse[l])
        rest = self.routes.estimate_part(l) if routed else None
        if rest is not None:  # the unread clusters: a third disjoint part of the softmax (index/routed/device.py)
            out_w, lse_w = lse_merge(out_w, lse_w, rest[0].view_as(out_w), rest[1].view_as(lse_w))
        self.win_out[l].copy_(out_w)
        self.win_lse[l].copy_(lse_w)

    def _segment(self, l: int) -> None:
        """Run segment l eagerly, leaving its outputs in self.xs / q_host / win_out / win_lse / self.logits."""
        if l == 0:
            self._first()
        elif l < self.shape.n_layers:
            self._boundary_segment(l)
        else:
            self._last()

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
                    warnings.warn(
                        f"torch.compile of the decode step failed ({type(e).__name__}: {e}); running it uncompiled",
                        TopkWarning,
                        stacklevel=3,
                    )
                    self.compiled, self._boundary = False, layer_boundary
                    self._warm_up()
            torch.cuda.current_stream(self.device).wait_stream(side)
            pool = torch.cuda.graph_pool_handle()
            graphs = []
            for l in range(L + 1):  # captured in replay order, sharing one pool
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self._segment(l)
                graphs.append(g)
            self.graphs = graphs
        except Exception as e:  # noqa: BLE001 - graphs are an optimisation: fall back to eager
            self.graphs = None
            warnings.warn(
                f"CUDA graph capture failed ({type(e).__name__}: {e}); decoding eagerly", TopkWarning, stacklevel=2
            )

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
        if self.host_embedding is not None:
            self.host_embedding.stage(token, self.x_in)
        self.position.fill_(position)
        self.win_len.fill_(window.length)
