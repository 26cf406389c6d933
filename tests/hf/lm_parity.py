"""Parity helpers for families whose transformers model has no balancing loss to compare (GLM-4.5, gpt-oss):
one training step's LM loss and every gradient, the MTP layers of DeepSeek-style checkpoints, and a
short CPU training run of a tiny recipe.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hf_parity import assert_close, tokens
from safetensors.torch import load_file, save_file

from moecore.config import load_config
from moecore.hf.families import get_family


def set_buffers(model: torch.nn.Module, suffix: str, scale: float, seed: int = 5) -> None:
    """Random values in every buffer whose name ends with `suffix` (e.g. the router correction bias)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith(suffix):
                b.copy_(torch.randn(b.shape, generator=g) * scale)


def lm_train_step_parity(ours, hf_model, seq: int = 16) -> None:
    """LM loss of one training step and the gradient of every parameter of ours against transformers."""
    ids = tokens(hf_model.config.vocab_size, batch=2, seq=seq, seed=3)
    ours.train()
    hf_model.train()
    ours.zero_grad()
    hf_model.zero_grad()
    ref = hf_model(ids, labels=ids)  # transformers shifts the labels itself
    out = ours(ids[:, :-1], labels=ids[:, 1:])
    assert_close(out.lm_loss, ref.loss, "LM loss")
    ref.loss.backward()
    out.lm_loss.backward()
    hf_params = dict(hf_model.named_parameters())
    ours_params = dict(ours.named_parameters())
    checked = 0
    for mp in get_family(hf_model.config.model_type).tensor_maps(ours.cfg, set(hf_model.state_dict())):
        if mp.ours not in ours_params:  # buffers (router correction bias)
            continue
        (name,) = mp.hf_names()
        g, want = ours_params[mp.ours].grad, hf_params[name].grad
        assert g is not None and want is not None, f"no gradient for {mp.ours} / {name}"
        ours_g = g if mp.to_hf is None else mp.to_hf(g)
        tol = 1e-4 * max(1e-3, want.abs().max().item())
        err = (ours_g - want).abs().max().item()
        assert err <= tol, f"grad of {mp.ours} vs {name}: max abs diff {err:.3g} > {tol:.3g}"
        checked += 1
    assert checked == len(ours_params)


def write_mtp_layers(folder: Path, layers: torch.nn.ModuleList, first: int, per_expert: bool = True) -> None:
    """Write transformers MtpLayers into a saved checkpoint as DeepSeek / GLM store them: decoder layer
    `first + k` with enorm, hnorm, eh_proj, shared_head.norm, the block's tensors and copies of the shared
    embedding and head; fused 3-D experts are split into per-expert tensors (as checkpoints hold them)."""
    tensors = load_file(folder / "model.safetensors")
    for k, layer in enumerate(layers):
        prefix = f"model.layers.{first + k}"
        for name, t in layer.state_dict().items():
            name = name.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
            if per_expert and name.endswith("experts.gate_up_proj"):
                f = t.shape[1] // 2
                for j in range(t.shape[0]):
                    tensors[f"{prefix}.{name[: -len('gate_up_proj')]}{j}.gate_proj.weight"] = t[j, :f].clone()
                    tensors[f"{prefix}.{name[: -len('gate_up_proj')]}{j}.up_proj.weight"] = t[j, f:].clone()
            elif per_expert and name.endswith("experts.down_proj"):
                for j in range(t.shape[0]):
                    tensors[f"{prefix}.{name[: -len('down_proj')]}{j}.down_proj.weight"] = t[j].clone()
            else:
                tensors[f"{prefix}.{name}"] = t.clone()
        tensors[f"{prefix}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[f"{prefix}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def reference_mtp_losses(ref, layers, ids: torch.Tensor) -> list[torch.Tensor]:
    """transformers' MtpLayers chained on the main model's final-normed states: depth k on the first S-k
    positions, embeddings of tokens k.., targets tokens k+1.. (ids has S+1 columns)."""
    s = ids.shape[1] - 1
    h = ref.model(ids[:, :s]).last_hidden_state
    losses = []
    for k, layer in enumerate(layers, start=1):
        n = s - k
        emb = ref.model.embed_tokens(ids[:, k : k + n])
        pos = torch.arange(n)[None]
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        pe = ref.model.rotary_emb(emb, pos)
        h = layer(emb, h[:, :n], pe, attention_mask=causal, position_ids=pos, cache=None)
        logits = ref.lm_head(h)
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, k + 1 : k + 1 + n].flatten()))
    return losses


def tiny_recipe_trains(recipe: str, tmp_path: Path, steps: int = 12, extra: tuple[str, ...] = ()) -> list[float]:
    """`moecore train <recipe>` shrunk to a few CPU steps on the embedded corpus; returns the losses."""
    from moecore.train.loop import train

    args = [
        "train.seq_length=32",
        "train.global_batch_size=4",
        "train.micro_batch_size=4",
        "train.eval_interval=0",
        f"train.steps={steps}",
        "train.device=cpu",
        "optim.warmup_steps=2",
        "optim.lr=0.01",
        "log.progress=false",
        "log.tensorboard=false",
        "log.interval=1",
        f"train.run_dir={tmp_path / 'run'}",
        *extra,
    ]
    result = train(load_config(recipe, args))
    losses = [loss for _, loss in result.losses]
    assert len(losses) == steps
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.3, losses
    return losses


def aux_loss_parity(ours, hf_model) -> None:
    """Each MoE layer's aux loss against transformers' load_balancing_loss_func on that layer's router logits
    (divided by k: Megatron-Core's normalisation, see hf_parity.train_step_parity)."""
    k = hf_model.config.num_experts_per_tok
    lbl = __import__(type(hf_model).__module__, fromlist=["load_balancing_loss_func"]).load_balancing_loss_func
    ids = tokens(hf_model.config.vocab_size, batch=2, seq=16, seed=3)
    with torch.no_grad():
        ref = hf_model(ids, output_router_logits=True)
        out = ours(ids, labels=ids)
    per_layer = [lbl((g,), g.shape[-1], k) / k for g in ref.router_logits]
    assert len(per_layer) == len(out.moe_stats) > 0
    for want, stats in zip(per_layer, out.moe_stats):
        assert_close(stats["aux_loss"], want, f"aux loss of layer {stats['layer']}")
