"""GLM-5 (model_type "glm_moe_dsa", GlmMoeDsaForCausalLM): GLM's MoE on DeepSeek-V3.2's sparse attention.

The maths is DeepSeek-V3.2's (deepseek_v32.py: MLA with q LoRA and interleaved RoPE, the lightning indexer and
top-`index_topk` sparse attention, moecore/models/dsa.py; the sigmoid router with the fp32 correction bias and
groups; first-k dense layers; shared experts; MTP layers) with two changes to the indexer and GLM's config fields:
- the indexer rotates its first qk_rope_head_dim channels in interleaved pairs (2j, 2j+1), as the main attention
  does, where DeepSeek-V3.2's indexer is half-split: `model.indexer_rope_interleave: true`. config.json's
  `indexer_rope_interleave` (the published checkpoints write true; transformers reads it not and always
  interleaves) must be true or absent, as must `rope_interleave`;
- `indexer_types` ("full" | "shared" per layer, our `model.indexer_types`): a shared layer has no indexer weights
  and attends to the top-k of the last full layer before it (moecore/models/dsa.py says how the indices travel).
  As transformers does, an absent `indexer_types` comes from `index_topk_pattern` ("F"/"S" per layer) or else
  from `index_topk_freq` (default 1) and `index_skip_topk_offset` (default 2): layer i is full when
  max(i - offset + 1, 0) % freq == 0, so the default is every layer full. The first layer must be full;
- which layers are dense is `mlp_layer_types` ("dense" | "sparse"), or without it `first_k_dense_replace`
  (default 3), as transformers reads them; we take a run of dense layers then MoE (`moe.first_k_dense_replace`;
  other patterns are refused) and write both fields;
- no balancing-loss fields: like families/glm4_moe_lite.py, an import takes GLM's published recipe (aux-loss-free
  bias, update rate 1e-3, plus a sequence-level balance loss of weight 1e-4).
config.json has no training-stage field: `model.dsa_stage` (dense_warmup | sparse) is ours, sparse on import.

Tensor names are DeepSeek-V3.2's (families/deepseek_v32.py), except that a shared layer has no
`self_attn.indexer.*`. MTP modules (`num_nextn_predict_layers`, decoder layers num_hidden_layers + k; transformers
skips them) are full DSA layers with their own indexer, imported and written back as DeepSeek-V3.2's.
"""

from __future__ import annotations

import copy
from collections.abc import Collection

from moecore.config import Config
from moecore.hf.families import TensorMap
from moecore.hf.families import deepseek_v32 as v32
from moecore.hf.families.common import HFFields, refuse_export_unless, validated
from moecore.hf.families.deepseek_v2 import check_deepseek_exportable, deepseek_base_config, mla_experts_to_hf
from moecore.hf.families.deepseek_v3 import shared_copies  # noqa: F401  (read by moecore.hf.pretrained)
from moecore.hf.families.glm4_moe import (
    glm_balancing,
    mtp_count,
    sigmoid_router_checks,
    sigmoid_router_from_hf,
    sigmoid_router_to_hf,
)
from moecore.hf.families.glm4_moe_lite import leading_dense_layers

MODEL_TYPE = "glm_moe_dsa"
ARCHITECTURE = "GlmMoeDsaForCausalLM"
IGNORED_HF_TENSORS = v32.IGNORED_HF_TENSORS  # rotary buffers; the MTP layers' copies of the embedding and head

# transformers' GlmMoeDsaConfig defaults, for fields a config.json leaves out (the DeepSeek-only balancing fields
# get values the shared reader accepts; GLM's recipe replaces them).
DEFAULTS = {
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "num_attention_heads": 64,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 2048,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "qk_nope_head_dim": 192,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "first_k_dense_replace": 3,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "num_nextn_predict_layers": 0,
    "aux_loss_alpha": 0.0,
    "seq_aux": True,
}


def _first_dense(f: HFFields, num_layers: int) -> int:
    """How many leading layers are dense: `mlp_layer_types` (a run of dense, then sparse), else
    `first_k_dense_replace`, which transformers reads only without `mlp_layer_types`."""
    k = f.integer("first_k_dense_replace", lo=0)
    dense = leading_dense_layers(f, num_layers)
    return min(k, num_layers) if dense is None else dense


