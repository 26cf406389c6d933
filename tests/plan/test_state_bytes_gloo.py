"""Per-rank parameter, gradient and optimizer bytes: the planner against the real tensors on gloo ranks.

For each layout that the trainer runs today (tp, ep, etp, dp with the distributed optimizer, and
their mixes) every rank builds the model with its ParallelDims, the optimizer the trainer would wrap
(AdamW, or DistributedOptimizer over it), gives every parameter a gradient and takes one step (so
that the moments exist), then sums the bytes of its parameters, gradients and optimizer tensors
(AdamW moments; the distributed optimizer's fp32 master shards and their moments; its gradients are
the reduced shards it keeps after a real backward). The planner's
`state_bytes` for the same layout (fp32 precision, CPU) must equal them exactly on every rank.
"""

from __future__ import annotations

import pytest
import torch

from moecore.config import Config, load_config
from moecore.models.transformer import MoETransformer
from moecore.optim.adamw import build_optimizer
from moecore.parallel.dims import ParallelDims
from moecore.parallel.distributed_optimizer import DistributedOptimizer
from moecore.parallel.launch import run_local
from moecore.plan.layout import layout_of
from moecore.plan.params import precision_mode, state_bytes

pytestmark = pytest.mark.distributed


def _config(par: dict) -> Config:
    """3 layers (first dense), 8 experts top-2 with a gated shared expert, q/k norm, untied head."""
    cfg = Config()
    m, e = cfg.model, cfg.moe
    m.vocab_size, m.hidden_size, m.num_layers, m.ffn_hidden_size = 64, 32, 3, 48
    m.num_attention_heads, m.num_kv_heads, m.qk_norm = 4, 2, True
    e.num_experts, e.router_topk, e.ffn_hidden_size, e.first_k_dense_replace = 8, 2, 16, 1
    e.shared_expert_intermediate_size, e.shared_expert_gate = 24, True
    cfg.train.precision, cfg.train.seq_length = "fp32", 8
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 4, 1
    for k, v in par.items():
        setattr(cfg.parallel, k, v)
    return cfg


def _fp8(cfg: Config, fp8: tuple[str, bool] | None) -> Config:
    """bf16, or train.precision=fp8 (emulated) with (recipe, primary_weights): every width here is a multiple of
    16, the alignment of the one-byte and rowwise recipes."""
    cfg.train.precision = "bf16"
    if fp8 is not None:
        cfg.train.precision = "fp8"
        cfg.fp8.recipe, cfg.fp8.primary_weights, cfg.fp8.emulate = fp8[0], fp8[1], True
    return cfg


def _param_bytes(p: torch.Tensor) -> int:
    """A parameter's own bytes (0 for an FP8 primary weight's storage-less placeholder) and its FP8 copies."""
    own = lambda t: t.numel() * t.element_size() if t.numel() and 0 not in t.stride() else 0  # noqa: E731
    copies = [c for c in (getattr(p, a, None) for a in ("fp8_primary", "fp8_primary_t")) if c is not None]
    return own(p) + sum(own(c.q) + own(c.s) for c in copies)


def _dense_warmup_config(par: dict) -> Config:
    """Tiny DeepSeek-V3.2 in DSA's dense_warmup (only the lightning indexers train), bf16."""
    over = ["model.dsa_stage=dense_warmup", "model.vocab_size=64", "train.precision=bf16", "train.seq_length=8"]
    cfg = load_config("tiny-deepseek-v32", [*over, "train.global_batch_size=2", "train.micro_batch_size=1"])
    for k, v in par.items():
        setattr(cfg.parallel, k, v)
    return cfg


def _v4_config(par: dict) -> Config:
    """Tiny DeepSeek-V4 (compressed attention with frozen indexers, hyper-connections, a hash-routed layer), bf16."""
    over = ["model.vocab_size=64", "train.precision=bf16", "train.seq_length=8"]
    cfg = load_config("tiny-deepseek-v4", [*over, "train.global_batch_size=2", "train.micro_batch_size=1"])
    for k, v in par.items():
        setattr(cfg.parallel, k, v)
    return cfg


