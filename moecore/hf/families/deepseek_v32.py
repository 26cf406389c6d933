"""DeepSeek-V3.2 (model_type "deepseek_v32", DeepseekV32ForCausalLM): DeepSeek-V3.2-Exp and DeepSeek-V3.2.

DeepSeek-V3's model (deepseek_v3.py: MLA with q LoRA, sigmoid router with correction bias and groups, first-k
dense layers, shared expert, MTP layers) plus DeepSeek Sparse Attention in every layer
(moecore/models/dsa.py, `model.attention_type: dsa`): a lightning indexer with `index_n_heads` heads of
`index_head_dim` channels selects the `index_topk` tokens each query attends to. The RoPE channels of the
main attention are always stored interleaved (transformers has no `rope_interleave` field for V3.2); the
indexer's are half-split.

Tensors, on top of DeepSeek-V3's (layer i, and the MTP layers num_hidden_layers + k):
    layers.i.attn.indexer.{wq_b,wk,weights_proj}.weight   model.layers.i.self_attn.indexer.<same>
    layers.i.attn.indexer.k_norm.{weight,bias}            model.layers.i.self_attn.indexer.k_norm.<same> (LayerNorm)
config.json has no training-stage field: `model.dsa_stage` (dense_warmup | sparse) is ours, sparse on import.
"""

from __future__ import annotations

import copy
from collections.abc import Collection

from moecore.config import Config
from moecore.hf.families import TensorMap
from moecore.hf.families import deepseek_v3 as v3
from moecore.hf.families.common import HFFields, dense_mlp_maps, embed_maps, refuse_export_unless, validated
from moecore.hf.families.deepseek_v2 import deepseek_base_config, mla_maps, moe_maps
from moecore.hf.families.glm4_moe import mtp_count, sigmoid_router_from_hf

MODEL_TYPE = "deepseek_v32"
ARCHITECTURE = "DeepseekV32ForCausalLM"
IGNORED_HF_TENSORS = v3.IGNORED_HF_TENSORS

# transformers' DeepseekV32Config defaults, used for fields a config.json leaves out.
DEFAULTS = {
    **v3.DEFAULTS,
    "max_position_embeddings": 163840,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 64,
}


def _dense_pattern_fields(f: HFFields, num_layers: int, first_k: int) -> None:
    """`mlp_layer_types` and `layer_types`, which transformers derives; they must say what we build."""
    mlp = f.get("mlp_layer_types", None)
    want = ["dense"] * min(first_k, num_layers) + ["sparse"] * max(0, num_layers - first_k)
    if mlp is not None and list(mlp) != want:
        f.refuse("mlp_layer_types", mlp, f"must be {first_k} dense layers then sparse (first_k_dense_replace)")
    types = f.get("layer_types", None)
    if types is not None and list(types) != ["indexed_attention"] * num_layers:
        f.refuse("layer_types", types, "every layer is indexed_attention")


def config_from_hf(hf: dict, available: Collection[str] | None = None) -> Config:
    """config.json -> Config; with `available` (the checkpoint's tensor names), MTP modules it lacks are dropped."""
    f = HFFields(hf, MODEL_TYPE, DEFAULTS)
    cfg = deepseek_base_config(f)
    m = cfg.model
    if m.q_lora_rank is None:
        f.refuse("q_lora_rank", None, "DeepSeek-V3.2's indexer reads the q latent; an integer")
    if f.get("rope_interleave", True) is not True:
        f.refuse("rope_interleave", f.hf.get("rope_interleave"), "DeepSeek-V3.2 stores RoPE channels interleaved")
    m.rope_interleave = True
    m.attention_type = "dsa"
    m.index_n_heads, m.index_head_dim = f.integer("index_n_heads"), f.integer("index_head_dim")
    m.index_topk = f.integer("index_topk")
    m.dsa_stage = "sparse"
    sigmoid_router_from_hf(f, cfg)
    _dense_pattern_fields(f, m.num_layers, cfg.moe.first_k_dense_replace)
    m.mtp_num_layers = mtp_count(f, m.num_layers, available, DEFAULTS["num_nextn_predict_layers"])
    f.finish()
    return validated(cfg)


def config_to_hf(cfg: Config) -> dict:
    """DeepSeek-V3's config.json (same checks) with the indexer's fields; refuses what V3.2 cannot express."""
    m = cfg.model
    refuse_export_unless(
        MODEL_TYPE,
        [
            ("model.attention_type", m.attention_type, m.attention_type == "dsa", "DeepSeek sparse attention (dsa)"),
            ("model.q_lora_rank", m.q_lora_rank, m.q_lora_rank is not None, "the indexer reads the q latent"),
            ("model.rope_interleave", m.rope_interleave, m.rope_interleave, "RoPE channels are stored interleaved"),
            (
                "model.indexer_rope_interleave",
                True,
                not m.indexer_rope_interleave,
                "half-split indexer RoPE (GLM-5's interleaved one: glm_moe_dsa)",
            ),
            (
                "model.indexer_types",
                m.indexer_types,
                m.indexer_types is None or "shared" not in m.indexer_types,
                "every layer runs its indexer (shared layers: glm_moe_dsa)",
            ),
        ],
    )
    as_v3 = copy.deepcopy(cfg)
    as_v3.model.attention_type = "mla"
    out = v3.config_to_hf(as_v3)
    del out["rope_interleave"]
    out.update(index_n_heads=m.index_n_heads, index_head_dim=m.index_head_dim, index_topk=m.index_topk)
    return out


def indexer_maps(ours: str, hf: str) -> list[TensorMap]:
    """The lightning indexer of one layer (`ours` / `hf`: the layer prefixes)."""
    names = ["wq_b.weight", "wk.weight", "weights_proj.weight", "k_norm.weight", "k_norm.bias"]
    return [TensorMap.copy(f"{ours}.attn.indexer.{n}", f"{hf}.self_attn.indexer.{n}") for n in names]


def layer_maps(ours: str, hf: str, is_moe: bool, cfg: Config, available: Collection[str] | None) -> list[TensorMap]:
    maps = mla_maps(ours, hf, cfg.model) + indexer_maps(ours, hf)
    if is_moe:
        return maps + moe_maps(f"{ours}.mlp", f"{hf}.mlp", cfg, available)
    return maps + dense_mlp_maps(f"{ours}.mlp", f"{hf}.mlp")


def tensor_maps(cfg: Config, available: Collection[str] | None) -> list[TensorMap]:
    m = cfg.model
    maps = embed_maps(m)
    for i in range(m.num_layers):
        maps += layer_maps(f"layers.{i}", f"model.layers.{i}", cfg.moe.is_moe_layer(i, m.num_layers), cfg, available)
    for k in range(m.mtp_num_layers):
        ours, hf = f"mtp.layers.{k}", f"model.layers.{m.num_layers + k}"
        maps += [TensorMap.copy(f"{ours}.{n}.weight", f"{hf}.{n}.weight") for n in ("enorm", "hnorm", "eh_proj")]
        maps.append(TensorMap.copy(f"{ours}.head_norm.weight", f"{hf}.shared_head.norm.weight"))
        maps += layer_maps(f"{ours}.block", hf, True, cfg, available)
    return maps


shared_copies = v3.shared_copies
