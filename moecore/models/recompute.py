"""Output recomputation: run `consumer(fn(*inputs))` without keeping fn's outputs for the backward pass.

Checkpointing a module on its own does not free its output: `torch.utils.checkpoint` drops what the
module keeps internally, but the next module saves the output as its own input. A norm's output is
saved by the q/k/v projection, the router and the shared experts; MLA's up-projected q, k, v are
saved by the attention kernel. Megatron-Core's "layernorm" and "mla_up_proj" recomputation therefore
discard the output after the consumer's forward and recompute it before the consumer's backward.
`recompute_output` does the same with saved-tensor hooks: while the consumer runs forward, every
tensor autograd saves that lives in the storage of one of fn's outputs (the output or a view of it)
is replaced by a marker; when backward unpacks a marker, fn(*inputs) is recomputed once (without
gradient) and the same view of the recomputed output is returned. fn must be deterministic (norms,
linear maps and RoPE are) so the recomputed values are the same bits.

The inputs are kept for the recomputation. When this runs inside another `recompute_output`
consumer (MLA's up-projection inside the attention norm's consumer), the inputs are saved through
the outer hooks, so an input that is the outer output is not kept either.

Tensors a custom autograd Function keeps outside `save_for_backward` are not seen by the hooks and
stay alive: correct, only without the saving.

`checkpoint_module(module, *args)` is `torch.utils.checkpoint` (non-reentrant) for a module whose forward makes
choices a recomputation must repeat rather than make again: a replayed router's expert choice, the averaged counts
of `global_aux_loss`. Each such submodule (one with a `recompute_memo` attribute: `MoELayer`, `TopKRouter`) gets a
dict for the checkpointed call; the forward writes its choices there and every recomputation of that call reads
them back. The schedules that split backward into input- and weight-gradient passes (zero bubble, V) recompute a
layer once in each pass, so a first-in-first-out pairing of forwards and recomputations would not do. Nested
checkpoints share the outermost call's dicts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop


class _Recompute:
    """A saved tensor replaced by a view into output `index` of the recomputed fn."""

    __slots__ = ("index", "size", "stride", "offset")

    def __init__(self, index: int, t: torch.Tensor) -> None:
        self.index = index
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


def _outer_hooks():
    """The (pack, unpack) hooks of an enclosing `recompute_output`, or None."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(False) if top is not None else None
    if hooks is not None and getattr(hooks[0], "_moecore_recompute", False):
        return hooks
    return None


def recompute_output(fn: Callable, inputs: tuple, consumer: Callable):
    """`consumer(fn(*inputs))`, with fn's outputs (a tensor or a tuple of tensors) recomputed in
    backward instead of saved by the consumer's ops."""
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    keys = {_storage_key(o): i for i, o in enumerate(outs)}
    keys.pop(None, None)
    outer = _outer_hooks()
    saved = [outer[0](t) if outer is not None and isinstance(t, torch.Tensor) else _detach(t) for t in inputs]
    cache: list[tuple] = []

    def pack(t: torch.Tensor):
        i = keys.get(_storage_key(t))
        return t if i is None else _Recompute(i, t)

    def unpack(p):
        if not isinstance(p, _Recompute):
            return p
        if not cache:
            args = [outer[1](s) if outer is not None and not _plain(s) else s for s in saved]
            with torch.no_grad():
                again = fn(*args)
            cache.append(again if isinstance(again, tuple) else (again,))
        return cache[0][p.index].as_strided(p.size, p.stride, p.offset)

    pack._moecore_recompute = True  # lets a nested recompute_output save its inputs through these hooks
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return consumer(out)


def _storage_key(t: torch.Tensor) -> tuple | None:
    """What identifies t's memory; None for a wrapper tensor subclass, which has no storage of its own (an FSDP
    weight gathered as FP8, moecore/parallel/fsdp_fp8.py) and is never one of fn's outputs."""
    if type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        return None
    return (t.untyped_storage().data_ptr(), t.dtype, t.device)


def _detach(v):
    return v.detach() if isinstance(v, torch.Tensor) else v


def _plain(v) -> bool:
    """A saved input that is not a packed object of the outer hooks (a non-tensor argument)."""
    return not isinstance(v, (torch.Tensor, _Recompute))


def _memo_holders(module: nn.Module) -> list[nn.Module]:
    """The submodules of `module` that keep per-forward choices for recomputation (found once, then cached)."""
    holders = module.__dict__.get("_memo_holders")
    if holders is None:
        holders = [m for m in module.modules() if hasattr(m, "recompute_memo")]
        module.__dict__["_memo_holders"] = holders
    return holders


class _MemoScope:
    """Sets each holder's `recompute_memo` to this checkpointed call's dict while the forward (`forward=True`) or a
    recomputation runs; re-enterable, since torch enters the recomputation's context once per recomputation."""

    def __init__(self, holders: list[nn.Module], memos: dict[int, dict], forward: bool) -> None:
        self.holders, self.memos, self.forward = holders, memos, forward
        self.set_here: list[nn.Module] = []

    def __enter__(self) -> None:
        # The outermost checkpoint owns the dicts: a nested one, entered with the holder's dict already set (in
        # the forward or inside the outer recomputation), keeps and reuses that one.
        self.set_here = []
        for h in self.holders:
            key = id(h)
            if h.recompute_memo is None:
                if self.forward or key in self.memos:
                    h.recompute_memo = self.memos.setdefault(key, {})
                    self.set_here.append(h)
            elif self.forward:
                self.memos[key] = h.recompute_memo

    def __exit__(self, *exc) -> None:
        for h in self.set_here:
            h.recompute_memo = None
        self.set_here = []


def checkpoint_module(module: nn.Module, *args):
    """`checkpoint(module, *args, use_reentrant=False)`, with each memo holder inside seeing one dict for this
    call in its forward and in every recomputation of it (see the module docstring).

    A decoder layer on hyper-connected streams (DeepSeek-V4) is recomputed whole, without torch's early stop (which
    ends a recomputation once the tensors backward needs are back): on a GPU, with the allocator's history being
    recorded (`log.oom_snapshot`, on by default), the early stop inside the layer's last stream merge raised
    `SystemError: error return without exception set` (docs/benchmarks.md, run CY). Only the merge's few
    elementwise ops run again."""
    holders = _memo_holders(module) if isinstance(module, nn.Module) else []
    hyper = getattr(module, "attn_hc", None) is not None
    with set_checkpoint_early_stop(False) if hyper else contextlib.nullcontext():
        if not holders:
            return checkpoint(module, *args, use_reentrant=False)
        memos: dict[int, dict] = {}
        scopes = (_MemoScope(holders, memos, True), _MemoScope(holders, memos, False))
        return checkpoint(module, *args, use_reentrant=False, context_fn=lambda: scopes)