def indexer_types_from_hf(f: HFFields, num_layers: int) -> list[str]:
    """Per layer "full" | "shared", as transformers' GlmMoeDsaConfig derives it (module docstring)."""
    types, key = f.get("indexer_types", None), "indexer_types"
    pattern = f.get("index_topk_pattern", None)
    freq, offset = f.get("index_topk_freq", 1), f.get("index_skip_topk_offset", 2)
    if types is None and pattern is not None:
        key = "index_topk_pattern"
        if isinstance(pattern, str):
            if set(pattern) - {"F", "S"}:
                f.refuse(key, pattern, "a string of F (full) and S (shared), one letter per layer")
            types = ["full" if c == "F" else "shared" for c in pattern]
        else:
            types = pattern
    if types is None:
        for name, value in (("index_topk_freq", freq), ("index_skip_topk_offset", offset)):
            if isinstance(value, bool) or not isinstance(value, int):
                f.refuse(name, value, "an integer")
        freq = max(freq, 1)
        return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or any(t not in ("full", "shared") for t in types):
        f.refuse(key, types, f"{num_layers} entries full | shared")
    if types[0] != "full":
        f.refuse(key, types, "the first layer must run its indexer (a shared layer reuses an earlier top-k)")
    return list(types)


def config_from_hf(hf: dict, available: Collection[str] | None = None) -> Config:
    """config.json -> Config; with `available` (the checkpoint's tensor names), MTP modules it lacks are dropped."""
    f = HFFields(dict(hf), MODEL_TYPE, DEFAULTS)  # a copy: the dense-layer count is written back below
    num_layers = f.integer("num_hidden_layers")
    f.hf["first_k_dense_replace"] = _first_dense(f, num_layers)  # what the DeepSeek reader takes
    cfg = deepseek_base_config(f)
    m, e = cfg.model, cfg.moe
    if m.q_lora_rank is None:
        f.refuse("q_lora_rank", None, "GLM-5's indexer reads the q latent; an integer")
    for key in ("rope_interleave", "indexer_rope_interleave"):
        if f.get(key, True) is not True:  # transformers rotates interleaved pairs whatever these say
            f.refuse(key, f.hf[key], "transformers' GlmMoeDsa rotates interleaved pairs; allowed: true")
    types = f.get("layer_types", None)
    if types is not None and list(types) != ["indexed_attention"] * num_layers:
        f.refuse("layer_types", types, "every layer is indexed_attention")
    m.attention_type, m.rope_interleave, m.indexer_rope_interleave = "dsa", True, True
    m.index_n_heads, m.index_head_dim = f.integer("index_n_heads"), f.integer("index_head_dim")
    m.index_topk = f.integer("index_topk")
    m.dsa_stage = "sparse"
    indexer_types = indexer_types_from_hf(f, num_layers)
    m.indexer_types = indexer_types if "shared" in indexer_types else None
    sigmoid_router_from_hf(f, cfg)
    glm_balancing(e)
    m.mtp_num_layers = mtp_count(f, num_layers, available, DEFAULTS["num_nextn_predict_layers"])
    f.finish()
    return validated(cfg)


def config_to_hf(cfg: Config) -> dict:
    """Our Config -> config.json, refusing options GlmMoeDsaForCausalLM cannot express."""
    m, e = cfg.model, cfg.moe
    refuse_export_unless(
        MODEL_TYPE,
        [
            ("model.attention_type", m.attention_type, m.attention_type == "dsa", "DeepSeek sparse attention (dsa)"),
            ("model.q_lora_rank", m.q_lora_rank, m.q_lora_rank is not None, "the indexer reads the q latent"),
            ("model.rope_interleave", m.rope_interleave, m.rope_interleave, "RoPE channels are stored interleaved"),
            ("model.indexer_rope_interleave", m.indexer_rope_interleave, m.indexer_rope_interleave,
             "the indexer's RoPE channels are interleaved (half-split: deepseek_v32)"),
        ],
    )  # fmt: skip
    check_deepseek_exportable(_as_mla(cfg), MODEL_TYPE)
    refuse_export_unless(MODEL_TYPE, sigmoid_router_checks(e))
    k = e.first_k_dense_replace
    return {
        **mla_experts_to_hf(cfg),
        "first_k_dense_replace": k,
        "mlp_layer_types": ["dense" if i < k else "sparse" for i in range(m.num_layers)],
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        **sigmoid_router_to_hf(e),
        "rope_interleave": True,
        "indexer_rope_interleave": True,
        "index_n_heads": m.index_n_heads,
        "index_head_dim": m.index_head_dim,
        "index_topk": m.index_topk,
        "indexer_types": list(m.indexer_types or ["full"] * m.num_layers),
        "num_nextn_predict_layers": m.mtp_num_layers,
    }


def _as_mla(cfg: Config) -> Config:
    """cfg with attention_type mla, for the DeepSeek checks of everything but the indexer."""
    out = copy.deepcopy(cfg)
    out.model.attention_type = "mla"
    return out


def tensor_maps(cfg: Config, available: Collection[str] | None) -> list[TensorMap]:
    """DeepSeek-V3.2's tensors (MTP layers included) without the indexers of the shared layers."""
    types = cfg.model.indexer_types or []
    shared = tuple(f"layers.{i}.attn.indexer." for i, t in enumerate(types) if t == "shared")
    return [mp for mp in v32.tensor_maps(cfg, available) if not (shared and mp.ours.startswith(shared))]
