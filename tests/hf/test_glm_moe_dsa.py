"""GLM-5 (glm_moe_dsa) against transformers: DeepSeek sparse attention whose indexer rotates interleaved RoPE pairs,
with "shared" layers that reuse the top-k of the last "full" layer. A tiny random model with layers full, shared,
full, shared and index_topk 5 smaller than the sequence (the sparse attention selects): logits on import and after
export; one training step's LM loss and every gradient, also with full and selective recomputation (a recomputed
shared layer sees the indices of its forward); the indexers' KL loss and gradients against the same loss built
from transformers' modules; checks that these comparisons fail when the indexer is half-split or a shared layer
selects its own tokens; the MTP layer; refusals; the recipes. fp32, tolerance 1e-4 * max(1, max |reference|)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "GlmMoeDsaConfig"):
    pytest.skip("this transformers has no GLM-5 (GlmMoeDsa)", allow_module_level=True)
from hf_parity import (  # noqa: E402
    assert_close,
    build_hf,
    check_indexer_grads_only,
    check_real_size_recipe,
    check_tiny_recipe_exports,
    import_export_parity,
    randomize,
    tokens,
)
from lm_parity import reference_mtp_losses, set_buffers, tiny_recipe_trains, write_mtp_layers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers.modeling_layers import MtpLayer  # noqa: E402
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_glm  # noqa: E402

from moecore.config import ConfigError, load_config  # noqa: E402
from moecore.hf import load_pretrained, save_pretrained  # noqa: E402
from moecore.hf.families import deepseek_v32, get_family  # noqa: E402
from moecore.hf.families import glm_moe_dsa as family  # noqa: E402
from moecore.models.dsa import DSAttention, LightningIndexer  # noqa: E402
from moecore.models.transformer import MoETransformer  # noqa: E402

V, S, TOPK = 96, 16, 5
TYPES = ["full", "shared", "full", "shared"]


def glm_config(**over) -> transformers.GlmMoeDsaConfig:
    fields = dict(
        vocab_size=V, hidden_size=48, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=12,
        qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        first_k_dense_replace=1, max_position_embeddings=128, index_topk=TOPK, index_head_dim=16, index_n_heads=8,
        indexer_types=TYPES,
    )  # fmt: skip
    return transformers.GlmMoeDsaConfig(**{**fields, **over})


def build(cfg):
    ref = build_hf(cfg)
    set_buffers(ref, "e_score_correction_bias", 0.1)
    return ref


def _err(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max abs difference, the tolerance of assert_close)."""
    return (ours - ref).abs().max().item(), 1e-4 * max(1.0, ref.abs().max().item())


def test_import_export(tmp_path):
    """Logits equal transformers' on import and after export; the shared layers hold no indexer (parameter count =
    transformers'); with a top-k covering every token the logits change (the sparse selection matters)."""
    ref = build(glm_config())
    ours, out = import_export_parity(ref, tmp_path)
    m, e = ours.cfg.model, ours.cfg.moe
    assert (m.attention_type, m.indexer_rope_interleave, m.indexer_types, m.index_topk) == ("dsa", True, TYPES, TOPK)
    assert (e.first_k_dense_replace, e.router_num_groups, e.router_load_balancing_type) == (1, 4, "seq_aux_loss")
    assert [layer.attn.indexer is None for layer in ours.layers] == [False, True, False, True]
    assert ours.num_params()[0] == sum(p.numel() for p in ref.parameters())
    written = json.loads((out / "config.json").read_text())
    assert written["indexer_types"] == TYPES and written["indexer_rope_interleave"] is True
    assert written["mlp_layer_types"] == ["dense", "sparse", "sparse", "sparse"]
    ids = tokens(V)
    with torch.no_grad():
        sparse = ours(ids).logits
        for layer in ours.layers:
            layer.attn.index_topk = 10_000
        err, tol = _err(ours(ids).logits, sparse)
    assert err > 100 * tol, "index_topk < sequence, yet the selection changed nothing"


