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
"""

from __future__ import annotations

from collections.abc import Callable

import torch


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
