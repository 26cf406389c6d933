"""MoE layer forward + backward: moecore's MoELayer against transformers' MoE block, same inputs, same GPU.

For each shape (hidden, expert ffn, experts, top-k, tokens) one transformers
`Qwen3MoeSparseMoeBlock` (softmax router, top-k, renormalised weights, SwiGLU experts) is built with
random weights (normal, std 0.02: near-uniform random routing) and timed with
`experts_implementation` = grouped_mm and eager; its weights are then copied into a moecore
`MoELayer` with the same routing options, so both route the same tokens to the same experts.
Inputs: x [1, T, H] bf16 and an output gradient, identical for all. Each implementation is timed
alone (the other's modules freed), so peak memory is its own (weights, inputs, activations, grads).

`routing="skewed"` makes a few experts take most tokens, the same way for every implementation: the input
gets a shared direction u (x + 4u, |u| = 1) and expert e's router row gets -log(e + 1) / 4 along u, so its
logit is shifted by about -log(e + 1) (Zipf-like popularity: expert 0 first, expert 1 half as likely, ...).
Each record carries the load this produced (`load`: tokens of the busiest expert over the mean, and the
share of assignments taken by the busiest tenth of the experts).

FLOPs per forward + backward, as in the reference measurements: 18 * H * F * K * T (three GEMMs,
backward twice the forward) + 6 * H * E * T (the router).
"""

from __future__ import annotations

import gc
import json

import torch

from moecore.bench.common import cuda_back_to_back_ms, cuda_time_ms, profile_gpu_ms, record

SHAPES = {  # hidden, expert ffn, experts, top-k, tokens
    "qwen3_30b_a3b": (2048, 768, 128, 8, 16384),
    "mixtral_8x7b": (4096, 14336, 8, 2, 16384),
    "deepseek_v3": (7168, 2048, 256, 8, 8192),
    "qwen3_next": (2048, 512, 512, 10, 16384),  # Qwen3-Next-80B-A3B's routed experts (its shared expert aside)
    "deepseek_v4": (4096, 2048, 256, 6, 16384),  # transformers' DeepseekV4Config defaults (its routed experts)
}
SWIGLU_LIMIT = 10.0  # DeepSeek-V4's swiglu_limit (transformers' default) for the clipped variants


def moe_flops(h: int, f: int, e: int, k: int, t: int) -> float:
    return 18 * h * f * k * t + 6 * h * e * t


def _hf_block(h: int, f: int, e: int, k: int, impl: str):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(
        hidden_size=h, moe_intermediate_size=f, num_experts=e, num_experts_per_tok=k, norm_topk_prob=True
    )
    cfg._experts_implementation = impl
    return Qwen3MoeSparseMoeBlock(cfg)


