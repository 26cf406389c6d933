"""DeepSeek-V4 (model_type "deepseek_v4"), as transformers' DeepseekV4 implements it.

What differs from DeepSeek-V3 and where it lives in moecore:
- attention (moecore/models/compressed_attention.py): a q LoRA, one key/value head shared by all query heads
  (K = V), RoPE on the trailing `qk_rope_head_dim` channels of each head in interleaved pairs, learned sinks,
  a sliding window over the layer's own tokens plus compressed entries (per `layer_types`: none, a lightning
  indexer's top-k of one entry per `compress_rates["compressed_sparse_attention"]` tokens, or all entries of one
  per `compress_rates["heavily_compressed_attention"]` tokens), and a grouped output projection
  (`o_groups`, `o_lora_rank`). Sliding layers rotate with `rope_parameters["main"]`, compressed layers with
  `rope_parameters["compress"]` (`compress_rope_theta`, YaRN without its attention scaling);
- manifold-constrained hyper-connections (`hc_mult` residual streams; moecore/models/hyper_connections.py);
- the router scores experts with sqrt(softplus(logit)) (`scoring_func`), selects with the correction bias, always
  renormalises the picked scores and multiplies them by `routed_scaling_factor`; the first `mlp_layer_types`
  entries "hash_moe" pick their experts from the table `gate.tid2eid` indexed by the token id (HashRouter);
- experts and the shared expert use a SwiGLU whose gate is clipped at `swiglu_limit` and whose up projection is
  clamped to +-`swiglu_limit` (`model.activation=swiglu_clipped`); one shared expert as wide as a routed one.

Older config.json files name some fields the way DeepSeek's release did (`compress_ratios` per layer, `num_hash_layers`,
`qk_rope_head_dim`, a flat YaRN `rope_scaling` for the compressed layers); both spellings import. transformers does not
build the multi-token prediction module, so `mtp.*` tensors are skipped on import and none are written.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from moecore.config import Config
from moecore.hf.families import TensorMap
from moecore.hf.families.common import (
    _YARN_KEYS,
    HFFields,
    aux_coef_to_hf,
    grouped_expert_maps,
    refuse_export_unless,
    validated,
)

MODEL_TYPE = "deepseek_v4"
ARCHITECTURE = "DeepseekV4ForCausalLM"
IGNORED_HF_TENSORS = (r"(^|\.)mtp\.", r"\.rotary_emb\.")

_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
_RATIO_TO_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}

# transformers' DeepseekV4Config defaults (DeepSeek-V4-Flash's shape), used for fields a config.json leaves out.
DEFAULTS = {
    "vocab_size": 129280,
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "num_experts_per_tok": 6,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "max_position_embeddings": 1048576,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "swiglu_limit": 10.0,
    "sliding_window": 128,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "num_nextn_predict_layers": 1,
    "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "attention_dropout": 0.0,
}


def _layer_types(f: HFFields, n: int) -> list[str]:
    """`layer_types`, or the per-layer `compress_ratios` of older files, or transformers' default pattern."""
    types, ratios = f.get("layer_types", None), f.get("compress_ratios", None)
    if types is None and ratios is not None:
        bad = [r for r in ratios if r not in _RATIO_TO_TYPE]
        if bad:
            f.refuse("compress_ratios", ratios, "entries 0 | 4 | 128")
        types = [_RATIO_TO_TYPE[r] for r in ratios]
    if types is None:  # transformers: two heavily compressed layers, then compressed sparse / heavily alternating
        rest = [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))
        ]
        types = ["heavily_compressed_attention"] * min(n, 2) + rest
    types = list(types)[:n]
    if len(types) != n or any(t not in _LAYER_TYPES for t in types):
        f.refuse("layer_types", types, f"{n} entries of " + " | ".join(_LAYER_TYPES))
    return types