def test_parity_fails_with_a_half_split_indexer_or_shared_layers_selecting(tmp_path):
    """The logits comparison is sensitive to both GLM-5 features: it fails when the indexer rotates half-split
    pairs (DeepSeek-V3.2's RoPE) and when the shared layers select their own tokens (each with a copy of the
    indexer of the full layer before it) instead of reusing that layer's top-k."""
    ref = build(glm_config())
    ref.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    ids = tokens(V)
    with torch.no_grad():
        want = ref(ids).logits
        assert_close(ours(ids).logits, want)
        own = copy.deepcopy(ours.cfg)
        own.model.indexer_types = None
        selecting = MoETransformer(own).eval()
        missing, unexpected = selecting.load_state_dict(ours.state_dict(), strict=False)
        assert not unexpected and all(".1.attn.indexer." in k or ".3.attn.indexer." in k for k in missing)
        for i in (1, 3):
            selecting.layers[i].attn.indexer.load_state_dict(ours.layers[i - 1].attn.indexer.state_dict())
        err, tol = _err(selecting(ids).logits, want)
        assert err > 100 * tol, f"shared layers selecting their own tokens went unnoticed ({err:.3g})"
        for mod in ours.modules():
            if isinstance(mod, LightningIndexer):
                mod.rope_interleave = False
        err, tol = _err(ours(ids).logits, want)
        assert err > 100 * tol, f"a half-split indexer RoPE went unnoticed ({err:.3g})"


# --------------------------------------------------------------------------------------------------
# One training step (sparse stage), with and without recomputation
# --------------------------------------------------------------------------------------------------


def _hf_kl(ref, ids: torch.Tensor) -> torch.Tensor:
    """The indexers' KL loss from transformers' modules: per full layer, the index scores I with gradient to the
    indexer (the formula of transformers' GlmMoeDsaIndexer, interleaved RoPE), over the keys transformers' indexer
    selected, against the attention probabilities summed over heads / n; mean over queries, then full layers."""
    inputs, latents, picked = {}, {}, {}
    hooks = []
    for i, layer in enumerate(ref.model.layers):
        attn = layer.self_attn
        if attn.indexer is None:
            continue
        hooks.append(
            attn.register_forward_pre_hook(
                lambda m, a, kw, i=i: inputs.__setitem__(i, kw["hidden_states"]), with_kwargs=True
            )
        )
        hooks.append(attn.q_a_layernorm.register_forward_hook(lambda m, a, o, i=i: latents.__setitem__(i, o)))
        hooks.append(attn.indexer.register_forward_hook(lambda m, a, o, i=i: picked.__setitem__(i, o.long())))
    probs = ref(ids, output_attentions=True).attentions
    for h in hooks:
        h.remove()
    b, s = ids.shape
    visible = torch.ones(s, s, dtype=torch.bool).tril()[None].expand(b, -1, -1)
    losses = []
    for i in sorted(picked):
        ix = ref.model.layers[i].self_attn.indexer
        x, cq = inputs[i].detach(), latents[i].detach()
        cos, sin = ref.model.rotary_emb(x, torch.arange(s)[None])
        q = ix.wq_b(cq).view(b, s, ix.n_heads, ix.head_dim)
        k = ix.k_norm(ix.wk(x)).unsqueeze(2)
        dr = ix.qk_rope_head_dim
        q_rot, k_rot = hf_glm.apply_rotary_pos_emb_interleave(q[..., :dr], k[..., :dr], cos, sin, unsqueeze_dim=2)
        q, k = torch.cat((q_rot, q[..., dr:]), -1), torch.cat((k_rot, k[..., dr:]), -1).squeeze(2)
        scores = torch.relu(torch.einsum("bthd,bsd->bths", q, k) * ix.softmax_scale)
        index_scores = torch.einsum("bth,bths->bts", ix.weights_proj(x) * ix.n_heads**-0.5, scores)
        keep = torch.zeros_like(visible).scatter(-1, picked[i], True) & visible
        p = probs[i].detach()
        target = p.sum(1) / p.shape[1] * keep
        log_q = torch.log_softmax(index_scores.masked_fill(~keep, float("-inf")), -1).masked_fill(~keep, 0.0)
        losses.append((torch.xlogy(target, target) - target * log_q).sum(-1).mean())
    return torch.stack(losses).mean()


