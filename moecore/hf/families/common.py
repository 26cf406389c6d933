"""Pieces the Hugging Face families share: strict config reading, RoPE and layer-pattern translation,
and the tensor maps of the Llama-style decoder (attention, norms, dense MLP, routed and shared experts).

Our parameter names (docs/design.md) against the Hugging Face ones, layer i:
    embed.weight                              model.embed_tokens.weight
    layers.i.attn_norm.weight                 model.layers.i.input_layernorm.weight
    layers.i.attn.{q,k,v,o}_proj.{weight,bias} model.layers.i.self_attn.{q,k,v,o}_proj.{weight,bias}
    layers.i.attn.{q,k}_norm.weight           model.layers.i.self_attn.{q,k}_norm.weight
    layers.i.mlp_norm.weight                  model.layers.i.post_attention_layernorm.weight
    layers.i.mlp.{gate,up,down}_proj.weight   model.layers.i.mlp.{gate,up,down}_proj.weight (dense layer)
    layers.i.mlp.router.weight                <moe>.gate.weight
    layers.i.mlp.experts.w13 [E, 2F, H]       <moe>.experts.j.{gate,up}.weight, stacked over j (gate rows first)
    layers.i.mlp.experts.w2  [E, H, F]        <moe>.experts.j.{down}.weight, stacked over j
    layers.i.mlp.shared_experts.*_proj.weight <moe>.shared_expert.*_proj.weight
    layers.i.mlp.shared_expert_gate.weight    <moe>.shared_expert_gate.weight
    norm.weight, lm_head.weight               model.norm.weight, lm_head.weight
where <moe> is model.layers.i.mlp (Qwen) or model.layers.i.block_sparse_moe (Mixtral on disk).
transformers 5 keeps experts in memory as fused 3-D tensors `experts.gate_up_proj` [E, 2F, H] (gate rows
first, the same as our w13) and `experts.down_proj` [E, H, F]; it converts them back to per-expert tensors
when it saves, and so do checkpoints on the Hub. We write per-expert tensors and read either layout.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from moecore.config import Config, ModelConfig, MoEConfig
from moecore.hf.families import TensorMap

# config.json fields that never change the model's maths (bookkeeping, generation defaults, token ids).
INERT_FIELDS = frozenset(
    """architectures model_type transformers_version torch_dtype dtype use_cache bos_token_id eos_token_id
    pad_token_id sep_token_id decoder_start_token_id _name_or_path name_or_path output_router_logits
    output_attentions output_hidden_states return_dict use_return_dict chunk_size_feed_forward id2label label2id
    problem_type is_encoder_decoder is_decoder tokenizer_class task_specific_params finetuning_task torchscript
    prefix tie_encoder_decoder cross_attention_hidden_size add_cross_attention pruned_heads max_length min_length
    do_sample early_stopping num_beams num_beam_groups diversity_penalty temperature top_k top_p typical_p
    repetition_penalty length_penalty no_repeat_ngram_size encoder_no_repeat_ngram_size bad_words_ids
    num_return_sequences output_scores return_dict_in_generate forced_bos_token_id forced_eos_token_id
    remove_invalid_values exponential_decay_length_penalty suppress_tokens begin_suppress_tokens tf_legacy_loss
    use_bfloat16 auto_map""".split()
)

_YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
)


_UNSET = object()


class HFFields:
    """Reads a config.json dict and remembers which fields were read, so that `finish()` can refuse the rest.

    `defaults` holds the values transformers' config class uses for absent (or null) fields, so a
    sparse config.json means here what it means to transformers. Any field that is neither read by the
    family nor listed in INERT_FIELDS stops the import: it might change the maths, and a silently
    different model is worse than an error.
    """

    def __init__(self, hf: dict, model_type: str, defaults: dict) -> None:
        self.hf = hf
        self.model_type = model_type
        self.defaults = defaults
        self.used: set[str] = set()

    def get(self, key: str, default=_UNSET):
        """The field's value; when it is absent or null, `default` or else transformers' default."""
        self.used.add(key)
        value = self.hf.get(key)
        if value is not None:
            return value
        return self.defaults.get(key) if default is _UNSET else default

    def has(self, key: str) -> bool:
        return self.hf.get(key) is not None

    def refuse(self, key: str, value, why: str) -> None:
        raise ValueError(f"config.json field {key}={value!r} is not supported for {self.model_type}: {why}")

    def expect(self, key: str, allowed: tuple):
        """The field's value, refused unless it is one of `allowed`."""
        value = self.get(key)
        if value not in allowed:
            self.refuse(key, value, "allowed: " + " | ".join(repr(a) for a in allowed))
        return value

    def integer(self, key: str, lo: int = 1):
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            self.refuse(key, value, f"an integer >= {lo}")
        return value

    def finish(self) -> None:
        if self.hf.get("quantization_config") is not None:
            from moecore.hf.fp8 import fp8_block_size

            try:  # block-wise fp8 weights are dequantized on import (moecore/hf/fp8.py)
                fp8_block_size(self.hf)
            except ValueError:
                self.refuse(
                    "quantization_config", self.hf["quantization_config"], "quantized checkpoints cannot be imported"
                )
            self.used.add("quantization_config")
        unknown = sorted(k for k in self.hf if k not in self.used and k not in INERT_FIELDS)
        if unknown:
            raise ValueError(
                f"config.json field(s) {', '.join(unknown)} are not understood by the {self.model_type} importer "
                "and may change the model's maths; remove them if they do not"
            )