def _num_hash_layers(f: HFFields, n: int) -> int:
    """The leading "hash_moe" entries of `mlp_layer_types` (older files: `num_hash_layers`; default 3)."""
    types, legacy = f.get("mlp_layer_types", None), f.get("num_hash_layers", None)
    if types is None:
        return min(n, 3 if legacy is None else int(legacy))
    types = list(types)[:n]
    k = 0
    while k < len(types) and types[k] == "hash_moe":
        k += 1
    if len(types) != n or any(t != "moe" for t in types[k:]):
        f.refuse("mlp_layer_types", types, "'hash_moe' entries first, then 'moe' (hash routing in the first layers)")
    return k


def _ropes(f: HFFields) -> tuple[float, float, dict | None]:
    """(main rope theta, compressed layers' theta, their YaRN scaling or None) from nested `rope_parameters`
    {main, compress}, or a flat `rope_parameters` / `rope_scaling` (older files: it is the compressed layers')."""
    params = f.get("rope_parameters", None) or f.get("rope_scaling", None) or {}
    theta, ctheta = float(f.get("rope_theta")), float(f.get("compress_rope_theta"))
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, comp = dict(params["main"]), dict(params["compress"])
        if main.get("rope_type", "default") != "default":
            f.refuse("rope_parameters.main.rope_type", main.get("rope_type"), "the sliding layers' RoPE is unscaled")
        theta = float(main.get("rope_theta", theta))
        ctheta = float(comp.pop("rope_theta", ctheta))
    else:
        comp = {k: v for k, v in params.items() if k not in ("rope_theta",)}
    for key in ("partial_rotary_factor",):
        comp.pop(key, None)
    kind = comp.pop("rope_type", None) or comp.pop("type", None) or "default"
    comp.pop("type", None)
    if kind == "default":
        return theta, ctheta, None
    if kind != "yarn":
        f.refuse("rope_parameters.compress.rope_type", kind, "allowed: default | yarn")
    unknown = sorted(k for k in comp if k not in _YARN_KEYS)
    if unknown:
        f.refuse(f"rope_parameters.compress.{unknown[0]}", comp[unknown[0]], f"yarn takes only {', '.join(_YARN_KEYS)}")
    scaling = {"type": "yarn", **{k: v for k, v in comp.items() if v is not None}}
    scaling.setdefault("attention_factor", 1.0)  # transformers: no YaRN scaling of cos / sin on compressed layers
    return theta, ctheta, scaling


