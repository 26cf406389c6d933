"""`Config`, a whole run made of every section, and the validation rules that span sections.

`Config.validate()` runs each section's own `validate()`, then the checks that need several sections
at once (parallel degrees against model shapes, MoE memory options and CUDA graphs against the
parallel layout, FP8 GEMM dimensions against the model's widths).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import yaml

from moecore.config.errors import _fail
from moecore.config.fp8 import FP8Config
from moecore.config.model import ModelConfig
from moecore.config.moe import MoEConfig
from moecore.config.parallel import ParallelConfig
from moecore.config.train import CheckpointConfig, DataConfig, LogConfig, OptimConfig, TrainConfig


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
        if self.optim.muon_qk_clip and m.qk_norm:
            _fail("optim.muon_qk_clip", self.optim.muon_qk_clip, "needs model.qk_norm=false (normalised q/k undo it)")
        if self.optim.muon_qk_clip and m.attention_type == "dsa":
            _fail("optim.muon_qk_clip", self.optim.muon_qk_clip, "needs model.attention_type gqa or mla")
        if m.attention_type == "dsa" and m.dsa_stage == "dense_warmup":  # all but the indexers frozen (models/dsa.py)
            if self.train.precision == "fp8" and self.fp8.primary_weights:
                _fail(
                    "fp8.primary_weights",
                    True,
                    "model.dsa_stage=dense_warmup freezes the weights, which then have no master copy to quantise from",
                )
        if self.optim.state_dtype == "bf16" and self.optim.name != "adamw":
            _fail("optim.state_dtype", "bf16", "needs optim.name=adamw")
        if self.train.exit_interval is not None and self.train.exit_interval > self.train.steps:
            _fail("train.exit_interval", self.train.exit_interval, f"must be <= train.steps={self.train.steps}")
        _validate_moe_perf(self)
        _validate_deepseek_v4(self)
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
    low_memory = e.activation_memory in ("minimal", "chunked")
    if e.num_experts and (low_memory or e.sync_free):
        name, value = ("moe.activation_memory", e.activation_memory) if low_memory else ("moe.sync_free", True)
        # chunked runs behind the expert-parallel dispatch too (on the rows each expert rank receives)
        if (p.ep > 1 or p.etp > 1) and (e.sync_free or e.activation_memory == "minimal"):
            _fail(name, value, "needs parallel.ep=1 and parallel.etp=1 (expert-parallel dispatch reads split sizes)")
        if m.activation == "gelu":  # SwiGLU and its clipped / clamped forms (biased or not) run there
            _fail(name, value, "needs SwiGLU experts (model.activation=gelu)")
    if e.num_experts and low_memory and e.expert_capacity_factor is not None:
        _fail("moe.activation_memory", e.activation_memory, "needs dropless routing (moe.expert_capacity_factor unset)")
    if e.num_experts and e.activation_memory == "chunked" and e.sync_free:
        _fail(
            "moe.activation_memory",
            "chunked",
            "reads the expert bounds on the host once per layer: moe.sync_free=false",
        )
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


def _validate_deepseek_v4(cfg: Config) -> None:
    """DeepSeek-V4's parts (compressed attention, hyper-connections, hash routing) with what they run under."""
    m, e, t = cfg.model, cfg.moe, cfg.train
    parts = [
        (m.attention_type == "compressed", "model.attention_type", "compressed"),
        (m.hc_mult > 1, "model.hc_mult", m.hc_mult),
        (e.num_experts > 0 and e.num_hash_layers > 0, "moe.num_hash_layers", e.num_hash_layers),
    ]
    for used, name, value in parts:
        if not used:
            continue
        if t.cuda_graphs != "none":
            _fail(name, value, "does not run under CUDA graphs: train.cuda_graphs=none")
        if m.mtp_num_layers:
            _fail(name, value, "has no multi-token prediction blocks: model.mtp_num_layers=0")
        if cfg.optim.muon_qk_clip and name == "model.attention_type":
            _fail(name, value, "does not record attention logits for optim.muon_qk_clip")
    if e.num_experts and e.num_hash_layers:
        moe_layers = sum(e.is_moe_layer(i, m.num_layers) for i in range(m.num_layers))
        if e.num_hash_layers > moe_layers:
            _fail("moe.num_hash_layers", e.num_hash_layers, f"exceeds the model's {moe_layers} MoE layers")


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
    # these expert GEMMs read counts on the host (tensorwise e5m2: a loop of per-expert GEMMs)
    host_counts = f.recipe == "blockwise" or (f.format == "hybrid" and f.recipe == "tensorwise")
    if e.num_experts and e.sync_free and "experts" in f.modules and host_counts:
        _fail(
            "moe.sync_free",
            True,
            "with FP8 experts needs fp8.recipe=rowwise, or tensorwise with fp8.format=e4m3 (the others pad by host "
            "counts)",
        )
    if cfg.train.cuda_graphs != "none" and f.primary_weights:  # a graph would keep reading the old FP8 copies
        _fail(
            "train.cuda_graphs",
            cfg.train.cuda_graphs,
            "with fp8.primary_weights=true is not supported (each step re-quantises the weights into new tensors); "
            "use none",
        )
