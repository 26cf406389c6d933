"""DeepSeek-V3.2 (DeepSeek Sparse Attention) against transformers: sparse-stage logits with index_topk smaller
than the sequence, dense-warm-up logits, one training step in each stage (LM loss and gradients; the
indexer's KL loss and its gradients against the same loss built from transformers' attention probabilities
and indexer), export, MTP layers, the recipes and short CPU training runs of both stages."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_parity import (  # noqa: E402
    assert_close,
    build_hf,
    check_indexer_grads_only,
    check_real_size_recipe,
    import_export_parity,
    tokens,
)
from lm_parity import reference_mtp_losses, set_buffers, tiny_recipe_trains, write_mtp_layers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, DeepseekV32Config  # noqa: E402
from transformers.modeling_layers import MtpLayer  # noqa: E402
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32  # noqa: E402

from moecore.config import load_config  # noqa: E402
from moecore.hf import load_pretrained, save_pretrained  # noqa: E402
from moecore.hf.families import deepseek_v32 as family  # noqa: E402
from moecore.hf.families import get_family  # noqa: E402
from moecore.models.dsa import DSAttention  # noqa: E402
from moecore.models.transformer import MoETransformer  # noqa: E402

V, S, TOPK = 96, 16, 5


def v32_config(**over) -> DeepseekV32Config:
    fields = dict(
        vocab_size=V,
        hidden_size=48,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        max_position_embeddings=128,
        index_topk=TOPK,
        index_head_dim=16,
        index_n_heads=8,
    )
    return DeepseekV32Config(**{**fields, **over})


def build(cfg: DeepseekV32Config):
    ref = build_hf(cfg)
    set_buffers(ref, "e_score_correction_bias", 0.1)
    return ref


def _set_hf_topk(ref, topk: int) -> None:
    for layer in ref.model.layers:
        layer.self_attn.indexer.index_topk = topk


def _load(folder, stage: str):
    ours = load_pretrained(folder)
    ours.cfg.model.dsa_stage = stage
    for m in ours.modules():
        if isinstance(m, DSAttention):
            m.stage = stage
    return ours


def test_sparse_import_export(tmp_path):
    """index_topk 5 < sequence 12: transformers' sparse logits, on import and after export; the dense stage
    gives other logits (the selection matters), equal to transformers' with a top-k covering every token."""
    ref = build(v32_config())
    ours, out = import_export_parity(ref, tmp_path)
    m = ours.cfg.model
    assert (m.attention_type, m.index_topk, m.index_n_heads, m.index_head_dim, m.dsa_stage) == (
        "dsa",
        5,
        8,
        16,
        "sparse",
    )
    ids = tokens(V)
    dense = _load(tmp_path / "hf", "dense_warmup")
    with torch.no_grad():
        sparse_logits = ref(ids).logits
        dense_logits = dense(ids).logits
        assert (dense_logits - sparse_logits).abs().max() > 1e-2
        _set_hf_topk(ref, 10_000)
        assert_close(dense_logits, ref(ids).logits, "dense warm-up logits")


# --------------------------------------------------------------------------------------------------
# One training step in each stage
# --------------------------------------------------------------------------------------------------


def _hf_indexer_and_attention(ref, ids: torch.Tensor, dense: bool):
    """Per layer, from transformers' own modules: (index scores I [B, S, S] with gradient to the indexer's
    parameters, the indices transformers' indexer selected, the attention probabilities [B, n, S, S]).
    I follows the formula of transformers' DeepseekV32Indexer docstring, from its submodules."""
    inputs, latents, picked = {}, {}, {}
    hooks = []
    for i, layer in enumerate(ref.model.layers):
        attn = layer.self_attn
        hooks.append(
            attn.register_forward_pre_hook(
                lambda m, a, kw, i=i: inputs.__setitem__(i, kw["hidden_states"]), with_kwargs=True
            )
        )
        hooks.append(attn.q_a_layernorm.register_forward_hook(lambda m, a, o, i=i: latents.__setitem__(i, o)))
        hooks.append(attn.indexer.register_forward_hook(lambda m, a, o, i=i: picked.__setitem__(i, o.long())))
    _set_hf_topk(ref, 10_000 if dense else TOPK)
    out = ref(ids, output_attentions=True)
    for h in hooks:
        h.remove()
    b, s = ids.shape
    pos = torch.arange(s)[None]
    results = []
    for i, layer in enumerate(ref.model.layers):
        ix = layer.self_attn.indexer
        x, cq = inputs[i].detach(), latents[i].detach()
        cos, sin = ref.model.rotary_emb(x, pos)
        q = ix.wq_b(cq).view(b, s, ix.n_heads, ix.head_dim)
        k = ix.k_norm(ix.wk(x)).unsqueeze(2)
        dr = ix.qk_rope_head_dim
        q_rot, k_rot = hf_v32.apply_rotary_pos_emb(q[..., :dr], k[..., :dr], cos, sin, unsqueeze_dim=2)
        q, k = torch.cat((q_rot, q[..., dr:]), -1), torch.cat((k_rot, k[..., dr:]), -1).squeeze(2)
        scores = torch.relu(torch.einsum("bthd,bsd->bths", q, k) * ix.softmax_scale)
        w = ix.weights_proj(x) * ix.n_heads**-0.5
        results.append((torch.einsum("bth,bths->bts", w, scores), picked[i], out.attentions[i].detach()))
    return results


