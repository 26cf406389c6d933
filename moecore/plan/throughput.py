"""Step-time estimate of a layout: FLOPs at a stated matmul efficiency, collectives at stated bandwidths, bubble.

    compute   = hardware FLOPs per rank / (peak x efficiency); hardware FLOPs = model FLOPs
                (moecore.train.logger.flops_per_token: 3 x forward) + the forward recomputation re-runs
    per-layer = tensor-parallel all-gather / reduce-scatter (sequence parallel: 2 per attention and per
                dense MLP in forward, 2 in backward), expert all-to-all (dispatch + combine, forward
                and backward, again for a recomputed MoE layer; the busiest rank's rows: x imbalance),
                context-parallel key/value all-gather and its reduce-scatter, pipeline sends
    bubble    = (pp - 1) / (vpp x m) of the pipelined part (1F1B, m micro-batches per step); the zero-bubble, zbv
                and DualPipeV schedules' from torch's order of the schedule played out with F = I = W
                (moecore/plan/schedule_memory.py `bubble_fraction`)
    optimizer = the optimizer step at the memory bound: the bytes it reads and writes / HBM bandwidth
    chunks    = moe.activation_memory=chunked's per-chunk cost (launches, smaller GEMMs, accumulation):
                CHUNK_S per chunk of moe.activation_chunk_rows routed rows, per MoE layer and micro-batch
    offload   = activation offloading's host copies (HOST_GBPS each way), hidden behind forward / backward
                compute except what exceeds it
    dp        = gradient all-reduce (reduce-scatter + all-gather with the distributed optimizer, plus
                the parameter all-gathers under fsdp), overlapped with backward except what exceeds it

Ring costs: all-reduce 2 (g-1)/g x bytes, all-gather / reduce-scatter / all-to-all (g-1)/g x bytes.
A group stays on NVLink when the ranks it spans fit in one node (rank order of ParallelDims), else it
runs at the inter-node bandwidth. Only the tensor-parallel, expert and context-parallel collectives
are counted as exposed (moecore does not overlap them with compute).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from moecore.config import Config
from moecore.plan.activations import expert_memory_mode, layer_saved, routed_rows
from moecore.plan.layout import Layout, group_span, run_schedule
from moecore.plan.memory import PlanOptions, act_context, micro_batches_per_step
from moecore.plan.params import param_summary, precision_mode
from moecore.plan.schedule_memory import SPLIT_BACKWARD_SCHEDULES, bubble_fraction

PEAK_TFLOPS = 989.0  # H100 / H200 SXM dense bf16 datasheet peak
# Achieved fraction of the datasheet peak for forward + backward, FLOPs counted as flops_per_token does (no
# embedding FLOPs): the Qwen3 proxy's train step on an H200 (docs/benchmarks.md, runs G / H, bf16 mode),
# 44.26 TFLOP in 136.0 ms less the optimizer's 18.6 ms = 377 TFLOP/s.
MATMUL_EFFICIENCY = 0.38
HBM_GBPS = 4200.0  # optimizer step at the memory bound: the H200's device-to-device copy rate in the same runs
INTRA_NODE_GBPS = 360.0  # NVLink bus bandwidth per GPU, GB/s (H100 / H200, NCCL all-reduce)
INTER_NODE_GBPS = 45.0  # per GPU across nodes (one 400 Gb/s NIC per GPU), GB/s
HOST_GBPS = 25.0  # device <-> pinned host copies per GPU and direction (PCIe), GB/s: activation offloading
# Forward + backward time of one chunk of moe.activation_memory=chunked beyond its FLOPs (docs/benchmarks.md,
# "Chunked expert memory", H200): the layer's time less 1.22x the standard layer's (FC1 again), per chunk, was
# 0.54 / 0.63 ms at Qwen3-Next's shape (chunks of 8192 / 2048 rows) and 1.20 / 0.73 ms at DeepSeek-V3's.
CHUNK_S = 0.7e-3


@dataclass
class Hardware:
    """The stated machine: GPUs per node, peak, efficiency and link bandwidths."""

    gpus_per_node: int = 8
    peak_tflops: float = PEAK_TFLOPS
    efficiency: float = MATMUL_EFFICIENCY
    intra_gbps: float = INTRA_NODE_GBPS
    inter_gbps: float = INTER_NODE_GBPS
    hbm_gbps: float = HBM_GBPS


@dataclass
class StepEstimate:
    """Seconds per optimizer step by part, tokens/s and MFU (model FLOPs / (world x peak))."""

    compute_s: float
    tp_s: float
    ep_s: float
    cp_s: float
    pp_s: float
    bubble_s: float
    dp_exposed_s: float
    optimizer_s: float
    step_s: float
    tokens_per_s: float
    mfu: float
    chunks_s: float = 0.0  # moe.activation_memory=chunked's per-chunk cost (part of step_s)

    def to_dict(self) -> dict:
        return asdict(self)


def _bw(layout: Layout, group: str, hw: Hardware) -> float:
    """Bytes/s of a group: NVLink when its span fits in a node."""
    gbps = hw.intra_gbps if group_span(layout, group) <= hw.gpus_per_node else hw.inter_gbps
    return gbps * 1e9


def data_parallel_bytes(layout: Layout, summary, mode, group: str) -> float:
    """Bytes one rank moves per step over the data-parallel `group` ("dp_cp" or "edp"): the gradient all-reduce
    (reduce-scatter + all-gather of the updated fp32 shards under the distributed optimizer), or under fsdp the
    parameter gathers (forward: every parameter; backward: the trained ones, since a frozen layer is not gathered
    again: moecore/parallel/fsdp.py `trainable_islands`) and the gradient reduce-scatter."""
    g = layout.edp if group == "edp" else layout.dp_cp
    expert = group == "edp"
    n = summary.expert if expert else summary.total - summary.expert  # unsharded elements
    # of which trained (dense_warmup freezes all but the indexers: no gradient, no update to gather)
    t = sum(k for (_, x), k in summary.groups.items() if x == expert)
    if layout.fsdp:
        return (g - 1) / g * ((n + t) * mode.param + t * mode.grad)
    vol = 2 * (g - 1) / g * t * mode.grad
    if layout.distributed_optimizer:
        vol += (g - 1) / g * t * 4  # the updated fp32 shards' all-gather
    return vol


def recompute_flops_per_token(cfg: Config, layout: Layout) -> float:
    """Extra forward FLOPs per token that recomputation re-runs (full: every layer; moe: the MoE blocks;
    core_attn: the attention scores; the cheap options are left out)."""
    from moecore.train.logger import _attention_flops, _ffn_flops, compressed_attention_flops

    m = cfg.model
    s = cfg.train.seq_length
    ctx = (s + 1) / 2
    extra = 0.0
    rec = set(layout.recompute_modules) if layout.recompute_granularity == "selective" else set()
    for i in range(m.num_layers):
        linear = m.layer_types is not None and m.layer_types[i] == "linear_attention"
        is_moe = cfg.moe.is_moe_layer(i, m.num_layers)
        if layout.recompute_granularity == "full":
            attn = compressed_attention_flops(cfg, i, s) if m.attention_type == "compressed" else None
            extra += (_attention_flops(cfg, ctx, linear) if attn is None else attn) + _ffn_flops(cfg, is_moe)
            continue
        if ("moe" in rec and is_moe) or ("mlp" in rec and not is_moe):
            extra += _ffn_flops(cfg, is_moe)
        if "core_attn" in rec and not linear:
            hd = (
                m.resolved_head_dim
                if m.attention_type not in ("mla", "dsa")
                else m.qk_nope_head_dim + m.qk_rope_head_dim
            )
            extra += 4.0 * m.num_attention_heads * hd * ctx
    return extra


def chunked_flops_per_token(cfg: Config, layout: Layout, c) -> float:
    """FC1 once more in backward per MoE layer where moe.activation_memory=chunked runs (moecore/moe/chunked.py):
    2 x H x 2F FLOPs for each of a token's K routed rows (its backward does so after a recomputed forward too)."""
    e, m = cfg.moe, cfg.model
    if not e.num_experts or expert_memory_mode(cfg, layout, c) != "chunked":
        return 0.0
    moe_layers = sum(1 for i in range(m.num_layers) if e.is_moe_layer(i, m.num_layers))
    return 4.0 * e.router_topk * m.hidden_size * e.ffn_hidden_size * moe_layers