VARIANTS = {  # moecore variants timed by `--variants` (the default is "moecore")
    "moecore": "fused router, GEMM plan per shape (default_plan)",
    "moecore-unfused-router": "moe.router_fusion=false: routing through separate torch ops",
    "moecore-all-grouped": "every expert GEMM through torch._grouped_mm (no host sync, one launch each)",
    "moecore-fp32-router-gemm": "the router's three GEMMs as fp32 GEMMs instead of the split-bf16 form (router_gemm.py)",
    "moecore-all-triton": "every expert GEMM through moecore's Triton grouped GEMMs (no host sync, one launch each)",
    "moecore-streams": "default_plan with its per-expert GEMM loops on two CUDA streams",
    "moecore-torch-gemms": "moe.gemm_backend=torch: the per-shape plan among torch's and moecore's Triton GEMMs, "
    "never QuACK's",
    "moecore-all-quack": "every expert GEMM through QuACK's grouped GEMMs (where they run; torch's elsewhere)",
    "moecore-spread-blind": "QuACK's tile choices not keyed by the layer's load spread: every load timed as the "
    "first one seen (under --routing random,skewed: the skewed layer runs random routing's tiles)",
    "moecore-probs-at-combine": "moe.apply_probs_on_input=false (the option's default; the recipes set true): the "
    "routing weights applied at the combine, whose backward then keeps the expert outputs",
    "moecore-minimal": "moe.activation_memory=minimal: experts, permute and combine as one Function (x, h, routing kept)",
    "moecore-minimal-swiglu-epilogue": "minimal with moe.swiglu_epilogue=true: the SwiGLU and its backward in QuACK's "
    "GEMM epilogues (probabilities at the combine)",
    "moecore-chunked": "moe.activation_memory=chunked: as minimal, keeping x and routing only, in chunks of 8192 rows"
    " (moecore-chunked-<rows>: chunks of <rows>)",
    "moecore-sync-free": "moe.sync_free=true: no host synchronisation from routing to combine",
    "moecore-clipped": "DeepSeek-V4's clipped SwiGLU (model.activation=swiglu_clipped, limit 10) on the fused expert "
    "FFN, as moecore train runs DeepSeek-V4's experts",
    "moecore-clipped-unfused": "the clipped SwiGLU experts through torch._grouped_mm and autograd's clamps (the "
    "experts' path without the fused expert FFN)",
    "moecore-fp8-tensorwise": "experts' GEMMs in FP8, one scale per tensor (fp8.recipe=tensorwise)",
    "moecore-fp8-rowwise": "experts' GEMMs in FP8, a scale per row (fp8.recipe=rowwise)",
    "moecore-fp8-blockwise": "experts' GEMMs in FP8, 1x128 activation / 128x128 weight blocks (fp8.recipe=blockwise)",
    "moecore-fp8-rowwise-bf16wgrad": "fp8.recipe=rowwise with the weight gradients in bf16 (fp8.wgrad=bf16)",
    "moecore-fp8-rowwise-fp8wgrad": "fp8.recipe=rowwise with the weight gradients in FP8 at every shape (fp8.wgrad=fp8;"
    " the default, auto, takes bf16 for narrow weights and for experts with few rows each: Fp8Recipe.wgrad_in_fp8)",
    "moecore-fp8-rowwise-primary": "fp8.recipe=rowwise with FP8 primary weights: both weight layouts quantised "
    "once per optimizer step (timed apart: primary_requant_ms), not in forward + backward",
    "moecore-fp8-rowwise-wgradpad": "fp8.recipe=rowwise with only the weight-gradient operands padded per expert "
    "(Fp8Recipe.padding=wgrad: no padded copies of x and dy, no un-padding of y and dx)",
    "moecore-fp8-rowwise-primary-wgradpad": "the two variants above together",
    "moecore-fp8-rowwise-allpad": "fp8.recipe=rowwise with every operand's rows padded per expert (fp8.padding=all)",
    "moecore-fp8-rowwise-triton": "fp8.recipe=rowwise with the forward and input-gradient grouped GEMMs in moecore's "
    "Triton kernel (fp8.grouped_gemm=triton)",
    "moecore-fp8-rowwise-torchgemm": "fp8.recipe=rowwise with every grouped GEMM torch's (fp8.grouped_gemm=torch)",
}
# moecore-fp8-<recipe>[-primary][-<option>...]: each option sets one fp8 field; unset fields keep `moecore train`'s
# defaults (FP8Config), so moecore-fp8-rowwise times what train.precision=fp8 runs
FP8_VARIANT_OPTIONS = {
    "bf16wgrad": ("wgrad", "bf16"),
    "fp8wgrad": ("wgrad", "fp8"),
    "wgradpad": ("padding", "wgrad"),
    "allpad": ("padding", "all"),
    "triton": ("grouped_gemm", "triton"),
    "torchgemm": ("grouped_gemm", "torch"),
    "hybrid": ("format", "hybrid"),
}


def _fp8_config(variant: str):
    """The FP8Config of moecore-fp8-<recipe>[-primary][-<option>...] (validated: ConfigError if it cannot run)."""
    from moecore.config.fp8 import FP8Config

    scaling, *options = variant.split("-")[2:]
    fp8 = FP8Config(recipe=scaling, modules=["experts"])
    for opt in options:
        if opt in FP8_VARIANT_OPTIONS:
            setattr(fp8, *FP8_VARIANT_OPTIONS[opt])
    fp8.validate()
    return fp8


