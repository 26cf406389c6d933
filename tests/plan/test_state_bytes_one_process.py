"""bf16 and FP8 bytes per rank: the planner against the runtime's real tensors (one CPU process).

`moecore.train.runtime` turns the model's parameters into bf16 with fp32 masters (or none), sums
gradients in fp32 main gradients when a step has several micro-batches, and builds the fused AdamW
with fp32 or bf16 moments. After one real forward / backward and step, the bytes of parameters,
gradients (`grad_of`), masters and moments must equal the planner's `state_bytes` exactly.

Under `train.precision=fp8` (emulated on CPU) the parameters are bf16 with fp32 masters; with
`fp8.primary_weights=true` the weights of the FP8 GEMMs live only as their FP8 copies (one byte per element
and fp32 scales; rowwise keeps both layouts) and the parameter itself is a placeholder without storage. The
linears whose widths are not multiples of the recipe's alignment (here k_proj / v_proj, 64 wide, under
blockwise) stay bf16, in the runtime and in the plan.

DSA's `model.dsa_stage=dense_warmup` freezes every parameter but the lightning indexers': the frozen ones stay
in the runtime as bf16 (fp32 under fp32) weights without a master, a gradient or moments, and the planner
counts them so.
"""

from __future__ import annotations

import pytest
import torch

from moecore.config import Config, load_config
from moecore.models.transformer import MoETransformer
from moecore.optim.mixed_precision import grad_of
from moecore.plan.layout import layout_of
from moecore.plan.params import param_summary, precision_mode, state_bytes
from moecore.train.runtime import setup_runtime


def _bytes(t: torch.Tensor) -> int:
    """A tensor's own bytes (0 for a placeholder expanded from one element: an FP8 primary weight's parameter)."""
    return t.numel() * t.element_size() if t.numel() and 0 not in t.stride() else 0


def _param_bytes(p: torch.Tensor) -> int:
    """What a parameter holds: its values, and its FP8 copies if it is an FP8 primary weight."""
    copies = [c for c in (getattr(p, a, None) for a in ("fp8_primary", "fp8_primary_t")) if c is not None]
    return _bytes(p) + sum(_bytes(c.q) + _bytes(c.s) for c in copies)


def _one_step(cfg: Config, micro_batches: int) -> tuple[torch.nn.Module, dict]:
    """The model after one real step of `micro_batches`, and the bytes of its state by kind."""
    rt = setup_runtime(cfg)
    torch.manual_seed(0)
    model = rt.wrap_model(MoETransformer(cfg, rt.dims), micro_batches)
    opt = rt.build_optimizer(model, cfg)
    for _ in range(micro_batches):
        ids = torch.randint(0, 64, (1, 8))
        model(ids, labels=ids).loss.backward()
    rt.optimizer_step(opt)
    size = lambda ts: sum(_bytes(t) for t in ts)  # noqa: E731
    moments = [t for s in opt.state.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]
    return model, {
        "params": sum(_param_bytes(p) for p in model.parameters()),
        "grads": size(g for p in model.parameters() if (g := grad_of(p)) is not None),  # frozen: none
        "optimizer": size(rt.mixed.masters.values() if rt.mixed is not None else []) + size(moments),
    }


def _bf16_config(master: str, state: str) -> Config:
    cfg = Config()
    m, e = cfg.model, cfg.moe
    m.vocab_size, m.hidden_size, m.num_layers, m.ffn_hidden_size = 64, 32, 2, 48
    m.num_attention_heads, m.num_kv_heads = 4, 2
    e.num_experts, e.router_topk, e.ffn_hidden_size, e.first_k_dense_replace = 4, 2, 16, 1
    cfg.train.precision, cfg.train.device, cfg.train.seq_length = "bf16", "cpu", 8
    cfg.optim.master_weights, cfg.optim.state_dtype = master, state
    return cfg


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("master,state", [("fp32", "fp32"), ("fp32", "bf16"), ("bf16", "bf16")])
def test_bf16_bytes_equal_the_runtime(master: str, state: str, micro_batches: int) -> None:
    cfg = _bf16_config(master, state)
    model, real = _one_step(cfg, micro_batches)
    layout = layout_of(cfg, 1)
    planned = state_bytes(cfg, layout, 0, precision_mode(cfg, layout, micro_batches, device="cpu"))
    assert real == planned
    assert planned["grads"] == (4 if micro_batches > 1 else 2) * sum(p.numel() for p in model.parameters())


