"""FP8 primary weights under FSDP2 (`parallel.fsdp=true` with `fp8.primary_weights=true`): weights all-gathered as
FP8 bytes.

Under FSDP each rank keeps a shard (rows of dim 0) of every parameter, its fp32 master, and FSDP2 all-gathers the
whole weight before the module's forward. For the weights of FP8 GEMMs whose recipe keeps one FP8 copy (tensorwise:
a scale per tensor or per expert; blockwise: a scale per 128x128 tile) the gather carries that copy instead of bf16
values: one byte per element, half the bytes, and the GEMMs find the weight already quantised. This uses FSDP2's
all-gather extension (a sharded parameter's local tensor that defines `fsdp_pre_all_gather` / `fsdp_post_all_gather`):

- `Fp8ShardedWeight` wraps the local fp32 shard (`hp_shard`); every other operation on it (the optimizer's update,
  checkpoint loading, FSDP's own padding and copies) runs on the wrapped tensor. Before a gather it takes the largest
  magnitude of each scale group among its rows (of their bf16 rounding, as the weights are quantised without
  FSDP; per row and 128-column block first, so nothing per element is indexed), one all-reduce (max) over the shard
  group gives every rank the whole weight's maxima, and each rank quantises its own rows with the scales that follow: the bytes and scales quantising the whole gathered weight
  gives (a scale group may straddle two shards; quantising an element needs only its group's scale).
- `Fp8GatheredWeight` is the unsharded weight the module sees during forward and backward: the gathered bytes and
  the scales, exposed as `fp8_primary` (what moecore/kernels/fp8_gemm.py and fp8_grouped.py read for FP8 primary
  weights); any other use of it computes on its dequantised values. Its gradient is an ordinary bf16 tensor, which
  FSDP reduce-scatters as it does every other.

Rowwise weights keep two FP8 layouts whose column scales need whole columns of the weight: they are gathered in bf16
as without primary weights (the distributed optimizer does the same, moecore/parallel/fp8_gather.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from moecore.kernels import fp8_quant as fq
from moecore.parallel.fp8_gather import ONE_BYTE_RECIPES, RowBlocks, scale_shape

E4M3 = torch.float8_e4m3fn

# FSDP2 pads, slices, views and copies a sharded parameter's local tensor: those results stay wrapped
_KEEP_WRAPPED = {
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default,
}
# the unsharded weight's views (FSDP's as_strided to the parameter's shape, nn.Parameter's detach)
_VIEWS = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten.view.default,
}


def _wrapper(cls, like: torch.Tensor, dtype: torch.dtype, requires_grad: bool = False) -> torch.Tensor:
    return torch.Tensor._make_wrapper_subclass(
        cls, like.size(), strides=like.stride(), storage_offset=like.storage_offset(), dtype=dtype,
        layout=like.layout, device=like.device, requires_grad=requires_grad,
    )  # fmt: skip


class Fp8ShardedWeight(torch.Tensor):
    """A sharded parameter's local tensor (`hp_shard`, fp32) that FSDP2 all-gathers as FP8 (module docstring)."""

    hp_shard: torch.Tensor
    gran: str
    pow2: bool

    @staticmethod
    def __new__(cls, hp_shard: torch.Tensor, gran: str, pow2: bool):
        return _wrapper(cls, hp_shard, hp_shard.dtype, hp_shard.requires_grad)

    def __init__(self, hp_shard: torch.Tensor, gran: str, pow2: bool) -> None:
        self.hp_shard, self.gran, self.pow2 = hp_shard, gran, pow2

    def __repr__(self) -> str:
        return f"Fp8ShardedWeight({self.gran}, {self.hp_shard!r})"

    def __reduce_ex__(self, protocol):  # saved (checkpoints) as the plain tensor it wraps: files stay precision-free
        return self.hp_shard.__reduce_ex__(protocol)

    def __tensor_flatten__(self):
        return ["hp_shard"], (self.gran, self.pow2)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: tuple, outer_size, outer_stride):
        return Fp8ShardedWeight(inner["hp_shard"], *meta)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        first = next(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, cls))
        if func is torch.ops.aten.detach.default:
            return cls(args[0].hp_shard.detach(), first.gran, first.pow2)
        args, kwargs = pytree.tree_map_only(cls, lambda t: t.hp_shard, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_WRAPPED:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, first.gran, first.pow2), out)

    def fsdp_pre_all_gather(self, mesh, outer_size: torch.Size, outer_stride, module, mp_policy):
        """This rank's rows quantised with the whole weight's scales (one all-reduce over the shard group)."""
        dtype = mp_policy.param_dtype or torch.bfloat16  # the compute dtype the weight is rounded to first
        shard = self.hp_shard  # this rank's rows, without FSDP's padding (the last ranks may hold fewer, or none)
        world = mesh.size()
        rank = mesh.get_local_rank() if world > 1 else 0
        # FSDP2 gives rank r the r-th chunk of ceil(rows / world) slices of dim 0; the all-gather input is that padded
        padded = (-(-outer_size[0] // world), *outer_size[1:])
        K = outer_size[-1]
        # whole rows of the weight viewed as [rows, K], rounded as the weights are without FSDP
        blocks = RowBlocks(shard.reshape(-1, K).to(dtype).float(), rank * math.prod(padded) // K, outer_size, self.gran)
        amax = blocks.maxima()
        if world > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
        s = fq.scale_from_amax(amax, E4M3, self.pow2)
        out = torch.zeros(math.prod(padded), dtype=torch.uint8, device=shard.device)  # the padding stays 0
        out[: shard.numel()] = blocks.cast(s).view(torch.uint8).reshape(-1)
        return (out.view(padded),), (s.view(scale_shape(outer_size, self.gran)),)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype: torch.dtype, *, out=None):
        """The gathered bytes and the scales as the unsharded weight (`out`: the one of an earlier gather, whose
        bytes FSDP has just refilled in place)."""
        (q,), (s,) = outputs, metadata
        if out is not None:
            out.s = s
            return None
        return Fp8GatheredWeight(q.view(E4M3), s, self.gran, param_dtype), (q,)


class Fp8GatheredWeight(torch.Tensor):
    """The unsharded weight as its FP8 copy: `fp8_primary` for the FP8 GEMMs; other uses see dequantised values."""

    q: torch.Tensor
    s: torch.Tensor
    gran: str

    @staticmethod
    def __new__(cls, q: torch.Tensor, s: torch.Tensor, gran: str, dtype: torch.dtype):
        return _wrapper(cls, q, dtype)

    def __init__(self, q: torch.Tensor, s: torch.Tensor, gran: str, dtype: torch.dtype) -> None:
        self.q, self.s, self.gran = q, s, gran

    def __repr__(self) -> str:
        return f"Fp8GatheredWeight({self.gran}, shape={tuple(self.shape)}, dtype={self.dtype})"

    @property
    def fp8_primary(self):
        from moecore.kernels.fp8_gemm import QOperand
        from moecore.kernels.fp8_grouped import GroupedWeight

        return (GroupedWeight if self.q.dim() == 3 else QOperand)(self.q, self.s, self.gran)

    def dequantized(self) -> torch.Tensor:
        if self.gran == "tensorwise" and self.q.dim() == 3:  # one scale per expert
            return (self.q.float() * self.s.view(-1, 1, 1)).to(self.dtype)
        return fq.dequantize(self.q, self.s, self.gran).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _VIEWS and isinstance(args[0], cls):
            w = args[0]
            return cls(func(w.q, *args[1:], **(kwargs or {})), w.s, w.gran, w.dtype)
        args, kwargs = pytree.tree_map_only(cls, lambda t: t.dequantized(), (args, kwargs or {}))
        return func(*args, **kwargs)


def gather_as_fp8(model: torch.nn.Module) -> list[str]:
    """Before `fully_shard`: make the one-byte FP8 GEMM weights (`fp8_gemm_recipe` tensorwise or blockwise, set by
    moecore/models/fp8.apply_fp8) gather as FP8; returns their names. Their values are unchanged."""
    done = []
    for mod_name, mod in model.named_modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            recipe = getattr(p, "fp8_gemm_recipe", None)
            if recipe is None or recipe.scaling not in ONE_BYTE_RECIPES:
                continue
            gran = "tensorwise" if recipe.scaling == "tensorwise" else "128x128"
            wrapped = torch.nn.Parameter(Fp8ShardedWeight(p.data, gran, recipe.pow2), requires_grad=p.requires_grad)
            wrapped.__dict__.update(p.__dict__)  # its recipe, ShardSpec and other tags
            setattr(mod, name, wrapped)
            done.append(f"{mod_name}.{name}" if mod_name else name)
    return done
