"""CUDA graphs for decoder layers (`train.cuda_graphs`): capture a part of each layer once, replay it after.

Modes (docs/train.md): `attention` captures each layer's attention norm + attention; `moe_static` also
captures the static head of each MoE block (the MLP norm and the router: logits, top-k, weights,
routing losses); `full` captures whole decoder layers, the MoE block included, which needs the
sync-free MoE layer (`moe.sync_free=true`: nothing from routing to combine reads the device back).

`GraphedBlock(module)` captures `module(*tensors) -> tuple of tensors` on its first call that is
eligible (training, gradients on, CUDA tensors) into a forward graph and a backward graph, as
torch.cuda.make_graphed_callables does, and from then on runs an autograd Function that copies the
inputs into the graph's static inputs, replays the forward graph, and in backward copies the output
gradients in and replays the backward graph. Unlike make_graphed_callables it returns copies of the
static outputs and gradients: autograd may keep a parameter gradient it receives as `.grad` without
copying it, and the next micro-batch's replay would overwrite a gradient aliasing the graph's memory
(gradient accumulation would double the last micro-batch instead). Calls that do not match the
captured shapes, dtypes and argument pattern (evaluation, a different batch shape) run eagerly.

Correctness rules (enforced by config validation, moecore/config/root.py): one forward of a layer is
followed by its backward before the next forward of that layer (so no pipeline schedule); with
activation recomputation a captured part is replayed again in backward, which recomputes the same
values, but its activations stay in the graph's memory pool (recomputation saves no memory there);
the buffers a captured MoE block updates in place (the expert-bias token counts) are restored after
the warm-up iterations of the capture, and `full` refuses the options whose bookkeeping runs in
Python during the forward (global_aux_loss, router replay, recomputation of the MoE block).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

MODES = ("none", "attention", "moe_static", "full")
WARMUP_ITERS = 3


def _flat(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


class _Simulated:
    """Stands in for a torch.cuda.CUDAGraph in CPU tests: `replay()` runs the recorded step again
    (the same static tensors in and out, so the replay plumbing is what the tests check)."""

    def __init__(self, step) -> None:
        self.replay = step


class _Capture:
    """The two graphs of one block and their static tensors (`simulate`: CPU stand-ins, for tests)."""

    def __init__(self, module: nn.Module, args: tuple[torch.Tensor, ...], simulate: bool = False) -> None:
        self.module = module
        self.params = tuple(p for p in module.parameters() if p.requires_grad)
        self.static_in = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
        self.signature = _signature(args)
        self.diff_in = [t for t in (*self.static_in, *self.params) if t.requires_grad]
        buffers = [b.detach().clone() for b in module.buffers()]
        # No saved-tensor hooks of an enclosing checkpoint / recompute_output may see the capture.
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            if simulate:
                grads = self._simulate()
            else:
                grads = self._capture()
        self.static_grads = dict(zip((id(t) for t in self.diff_in), grads))
        self.grad_slots = [id(t) for t in (*self.static_in, *self.params)]
        with torch.no_grad():  # the warm-up ran the block's in-place buffer updates: undo them
            for b, saved in zip(module.buffers(), buffers):
                b.copy_(saved)

    def _grad(self, outs: tuple, douts: list) -> tuple:
        req = [outs[i] for i in self.out_req]
        if not req:
            return tuple(None for _ in self.diff_in)
        return torch.autograd.grad(req, self.diff_in, douts, allow_unused=True)

    def _capture(self) -> tuple:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_ITERS):  # compiles kernels, settles the allocator
                outs = _flat(self.module(*self.static_in))
                self.out_req = [i for i, o in enumerate(outs) if o.requires_grad]
                self._grad(outs, [torch.zeros_like(outs[i]) for i in self.out_req])
                del outs
        torch.cuda.current_stream().wait_stream(side)
        self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(self.fwd, pool=pool, capture_error_mode="thread_local"):
            outs = _flat(self.module(*self.static_in))
        self.static_out = outs
        self.out_req = [i for i, o in enumerate(outs) if o.requires_grad]
        self.static_dout = [torch.zeros_like(outs[i]) for i in self.out_req]
        with torch.cuda.graph(self.bwd, pool=pool, capture_error_mode="thread_local"):
            return self._grad(outs, self.static_dout)

    def _simulate(self) -> tuple:
        outs = _flat(self.module(*self.static_in))
        self.out_req = [i for i, o in enumerate(outs) if o.requires_grad]
        self.static_out = tuple(o.detach().clone() for o in outs)
        self.static_dout = [torch.zeros_like(outs[i]) for i in self.out_req]
        grads = [None if g is None else g.clone() for g in self._grad(outs, self.static_dout)]
        live: list[tuple] = []

        def fwd() -> None:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                outs = _flat(self.module(*self.static_in))
            live[:] = [outs]
            with torch.no_grad():
                for static, o in zip(self.static_out, outs):
                    static.copy_(o)

        def bwd() -> None:
            with torch.enable_grad():
                new = self._grad(live[0], self.static_dout)
            with torch.no_grad():
                for static, g in zip(grads, new):
                    if static is not None:
                        static.copy_(g)

        self.fwd, self.bwd = _Simulated(fwd), _Simulated(bwd)
        return tuple(grads)


def _signature(args: tuple) -> tuple:
    return tuple((tuple(a.shape), a.dtype, a.device, a.requires_grad) for a in args)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cap: _Capture, *inputs):
        n = len(cap.static_in)
        for static, new in zip(cap.static_in, inputs[:n]):
            if static.data_ptr() != new.data_ptr():
                static.detach().copy_(new)
        cap.fwd.replay()
        ctx.cap = cap
        outs = tuple(o.detach().clone() for o in cap.static_out)
        ctx.mark_non_differentiable(*(o for i, o in enumerate(outs) if i not in cap.out_req))
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *douts):
        cap: _Capture = ctx.cap
        for slot, i in zip(cap.static_dout, cap.out_req):
            g = douts[i]
            if g is None:
                slot.zero_()
            else:
                slot.copy_(g)
        cap.bwd.replay()
        grads = []
        for key in cap.grad_slots:
            g = cap.static_grads.get(key)
            grads.append(None if g is None else g.clone())
        return (None, *grads)


class GraphedBlock:
    """`module(*tensors)` captured on the first eligible call, replayed afterwards (module docstring)."""

    def __init__(self, module: nn.Module, simulate: bool = False) -> None:
        self.module = module
        self.simulate = simulate
        self.capture: _Capture | None = None
        self.replays = 0  # forward replays so far (tests, diagnostics)

    def eligible(self, args: tuple) -> bool:
        on_device = all(isinstance(a, torch.Tensor) and (a.is_cuda or self.simulate) for a in args)
        # the wrapper itself is outside the model (model.train() / eval() never reach it): ask its parts
        training = all(m.training for m in self.module.children())
        return training and torch.is_grad_enabled() and on_device

    def __call__(self, *args: torch.Tensor) -> tuple:
        if not self.eligible(args):
            return _flat(self.module(*args))
        if self.capture is None:
            self.capture = _Capture(self.module, args, self.simulate)
        elif _signature(args) != self.capture.signature:
            return _flat(self.module(*args))
        self.replays += 1
        return _Replay.apply(self.capture, *args, *self.capture.params)


# ---------------------------------------------------------------- the captured parts of a decoder layer


class _Attention(nn.Module):
    """attention(attn_norm(x)): the first half of a decoder layer."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.norm, self.attn = layer.attn_norm, layer.attn

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.attn(self.norm(x), position_ids)


