"""Exact parameter counts per rank and pipeline stage, and the bytes of parameters, gradients and optimizer state.

`param_entries(cfg, layout, layers)` lists every parameter tensor one rank holds for the given decoder
layers (plus the embedding on the first pipeline stage, the final norm, head and MTP modules on the
last), with the sharding moecore applies: q/k/v/gate/up projections split by output columns over tp,
o/down projections by input rows, embedding and head rows by vocabulary; routed experts E / ep per
rank, each with F / etp FFN columns; MLA's up-projections and gated DeltaNet's projections, A_log and
dt_bias split by heads, MLA's down-projections and latent norms, DeltaNet's conv and gated-norm weights,
the DSA indexer (absent from GLM-5's shared indexer layers), norms, routers and shared experts replicated.
Each entry knows whether AdamW decays it (moecore.optim.adamw: matrices only, no embeddings or norms),
whether it is an expert parameter (reduced and sharded over the expert data-parallel group, not dp x cp) and
whether it trains: DSA's `model.dsa_stage=dense_warmup` freezes every parameter but the lightning indexers'
(moecore/models/dsa.py `freeze_all_but_indexers`).

`state_bytes` turns the entries into bytes per rank under a precision mode:

| mode | parameter | master | gradient | Adam moments |
|---|---|---|---|---|
| fp32 | 4 | - | 4 | 8 |
| bf16 | 2 | 4 (0 with master_weights=bf16) | 4 when summed, else 2 | 8 (4 with state_dtype=bf16) |
| fp16 (autocast on fp32 parameters) | 4 | - | 4 | 8 |
| fp8 | as bf16; with `fp8.primary_weights` the FP8 GEMMs' weights 1 (+ scales), rowwise 2 (both layouts) | 4 | as bf16 | as bf16 |

"Summed" gradients: more than one micro-batch per step, or more than one rank. With the
distributed optimizer the master weights and moments of each (parameter group, reduction domain)
are one flat buffer padded to a multiple of the domain's size and split evenly, and the reduced
gradient is kept as the same fp32 shard (moecore/parallel/distributed_optimizer.py; up to
`parallel.grad_bucket_mb` per buffer; a domain of one rank is one whole shard); the fp32 master
shard is the only fp32 copy under bf16 too. With fsdp the parameters, gradients, master weights
and moments are all sharded; under pipeline parallel (pp > 1) a stage also holds, through a step, its
weights gathered (in the compute dtype) and its gradients unsharded in fp32 (torch's PipelineStage turns
FSDP2's gradient sync off until the last micro-batch's backward, and moecore keeps the weights gathered
after forward: moecore/parallel/fsdp.py), so only the master weights and moments stay sharded there.

Frozen parameters (`requires_grad` off: dense_warmup's) keep their weights only: the optimizer's parameter
groups (moecore.optim.groups), the gradient hooks and buckets (moecore/parallel/data_parallel.py) and the
master weights (MixedPrecision casts a frozen parameter to bf16 and keeps no fp32 copy of it) skip them. So
they cost the parameter dtype's bytes per element (fp32 4, bf16 / fp8 2, fp16 autocast 4) and nothing else;
under fsdp their shards are the sharded parameters (fp32 with fp32 master weights, else bf16), without a
gradient (checked against a dp2 run's logged bytes: tests/distributed/test_fsdp_dense_warmup.py).
The trainer refuses FP8 primary weights without master weights (moecore/models/fp8.py
`enable_primary_weights`), so frozen FP8 GEMM weights are counted in the parameter dtype.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

from moecore.config import Config
from moecore.plan.layout import Layout, head_rank


@dataclass(frozen=True)
class ParamEntry:
    """One parameter tensor on one rank."""

    name: str
    numel: int
    decay: bool
    expert: bool = False
    # a weight FP8 GEMMs can compute with: (fp8.modules kind, G, N, K) for G matrices of [N, K] (None: never FP8)
    gemm: tuple[str, int, int, int] | None = None
    trained: bool = True  # False: frozen (requires_grad off), no gradient, master weight or optimizer state


def _linear_attention_numels(cfg: Config, tp: int = 1) -> list[tuple[str, int, int]]:
    """(name, numel, ndim) on one rank of a gated DeltaNet layer (moecore/models/linear_attention.py): heads split
    over tp, the conv and gated-norm weights whole."""
    m = cfg.model
    h = m.hidden_size
    kd, vd = m.linear_num_key_heads * m.linear_key_head_dim, m.linear_num_value_heads * m.linear_value_head_dim
    conv = 2 * kd + vd
    nv = m.linear_num_value_heads
    return [
        ("attn.in_proj_qkvz.weight", h * (2 * kd + 2 * vd) // tp, 2),
        ("attn.in_proj_ba.weight", h * 2 * nv // tp, 2),
        ("attn.conv1d.weight", conv * m.linear_conv_kernel_dim, 3),
        ("attn.dt_bias", nv // tp, 1),
        ("attn.A_log", nv // tp, 1),
        ("attn.norm.weight", m.linear_value_head_dim, 1),
        ("attn.out_proj.weight", vd * h // tp, 2),
    ]


def _compressed_attention_numels(cfg: Config, layer: int, tp: int = 1) -> list[tuple[str, int, int]]:
    """(name, numel, ndim) on one rank of a DeepSeek-V4 attention layer: q LoRA, one key/value head, grouped output
    projection, sinks (the heads' parts split over tp); a compressor on CSA / HCA layers (CSA's pools two series: 2 D
    channels) and CSA's lightning indexer, whole on every rank."""
    m = cfg.model
    h, n, d, ql = m.hidden_size, m.num_attention_heads // tp, m.resolved_head_dim, m.q_lora_rank
    out = [
        ("attn.q_a_proj.weight", h * ql, 2), ("attn.q_a_norm.weight", ql, 1), ("attn.q_b_proj.weight", ql * n * d, 2),
        ("attn.kv_proj.weight", h * d, 2), ("attn.kv_norm.weight", d, 1),
        ("attn.o_a_proj.weight", n * d * m.o_lora_rank, 2),
        ("attn.o_b_proj.weight", m.o_groups // tp * m.o_lora_rank * h, 2), ("attn.sinks", n, 1),
    ]  # fmt: skip
    kind = m.layer_types[layer]
    if kind == "sliding_attention":
        return out

    def compressor(prefix: str, dim: int, rate: int, width: int) -> list[tuple[str, int, int]]:
        return [(f"{prefix}.kv_proj.weight", h * width, 2), (f"{prefix}.gate_proj.weight", h * width, 2),
                (f"{prefix}.position_bias", rate * width, 2), (f"{prefix}.kv_norm.weight", dim, 1)]  # fmt: skip

    if kind == "heavily_compressed_attention":
        return out + compressor("attn.compressor", d, m.hca_compress_rate, d)
    rate, nh, di = m.csa_compress_rate, m.index_n_heads, m.index_head_dim
    out += compressor("attn.compressor", d, rate, 2 * d) + compressor("attn.compressor.indexer", di, rate, 2 * di)
    return out + [("attn.compressor.indexer.q_b_proj.weight", ql * nh * di, 2),
                  ("attn.compressor.indexer.weights_proj.weight", h * nh, 2)]  # fmt: skip


def _attention(cfg: Config, layer: int, tp: int, prefix: str) -> list[ParamEntry]:
    m = cfg.model
    h = m.hidden_size
    out: list[ParamEntry] = []

    def add(name: str, numel: int, ndim: int, n_k: tuple[int, int] | None = None) -> None:
        full = prefix + name
        decay = ndim >= 2 and not name.endswith((".bias", ".position_bias")) and "norm" not in full
        out.append(ParamEntry(full, numel, decay, gemm=None if n_k is None else ("attention", 1, *n_k)))

    if m.layer_types is not None and m.layer_types[layer] == "linear_attention":
        for name, numel, ndim in _linear_attention_numels(cfg, tp):
            add(name, numel, ndim)
        return out
    if m.attention_type == "compressed":  # DeepSeek-V4 (moecore/models/compressed_attention.py)
        for name, numel, ndim in _compressed_attention_numels(cfg, layer, tp):
            add(name, numel, ndim)
        return out
    if m.attention_type in ("mla", "dsa"):  # DSA is MLA plus the lightning indexer (moecore/models/dsa.py)
        n = m.num_attention_heads // tp  # up-projections split by heads; down-projections and indexer whole
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            add("attn.q_proj.weight", h * n * qk, 2, (n * qk, h))
        else:
            add("attn.q_a_proj.weight", h * m.q_lora_rank, 2, (m.q_lora_rank, h))
            add("attn.q_a_layernorm.weight", m.q_lora_rank, 1)
            add("attn.q_b_proj.weight", m.q_lora_rank * n * qk, 2, (n * qk, m.q_lora_rank))
        kv_a = m.kv_lora_rank + m.qk_rope_head_dim
        add("attn.kv_a_proj_with_mqa.weight", h * kv_a, 2, (kv_a, h))
        add("attn.kv_a_layernorm.weight", m.kv_lora_rank, 1)
        kv_b = n * (m.qk_nope_head_dim + m.v_head_dim)
        add("attn.kv_b_proj.weight", m.kv_lora_rank * kv_b, 2, (kv_b, m.kv_lora_rank))
        add("attn.o_proj.weight", n * m.v_head_dim * h, 2, (h, n * m.v_head_dim))
        shared = m.indexer_types is not None and m.indexer_types[layer] == "shared"  # GLM-5: reuses a top-k
        if m.attention_type == "dsa" and not shared:  # reads the q latent, so q_lora_rank is set (None refused)
            nh, d = m.index_n_heads, m.index_head_dim
            add("attn.indexer.wq_b.weight", m.q_lora_rank * nh * d, 2)
            add("attn.indexer.wk.weight", h * d, 2)
            add("attn.indexer.k_norm.weight", d, 1)  # a LayerNorm: weight and bias
            add("attn.indexer.k_norm.bias", d, 1)
            add("attn.indexer.weights_proj.weight", h * nh, 2)
        return out
    hd = m.resolved_head_dim
    nq, nkv = m.num_attention_heads * hd, m.kv_heads * hd
    q_out = nq * (2 if m.attn_output_gate else 1)
    add("attn.q_proj.weight", h * q_out // tp, 2, (q_out // tp, h))
    add("attn.k_proj.weight", h * nkv // tp, 2, (nkv // tp, h))
    add("attn.v_proj.weight", h * nkv // tp, 2, (nkv // tp, h))
    if m.qkv_bias:
        add("attn.q_proj.bias", q_out // tp, 1)
        add("attn.k_proj.bias", nkv // tp, 1)
        add("attn.v_proj.bias", nkv // tp, 1)
    add("attn.o_proj.weight", nq // tp * h, 2, (h, nq // tp))
    if m.attn_out_bias:
        add("attn.o_proj.bias", h, 1)
    if m.qk_norm and m.qk_norm_scope == "projection":  # over all heads' channels, split with the heads
        add("attn.q_norm.weight", nq // tp, 1)
        add("attn.k_norm.weight", nkv // tp, 1)
    elif m.qk_norm:
        add("attn.q_norm.weight", hd, 1)
        add("attn.k_norm.weight", hd, 1)
    if getattr(m, "attn_sinks", False):  # one learned logit per head (gpt-oss), split with the heads
        add("attn.sinks", m.num_attention_heads // tp, 1)
    return out


def _ffn(cfg: Config, is_moe: bool, layout: Layout, prefix: str) -> list[ParamEntry]:
    m, e = cfg.model, cfg.moe
    h = m.hidden_size
    mats = 2 if m.activation == "gelu" else 3
    # gate / up [F / tp, H] and down [H, F / tp]: as mats x [F / tp, H] in numel and in the scales of every FP8 copy
    # the plan counts (tensorwise, 128x128 tiles, rowwise primary weights' two layouts)
    if not is_moe:
        f = m.ffn_hidden_size // layout.tp
        return [ParamEntry(prefix + "mlp.proj", mats * h * f, True, gemm=("dense_mlp", mats, f, h))]
    out = [ParamEntry(prefix + "mlp.router.weight", e.num_experts * h, True)]
    gated = 1 if m.activation == "gelu" else 2  # w13 rows per FFN column: gate and up, or up
    if getattr(m, "router_logit_bias", False):  # gpt-oss: a learned bias [E] on the router logits
        out.append(ParamEntry(prefix + "mlp.router.bias", e.num_experts, False))
    f_loc = e.ffn_hidden_size // layout.etp
    e_loc = e.num_experts // layout.ep
    swiglu = m.activation != "gelu"  # the FP8 expert FFN is SwiGLU's, in each of its forms (moecore/models/fp8.py)
    w13, w2 = ("experts", e_loc, gated * f_loc, h), ("experts", e_loc, h, f_loc)
    out.append(ParamEntry(prefix + "mlp.experts.w13", e_loc * gated * f_loc * h, True, True, w13 if swiglu else None))
    out.append(ParamEntry(prefix + "mlp.experts.w2", e_loc * h * f_loc, True, True, w2 if swiglu else None))
    if getattr(m, "expert_linear_bias", False):
        # gpt-oss's expert biases b13 [E, 2F] and b2 [E, H] (moecore/models/biased_moe.py: b13 split with the FFN
        # columns over etp, b2 with the hidden columns), trained without weight decay like every bias
        # (moecore.optim.groups.no_decay).
        out.append(ParamEntry(prefix + "mlp.experts.b13", e_loc * gated * f_loc, False, expert=True))
        out.append(ParamEntry(prefix + "mlp.experts.b2", e_loc * h // layout.etp, False, expert=True))
    if e.shared_expert_intermediate_size:
        sh = e.shared_expert_intermediate_size
        out.append(ParamEntry(prefix + "mlp.shared_experts", mats * h * sh, True, gemm=("shared_experts", mats, sh, h)))
        if e.shared_expert_gate:
            out.append(ParamEntry(prefix + "mlp.shared_expert_gate.weight", h, True))
    return out


def decoder_layer_entries(cfg: Config, layer: int, layout: Layout, is_moe: bool, prefix: str) -> list[ParamEntry]:
    """Parameters of one decoder layer on one rank: two norms, attention, dense MLP or MoE block."""
    h, hc = cfg.model.hidden_size, cfg.model.hc_mult
    out = [ParamEntry(prefix + "attn_norm.weight", h, False), ParamEntry(prefix + "mlp_norm.weight", h, False)]
    if hc > 1:  # hyper-connections (moecore/models/hyper_connections.py): fn [(2 + n) n, n H], base, scale [3]
        for block in ("attn_hc", "mlp_hc"):
            out += [ParamEntry(f"{prefix}{block}.fn", (2 + hc) * hc * hc * h, True),
                    ParamEntry(f"{prefix}{block}.base", (2 + hc) * hc, False), ParamEntry(f"{prefix}{block}.scale", 3, False)]  # fmt: skip
    return out + _attention(cfg, layer, layout.tp, prefix) + _ffn(cfg, is_moe, layout, prefix)


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Contiguous decoder layers of each pipeline stage, as even as possible (earlier stages take the extra)."""
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def param_entries(cfg: Config, layout: Layout, stage: int = 0) -> list[ParamEntry]:
    """Every parameter one rank of pipeline stage `stage` holds."""
    m = cfg.model
    h, v = m.hidden_size, m.vocab_size
    layers = stage_layers(m.num_layers, layout.pp)[stage]
    out: list[ParamEntry] = []
    first, last = stage == 0, stage == head_rank(cfg, layout)
    if first or (last and m.tie_embeddings):
        out.append(ParamEntry("embed.weight", v // layout.tp * h, False))
    for i in layers:
        out += decoder_layer_entries(cfg, i, layout, cfg.moe.is_moe_layer(i, m.num_layers), f"layers.{i}.")
    if last:
        out.append(ParamEntry("norm.weight", h, False))
        hc = m.hc_mult
        if hc > 1:  # the final collapse of the hyper-connection streams
            out += [ParamEntry("hc_head.hc_fn", hc * hc * h, True), ParamEntry("hc_head.hc_base", hc, False),
                    ParamEntry("hc_head.hc_scale", 1, False)]  # fmt: skip
        if not m.tie_embeddings:
            out.append(ParamEntry("lm_head.weight", v // layout.tp * h, True))
        for d in range(m.mtp_num_layers):
            pre = f"mtp.layers.{d}."
            out += [ParamEntry(pre + n, h, False) for n in ("enorm.weight", "hnorm.weight", "head_norm.weight")]
            out.append(ParamEntry(pre + "eh_proj.weight", 2 * h * h, True))
            blk = cfg
            if m.layer_types is not None or m.indexer_types is not None:  # MTP blocks: full attention, own indexer
                blk = copy.deepcopy(cfg)
                blk.model.layer_types = blk.model.indexer_types = None
            out += decoder_layer_entries(blk, 0, layout, cfg.moe.num_experts > 0, pre + "block.")
    if m.attention_type == "compressed":  # DeepSeek-V4's indexers are frozen (moecore/models/compressed_attention.py)
        out = [replace(e, trained=False) if ".compressor.indexer." in e.name else e for e in out]
    if dense_warmup(cfg):  # only the lightning indexers train (moecore/models/dsa.py freeze_all_but_indexers)
        out = [e if ".indexer." in e.name else replace(e, trained=False) for e in out]
    return out


def dense_warmup(cfg: Config) -> bool:
    """DSA's warm-up stage: every parameter but the lightning indexers' frozen."""
    return cfg.model.attention_type == "dsa" and cfg.model.dsa_stage == "dense_warmup"


@dataclass
class PrecisionMode:
    """Bytes per parameter element of each kind (see the module docstring)."""

    name: str
    param: int
    master: int
    grad: int
    moments: int
    autocast: bool  # bf16 / fp16 autocast on fp32 parameters: casts of the weights live per micro-batch
    act_bytes: int  # activation element size
    fp8: str = ""  # train.precision=fp8: the recipe (tensorwise | rowwise | blockwise)
    fp8_primary: bool = False  # fp8.primary_weights: the FP8 GEMMs' weights live as their FP8 copies only

    @property
    def fp8_kept_per_micro_batch(self) -> bool:
        """The FP8 copies of the weights a forward quantises are saved for its backward (one-byte recipes without
        primary weights; rowwise re-quantises w^T in backward: moecore/kernels/fp8_gemm.py, fp8_grouped.py)."""
        return self.fp8 in ("tensorwise", "blockwise") and not self.fp8_primary


PRECISIONS = ("", "adam_bf16", "master_bf16")  # Layout.precision: the config's; bf16 moments; bf16 master and moments


def precision_mode(cfg: Config, layout: Layout, micro_batches: int, device: str = "cuda") -> PrecisionMode:
    """The precision mode of a run (train.precision auto means bf16 on GPU, fp32 on CPU).

    bf16 follows the bf16-parameter scheme (bf16 parameters, fp32 master weights and moments unless
    `optim.master_weights` / `optim.state_dtype` or the layout's `precision` say bf16); fp16 keeps
    autocast on fp32 parameters.
    """
    prec = cfg.train.precision
    if prec == "auto":
        prec = "bf16" if device == "cuda" else "fp32"
    if prec == "fp32":
        return PrecisionMode("fp32", 4, 0, 4, 8, False, 4)
    if prec == "fp16":
        return PrecisionMode("fp16-autocast", 4, 0, 4, 8, True, 2)
    o = cfg.optim
    master_bf16 = getattr(o, "master_weights", "fp32") == "bf16" or layout.precision == "master_bf16"
    state_bf16 = getattr(o, "state_dtype", "fp32") == "bf16" or layout.precision in ("adam_bf16", "master_bf16")
    summed = micro_batches > 1 or layout.world > 1  # as moecore.train.runtime decides sum_in_fp32
    fp8, primary = (cfg.fp8.recipe, cfg.fp8.primary_weights) if prec == "fp8" else ("", False)
    name = f"fp8-{fp8}" + ("/primary" if primary else "") if fp8 else "bf16"
    name += ("/bf16-master" if master_bf16 else "") + ("/bf16-adam" if state_bf16 else "")
    master = 0 if master_bf16 else 4
    return PrecisionMode(name, 2, master, 4 if summed else 2, 4 if state_bf16 else 8, False, 2, fp8, primary)


def fp8_copy_bytes(recipe: str, groups: int, n: int, k: int, primary: bool = False) -> int:
    """Bytes of the FP8 copy of `groups` matrices of [n, k]: one byte per element and fp32 scales (tensorwise: one
    per matrix; blockwise: per 128x128 tile; rowwise: per row). A rowwise primary weight keeps its transpose too
    (scales per column): moecore/models/fp8.py's quantize_primary."""
    if recipe == "tensorwise":
        return groups * (n * k + 4)
    if recipe == "blockwise":
        return groups * (n * k + 4 * -(-n // 128) * -(-k // 128))
    one = groups * (n * k + 4 * n)
    return one + groups * (n * k + 4 * k) if primary else one


def _flat_shard(n: int, g: int) -> int:
    """Elements of one rank's shard of a flat buffer of n elements padded to a multiple of g."""
    return -(-n // g)


@dataclass(frozen=True)
class ParamSummary:
    """The sums of one rank's parameter entries the memory and time models need."""

    groups: dict  # (decay, expert) -> elements of the trained parameters: the distributed optimizer's flat buffers
    largest_layer: int  # elements of the largest decoder layer
    matmuls: int  # decayed (matrix) elements outside the embedding: what autocast casts to bf16
    moe_matmuls: int  # of which router and routed experts (dropped from the casts by "moe" recomputation)
    # train.precision=fp8: (decay, expert) -> (elements of the weights FP8 GEMMs compute with, bytes of their FP8
    # copies as fp8.primary_weights keeps them), the frozen ones under ("frozen", expert); and the bytes of the
    # routed experts' copies a forward quantises
    fp8_weights: dict = field(default_factory=dict)
    fp8_moe_copy: int = 0
    frozen: dict = field(default_factory=lambda: {False: 0, True: 0})  # expert -> elements of frozen parameters

    @property
    def trained(self) -> int:
        return sum(self.groups.values())

    @property
    def total(self) -> int:
        return self.trained + sum(self.frozen.values())

    @property
    def expert(self) -> int:
        return sum(n for (_, expert), n in self.groups.items() if expert) + self.frozen[True]


def param_summary(cfg: Config, layout: Layout, stage: int = 0, cache: dict | None = None) -> ParamSummary:
    """`ParamSummary` of one rank of `stage`; `cache` (a dict) memoises it per sharding-relevant degrees."""
    key = ("params", layout.tp, layout.ep, layout.etp, layout.pp, stage, head_rank(cfg, layout))
    if cache is not None and key in cache:
        return cache[key]
    entries = param_entries(cfg, layout, stage)
    groups: dict = {(d, x): 0 for d in (True, False) for x in (False, True)}
    frozen = {False: 0, True: 0}
    per_layer: dict[str, int] = {}
    matmuls = moe_matmuls = 0
    for e in entries:
        if e.trained:
            groups[(e.decay, e.expert)] += e.numel
        else:
            frozen[e.expert] += e.numel
        if e.name.startswith("layers."):
            k = e.name.split(".")[1]
            per_layer[k] = per_layer.get(k, 0) + e.numel
        if e.decay and not e.name.startswith("embed"):
            matmuls += e.numel
            if ".mlp.experts" in e.name or ".mlp.router" in e.name:
                moe_matmuls += e.numel
    fp8, fp8_moe = _fp8_summary(cfg, entries)
    out = ParamSummary(groups, max(per_layer.values(), default=0), matmuls, moe_matmuls, fp8, fp8_moe, frozen)
    if cache is not None:
        cache[key] = out
    return out


def _fp8_summary(cfg: Config, entries: list[ParamEntry]) -> tuple[dict, int]:
    """`ParamSummary.fp8_weights` and `.fp8_moe_copy`: the entries whose GEMMs apply_fp8 makes FP8 (a kind in
    fp8.modules; linears with both dimensions multiples of the recipe's alignment, as moecore/models/fp8.py)."""
    if cfg.train.precision != "fp8":
        return {}, 0
    f = cfg.fp8
    align = f.alignment
    out: dict = {}
    moe_copy = 0
    for e in entries:
        if e.gemm is None or e.gemm[0] not in f.modules:
            continue
        kind, g, n, k = e.gemm
        if kind != "experts" and (n % align or k % align):
            continue
        key = (e.decay, e.expert) if e.trained else ("frozen", e.expert)
        numel, kept = out.get(key, (0, 0))
        out[key] = (numel + e.numel, kept + fp8_copy_bytes(f.recipe, g, n, k, primary=f.primary_weights))
        if kind == "experts":
            moe_copy += fp8_copy_bytes(f.recipe, g, n, k)
    return out, moe_copy


def _param_bytes(n: int, group: tuple, summary: ParamSummary, mode: PrecisionMode) -> int:
    """Bytes of one rank's whole parameters of a group: FP8 primary weights as their FP8 copies, the rest in the
    parameter dtype."""
    numel, kept = summary.fp8_weights.get(group, (0, 0)) if mode.fp8_primary else (0, 0)
    return (n - numel) * mode.param + kept


def state_bytes(
    cfg: Config, layout: Layout, stage: int, mode: PrecisionMode, cache: dict | None = None
) -> dict[str, int]:
    """{"params", "grads", "optimizer"} bytes on one rank of `stage` (Muon keeps one momentum: 4 bytes); frozen
    parameters hold their weights only (module docstring)."""
    summary = param_summary(cfg, layout, stage, cache)
    moments = mode.moments if cfg.optim.name == "adamw" else mode.moments // 2
    params = grads = opt = 0
    sharded = layout.distributed_optimizer or layout.fsdp
    for group, n in summary.groups.items():
        if not n:
            continue
        expert = group[1]
        g = layout.edp if expert else layout.dp_cp
        if sharded and g > 1 and layout.fsdp:
            # FSDP's sharded parameters are the master weights (fp32; bf16 with optim.master_weights=bf16),
            # their gradients have the same dtype, and there is no separate master (moecore/parallel/fsdp.py)
            shard = _flat_shard(n, g)
            weight = 4 if mode.master or mode.param == 4 else 2
            opt += shard * moments
            params += shard * weight
            if layout.pp > 1:  # the gathered weights and unsharded fp32 gradients of a pipeline step
                params += n * mode.param
                grads += n * 4
            else:
                grads += shard * weight
        elif layout.distributed_optimizer and layout.world > 1:
            # moecore's distributed optimizer: per (group, domain) bucket an fp32 master shard (the only
            # fp32 copy, also under bf16) and its moments, and after backward the reduced fp32 gradient
            # shard only (moecore/parallel/distributed_optimizer.py); a domain of one rank is one shard
            shard = _flat_shard(n, g)
            opt += shard * (4 + moments)
            params += _param_bytes(n, group, summary, mode)
            grads += shard * 4
        else:
            opt += n * (mode.master + moments)
            params += _param_bytes(n, group, summary, mode)
            grads += n * mode.grad
    for expert, n in summary.frozen.items():
        g = layout.edp if expert else layout.dp_cp
        if n and layout.fsdp and g > 1:  # the frozen shards are the sharded parameters, in their stored dtype
            params += _flat_shard(n, g) * (4 if mode.master or mode.param == 4 else 2)
            params += n * mode.param if layout.pp > 1 else 0  # gathered through a pipeline step
        else:
            params += n * mode.param
    return {"params": params, "grads": grads, "optimizer": opt}


def total_params(cfg: Config) -> tuple[int, int]:
    """(total parameters, parameters active per token) of the whole model, one copy."""
    one = Layout()
    entries = param_entries(cfg, one, 0)
    total = sum(e.numel for e in entries)
    e = cfg.moe
    inactive = 0
    if e.num_experts:
        experts = sum(x.numel for x in entries if x.expert)
        inactive = experts - experts * e.router_topk // e.num_experts
    return total, total - inactive
