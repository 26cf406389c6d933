"""Output recomputation: run `consumer(fn(x))` without keeping fn(x) for the backward pass.

Checkpointing a norm on its own saves nothing: `torch.utils.checkpoint` drops what the norm keeps
internally, but the next module (the attention's q/k/v projection, the router, the shared experts)
saves the norm's *output* as its input for the weight gradient. Megatron-Core's "layernorm"
recomputation therefore discards the output after the consumer's forward and recomputes it before
the consumer's backward. `recompute_output` does the same with saved-tensor hooks: while the
consumer runs forward, every tensor autograd saves that lives in fn(x)'s storage (the output or a
view of it) is replaced by a marker; when backward unpacks a marker, fn(x) is recomputed once
(without gradient) and the same view of it is returned. fn's own backward keeps x, which the
residual stream holds anyway. fn must be deterministic (a norm is) so the recomputed values are the
same bits.

Tensors a custom autograd Function keeps outside `save_for_backward` are not seen by the hooks and
stay alive: correct, only without the saving.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class _Recompute:
    """A saved tensor replaced by a view into the recomputed output."""

    __slots__ = ("size", "stride", "offset")

    def __init__(self, t: torch.Tensor) -> None:
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


def recompute_output(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, consumer: Callable):
    """`consumer(fn(x))`, with fn(x) recomputed in backward instead of saved by the consumer's ops."""
    h = fn(x)
    ptr, dtype, device = h.untyped_storage().data_ptr(), h.dtype, h.device
    x_saved = x.detach()  # the same storage as x (held by the residual stream), not a copy
    cache: dict[str, torch.Tensor] = {}

    def pack(t: torch.Tensor):
        if t.dtype == dtype and t.device == device and t.untyped_storage().data_ptr() == ptr:
            return _Recompute(t)
        return t

    def unpack(p):
        if not isinstance(p, _Recompute):
            return p
        if "h" not in cache:
            with torch.no_grad():
                cache["h"] = fn(x_saved)
        return cache["h"].as_strided(p.size, p.stride, p.offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return consumer(h)