class _MoEHead(nn.Module):
    """The static head of an MoE block: mlp_norm + routing + the dispatch preprocessing (the assignments' sort
    by expert; moecore/moe/layer.py `MoELayer.route`, `MoELayer.presort`)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.norm, self.moe = layer.mlp_norm, layer.mlp
        self.stat_keys: list[str] = []

    def forward(self, x: torch.Tensor, *mask: torch.Tensor) -> tuple:
        h = self.norm(x)
        m = mask[0] if mask else None
        routed = self.moe.presort(self.moe.route(h, m, m))  # no tensor parallel here: all tokens are this rank's
        self.stat_keys = sorted(routed.stats)
        empty = h.new_empty(0)  # stands for None (graph outputs are tensors)
        counts = routed.counts_E if routed.counts_E is not None else empty
        ps = routed.presorted
        inv = ps.inv if ps is not None and ps.inv is not None else empty
        sort = (ps.sorted_e, ps.order, ps.counts, inv) if ps is not None else (empty, empty, empty, empty)
        head = (h, routed.idx_TK, routed.weight_TK, routed.loss, counts, *sort)
        return (*head, *(routed.stats[k] for k in self.stat_keys))


class _WholeLayer(nn.Module):
    """A whole decoder layer; outputs flattened to tensors: (x, [aux loss, *aux stats])."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.stat_keys: list[str] = []

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, *mask: torch.Tensor) -> tuple:
        out, aux = self.layer.eager_forward(x, position_ids, mask[0] if mask else None)
        if aux is None:
            return (out,)
        self.stat_keys = sorted(aux.stats)
        return (out, aux.loss, *(aux.stats[k] for k in self.stat_keys))