def _chunk_rows(variant: str) -> int | None:
    """`moecore-chunked-<rows>`: the chunked mode with moe.activation_chunk_rows=<rows>; None for other names."""
    head, _, rows = variant.rpartition("-")
    return int(rows) if head == "moecore-chunked" and rows.isdigit() and int(rows) > 0 else None


def is_variant(name: str) -> bool:
    """A name of VARIANTS, or an FP8 variant composed of a recipe and options (FP8_VARIANT_OPTIONS, `primary`)."""
    from moecore.config.errors import ConfigError

    parts = name.split("-")
    if name in VARIANTS or _chunk_rows(name) is not None:
        return True
    if parts[:2] != ["moecore", "fp8"] or len(parts) < 3:
        return False
    if any(p != "primary" and p not in FP8_VARIANT_OPTIONS for p in parts[3:]):
        return False
    try:
        _fp8_config(name)
    except ConfigError:
        return False
    return True


def _moecore_layer(h: int, f: int, e: int, k: int, variant: str = "moecore", tokens: int = 16384):
    from moecore.config import MoEConfig
    from moecore.kernels.grouped_ffn import GemmPlan, default_plan
    from moecore.moe.layer import MoELayer

    cfg = MoEConfig(
        num_experts=e,
        router_topk=k,
        ffn_hidden_size=f,
        router_pre_softmax=True,  # softmax over all experts, then top-k, then renormalise (Qwen3-MoE)
        norm_topk_prob=True,
        router_load_balancing_type="none",  # transformers' block computes no balancing loss either
        aux_loss_coeff=0.0,
        # weights inside the SwiGLU as `moecore train`'s recipes run them (Megatron-Core's fused weighted SwiGLU);
        # QuACK's SwiGLU epilogue takes them at the combine
        apply_probs_on_input=variant not in ("moecore-minimal-swiglu-epilogue", "moecore-probs-at-combine"),
        swiglu_epilogue=variant == "moecore-minimal-swiglu-epilogue",
        router_fusion=variant != "moecore-unfused-router",
        activation_memory="chunked"
        if _chunk_rows(variant)
        else {"moecore-chunked": "chunked"}.get(
            variant, "minimal" if variant.startswith("moecore-minimal") else "standard"
        ),
        activation_chunk_rows=_chunk_rows(variant) or MoEConfig.activation_chunk_rows,
        sync_free=variant == "moecore-sync-free",
        gemm_backend="torch" if variant == "moecore-torch-gemms" else "auto",
    )
    cfg.validate()
    layer = MoELayer(cfg, h)
    if variant.startswith("moecore-clipped"):
        layer.experts.swiglu_limit = SWIGLU_LIMIT
        if variant == "moecore-clipped-unfused":  # torch._grouped_mm, the activation through autograd
            from moecore.moe.experts import experts_grouped_mm

            ex = layer.experts
            ex.forward = lambda x, counts, probs=None: experts_grouped_mm(
                x, counts, ex.w13, ex.w2, "swiglu", probs, False, ex.swiglu_limit
            )
    if variant == "moecore-all-grouped":
        layer.experts.gemm_plan = GemmPlan.uniform("grouped")
    if variant == "moecore-fp32-router-gemm":
        layer.router.split_gemm = False
    if variant == "moecore-all-triton":
        layer.experts.gemm_plan = GemmPlan.uniform("triton")
    if variant == "moecore-all-quack":
        layer.experts.gemm_plan = GemmPlan.uniform("quack")
    if variant == "moecore-spread-blind":
        layer.experts.load_spread = None
    if variant == "moecore-streams":
        layer.experts.gemm_plan = default_plan(e, tokens * k, h, f, torch.device("cuda")).with_streams()
    if variant.startswith("moecore-fp8-"):  # train.precision=fp8 with fp8.modules=[experts]
        from moecore.kernels.fp8_gemm import Fp8Recipe
        from moecore.models.fp8 import apply_fp8

        apply_fp8(layer, Fp8Recipe.from_config(_fp8_config(variant)), ["experts"])
    return layer


