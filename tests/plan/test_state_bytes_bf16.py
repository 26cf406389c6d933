"""bf16 bytes per rank: the planner against the runtime's real tensors (one CPU process, bf16 asked for).

`moecore.train.runtime` turns the model's parameters into bf16 with fp32 masters (or none), sums
gradients in fp32 main gradients when a step has several micro-batches, and builds the fused AdamW
with fp32 or bf16 moments. After one real forward / backward and step, the bytes of parameters,
gradients (`grad_of`), masters and moments must equal the planner's `state_bytes` exactly.
"""

from __future__ import annotations

import pytest
import torch

from moecore.config import Config
from moecore.models.transformer import MoETransformer
from moecore.optim.mixed_precision import grad_of
from moecore.plan.layout import layout_of
from moecore.plan.params import precision_mode, state_bytes
from moecore.train.runtime import setup_runtime


def _config(master: str, state: str) -> Config:
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
    cfg = _config(master, state)
    rt = setup_runtime(cfg)
    torch.manual_seed(0)
    model = rt.wrap_model(MoETransformer(cfg, rt.dims), micro_batches)
    opt = rt.build_optimizer(model, cfg)
    for _ in range(micro_batches):
        ids = torch.randint(0, 64, (1, 8))
        model(ids, labels=ids).loss.backward()
    rt.optimizer_step(opt)
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    moments = [t for s in opt.state.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]
    real = {
        "params": size(model.parameters()),
        "grads": size(grad_of(p) for p in model.parameters()),
        "optimizer": size(rt.mixed.masters.values()) + size(moments),
    }
    layout = layout_of(cfg, 1)
    planned = state_bytes(cfg, layout, 0, precision_mode(cfg, layout, micro_batches, device="cpu"))
    assert real == planned
    assert planned["grads"] == (4 if micro_batches > 1 else 2) * sum(p.numel() for p in model.parameters())
