"""Shared checks for the Hugging Face family tests: tiny random transformers models against ours.

Every check compares with transformers (installed from PyPI; nothing is downloaded):
- `import_export_parity`: save a transformers model, `load_pretrained` it, compare fp32 logits;
  `save_pretrained` it back, load that with `AutoModelForCausalLM`, compare again;
- `check_projection_norm_is_needed`: q/k norms over the whole projection (MiniMax-M2, OLMoE) fail the logits
  comparison when applied per head;
- `train_step_parity`: the LM loss and every parameter's gradient of one training step, then the
  per-layer aux loss against transformers' `load_balancing_loss_func` and the gradient of the full
  objective (LM + aux) against the same objective built from transformers' router logits.
Tolerance for logits: max abs diff <= 1e-4 * max(1, max |reference|).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moecore.config import load_config
from moecore.hf import load_pretrained, save_pretrained
from moecore.hf.families import get_family

transformers = __import__("transformers")


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights that make every tensor matter: matrices N(0, 1/sqrt(fan_in)), norms 1 + N(0, 0.3), biases N(0, 0.2).

    transformers initialises norms to one and weights with std 0.02, under which swapped norms or a
    near-uniform router would go unnoticed.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


# The tiny grouped-query decoder of the Mixtral and Qwen-MoE tests; each family adds its own fields.
TINY_GQA = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2
)


def tiny_config(config_class, fields: dict, over: dict | None = None):
    """A transformers config: TINY_GQA, then the family's `fields`, then a test's `over` (later ones win)."""
    return config_class(**{**TINY_GQA, **fields, **(over or {})})


def build_hf(config, seed: int = 0) -> torch.nn.Module:
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomize(transformers.AutoModelForCausalLM.from_config(config), seed).eval()


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str = "logits") -> float:
    tol = 1e-4 * max(1.0, ref.abs().max().item())
    err = (ours - ref).abs().max().item()
    assert err <= tol, f"{what}: max abs diff {err:.3g} > {tol:.3g}"
    return err


def tokens(vocab: int, batch: int = 2, seq: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def import_export_parity(hf_model, tmp_path: Path, hf_save_kwargs: dict | None = None):
    """Import, compare, export, reload with transformers, compare. Returns (our model, exported folder)."""
    src, out = tmp_path / "hf", tmp_path / "exported"
    hf_model.save_pretrained(src, **(hf_save_kwargs or {}))
    ours = load_pretrained(src)
    ids = tokens(hf_model.config.vocab_size)
    with torch.no_grad():
        ref = hf_model(ids).logits
        assert_close(ours(ids).logits, ref, "imported logits")
    save_pretrained(ours, out)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(back) is type(hf_model)
    with torch.no_grad():
        assert_close(back(ids).logits, ref, "exported logits")
    return ours, out


def _grad_pairs(ours, hf_model):
    """(our name, our grad, HF name, HF grad) for every parameter, through the family's in-memory name map."""
    family = get_family(hf_model.config.model_type)
    hf_params = dict(hf_model.named_parameters())
    maps = family.tensor_maps(ours.cfg, set(hf_params))  # transformers' in-memory layout (fused experts)
    ours_params = dict(ours.named_parameters())
    for mp in maps:
        names = mp.hf_names()
        if mp.combine is not None:  # ours is made of several tensors (a re-layout): their gradients, combined alike
            grads = [hf_params[n].grad for n in names]
            hg = None if any(g is None for g in grads) else mp.combine(grads)
            yield mp.ours, ours_params[mp.ours].grad, " + ".join(names), hg
            continue
        assert len(names) == 1, f"in-memory layout of {mp.ours} should be one tensor, got {names}"
        if mp.ours == "lm_head.weight" and names[0] not in hf_params:
            continue
        yield mp.ours, ours_params[mp.ours].grad, names[0], hf_params[names[0]].grad


def train_step_parity(ours, hf_model) -> None:
    """Loss and gradients of one training step against transformers (LM loss, then LM + aux loss)."""
    cfg = hf_model.config
    ids = tokens(cfg.vocab_size, batch=2, seq=16, seed=3)
    ours.train()
    hf_model.train()

    # 1. LM loss alone: transformers shifts labels itself; ours takes labels already shifted.
    ours.zero_grad()
    hf_model.zero_grad()
    ref = hf_model(ids, labels=ids, output_router_logits=False)
    out = ours(ids[:, :-1], labels=ids[:, 1:])
    assert_close(out.lm_loss, ref.loss, "LM loss")
    ref.loss.backward()
    out.lm_loss.backward()
    for name, g, hf_name, hg in _grad_pairs(ours, hf_model):
        assert g is not None and hg is not None, f"no gradient for {name} / {hf_name}"
        tol = 1e-4 * hg.abs().max().item() + 1e-9
        err = (g - hg).abs().max().item()
        assert err <= tol, f"grad of {name} vs {hf_name}: max abs diff {err:.3g} > {tol:.3g}"

    # 2. Aux loss per MoE layer. transformers' load_balancing_loss_func on one layer's router logits is
    #    E * sum_i f_i P_i with f summing to top-k; ours (Megatron-Core's) divides by top-k.
    k = cfg.num_experts_per_tok
    coef = ours.cfg.moe.aux_loss_coeff
    lbl = __import__(type(hf_model).__module__, fromlist=["load_balancing_loss_func"]).load_balancing_loss_func
    ours.zero_grad()
    hf_model.zero_grad()
    ref = hf_model(ids[:, :-1], output_router_logits=True)
    out = ours(ids[:, :-1], labels=ids[:, 1:])
    per_layer = [lbl((g,), g.shape[-1], k) / k for g in ref.router_logits]
    assert len(per_layer) == len(out.moe_stats) > 0
    for ref_aux, stats in zip(per_layer, out.moe_stats):
        assert_close(stats["aux_loss"], ref_aux, f"aux loss of layer {stats['layer']}")
    ce = torch.nn.functional.cross_entropy(ref.logits.flatten(0, 1), ids[:, 1:].flatten())
    ref_total = ce + coef * sum(per_layer)
    assert_close(out.loss, ref_total, "LM + aux loss")
    ref_total.backward()
    out.loss.backward()
    for name, g, hf_name, hg in _grad_pairs(ours, hf_model):
        tol = 1e-4 * hg.abs().max().item() + 1e-9
        err = (g - hg).abs().max().item()
        assert err <= tol, f"grad (LM + aux) of {name} vs {hf_name}: max abs diff {err:.3g} > {tol:.3g}"