def _fp8_primary_weights(layer) -> float:
    """FP8 primary weights for the layer's experts (fp8.primary_weights=true): quantise w13 and w2 into their FP8
    layouts, as every optimizer step does, and keep only those (the bf16 values become placeholders).
    Returns the median GPU ms of that quantisation, the per-step cost the forward + backward time leaves out."""
    from moecore.models.fp8 import quantize_primary

    ex = layer.experts
    weights = [ex.w13, ex.w2]

    def requant():
        for p in weights:
            quantize_primary(p, p.detach(), ex.fp8_recipe, grouped=True)

    ms = cuda_time_ms(requant, 1, 3)
    for p in weights:
        p.data = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
    return round(ms, 3)


def _copy_hf_to_moecore(hf_state: dict, layer) -> None:
    """transformers' gate / gate_up_proj / down_proj are our router.weight / w13 / w2 (same layouts)."""
    with torch.no_grad():
        layer.router.weight.copy_(hf_state["gate.weight"])
        layer.experts.w13.copy_(hf_state["experts.gate_up_proj"])
        layer.experts.w2.copy_(hf_state["experts.down_proj"])


def _time_step(module, x: torch.Tensor, g: torch.Tensor, warmup: int, iters: int) -> tuple[float, float, float]:
    """(median ms of forward + backward, each from an idle GPU; mean ms launched back to back; peak GB) for
    module(x) -> y (or (y, aux))."""

    def step():
        x.grad = None
        for p in module.parameters():
            p.grad = None
        out = module(x)
        y = out[0] if isinstance(out, tuple) else out
        y.backward(g)

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = cuda_time_ms(step, warmup, iters)
    peak = torch.cuda.max_memory_allocated() / 2**30
    return ms, cuda_back_to_back_ms(step, iters), peak


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _weights(h: int, f: int, e: int, dev: torch.device, dt: torch.dtype, experts: bool = True) -> dict:
    """The block's weights, drawn on the GPU from a fixed seed (normal, std 0.02), in transformers' names;
    with `experts=False` the router's alone (the same values: it is drawn first)."""
    g = torch.Generator(device=dev).manual_seed(1)
    out = {"gate.weight": torch.randn(e, h, generator=g, device=dev, dtype=dt) * 0.02}
    if experts:
        out["experts.gate_up_proj"] = torch.randn(e, 2 * f, h, generator=g, device=dev, dtype=dt) * 0.02
        out["experts.down_proj"] = torch.randn(e, h, f, generator=g, device=dev, dtype=dt) * 0.02
    return out


PHASES = (  # (phase, substrings of CUDA kernel names), first match wins
    ("expert GEMMs", ("gemm", "cutlass", "nvjet", "xmma", "sm90", "grouped")),
    ("SwiGLU", ("swiglu", "silu", "glu")),
    ("permute/unpermute", ("_gather", "index", "scatter")),
    ("router", ("_router_", "softmax", "topk")),
    ("sort/count", ("sort", "bincount", "histc", "cumsum", "radix")),
)


ROUTINGS = ("random", "skewed")


def skew_routing(x: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, gate) with a Zipf-like expert popularity (module docstring); deterministic, on x's device."""
    h, e = x.shape[-1], gate.shape[0]
    u = torch.randn(h, generator=torch.Generator(device=x.device).manual_seed(2), device=x.device)
    u = u / u.norm()
    shift = -torch.log(torch.arange(1, e + 1, device=x.device, dtype=torch.float32))
    return (x.float() + 4 * u).to(x.dtype), (gate.float() + (shift / 4)[:, None] * u).to(gate.dtype)


