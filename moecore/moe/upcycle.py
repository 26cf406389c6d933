"""Dense-to-MoE upcycling: start an MoE model's experts from a trained dense model's MLPs.

`upcycle_state_dict(dense_sd, cfg, init_sd)` maps the state dict of a dense moecore model
(`moe.num_experts=0`) onto the MoE model that `cfg` describes; `init_sd` is the freshly initialised
MoE model's state dict (router, shared experts and anything else the dense model lacks come from it,
i.e. from `train.seed`). `upcycle_from_checkpoint(model, folder, cfg)` loads a dense checkpoint
folder and does the same in place; the Trainer calls it when a run starts (never when it resumes)
with `checkpoint.upcycle_from` set.

Granularity G = F_dense / F_expert (`model.ffn_hidden_size` of the dense run / `moe.ffn_hidden_size`)
must be a whole number and divide E (`moe.num_experts`); C = E / G copies of the dense MLP:
- G = 1 (plain, "sparse upcycling", Komatsuzaki et al. 2022): every expert is a copy of the dense
  MLP. With routing weights that sum to one per token (softmax after top-k, or a renormalised
  softmax / sigmoid top-k) and no shared expert, the MoE layer's output equals the dense MLP's.
- G > 1 (granular upcycling, He et al. 2024 "Upcycling Large Language Models into Mixture of
  Experts", Megatron-Core's `moe_upcycling_granularity`): the FFN columns are cut into G slices of
  width F_expert; expert e holds slice e mod G, so experts [vG, (v+1)G) form "virtual group" v,
  which holds the whole dense MLP once. The router gets one row per
  virtual group, repeated G times ("virtual group initialisation"), so the G experts of a group tie
  and top-k picks whole groups when K is a multiple of G (required here). The sum of a group's G
  experts is the dense MLP, but each expert's weight is 1/G of its group's share when the weights
  sum to one, so the output is the dense MLP's divided by G: the down projection (`w2`) is
  multiplied by G to keep the output equal. The down projection is linear, so this is exact; Megatron
  instead spreads the factor over fc1 and fc2 (its cube root for gated units), which is exact only
  for activations homogeneous in their input.

  When the routing weights do not sum to one (`router_pre_softmax` without `norm_topk_prob`) the
  factor is Megatron's E * G / K, exact only for a uniform router (softmax weights 1/E), and
  `router_topk_scaling_factor` s is divided out (factor / s). Sigmoid without renormalisation is refused.

Dense layers of the MoE config (`first_k_dense_replace`, `layer_freq`) keep the dense weights as
they are, so their `model.ffn_hidden_size` must equal the dense run's.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from moecore.config import Config, ConfigError, config_from_dict

W13, W2 = "experts.w13", "experts.w2"


def _fail(msg: str) -> None:
    raise ConfigError(f"checkpoint.upcycle_from is invalid: {msg}")


def granularity(dense_ffn: int, expert_ffn: int, num_experts: int, topk: int) -> int:
    """G = dense FFN width / expert FFN width, checked to divide E (and K when G > 1)."""
    if dense_ffn % expert_ffn:
        _fail(f"the dense FFN width {dense_ffn} is not a multiple of moe.ffn_hidden_size={expert_ffn}")
    g = dense_ffn // expert_ffn
    if num_experts % g:
        _fail(f"moe.num_experts={num_experts} is not a multiple of the granularity {g} (= {dense_ffn}/{expert_ffn})")
    if g > 1 and topk % g:
        _fail(f"moe.router_topk={topk} is not a multiple of the granularity {g}: top-k must pick whole groups")
    return g


def output_scale(cfg: Config, g: int) -> float:
    """What the experts' down projections are multiplied by so the MoE output starts at the dense one's."""
    m = cfg.moe
    sums_to_one = (m.router_score_function == "softmax" and not m.router_pre_softmax) or m.norm_topk_prob
    if sums_to_one:
        scale = float(g)
    elif m.router_score_function == "softmax":
        scale = m.num_experts * g / m.router_topk  # Megatron-Core's factor, exact for a uniform router
    else:
        _fail("moe.router_score_function=sigmoid needs moe.norm_topk_prob=true (weights summing to one)")
    if m.router_topk_scaling_factor:
        scale /= m.router_topk_scaling_factor
    return scale


def _expert_weights(
    dense_sd: dict, prefix: str, num_experts: int, f_exp: int, scale: float, swiglu: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2F or F, H] and w2 [E, H, F] from the dense MLP at `prefix` (expert e: slice e mod G)."""
    up = dense_sd[prefix + "up_proj.weight"]
    down = dense_sd[prefix + "down_proj.weight"]
    g = up.shape[0] // f_exp
    w13, w2 = [], []
    for e in range(num_experts):
        cols = slice((e % g) * f_exp, (e % g + 1) * f_exp)
        rows = [dense_sd[prefix + "gate_proj.weight"][cols]] if swiglu else []
        w13.append(torch.cat(rows + [up[cols]], dim=0))
        w2.append(down[:, cols] * scale)
    return torch.stack(w13), torch.stack(w2)


