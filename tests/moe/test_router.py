"""Router: hand-worked examples for each scoring / grouping / scaling option, and parity with the
routers of Hugging Face transformers (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2, DeepSeek-V3)."""

from __future__ import annotations

import math

import pytest
import torch

from moecore.config import MoEConfig
from moecore.moe.router import TopKRouter, topk_routing


def _route(logits, k, **kw):
    w, idx = topk_routing(torch.tensor([logits], dtype=torch.float64), k, **kw)
    order = torch.argsort(idx[0])
    return idx[0][order].tolist(), w[0][order].tolist()


def _sig(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


L4 = [1.0, 2.0, 0.5, -1.0]


def test_softmax_pre_renormalised():
    idx, w = _route(L4, 2, pre_softmax=True, norm_topk_prob=True)
    assert idx == [0, 1]
    assert w == pytest.approx([1 / (1 + math.e), math.e / (1 + math.e)], abs=1e-12)


def test_softmax_pre_not_renormalised():
    z = sum(math.exp(v) for v in L4)
    idx, w = _route(L4, 2, pre_softmax=True, norm_topk_prob=False)
    assert idx == [0, 1]
    assert w == pytest.approx([math.exp(1) / z, math.exp(2) / z], abs=1e-12)


def test_softmax_after_topk_equals_renormalised():
    idx, w = _route(L4, 3, pre_softmax=False)
    z = math.exp(1) + math.exp(2) + math.exp(0.5)
    assert idx == [0, 1, 2]
    assert w == pytest.approx([math.exp(1) / z, math.exp(2) / z, math.exp(0.5) / z], abs=1e-12)


def test_topk_one_and_scaling():
    idx, w = _route(L4, 1, pre_softmax=True, norm_topk_prob=False, scaling_factor=16.0)
    z = sum(math.exp(v) for v in L4)
    assert idx == [1] and w == pytest.approx([16.0 * math.exp(2) / z], abs=1e-12)


def test_sigmoid_plain_and_renormalised_with_scaling():
    idx, w = _route(L4, 2, score_function="sigmoid", norm_topk_prob=False)
    assert idx == [0, 1] and w == pytest.approx([_sig(1), _sig(2)], abs=1e-12)
    idx, w = _route(L4, 2, score_function="sigmoid", norm_topk_prob=True, scaling_factor=2.5)
    s = _sig(1) + _sig(2) + 1e-20
    assert idx == [0, 1] and w == pytest.approx([2.5 * _sig(1) / s, 2.5 * _sig(2) / s], abs=1e-12)


def test_expert_bias_selects_but_does_not_weight():
    bias = torch.tensor([0.0, 0.0, 0.5, 0.0], dtype=torch.float64)
    # selection scores: sigmoid + bias = [0.731, 0.881, 1.122, 0.269] -> experts 1 and 2
    idx, w = _route(L4, 2, score_function="sigmoid", norm_topk_prob=False, expert_bias_E=bias)
    assert idx == [1, 2] and w == pytest.approx([_sig(2), _sig(0.5)], abs=1e-12)


# 8 experts in 4 groups of 2. Group scores: max = [5, 3, 4, 0]; top2_sum = [0, 5.9, 1, -1].
L8 = [5.0, -5.0, 3.0, 2.9, 4.0, -3.0, 0.0, -1.0]


def test_group_limited_max_and_top2_sum():
    idx, _ = _route(L8, 3)  # no groups: the three best experts
    assert idx == [0, 2, 4]
    idx, w = _route(L8, 3, num_groups=4, group_topk=2, group_score="max")  # groups 0 and 2
    assert idx == [0, 4, 5]
    z = math.exp(5) + math.exp(4) + math.exp(-3)
    assert w == pytest.approx([math.exp(5) / z, math.exp(4) / z, math.exp(-3) / z], abs=1e-12)
    idx, _ = _route(L8, 3, num_groups=4, group_topk=2, group_score="top2_sum")  # groups 1 and 2
    assert idx == [2, 3, 4]


def test_router_module_options():
    cfg = MoEConfig(num_experts=4, router_topk=2, router_dtype="fp64", router_enable_expert_bias=True)
    r = TopKRouter(cfg, 8)
    out = r(torch.randn(5, 8))
    assert out.logits_TE.dtype == torch.float64 and out.topk_weight_TK.dtype == torch.float64
    r = r.to(torch.bfloat16)
    assert r.weight.dtype == torch.bfloat16 and r.expert_bias.dtype == torch.float32
    assert "expert_bias" in r.state_dict() and "local_tokens_per_expert" not in r.state_dict()
    with pytest.raises(ValueError, match="moe.norm_topk_prob"):
        TopKRouter(MoEConfig(num_experts=4, norm_topk_prob=False), 8)


def test_input_jitter_only_in_training():
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, router_topk=2, input_jitter_eps=0.1)
    r = TopKRouter(cfg, 8)
    x = torch.randn(64, 8)
    clean = torch.nn.functional.linear(x, r.weight)
    r.eval()
    assert torch.equal(r(x).logits_TE, clean)
    r.train()
    jit = r(x).logits_TE
    assert not torch.equal(jit, clean)
    # logits of a jittered input: sum_h w_eh x_h u_h with u in [0.9, 1.1] -> within 0.1 * sum_h |w_eh x_h|
    bound = 0.1 * (x.abs() @ r.weight.abs().T) + 1e-6
    assert ((jit - clean).abs() <= bound).all()