def config_from_hf(hf: dict) -> Config:
    """config.json -> our Config (model and moe sections)."""
    f = HFFields(hf, MODEL_TYPE, DEFAULTS)
    cfg = Config()
    m, e = cfg.model, cfg.moe
    m.family = MODEL_TYPE
    m.vocab_size = f.integer("vocab_size")
    m.hidden_size = f.integer("hidden_size")
    m.num_layers = f.integer("num_hidden_layers")
    m.num_attention_heads = f.integer("num_attention_heads")
    if f.integer("num_key_value_heads") != 1:
        f.refuse("num_key_value_heads", hf["num_key_value_heads"], "DeepSeek-V4 shares one key/value head")
    m.num_kv_heads = 1
    m.head_dim = f.integer("head_dim")
    m.q_lora_rank = f.integer("q_lora_rank")
    legacy_rope = f.get("qk_rope_head_dim", None)
    partial = f.get("partial_rotary_factor", None)
    m.qk_rope_head_dim = int(legacy_rope) if legacy_rope is not None else int(m.head_dim * (partial or 64 / 512))
    f.expect("hidden_act", ("silu", "swish"))
    for key in ("attention_bias", "mlp_bias"):
        if f.get(key):
            f.refuse(key, True, "DeepSeek-V4 has no biases")
    if float(f.get("attention_dropout")) > 0:
        f.refuse("attention_dropout", hf["attention_dropout"], "only 0 imports")
    if float(f.get("router_jitter_noise")) > 0:
        f.refuse("router_jitter_noise", hf["router_jitter_noise"], "only 0 imports")
    m.norm_eps = float(f.get("rms_norm_eps"))
    m.max_position_embeddings = f.integer("max_position_embeddings")
    m.tie_embeddings = bool(f.get("tie_word_embeddings"))
    m.init_std = float(f.get("initializer_range"))
    m.rope_theta, m.compress_rope_theta, m.compress_rope_scaling = _ropes(f)
    m.attention_type = "compressed"
    m.layer_types = _layer_types(f, m.num_layers)
    rates = dict(f.get("compress_rates", None) or {})
    m.csa_compress_rate = int(rates.get("compressed_sparse_attention", f.get("compress_rate_csa", 4)))
    m.hca_compress_rate = int(rates.get("heavily_compressed_attention", f.get("compress_rate_hca", 128)))
    m.sliding_window = f.integer("sliding_window")
    m.o_groups, m.o_lora_rank = f.integer("o_groups"), f.integer("o_lora_rank")
    m.index_n_heads, m.index_head_dim = f.integer("index_n_heads"), f.integer("index_head_dim")
    m.index_topk = f.integer("index_topk")
    m.attn_sinks = True
    m.hc_mult, m.hc_sinkhorn_iters = f.integer("hc_mult"), f.integer("hc_sinkhorn_iters")
    m.hc_eps = float(f.get("hc_eps"))
    m.activation, m.swiglu_limit = "swiglu_clipped", float(f.get("swiglu_limit"))
    if m.swiglu_limit <= 0:
        f.refuse("swiglu_limit", hf.get("swiglu_limit"), "a limit > 0")
    f.get("num_nextn_predict_layers")  # transformers builds no MTP module; its tensors are skipped

    e.num_experts = f.integer("n_routed_experts")
    e.router_topk = f.integer("num_experts_per_tok")
    e.ffn_hidden_size = f.integer("moe_intermediate_size")
    m.ffn_hidden_size = e.ffn_hidden_size  # no dense layers; kept equal for the planner's defaults
    if f.integer("n_shared_experts", lo=0) != 1:
        f.refuse("n_shared_experts", hf["n_shared_experts"], "transformers' DeepSeek-V4 builds exactly one")
    e.shared_expert_intermediate_size = e.ffn_hidden_size
    score = f.expect("scoring_func", ("sqrtsoftplus", "sigmoid", "softmax"))
    e.router_score_function, e.router_pre_softmax = score, score == "softmax"
    if not f.get("norm_topk_prob"):
        f.refuse("norm_topk_prob", hf["norm_topk_prob"], "transformers' DeepSeek-V4 always renormalises")
    e.norm_topk_prob = True
    e.router_topk_scaling_factor = float(f.get("routed_scaling_factor"))
    e.router_enable_expert_bias = True
    e.num_hash_layers = _num_hash_layers(f, m.num_layers)
    e.router_dtype, e.expert_capacity_factor = "fp32", None
    e.router_load_balancing_type, e.aux_loss_coeff = "aux_loss", float(f.get("router_aux_loss_coef"))
    e.layer_freq, e.first_k_dense_replace = 1, 0
    e.apply_probs_on_input = True  # the same sum with the weight applied before the down projection (docs/moe.md)
    f.finish()
    return validated(cfg)