class LayerGraphs:
    """What `train.cuda_graphs` captures of one decoder layer; the layer calls these (models/transformer.py)."""

    def __init__(self, layer: nn.Module, mode: str, simulate: bool = False) -> None:
        self.mode = mode
        self.attention = GraphedBlock(_Attention(layer), simulate) if mode in ("attention", "moe_static") else None
        has_route = hasattr(layer.mlp, "route")  # MoELayer (not gpt-oss's BiasedMoELayer)
        self._head = _MoEHead(layer) if mode == "moe_static" and layer.is_moe and has_route else None
        self.moe_head = GraphedBlock(self._head, simulate) if self._head is not None else None
        self._whole = _WholeLayer(layer) if mode == "full" else None
        self.whole = GraphedBlock(self._whole, simulate) if self._whole is not None else None

    def layer_forward(self, x: torch.Tensor, position_ids: torch.Tensor, loss_mask: torch.Tensor | None):
        """The whole layer from its graph: (x, MoELayerAux | None)."""
        from moecore.moe.layer import MoELayerAux

        outs = self.whole(x, position_ids, *(() if loss_mask is None else (loss_mask,)))
        if len(outs) == 1:
            return outs[0], None
        return outs[0], MoELayerAux(loss=outs[1], stats=dict(zip(self._whole.stat_keys, outs[2:])))

    def routed(self, x: torch.Tensor, loss_mask: torch.Tensor | None):
        """(mlp_norm(x), the MoE block's `Routed`) from the captured head."""
        from moecore.moe.layer import Routed
        from moecore.moe.permute import SortedAssignments

        outs = self.moe_head(x, *(() if loss_mask is None else (loss_mask,)))
        h, idx, weight, loss, counts, sorted_e, order, sorted_counts, inv = outs[:9]
        stats = dict(zip(self._head.stat_keys, outs[9:]))
        presorted = (
            SortedAssignments(sorted_e, order, sorted_counts, inv if inv.numel() else None) if order.numel() else None
        )
        return h, Routed(idx, weight, loss, stats, counts if counts.numel() else None, presorted)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder spine's layers (`model.layers`; multi-token-prediction blocks stay eager)."""
    return [m for m in getattr(model, "layers", []) if hasattr(m, "cuda_graphs") and hasattr(m, "eager_forward")]


def apply_cuda_graphs(model: nn.Module, mode: str, simulate: bool = False) -> int:
    """Give every decoder layer of `model` its `LayerGraphs` for `mode` (none: remove them); returns how many.

    `simulate`: CPU stand-ins for the graphs that re-run the captured step (tests of the replay plumbing).
    """
    if mode not in MODES:
        raise ValueError(f"train.cuda_graphs={mode!r} is invalid: allowed: {' | '.join(MODES)}")
    layers = _decoder_layers(model)
    for m in layers:
        m.cuda_graphs = None if mode == "none" else LayerGraphs(m, mode, simulate)
    return len(layers)


@contextlib.contextmanager
def eager_layers(model: nn.Module):
    """Run `model`'s decoder layers eagerly inside the block (tests, debugging)."""
    saved = [(m, m.cuda_graphs) for m in _decoder_layers(model)]
    try:
        for m, _ in saved:
            m.cuda_graphs = None
        yield
    finally:
        for m, g in saved:
            m.cuda_graphs = g
