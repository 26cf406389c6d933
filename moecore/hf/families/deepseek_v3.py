"""DeepSeek-V3 (model_type "deepseek_v3"): DeepSeek-V3, DeepSeek-R1, and their relatives that share the layout.

On top of DeepSeek-V2's decoder (deepseek_v2.py: MLA, first-k dense layers, shared experts), as
transformers' DeepseekV3 implements it:
- the router scores experts with a sigmoid; selection adds the fp32 `e_score_correction_bias` (our
  `router.expert_bias`, aux-loss-free balancing) and keeps the best `topk_group` of `n_group` groups,
  a group scored by the sum of its two best biased scores; the weights are the unbiased sigmoid scores
  of the chosen experts, divided by their sum (+1e-20) when `norm_topk_prob`, times `routed_scaling_factor`;
- `rope_interleave` says whether the checkpoint stores the RoPE channels interleaved (DeepSeek's own
  checkpoints do) or half-split;
- multi-token prediction: `num_nextn_predict_layers` (transformers: `num_mtp_layers`) extra modules
  stored as decoder layers num_hidden_layers, num_hidden_layers + 1, ... with, besides a decoder
  layer's own tensors, `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and copies of the shared
  embedding (`embed_tokens`) and output head (`shared_head.head`). transformers' DeepseekV3ForCausalLM
  skips them; we import them into `mtp.layers.k` (moecore/models/mtp.py) and write them back, copies
  included, so that inference engines that read the MTP layer find every tensor they expect. A
  checkpoint whose config.json announces MTP layers that its weights lack (what transformers' own
  save_pretrained writes) imports without MTP.
"""

from __future__ import annotations

from collections.abc import Collection

from moecore.config import Config
from moecore.hf.families import TensorMap
from moecore.hf.families.common import HFFields, refuse_export_unless, validated
from moecore.hf.families.deepseek_v2 import (
    check_deepseek_exportable,
    decoder_layer_maps,
    deepseek_base_config,
    deepseek_base_to_hf,
    main_model_maps,
)

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
# The MTP layers' copies of the shared embedding and head: the main model's tensors on import.
IGNORED_HF_TENSORS = (r"\.rotary_emb\.inv_freq$", r"^model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$")

# transformers' DeepseekV3Config defaults, used for fields a config.json leaves out.
DEFAULTS = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_interleave": True,
    "num_nextn_predict_layers": 1,
    "aux_loss_alpha": 0.001,
    "seq_aux": True,
}


def mtp_layers_in_checkpoint(num_layers: int, announced: int, available: Collection[str]) -> int:
    """How many of the announced MTP modules the checkpoint holds (they must be the first ones)."""
    held = [f"model.layers.{num_layers + k}.eh_proj.weight" in available for k in range(announced)]
    count = sum(held)
    if held[:count] != [True] * count:
        raise ValueError(
            f"the checkpoint holds MTP layers {held} of the {announced} config.json announces; expected a prefix"
        )
    return count


def config_from_hf(hf: dict, available: Collection[str] | None = None) -> Config:
    """config.json -> Config; with `available` (the checkpoint's tensor names), MTP modules it lacks are dropped."""
    f = HFFields(hf, MODEL_TYPE, DEFAULTS)
    cfg = deepseek_base_config(f)
    m, e = cfg.model, cfg.moe
    m.rope_interleave = bool(f.get("rope_interleave"))
    f.expect("scoring_func", ("sigmoid", None))
    f.expect("topk_method", ("noaux_tc", None))  # transformers always routes this way
    e.router_score_function, e.router_pre_softmax = "sigmoid", False
    e.router_enable_expert_bias = True
    e.norm_topk_prob = bool(f.get("norm_topk_prob"))
    n_group, topk_group = f.integer("n_group"), f.integer("topk_group")
    if e.num_experts % n_group:
        f.refuse("n_group", n_group, f"must divide n_routed_experts={e.num_experts}")
    if topk_group > n_group:
        f.refuse("topk_group", topk_group, f"an integer in [1, n_group={n_group}]")
    if n_group > 1:
        e.router_num_groups, e.router_group_topk, e.router_group_score = n_group, topk_group, "top2_sum"
    a, b = f.get("num_nextn_predict_layers", None), f.get("num_mtp_layers", None)
    if a is not None and b is not None and a != b:
        f.refuse("num_mtp_layers", b, f"disagrees with num_nextn_predict_layers={a}")
    announced = int(a if a is not None else b if b is not None else DEFAULTS["num_nextn_predict_layers"])
    m.mtp_num_layers = announced if available is None else mtp_layers_in_checkpoint(m.num_layers, announced, available)
    f.finish()
    return validated(cfg)


def config_to_hf(cfg: Config) -> dict:
    m, e = cfg.model, cfg.moe
    check_deepseek_exportable(cfg, MODEL_TYPE)
    bias = e.router_enable_expert_bias
    grouped, score = e.router_num_groups is not None and e.router_num_groups > 1, e.router_group_score
    refuse_export_unless(
        MODEL_TYPE,
        [
            ("moe.router_score_function", e.router_score_function, e.router_score_function == "sigmoid", "sigmoid"),
            ("moe.router_enable_expert_bias", bias, bias, "needs the expert bias"),
            (
                "moe.router_group_score",
                score,
                not grouped or score == "top2_sum",
                "DeepSeek-V3 scores a group by its top-2 sum",
            ),
        ],
    )
    return {
        **deepseek_base_to_hf(cfg, MODEL_TYPE),
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "norm_topk_prob": e.norm_topk_prob,
        "n_group": e.router_num_groups if grouped else 1,
        "topk_group": e.router_group_topk if grouped else 1,
        "rope_interleave": m.rope_interleave,
        "num_nextn_predict_layers": m.mtp_num_layers,
    }


def mtp_maps(cfg: Config, available: Collection[str] | None) -> list[TensorMap]:
    """MTP module k <-> checkpoint layer num_hidden_layers + k (its block is MoE whenever there are experts)."""
    maps = []
    for k in range(cfg.model.mtp_num_layers):
        ours, hf = f"mtp.layers.{k}", f"model.layers.{cfg.model.num_layers + k}"
        maps += [TensorMap.copy(f"{ours}.{n}.weight", f"{hf}.{n}.weight") for n in ("enorm", "hnorm", "eh_proj")]
        maps.append(TensorMap.copy(f"{ours}.head_norm.weight", f"{hf}.shared_head.norm.weight"))
        maps += decoder_layer_maps(f"{ours}.block", hf, cfg.moe.num_experts > 0, cfg, available)
    return maps


def shared_copies(cfg: Config) -> list[tuple[str, str]]:
    """(checkpoint name, our tensor) for the MTP layers' copies of the shared embedding and output head."""
    out = []
    head = "embed.weight" if cfg.model.tie_embeddings else "lm_head.weight"
    for k in range(cfg.model.mtp_num_layers):
        hf = f"model.layers.{cfg.model.num_layers + k}"
        out += [(f"{hf}.embed_tokens.weight", "embed.weight"), (f"{hf}.shared_head.head.weight", head)]
    return out


def tensor_maps(cfg: Config, available: Collection[str] | None) -> list[TensorMap]:
    return main_model_maps(cfg, available) + mtp_maps(cfg, available)