_FORWARD = DSAttention.forward


def _recording(monkeypatch, swap: dict | None = None) -> list:
    """Record every DSA layer call (layer, in a recomputation, top-k given, top-k used); `swap` {layer: other}:
    in recomputation, layer gets the top-k that `other` used in forward (a deliberately wrong recomputation)."""
    calls, orig = [], _FORWARD

    def spy(self, x, position_ids, topk_idx=None):
        again = torch._C._current_graph_task_id() != -1
        if again and swap and self.layer_idx in swap:
            topk_idx = next(c[3] for c in calls if c[0] == swap[self.layer_idx] and not c[1])
        out = orig(self, x, position_ids, topk_idx)
        calls.append((self.layer_idx, again, topk_idx, out[1]))
        return out

    monkeypatch.setattr(DSAttention, "forward", spy)
    return calls


def _ours(folder, granularity: str) -> MoETransformer:
    """The imported model rebuilt with `model.recompute_granularity` (selective: the attention norm's output)."""
    imported = load_pretrained(folder)
    cfg = copy.deepcopy(imported.cfg)
    cfg.model.recompute_granularity = granularity
    cfg.model.recompute_modules = ["norm", "moe_act"] if granularity == "selective" else []
    model = MoETransformer(cfg.validate())
    model.load_state_dict(imported.state_dict())
    return model.train()


def _lm_grad_errors(ours, ref, maps) -> dict:
    """Our gradient of every non-indexer parameter against transformers': {name: (error, tolerance)}; asserts
    the LM loss reached no indexer."""
    params, hf_params = dict(ours.named_parameters()), dict(ref.named_parameters())
    out = {}
    for mp in maps:
        if mp.ours not in params:  # the router's correction bias (a buffer)
            continue
        g, (name,) = params[mp.ours].grad, mp.hf_names()
        if ".indexer." in mp.ours:
            assert g is None, f"the LM loss reached {mp.ours}"
            continue
        want = hf_params[name].grad
        out[mp.ours] = ((g - want).abs().max().item(), 1e-4 * max(1e-3, want.abs().max().item()))
    return out


@pytest.mark.parametrize("granularity", ["none", "full", "selective"])
def test_train_step(tmp_path, monkeypatch, granularity):
    """LM loss and every non-indexer gradient equal transformers'; the indexers' KL loss and gradients equal the
    reference from transformers' modules (the LM loss reaches no indexer, the KL loss nothing else). Each shared
    layer attends to the top-k its full layer used; with full recomputation its recomputation gets those same
    indices, and the gradient comparison fails if it got another full layer's."""
    ref = build(glm_config())
    ref.save_pretrained(tmp_path)
    ref.train()
    ours = _ours(tmp_path, granularity)
    ids = tokens(V, seq=S + 1, seed=3)
    x, y = ids[:, :-1], ids[:, 1:]
    maps = get_family("glm_moe_dsa").tensor_maps(ours.cfg, set(ref.state_dict()))

    calls = _recording(monkeypatch)
    out = ours(x, labels=y)
    ref_loss = ref(ids, labels=ids).loss
    assert_close(out.lm_loss, ref_loss, "LM loss")
    ref_loss.backward()
    out.lm_loss.backward()
    errors = _lm_grad_errors(ours, ref, maps)
    assert len(errors) == len([p for n, p in ours.named_parameters() if ".indexer." not in n])
    bad = {n: e for n, e in errors.items() if e[0] > e[1]}
    assert not bad, bad

    fwd = {c[0]: c for c in calls if not c[1]}
    assert fwd[0][2] is None and all(torch.equal(fwd[i][3], fwd[i][2]) for i in (1, 3))  # shared: reused
    assert torch.equal(fwd[1][3], fwd[0][3]) and torch.equal(fwd[3][3], fwd[2][3])  # ... from its full layer
    assert fwd[0][3].shape[-1] == TOPK < S and not torch.equal(fwd[0][3], fwd[2][3])
    recomputed = [c for c in calls if c[1]]
    assert [c[0] for c in recomputed] == ([3, 2, 1, 0] if granularity == "full" else [])
    for i, _, given, used in recomputed:  # a recomputation gets and uses the indices of its forward
        assert (given is None) == (fwd[i][2] is None) and (given is None or torch.equal(given, fwd[i][2])), i
        assert torch.equal(used, fwd[i][3]), i

    if granularity == "full":  # the comparison catches a recomputation that sees other indices
        ref.zero_grad()
        broken = _ours(tmp_path, granularity)
        _recording(monkeypatch, swap={1: 2})
        broken(x, labels=y).lm_loss.backward()
        ref(ids, labels=ids).loss.backward()
        errors = _lm_grad_errors(broken, ref, maps)
        assert any(e > tol for e, tol in errors.values()), "a recomputation with other indices went unnoticed"
        monkeypatch.undo()

    ref.zero_grad()
    ours.zero_grad()
    ref.eval()
    want = _hf_kl(ref, x)
    out = ours(x, labels=y)
    assert_close(out.indexer_loss, want, "indexer KL loss")
    want.backward()
    out.indexer_loss.backward()
    assert check_indexer_grads_only(ours, ref, maps) == 5 * 2  # two full layers, five tensors each


