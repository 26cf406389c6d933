"""Activation offloading: the tensors chosen modules save for backward wait in host memory, not on the GPU.

`apply_offload(model, names)` (`model.offload_modules`, the names of `model.recompute_modules`) wraps
the forward of every matching module in `torch.autograd.graph.saved_tensors_hooks`:

| name | modules whose saved tensors are offloaded |
|---|---|
| moe | the whole MoE block (router, permutation, experts, shared experts) |
| moe_act | the routed experts (the expert FFN's input rows, w13 output and probabilities) |
| shared_experts | the shared expert MLP |
| mlp | the dense MLP |
| core_attn, mla_up_proj | the attention block (GQA, MLA or DeltaNet) |
| norm | the two RMSNorms of each decoder layer |

Pack (forward): a saved tensor of at least `min_bytes` that is not a parameter (or a view of one) is
copied to pinned host memory on a side stream, after the side stream waits for the work that made
it; `record_stream` keeps its GPU block from being reused before the copy has read it, and the GPU
tensor is dropped. Unpack (backward): the tensors a module saved come back as one group on the side
stream, and the group saved just before it (the next one backward reaches) is prefetched at the same
time, so its copy overlaps this module's backward; the compute stream waits for the copy's event
before it uses a tensor. The bytes come back unchanged and with their strides (a view's whole span is
copied), so backward runs the same kernels and gradients are bit-identical to a run without offloading.
On CPU the "host" copy is a copy in place (same mechanics, no memory saved).

Forwards that run without gradients, in eval mode, or again inside backward (recomputation of a
checkpointed module) are not offloaded. With pipeline parallelism every in-flight micro-batch's
activations of these modules wait on the host (no per-stage budget yet).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

OFFLOAD_CHOICES = ("core_attn", "mla_up_proj", "moe", "mlp", "moe_act", "norm", "shared_experts")
MIN_BYTES = 1 << 16  # smaller saved tensors (indices of tiny batches, statistics) stay where they are


def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _copy_like(t: torch.Tensor, device: torch.device, pin_memory: bool = False) -> torch.Tensor:
    """A copy of t on `device` (asynchronous where the devices allow) with t's sizes and strides, so that backward
    runs the same kernels on it: a contiguous copy of a strided view (a column slice, say) can take another BLAS
    path and change the last bits of the gradients. A dense tensor is copied as it is; any other view with the
    whole stretch of storage it spans (gaps included, at most a few times its size for the slices saved here)."""
    if t.numel() == 0 or torch.empty_like(t, device="meta").stride() == t.stride():  # dense, non-overlapping
        out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device, pin_memory=pin_memory)
        return out.copy_(t, non_blocking=True)
    span = 1 + sum((n - 1) * st for n, st in zip(t.size(), t.stride()))
    buf = torch.empty(span, dtype=t.dtype, device=device, pin_memory=pin_memory)
    buf.copy_(t.as_strided((span,), (1,), t.storage_offset()), non_blocking=True)
    return buf.as_strided(t.size(), t.stride(), 0)


def _is_param_like(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    return isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)


@dataclass
class _Group:
    """The tensors one module call saved, in order; `ready` when they are back on the device."""

    items: list = field(default_factory=list)  # weak references: autograd owns the packed tensors
    event: object = None  # CUDA event of the device-to-host copies (or the prefetch)
    fetched: bool = False


class _Saved:
    """A saved tensor waiting in host memory."""

    __slots__ = ("group", "host", "device", "back", "__weakref__")

    def __init__(self, group: int, host: torch.Tensor, device: torch.device) -> None:
        self.group, self.host, self.device, self.back = group, host, device, None


class ActivationOffloader:
    """The hooks and stream state of one model (no global state); `stats` counts what moved."""

    def __init__(self, min_bytes: int = MIN_BYTES) -> None:
        self.min_bytes = min_bytes
        self.groups: dict[int, _Group] = {}  # by call number (forward order)
        self._next = 0
        self._stream: torch.cuda.Stream | None = None
        self._contexts: list = []
        self.stats = {"packed": 0, "unpacked": 0, "bytes": 0}

    # ------------------------------------------------------------------ streams
    def _side(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    # ------------------------------------------------------------------ forward: pack
    def pack(self, t: torch.Tensor):
        if (
            not isinstance(t, torch.Tensor)
            or t.numel() * t.element_size() < self.min_bytes
            or _is_param_like(t)
            or t.layout != torch.strided
        ):
            return t
        gi = self._next - 1
        group = self.groups[gi]
        if t.is_cuda:
            side = self._side(t.device)
            side.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(side):
                host = _copy_like(t, torch.device("cpu"), pin_memory=True)
            t.record_stream(side)
            group.event = side.record_event()
        else:
            host = _copy_like(t.detach(), t.device)
        self.stats["packed"] += 1
        self.stats["bytes"] += t.numel() * t.element_size()
        item = _Saved(gi, host, t.device)
        group.items.append(weakref.ref(item))
        return item

    # ------------------------------------------------------------------ backward: unpack
    def _fetch(self, gi: int) -> None:
        """Start copying group gi back (side stream); no-op when it is already on its way."""
        if gi not in self.groups or self.groups[gi].fetched:
            return
        group = self.groups[gi]
        group.fetched = True
        items = [i for i in (ref() for ref in group.items) if i is not None and i.host is not None]
        for item in items:
            if item.device.type != "cuda":
                item.back = item.host
                continue
            side = self._side(item.device)
            with torch.cuda.stream(side):
                item.back = _copy_like(item.host, item.device)
        cuda = [i for i in items if i.device.type == "cuda"]
        if cuda:
            group.event = self._side(cuda[0].device).record_event()

    def unpack(self, p):
        if not isinstance(p, _Saved):
            return p
        self._fetch(p.group)
        self._fetch(p.group - 1)  # the module backward reaches next: overlap its copy with this backward
        group = self.groups[p.group]
        if p.device.type == "cuda" and group.event is not None:
            main = torch.cuda.current_stream(p.device)
            main.wait_event(group.event)
            p.back.record_stream(main)
        self.stats["unpacked"] += 1
        out, p.host = p.back, None
        return out

    # ------------------------------------------------------------------ module hooks
    def enter(self, module: nn.Module, args) -> None:
        active = module.training and torch.is_grad_enabled() and not _in_backward()
        ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack) if active else None
        if ctx is not None:
            self.groups[self._next] = _Group()
            self._next += 1
            ctx.__enter__()
        self._contexts.append(ctx)

    def exit(self, module: nn.Module, args, output) -> None:
        ctx = self._contexts.pop()
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def new_step(self) -> None:
        """Forget the groups of finished backward passes (called before each forward of the model)."""
        if not self._contexts:  # keep groups that a pending backward (a graph still alive) will unpack
            self.groups = {k: g for k, g in self.groups.items() if any(_pending(r) for r in g.items)}


def _pending(ref: weakref.ref) -> bool:
    item = ref()
    return item is not None and item.host is not None


def modules_for(model: nn.Module, names: list[str] | tuple) -> list[nn.Module]:
    """The modules `names` select in a MoETransformer (table in the module docstring)."""
    from moecore.models.attention import Attention
    from moecore.models.linear_attention import GatedDeltaNet
    from moecore.models.mla import MLAttention
    from moecore.models.mlp import MLP
    from moecore.moe.experts import GroupedExperts
    from moecore.moe.layer import MoELayer, SharedExpertMLP

    kinds: dict[str, tuple] = {
        "moe": (MoELayer,),
        "moe_act": (GroupedExperts,),
        "shared_experts": (SharedExpertMLP,),
        "mlp": (MLP,),
        "core_attn": (Attention, MLAttention, GatedDeltaNet),
        "mla_up_proj": (MLAttention,),
    }
    wanted = set(names)
    out: list[nn.Module] = []
    for mod in model.modules():
        if any(isinstance(mod, kinds[n]) for n in wanted if n in kinds):
            out.append(mod)
    if "norm" in wanted:
        for mod in model.modules():
            for child in ("attn_norm", "mlp_norm"):
                norm = getattr(mod, child, None)
                if isinstance(norm, nn.Module):
                    out.append(norm)
    # an outer module's hooks cover its children: keep the outermost of nested selections
    chosen = set(map(id, out))
    covered = {id(sub) for mod in out for sub in mod.modules() if sub is not mod}
    return [m for m in out if id(m) in chosen and id(m) not in covered]


def apply_offload(model: nn.Module, names: list[str] | tuple, min_bytes: int = MIN_BYTES) -> ActivationOffloader:
    """Offload the saved tensors of the modules `names` select; returns the offloader (also `model._offloader`)."""
    for n in names:
        if n not in OFFLOAD_CHOICES:
            raise ValueError(f"model.offload_modules={n!r} is invalid: allowed: {' | '.join(OFFLOAD_CHOICES)}")
    off = ActivationOffloader(min_bytes)
    for mod in modules_for(model, names):
        mod.register_forward_pre_hook(off.enter)
        mod.register_forward_hook(off.exit, always_call=True)
    model.register_forward_pre_hook(lambda m, a: off.new_step())
    model._offloader = off
    return off
