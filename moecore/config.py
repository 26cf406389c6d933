"""Typed, nested run configuration: one small dataclass per section, YAML recipes, dotted overrides.

A run is described by `Config`, whose sections are `model`, `moe`, `parallel`, `optim`, `data`,
`train`, `checkpoint`, `log` and `fp8`. A recipe is a YAML file holding any subset of these sections;
overrides on the command line look like `section.field=value` (lists as `data.paths=[a,b]`).

Every section has a `validate()` that raises `ConfigError` (a `ValueError`) with one line naming the
field, the bad value and what is allowed; `Config.validate()` adds the checks that span sections
(for example `moe.router_topk` <= `moe.num_experts`). Nothing here touches torch or the filesystem
beyond reading YAML, so validation runs before any work starts.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

RECIPE_DIR = Path(__file__).parent / "recipes"
DEFAULT_RECIPE = "tiny-moe"


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader that also reads `1e-5` as a number: YAML 1.1 (PyYAML) wants `1.0e-5`, YAML 1.2 not."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+$"), list("-+.0123456789")
)


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)


class ConfigError(ValueError):
    """Invalid user input. The message is one line meant to be shown as is (CLI exit code 2)."""


def _fail(name: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{name}={value!r} is invalid: {allowed}")


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        _fail(name, value, "allowed: " + " | ".join(str(c) for c in choices))


def _check_range(name: str, value: float | int | None, lo: float | None = None, hi: float | None = None) -> None:
    if value is None:
        return
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        lo_s = "-inf" if lo is None else str(lo)
        hi_s = "inf" if hi is None else str(hi)
        _fail(name, value, f"must be in [{lo_s}, {hi_s}]")


# --------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------


MODEL_FAMILIES = (
    "moecore", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "deepseek_v32", "qwen3_next",
    "glm4_moe", "gpt_oss",
)  # fmt: skip


@dataclass
class ModelConfig:
    """Shape of the transformer. Field names follow Hugging Face configs where one exists."""

    family: str = "moecore"  # moecore | mixtral | qwen2_moe | qwen3_moe | deepseek_v2 | deepseek_v3 | qwen3_next | ...
    vocab_size: int = 0  # 0: take the tokenizer's vocabulary size
    hidden_size: int = 128
    num_layers: int = 4
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    ffn_hidden_size: int = 352  # dense SwiGLU MLP width (dense layers)
    activation: str = "swiglu"  # swiglu | gelu | swiglu_clamped (gpt-oss experts) (dense MLP and experts)
    norm_eps: float = 1e-6
    norm_zero_centered: bool = False  # RMSNorm weight stored as an offset from 1 (Qwen3-Next)
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # e.g. {type: yarn, factor: 40, original_max_position_embeddings: 4096, ...}
    partial_rotary_factor: float = 1.0
    qkv_bias: bool = False
    attn_out_bias: bool = False  # bias on o_proj
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    attn_output_gate: bool = False  # sigmoid gate on the attention output from q_proj (Qwen3-Next)
    sliding_window: int | None = None
    attention_dropout: float = 0.0
    tie_embeddings: bool = False
    init_std: float = 0.02
    attention_backend: str = "auto"  # auto | flash | cudnn | efficient | math
    # Multi-latent attention (DeepSeek-V2/V3). attention_type=mla switches attention to MLA; dsa adds
    # DeepSeek-V3.2's lightning indexer and top-k sparse attention (moecore/models/dsa.py).
    attention_type: str = "gqa"  # gqa | mla | dsa
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True  # MLA checkpoints store rope dims interleaved
    # DeepSeek sparse attention (attention_type=dsa): indexer heads, their size, tokens kept per query,
    # training stage (dense_warmup: dense attention, only the indexer trained; sparse) and the KL loss weight.
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    dsa_stage: str = "sparse"  # dense_warmup | sparse
    dsa_indexer_loss_coeff: float = 1.0
    # Per-layer attention kind, one entry per layer: full_attention | linear_attention (Qwen3-Next hybrid)
    # | sliding_attention (gpt-oss: model.sliding_window on that layer only).
    layer_types: list | None = None
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    linear_conv_kernel_dim: int = 4
    linear_chunk_size: int = 64
    # Multi-token prediction (DeepSeek-V3).
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1
    # gpt-oss: a learned logit per head in the softmax denominator (attention sinks), biased expert
    # projections with the clamped SwiGLU (activation=swiglu_clamped), a learned bias on the router logits.
    attn_sinks: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_linear_bias: bool = False
    router_logit_bias: bool = False
    # Recomputation: names of modules whose activations are recomputed in backward.
    recompute_modules: list = field(default_factory=list)
    recompute_granularity: str = "none"  # none | selective | full
    fused_cross_entropy: bool = True  # chunked linear + cross-entropy, never materialising all logits
    # Activation offloading: modules (names as recompute_modules) whose saved tensors wait in host memory.
    offload_modules: list = field(default_factory=list)

    RECOMPUTE_CHOICES = ("core_attn", "mla_up_proj", "moe", "mlp", "moe_act", "norm", "shared_experts")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        _check_choice(
            "model.family",
            self.family,
            MODEL_FAMILIES,
        )
        for name in ("hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size"):
            _check_range(f"model.{name}", getattr(self, name), 1)
        _check_range("model.vocab_size", self.vocab_size, 0)
        _check_range("model.num_kv_heads", self.num_kv_heads, 1)
        if self.num_attention_heads % self.kv_heads:
            _fail(
                "model.num_kv_heads",
                self.num_kv_heads,
                f"must divide model.num_attention_heads={self.num_attention_heads}",
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            _fail(
                "model.num_attention_heads",
                self.num_attention_heads,
                f"must divide model.hidden_size={self.hidden_size} (or set model.head_dim)",
            )
        _check_choice("model.activation", self.activation, ("swiglu", "gelu", "swiglu_clamped"))
        _check_range("model.swiglu_limit", self.swiglu_limit, 0.0)
        if self.activation == "swiglu_clamped" and not self.expert_linear_bias:
            _fail(
                "model.activation",
                self.activation,
                "swiglu_clamped is gpt-oss's expert activation: set model.expert_linear_bias=true",
            )
        if self.expert_linear_bias and self.activation == "gelu":
            _fail("model.expert_linear_bias", True, "biased experts take swiglu | swiglu_clamped")
        _check_choice("model.attention_type", self.attention_type, ("gqa", "mla", "dsa"))
        _check_choice("model.dsa_stage", self.dsa_stage, ("dense_warmup", "sparse"))
        _check_range("model.dsa_indexer_loss_coeff", self.dsa_indexer_loss_coeff, 0.0)
        if self.attention_type == "dsa":
            for name in ("index_n_heads", "index_head_dim", "index_topk"):
                _check_range(f"model.{name}", getattr(self, name), 1)
            if self.q_lora_rank is None:
                _fail(
                    "model.q_lora_rank",
                    None,
                    "model.attention_type=dsa needs the q LoRA (its indexer reads the q latent)",
                )
            if not self.rope_interleave:
                _fail("model.rope_interleave", False, "model.attention_type=dsa stores RoPE channels interleaved")
            if self.index_head_dim < self.qk_rope_head_dim:
                _fail(
                    "model.index_head_dim",
                    self.index_head_dim,
                    f"must be >= model.qk_rope_head_dim={self.qk_rope_head_dim}",
                )
        _check_choice(
            "model.attention_backend", self.attention_backend, ("auto", "flash", "cudnn", "efficient", "math")
        )
        _check_range("model.partial_rotary_factor", self.partial_rotary_factor, 0.0, 1.0)
        _check_range("model.norm_eps", self.norm_eps, 0.0)
        _check_range("model.init_std", self.init_std, 0.0)
        _check_range("model.mtp_num_layers", self.mtp_num_layers, 0)
        _check_range("model.mtp_loss_scaling_factor", self.mtp_loss_scaling_factor, 0.0)
        _check_range("model.attention_dropout", self.attention_dropout, 0.0, 1.0)
        if self.sliding_window is not None:
            _check_range("model.sliding_window", self.sliding_window, 1)
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, dict) or "type" not in self.rope_scaling:
                _fail("model.rope_scaling", self.rope_scaling, "a mapping with a 'type' key (yarn | linear | default)")
            _check_choice("model.rope_scaling.type", self.rope_scaling["type"], ("yarn", "linear", "default"))
        for m in self.recompute_modules:
            _check_choice("model.recompute_modules", m, self.RECOMPUTE_CHOICES)
        for m in self.offload_modules:
            _check_choice("model.offload_modules", m, self.RECOMPUTE_CHOICES)
        _check_choice("model.recompute_granularity", self.recompute_granularity, ("none", "selective", "full"))
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                _fail(
                    "model.layer_types",
                    self.layer_types,
                    f"needs one entry per layer (model.num_layers={self.num_layers})",
                )
            for t in self.layer_types:
                _check_choice("model.layer_types", t, ("full_attention", "linear_attention", "sliding_attention"))
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                _fail(
                    "model.sliding_window", None, "set a window for the sliding_attention entries of model.layer_types"
                )


@dataclass
class MoEConfig:
    """Mixture-of-Experts options; names are Megatron-Core's `--moe-*` flags in snake_case."""

    num_experts: int = 8  # 0: no MoE layers (dense model)
    router_topk: int = 2
    router_score_function: str = "softmax"  # softmax | sigmoid
    router_pre_softmax: bool = False  # softmax over all experts before top-k (else softmax over the top-k)
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum to one
    router_topk_scaling_factor: float | None = None  # multiply the routing weights (routed_scaling_factor)
    router_num_groups: int | None = None  # group-limited routing: number of expert groups
    router_group_topk: int | None = None  # groups a token may pick from
    router_group_score: str = "max"  # max (DeepSeek-V2) | top2_sum (DeepSeek-V3)
    router_enable_expert_bias: bool = False  # aux-loss-free balancing bias, used for selection only
    router_bias_update_rate: float = 1e-3
    router_dtype: str = "fp32"  # fp32 | fp64
    router_fusion: bool = True  # one Triton kernel for scores, top-k, weights and loss sums (CUDA; see docs/moe.md)
    input_jitter_eps: float | None = None
    router_load_balancing_type: Any = "aux_loss"  # aux_loss | seq_aux_loss | global_aux_loss | none, or a list
    aux_loss_coeff: Any = 1e-2  # one float, or a list with one coefficient per balancing type
    z_loss_coeff: float | None = None
    expert_capacity_factor: float | None = None  # None: dropless
    token_drop_policy: str = "probs"  # probs | position
    pad_expert_input_to_capacity: bool = False
    ffn_hidden_size: int = 128  # per-expert FFN width
    shared_expert_intermediate_size: int | None = None  # None/0: no shared expert
    shared_expert_gate: bool = False  # sigmoid gate on the shared expert output (Qwen2-MoE)
    layer_freq: Any = 1  # int N: every N-th layer is MoE; or a list of 0/1 per layer
    first_k_dense_replace: int = 0  # the first k layers are dense (DeepSeek)
    token_dispatcher_type: str = "alltoall"  # allgather | alltoall
    grouped_gemm: bool = (
        True  # grouped GEMM where it runs (fused expert FFN kernels on CUDA); a loop of GEMMs otherwise
    )
    apply_probs_on_input: bool = False  # multiply routing probs inside the activation instead of at combine
    router_replay_mode: str = "none"  # none | record | replay: save / reuse every forward's top-k experts (RL)
    router_replay_path: str | None = None  # the file recorded to (record) or read from (replay)
    # standard | minimal: minimal keeps only the layer input, the FC1 output and the routing for backward
    # (no top-k copies of hidden-sized rows; moecore/moe/minimal.py)
    activation_memory: str = "standard"
    sync_free: bool = False  # no host synchronisation from routing to combine (CUDA-graph capturable)

    BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")

    @property
    def balancing_types(self) -> list[str]:
        t = self.router_load_balancing_type
        return list(t) if isinstance(t, (list, tuple)) else [t]

    @property
    def aux_loss_coeffs(self) -> list[float]:
        c = self.aux_loss_coeff
        if isinstance(c, (list, tuple)):
            return [float(x) for x in c]
        return [float(c)] * len(self.balancing_types)

    def is_moe_layer(self, layer_idx: int, num_layers: int) -> bool:
        """Whether decoder layer `layer_idx` (0-based) holds an MoE block."""
        if self.num_experts == 0 or layer_idx < self.first_k_dense_replace:
            return False
        if isinstance(self.layer_freq, (list, tuple)):
            return bool(self.layer_freq[layer_idx])
        return layer_idx % int(self.layer_freq) == 0

    def validate(self, num_layers: int | None = None) -> None:
        _check_range("moe.num_experts", self.num_experts, 0)
        _check_choice("moe.router_replay_mode", self.router_replay_mode, ("none", "record", "replay"))
        if self.router_replay_mode != "none" and self.num_experts == 0:
            _fail("moe.router_replay_mode", self.router_replay_mode, "needs moe.num_experts > 0 (a dense model)")
        if self.router_replay_mode != "none" and not self.router_replay_path:
            _fail("moe.router_replay_path", self.router_replay_path, f"set a file path with {self.router_replay_mode}")
        replay_files = (Path(str(self.router_replay_path)), Path(f"{self.router_replay_path}.rank-0"))
        if self.router_replay_mode == "replay" and not any(f.is_file() for f in replay_files):
            _fail("moe.router_replay_path", self.router_replay_path, "no such file to replay (record it first)")
        _check_choice("moe.activation_memory", self.activation_memory, ("standard", "minimal"))
        if not isinstance(self.sync_free, bool):
            _fail("moe.sync_free", self.sync_free, "true | false")
        if self.num_experts == 0:
            return
        _check_range("moe.router_topk", self.router_topk, 1, self.num_experts)
        _check_choice("moe.router_score_function", self.router_score_function, ("softmax", "sigmoid"))
        _check_choice("moe.router_dtype", self.router_dtype, ("fp32", "fp64"))
        _check_choice("moe.token_drop_policy", self.token_drop_policy, ("probs", "position"))
        _check_choice("moe.token_dispatcher_type", self.token_dispatcher_type, ("allgather", "alltoall"))
        _check_choice("moe.router_group_score", self.router_group_score, ("max", "top2_sum"))
        _check_range("moe.ffn_hidden_size", self.ffn_hidden_size, 1)
        _check_range("moe.router_bias_update_rate", self.router_bias_update_rate, 0.0)
        _check_range("moe.first_k_dense_replace", self.first_k_dense_replace, 0)
        if self.expert_capacity_factor is not None:
            _check_range("moe.expert_capacity_factor", self.expert_capacity_factor, 0.0)
            if self.expert_capacity_factor <= 0:
                _fail("moe.expert_capacity_factor", self.expert_capacity_factor, "must be > 0 (or null for dropless)")
        elif self.pad_expert_input_to_capacity:
            _fail("moe.pad_expert_input_to_capacity", True, "needs moe.expert_capacity_factor to be set")
        if self.input_jitter_eps is not None:
            _check_range("moe.input_jitter_eps", self.input_jitter_eps, 0.0, 1.0)
        if self.z_loss_coeff is not None:
            _check_range("moe.z_loss_coeff", self.z_loss_coeff, 0.0)
        for t in self.balancing_types:
            _check_choice("moe.router_load_balancing_type", t, self.BALANCING_TYPES)
        if len(self.aux_loss_coeffs) != len(self.balancing_types):
            _fail(
                "moe.aux_loss_coeff",
                self.aux_loss_coeff,
                f"needs one coefficient per balancing type ({len(self.balancing_types)})",
            )
        for c in self.aux_loss_coeffs:
            _check_range("moe.aux_loss_coeff", c, 0.0)
        if self.router_pre_softmax and self.router_score_function != "softmax":
            _fail("moe.router_pre_softmax", True, "only applies with moe.router_score_function=softmax")
        if self.router_score_function == "softmax" and not self.router_pre_softmax and not self.norm_topk_prob:
            _fail(
                "moe.norm_topk_prob",
                False,
                "a softmax over the top-k always sums to one; with moe.router_pre_softmax=false keep it true",
            )
        if (self.router_num_groups is None) != (self.router_group_topk is None):
            _fail(
                "moe.router_group_topk",
                self.router_group_topk,
                "set both moe.router_num_groups and moe.router_group_topk, or neither",
            )
        if self.router_num_groups is not None:
            if self.router_num_groups < 1 or self.num_experts % self.router_num_groups:
                _fail(
                    "moe.router_num_groups", self.router_num_groups, f"must divide moe.num_experts={self.num_experts}"
                )
            _check_range("moe.router_group_topk", self.router_group_topk, 1, self.router_num_groups)
            per_group = self.num_experts // self.router_num_groups
            if self.router_group_topk * per_group < self.router_topk:
                _fail(
                    "moe.router_group_topk",
                    self.router_group_topk,
                    f"selected groups hold fewer than moe.router_topk={self.router_topk} experts",
                )
        if self.shared_expert_intermediate_size is not None:
            _check_range("moe.shared_expert_intermediate_size", self.shared_expert_intermediate_size, 0)
        if isinstance(self.layer_freq, (list, tuple)):
            if num_layers is not None and len(self.layer_freq) != num_layers:
                _fail(
                    "moe.layer_freq",
                    self.layer_freq,
                    f"a list needs one 0/1 entry per layer (model.num_layers={num_layers})",
                )
            for v in self.layer_freq:
                _check_choice("moe.layer_freq", v, (0, 1))
        else:
            if not isinstance(self.layer_freq, int) or self.layer_freq < 1:
                _fail("moe.layer_freq", self.layer_freq, "an int >= 1 or a list of 0/1 per layer")