class _MtpBlock(hf_glm.GlmMoeDsaDecoderLayer):
    """transformers' GLM-5 decoder layer returning hidden states only, as transformers' MtpLayer expects."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)[0]


def test_mtp_layer_import_export(tmp_path):
    """An MTP layer (a full DSA layer with its own interleaved-RoPE indexer) as GLM stores it: its loss equals
    transformers' MtpLayer on the same tensors; every tensor is written back unchanged."""
    ref = build(glm_config())
    src = tmp_path / "hf"
    ref.save_pretrained(src)
    mtp_cfg = copy.deepcopy(ref.config)
    mtp_cfg.num_hidden_layers, mtp_cfg.first_k_dense_replace = 1, 0
    mtp_cfg.mlp_layer_types, mtp_cfg.layer_types, mtp_cfg.indexer_types = ["sparse"], ["indexed_attention"], ["full"]
    mtp_cfg._attn_implementation = "eager"
    layers = torch.nn.ModuleList([MtpLayer(mtp_cfg, _MtpBlock, hf_glm.GlmMoeDsaRMSNorm, 0)])
    randomize(layers, 4)
    set_buffers(layers, "e_score_correction_bias", 0.1, seed=8)
    write_mtp_layers(src, layers, ref.config.num_hidden_layers)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    ours = load_pretrained(src)
    assert ours.cfg.model.mtp_num_layers == 1 and ours.mtp.layers[0].block.attn.indexer.rope_interleave
    ids = tokens(V, seq=S + 1, seed=6)
    with torch.no_grad():
        out = ours(ids[:, :S], labels=ids[:, 1:])
        (want,) = reference_mtp_losses(ref, layers, ids)
    torch.testing.assert_close(out.mtp_losses[0], want, rtol=1e-5, atol=1e-5)
    exported = save_pretrained(ours, tmp_path / "export")
    before, after = load_file(src / "model.safetensors"), load_file(exported / "model.safetensors")
    assert sorted(before) == sorted(after) and all(torch.equal(after[n], t) for n, t in before.items())


# --------------------------------------------------------------------------------------------------
# config.json and refusals
# --------------------------------------------------------------------------------------------------