def expert_load(x: torch.Tensor, gate: torch.Tensor, k: int) -> dict:
    """How the softmax-top-k router spreads these tokens: busiest expert over the mean, busiest tenth's share."""
    chosen = torch.topk(x.reshape(-1, x.shape[-1]).float() @ gate.float().t(), k, dim=-1).indices
    counts = torch.bincount(chosen.reshape(-1), minlength=gate.shape[0]).float()
    top = torch.sort(counts, descending=True).values[: max(1, gate.shape[0] // 10)]
    return {
        "max_over_mean": round(float(counts.max() / counts.mean()), 2),
        "top10pct_share": round(float(top.sum() / counts.sum()), 3),
    }


def quack_choices(num_experts: int) -> dict:
    """The GEMM choices `quack_gemm` has made so far for layers of `num_experts` experts, for the records:
    "kind[/layout][ spread=S]" -> {"choice": the fastest candidate, "ms": each candidate's time}, with S the load
    spread the choice was made for where it is above 1 (`quack_gemm.LoadSpread`); empty without QuACK."""
    from moecore.kernels.quack_gemm import CHOICE_TIMES

    out = {}
    for key, times in CHOICE_TIMES.items():
        kind, experts, spread, layout = key[0], key[1], key[-2], key[-1]
        if experts == num_experts and times:
            name = (f"{kind}/{layout}" if layout else kind) + (f" spread={spread}" if spread > 1 else "")
            out[name] = {"choice": min(times, key=times.get), "ms": {c: round(t, 3) for c, t in times.items()}}
    return out


def profile_phases(module, x: torch.Tensor, g: torch.Tensor, steps: int = 3, top: list | None = None) -> dict:
    """GPU milliseconds per forward + backward by phase (see `profile_gpu_ms`; `top` gets the longest kernels)."""

    def step():
        x.grad = None
        for p in module.parameters():
            p.grad = None
        out = module(x)
        (out[0] if isinstance(out, tuple) else out).backward(g)

    return profile_gpu_ms(step, PHASES, steps, top)


def run_shape(
    name: str,
    compare_hf: bool,
    warmup: int,
    iters: int,
    eager: bool = True,
    phases: bool = False,
    variants: tuple[str, ...] = ("moecore",),
    routing: str = "random",
) -> list[dict]:
    h, f, e, k, t = SHAPES[name]
    flops = moe_flops(h, f, e, k, t)
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(1, t, h, device=dev, dtype=dt)
    g = torch.randn(1, t, h, device=dev, dtype=dt)
    gate = _weights(h, f, e, dev, dt, experts=False)["gate.weight"]
    if routing == "skewed":
        x, gate = skew_routing(x, gate)
    load = {"routing": routing, "load": expert_load(x, gate, k)}
    x.requires_grad_()
    records = []
    impls = []
    if compare_hf:
        impls.append("transformers-grouped_mm")
        if eager and e <= 128:  # eager on DeepSeek-V3's 256 experts takes minutes; the reference run skipped it too
            impls.append("transformers-eager")
    impls.extend(variants)
    for impl in impls:
        mod = None
        try:
            with torch.device(dev):
                mod = (
                    _hf_block(h, f, e, k, impl.split("-", 1)[1])
                    if impl.startswith("transformers")
                    else _moecore_layer(h, f, e, k, impl, t)
                )
            mod = mod.to(dt)
            state = {**_weights(h, f, e, dev, dt), "gate.weight": gate}
            if impl.startswith("transformers"):
                mod.load_state_dict(state)
            else:
                _copy_hf_to_moecore(state, mod)
            del state
            extra = {}
            if impl.startswith("moecore-fp8-") and "primary" in impl.split("-"):
                extra["primary_requant_ms"] = _fp8_primary_weights(mod)
            _free()
            ms, ms_b2b, peak = _time_step(mod, x, g, warmup, iters)
            extra["ms_back_to_back"] = round(ms_b2b, 3)
            if phases:
                top: list = []
                extra.update(phases_ms=profile_phases(mod, x, g, top=top), top_kernels=top)
            choices = {} if impl.startswith("transformers") else quack_choices(e)
            if choices:
                extra["quack_choices"] = choices
            records.append(record(name, impl, ms, flops, peak, **load, **extra))
        except Exception as ex:  # record and continue: one failing implementation must not hide the others
            records.append(record(name, impl, None, None, None, error=f"{type(ex).__name__}: {ex}"[:300]))
        print(json.dumps(records[-1]), flush=True)
        mod = None
        _free()
    return records


def run(
    shapes: list[str],
    compare_hf: bool,
    warmup: int,
    iters: int,
    eager: bool = True,
    phases: bool = False,
    variants: tuple[str, ...] = ("moecore",),
    routing: tuple[str, ...] = ("random",),
) -> list[dict]:
    out = []
    for name in shapes:
        for how in routing:
            out.extend(run_shape(name, compare_hf, warmup, iters, eager, phases, variants, how))
    return out
