"""MoELayer end to end: Hugging Face MoE blocks (Mixtral, Qwen2-MoE with gated shared expert, DeepSeek-V3),
capacity dropping and its statistics, aux-loss-free expert bias, parameter names."""

from __future__ import annotations

import pytest
import torch

from moecore.config import MoEConfig
from moecore.moe.experts import experts_reference
from moecore.moe.layer import MoELayer, update_expert_biases
from moecore.moe.permute import capacity_keep, expert_capacity


def _load(ours: MoELayer, gate, experts, shared=None, shared_gate=None) -> None:
    with torch.no_grad():
        ours.router.weight.copy_(gate.weight)
        if ours.router.expert_bias is not None:
            ours.router.expert_bias.copy_(gate.e_score_correction_bias)
        ours.experts.w13.copy_(experts.gate_up_proj)
        ours.experts.w2.copy_(experts.down_proj)
        if shared is not None:
            for n in ("gate_proj", "up_proj", "down_proj"):
                getattr(ours.shared_experts, n).weight.copy_(getattr(shared, n).weight)
        if shared_gate is not None:
            ours.shared_expert_gate.weight.copy_(shared_gate.weight)


def _randomise(module: torch.nn.Module, std: float = 0.2) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(std=std)


@pytest.mark.parametrize("probs_on_input", [False, True], ids=["probs-at-combine", "probs-in-activation"])
def test_matches_hf_mixtral_block(probs_on_input):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(0)
    hf_cfg = MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=8, num_experts_per_tok=2)
    hf_cfg._experts_implementation = "eager"
    hf = MixtralSparseMoeBlock(hf_cfg).eval()
    _randomise(hf)
    cfg = MoEConfig(
        num_experts=8, router_topk=2, router_pre_softmax=True, ffn_hidden_size=24, apply_probs_on_input=probs_on_input
    )
    ours = MoELayer(cfg, 16).eval()
    _load(ours, hf.gate, hf.experts)
    x = torch.randn(3, 10, 16)
    torch.testing.assert_close(ours(x)[0], hf(x))


def test_routing_weights_inside_the_activation_give_the_same_layer_and_gradients():
    """moe.apply_probs_on_input (every full-size recipe sets it) against weighting at the combine: the same
    outputs, input gradient, weight gradients and routing-loss values in float64, with a gated shared expert,
    an auxiliary loss and experts that receive no token."""
    torch.manual_seed(5)
    results = []
    for inside in (False, True):
        cfg = MoEConfig(
            num_experts=12, router_topk=3, ffn_hidden_size=10, shared_expert_intermediate_size=14,
            shared_expert_gate=True, router_load_balancing_type="aux_loss", aux_loss_coeff=1e-2,
            apply_probs_on_input=inside,
        )  # fmt: skip
        torch.manual_seed(6)
        layer = MoELayer(cfg, 16).double()
        _randomise(layer)
        x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
        y, aux = layer(x)
        (y.square().sum() + aux.loss).backward()
        results.append((y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}, aux.stats))
    (y0, dx0, g0, s0), (y1, dx1, g1, s1) = results
    assert (s0["tokens_per_expert"] == 0).any()  # some experts get no token
    torch.testing.assert_close(y1, y0)
    torch.testing.assert_close(dx1, dx0)
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], msg=n)
    torch.testing.assert_close(s1["aux_loss"], s0["aux_loss"])


def test_matches_hf_qwen2_moe_block_with_gated_shared_expert():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    torch.manual_seed(1)
    hf_cfg = Qwen2MoeConfig(
        hidden_size=16, moe_intermediate_size=12, shared_expert_intermediate_size=20, num_experts=6,
        num_experts_per_tok=4, norm_topk_prob=False,
    )  # fmt: skip
    hf_cfg._experts_implementation = "eager"
    hf = Qwen2MoeSparseMoeBlock(hf_cfg).eval()
    _randomise(hf)
    cfg = MoEConfig(
        num_experts=6, router_topk=4, router_pre_softmax=True, norm_topk_prob=False, ffn_hidden_size=12,
        shared_expert_intermediate_size=20, shared_expert_gate=True,
    )  # fmt: skip
    ours = MoELayer(cfg, 16).eval()
    _load(ours, hf.gate, hf.experts, hf.shared_expert, hf.shared_expert_gate)
    x = torch.randn(2, 9, 16)
    torch.testing.assert_close(ours(x)[0], hf(x))


def test_matches_hf_deepseek_v3_moe():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    torch.manual_seed(2)
    hf_cfg = DeepseekV3Config(
        hidden_size=16, num_attention_heads=4, moe_intermediate_size=8, n_routed_experts=16, num_experts_per_tok=4,
        n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=2,
    )  # fmt: skip
    hf_cfg._experts_implementation = "eager"
    hf = DeepseekV3MoE(hf_cfg).eval()
    _randomise(hf)
    with torch.no_grad():
        hf.gate.e_score_correction_bias.normal_(std=0.3)
    cfg = MoEConfig(
        num_experts=16, router_topk=4, router_score_function="sigmoid", norm_topk_prob=True,
        router_topk_scaling_factor=2.5, router_num_groups=4, router_group_topk=2, router_group_score="top2_sum",
        router_enable_expert_bias=True, ffn_hidden_size=8, shared_expert_intermediate_size=16,
    )  # fmt: skip
    ours = MoELayer(cfg, 16).eval()
    _load(ours, hf.gate, hf.experts, hf.shared_experts)
    x = torch.randn(2, 12, 16)
    torch.testing.assert_close(ours(x)[0], hf(x))