_CONFIGS = {"dense_warmup": _dense_warmup_config, "v4": _v4_config}


def _real_bytes_bf16(
    rank: int, world: int, par: dict, fp8: tuple[str, bool] | None = None, model: str | None = None
) -> dict:
    """The same through the runtime with bf16 parameters: fp32 masters, fp32 main gradients, the
    distributed optimizer driven on the masters (moecore.train.runtime); with `fp8`, FP8 GEMMs and, with primary
    weights, the FP8 GEMMs' weights held as their FP8 copies only (rebuilt from the gathered masters);
    `model`: a `_CONFIGS` model instead of `_config`'s."""
    from moecore.optim.mixed_precision import grad_of
    from moecore.train.runtime import Runtime

    cfg = _CONFIGS[model](par) if model else _fp8(_config(par), fp8)
    dims = ParallelDims(cfg.parallel, world, rank, "cpu", num_experts=8, num_attention_heads=4, vocab_size=64)
    rt = Runtime(
        dims=dims,
        device=torch.device("cpu"),
        autocast_dtype=torch.bfloat16,
        precision=cfg.train.precision,
        fp8=cfg.fp8 if fp8 is not None else None,
    )
    torch.manual_seed(0)
    model = rt.wrap_model(MoETransformer(cfg, dims), 1)
    opt = rt.build_optimizer(model, cfg)
    ids = torch.randint(0, 64, (1, 8))  # the same on every rank (tensor-parallel ranks need it)
    model(ids, labels=ids).loss.backward()
    rt.finish_grad_sync(model)
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    # The reduced gradient shards (the full gradients were freed when their buckets were launched).
    grads = size([g for p in model.parameters() if (g := grad_of(p)) is not None] + opt.memory_tensors()["grads"])
    rt.optimizer_step(opt)
    moments = [t for s in opt.inner.state.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]
    return {
        "params": sum(_param_bytes(p) for p in model.parameters()),
        "grads": grads,
        "optimizer": size(rt.mixed.masters.values()) + size(moments) + size(opt.master.values()),
    }


def _real_bytes(rank: int, world: int, par: dict) -> dict:
    cfg = _config(par)
    dims = ParallelDims(cfg.parallel, world, rank, "cpu", num_experts=8, num_attention_heads=4, vocab_size=64)
    torch.manual_seed(0)
    model = MoETransformer(cfg, dims)
    opt = build_optimizer(model, cfg.optim)
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    if cfg.parallel.distributed_optimizer:  # gradients reduce-scattered by its buckets, then the step
        opt = DistributedOptimizer(model, opt, dims)
        ids = torch.randint(0, 64, (1, 8))  # the same on every rank (tensor-parallel ranks need it)
        model(ids, labels=ids).loss.backward()
        model._moecore_grad_sync.finish_grad_sync()
        grads = size(opt.memory_tensors()["grads"]) + size(p.grad for p in model.parameters() if p.grad is not None)
    else:
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        grads = size(p.grad for p in model.parameters())
    opt.step()
    state = opt.state if not cfg.parallel.distributed_optimizer else opt.inner.state
    moments = [t for s in state.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]
    masters = list(getattr(opt, "master", {}).values())
    return {"params": size(model.parameters()), "grads": grads, "optimizer": size(moments) + size(masters)}


LAYOUTS = [
    (2, {"tp": 2}),
    (2, {"ep": 2}),
    (2, {"etp": 2}),
    (2, {"distributed_optimizer": True}),
    (2, {"ep": 2, "distributed_optimizer": True}),
    (4, {"tp": 2, "ep": 2, "distributed_optimizer": True}),
    (4, {"ep": 2, "distributed_optimizer": True}),
]


IDS = [f"{w}-{'-'.join(f'{k}{v}' for k, v in p.items())}" for w, p in LAYOUTS]