# ---------------------------------------------------------------------------------------------
# Parity with Hugging Face routers
# ---------------------------------------------------------------------------------------------


def _compare(hf_router, ours: TopKRouter, x: torch.Tensor) -> None:
    ours.weight.data.copy_(hf_router.weight.data)
    if ours.expert_bias is not None:
        ours.expert_bias.copy_(hf_router.e_score_correction_bias)
    _, hf_w, hf_idx = hf_router(x)
    out = ours(x)
    hs, ho = torch.sort(hf_idx, dim=-1)
    os_, oo = torch.sort(out.topk_idx_TK, dim=-1)
    assert torch.equal(hs, os_)
    torch.testing.assert_close(out.topk_weight_TK.gather(1, oo), hf_w.float().gather(1, ho), rtol=0, atol=0)


def test_parity_mixtral_router():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    torch.manual_seed(0)
    hf = MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=2))
    torch.nn.init.normal_(hf.weight, std=0.5)
    cfg = MoEConfig(num_experts=8, router_topk=2, router_pre_softmax=True, norm_topk_prob=True)
    _compare(hf, TopKRouter(cfg, 16), torch.randn(64, 16))


@pytest.mark.parametrize("model", ["qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("norm", [False, True])
def test_parity_qwen_routers(model, norm):
    if model == "qwen2_moe":
        from transformers import Qwen2MoeConfig as C
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter as R
    else:
        from transformers import Qwen3MoeConfig as C
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as R
    torch.manual_seed(1)
    hf = R(C(hidden_size=16, num_experts=12, num_experts_per_tok=4, norm_topk_prob=norm))
    torch.nn.init.normal_(hf.weight, std=0.5)
    cfg = MoEConfig(num_experts=12, router_topk=4, router_pre_softmax=True, norm_topk_prob=norm)
    _compare(hf, TopKRouter(cfg, 16), torch.randn(64, 16))


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_parity_deepseek_v2_router(method):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    torch.manual_seed(2)
    hf_cfg = DeepseekV2Config(
        hidden_size=16, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        topk_method=method, routed_scaling_factor=16.0,
    )  # fmt: skip
    hf = DeepseekV2TopkRouter(hf_cfg)
    torch.nn.init.normal_(hf.weight, std=0.5)
    groups = dict(router_num_groups=4, router_group_topk=2) if method != "greedy" else {}
    cfg = MoEConfig(
        num_experts=16, router_topk=4, router_pre_softmax=True, norm_topk_prob=False,
        router_topk_scaling_factor=16.0, router_group_score="max", **groups,
    )  # fmt: skip
    _compare(hf, TopKRouter(cfg, 16), torch.randn(128, 16))


@pytest.mark.parametrize("norm", [True, False])
def test_parity_deepseek_v3_router(norm):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(3)
    hf_cfg = DeepseekV3Config(
        hidden_size=16, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        norm_topk_prob=norm, routed_scaling_factor=2.5,
    )  # fmt: skip
    hf = DeepseekV3TopkRouter(hf_cfg)
    torch.nn.init.normal_(hf.weight, std=0.5)
    hf.e_score_correction_bias.copy_(torch.randn(16) * 0.3)  # a bias that changes the selection
    cfg = MoEConfig(
        num_experts=16, router_topk=4, router_score_function="sigmoid", norm_topk_prob=norm,
        router_topk_scaling_factor=2.5, router_num_groups=4, router_group_topk=2,
        router_group_score="top2_sum", router_enable_expert_bias=True,
    )  # fmt: skip
    ours = TopKRouter(cfg, 16)
    x = torch.randn(128, 16)
    _compare(hf, ours, x)
    # the bias really matters here: without it another set of experts is picked for some tokens
    ours.expert_bias.zero_()
    assert not torch.equal(torch.sort(ours(x).topk_idx_TK, -1).values, torch.sort(hf(x)[2], -1).values)
