"""Activation bytes one micro-batch leaves saved for the backward pass, per decoder layer and per module.

Derived from what moecore's modules save (moecore/models, moecore/moe, moecore/kernels), for the
GPU path (fused kernels; `fused` False describes the CPU / unfused ops). Legend: T tokens of the
micro-batch on this rank (micro_batch_size x seq_length / cp), H hidden, b activation bytes, tp/ep/
etp the degrees; under tensor parallel the norms see sequence shards (T / tp), attention and dense
MLP internals see T tokens and heads / tp, an MoE layer routes T / tp tokens. N = routed rows an
expert rank holds: T/tp x top-k x etp, times the load-imbalance margin when ep > 1.

| module key | saved tensors | recomputation that drops it |
|---|---|---|
| norm_in | the norm's input (the residual stream) and 1/rms (fp32) | full |
| norm_out | the norm's output kept by the next projections / router / shared experts | norm (not for attention under tp > 1: its consumers keep the gathered copy) |
| qk_norm | q and k projections (inputs of the norms) and 1/rms (fp32; per head, or per token with `qk_norm_scope=projection`; under tp > 1 that norm is unfused and keeps two fp32 tensors instead of the input) | full |
| core_attn | SDPA's q, k and v (k, v expanded to every query head), output and log-sum-exp | core_attn (keeps q, k, v unexpanded) |
| mla_up | MLA's up-projected q, k and the key/value projection v is a view of | mla_up_proj |
| mla_latent | MLA's latent (its whole down-projection) and its normed copy; the q LoRA pair | full |
| attn_out | the copy of the attention output that o_proj keeps | full |
| sparse_attn | DSA, sparse stage: q_b_proj's output, the absorbed q~ / kv~, top-k, output and lse (`dsa_modules`) | full |
| indexer | DSA: the lightning indexer's k_norm input, q, k, w and its KL loss's target and masks (`dsa_modules`) | full |
| mlp | dense SwiGLU: gate, up, silu(gate), product (GeLU: up and gelu) | mlp |
| router | router logits (fp32), top-k indices (int64), valid mask | moe |
| permute | permutation indices; with probabilities applied at combine also the expert outputs | moe |
| experts | expert input rows [N, H], w13 output [N, 2F/etp], probabilities (FP8 blockwise: N padded per expert to 128); unfused: activation intermediates | moe (moe_act: the intermediates) |
| (minimal) | `moe.activation_memory=minimal`: permute = order, inverse, probabilities; experts = w13 output [N, 2F] | moe |
| (chunked) | `moe.activation_memory=chunked`: permute as minimal; experts = nothing (FC1 is computed again); under ep/etp > 1 permute as standard, experts = the received rows (and probabilities) | moe |
| shared_experts | the shared expert MLP's intermediates | shared_experts, moe |

With full recomputation a layer keeps only its input (T/tp x H x b). `model.offload_modules` moves the
keys of `OFFLOADS` to host memory; the memory model keeps two layers' worth of them on the GPU (the
group being consumed and the one prefetched). The numbers were checked
against the H200 measurements of benchmarks/recompute_memory.py (docs/benchmarks.md) and are
checked again by benchmarks/plan_accuracy.py.

DSA (DeepSeek-V3.2, GLM-5) layers (`dsa_modules`): `indexer` is what the lightning indexer's projection and
KL loss keep (fp32; the loss's target is per query its top-k keys, or every visible key in dense_warmup), absent from
GLM-5's shared layers; in the sparse stage `sparse_attn` (the absorbed form and the sparse attention: the Triton
kernel's inputs on GPUs, the PyTorch reference's gathered rows on the CPU) replaces mla_up and core_attn, which
no selective option recomputes there. Not counted: the kernels' workspaces, the rotary tables, dense_warmup's
freezing (counted as MLA plus the indexer, an upper bound). Attention with sinks (gpt-oss) is counted as plain SDPA.

DeepSeek-V4 (`compressed_modules`, `hyper_modules`): estimated from what the eager PyTorch implementation keeps
(moecore/models/compressed_attention.py, hyper_connections.py), not yet checked against GPU measurements. Its
attention keeps fp32 probabilities over all S local keys plus the layer's S / m compressed entries per head and
query (`core_attn`, dropped by core_attn recomputation down to q and the keys); each hyper-connection keeps the n
streams in fp32 twice (its norm's input and the projection's) and in the activation dtype twice (collapse, merge).
"""