def upcycle_state_dict(dense_sd: dict, cfg: Config, init_sd: dict, wanted: set[str] | None = None) -> dict:
    """The MoE model's state dict (keys and shapes of `init_sd`) upcycled from the dense `dense_sd`.

    `wanted`: build only these keys (a parallel rank's; default: all); the checks still see every key of `init_sd`.
    An entry of `init_sd` on the meta device gives a key's global shape only: a key that would come from its
    initialisation is then left out (the rank keeps its own seeded shard)."""
    m = cfg.moe
    swiglu = cfg.model.activation == "swiglu"
    out: dict = {}
    upcycled = set()
    moe_layers = 0
    for key, init in init_sd.items():
        if not key.endswith("mlp." + W13):
            continue
        moe_layers += 1
        prefix = key[: -len(W13)]  # "layers.{i}.mlp."
        if prefix + "up_proj.weight" not in dense_sd:
            _fail(f"the dense checkpoint has no {prefix}up_proj.weight for MoE layer {prefix[:-1]}")
        upcycled.update(prefix + n + ".weight" for n in ("gate_proj", "up_proj", "down_proj"))
        g = granularity(dense_sd[prefix + "up_proj.weight"].shape[0], m.ffn_hidden_size, m.num_experts, m.router_topk)
        if wanted is not None and not {key, prefix + W2, prefix + "router.weight"} & wanted:
            continue  # another pipeline stage's layer
        w13, w2 = _expert_weights(dense_sd, prefix, m.num_experts, m.ffn_hidden_size, output_scale(cfg, g), swiglu)
        if w13.shape != init.shape or w2.shape != init_sd[prefix + W2].shape:
            _fail(f"{prefix}experts shapes {tuple(w13.shape)} / {tuple(w2.shape)} do not fit the MoE model's")
        out[key], out[prefix + W2] = w13.to(init.dtype), w2.to(init.dtype)
        router = init_sd[prefix + "router.weight"]
        # Virtual groups: one seeded row per group of G experts, repeated G times (identical logits).
        out[prefix + "router.weight"] = router[: m.num_experts // g].repeat_interleave(g, dim=0).clone()
    if not moe_layers:
        _fail("the MoE config has no MoE layer to upcycle into")
    for key, init in init_sd.items():
        if key in out:
            continue
        if key in dense_sd:
            if dense_sd[key].shape != init.shape:
                _fail(f"{key} has shape {tuple(dense_sd[key].shape)} in the dense checkpoint, {tuple(init.shape)} here")
            if wanted is None or key in wanted:
                out[key] = dense_sd[key].to(init.dtype).clone()
        elif not init.is_meta and (wanted is None or key in wanted):
            out[key] = init.clone()  # shared experts, expert bias, ...: the seeded initialisation
    unused = sorted(k for k in dense_sd if k not in init_sd and k not in upcycled)
    if unused:
        _fail(f"the dense checkpoint holds {unused[0]} which the MoE model lacks (different architecture?)")
    return {k: v for k, v in out.items() if wanted is None or k in wanted}


def dense_config(folder: str | Path) -> Config:
    """The config of the run that wrote the dense checkpoint `folder` (its config.yaml), checked dense."""
    folder = Path(folder)
    if not (folder / ".metadata").is_file() or not (folder / "config.yaml").is_file():
        _fail(f"{str(folder)!r} is not a moecore checkpoint folder (needs .metadata and config.yaml)")
    import yaml

    dense = config_from_dict(yaml.safe_load((folder / "config.yaml").read_text()))
    if dense.moe.num_experts:
        _fail(f"{str(folder)!r} was written by an MoE run (moe.num_experts={dense.moe.num_experts}); needs 0")
    return dense


def upcycle_from_checkpoint(model: nn.Module, folder: str | Path, cfg: Config) -> None:
    """Load the dense checkpoint `folder` and upcycle it into `model` (built from `cfg`) in place."""
    from moecore.checkpoint import load_model_weights
    from moecore.models.transformer import MoETransformer
    from moecore.parallel.sharding import get_shard, load_global_state_dict

    dense_cfg = dense_config(folder)
    for name in ("hidden_size", "num_layers", "vocab_size", "activation", "attention_type", "tie_embeddings"):
        a, b = getattr(dense_cfg.model, name), getattr(cfg.model, name)
        if a != b:
            _fail(f"the dense run has model.{name}={a!r}, this run {b!r}")
    with torch.device("cpu"):
        dense = MoETransformer(dense_cfg)
    load_model_weights(Path(folder), dense, what="checkpoint.upcycle_from")
    # Every rank upcycles the tensors it holds, in their global shapes, and keeps its shard of them: the
    # one-process model on the meta device gives every key's global shape (and the checks every key); a rank's
    # unsharded tensors give their seeded values (the router's rows), its sharded ones keep their own.
    with torch.device("meta"):
        full = MoETransformer(cfg).state_dict()
    local = dict(model.named_parameters())
    local.update(model.named_buffers())
    init_sd = {
        k: local[k].detach() if k in local and not get_shard(local[k]).is_sharded else v for k, v in full.items()
    }
    new_sd = upcycle_state_dict(dense.state_dict(), cfg, init_sd, wanted=set(local))
    load_global_state_dict(model, {k: v for k, v in new_sd.items() if not v.is_meta}, strict=False)
