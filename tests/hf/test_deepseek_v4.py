"""DeepSeek-V4 (deepseek_v4) against transformers: compressed attention (sliding, heavily compressed, compressed sparse
with the lightning indexer), hyper-connections, the sqrt-softplus router with the correction bias, hash-routed first
layers, clipped SwiGLU experts and shared expert; import/export, one training step's every gradient, older config.json
spellings, refusals, the tiny recipe. Tiny random models, fp32, tolerance 1e-4 * max(1, max |reference|)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4Config"):
    pytest.skip("this transformers has no DeepSeek-V4", allow_module_level=True)
from hf_parity import assert_close, build_hf, check_tiny_recipe_exports, import_export_parity, tokens  # noqa: E402
from lm_parity import set_buffers, tiny_recipe_trains  # noqa: E402

from moecore.config import load_config  # noqa: E402
from moecore.hf import load_pretrained  # noqa: E402
from moecore.hf.families import deepseek_v4 as family  # noqa: E402
from moecore.hf.families import get_family  # noqa: E402
from moecore.models.transformer import MoETransformer  # noqa: E402
from moecore.moe.router import random_hash_table  # noqa: E402

V = 96
TYPES = ["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"]


def v4_config(**over) -> transformers.DeepseekV4Config:
    fields = dict(
        vocab_size=V, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, q_lora_rank=12, partial_rotary_factor=0.5, num_experts_per_tok=2,
        n_routed_experts=6, n_shared_experts=1, routed_scaling_factor=1.5, layer_types=TYPES,
        mlp_layer_types=["hash_moe", "moe", "moe"], compress_rates={"compressed_sparse_attention": 4,
        "heavily_compressed_attention": 8}, sliding_window=6, o_groups=2, o_lora_rank=8, index_n_heads=4,
        index_head_dim=12, index_topk=2, hc_mult=3, hc_sinkhorn_iters=2, swiglu_limit=1.5,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    )  # fmt: skip
    return transformers.DeepseekV4Config(**{**fields, **over})


def build(cfg):
    ref = build_hf(cfg)
    set_buffers(ref, "e_score_correction_bias", 0.3)
    with torch.no_grad():  # transformers starts the hash table at zero (every token to expert 0): draw one
        for name, b in ref.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(random_hash_table(b.shape[0], cfg.n_routed_experts, b.shape[1], seed=7))
    return ref


def step_parity(ours, ref, seq: int = 21) -> int:
    """LM loss and every gradient of one step; returns how many parameters have none in both (the indexers')."""
    ids = tokens(V, batch=2, seq=seq, seed=3)
    ours.train(), ref.train()
    want = ref(ids, labels=ids)
    got = ours(ids[:, :-1], labels=ids[:, 1:])
    assert_close(got.lm_loss, want.loss, "LM loss")
    want.loss.backward()
    got.lm_loss.backward()
    hf_params, ours_params = dict(ref.named_parameters()), dict(ours.named_parameters())
    no_grad = 0
    for mp in get_family("deepseek_v4").tensor_maps(ours.cfg, set(ref.state_dict())):
        if mp.ours not in ours_params:  # buffers
            continue
        (name,) = mp.hf_names()
        g, hg = ours_params[mp.ours].grad, hf_params[name].grad
        if hg is None:  # the indexer only selects (top-k): no gradient reaches it in transformers either
            assert g is None or g.abs().max() == 0, f"{mp.ours} has a gradient, {name} none"
            assert ".indexer." in mp.ours, mp.ours
            no_grad += 1
            continue
        assert g is not None, f"no gradient for {mp.ours}"
        tol = 1e-4 * max(1e-3, hg.abs().max().item())
        err = (g - hg).abs().max().item()
        assert err <= tol, f"grad of {mp.ours} vs {name}: max abs diff {err:.3g} > {tol:.3g}"
    return no_grad


def test_import_export(tmp_path):
    """One layer of each attention kind (sequence 12: windows of 4 and 8 do not divide it), 3 streams, the first
    layer hash-routed, the yarn rope of the compressed layers: logits match on import and after export."""
    ref = build(v4_config())
    ours, out = import_export_parity(ref, tmp_path)
    m, e = ours.cfg.model, ours.cfg.moe
    assert (m.attention_type, m.layer_types, m.hc_mult, m.qk_rope_head_dim) == ("compressed", TYPES, 3, 8)
    assert (m.csa_compress_rate, m.hca_compress_rate, m.activation) == (4, 8, "swiglu_clipped")
    assert m.compress_rope_scaling["type"] == "yarn" and m.compress_rope_scaling["attention_factor"] == 1.0
    assert (e.router_score_function, e.num_hash_layers, e.router_topk_scaling_factor) == ("sqrtsoftplus", 1, 1.5)
    table = ref.model.layers[0].mlp.gate.tid2eid
    assert torch.equal(ours.layers[0].mlp.router.tid2eid, table)
    written = json.loads((out / "config.json").read_text())
    assert written["mlp_layer_types"] == ["hash_moe", "moe", "moe"] and written["layer_types"] == TYPES


def test_train_step(tmp_path):
    """Sequence 20: the sparse layer's indexer picks 2 of 5 compressed entries for its late queries."""
    ref = build(v4_config())
    ref.save_pretrained(tmp_path)
    assert step_parity(load_pretrained(tmp_path), ref) == 6  # the CSA layer's indexer: 6 tensors


@pytest.mark.parametrize("mode", ["minimal", "chunked"])
def test_train_step_low_memory_experts(tmp_path, mode):
    """The clipped SwiGLU experts in moe.activation_memory=minimal / chunked (the SwiGLU kernel's clip, not
    autograd's clamps): one step's loss and every gradient against transformers."""
    ref = build(v4_config())
    ref.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    ours.cfg.moe.activation_memory, ours.cfg.moe.activation_chunk_rows = mode, 5
    ours.cfg.validate()
    assert step_parity(ours, ref) == 6
    paths = {layer.mlp.experts.last_path for layer in ours.layers}
    assert paths == {mode}, paths


def test_sigmoid_router_legacy_fields(tmp_path):
    """An older config.json (compress_ratios per layer, num_hash_layers, qk_rope_head_dim, a flat yarn rope_scaling
    for the compressed layers) and the sigmoid router, with tied embeddings and 4 layers."""
    ref = build(
        v4_config(num_hidden_layers=4, layer_types=[*TYPES, "compressed_sparse_attention"], scoring_func="sigmoid",
                  mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], tie_word_embeddings=True)
    )  # fmt: skip
    ref.save_pretrained(tmp_path / "hf")
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    legacy = {k: v for k, v in raw.items() if k not in ("layer_types", "mlp_layer_types", "partial_rotary_factor")}
    legacy.update(compress_ratios=[0, 128, 4, 4], num_hash_layers=2, qk_rope_head_dim=8)
    legacy["compress_rates"] = None
    legacy["rope_parameters"] = raw["rope_parameters"]["compress"]  # flat: the compressed layers' yarn
    cfg = family.config_from_hf(legacy)
    assert cfg.model.layer_types[1] == "heavily_compressed_attention" and cfg.moe.num_hash_layers == 2
    assert cfg.model.hca_compress_rate == 128  # from the ratios' kinds: transformers' default rate
    ours, _ = import_export_parity(ref, tmp_path / "roundtrip")
    assert ours.cfg.moe.router_score_function == "sigmoid" and ours.cfg.model.tie_embeddings


