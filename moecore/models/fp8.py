"""Turning a built model's GEMMs into FP8 (`train.precision=fp8`): which modules, and the FP8 linear classes.

`apply_fp8(model, recipe, modules)` walks the model once and, for the module kinds named in
`fp8.modules`, makes their GEMMs FP8 (moecore/kernels/fp8_gemm.py, fp8_grouped.py):

- experts:        the routed experts (`GroupedExperts` with SwiGLU: its clipped form, gpt-oss's biased clamped
                  experts too) run `fp8_expert_ffn`;
- shared_experts: the linears of `SharedExpertMLP` (not its sigmoid gate, a [hidden -> 1] GEMV);
- dense_mlp:      the linears of the dense `MLP` blocks (dense layers, MTP layers);
- attention:      the projections of `Attention` / `MLAttention` (q, k, v, o and MLA's low-rank ones).

A linear becomes FP8 only where both its dimensions are multiples of the recipe's alignment (16, or 128
for blockwise); others (e.g. MLA's kv_a projection of 576 columns under blockwise) stay bf16 and are
listed by `apply_fp8`'s return value. The router, embeddings, output head, norms, DeepSeek sparse
attention's indexer and linear-attention projections are never touched. The swap changes a module's
class, not its parameters, so state dicts, checkpoints and HF export are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from moecore.kernels import fp8_quant as fq
from moecore.kernels.fp8_gemm import E4M3, Fp8Recipe, QOperand, fp8_linear, quant_rows
from moecore.kernels.fp8_grouped import quant_weights, rowwise_weight_pair
from moecore.parallel import comm
from moecore.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, tp_region_output, tp_size


class Fp8Linear(nn.Linear):
    """nn.Linear whose GEMMs run in FP8 (`fp8_recipe`)."""

    fp8_recipe: Fp8Recipe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.fp8_recipe)


class Fp8ColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear with FP8 GEMMs."""

    fp8_recipe: Fp8Recipe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_linear(x, self.weight, self.bias, self.fp8_recipe)
        if self.gather_output and tp_size(self.dims) > 1:
            y = comm.gather_from_region(y, self.dims.tp_group, dim=-1)
        return y


class Fp8RowParallelLinear(RowParallelLinear):
    """RowParallelLinear with FP8 GEMMs (the bias is added after the TP sum, as in the bf16 class)."""

    fp8_recipe: Fp8Recipe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tp_region_output(fp8_linear(x, self.weight, None, self.fp8_recipe), self.dims)
        return y if self.bias is None else y + self.bias


_FP8_CLASS = {
    nn.Linear: Fp8Linear,
    ColumnParallelLinear: Fp8ColumnParallelLinear,
    RowParallelLinear: Fp8RowParallelLinear,
}


def _kind(module: nn.Module) -> str | None:
    """Which fp8.modules entry a module belongs to (by class name, so this file imports no model code)."""
    name = type(module).__name__
    if name == "SharedExpertMLP":
        return "shared_experts"
    if name == "MLP":
        return "dense_mlp"
    if name in ("Attention", "MLAttention", "DSAttention"):
        return "attention"
    if name in ("GroupedExperts", "BiasedGroupedExperts"):
        return "experts"
    return None


def _fp8_weights(model: nn.Module) -> list[tuple[torch.Tensor, Fp8Recipe, bool]]:
    """(parameter, recipe, is an expert tensor) for every weight of an FP8 GEMM in the model."""
    out = []
    for mod in model.modules():
        recipe = getattr(mod, "fp8_recipe", None)
        if recipe is None:
            continue
        if isinstance(mod, nn.Linear):
            out.append((mod.weight, recipe, False))
        else:  # GroupedExperts
            out += [(mod.w13, recipe, True), (mod.w2, recipe, True)]
    return out