def _fp8_config(recipe: str, primary: bool) -> Config:
    cfg = Config()
    m, e = cfg.model, cfg.moe
    m.vocab_size, m.hidden_size, m.num_layers, m.ffn_hidden_size = 64, 128, 2, 256
    m.num_attention_heads, m.num_kv_heads, m.head_dim = 2, 1, 64
    e.num_experts, e.router_topk, e.ffn_hidden_size, e.first_k_dense_replace = 4, 2, 128, 1
    e.shared_expert_intermediate_size = 128
    cfg.train.precision, cfg.train.device, cfg.train.seq_length = "fp8", "cpu", 8
    cfg.fp8.recipe, cfg.fp8.primary_weights, cfg.fp8.emulate = recipe, primary, True
    return cfg


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("primary", [False, True], ids=["", "primary"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_fp8_bytes_equal_the_runtime(recipe: str, primary: bool, micro_batches: int) -> None:
    cfg = _fp8_config(recipe, primary)
    model, real = _one_step(cfg, micro_batches)
    layout = layout_of(cfg, 1)
    mode = precision_mode(cfg, layout, micro_batches, device="cpu")
    assert mode.fp8 == recipe and mode.fp8_primary is primary
    assert real == state_bytes(cfg, layout, 0, mode)
    # the planner's FP8 GEMM weights are the runtime's (apply_fp8 marks each with its recipe); blockwise leaves
    # the 64-wide k / v projections bf16
    planned_fp8 = sum(n for n, _ in param_summary(cfg, layout).fp8_weights.values())
    fp8_weights = [p for p in model.parameters() if hasattr(p, "fp8_gemm_recipe")]
    assert planned_fp8 == sum(p.numel() for p in fp8_weights) > 0
    assert len(fp8_weights) == (12 if recipe == "blockwise" else 16)  # 2 x (q, k, v, o), 3 dense, w13, w2, 3 shared
    assert all(hasattr(p, "fp8_primary") == primary for p in fp8_weights)


DENSE_WARMUP = {
    "fp32": ["train.precision=fp32"],
    "bf16": ["train.precision=bf16"],
    "bf16-adam": ["train.precision=bf16", "optim.state_dtype=bf16"],
    "bf16-master": ["train.precision=bf16", "optim.master_weights=bf16", "optim.state_dtype=bf16"],
    "fp8": ["train.precision=fp8", "fp8.recipe=tensorwise", "fp8.emulate=true"],
}


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("precision", list(DENSE_WARMUP))
def test_dsa_dense_warmup_bytes_equal_the_runtime(precision: str, micro_batches: int) -> None:
    """Tiny DeepSeek-V3.2 in dense_warmup (main layers and MTP block): only the indexers' parameters have a
    gradient, a master weight and moments; every other parameter is its weight alone, in the compute dtype."""
    over = ["model.dsa_stage=dense_warmup", "model.vocab_size=64", "train.device=cpu", "train.seq_length=8"]
    cfg = load_config("tiny-deepseek-v32", over + DENSE_WARMUP[precision])
    model, real = _one_step(cfg, micro_batches)
    layout = layout_of(cfg, 1)
    mode = precision_mode(cfg, layout, micro_batches, device="cpu")
    planned = state_bytes(cfg, layout, 0, mode)
    assert real == planned
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".indexer." in n for n in trained) and any(n.startswith("mtp.") for n in trained)
    summary = param_summary(cfg, layout)
    n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in model.parameters())
    assert (summary.trained, summary.total) == (n_trained, n_all) and 30 * n_trained < n_all
    assert planned == {
        "params": n_all * mode.param,
        "grads": n_trained * mode.grad,
        "optimizer": n_trained * (mode.master + mode.moments),
    }