@dataclass
class ParallelConfig:
    """Parallel degrees. Data parallel is derived: world_size / (tp * pp * cp)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = True  # with tp > 1, shard activations along the sequence outside TP regions
    distributed_optimizer: bool = False
    fsdp: bool = False
    grad_bucket_mb: float = 25.0
    overlap_grad_reduce: bool = True
    backend: str = "auto"  # auto | gloo | nccl
    vpp: int = 1  # virtual pipeline stages per rank (interleaved / V-shaped schedules)
    pp_schedule: str = "1f1b"  # 1f1b | interleaved_1f1b | zero_bubble | zbv | dualpipev
    pp_layout: str | None = None  # stages in Megatron-Core notation, e.g. "Et*3|(tt|)*29,m|L"; None: even split
    cp_comm: str = "ring"  # context parallel attention exchange: ring (K/V passed around) | allgather

    PP_SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")

    def validate(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "etp", "vpp"):
            _check_range(f"parallel.{name}", getattr(self, name), 1)
        _check_choice("parallel.pp_schedule", self.pp_schedule, self.PP_SCHEDULES)
        if self.vpp > 1 and self.pp == 1:
            _fail("parallel.vpp", self.vpp, "needs parallel.pp > 1 (virtual stages are stages of a pipeline)")
        if self.pp_layout is not None and self.pp == 1:
            _fail("parallel.pp_layout", self.pp_layout, "needs parallel.pp > 1")
        _check_choice("parallel.backend", self.backend, ("auto", "gloo", "nccl"))
        _check_choice("parallel.cp_comm", self.cp_comm, ("ring", "allgather"))
        _check_range("parallel.grad_bucket_mb", self.grad_bucket_mb, 0.0)


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    name: str = "adamw"  # adamw | muon
    lr: float = 3e-3
    min_lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0  # 0: no clipping
    warmup_steps: int = 10
    schedule: str = "cosine"  # cosine | wsd | constant | linear
    wsd_decay_fraction: float = 0.2  # WSD: fraction of steps spent decaying at the end
    muon_momentum: float = 0.95
    muon_ns_steps: int = 5
    # MuonClip's QK-Clip (Kimi K2): after each step, rescale the q/k weights of every attention head whose
    # largest pre-softmax logit in the step exceeded this threshold tau (Kimi K2: 100). 0: off.
    muon_qk_clip: float = 0.0
    # With train.precision=bf16 the model's parameters are bf16 (the compute weights); these two
    # choose what the optimizer keeps (bytes per parameter in docs/train.md "Precision").
    master_weights: str = "fp32"  # fp32: an fp32 master copy is updated and cast to bf16 | bf16: update bf16 in place
    state_dtype: str = "fp32"  # fp32 | bf16: dtype of the AdamW moments (exp_avg, exp_avg_sq)

    def validate(self) -> None:
        _check_choice("optim.name", self.name, ("adamw", "muon"))
        _check_choice("optim.master_weights", self.master_weights, ("fp32", "bf16"))
        _check_choice("optim.state_dtype", self.state_dtype, ("fp32", "bf16"))
        _check_choice("optim.schedule", self.schedule, ("cosine", "wsd", "constant", "linear"))
        _check_range("optim.lr", self.lr, 0.0)
        _check_range("optim.min_lr", self.min_lr, 0.0)
        _check_range("optim.weight_decay", self.weight_decay, 0.0)
        _check_range("optim.beta1", self.beta1, 0.0, 1.0)
        _check_range("optim.beta2", self.beta2, 0.0, 1.0)
        _check_range("optim.eps", self.eps, 0.0)
        _check_range("optim.clip_grad", self.clip_grad, 0.0)
        _check_range("optim.warmup_steps", self.warmup_steps, 0)
        _check_range("optim.wsd_decay_fraction", self.wsd_decay_fraction, 0.0, 1.0)
        _check_range("optim.muon_qk_clip", self.muon_qk_clip, 0.0)


@dataclass
class DataConfig:
    """Where tokens come from. Empty `paths`: the embedded default corpus."""

    paths: list = field(default_factory=list)  # indexed dataset prefixes (.bin/.idx)
    weights: list | None = None  # blend weights, one per path
    split: str = "98,2,0"  # train,valid,test proportions
    tokenizer: str | None = None  # folder with tokenizer.json; None: the embedded tokenizer
    cache_dir: str | None = None  # index caches; None: next to the data

    def validate(self) -> None:
        if not isinstance(self.paths, list):
            _fail("data.paths", self.paths, "a list of dataset prefixes, e.g. data.paths=[a,b]")
        if self.weights is not None:
            if not isinstance(self.weights, list) or len(self.weights) != len(self.paths):
                _fail("data.weights", self.weights, f"one weight per entry of data.paths ({len(self.paths)})")
            for w in self.weights:
                if not isinstance(w, (int, float)) or w < 0:
                    _fail("data.weights", self.weights, "non-negative numbers")
            if sum(self.weights) <= 0:
                _fail("data.weights", self.weights, "at least one weight must be > 0")
        parts = str(self.split).split(",")
        try:
            nums = [float(p) for p in parts]
        except ValueError:
            nums = []
        if len(nums) != 3 or any(n < 0 for n in nums) or sum(nums) <= 0:
            _fail("data.split", self.split, "three non-negative numbers 'train,valid,test', e.g. 98,2,0")


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = 200
    seed: int = 1234
    global_batch_size: int = 16
    micro_batch_size: int = 8
    seq_length: int = 128
    run_dir: str | None = None  # None: runs/<recipe>-<timestamp>
    exit_interval: int | None = None  # stop after this step with a checkpoint; the schedule stays the full run's
    eval_interval: int = 50
    eval_iters: int = 4
    profile_steps: list | None = None  # [a, b]: torch.profiler trace for steps a..b
    # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16 (bf16 parameters and activations, fp32 master weights
    # per optim.master_weights) | fp16 (autocast over fp32 parameters, dynamic loss scaling)
    # | fp8 (bf16 as above, with the GEMMs of the modules in fp8.modules in FP8: the `fp8` section)
    precision: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    deterministic: bool = False
    cpu_threads: int | None = None  # torch intra-op threads on CPU; None: torch's default (one per core)
    on_nonfinite: str = "error"  # error (stop with one line, exit code 3) | skip (drop the step's update)
    max_skipped_steps: int = 5  # on_nonfinite=skip: stop after this many non-finite steps in a row
    stop_signals: list = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])  # save, then exit 75
    preflight_memory: str | bool = "warn"  # error | warn | off: when `moecore plan`'s estimate exceeds the GPU's memory
    cuda_graphs: str = "none"  # none | attention | moe_static | full: what each decoder layer captures (docs/train.md)

    STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")
    CUDA_GRAPHS = ("none", "attention", "moe_static", "full")

    def validate(self) -> None:
        for name in ("steps", "global_batch_size", "micro_batch_size", "seq_length", "eval_iters"):
            _check_range(f"train.{name}", getattr(self, name), 1)
        _check_range("train.eval_interval", self.eval_interval, 0)
        if self.global_batch_size % self.micro_batch_size:
            _fail(
                "train.global_batch_size",
                self.global_batch_size,
                f"must be a multiple of train.micro_batch_size={self.micro_batch_size}",
            )
        if self.exit_interval is not None:
            _check_range("train.exit_interval", self.exit_interval, 1)
        if self.profile_steps is not None:
            if (
                not isinstance(self.profile_steps, list)
                or len(self.profile_steps) != 2
                or not all(isinstance(s, int) for s in self.profile_steps)
                or self.profile_steps[0] > self.profile_steps[1]
            ):
                _fail("train.profile_steps", self.profile_steps, "two step numbers [a,b] with a <= b")
        _check_choice("train.precision", self.precision, ("auto", "fp32", "bf16", "fp16", "fp8"))
        _check_choice("train.device", self.device, ("auto", "cpu", "cuda"))
        if self.cpu_threads is not None:
            _check_range("train.cpu_threads", self.cpu_threads, 1)
        _check_choice("train.on_nonfinite", self.on_nonfinite, ("error", "skip"))
        _check_range("train.max_skipped_steps", self.max_skipped_steps, 1)
        if not isinstance(self.stop_signals, list):
            _fail("train.stop_signals", self.stop_signals, "a list, e.g. [SIGTERM,SIGUSR1] ([] for none)")
        for s in self.stop_signals:
            _check_choice("train.stop_signals", s, self.STOP_SIGNALS)
        if self.preflight_memory is False:  # YAML reads a bare `off` as false
            self.preflight_memory = "off"
        _check_choice("train.preflight_memory", self.preflight_memory, ("error", "warn", "off"))
        _check_choice("train.cuda_graphs", self.cuda_graphs, self.CUDA_GRAPHS)


@dataclass
class CheckpointConfig:
    """Saving and loading."""

    interval: int = 0  # 0: only at the end (and at train.exit_interval)
    resume: bool = False  # continue the run in train.run_dir from its latest checkpoint
    load: str | None = None  # start from this checkpoint (weights only unless resume)
    keep_last: int | None = None
    upcycle_from: str | None = None  # a dense moecore checkpoint folder (moe.num_experts=0): experts start from it
    async_save: bool | None = None  # write checkpoints in the background; None: true on GPU, false on CPU

    def validate(self) -> None:
        _check_range("checkpoint.interval", self.interval, 0)
        if self.keep_last is not None:
            _check_range("checkpoint.keep_last", self.keep_last, 1)
        if self.load is not None and not Path(self.load).exists():
            _fail("checkpoint.load", self.load, "no such checkpoint folder")
        if self.upcycle_from is not None:
            if not Path(self.upcycle_from).is_dir():
                _fail("checkpoint.upcycle_from", self.upcycle_from, "no such checkpoint folder")
            if self.load is not None:
                _fail("checkpoint.upcycle_from", self.upcycle_from, "set checkpoint.upcycle_from or checkpoint.load")


@dataclass
class LogConfig:
    """Console, metrics.jsonl, TensorBoard and Weights & Biases."""

    interval: int = 10
    tensorboard: bool = True
    wandb_project: str | None = None
    peak_tflops: float | None = None  # for MFU; None: measured or a table value on GPU
    progress: bool = True
    oom_snapshot: bool = True  # on GPU: record allocations and write a memory snapshot on out-of-memory

    def validate(self) -> None:
        _check_range("log.interval", self.interval, 1)
        if self.peak_tflops is not None:
            _check_range("log.peak_tflops", self.peak_tflops, 0.0)


FP8_MODULES = ("experts", "shared_experts", "dense_mlp", "attention")


@dataclass
class FP8Config:
    """FP8 GEMMs under `train.precision=fp8` (moecore/kernels/fp8_gemm.py; docs/train.md "FP8").

    The router, embeddings, output head and norms stay bf16/fp32; every other tensor is bf16 as in
    `train.precision=bf16` (bf16 parameters, fp32 masters in the optimizer). Scales are computed from
    the tensor being quantised at every use (current scaling): scale = amax / fp8_max per group.
    """

    recipe: str = "rowwise"  # tensorwise | rowwise | blockwise (activations 1x128, weights 128x128, as DeepSeek-V3)
    format: str = "e4m3"  # e4m3 everywhere | hybrid: e4m3 forward, e5m2 gradients
    modules: list = field(default_factory=lambda: ["experts", "shared_experts", "dense_mlp", "attention"])
    primary_weights: bool = False  # keep the weights in FP8 between steps (masters in the optimizer)
    pow2_scales: bool = False  # round every scale up to a power of two (exact rescaling; off as in DeepSeek-V3)
    emulate: bool = False  # quantise-dequantise then ordinary matmuls: FP8 numerics without FP8 GEMMs (CPU, debugging)
    fprop_fast_accum: bool = True  # forward GEMMs use Hopper's fast FP8 accumulation (Transformer Engine's default)

    RECIPES = ("tensorwise", "rowwise", "blockwise")

    @property
    def alignment(self) -> int:
        """Multiple the GEMM dimensions must be: 128 (the block) for blockwise, 16 (FP8 tensor cores) otherwise."""
        return 128 if self.recipe == "blockwise" else 16

    def validate(self) -> None:
        _check_choice("fp8.recipe", self.recipe, self.RECIPES)
        _check_choice("fp8.format", self.format, ("e4m3", "hybrid"))
        if not isinstance(self.modules, list) or not self.modules:
            _fail("fp8.modules", self.modules, "a non-empty list of " + " | ".join(FP8_MODULES))
        for m in self.modules:
            _check_choice("fp8.modules", m, FP8_MODULES)
        if self.primary_weights and self.recipe == "rowwise":
            _fail(
                "fp8.primary_weights",
                True,
                "needs fp8.recipe=tensorwise | blockwise (their weight scales also serve the transposed weight)",
            )


def check_fp8_dims(cfg: Config) -> None:
    """Refuse shapes the FP8 GEMMs cannot run: every dimension of an FP8 GEMM must be a multiple of
    `fp8.alignment` (16, or the 128 block of the blockwise recipe). Names the first field that is not."""
    m, e, f = cfg.model, cfg.moe, cfg.fp8
    a = f.alignment
    fields: list[tuple[str, int]] = []
    uses_experts = e.num_experts > 0
    if "experts" in f.modules and uses_experts:
        fields += [("model.hidden_size", m.hidden_size), ("moe.ffn_hidden_size", e.ffn_hidden_size)]
    if "shared_experts" in f.modules and uses_experts and e.shared_expert_intermediate_size:
        fields += [
            ("model.hidden_size", m.hidden_size),
            ("moe.shared_expert_intermediate_size", e.shared_expert_intermediate_size),
        ]
    if "dense_mlp" in f.modules:
        fields += [("model.hidden_size", m.hidden_size), ("model.ffn_hidden_size", m.ffn_hidden_size)]
    if "attention" in f.modules:  # projections of other widths (MLA's kv_a 576) stay bf16: moecore/models/fp8.py
        fields += [("model.hidden_size", m.hidden_size)]
    for name, value in fields:
        if value % a:
            why = "the 128 block of fp8.recipe=blockwise" if a == 128 else "FP8 GEMMs need multiples of 16"
            _fail(name, value, f"must be a multiple of {a} with train.precision=fp8 ({why})")


def _check_fp8_combinations(cfg: Config) -> None:
    """train.precision=fp8 with options whose promises FP8 does not keep yet."""
    f, e = cfg.fp8, cfg.moe
    host_counts = f.recipe == "blockwise" or f.format == "hybrid"  # these expert GEMMs read counts on the host
    if e.num_experts and e.sync_free and "experts" in f.modules and host_counts:
        _fail(
            "moe.sync_free",
            True,
            "with FP8 experts needs fp8.recipe=tensorwise | rowwise and fp8.format=e4m3 (the others pad by host counts)",
        )
    if cfg.train.cuda_graphs != "none":
        _fail("train.cuda_graphs", cfg.train.cuda_graphs, "is not supported with train.precision=fp8 yet; use none")


@dataclass
class Config:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    recipe: str = "custom"

    SECTIONS = ("model", "moe", "parallel", "optim", "data", "train", "checkpoint", "log", "fp8")

    def validate(self) -> Config:
        """Check every section and the rules that span sections; returns self."""
        self.model.validate()
        self.moe.validate(self.model.num_layers)
        self.parallel.validate()
        self.optim.validate()
        self.data.validate()
        self.train.validate()
        self.checkpoint.validate()
        self.log.validate()
        self.fp8.validate()
        m, e, p = self.model, self.moe, self.parallel
        if e.num_experts and e.num_experts % p.ep:
            _fail("parallel.ep", p.ep, f"must divide moe.num_experts={e.num_experts}")
        if m.num_attention_heads % p.tp:
            _fail("parallel.tp", p.tp, f"must divide model.num_attention_heads={m.num_attention_heads}")
        if self.optim.min_lr > self.optim.lr:
            _fail("optim.min_lr", self.optim.min_lr, f"must be <= optim.lr={self.optim.lr}")
        if m.vocab_size and m.vocab_size % p.tp:
            _fail("model.vocab_size", m.vocab_size, f"must be a multiple of parallel.tp={p.tp}")
        if self.checkpoint.upcycle_from is not None and not e.num_experts:
            _fail("checkpoint.upcycle_from", self.checkpoint.upcycle_from, "needs moe.num_experts > 0 (an MoE model)")
        if self.checkpoint.upcycle_from is not None and max(p.tp, p.ep, p.etp, p.pp) > 1:
            _fail(
                "checkpoint.upcycle_from", self.checkpoint.upcycle_from, "needs parallel.tp, ep, etp and pp = 1 for now"
            )
        if self.optim.muon_qk_clip and m.qk_norm:
            _fail("optim.muon_qk_clip", self.optim.muon_qk_clip, "needs model.qk_norm=false (normalised q/k undo it)")
        if self.optim.muon_qk_clip and m.attention_type == "dsa":
            _fail("optim.muon_qk_clip", self.optim.muon_qk_clip, "needs model.attention_type gqa or mla")
        if self.optim.state_dtype == "bf16" and self.optim.name != "adamw":
            _fail("optim.state_dtype", "bf16", "needs optim.name=adamw")
        if self.train.exit_interval is not None and self.train.exit_interval > self.train.steps:
            _fail("train.exit_interval", self.train.exit_interval, f"must be <= train.steps={self.train.steps}")
        _validate_moe_perf(self)
        if self.train.precision == "fp8":
            check_fp8_dims(self)
            _check_fp8_combinations(self)
            if self.fp8.primary_weights and self.optim.master_weights != "fp32":
                _fail(
                    "fp8.primary_weights",
                    True,
                    "needs optim.master_weights=fp32 (the FP8 weights are quantised from it)",
                )
        return self

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _validate_moe_perf(cfg: Config) -> None:
    """Cross-section rules of moe.activation_memory, moe.sync_free and train.cuda_graphs (docs/train.md)."""
    e, p, m, t = cfg.moe, cfg.parallel, cfg.model, cfg.train
    if e.num_experts and (e.activation_memory == "minimal" or e.sync_free):
        name, value = (
            ("moe.activation_memory", "minimal") if e.activation_memory == "minimal" else ("moe.sync_free", True)
        )
        if p.ep > 1 or p.etp > 1:
            _fail(name, value, "needs parallel.ep=1 and parallel.etp=1 (expert-parallel dispatch reads split sizes)")
        if m.activation != "swiglu" or m.expert_linear_bias:
            _fail(name, value, f"needs SwiGLU experts without biases (model.activation={m.activation})")
    if e.num_experts and e.activation_memory == "minimal" and e.expert_capacity_factor is not None:
        _fail("moe.activation_memory", "minimal", "needs dropless routing (moe.expert_capacity_factor unset)")
    if e.num_experts and e.sync_free and e.expert_capacity_factor is not None and not e.pad_expert_input_to_capacity:
        _fail(
            "moe.sync_free", True, "with a capacity factor needs moe.pad_expert_input_to_capacity=true (static shapes)"
        )
    if t.cuda_graphs == "none":
        return
    g = t.cuda_graphs

    def refuse(why: str) -> None:
        _fail("train.cuda_graphs", g, why + "; use train.cuda_graphs=none")

    if t.device == "cpu":
        refuse("needs a CUDA device (train.device=cpu)")
    if p.pp > 1:
        refuse("needs parallel.pp=1 (a pipeline schedule runs several forwards of a layer before their backwards)")
    if p.tp > 1 or p.cp > 1 or p.fsdp:
        refuse(
            "needs parallel.tp=1, parallel.cp=1 and parallel.fsdp=false (collectives and resharded weights in a layer)"
        )
    if t.precision == "fp16":
        refuse("needs train.precision bf16 or fp32 (fp16 autocast caches casts outside the graph)")
    if m.attention_type == "dsa" or (m.layer_types and "linear_attention" in m.layer_types):
        refuse("captures full attention layers only (model.attention_type=dsa / linear_attention layers are not)")
    if g in ("moe_static", "full") and e.num_experts:
        if "global_aux_loss" in e.balancing_types or e.router_replay_mode != "none":
            refuse("cannot capture the router with global_aux_loss or router replay (Python-side bookkeeping)")
    if g == "full" and e.num_experts:
        if not e.sync_free:
            refuse("captures the MoE layer and needs moe.sync_free=true")
        recompute_moe = "moe" in m.recompute_modules or m.recompute_granularity == "full"
        if recompute_moe and e.router_enable_expert_bias:
            refuse("with expert bias cannot recompute the MoE block (its token counts would be added twice)")


# --------------------------------------------------------------------------------------------------
# Loading recipes and applying overrides
# --------------------------------------------------------------------------------------------------


def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def recipe_path(name_or_path: str) -> Path:
    """A recipe name (shipped with the package) or a path to a YAML file."""
    p = Path(name_or_path)
    shipped = RECIPE_DIR / f"{name_or_path}.yaml"
    if p.is_dir() and shipped.is_file():  # e.g. a run folder named after its recipe: the name wins
        return shipped
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise ConfigError(f"recipe file {name_or_path!r} does not exist")
        return p
    if not shipped.is_file():
        raise ConfigError(
            f"recipe {name_or_path!r} is not a shipped recipe or a YAML file; shipped: {', '.join(list_recipes())}"
        )
    return shipped


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(name: str, value: Any, typ: Any) -> Any:
    """Convert a YAML/CLI value to the field's declared type, or raise ConfigError."""
    if typ is Any:
        return value
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(typ)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(name, value, a)
            except ConfigError as e:
                errors.append(e)
        allowed = " or ".join(getattr(a, "__name__", str(a)) for a in args)
        _fail(name, value, f"expected {allowed}")
    if typ is bool:
        if isinstance(value, bool):
            return value
        _fail(name, value, "expected true or false")
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(name, value, "expected an integer")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(name, value, "expected a number")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            _fail(name, value, "expected a string")
        return value
    if typ is list or origin is list:
        if not isinstance(value, list):
            _fail(name, value, "expected a list, e.g. [a,b]")
        return value
    if typ is dict or origin is dict:
        if not isinstance(value, dict):
            _fail(name, value, "expected a mapping, e.g. {type: yarn, factor: 4}")
        return value
    return value