def quantize_primary(
    p: torch.Tensor, w: torch.Tensor, recipe: Fp8Recipe, grouped: bool, dtype: torch.dtype | None = None
) -> None:
    """Set the FP8 values parameter p computes with from w (p's values, or its fp32 master: rounded to `dtype`,
    p's compute dtype, first): `p.fp8_primary` for the forward GEMM and, rowwise, `p.fp8_primary_t` (w^T along
    the other dim, for the input-gradient GEMM; tensorwise and 128x128 scales serve both layouts)."""
    w = w.to(dtype or p.dtype)
    if recipe.scaling != "rowwise":
        p.fp8_primary = quant_weights(w, recipe) if grouped else quant_rows(w, recipe, E4M3, True)
        return
    if grouped:
        p.fp8_primary, p.fp8_primary_t = rowwise_weight_pair(w, recipe)
        return
    (q, s), (qt, st) = fq.quantize_weight_layouts(w.unsqueeze(0), E4M3, recipe.pow2)
    p.fp8_primary, p.fp8_primary_t = QOperand(q[0], s[0], "rowwise"), QOperand(qt[0], st[0], "rowwise")


def enable_primary_weights(model: nn.Module, mixed) -> int:
    """Keep every FP8 GEMM weight in FP8 between steps (module docstring); `mixed` is the run's MixedPrecision,
    whose fp32 masters the FP8 copies are quantised from. Returns the number of parameters turned."""
    n = 0
    for p, recipe, grouped in _fp8_weights(model):
        if p not in mixed.masters:
            raise ValueError("FP8 primary weights need fp32 master weights (optim.master_weights=fp32)")

        def rebuild(master: torch.Tensor, p=p, recipe=recipe, grouped=grouped, dtype=p.dtype) -> None:
            # from the bf16 rounding of the master, as the weights are quantised without primary weights
            # (so both modes compute the same; the dtype is fixed here, not read from p, which may be lending
            # its fp32 master when this runs); the bf16 copy lives only for this call
            with torch.no_grad():
                quantize_primary(p, master, recipe, grouped, dtype)

        rebuild(mixed.masters[p])
        p.data = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)  # shape and dtype only
        mixed.recast[p] = rebuild
        n += 1
    if n:
        model._register_state_dict_hook(_state_dict_with_fp8_values)
    return n


def _dequantized(p: torch.Tensor) -> torch.Tensor:
    """The values an FP8 primary weight computes with, in the parameter's dtype."""
    w = p.fp8_primary
    if w.gran == "tensorwise" and w.q.dim() == 3:  # one scale per expert
        return (w.q.float() * w.s.view(-1, 1, 1)).to(p.dtype)
    return fq.dequantize(w.q, w.s, w.gran).to(p.dtype)


def _state_dict_with_fp8_values(module: nn.Module, state: dict, prefix: str, local_metadata) -> None:
    """A state dict taken outside MixedPrecision.fp32_view (which lends the masters, as checkpoints do) shows
    each FP8 primary weight's dequantised values instead of its placeholder."""
    params = dict(module.named_parameters())
    for name, p in params.items():
        key = prefix + name
        if hasattr(p, "fp8_primary") and key in state and p.dim() and all(st == 0 for st in p.stride()):
            state[key] = _dequantized(p)


def apply_fp8(model: nn.Module, recipe: Fp8Recipe, modules: list[str] | tuple[str, ...]) -> dict:
    """Make the GEMMs of `modules` FP8 in place; returns {"fp8": [names], "bf16": [names kept bf16, why]}."""
    done, kept = [], []
    align = recipe.alignment
    for name, mod in model.named_modules():
        kind = _kind(mod)
        if kind is None or kind not in modules:
            continue
        if kind == "experts":
            if getattr(mod, "activation", None) == "swiglu":  # gpt-oss's biased experts too (their kind aside)
                mod.fp8_recipe = recipe
                done.append(name)
            else:
                kept.append(f"{name} (activation {getattr(mod, 'activation', '?')}: FP8 experts are SwiGLU)")
            continue
        for child_name, child in mod.named_children():  # direct linears only (not e.g. the DSA indexer's)
            cls = _FP8_CLASS.get(type(child))
            if cls is None:
                continue
            full = f"{name}.{child_name}"
            if child.in_features % align or child.out_features % align:
                kept.append(f"{full} ({child.out_features}x{child.in_features} not multiples of {align})")
                continue
            child.__class__ = cls
            child.fp8_recipe = recipe
            done.append(full)
    for p, r, _ in _fp8_weights(model):  # the distributed optimizer buckets them apart (parallel/fp8_gather.py)
        p.fp8_gemm_recipe = r
    return {"fp8": done, "bf16": kept}