def _reference_kl(results, dense: bool) -> torch.Tensor:
    """Mean over layers and queries of KL(attention probabilities summed over heads / n || softmax(I)), over
    the visible keys (dense) or the selected ones (sparse)."""
    losses = []
    for index_scores, picked, probs in results:
        b, s, _ = index_scores.shape
        visible = torch.ones(s, s, dtype=torch.bool).tril()[None].expand(b, -1, -1)
        keep = visible.clone()
        if not dense:
            keep = torch.zeros_like(visible).scatter(-1, picked, True) & visible
        target = probs.sum(1) / probs.shape[1] * keep
        log_q = torch.log_softmax(index_scores.masked_fill(~keep, float("-inf")), -1).masked_fill(~keep, 0.0)
        losses.append((torch.xlogy(target, target) - target * log_q).sum(-1).mean())
    return torch.stack(losses).mean()


@pytest.mark.parametrize("stage", ["sparse", "dense_warmup"])
def test_train_step(tmp_path, stage):
    """Sparse: LM loss and every non-indexer gradient equal transformers' (whose indexer has no gradient);
    the LM loss sends no gradient into the indexer. Both stages: the KL loss and the indexer's gradients
    equal the reference built from transformers' attention probabilities and indexer. Dense warm-up: the
    objective trains the indexers only."""
    ref = build(v32_config())
    ref.save_pretrained(tmp_path)
    ours = _load(tmp_path, stage).train()
    ref.train()
    ids = tokens(V, seq=S + 1, seed=3)
    x, y = ids[:, :-1], ids[:, 1:]
    out = ours(x, labels=y)
    family_maps = get_family("deepseek_v32").tensor_maps(ours.cfg, set(ref.state_dict()))
    params, hf_params = dict(ours.named_parameters()), dict(ref.named_parameters())

    if stage == "sparse":
        _set_hf_topk(ref, TOPK)
        ref_loss = ref(ids, labels=ids).loss
        assert_close(out.lm_loss, ref_loss, "LM loss")
        ref_loss.backward()
        out.lm_loss.backward(retain_graph=True)
        for mp in family_maps:
            if mp.ours not in params:
                continue
            g, (name,) = params[mp.ours].grad, mp.hf_names()
            if ".indexer." in mp.ours:
                assert g is None, f"the LM loss reached {mp.ours}"
                continue
            want = hf_params[name].grad
            assert (g - want).abs().max() <= 1e-4 * max(1e-3, want.abs().max().item()), mp.ours
    else:
        assert out.lm_loss.grad_fn is None and out.loss is out.indexer_loss

    ref.zero_grad()
    ours.zero_grad()
    dense = stage == "dense_warmup"
    ref.eval()
    want = _reference_kl(_hf_indexer_and_attention(ref, x, dense), dense)
    assert_close(out.indexer_loss, want, "indexer KL loss")
    want.backward()
    out.indexer_loss.backward()
    assert check_indexer_grads_only(ours, ref, family_maps) == 5 * ours.cfg.model.num_layers


