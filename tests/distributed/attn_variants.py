"""Tiny multi-latent attention and gated DeltaNet variants of dist_parity's model, for the tensor-parallel tests.

- `mla_config`: DeepSeek-V3 style MLA (optionally with the q LoRA) and one MTP layer;
- `deltanet_config`: Qwen3-Next style, gated DeltaNet layers (2 key heads, 4 value heads, chunk 3, so the
  sequence of 8 is not a multiple of the chunk) around one gated GQA layer with q/k norms, and one MTP layer.
- `oss_config`: gpt-oss (attention sinks, sliding windows, biases, biased experts);
- `dsa_config`: DeepSeek-V3.2 sparse attention (MLA + lightning indexer), sparse or dense_warmup stage;
- `glm5_config`: GLM-5's variant of it (interleaved indexer RoPE; layer 1 reuses the top-k of layer 0);
- `minimax_config`: MiniMax-M2 (q/k norms over the whole projection, partial RoPE, sigmoid router with expert bias).
`with_indexer_in_aux` wraps MoETransformer.forward so that the DSA indexers' loss joins `aux_loss`, which the
harness's objective scales as the training loop scales it (moecore/train/loop.py); the harness adds the MTP
loss itself.
"""

from __future__ import annotations

from dist_parity import tiny_config

from moecore.config import Config


def mla_config(q_lora: bool = True, mtp: bool = True) -> Config:
    cfg = tiny_config(token_dispatcher_type="alltoall")
    m = cfg.model
    m.attention_type, m.num_kv_heads, m.kv_lora_rank = "mla", 4, 8
    m.q_lora_rank = 16 if q_lora else None
    m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.rope_interleave = 8, 4, 8, True
    m.mtp_num_layers, m.mtp_loss_scaling_factor = (1, 0.3) if mtp else (0, 0.0)
    return cfg


def dsa_config(stage: str = "sparse") -> Config:
    """DeepSeek-V3.2's sparse attention on MLA: 2 indexer heads, top-3 of a sequence of 8, without MTP."""
    cfg = mla_config(mtp=False)
    m = cfg.model
    m.attention_type, m.dsa_stage = "dsa", stage
    m.index_n_heads, m.index_head_dim, m.index_topk = 2, 8, 3
    return cfg


def glm5_config() -> Config:
    """GLM-5's sparse attention: the indexer rotates interleaved pairs; layers full, shared, full."""
    cfg = dsa_config()
    cfg.model.indexer_rope_interleave, cfg.model.indexer_types = True, ["full", "shared", "full"]
    return cfg


def deltanet_config() -> Config:
    cfg = tiny_config(token_dispatcher_type="alltoall")
    m = cfg.model
    m.layer_types = ["linear_attention", "full_attention", "linear_attention"]
    m.head_dim, m.partial_rotary_factor, m.qk_norm, m.attn_output_gate = 8, 0.5, True, True
    m.norm_zero_centered = True
    m.linear_num_key_heads, m.linear_num_value_heads = 2, 4
    m.linear_key_head_dim, m.linear_value_head_dim = 8, 8
    m.linear_conv_kernel_dim, m.linear_chunk_size = 4, 3
    m.mtp_num_layers, m.mtp_loss_scaling_factor = 1, 0.3
    # With dist_parity's init_std 0.1 this tiny DeltaNet model is ill-conditioned under the harness's AdamW
    # steps: a relative 1e-7 perturbation of the initial weights moves the third step's grad norm by ~3e-4 in
    # the one-process run itself (ep2, without TP, differs as much). At 0.02 the same perturbation moves it ~6e-6.
    m.init_std = 0.02
    return cfg


def oss_config() -> Config:
    """gpt-oss's layers: attention sinks, alternating sliding (window 3) / full layers, q/k/v/o biases, router
    logit bias, biased experts with the clamped SwiGLU."""
    cfg = tiny_config(token_dispatcher_type="alltoall")
    m = cfg.model
    m.layer_types, m.sliding_window = ["sliding_attention", "full_attention", "sliding_attention"], 3
    m.qkv_bias = m.attn_out_bias = m.attn_sinks = True
    m.activation, m.swiglu_limit = "swiglu_clamped", 0.5
    m.expert_linear_bias = m.router_logit_bias = True
    cfg.moe.first_k_dense_replace, cfg.moe.shared_expert_intermediate_size = 0, None
    cfg.moe.router_pre_softmax = False
    return cfg


def minimax_config() -> Config:
    """MiniMax-M2's layers: q/k RMSNorm over all heads' channels at once (its mean of squares spans the TP ranks'
    heads), half of each head rotated, head_dim 8 != hidden/heads; every layer MoE with the sigmoid router and expert
    bias, no shared expert."""
    cfg = tiny_config(token_dispatcher_type="alltoall")
    m, e = cfg.model, cfg.moe
    m.head_dim, m.partial_rotary_factor, m.qk_norm, m.qk_norm_scope = 8, 0.5, True, "projection"
    e.first_k_dense_replace, e.shared_expert_intermediate_size = 0, None
    e.router_score_function, e.router_pre_softmax, e.router_enable_expert_bias = "sigmoid", False, True
    return cfg


def with_indexer_in_aux(forward):
    """MoETransformer.forward, with the DSA indexers' loss added into ModelOutput.aux_loss."""

    def folded(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        extra = out.indexer_loss
        if extra is not None and extra.requires_grad:
            out.aux_loss = extra if out.aux_loss is None or not out.aux_loss.requires_grad else out.aux_loss + extra
        return out

    return folded


def v4_config(num_layers: int = 3) -> Config:
    """DeepSeek-V4's layers: sliding (window 3), heavily compressed (every 4 tokens) and compressed sparse (every 2,
    the indexer's top-2) attention, then sliding layers; 2 hyper-connection streams, the sqrt-softplus router with
    expert bias, the first layer hash-routed, clipped-SwiGLU experts and shared expert, every layer MoE."""
    cfg = tiny_config(token_dispatcher_type="alltoall", first_k_dense_replace=0)
    m, e = cfg.model, cfg.moe
    m.num_layers = num_layers
    m.attention_type, m.num_kv_heads, m.head_dim, m.q_lora_rank, m.qk_rope_head_dim = "compressed", 1, 8, 8, 4
    kinds = ["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"]
    m.layer_types = (kinds + ["sliding_attention"] * num_layers)[:num_layers]
    m.sliding_window, m.csa_compress_rate, m.hca_compress_rate, m.o_groups, m.o_lora_rank = 3, 2, 4, 2, 8
    m.index_n_heads, m.index_head_dim, m.index_topk, m.attn_sinks, m.hc_mult = 4, 8, 2, True, 2
    m.activation, m.swiglu_limit = "swiglu_clipped", 0.5
    e.router_score_function, e.router_pre_softmax, e.router_enable_expert_bias = "sqrtsoftplus", False, True
    e.router_topk_scaling_factor, e.num_hash_layers = 1.5, 1
    return cfg
