"""Multi-token prediction against transformers' DeepSeek-V3 decoder and its MtpLayer, with copied weights.

The main model here is all dense (first_k_dense_replace = num_layers) so that it maps one to one onto
transformers' DeepseekV3ForCausalLM; the MoE version is covered by tests/hf/test_deepseek.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moecore.config import Config
from moecore.models.mtp import roll_left
from moecore.models.transformer import MoETransformer

transformers = pytest.importorskip("transformers")
from transformers.modeling_layers import MtpLayer  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3  # noqa: E402

V, H, L, HEADS, FFN, S = 96, 48, 2, 4, 80, 20


def _pair(depths: int, seed: int = 0):
    cfg = Config()
    m = cfg.model
    m.family, m.vocab_size, m.hidden_size, m.num_layers, m.num_attention_heads = "deepseek_v3", V, H, L, HEADS
    m.num_kv_heads, m.ffn_hidden_size, m.attention_type = HEADS, FFN, "mla"
    m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = 24, 16, 12, 8, 10
    m.mtp_num_layers, m.mtp_loss_scaling_factor, m.fused_cross_entropy = depths, 0.3, False
    cfg.moe.num_experts = 0
    cfg.validate()
    hf_cfg = transformers.DeepseekV3Config(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=FFN,
        num_hidden_layers=L,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        first_k_dense_replace=L + depths,  # every layer dense, the MTP blocks included
        n_group=1,
        topk_group=1,
        num_mtp_layers=depths,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    ref = hf_v3.DeepseekV3ForCausalLM(hf_cfg).eval()
    norm = hf_v3.DeepseekV3RMSNorm
    mtp = torch.nn.ModuleList(MtpLayer(hf_cfg, hf_v3.DeepseekV3DecoderLayer, norm, L + k) for k in range(depths))
    with torch.no_grad():
        for p in list(ref.parameters()) + list(mtp.parameters()):
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    ours = MoETransformer(cfg).eval()
    ours.load_state_dict(_to_ours(ref.state_dict(), mtp.state_dict()), strict=True)
    return ours, ref, mtp


def _layer_names(name: str) -> str:
    return (
        name.replace("self_attn.", "attn.")
        .replace("input_layernorm.", "attn_norm.")
        .replace("post_attention_layernorm.", "mlp_norm.")
    )


def _to_ours(main: dict, mtp: dict) -> dict:
    out = {}
    for k, v in main.items():
        k = (
            k.replace("model.embed_tokens.", "embed.")
            .replace("model.norm.", "norm.")
            .replace("model.layers.", "layers.")
        )
        out[_layer_names(k)] = v
    for k, v in mtp.items():
        k = k.replace(".mtp_block.", ".block.").replace(".post_norm.", ".head_norm.")
        out["mtp.layers." + _layer_names(k)] = v
    return out


def _reference_losses(ref, mtp, tokens: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Depth k on the first S-k positions only (no roll): embeds of tokens k.., targets tokens k+1.."""
    h = ref.model(tokens[:, :S]).last_hidden_state  # final-normed, as transformers' MTP drafting uses
    rotary = ref.model.rotary_emb
    losses = []
    for k, layer in enumerate(mtp, start=1):
        n = S - k
        emb = ref.model.embed_tokens(tokens[:, k : k + n])
        pos = torch.arange(n)[None]
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        h = layer(emb, h[:, :n], rotary(emb, pos), attention_mask=causal, position_ids=pos, cache=None)
        ce = F.cross_entropy(ref.lm_head(h).flatten(0, 1), tokens[:, k + 1 : k + 1 + n].flatten(), reduction="none")
        m = mask[:, k : k + n].flatten()
        losses.append((ce * m).sum() / m.sum())
    return losses


@pytest.mark.parametrize("depths", [1, 2])
def test_mtp_losses_match_transformers_mtp_layers(depths):
    ours, ref, mtp = _pair(depths)
    torch.manual_seed(1)
    tokens = torch.randint(0, V, (2, S + 1))
    mask = (torch.rand(2, S) > 0.2).float()
    out = ours(tokens[:, :S], labels=tokens[:, 1:], loss_mask=mask)
    with torch.no_grad():
        ref_logits = ref(tokens[:, :S]).logits
        want = _reference_losses(ref, mtp, tokens, mask)
    torch.testing.assert_close(out.logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert len(out.mtp_losses) == depths
    for got, w in zip(out.mtp_losses, want):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.mtp_loss, 0.3 * torch.stack(want).mean(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, out.lm_loss + out.mtp_loss)


def test_mtp_gradients_reach_every_mtp_parameter_and_the_shared_head():
    ours, _, _ = _pair(2)
    ours.train()
    tokens = torch.randint(0, V, (2, S + 1))
    out = ours(tokens[:, :S], labels=tokens[:, 1:])
    out.mtp_loss.backward()
    for name, p in ours.mtp.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert ours.lm_head.weight.grad.abs().sum() > 0 and ours.embed.weight.grad.abs().sum() > 0


def test_roll_left():
    t = torch.arange(10).view(2, 5)
    torch.testing.assert_close(roll_left(t, 2, fill=-1), torch.tensor([[2, 3, 4, -1, -1], [7, 8, 9, -1, -1]]))


def test_tiny_v3_training_lowers_lm_and_mtp_losses():
    """The tiny DeepSeek-V3 recipe (MoE with expert bias, group routing, one MTP layer), shrunk further,
    learns sequences t_{i+1} = t_i + step (mod V): both the next-token and the MTP loss must fall."""
    from moecore.config import load_config

    cfg = load_config(
        "tiny-deepseek-v3",
        ["model.vocab_size=64", "model.hidden_size=64", "model.num_layers=2", "model.ffn_hidden_size=128"],
    ).validate()
    torch.manual_seed(0)
    model = MoETransformer(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    lm, mtp = [], []
    for _ in range(25):
        start = torch.randint(0, 64, (16, 1), generator=g)
        step = torch.randint(1, 4, (16, 1), generator=g)
        tokens = (start + step * torch.arange(33)) % 64
        out = model(tokens[:, :32], labels=tokens[:, 1:])
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        for layer in model.moe_layers():
            layer.update_expert_bias()
        lm.append(out.lm_loss.item())
        mtp.append(out.mtp_losses[0].item())
    assert sum(lm[-5:]) / 5 < 0.5 * sum(lm[:5]) / 5, lm
    assert sum(mtp[-5:]) / 5 < 0.5 * sum(mtp[:5]) / 5, mtp
    # The MTP block is an MoE layer whose expert bias moved like the main layers' ones.
    assert model.mtp.layers[0].block.mlp.router.expert_bias.abs().sum() > 0