def test_parameter_names_and_dims_none():
    cfg = MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=8, shared_expert_intermediate_size=8,
                    shared_expert_gate=True, router_enable_expert_bias=True)  # fmt: skip
    layer = MoELayer(cfg, 12, dims=None)
    shapes = {k: tuple(v.shape) for k, v in layer.state_dict().items()}
    assert shapes == {
        "router.weight": (4, 12),
        "router.expert_bias": (4,),
        "experts.w13": (4, 16, 12),
        "experts.w2": (4, 12, 8),
        "shared_experts.gate_proj.weight": (8, 12),
        "shared_experts.up_proj.weight": (8, 12),
        "shared_experts.down_proj.weight": (12, 8),
        "shared_expert_gate.weight": (1, 12),
    }
    gelu = MoELayer(MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=8), 12, activation="gelu")
    assert tuple(gelu.experts.w13.shape) == (4, 8, 12)
    y, _ = gelu(torch.randn(2, 3, 12))
    assert y.shape == (2, 3, 12)


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_capacity_drops_and_stats(policy, pad):
    torch.manual_seed(3)
    cfg = MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=8, expert_capacity_factor=0.6,
                    token_drop_policy=policy, pad_expert_input_to_capacity=pad)  # fmt: skip
    layer = MoELayer(cfg, 12)
    with torch.no_grad():
        layer.router.weight[0] += 0.5  # skew the routing so that some experts overflow
    x = torch.randn(2, 16, 12) + 0.5
    mask = torch.ones(2, 16)
    mask[1, 12:] = 0
    y, aux = layer(x, mask)
    r = layer.router(x.reshape(-1, 12))
    C = expert_capacity(32, 2, 4, 0.6)
    keep = capacity_keep(r.topk_idx_TK, r.topk_weight_TK, 4, C, policy)
    assert (~keep).any()
    expected = experts_reference(x.reshape(-1, 12), r.topk_idx_TK, r.topk_weight_TK * keep, layer.experts.w13,
                                 layer.experts.w2, "swiglu")  # fmt: skip
    torch.testing.assert_close(y.reshape(-1, 12), expected, rtol=1e-5, atol=1e-6)
    valid = mask.reshape(-1).bool()
    kept_valid = keep & valid.unsqueeze(-1)
    tpe = torch.bincount(r.topk_idx_TK[kept_valid], minlength=4).float()
    torch.testing.assert_close(aux.stats["tokens_per_expert"], tpe)
    torch.testing.assert_close(aux.stats["dropped_fraction"], 1 - kept_valid.sum() / (2 * valid.sum()))
    torch.testing.assert_close(aux.stats["imbalance"], tpe.max() / tpe.mean())


def test_zero_token_experts_in_backward():
    torch.manual_seed(4)
    layer = MoELayer(MoEConfig(num_experts=8, router_topk=1, ffn_hidden_size=8, router_pre_softmax=True), 12)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:2] = torch.rand(2, 12) + 0.5  # positive inputs: experts 2..7 never chosen
    y, aux = layer(torch.rand(2, 5, 12))
    (y.square().sum() + aux.loss).backward()
    assert aux.stats["tokens_per_expert"][2:].sum() == 0
    assert layer.experts.w13.grad[2:].abs().sum() == 0 and layer.experts.w13.grad[:2].abs().sum() > 0


def test_expert_bias_moves_skewed_routing_toward_balance():
    """Aux-loss-free balancing alone (no aux loss, frozen weights): the bias update evens out the load."""
    torch.manual_seed(5)
    cfg = MoEConfig(num_experts=8, router_topk=2, ffn_hidden_size=8, router_score_function="sigmoid",
                    router_enable_expert_bias=True, router_bias_update_rate=0.02,
                    router_load_balancing_type="none", aux_loss_coeff=0.0)  # fmt: skip
    layer = MoELayer(cfg, 12)
    with torch.no_grad():
        layer.router.weight.normal_(std=0.3)
        layer.router.weight[:2] += 0.4  # experts 0 and 1 attract most tokens
    x = torch.randn(2, 64, 12) + 0.5
    imbalance = []
    for _ in range(40):  # one micro-batch per optimizer step
        _, aux = layer(x)
        imbalance.append(aux.stats["imbalance"].item())
        update_expert_biases(layer)
    assert imbalance[0] > 2.5
    assert max(imbalance[-10:]) < 1.5
    assert layer.router.expert_bias[:2].max() < layer.router.expert_bias[2:].min()  # favourites pushed down
    # the bias decides the choice only: the weights still come from the unbiased sigmoid scores
    r = layer.router(x.reshape(-1, 12))
    torch.testing.assert_close(r.topk_weight_TK, torch.sigmoid(r.logits_TE).gather(1, r.topk_idx_TK) /
                               torch.sigmoid(r.logits_TE).gather(1, r.topk_idx_TK).sum(-1, keepdim=True))  # fmt: skip


def test_expert_bias_counts_only_training_forwards():
    layer = MoELayer(MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=8, router_enable_expert_bias=True), 12)
    x = torch.randn(1, 6, 12)
    with torch.no_grad():
        layer(x)
    layer.eval()
    layer(x)
    assert layer.router.local_tokens_per_expert.sum() == 0
    layer.train()
    mask = torch.tensor([[1, 1, 1, 0, 0, 0]])
    layer(x, mask)
    assert layer.router.local_tokens_per_expert.sum() == 3 * 2  # padding tokens are not counted