def refuse_export(model_type: str, field: str, value, why: str) -> None:
    raise ValueError(f"{field}={value!r} cannot be exported as {model_type}: {why}")


def refuse_export_unless(model_type: str, checks: Iterable[tuple[str, object, bool, str]]) -> None:
    """Refuse the first (our field, its value, ok, why) whose `ok` is false."""
    for field, value, ok, why in checks:
        if not ok:
            refuse_export(model_type, field, value, why)


# --------------------------------------------------------------------------------------------------
# Config pieces
# --------------------------------------------------------------------------------------------------


def base_config(f: HFFields) -> Config:
    """The Llama-style `model` fields (and router defaults) every family here shares; the family adds the rest."""
    cfg = Config()
    m = cfg.model
    m.family = f.model_type
    m.vocab_size = f.integer("vocab_size")
    m.hidden_size = f.integer("hidden_size")
    m.num_layers = f.integer("num_hidden_layers")
    m.num_attention_heads = f.integer("num_attention_heads")
    m.num_kv_heads = int(f.get("num_key_value_heads", m.num_attention_heads))
    head_dim = f.get("head_dim", None)
    if head_dim is not None and not (
        m.hidden_size % m.num_attention_heads == 0 and head_dim == m.hidden_size // m.num_attention_heads
    ):
        m.head_dim = f.integer("head_dim")
    m.ffn_hidden_size = f.integer("intermediate_size")
    f.expect("hidden_act", ("silu", "swish"))
    m.activation = "swiglu"
    m.norm_eps = float(f.get("rms_norm_eps"))
    m.max_position_embeddings = f.integer("max_position_embeddings")
    m.rope_theta, m.rope_scaling = rope_from_hf(f)
    m.tie_embeddings = bool(f.get("tie_word_embeddings", False))
    m.attention_dropout = float(f.get("attention_dropout", 0.0))
    if m.attention_dropout > 0:
        f.refuse("attention_dropout", m.attention_dropout, "our grouped-query attention has no dropout; only 0 imports")
    m.init_std = float(f.get("initializer_range", 0.02))
    e = cfg.moe
    e.router_score_function = "softmax"
    e.router_pre_softmax = True  # transformers: softmax over all experts, then top-k
    e.router_dtype = "fp32"
    e.expert_capacity_factor = None  # transformers is dropless
    e.router_load_balancing_type = "aux_loss"
    e.aux_loss_coeff = float(f.get("router_aux_loss_coef", 0.001))
    e.router_topk = f.integer("num_experts_per_tok")
    # transformers weights each expert's output; the same sum with the weight applied before the down projection,
    # as the recipes run it (less kept for backward; docs/moe.md)
    e.apply_probs_on_input = True
    return cfg