def test_refusals():
    base = v4_config().to_dict()
    for field, value in [
        ("num_key_value_heads", 2), ("n_shared_experts", 2), ("norm_topk_prob", False), ("scoring_func", "tanh"),
        ("mlp_layer_types", ["moe", "hash_moe", "moe"]), ("attention_bias", True), ("some_new_field", 1),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            family.config_from_hf({**base, field: value})
    for field, value in [
        ("model.hc_mult", "1"), ("model.activation", "swiglu"), ("moe.shared_expert_gate", "true"),
        ("moe.router_num_groups", "2"),
    ]:  # fmt: skip
        extra = ["moe.router_group_topk=1"] if field == "moe.router_num_groups" else []
        bad = load_config("tiny-deepseek-v4", [f"{field}={value}", *extra])
        with pytest.raises(ValueError, match=field):
            family.config_to_hf(bad)


def test_layout_refusals():
    for over, match in [
        ("model.mtp_num_layers=1", "mtp"), ("train.cuda_graphs=attention", "cuda_graphs"),
        ("moe.num_hash_layers=5", "moe.num_hash_layers"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            load_config("tiny-deepseek-v4", [over]).validate()


def test_tiny_recipe(tmp_path):
    """The tiny recipe exports as deepseek_v4 and trains on a CPU (no real-size recipe: import the checkpoint's
    config.json with `moecore convert --from-hf`)."""
    check_tiny_recipe_exports("tiny-deepseek-v4", "deepseek_v4")
    tiny_recipe_trains("tiny-deepseek-v4", tmp_path)


def test_flash_recipe_is_transformers_default_config():
    """`deepseek-v4-flash` is what importing transformers' default DeepseekV4Config (DeepSeek-V4-Flash-Base's) gives,
    but for the training choices a config.json does not carry; 284B parameters, 13.8B active."""
    import dataclasses

    from moecore.plan.params import total_params

    ours, imported = load_config("deepseek-v4-flash"), family.config_from_hf(transformers.DeepseekV4Config().to_dict())
    training_choices = {"recompute_granularity", "recompute_modules", "router_load_balancing_type"}
    for section in ("model", "moe"):
        a, b = getattr(ours, section), getattr(imported, section)
        differ = {f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)}
        assert differ <= training_choices, (section, differ)
    total, active = total_params(ours)
    assert round(total / 1e9) == 284 and round(active / 1e8) == 138


def test_exit_and_resume_is_bit_exact(tmp_path):
    """A tiny-deepseek-v4 run stopped at step 3 and resumed continues as the uninterrupted run: the hash table, the
    correction biases (updated every step) and the frozen indexers travel through the checkpoint with the weights
    (the indexers have no optimizer state)."""
    from moecore.train.loop import train

    args = ["train.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_interval=0",
            "train.steps=6", "train.device=cpu", "optim.warmup_steps=1", "log.progress=false",
            "log.tensorboard=false", "log.interval=1", "moe.router_bias_update_rate=0.05"]  # fmt: skip
    full = train(load_config("tiny-deepseek-v4", [*args, f"train.run_dir={tmp_path / 'full'}"]))
    part = tmp_path / "part"
    train(load_config("tiny-deepseek-v4", [*args, "train.exit_interval=3", f"train.run_dir={part}"]))
    second = train(load_config("tiny-deepseek-v4", [*args, "checkpoint.resume=true", f"train.run_dir={part}"]))
    want, got = dict(full.losses), dict(second.losses)
    assert sorted(got) == [4, 5, 6] and all(got[s] == want[s] for s in got), (got, want)
    assert want[6] != want[3]


def test_full_recomputation_equals_none():
    """model.recompute_granularity=full on hyper-connected layers (recomputed whole, without torch's early stop):
    the same loss and gradients as keeping every activation."""
    torch.manual_seed(0)
    grads = []
    for gran in ("none", "full"):
        cfg = load_config("tiny-deepseek-v4", [f"model.recompute_granularity={gran}", "model.vocab_size=96"])
        torch.manual_seed(0)
        model = MoETransformer(cfg).train()
        ids = tokens(V, batch=2, seq=33, seed=3)
        out = model(ids[:, :-1], labels=ids[:, 1:])
        out.lm_loss_sum.backward()
        grads.append((out.lm_loss_sum.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = grads
    assert torch.equal(l0, l1) and g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-6, atol=1e-7, msg=n)