from __future__ import annotations

from dataclasses import dataclass

from moecore.config import Config
from moecore.plan.layout import Layout

FUSED_CE_CHUNK = 4096  # rows of moecore.kernels.cross_entropy.linear_cross_entropy's chunk


@dataclass(frozen=True)
class ActContext:
    """The facts about a run the activation model needs."""

    tokens: int  # T: micro_batch_size x seq_length / cp
    act_bytes: int  # b
    residual_bytes: int  # element size of the residual stream (4 under autocast on fp32 parameters)
    fused: bool  # GPU kernels (fused router, permute, expert FFN, cross-entropy)
    imbalance: float  # margin on routed rows per expert rank when ep > 1
    # FP8 recipes that pad every expert GEMM's rows to their alignment (fp8.padding=all: blockwise's 128): the
    # alignment, else 0 (rowwise pads only its weight-gradient operands, which it does not keep)
    expert_row_alignment: int = 0
    # whether that padding is the fixed bound (GEMMs that read their offsets on the GPU) or exact (host counts)
    expert_row_bound: bool = False


def _recompute_set(layout: Layout) -> set[str]:
    if layout.recompute_granularity == "selective":
        return set(layout.recompute_modules)
    return set()


def attention_modules(cfg: Config, layer: int, layout: Layout, c: ActContext) -> dict[str, float]:
    """Saved bytes of one layer's attention half (norm, projections, attention), by module key."""
    m = cfg.model
    T, b, tp = c.tokens, c.act_bytes, layout.tp
    h = m.hidden_size
    out = {"norm_in": T / tp * (h * c.residual_bytes + 4), "norm_out": T * h * b}
    if m.layer_types is not None and m.layer_types[layer] == "linear_attention":
        kd = m.linear_num_key_heads * m.linear_key_head_dim // tp  # this rank's heads
        vd = m.linear_num_value_heads * m.linear_value_head_dim // tp
        # projections, conv input/output, q/k/v after the conv and norm, gate z, rule output, gated norm
        out["core_attn"] = T * b * (2 * (2 * kd + 2 * vd) + 2 * (2 * kd + vd) + 3 * vd)
        if layout.cp > 1:  # the identity-start pass's zero values and read-out qt, fp32 (parallel/context_deltanet.py)
            out["core_attn"] += 2 * T * m.linear_num_value_heads * m.linear_key_head_dim * 4
        out["attn_out"] = T * vd * b
        return out
    if m.attention_type == "compressed":
        out.update(compressed_modules(cfg, layer, c, tp))
        return out
    if m.attention_type in ("mla", "dsa"):
        n, dn, dr, dv = m.num_attention_heads // tp, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        # the latents are those of the whole sequence on every TP rank; the heads are this rank's
        lat = T * (m.kv_lora_rank + dr) * b + T * 4 + T * m.kv_lora_rank * b
        if m.q_lora_rank:
            lat += 2 * T * m.q_lora_rank * b + T * 4
        out["mla_latent"] = lat
        up = T * n * (dn + dr) * b * 2 + T * n * (dn + dv) * b
        if m.attention_backend == "flash" and dv != dn + dr:
            up += T * n * (dn + dr) * b
        out["mla_up"] = up
        out["core_attn"] = T * n * dv * b + T * n * 4
        out["attn_out"] = T * n * dv * b
        if m.attention_type == "dsa":
            out.update(dsa_modules(cfg, layer, layout, c))
            out = {k: v for k, v in out.items() if v is not None}
        return out
    hd = m.resolved_head_dim
    nh, nkv = m.num_attention_heads // tp, m.kv_heads // tp
    kv_saved = nh if nkv < nh else nkv  # grouped-query keys/values are expanded before SDPA
    if m.qk_norm and m.qk_norm_scope == "projection":
        # one 1/rms per token for q and one for k; under tp > 1 (tensor_parallel.sharded_rms_norm, autograd ops)
        # the input in fp32 and the fp32 normalised values instead of the input
        per_value = b if tp == 1 else 8
        out["qk_norm"] = T * (nh + nkv) * hd * per_value + 2 * T * 4
    elif m.qk_norm:
        out["qk_norm"] = T * (nh + nkv) * (hd * b + 4)
    out["core_attn"] = T * hd * b * (2 * nh + 2 * kv_saved) + T * nh * 4
    out["attn_out"] = T * nh * hd * b
    if m.attn_output_gate:
        out["attn_gate"] = 2 * T * nh * hd * b
    return out