def base_to_hf(m: ModelConfig) -> dict:
    """The Llama-style config.json fields every family writes (the `model` part of `base_config`, reversed)."""
    return {
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_position_embeddings,
        "initializer_range": m.init_std,
        "rms_norm_eps": m.norm_eps,
        **rope_to_hf(m),
        "attention_dropout": m.attention_dropout,
        "tie_word_embeddings": m.tie_embeddings,
    }


def num_experts(f: HFFields, key: str, alias: str) -> int:
    """The expert count from `key` or its alias (transformers maps one onto the other); they must agree."""
    a, b = f.get(key, None), f.get(alias, None)
    if a is not None and b is not None and a != b:
        f.refuse(alias, b, f"disagrees with {key}={a}")
    return f.integer(alias if b is not None else key, lo=1)


def aux_coef_to_hf(e: MoEConfig) -> float:
    """`router_aux_loss_coef`: our coefficient of the per-layer `aux_loss` (0 when it is off)."""
    for kind, coef in zip(e.balancing_types, e.aux_loss_coeffs):
        if kind == "aux_loss":
            return coef
    return 0.0


def validated(cfg: Config) -> Config:
    """Run our own checks on the translated sections (they name our fields)."""
    cfg.model.validate()
    cfg.moe.validate(cfg.model.num_layers)
    return cfg


