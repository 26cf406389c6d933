"""The `model` section: the transformer's shape (attention kinds, norms, RoPE, MTP, recomputation)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moecore.config.errors import _check_choice, _check_range, _fail

MODEL_FAMILIES = (
    "moecore", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "deepseek_v32", "qwen3_next",
    "glm4_moe", "gpt_oss", "qwen3_5_moe_text", "glm4_moe_lite", "minimax_m2", "glm_moe_dsa", "olmoe",
    "dots1", "deepseek_v4",
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
    # swiglu | gelu | swiglu_clamped (gpt-oss experts) | swiglu_clipped (DeepSeek-V4: gate <= swiglu_limit, up
    # within +-swiglu_limit, then the plain SwiGLU; experts and shared experts)
    activation: str = "swiglu"
    norm_eps: float = 1e-6
    norm_zero_centered: bool = False  # RMSNorm weight stored as an offset from 1 (Qwen3-Next)
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # e.g. {type: yarn, factor: 40, original_max_position_embeddings: 4096, ...}
    partial_rotary_factor: float = 1.0
    qkv_bias: bool = False
    attn_out_bias: bool = False  # bias on o_proj
    qk_norm: bool = False  # RMSNorm on q and k before RoPE (Qwen3: per head; see qk_norm_scope)
    qk_norm_scope: str = "head"  # head: one norm per head (Qwen3) | projection: over all heads at once (MiniMax-M2)
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
    # DeepSeek-V4 (attention_type=compressed, moecore/models/compressed_attention.py): one shared key/value head,
    # a sliding window over the layer's own tokens plus compressed entries: per layer (layer_types) none
    # (sliding_attention), one per csa_compress_rate tokens picked by a lightning indexer (compressed_sparse_attention)
    # or one per hca_compress_rate tokens, all visible (heavily_compressed_attention). Compressed layers rotate with
    # compress_rope_theta / compress_rope_scaling. The output projection is grouped: o_groups blocks of heads, each to
    # o_lora_rank channels, then one linear to the hidden size. Learned attention sinks on every layer.
    csa_compress_rate: int = 4
    hca_compress_rate: int = 128
    compress_rope_theta: float = 160000.0
    compress_rope_scaling: dict | None = None
    o_groups: int = 8
    o_lora_rank: int = 1024
    # the attention's kernel on GPUs: flex (torch's flex_attention, compiled, with a block mask) | sparse (moecore's
    # sparse MLA kernel over each query's window and picked entries; not yet timed on a GPU, docs/benchmarks.md)
    compressed_attention_kernel: str = "flex"
    # Manifold-constrained hyper-connections (DeepSeek-V4, moecore/models/hyper_connections.py): hc_mult residual
    # streams mixed by per-token weights, the mixing matrix made doubly stochastic by hc_sinkhorn_iters Sinkhorn
    # iterations. 1: the plain residual.
    hc_mult: int = 1
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # DeepSeek sparse attention (attention_type=dsa): indexer heads, their size, tokens kept per query,
    # training stage (dense_warmup: dense attention, only the indexer trained; sparse) and the KL loss weight.
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    dsa_stage: str = "sparse"  # dense_warmup | sparse
    dsa_indexer_loss_coeff: float = 1.0
    # GLM-5 (glm_moe_dsa): the indexer's RoPE channels in interleaved pairs (DeepSeek-V3.2's are half-split), and per
    # layer whether it runs its own indexer (full) or reuses the top-k of the last full layer before it (shared,
    # no indexer weights). None: every layer full.
    indexer_rope_interleave: bool = False
    indexer_types: list | None = None
    # Per-layer attention kind, one entry per layer: full_attention | linear_attention (Qwen3-Next hybrid)
    # | sliding_attention (gpt-oss: model.sliding_window on that layer only); with attention_type=compressed:
    # sliding_attention | compressed_sparse_attention | heavily_compressed_attention.
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
        _check_choice("model.activation", self.activation, ("swiglu", "gelu", "swiglu_clamped", "swiglu_clipped"))
        _check_range("model.swiglu_limit", self.swiglu_limit, 0.0)
        if self.activation == "swiglu_clamped" and not self.expert_linear_bias:
            _fail(
                "model.activation",
                self.activation,
                "swiglu_clamped is gpt-oss's expert activation: set model.expert_linear_bias=true",
            )
        if self.expert_linear_bias and self.activation not in ("swiglu", "swiglu_clamped"):
            _fail("model.expert_linear_bias", True, "biased experts take swiglu | swiglu_clamped")
        _check_choice("model.qk_norm_scope", self.qk_norm_scope, ("head", "projection"))
        if self.qk_norm_scope == "projection" and not self.qk_norm:
            _fail("model.qk_norm_scope", self.qk_norm_scope, "needs model.qk_norm=true")
        _check_choice("model.attention_type", self.attention_type, ("gqa", "mla", "dsa", "compressed"))
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
        self._validate_indexer_types()
        self._validate_compressed()
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
            kinds = ("full_attention", "linear_attention", "sliding_attention")
            if self.attention_type == "compressed":
                kinds = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
            for t in self.layer_types:
                _check_choice("model.layer_types", t, kinds)
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                _fail(
                    "model.sliding_window", None, "set a window for the sliding_attention entries of model.layer_types"
                )

    def _validate_compressed(self) -> None:
        """DeepSeek-V4's attention (attention_type=compressed) and hyper-connections."""
        _check_range("model.hc_mult", self.hc_mult, 1)
        _check_range("model.hc_sinkhorn_iters", self.hc_sinkhorn_iters, 1)
        _check_range("model.hc_eps", self.hc_eps, 0.0)
        if self.attention_type != "compressed":
            return
        for name in ("csa_compress_rate", "hca_compress_rate", "o_groups", "o_lora_rank", "index_n_heads",
                     "index_head_dim", "index_topk"):  # fmt: skip
            _check_range(f"model.{name}", getattr(self, name), 1)
        _check_choice("model.compressed_attention_kernel", self.compressed_attention_kernel, ("flex", "sparse"))
        if self.q_lora_rank is None:
            _fail("model.q_lora_rank", None, "model.attention_type=compressed needs the q LoRA rank")
        if self.sliding_window is None:
            _fail("model.sliding_window", None, "model.attention_type=compressed needs the local window")
        if self.layer_types is None:
            _fail("model.layer_types", None, "model.attention_type=compressed needs one attention kind per layer")
        heads = self.num_attention_heads
        if heads % self.o_groups:
            _fail("model.o_groups", self.o_groups, f"must divide model.num_attention_heads={heads}")
        rope = self.qk_rope_head_dim
        if rope % 2 or rope > min(self.resolved_head_dim, self.index_head_dim):
            _fail("model.qk_rope_head_dim", rope, "must be even and at most model.head_dim and model.index_head_dim")

    def _validate_indexer_types(self) -> None:
        """GLM-5's per-layer indexer kinds and indexer RoPE layout (DSA layers only)."""
        for name in ("indexer_types", "indexer_rope_interleave"):
            value = getattr(self, name)
            if value not in (None, False) and self.attention_type != "dsa":
                _fail(f"model.{name}", value, "needs model.attention_type=dsa (it describes the DSA indexers)")
        types = self.indexer_types
        if types is None:
            return
        if not isinstance(types, list) or len(types) != self.num_layers:
            _fail("model.indexer_types", types, f"needs one entry per layer (model.num_layers={self.num_layers})")
        for t in types:
            _check_choice("model.indexer_types", t, ("full", "shared"))
        if types[0] != "full":
            _fail("model.indexer_types", types, "the first layer must be full (a shared layer reuses an earlier top-k)")