# The fields a Hugging Face config.json decides (the rest of a recipe is training choices).
MODEL_FIELDS = (
    "family vocab_size hidden_size num_layers num_attention_heads num_kv_heads resolved_head_dim ffn_hidden_size "
    "activation max_position_embeddings rope_theta rope_scaling norm_eps qkv_bias attn_out_bias qk_norm "
    "qk_norm_scope sliding_window tie_embeddings"
).split()
MOE_FIELDS = (
    "num_experts router_topk router_score_function router_pre_softmax norm_topk_prob ffn_hidden_size "
    "shared_expert_intermediate_size shared_expert_gate router_topk_scaling_factor router_num_groups "
    "router_enable_expert_bias expert_capacity_factor"
).split()


def check_real_size_recipe(recipe: str, hf_config: dict) -> None:
    """The shipped recipe builds exactly the model a real checkpoint's config.json describes, so
    `moecore train <recipe> checkpoint.load=<converted checkpoint>` loads it."""
    ours = load_config(recipe).validate()
    ref = get_family(hf_config["model_type"]).config_from_hf(hf_config)
    for f in MODEL_FIELDS:
        assert getattr(ours.model, f) == getattr(ref.model, f), f"{recipe}: model.{f}"
    for f in MOE_FIELDS:
        assert getattr(ours.moe, f) == getattr(ref.moe, f), f"{recipe}: moe.{f}"
    n = ref.model.num_layers
    assert [ours.moe.is_moe_layer(i, n) for i in range(n)] == [ref.moe.is_moe_layer(i, n) for i in range(n)]
    assert ours.moe.aux_loss_coeffs == ref.moe.aux_loss_coeffs, f"{recipe}: moe.aux_loss_coeff"


def check_tiny_recipe_exports(recipe: str, model_type: str) -> None:
    """A tiny recipe is a model the family can express (its export config is accepted by transformers)."""
    cfg = load_config(recipe).validate()
    cfg.model.vocab_size = 64
    hf_config = get_family(model_type).config_to_hf(cfg)
    transformers.AutoConfig.for_model(model_type, **hf_config)


def check_indexer_grads_only(ours, hf_model, maps) -> int:
    """After the DSA indexers' KL loss alone was backpropagated through both models: every indexer tensor's gradient
    equals transformers' (1e-4 of its largest entry), and no other parameter got one. Returns how many were checked."""
    params, hf_params = dict(ours.named_parameters()), dict(hf_model.named_parameters())
    checked = 0
    for mp in maps:
        if ".indexer." in mp.ours:
            g, want = params[mp.ours].grad, hf_params[mp.hf_names()[0]].grad
            assert (g - want).abs().max() <= 1e-4 * max(1e-3, want.abs().max().item()), mp.ours
            checked += 1
        elif mp.ours in params:
            assert params[mp.ours].grad is None, f"the indexer loss reached {mp.ours}"
    return checked


def _norm_per_head(self, x: torch.Tensor, norm) -> torch.Tensor:
    """A mutation of `Attention._qk_norm`: the same weights, but each head normalised by its own mean of squares."""
    from moecore.models.norms import rms_norm

    return rms_norm(x, norm.weight.view(x.shape[-2], x.shape[-1]), norm.eps)


def check_projection_norm_is_needed(hf_model, folder: Path, monkeypatch) -> None:
    """For a family whose q/k norm covers the whole projection: the imported model's logits match, and they stop
    matching when the same weights normalise each head on its own (the comparison sees the norm's scope)."""
    from moecore.models.attention import Attention

    hf_model.save_pretrained(folder)
    ours = load_pretrained(folder)
    ids = tokens(hf_model.config.vocab_size)
    with torch.no_grad():
        want = hf_model(ids).logits
        assert_close(ours(ids).logits, want)
        monkeypatch.setattr(Attention, "_qk_norm", _norm_per_head)
        with pytest.raises(AssertionError, match="max abs diff"):
            assert_close(ours(ids).logits, want)