def test_mtp_layer_import_export(tmp_path):
    """An MTP layer (itself a DSA layer with its indexer) as DeepSeek stores it: its loss equals transformers'
    MtpLayer on the same tensors; every tensor is written back unchanged."""
    ref = build(v32_config())
    src = tmp_path / "hf"
    ref.save_pretrained(src)
    mtp_cfg = ref.config.get_mtp_config() if hasattr(ref.config, "num_mtp_layers") else None
    if mtp_cfg is None:
        import copy

        mtp_cfg = copy.deepcopy(ref.config)
        mtp_cfg.num_hidden_layers, mtp_cfg.first_k_dense_replace = 1, 0
        mtp_cfg.mlp_layer_types, mtp_cfg.layer_types = ["sparse"], ["indexed_attention"]
    mtp_cfg._attn_implementation = "eager"
    layers = torch.nn.ModuleList([MtpLayer(mtp_cfg, hf_v32.DeepseekV32DecoderLayer, hf_v32.DeepseekV32RMSNorm, 0)])
    from hf_parity import randomize

    randomize(layers, 4)
    set_buffers(layers, "e_score_correction_bias", 0.1, seed=8)
    write_mtp_layers(src, layers, ref.config.num_hidden_layers)
    ours = load_pretrained(src)
    assert ours.cfg.model.mtp_num_layers == 1
    ids = tokens(V, seq=S + 1, seed=6)
    with torch.no_grad():
        out = ours(ids[:, :S], labels=ids[:, 1:])
        (want,) = reference_mtp_losses(ref, layers, ids)
    torch.testing.assert_close(out.mtp_losses[0], want, rtol=1e-5, atol=1e-5)
    exported = save_pretrained(ours, tmp_path / "export")
    before, after = load_file(src / "model.safetensors"), load_file(exported / "model.safetensors")
    assert sorted(before) == sorted(after) and all(torch.equal(after[n], t) for n, t in before.items())
    back = AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager").eval()
    with torch.no_grad():
        assert_close(back(ids[:, :S]).logits, ref(ids[:, :S]).logits)


def test_refusals():
    base = v32_config().to_dict()
    for field, value in (
        ("q_lora_rank", None),
        ("layer_types", ["full_attention"] * 2),
        ("mlp_layer_types", ["sparse"] * 2),
    ):
        with pytest.raises(ValueError, match=field):
            family.config_from_hf({**base, field: value})
    cfg = load_config("tiny-deepseek-v32")
    cfg.model.attention_type = "mla"
    with pytest.raises(ValueError, match="model.attention_type"):
        family.config_to_hf(cfg)


# --------------------------------------------------------------------------------------------------
# Recipes (deepseek-ai/DeepSeek-V3.2-Exp config.json; its fp8 weights are dequantized on import)
# --------------------------------------------------------------------------------------------------

DEEPSEEK_V32 = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_real_size_recipe():
    # config.json leaves the balance-loss weight to transformers' default (1e-3); the recipe keeps DeepSeek-V3's
    # training value 1e-4 (as the deepseek-v3 recipe does), the only field set apart here.
    check_real_size_recipe("deepseek-v3.2", {**DEEPSEEK_V32, "aux_loss_alpha": 0.0001})
    ours = load_config("deepseek-v3.2").validate()
    ref = family.config_from_hf(DEEPSEEK_V32)
    for f in ("attention_type", "index_n_heads", "index_head_dim", "index_topk", "q_lora_rank", "kv_lora_rank",
              "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mtp_num_layers"):  # fmt: skip
        assert getattr(ours.model, f) == getattr(ref.model, f), f
    with torch.device("meta"):
        total, _ = MoETransformer(load_config("deepseek-v3.2", ["model.mtp_num_layers=0"])).num_params()
        hf_cfg = {k: v for k, v in DEEPSEEK_V32.items() if k not in ("architectures", "model_type")}
        hf_total = sum(p.numel() for p in AutoModelForCausalLM.from_config(DeepseekV32Config(**hf_cfg)).parameters())
    assert total == hf_total and 671e9 < total < 690e9, (total, hf_total)


@pytest.mark.parametrize("stage", ["sparse", "dense_warmup"])
def test_tiny_recipe_trains(tmp_path, stage):
    """`moecore train tiny-deepseek-v32` on the CPU (sequence 32 > index_topk 16): the LM loss falls in the
    sparse stage, the indexer's KL loss in the dense warm-up (the rest of the model is frozen there)."""
    from moecore.hf.families.deepseek_v32 import config_to_hf

    config_to_hf(load_config("tiny-deepseek-v32", ["model.vocab_size=64"]))  # the tiny model is exportable
    extra = ("model.num_layers=2", "model.mtp_num_layers=0", f"model.dsa_stage={stage}")
    if stage == "sparse":
        tiny_recipe_trains("tiny-deepseek-v32", tmp_path, extra=extra)
        return
    import json

    from moecore.train.loop import train

    args = ["train.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=4", "train.eval_interval=0",
            "train.steps=12", "train.device=cpu", "optim.warmup_steps=2", "optim.lr=0.01", "log.progress=false",
            "log.tensorboard=false", "log.interval=1", f"train.run_dir={tmp_path / 'run'}", *extra]  # fmt: skip
    result = train(load_config("tiny-deepseek-v32", args))
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    kl = [r["indexer_loss"] for r in rows if "indexer_loss" in r]
    assert len(kl) == 12 and sum(kl[-3:]) < 0.8 * sum(kl[:3]), kl
    lm = [loss for _, loss in result.losses]
    assert max(lm) - min(lm) < 0.2 * lm[0], lm  # the main model is frozen: only batch-to-batch variation