@pytest.mark.parametrize("world,par", LAYOUTS, ids=IDS)
def test_planner_bytes_equal_the_real_tensors(world: int, par: dict) -> None:
    real = run_local(_real_bytes, world, par)
    cfg = _config(par)
    layout = layout_of(cfg, world)
    mode = precision_mode(cfg, layout, micro_batches=1, device="cpu")
    planned = state_bytes(cfg, layout, 0, mode)
    one = state_bytes(cfg, layout_of(_config({}), 1), 0, mode)
    assert planned["params"] + planned["optimizer"] < one["params"] + one["optimizer"]  # the layout shards something
    for rank, r in enumerate(real):
        assert r == planned, f"rank {rank}: real {r} planned {planned}"


BF16 = [(2, {"ep": 2, "distributed_optimizer": True}), (4, {"tp": 2, "ep": 2, "distributed_optimizer": True})]


@pytest.mark.parametrize("world,par", BF16, ids=[f"{w}-{'-'.join(f'{k}{v}' for k, v in p.items())}" for w, p in BF16])
def test_planner_bf16_bytes_equal_the_runtime(world: int, par: dict) -> None:
    real = run_local(_real_bytes_bf16, world, par)
    cfg = _fp8(_config(par), None)
    layout = layout_of(cfg, world)
    planned = state_bytes(cfg, layout, 0, precision_mode(cfg, layout, micro_batches=1, device="cpu"))
    for rank, r in enumerate(real):
        assert r == planned, f"rank {rank}: real {r} planned {planned}"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_planner_fp8_primary_bytes_under_the_distributed_optimizer(recipe: str) -> None:
    """FP8 primary weights over dp2 x ep2 with the distributed optimizer: each rank's FP8 copies (tensorwise: one
    byte per element and a scale; rowwise: both layouts), its fp32 master shards and their moments, and its reduced
    gradient shards, as the planner counts them."""
    par = {"ep": 2, "distributed_optimizer": True}
    real = run_local(_real_bytes_bf16, 4, par, (recipe, True))
    cfg = _fp8(_config(par), (recipe, True))
    layout = layout_of(cfg, 4)
    mode = precision_mode(cfg, layout, micro_batches=1, device="cpu")
    assert mode.fp8_primary
    planned = state_bytes(cfg, layout, 0, mode)
    for rank, r in enumerate(real):
        assert r == planned, f"rank {rank}: real {r} planned {planned}"


@pytest.mark.parametrize("par", [{"distributed_optimizer": True}, {"ep": 2, "distributed_optimizer": True}])
def test_planner_dense_warmup_bytes_under_the_distributed_optimizer(par: dict) -> None:
    """DSA's dense_warmup over 2 ranks: the distributed optimizer's buckets, master shards and moments hold the
    indexers' parameters only; every frozen parameter is its bf16 weight on each rank, as the planner counts."""
    _check_model_bytes("dense_warmup", par)


def _check_model_bytes(model: str, par: dict) -> None:
    """Every one of 2 ranks' bf16 runtime bytes for the `_CONFIGS` model equal the planner's."""
    real = run_local(_real_bytes_bf16, 2, par, None, model)
    cfg = _CONFIGS[model](par)
    layout = layout_of(cfg, 2)
    planned = state_bytes(cfg, layout, 0, precision_mode(cfg, layout, micro_batches=1, device="cpu"))
    for rank, r in enumerate(real):
        assert r == planned, f"rank {rank}: real {r} planned {planned}"


@pytest.mark.parametrize(
    "par", [{"tp": 2, "distributed_optimizer": True}, {"ep": 2, "distributed_optimizer": True}], ids=["tp2", "ep2"]
)
def test_planner_deepseek_v4_bytes(par: dict) -> None:
    """DeepSeek-V4 over 2 ranks, the optimizer state sharded: heads, sinks and output groups split over tp (the
    key/value head, compressors and frozen indexers whole), or experts over ep; the indexers have no master, gradient
    or moments. Every rank's bytes as the planner counts them."""
    _check_model_bytes("v4", par)