def _apply_section(section_obj: Any, section: str, values: dict) -> None:
    if not isinstance(values, dict):
        raise ConfigError(f"{section}={values!r} is invalid: expected a mapping of fields")
    types_ = _field_types(type(section_obj))
    for key, val in values.items():
        if key not in types_:
            close = ", ".join(sorted(types_))
            raise ConfigError(f"{section}.{key} is not a known field; fields of {section}: {close}")
        setattr(section_obj, key, _coerce(f"{section}.{key}", val, types_[key]))


def apply_dict(cfg: Config, data: dict, source: str = "recipe") -> Config:
    """Merge a nested mapping (a parsed recipe) into cfg."""
    if data is None:
        return cfg
    if not isinstance(data, dict):
        raise ConfigError(f"{source} must be a mapping of sections ({', '.join(Config.SECTIONS)})")
    for section, values in data.items():
        if section == "recipe":
            cfg.recipe = str(values)
            continue
        if section == "description":  # a recipe's one-line summary, shown by `moecore recipes`
            continue
        if section not in Config.SECTIONS:
            raise ConfigError(
                f"{section!r} in {source} is not a config section; sections: {', '.join(Config.SECTIONS)}"
            )
        _apply_section(getattr(cfg, section), section, values or {})
    return cfg


def parse_override(text: str) -> tuple[str, str, Any]:
    """`section.field=value` -> (section, field, parsed value). Values are parsed as YAML scalars/lists."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is invalid: expected section.field=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"override {text!r} is invalid: expected section.field=value, e.g. train.steps=100")
    section, name = parts
    if section not in Config.SECTIONS:
        raise ConfigError(
            f"{section!r} in override {text!r} is not a config section; sections: {', '.join(Config.SECTIONS)}"
        )
    try:
        value = _yaml_load(raw) if raw.strip() != "" else None
    except yaml.YAMLError:
        value = raw  # fall back to the raw string; the field's type check decides
    if isinstance(value, list):
        # `[a,b]` parses as strings already; keep numbers as numbers.
        value = [v for v in value]
    return section, name, value


def load_config(recipe: str | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Build a Config from a recipe (name or path; None: the default tiny recipe) and overrides."""
    name = recipe or DEFAULT_RECIPE
    path = recipe_path(name)
    try:
        data = _yaml_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"recipe file {str(path)!r} is not valid YAML{where}") from None
    except OSError as e:
        raise ConfigError(f"recipe file {str(path)!r} cannot be read: {e.strerror}") from None
    cfg = Config(recipe=path.stem)
    apply_dict(cfg, data or {}, source=str(path))
    for ov in overrides:
        section, fname, value = parse_override(ov)
        _apply_section(getattr(cfg, section), section, {fname: value})
    return cfg


def config_from_dict(data: dict) -> Config:
    """Rebuild a Config from `Config.to_dict()` output (e.g. a run folder's config.yaml)."""
    cfg = Config()
    apply_dict(cfg, data)
    return cfg
