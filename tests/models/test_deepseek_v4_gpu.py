"""DeepSeek-V4 on a GPU: the flex_attention path of its attention against the eager reference (each layer kind,
fp32 and bf16, output and every gradient), the whole tiny model on CUDA against the CPU (fp32, TF32 off), and the
tiny recipe training in bf16 through the trainer."""

from __future__ import annotations

import copy

import pytest
import torch

from moecore.config import ModelConfig, load_config
from moecore.models.compressed_attention import CompressedAttention
from moecore.models.transformer import MoETransformer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
SEQ = 300  # three 128-row blocks of queries, the last one partial; no multiple of either rate


def attention_config() -> ModelConfig:
    m = ModelConfig(hidden_size=128, num_layers=3, num_attention_heads=4, num_kv_heads=1, head_dim=64)
    m.attention_type, m.layer_types, m.q_lora_rank, m.qk_rope_head_dim = "compressed", KINDS, 32, 16
    m.sliding_window, m.csa_compress_rate, m.hca_compress_rate, m.o_groups, m.o_lora_rank = 64, 4, 16, 2, 32
    m.index_n_heads, m.index_head_dim, m.index_topk, m.attn_sinks = 4, 32, 8, True
    m.compress_rope_scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    return m


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_flex_path_matches_eager(kind: str, dtype: torch.dtype, tol: float) -> None:
    """Same module, same inputs: flex_attention (TF32 / bf16 inside its kernel) against the eager scores."""
    torch.manual_seed(0)
    eager = CompressedAttention(attention_config(), KINDS.index(kind)).cuda()
    with torch.no_grad():
        for name, p in eager.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    eager = eager.to(dtype)
    flex = copy.deepcopy(eager)
    eager.use_flex = False
    x = torch.randn(2, SEQ, 128, device="cuda", dtype=dtype)
    pos = torch.arange(SEQ, device="cuda")
    outs = []
    for m in (eager, flex):
        xi = x.clone().requires_grad_()
        out = m(xi, pos)
        out.float().square().sum().backward()
        outs.append((out.float(), xi.grad.float(), {n: p.grad for n, p in m.named_parameters()}))
    (ref, ref_dx, ref_g), (got, got_dx, got_g) = outs
    assert (got - ref).abs().max() <= tol * ref.abs().max()
    assert (got_dx - ref_dx).abs().max() <= tol * ref_dx.abs().max()
    for name, g in ref_g.items():
        if g is None:  # the indexer: no gradient in either path
            assert got_g[name] is None, name
            continue
        err = (got_g[name].float() - g.float()).abs().max()
        assert err <= tol * g.float().abs().max(), (name, float(err))


def test_model_on_cuda_equals_cpu() -> None:
    """The tiny recipe's model, fp32, one forward and backward: CUDA (flex attention, Triton norms and RoPE, the
    experts' loop) against the CPU's eager reference. Every expert and every ready compressed entry is picked, so no
    discrete choice can flip between the devices' roundings (the flex test above covers the picks); flex_attention's
    Triton kernels compute fp32 dot products in TF32, hence the 1e-3 bound on the gradients."""
    over = ["model.vocab_size=256", "train.precision=fp32", "moe.router_topk=8", "model.index_topk=64"]
    cfg = load_config("tiny-deepseek-v4", over)
    torch.manual_seed(0)
    cpu = MoETransformer(cfg).train()
    gpu = copy.deepcopy(cpu).cuda()
    ids = torch.randint(0, 256, (2, 129), generator=torch.Generator().manual_seed(1))
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        losses = []
        for m, dev in ((cpu, "cpu"), (gpu, "cuda")):
            out = m(ids[:, :-1].to(dev), labels=ids[:, 1:].to(dev))
            out.loss.backward()
            losses.append(float(out.loss.detach()))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    assert abs(losses[0] - losses[1]) <= 1e-4 * abs(losses[0])
    gpu_params = dict(gpu.named_parameters())
    for name, p in cpu.named_parameters():
        if p.grad is None:
            assert gpu_params[name].grad is None, name
            continue
        err = (gpu_params[name].grad.cpu() - p.grad).abs().max()
        assert err <= 1e-3 * p.grad.abs().max() + 1e-7, (name, float(err))


def test_tiny_recipe_trains_in_bf16(tmp_path) -> None:
    from moecore.train.loop import Trainer

    cfg = load_config(
        "tiny-deepseek-v4",
        ["train.steps=40", "train.eval_interval=0", "log.progress=false", "log.tensorboard=false",
         "optim.warmup_steps=5", f"train.run_dir={tmp_path}"],
    )  # fmt: skip
    trainer = Trainer(cfg)
    try:
        losses = [trainer.train_step(with_moe_metrics=False)["loss"] for _ in range(40)]
        assert next(trainer.model.parameters()).dtype == torch.bfloat16
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
        paths = {m.experts.last_path for m in trainer.model.moe_layers()}
        assert paths == {"fused"}, paths  # the clipped SwiGLU in the fused expert FFN's SwiGLU kernel
    finally:
        trainer.rt.shutdown()