def test_indexer_schedule_as_transformers_derives_it():
    """indexer_types from index_topk_pattern or index_topk_freq / index_skip_topk_offset, as GlmMoeDsaConfig."""
    for extra in ({}, {"index_topk_freq": 2, "index_skip_topk_offset": 1}, {"index_topk_freq": 3},
                  {"index_topk_pattern": "FSSFFS"}):  # fmt: skip
        hf = glm_config(num_hidden_layers=6, indexer_types=None, first_k_dense_replace=1, **extra)
        want = list(hf.indexer_types)
        derived = {k: v for k, v in hf.to_dict().items() if k != "indexer_types"}  # our own derivation
        got = family.config_from_hf(derived).model.indexer_types
        assert (got or ["full"] * 6) == want and ("shared" in want) == bool(extra), extra


def test_refusals():
    base = glm_config().to_dict()
    for field, value in (
        ("indexer_types", ["shared", "full", "full", "shared"]),
        ("indexer_types", ["full", "sparse", "full", "full"]),
        ("indexer_rope_interleave", False),
        ("rope_interleave", False),
        ("q_lora_rank", None),
        ("mlp_layer_types", ["sparse", "dense", "sparse", "sparse"]),
        ("layer_types", ["full_attention"] * 4),
    ):
        with pytest.raises(ValueError, match=field):
            family.config_from_hf({**base, field: value})
    no_types = {k: v for k, v in base.items() if k != "indexer_types"}
    with pytest.raises(ValueError, match="index_topk_pattern"):
        family.config_from_hf({**no_types, "index_topk_pattern": "SFFF"})

    cfg = load_config("tiny-glm-5", ["model.vocab_size=64"])
    for override, field in (
        ("model.indexer_types=[shared,full,full,full]", "model.indexer_types"),
        ("model.indexer_types=[full,shared]", "model.indexer_types"),
        ("model.attention_type=mla", "model.indexer_types"),
    ):
        with pytest.raises(ConfigError, match=field):
            load_config("tiny-glm-5", [override]).validate()
    with pytest.raises(ValueError, match="model.indexer_rope_interleave"):
        deepseek_v32.config_to_hf(copy.deepcopy(cfg))  # DeepSeek-V3.2 cannot write GLM-5's indexer
    half_split = load_config("tiny-glm-5", ["model.vocab_size=64", "model.indexer_rope_interleave=false"])
    with pytest.raises(ValueError, match="model.indexer_rope_interleave"):
        family.config_to_hf(half_split)


# --------------------------------------------------------------------------------------------------
# Recipes
# --------------------------------------------------------------------------------------------------

# transformers' GlmMoeDsaConfig defaults (every layer its own indexer) with the one MTP layer of the checkpoints
GLM_5 = {
    **{k: v for k, v in transformers.GlmMoeDsaConfig().to_dict().items() if k != "rope_parameters"},
    "model_type": "glm_moe_dsa",
    "rope_theta": 1e6,  # zai-org/GLM-5's config.json (transformers' default is 10000; the shapes are its defaults)
    "num_nextn_predict_layers": 1,
}


def test_real_size_recipe():
    """The recipe builds the model of transformers' defaults: its parameter count plus the MTP layer."""
    check_real_size_recipe("glm-5", GLM_5)
    ours = load_config("glm-5").validate()
    ref = family.config_from_hf(GLM_5)
    for f in ("attention_type", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
              "index_n_heads", "index_head_dim", "index_topk", "indexer_rope_interleave", "indexer_types",
              "mtp_num_layers"):  # fmt: skip
        assert getattr(ours.model, f) == getattr(ref.model, f), f
    with torch.device("meta"):
        model = MoETransformer(ours)
        hf_total = sum(
            p.numel() for p in transformers.GlmMoeDsaForCausalLM(transformers.GlmMoeDsaConfig()).parameters()
        )
    assert model.num_params()[0] - sum(p.numel() for p in model.mtp.parameters()) == hf_total
    assert 743e9 < hf_total < 745e9


def test_tiny_recipe_exports_and_trains(tmp_path):
    """`moecore train tiny-glm-5` on the CPU (sequence 32 > index_topk 16, full and shared layers): the loss falls."""
    check_tiny_recipe_exports("tiny-glm-5", "glm_moe_dsa")
    tiny_recipe_trains("tiny-glm-5", tmp_path, extra=("model.mtp_num_layers=0", "model.hidden_size=64"))