def config_to_hf(cfg: Config) -> dict:
    """Our Config -> config.json, refusing options DeepseekV4ForCausalLM cannot express."""
    m, e = cfg.model, cfg.moe
    all_moe = e.num_experts > 0 and all(e.is_moe_layer(i, m.num_layers) for i in range(m.num_layers))
    shared = e.shared_expert_intermediate_size
    score_ok = e.router_score_function in ("sqrtsoftplus", "sigmoid") or e.router_pre_softmax
    refuse_export_unless(
        MODEL_TYPE,
        [
            ("model.attention_type", m.attention_type, m.attention_type == "compressed", "compressed attention"),
            ("model.num_kv_heads", m.num_kv_heads, m.kv_heads == 1, "one shared key/value head"),
            ("model.hc_mult", m.hc_mult, m.hc_mult > 1, "hyper-connections (hc_mult > 1)"),
            ("model.activation", m.activation, m.activation == "swiglu_clipped", "the clipped SwiGLU"),
            ("model.mtp_num_layers", m.mtp_num_layers, m.mtp_num_layers == 0, "no multi-token prediction"),
            ("model.norm_zero_centered", m.norm_zero_centered, not m.norm_zero_centered, "plain RMSNorm only"),
            ("moe.layer_freq", e.layer_freq, all_moe, "every layer is MoE"),
            ("moe.shared_expert_intermediate_size", shared, shared == e.ffn_hidden_size, "one routed expert's width"),
            ("moe.shared_expert_gate", e.shared_expert_gate, not e.shared_expert_gate, "no shared expert gate"),
            ("moe.router_score_function", e.router_score_function, score_ok, "sqrtsoftplus | sigmoid | pre-softmax"),
            ("moe.norm_topk_prob", e.norm_topk_prob, e.norm_topk_prob, "always renormalised"),
            ("moe.router_enable_expert_bias", e.router_enable_expert_bias, e.router_enable_expert_bias, "needed"),
            ("moe.router_num_groups", e.router_num_groups, e.router_num_groups is None, "no group-limited routing"),
        ],
    )  # fmt: skip
    compress = {"rope_type": "default", "rope_theta": float(m.compress_rope_theta)}
    if m.compress_rope_scaling:
        scaling = dict(m.compress_rope_scaling)
        compress = {"rope_type": scaling.pop("type"), "rope_theta": float(m.compress_rope_theta), **scaling}
    partial = m.qk_rope_head_dim / m.resolved_head_dim
    compress["partial_rotary_factor"] = partial
    return {
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "moe_intermediate_size": e.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": 1,
        "head_dim": m.resolved_head_dim,
        "q_lora_rank": m.q_lora_rank,
        "partial_rotary_factor": partial,
        "num_experts_per_tok": e.router_topk,
        "n_routed_experts": e.num_experts,
        "n_shared_experts": 1,
        "scoring_func": e.router_score_function,
        "norm_topk_prob": True,
        "routed_scaling_factor": e.router_topk_scaling_factor or 1.0,
        "max_position_embeddings": m.max_position_embeddings,
        "rope_theta": float(m.rope_theta),
        "compress_rope_theta": float(m.compress_rope_theta),
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": float(m.rope_theta), "partial_rotary_factor": partial},
            "compress": compress,
        },
        "layer_types": list(m.layer_types),
        "compress_rates": {
            "compressed_sparse_attention": m.csa_compress_rate,
            "heavily_compressed_attention": m.hca_compress_rate,
        },
        "mlp_layer_types": ["hash_moe"] * e.num_hash_layers + ["moe"] * (m.num_layers - e.num_hash_layers),
        "hc_mult": m.hc_mult,
        "hc_sinkhorn_iters": m.hc_sinkhorn_iters,
        "hc_eps": m.hc_eps,
        "swiglu_limit": m.swiglu_limit,
        "sliding_window": m.sliding_window,
        "o_groups": m.o_groups,
        "o_lora_rank": m.o_lora_rank,
        "index_n_heads": m.index_n_heads,
        "index_head_dim": m.index_head_dim,
        "index_topk": m.index_topk,
        "num_nextn_predict_layers": 0,
        "router_aux_loss_coef": aux_coef_to_hf(e),
        "hidden_act": "silu",
        "initializer_range": m.init_std,
        "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": m.attention_dropout,
    }


# --------------------------------------------------------------------------------------------------
# Tensor maps
# --------------------------------------------------------------------------------------------------


# transformers' in-memory names -> the names its save_pretrained writes (DeepSeek's own tensor names, with the
# "model." prefix kept), applied in this order; the reverse of its DeepSeek-V4 conversion mapping.
_DISK_RENAMES = (
    (r"^lm_head\.", "head."),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.shared_experts\.gate_proj\.", ".ffn.shared_experts.w1."),
    (r"\.mlp\.shared_experts\.up_proj\.", ".ffn.shared_experts.w3."),
    (r"\.mlp\.shared_experts\.down_proj\.", ".ffn.shared_experts.w2."),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".ffn.gate.bias"),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.", ".hc_attn_"),
    (r"\.ffn_hc\.", ".hc_ffn_"),
    (r"\.sinks$", ".attn_sink"),
    (r"\.kv_norm\.", ".norm."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
)