def estimate_step(
    cfg: Config, layout: Layout, hw: Hardware | None = None, opts: PlanOptions | None = None
) -> StepEstimate:
    """The step-time estimate of one layout (module docstring)."""
    from moecore.train.logger import flops_per_token

    hw = hw or Hardware()
    opts = opts or PlanOptions()
    m_cfg, e = cfg.model, cfg.moe
    t = cfg.train
    m = micro_batches_per_step(cfg, layout)
    mode = precision_mode(cfg, layout, m, opts.device)
    c = act_context(cfg, layout, mode, opts)
    key = ("flops", layout.recompute_granularity, layout.recompute_modules)
    if key not in opts.cache:
        opts.cache[key] = (flops_per_token(cfg), recompute_flops_per_token(cfg, layout))
    model_fpt, extra_fpt = opts.cache[key]
    hw_fpt = model_fpt + extra_fpt + chunked_flops_per_token(cfg, layout, c)
    global_tokens = t.global_batch_size * t.seq_length
    rate = hw.peak_tflops * 1e12 * hw.efficiency
    compute = hw_fpt * global_tokens / layout.world / rate

    h, b = m_cfg.hidden_size, c.act_bytes
    layers_per_stage = -(-m_cfg.num_layers // layout.pp)
    if "moe_layers" not in opts.cache:
        opts.cache["moe_layers"] = sum(1 for i in range(m_cfg.num_layers) if e.is_moe_layer(i, m_cfg.num_layers))
    moe_layers = opts.cache["moe_layers"] / layout.pp
    dense_layers = layers_per_stage - moe_layers
    T = c.tokens
    full = layout.recompute_granularity == "full"
    rec = set(layout.recompute_modules) if layout.recompute_granularity == "selective" else set()

    tp_s = ep_s = cp_s = pp_s = 0.0
    if layout.tp > 1:
        per = (layout.tp - 1) / layout.tp * T * h * b / _bw(layout, "tp", hw)
        colls = 4 * layers_per_stage + 4 * dense_layers  # attention (+ dense MLP): 2 forward, 2 backward
        tp_s = per * colls * (1.5 if full else 1.0) * m
    if layout.ep > 1 and e.num_experts:
        rows = routed_rows(cfg, layout, c) / layout.etp
        per = (layout.ep - 1) / layout.ep * rows * h * b / _bw(layout, "ep", hw)
        colls = 4 + (2 if full or "moe" in rec else 0)
        ep_s = per * colls * moe_layers * m
    if layout.etp > 1 and e.num_experts:  # expert rows gathered over etp, outputs reduce-scattered
        rows = routed_rows(cfg, layout, c)
        per = (layout.etp - 1) / layout.etp * rows * h * b / _bw(layout, "etp", hw)
        ep_s += per * (4 + (2 if full or "moe" in rec else 0)) * moe_layers * m
    if layout.cp > 1:
        hd = m_cfg.resolved_head_dim
        kv = 2 * m_cfg.kv_heads // max(1, layout.tp) * hd
        per = (layout.cp - 1) * T * kv * b / _bw(layout, "cp", hw)
        linear = sum(t == "linear_attention" for t in m_cfg.layer_types or []) / layout.pp
        # gated DeltaNet layers all-gather every chunk's fp32 state map (A, B) instead (parallel/context_deltanet.py)
        dk, hv = m_cfg.linear_key_head_dim, m_cfg.linear_num_value_heads // max(1, layout.tp)
        state = 2 * layout.micro_batch_size * hv * dk * (dk + m_cfg.linear_value_head_dim) * 4
        per_linear = (layout.cp - 1) * state / _bw(layout, "cp", hw)
        cp_s = 2 * (per * (layers_per_stage - linear) + per_linear * linear) * m
    if layout.pp > 1:
        per = T * h * b / layout.tp / _bw(layout, "pp", hw)
        pp_s = 2 * per * layout.vpp * m
    chunks_s = 0.0
    if e.num_experts and expert_memory_mode(cfg, layout, c) == "chunked":  # moecore/moe/chunked.py
        chunks = -(-routed_rows(cfg, layout, c) // e.activation_chunk_rows)
        chunks_s = CHUNK_S * chunks * moe_layers * m
    pipelined = compute + tp_s + ep_s + cp_s + pp_s + chunks_s
    bubble = _bubble_share(cfg, layout, m) * pipelined if layout.pp > 1 else 0.0

    # data-parallel gradient reduction (and parameter gathers), per rank of the worst stage
    dp_s = 0.0
    summary = param_summary(cfg, layout, 0, opts.cache)
    for group, g in (("dp_cp", layout.dp_cp), ("edp", layout.edp)):
        if g > 1:
            dp_s += data_parallel_bytes(layout, summary, mode, group) / _bw(layout, group, hw)
    backward = compute * 2 / 3
    dp_exposed = max(0.0, dp_s - backward) + 0.05 * dp_s
    offload_exposed = 0.0
    if layout.offload_modules:  # copies out in forward, back in backward, each overlapping that pass
        host = (
            sum(layer_saved(cfg, i, e.is_moe_layer(i, m_cfg.num_layers), layout, c)[2] for i in range(m_cfg.num_layers))
            / layout.pp
            * m
        )
        copy = host / (HOST_GBPS * 1e9)
        offload_exposed = max(0.0, copy - compute / 3) + max(0.0, copy - 2 * compute / 3)  # forward, backward
    optimizer = optimizer_bytes(cfg, layout, mode, summary) / (hw.hbm_gbps * 1e9)
    step = pipelined + bubble + dp_exposed + offload_exposed + optimizer
    tps = global_tokens / step
    mfu = model_fpt * tps / (layout.world * hw.peak_tflops * 1e12)
    return StepEstimate(compute, tp_s, ep_s, cp_s, pp_s, bubble, dp_exposed, optimizer, step, tps, mfu, chunks_s)


def optimizer_bytes(cfg: Config, layout: Layout, mode, summary) -> float:
    """Bytes the optimizer step moves on one rank: gradient read, master (or weight) read and written, the
    compute weight written, both moments read and written (the fused AdamW kernel touches each once);
    a sharded optimizer works on its shard and then writes the gathered update into every parameter."""
    total = 0.0
    moments = mode.moments if cfg.optim.name == "adamw" else mode.moments // 2
    weight = 2 * mode.master + mode.param if mode.master else 2 * mode.param
    for (_, expert), n in summary.groups.items():
        g = layout.edp if expert else layout.dp_cp
        sharded = (layout.distributed_optimizer or layout.fsdp) and g > 1
        k = -(-n // g) if sharded else n
        total += k * (mode.grad + weight + 2 * moments)
        if sharded and not layout.fsdp:
            total += n * mode.param
    return total


def _bubble_share(cfg: Config, layout: Layout, m: int) -> float:
    """The pipeline's idle time over each rank's work: (pp - 1) / (vpp m) for 1F1B and interleaved 1F1B; the
    zero-bubble and V schedules' from their order (module docstring), or the interleaved value where torch cannot
    build it."""
    schedule = run_schedule(cfg, layout)
    if schedule in SPLIT_BACKWARD_SCHEDULES and layout.vpp > 1:
        share = bubble_fraction(schedule, layout.pp, layout.vpp, m)
        if share is not None:
            return share
    return (layout.pp - 1) / (layout.vpp * m)