def rope_from_hf(f: HFFields) -> tuple[float, dict | None]:
    """(rope_theta, our rope_scaling) from `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling` (4.x)."""
    params = f.get("rope_parameters")
    legacy = f.get("rope_scaling")
    theta = f.get("rope_theta")
    src_name = "rope_parameters" if params else "rope_scaling"
    rope = dict(params or legacy or {})
    if any(isinstance(v, dict) for v in rope.values()):
        f.refuse(src_name, rope, "RoPE parameters per layer type are not supported")
    theta = float(rope.pop("rope_theta", theta))
    partial = rope.pop("partial_rotary_factor", f.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        f.refuse("partial_rotary_factor", partial, f"{f.model_type} rotates every head channel")
    kind = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope.pop("type", None)
    if kind == "default":
        extra = {k: v for k, v in rope.items() if v is not None}
        if extra:
            f.refuse(src_name, extra, "fields other than rope_type/rope_theta need a scaled rope_type")
        return theta, None
    if kind == "linear":
        factor = rope.pop("factor", None)
        if factor is None or rope:
            f.refuse(src_name, {"rope_type": kind, "factor": factor, **rope}, "linear scaling takes exactly 'factor'")
        return theta, {"type": "linear", "factor": float(factor)}
    if kind == "yarn":
        unknown = sorted(k for k in rope if k not in _YARN_KEYS)
        if unknown:
            f.refuse(f"{src_name}.{unknown[0]}", rope[unknown[0]], f"yarn takes only {', '.join(_YARN_KEYS)}")
        return theta, {"type": "yarn", **{k: v for k, v in rope.items() if v is not None}}
    f.refuse(f"{src_name}.rope_type", kind, "allowed: default | linear | yarn")
    return theta, None  # unreachable


def rope_to_hf(m: ModelConfig) -> dict:
    """`rope_theta` and `rope_scaling` as checkpoints on the Hub write them (transformers 4.x and 5 read them)."""
    out: dict = {"rope_theta": float(m.rope_theta), "rope_scaling": None}
    scaling = dict(m.rope_scaling or {})
    kind = scaling.pop("type", None) or scaling.pop("rope_type", None) or "default"
    if kind != "default":
        out["rope_scaling"] = {"rope_type": kind, **scaling}
    return out


def moe_pattern_from_hf(f: HFFields, num_layers: int, num_experts: int) -> list[int]:
    """0/1 per layer from `decoder_sparse_step` and `mlp_only_layers` (Qwen): MoE when (i+1) % step == 0."""
    step = f.get("decoder_sparse_step", 1)
    dense = f.get("mlp_only_layers", [])
    if not isinstance(step, int) or step < 1:
        f.refuse("decoder_sparse_step", step, "an integer >= 1")
    if not isinstance(dense, list) or any(not isinstance(i, int) or not 0 <= i < num_layers for i in dense):
        f.refuse("mlp_only_layers", dense, f"a list of layer indices in [0, {num_layers})")
    return [int(num_experts > 0 and i not in dense and (i + 1) % step == 0) for i in range(num_layers)]


def qwen_experts_from_hf(f: HFFields, cfg: Config, num_experts: int) -> None:
    """Routed experts and the dense/MoE layout as Qwen2-MoE and Qwen3-MoE write them."""
    e = cfg.moe
    e.num_experts = num_experts
    e.ffn_hidden_size = f.integer("moe_intermediate_size")
    e.norm_topk_prob = f.expect("norm_topk_prob", (True, False))
    pattern = moe_pattern_from_hf(f, cfg.model.num_layers, e.num_experts)
    e.layer_freq = 1 if all(pattern) else pattern


def qwen_experts_to_hf(cfg: Config) -> dict:
    """The reverse of `qwen_experts_from_hf`, with the router's top-k and aux-loss coefficient."""
    e = cfg.moe
    return {
        "num_experts": e.num_experts,
        "num_experts_per_tok": e.router_topk,
        "moe_intermediate_size": e.ffn_hidden_size,
        "norm_topk_prob": renormalises(e),
        **moe_pattern_to_hf(cfg),
        "router_aux_loss_coef": aux_coef_to_hf(e),
        "output_router_logits": False,
    }


def moe_pattern(cfg: Config) -> list[int]:
    return [int(cfg.moe.is_moe_layer(i, cfg.model.num_layers)) for i in range(cfg.model.num_layers)]


def moe_pattern_to_hf(cfg: Config) -> dict:
    """`decoder_sparse_step` and `mlp_only_layers` that reproduce our dense/MoE pattern exactly."""
    pattern = moe_pattern(cfg)
    n = len(pattern)
    for step in range(1, n + 1):
        if pattern == [int((i + 1) % step == 0) for i in range(n)]:
            return {"decoder_sparse_step": step, "mlp_only_layers": []}
    return {"decoder_sparse_step": 1, "mlp_only_layers": [i for i, p in enumerate(pattern) if not p]}


def softmax_router_checks(e: MoEConfig) -> list[tuple[str, object, bool, str]]:
    """The router options no family with a plain softmax router can express (for `refuse_export_unless`)."""
    return [
        ("moe.router_score_function", e.router_score_function, e.router_score_function == "softmax", "softmax only"),
        ("moe.router_enable_expert_bias", True, not e.router_enable_expert_bias, "no expert bias"),
        (
            "moe.router_topk_scaling_factor",
            e.router_topk_scaling_factor,
            e.router_topk_scaling_factor in (None, 1.0),
            "no scaling",
        ),
        ("moe.router_num_groups", e.router_num_groups, e.router_num_groups is None, "no group-limited routing"),
    ]


def qk_norm_scope_checks(m: ModelConfig) -> list[tuple[str, object, bool, str]]:
    """Families whose q/k norms are per head cannot write MiniMax-M2's norm over the whole projection."""
    scope = m.qk_norm_scope
    return [("model.qk_norm_scope", scope, not m.qk_norm or scope == "head", "q/k norms per head only")]


def projection_norm_attention_checks(m: ModelConfig, name: str) -> list[tuple[str, object, bool, str]]:
    """The attention options of the families whose GQA layers normalise the whole q (k) projection and have nothing
    else (MiniMax-M2, OLMoE): every layer softmax attention over the whole causal context, plain RMSNorm, SwiGLU, no
    output gate, sinks or MTP (for `refuse_export_unless`)."""
    return [
        ("model.attention_type", m.attention_type, m.attention_type == "gqa", "grouped-query attention only"),
        ("model.layer_types", m.layer_types, m.layer_types is None, "one attention kind for every layer"),
        ("model.qk_norm", m.qk_norm, m.qk_norm, f"{name} always normalises q and k"),
        (
            "model.qk_norm_scope",
            m.qk_norm_scope,
            m.qk_norm_scope == "projection",
            f"{name} normalises the whole q (k) projection (allowed: projection)",
        ),
        ("model.attn_output_gate", m.attn_output_gate, not m.attn_output_gate, "no attention output gate"),
        ("model.attn_sinks", m.attn_sinks, not m.attn_sinks, "no attention sinks"),
        ("model.sliding_window", m.sliding_window, m.sliding_window is None, "no sliding window"),
        ("model.norm_zero_centered", m.norm_zero_centered, not m.norm_zero_centered, "plain RMSNorm only"),
        ("model.activation", m.activation, m.activation == "swiglu", "SwiGLU only"),
        ("model.mtp_num_layers", m.mtp_num_layers, m.mtp_num_layers == 0, "transformers builds no MTP module"),
    ]


def check_exportable(cfg: Config, model_type: str) -> None:
    """Refuse our options that no Llama-style family here can express in config.json (Mixtral, Qwen2/3-MoE)."""
    m, e = cfg.model, cfg.moe
    refuse_export_unless(
        model_type,
        [
            ("model.attention_type", m.attention_type, m.attention_type == "gqa", "only gqa attention"),
            ("model.layer_types", m.layer_types, m.layer_types is None, "no linear-attention layers"),
            ("model.attn_output_gate", m.attn_output_gate, not m.attn_output_gate, "no attention output gate"),
            ("model.norm_zero_centered", m.norm_zero_centered, not m.norm_zero_centered, "plain RMSNorm only"),
            (
                "model.partial_rotary_factor",
                m.partial_rotary_factor,
                m.partial_rotary_factor == 1.0,
                "full rotary only",
            ),
            ("model.activation", m.activation, m.activation == "swiglu", "SwiGLU only"),
            ("model.mtp_num_layers", m.mtp_num_layers, m.mtp_num_layers == 0, "no multi-token prediction"),
            *qk_norm_scope_checks(m),
            ("moe.num_experts", e.num_experts, e.num_experts > 0, "needs routed experts"),
            *softmax_router_checks(e),
        ],
    )


def renormalises(e: MoEConfig) -> bool:
    """Whether the top-k weights sum to one: softmax after top-k always does; softmax before, with norm_topk_prob."""
    return (not e.router_pre_softmax) or e.norm_topk_prob


# --------------------------------------------------------------------------------------------------
# Tensor maps
# --------------------------------------------------------------------------------------------------


def embed_maps(m: ModelConfig) -> list[TensorMap]:
    maps = [
        TensorMap.copy("embed.weight", "model.embed_tokens.weight"),
        TensorMap.copy("norm.weight", "model.norm.weight"),
    ]
    if not m.tie_embeddings:
        maps.append(TensorMap.copy("lm_head.weight", "lm_head.weight"))
    return maps


def norm_maps(ours: str, hf: str) -> list[TensorMap]:
    """The two RMSNorms of one decoder layer (`ours` / `hf`: the layer prefixes)."""
    return [
        TensorMap.copy(f"{ours}.attn_norm.weight", f"{hf}.input_layernorm.weight"),
        TensorMap.copy(f"{ours}.mlp_norm.weight", f"{hf}.post_attention_layernorm.weight"),
    ]


def attention_maps(i: int, m: ModelConfig) -> list[TensorMap]:
    ours, hf = f"layers.{i}", f"model.layers.{i}"
    maps = norm_maps(ours, hf)
    for p in ("q", "k", "v", "o"):
        maps.append(TensorMap.copy(f"{ours}.attn.{p}_proj.weight", f"{hf}.self_attn.{p}_proj.weight"))
        if (m.qkv_bias and p != "o") or (m.attn_out_bias and p == "o"):
            maps.append(TensorMap.copy(f"{ours}.attn.{p}_proj.bias", f"{hf}.self_attn.{p}_proj.bias"))
    if m.qk_norm:
        for p in ("q", "k"):
            maps.append(TensorMap.copy(f"{ours}.attn.{p}_norm.weight", f"{hf}.self_attn.{p}_norm.weight"))
    return maps


def dense_mlp_maps(ours: str, hf: str) -> list[TensorMap]:
    return [TensorMap.copy(f"{ours}.{p}_proj.weight", f"{hf}.{p}_proj.weight") for p in ("gate", "up", "down")]


def holds_fused_experts(hf_moe: str, available: Collection[str] | None) -> bool:
    """Whether the checkpoint holds transformers' in-memory layout of the experts under `hf_moe`."""
    return available is not None and f"{hf_moe}.experts.gate_up_proj" in available


def grouped_expert_maps(
    ours: str,
    hf_moe: str,
    num_experts: int,
    fused: bool,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> list[TensorMap]:
    """Our `{ours}.experts.w13` / `.w2`: transformers' fused `{hf_moe}.experts.gate_up_proj` / `.down_proj`
    when `fused`, else per-expert tensors `{hf_moe}.experts.{j}.{gate,up,down}.weight` (names[0..2]) stacked."""
    if fused:
        return [
            TensorMap.copy(f"{ours}.experts.w13", f"{hf_moe}.experts.gate_up_proj"),
            TensorMap.copy(f"{ours}.experts.w2", f"{hf_moe}.experts.down_proj"),
        ]
    gate, up, down = names
    ex = [f"{hf_moe}.experts.{j}" for j in range(num_experts)]
    return [
        TensorMap.stack(f"{ours}.experts.w13", [[f"{x}.{gate}.weight", f"{x}.{up}.weight"] for x in ex]),
        TensorMap.stack(f"{ours}.experts.w2", [[f"{x}.{down}.weight"] for x in ex]),
    ]


def expert_maps(
    i: int,
    num_experts: int,
    hf_moe: str,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    fused_moe: str | None = None,
    available: Collection[str] | None = None,
) -> list[TensorMap]:
    """Router and grouped experts of MoE layer i.

    Per-expert tensors `{hf_moe}.experts.{j}.{gate,up,down}.weight` (names[0..2]); or, when the checkpoint
    holds them, transformers' fused `{fused_moe}.experts.gate_up_proj` / `.down_proj`.
    """
    ours = f"layers.{i}.mlp"
    fused_moe = fused_moe or hf_moe
    fused = holds_fused_experts(fused_moe, available)
    hf_moe = fused_moe if fused else hf_moe
    router = TensorMap.copy(f"{ours}.router.weight", f"{hf_moe}.gate.weight")
    return [router, *grouped_expert_maps(ours, hf_moe, num_experts, fused, names)]


def shared_expert_maps(i: int, hf_moe: str, gated: bool) -> list[TensorMap]:
    ours = f"layers.{i}.mlp"
    maps = dense_mlp_maps(f"{ours}.shared_experts", f"{hf_moe}.shared_expert")
    if gated:
        maps.append(TensorMap.copy(f"{ours}.shared_expert_gate.weight", f"{hf_moe}.shared_expert_gate.weight"))
    return maps


def qwen_tensor_maps(
    cfg: Config,
    available: Collection[str] | None,
    shared_expert: bool,
    attention: Callable[[int, ModelConfig], list[TensorMap]] = attention_maps,
) -> list[TensorMap]:
    """Every tensor in the Qwen layout: `attention(i, m)` of each layer, then `model.layers.i.mlp` holding a
    dense SwiGLU or the router and experts (and, with `shared_expert`, the sigmoid-gated shared expert)."""
    m, e = cfg.model, cfg.moe
    maps = embed_maps(m)
    for i, is_moe in enumerate(moe_pattern(cfg)):
        maps += attention(i, m)
        hf = f"model.layers.{i}.mlp"
        if not is_moe:
            maps += dense_mlp_maps(f"layers.{i}.mlp", hf)
            continue
        maps += expert_maps(i, e.num_experts, hf, available=available)
        if shared_expert:
            maps += shared_expert_maps(i, hf, gated=True)
    return maps