def disk_name(name: str) -> str:
    """A tensor's name in a saved checkpoint, from its name in transformers' model."""
    for pattern, repl in _DISK_RENAMES:
        name = re.sub(pattern, repl, name)
    return name


def _in_memory(available: Collection[str] | None) -> bool:
    """Whether `available` holds transformers' in-memory names (a live model's state dict, as tests pair
    gradients) rather than a checkpoint's."""
    return available is not None and "model.layers.0.self_attn.q_a_proj.weight" in available


def _attention_names(layer_type: str) -> list[str]:
    """The attention's tensors, named as in transformers' model relative to `self_attn`."""
    names = ["q_a_proj.weight", "q_a_norm.weight", "q_b_proj.weight", "kv_proj.weight", "kv_norm.weight",
             "o_a_proj.weight", "o_b_proj.weight", "sinks"]  # fmt: skip
    if layer_type == "sliding_attention":
        return names
    comp = ["kv_proj.weight", "gate_proj.weight", "position_bias", "kv_norm.weight"]
    names += [f"compressor.{n}" for n in comp]
    if layer_type == "compressed_sparse_attention":
        names += [f"compressor.indexer.{n}" for n in [*comp, "q_b_proj.weight", "scorer.weights_proj.weight"]]
    return names


def tensor_maps(cfg: Config, available: Collection[str] | None = None) -> list[TensorMap]:
    """Every tensor of our model and the checkpoint tensors it is made of (checkpoint names; transformers' own
    names when `available` is a live model's state dict)."""
    m, e = cfg.model, cfg.moe
    live = _in_memory(available)
    rename = (lambda n: n) if live else disk_name
    pairs = [("embed.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight")]
    pairs += [(f"hc_head.{n}", f"model.hc_head.{n}") for n in ("hc_fn", "hc_base", "hc_scale")]
    if not m.tie_embeddings:
        pairs.append(("lm_head.weight", "lm_head.weight"))
    maps = []
    for i in range(m.num_layers):
        ours, hf = f"layers.{i}", f"model.layers.{i}"
        pairs += [(f"{ours}.attn_norm.weight", f"{hf}.input_layernorm.weight"),
                  (f"{ours}.mlp_norm.weight", f"{hf}.post_attention_layernorm.weight")]  # fmt: skip
        for n in ("fn", "base", "scale"):
            pairs += [(f"{ours}.attn_hc.{n}", f"{hf}.attn_hc.{n}"), (f"{ours}.mlp_hc.{n}", f"{hf}.ffn_hc.{n}")]
        for n in _attention_names(m.layer_types[i]):
            pairs.append((f"{ours}.attn.{n.replace('scorer.', '')}", f"{hf}.self_attn.{n}"))
        mo, mh = f"{ours}.mlp", f"{hf}.mlp"
        pairs.append((f"{mo}.router.weight", f"{mh}.gate.weight"))
        if i < e.num_hash_layers:
            pairs.append((f"{mo}.router.tid2eid", f"{mh}.gate.tid2eid"))
        else:
            pairs.append((f"{mo}.router.expert_bias", f"{mh}.gate.e_score_correction_bias"))
        pairs += [(f"{mo}.shared_experts.{p}_proj.weight", f"{mh}.shared_experts.{p}_proj.weight")
                  for p in ("gate", "up", "down")]  # fmt: skip
        if live:
            maps += grouped_expert_maps(mo, mh, e.num_experts, fused=True)
        else:
            maps += grouped_expert_maps(mo, rename(mh + ".")[:-1], e.num_experts, False, ("w1", "w3", "w2"))
    return [TensorMap.copy(ours, rename(hf)) for ours, hf in pairs] + maps