def _compressed_rate(cfg: Config, layer: int) -> int:
    """m of a DeepSeek-V4 layer: tokens per compressed entry (0: a sliding layer, no entries)."""
    m = cfg.model
    kind = m.layer_types[layer]
    if kind == "sliding_attention":
        return 0
    return m.csa_compress_rate if kind == "compressed_sparse_attention" else m.hca_compress_rate


def compressed_modules(cfg: Config, layer: int, c: ActContext, tp: int = 1) -> dict[str, float]:
    """A DeepSeek-V4 attention layer, T tokens of this rank (whole sequences of S under tp; S / cp of them under cp,
    with the keys of the whole sequence), n heads of D on this rank (its share under tp), K = S + S // m keys:
    projections: q_a's output and q latent, q_b's output, its fp32 copy and normed q, kv_proj's output and kv
                 T (2 q_lora b + n D (2 b + 8) + 3 D b)
    core_attn:   fp32 probabilities and their cast, the visibility mask, the output before and after the
                 de-rotation   T (n K (4 + b) + K + 2 n D b)
    compressor:  the pooled series and their fp32 gates and softmax (w = 2 D on CSA layers, D on HCA layers),
                 and the indexer's the same at its head dim (no gradient: nothing kept)   T 3 w (b + 4) / ...
    attn_out:    o_a's and o_b's inputs   T (n D + o_groups o_lora_rank) b"""
    m = cfg.model
    T, b = c.tokens, c.act_bytes
    n, d, s = m.num_attention_heads // tp, m.resolved_head_dim, cfg.train.seq_length
    rate = _compressed_rate(cfg, layer)
    keys = s + (s // rate if rate else 0)
    out = {
        "mla_latent": T * (2 * m.q_lora_rank * b + n * d * (2 * b + 8) + 3 * d * b),
        "core_attn": T * (n * keys * (4 + b) + keys + 2 * n * d * b),
        "attn_out": T * (n * d + m.o_groups // tp * m.o_lora_rank) * b,
    }
    if rate:
        width = 2 * d if m.layer_types[layer] == "compressed_sparse_attention" else d
        out["indexer"] = T * width * (b + 8)
    return out


def hyper_modules(cfg: Config, c: ActContext) -> float:
    """One hyper-connection (DeepSeek-V4, n = hc_mult streams): the streams in fp32 for the norm and the projection,
    in the activation dtype for the collapse and the merge, and its fp32 weights: T (n H (8 + 2 b) + 4 n (n + 2))."""
    n, h = cfg.model.hc_mult, cfg.model.hidden_size
    return c.tokens * (n * h * (8 + 2 * c.act_bytes) + 4 * n * (n + 2))


def dsa_modules(cfg: Config, layer: int, layout: Layout, c: ActContext) -> dict[str, float | None]:
    """What a DSA layer (moecore/models/dsa.py) saves beyond or instead of MLA's keys (None: the MLA key is gone).

    n heads of this rank, D = kv_lora_rank + dr, r = kv_lora_rank, K = min(index_topk, S) keys per query, S the
    sequence (context parallel refuses DSA), nh / d the indexer's heads / head dim, s = 4 bytes per LayerNorm
    statistic on GPUs (b on the CPU). Indexer (layers with one, not GLM-5's shared ones; every rank runs it
    whole, on the gathered sequence), in fp32 apart from k_norm's input:
      projection: k_norm's input and statistics                          T (d b + 2 s)
      KL loss, its scores computed again in backward (dsa.py `recomputed_kl`): q, k and w, and per query
      block its target, mask and (sparse) clamped top-k
        sparse:        T (4 nh (d + 1) + 4 d + 13 K)
        dense_warmup:  T (4 nh (d + 1) + 4 d + 4 S) + S^2 (the causal mask, shared by the batch)
    Sparse stage, main attention in the absorbed form (`sparse_attn`, replaces mla_up and core_attn; no selective
    option recomputes it): q_b_proj's output T n (dn + dr) b and the einsum's copy of the latent output T n r b,
    plus on GPUs the Triton kernel's q~, kv~, top-k, output and lse, T (n D b + D b + 8 K + n r b + 4 n) (a shared
    layer's top-k is its full layer's tensor: not counted again), on the CPU the PyTorch reference's
    T (9 K + 4 K D + 4 n D + 8 n K + 4 n), and 4 T K dv more below fp32. The normed latent is not kept
    (mla_latent loses T r b). dense_warmup runs dense MLA: counted as MLA plus the indexer, an upper bound, since
    the warm-up freezes everything but the indexers (moecore/models/dsa.py `freeze_all_but_indexers`)."""
    m = cfg.model
    T, b, tp = c.tokens, c.act_bytes, layout.tp
    n, dn, dr, dv, r = m.num_attention_heads // tp, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    nh, d, s = m.index_n_heads, m.index_head_dim, cfg.train.seq_length
    k, stat = min(m.index_topk, s), 4 if c.fused else b
    has_indexer = m.indexer_types is None or m.indexer_types[layer] != "shared"
    out: dict[str, float | None] = {}
    if has_indexer:
        proj = T * (d * b + 2 * stat)
        qkw = T * (4 * nh * (d + 1) + 4 * d)
        if m.dsa_stage == "dense_warmup":
            out["indexer"] = proj + qkw + T * 4 * s + s * s
        else:
            out["indexer"] = proj + qkw + T * 13 * k
    if m.dsa_stage == "dense_warmup":
        return out
    big_d = r + dr
    attn = T * n * (dn + dr) * b + T * n * r * b
    if c.fused:
        attn += T * (n * big_d * b + big_d * b + n * r * b + 4 * n) + (T * 8 * k if has_indexer else 0)
    else:
        attn += T * (9 * k + 4 * k * big_d + 4 * n * big_d + 8 * n * k + 4 * n) + (4 * T * k * dv if b != 4 else 0)
    out["sparse_attn"] = attn
    # the latent (its norm's input) with 1/rms, the q LoRA pair with 1/rms: the normed latent is no GEMM's input
    out["mla_latent"] = T * big_d * b + T * 4 + 2 * T * m.q_lora_rank * b + T * 4
    out["mla_up"] = out["core_attn"] = None
    return out


def routed_rows(cfg: Config, layout: Layout, c: ActContext) -> float:
    """N: routed rows one expert rank holds for a micro-batch (with the imbalance margin under ep > 1)."""
    rows = c.tokens / layout.tp * cfg.moe.router_topk * layout.etp
    return rows * (c.imbalance if layout.ep > 1 else 1.0)


def padded_rows(cfg: Config, layout: Layout, c: ActContext, n: float) -> float:
    """Rows of the expert FFN's operands once FP8 padding rounds each local expert's rows up to the alignment
    a (moecore/kernels/fp8_grouped.py pad_plan): the fixed bound N + E (a - 1), rounded up to a, where the GEMMs
    read their offsets on the GPU (no host sync: torch's grouped GEMM, rowwise's Triton kernels); otherwise the exact
    padding (blockwise, and the CPU), (a - 1) / 2 rows per expert on average."""
    a = c.expert_row_alignment
    if not a:
        return n
    experts = cfg.moe.num_experts // layout.ep
    if c.expert_row_bound:
        return -(-(n + experts * (a - 1)) // a) * a
    return n + experts * (a - 1) / 2


def expert_memory_mode(cfg: Config, layout: Layout, c: ActContext) -> str:
    """moe.activation_memory as the MoE layer runs it (moecore/moe/layer.py `_minimal_memory`,
    `_chunked_sorted_rows`): dropless SwiGLU grouped experts in bf16 on GPUs (any dtype on CPU), not FP8
    experts; minimal needs one expert rank, chunked also runs behind expert (tensor) parallel dispatch."""
    mode = layout.activation_memory or cfg.moe.activation_memory
    one_rank = layout.ep == 1 and layout.etp == 1
    runs = low_memory_experts_run(cfg) and (one_rank or mode == "chunked") and (c.act_bytes == 2 or not c.fused)
    return mode if runs else "standard"


def low_memory_experts_run(cfg: Config) -> bool:
    """The config's part of where moe.activation_memory=minimal | chunked run (moecore/moe/layer.py
    `_low_memory_rows`): dropless SwiGLU grouped experts (gpt-oss's biased ones too), not FP8 experts (they run their
    own Function)."""
    e = cfg.moe
    fp8_experts = cfg.train.precision == "fp8" and "experts" in cfg.fp8.modules
    gated = cfg.model.activation != "gelu"  # SwiGLU and its clipped / clamped (biased) forms
    return gated and e.grouped_gemm and e.expert_capacity_factor is None and not fp8_experts


def ffn_modules(cfg: Config, is_moe: bool, layout: Layout, c: ActContext) -> dict[str, float]:
    """Saved bytes of one layer's feed-forward half (norm, dense MLP or MoE block), by module key."""
    m, e = cfg.model, cfg.moe
    T, b, tp = c.tokens, c.act_bytes, layout.tp
    h = m.hidden_size
    gated = m.activation != "gelu"  # gate and up projections (SwiGLU and its clamped / clipped forms)
    out = {"norm_in": T / tp * (h * c.residual_bytes + 4)}
    if not is_moe:
        out["norm_out"] = T * h * b
        out["mlp"] = (4 if gated else 2) * T * m.ffn_hidden_size / tp * b
        return out
    tm = T / tp
    out["norm_out"] = tm * h * b
    k, n_exp = e.router_topk, e.num_experts
    fused_router = c.fused and tp == 1 and e.router_fusion
    out["router"] = tm * n_exp * 4 + tm * k * 8 + tm if fused_router else 3 * tm * n_exp * 4 + tm * k * 12
    n = routed_rows(cfg, layout, c)
    f = e.ffn_hidden_size // layout.etp
    perm = tm * k * 16 + (n * 8 if layout.ep > 1 else 0)
    if not e.apply_probs_on_input:
        perm += n * h * b + n * 4  # unpermute keeps the expert outputs and probabilities to weight them
    out["permute"] = perm
    memory_mode = expert_memory_mode(cfg, layout, c)
    if memory_mode == "chunked" and (layout.ep > 1 or layout.etp > 1):  # chunked.py `chunked_sorted_rows`
        # the rows this rank received (its experts' input) and their probabilities: nothing per FFN column
        out["experts"] = n * h * b + (n * 4 if e.apply_probs_on_input else 0)
        out["moe_act"] = 0.0
    elif memory_mode != "standard":  # moecore/moe/minimal.py, chunked.py
        out["permute"] = n * (8 + 8 + 4)  # sort order, its inverse, per-row probability (x is norm_out)
        out["experts"] = n * 2 * f * b if memory_mode == "minimal" else 0.0  # the w13 output (minimal)
        out["moe_act"] = 0.0
    elif gated and c.fused and e.grouped_gemm and b == 2:  # the fused expert FFN (bf16, GPUs)
        p = padded_rows(cfg, layout, c, n)  # FP8 with every GEMM padded keeps x and h padded (n otherwise)
        out["experts"] = p * h * b + p * 2 * f * b + p * 4
        if m.expert_linear_bias:  # gpt-oss: each row's expert index for its biases
            out["experts"] += n * 8
        out["moe_act"] = 0.0
    else:
        rows13 = 2 * f if gated else f
        out["experts"] = n * h * b + n * rows13 * b + n * f * b + n * 4
        out["moe_act"] = (2 if gated else 1) * n * f * b  # the activation's intermediates
    if e.shared_expert_intermediate_size:
        fs = e.shared_expert_intermediate_size
        out["shared_experts"] = (4 if gated else 2) * tm * fs * b
        if e.shared_expert_gate:
            out["shared_experts"] += 2 * tm * b
    return out


def layer_modules(cfg: Config, layer: int, is_moe: bool, layout: Layout, c: ActContext) -> dict[str, float]:
    """Both halves of one decoder layer, keys prefixed attn. / ffn."""
    out = {f"attn.{k}": v for k, v in attention_modules(cfg, layer, layout, c).items()}
    out.update({f"ffn.{k}": v for k, v in ffn_modules(cfg, is_moe, layout, c).items()})
    if cfg.model.hc_mult > 1:
        out["attn.hyper"] = out["ffn.hyper"] = hyper_modules(cfg, c)
    return out


# module keys each recomputation option drops (see the table in the module docstring)
DROPS = {
    "core_attn": ("attn.core_attn",),
    "mla_up_proj": ("attn.mla_up",),
    "mlp": ("ffn.mlp",),
    "moe_act": ("ffn.moe_act",),
    "shared_experts": ("ffn.shared_experts",),
    "moe": ("ffn.router", "ffn.permute", "ffn.experts", "ffn.moe_act", "ffn.shared_experts"),
}


# module keys whose tensors `model.offload_modules` sends to host memory (moecore/models/offload.py)
_ATTN = ("attn.norm_out", "attn.qk_norm", "attn.core_attn", "attn.attn_out", "attn.attn_gate", "attn.mla_latent",
         "attn.mla_up", "attn.sparse_attn", "attn.indexer")  # fmt: skip
OFFLOADS = {
    "moe": ("ffn.norm_out", "ffn.router", "ffn.permute", "ffn.experts", "ffn.moe_act", "ffn.shared_experts"),
    "moe_act": ("ffn.experts", "ffn.moe_act"),
    "shared_experts": ("ffn.shared_experts",),
    "mlp": ("ffn.norm_out", "ffn.mlp"),
    "core_attn": _ATTN,
    "mla_up_proj": _ATTN,
    "norm": ("attn.norm_in", "ffn.norm_in"),
}


def offloaded_keys(layout: Layout, is_moe: bool) -> set[str]:
    """Module keys of one layer whose saved tensors wait in host memory."""
    out: set[str] = set()
    for name in layout.offload_modules:
        if (name == "moe" and not is_moe) or (name == "mlp" and is_moe):
            continue
        out.update(OFFLOADS.get(name, ()))
    return out


def dropped_keys(cfg: Config, layout: Layout, is_moe: bool) -> set[str]:
    """Module keys that a layer's selective recomputation does not keep for backward."""
    rec = _recompute_set(layout)
    out: set[str] = set()
    for name in rec:
        if name == "moe" and not is_moe:
            continue
        if name == "mlp" and is_moe:
            continue
        out.update(DROPS.get(name, ()))
    if "norm" in rec:
        out.add("ffn.norm_out")
        if layout.tp == 1:
            out.add("attn.norm_out")
    if "core_attn" in rec and "attn.core_attn" in out:
        out.discard("attn.core_attn")
        out.add("attn.core_attn:recomputed")
    return out


def layer_saved(cfg: Config, layer: int, is_moe: bool, layout: Layout, c: ActContext) -> tuple[float, float, float]:
    """(bytes one layer keeps on the GPU for backward, bytes its backward recomputes at once, bytes it
    keeps in host memory instead)."""
    mods = layer_modules(cfg, layer, is_moe, layout, c)
    h = cfg.model.hidden_size
    total = sum(mods.values())
    if layout.recompute_granularity == "full":  # the layer's input: hc_mult streams with hyper-connections
        kept = c.tokens / layout.tp * h * c.residual_bytes * cfg.model.hc_mult
        return kept, total, 0.0
    drop = dropped_keys(cfg, layout, is_moe)
    host = offloaded_keys(layout, is_moe)
    saved = recomputed = offloaded = 0.0
    for key, v in mods.items():
        if key in drop:
            recomputed += v
            continue
        if key == "attn.core_attn" and "attn.core_attn:recomputed" in drop:
            keep = _core_attn_inputs(cfg, layout, c)
            recomputed += v - keep
            v = keep
        if key in host:
            offloaded += v
        else:
            saved += v
    return saved, recomputed, offloaded


def _core_attn_inputs(cfg: Config, layout: Layout, c: ActContext) -> float:
    """What a checkpointed core attention keeps: q, k, v before the grouped-query expansion."""
    m = cfg.model
    T, b = c.tokens, c.act_bytes
    if m.attention_type in ("mla", "dsa"):
        return 0.0  # q, k, v are kept by mla_up already (or recomputed with it under mla_up_proj)
    if m.attention_type == "compressed":  # q and the single key/value head (its compressed entries are few)
        return T * m.resolved_head_dim * b * (m.num_attention_heads + 1)
    hd = m.resolved_head_dim
    nh, nkv = m.num_attention_heads // layout.tp, m.kv_heads // layout.tp
    return T * hd * b * (nh + 2 * nkv)


def layer_backward_workspace(cfg: Config, is_moe: bool, layout: Layout, c: ActContext) -> float:
    """Gradients of one layer's activations alive at once during its backward (the largest piece)."""
    m, e = cfg.model, cfg.moe
    T, b = c.tokens, c.act_bytes
    h = m.hidden_size
    if is_moe:
        n = routed_rows(cfg, layout, c)
        f = e.ffn_hidden_size // layout.etp
        if expert_memory_mode(cfg, layout, c) == "chunked":  # moecore/moe/chunked.py backward, per chunk
            rows = min(n, max(e.activation_chunk_rows, n / e.num_experts))  # whole experts: at least one's rows
            # the larger of: x, dOut gathered, h, da, dh, a*p (after the SwiGLU backward) or dh, the chunk's
            # input gradient and its fp32 copy (the last GEMM)
            chunk = rows * max(b * (2 * h + 6 * f), b * (2 * f + h) + 4 * h)
            if layout.ep > 1 or layout.etp > 1:  # received rows: their input gradient [n, H], then all-to-all
                return n * h * b + chunk + 2 * n * h * b  # (row slices: an upper bound, nothing gathered)
            return T / layout.tp * h * 4 + chunk  # with the fp32 input-gradient accumulator of the tokens
        ws = n * b * (2 * h + 3 * f)
        if layout.ep > 1:
            ws += 2 * n * h * b  # all-to-all send and receive buffers of the gradient
        return ws
    return T * b * (2 * h + 3 * m.ffn_hidden_size / layout.tp)


def loss_bytes(cfg: Config, layout: Layout, c: ActContext, param_bytes: int) -> tuple[float, float]:
    """(bytes the LM loss keeps for backward, transient bytes of its backward) for one micro-batch.

    The fused linear cross-entropy (GPU, tp = 1) computes the head's gradients in its forward: dh [T, H]
    and dW [V, H] (fp32 when the micro-batch has more rows than one chunk, else in the compute dtype);
    its backward scales dW in fp32 and casts it to the parameter dtype. Unfused: bf16 logits and the
    fp32 softmax of this rank's vocabulary shard.
    """
    m = cfg.model
    T, b = c.tokens, c.act_bytes
    v, h = m.vocab_size // layout.tp, m.hidden_size
    if c.fused and layout.tp == 1 and m.fused_cross_entropy:
        dw_bytes = 4 if T > FUSED_CE_CHUNK else b
        kept = T * h * b + v * h * dw_bytes
        return kept, v * h * 4 + v * h * param_bytes
    return T * v * (b + 4), T * v * 4
