"""Which model / parallel-layout combinations this version runs; checked before any work (no torch needed).

`check_layout(cfg)` raises ConfigError with one line naming the field, the value and what is
allowed. It is called by `validate_layout(cfg, world_size)` (the preflight of `moecore train`), so an
unsupported layout is refused before processes start work; the layers raise the same errors if built
directly.
"""

from __future__ import annotations

from moecore.config import Config, ConfigError
from moecore.parallel.pipeline_layout import StageSpec, check_pipeline, weights_shared_on_a_rank


def check_layout(cfg: Config) -> None:
    """Refuse degrees and combinations that are not implemented or do not divide the model's sizes."""
    p, m, e = cfg.parallel, cfg.model, cfg.moe
    if p.pp > 1:
        stages = check_pipeline(cfg)  # stage layout and schedule (micro-batch counts: validate_layout)
        if p.fsdp:
            _check_pipeline_fsdp(cfg, stages)
        types = m.indexer_types if m.attention_type == "dsa" else None
        for s in stages:  # a shared DSA layer reuses the previous layer's top-k: both on one stage
            if types and s.layers and types[s.layers[0]] == "shared":
                raise ConfigError(
                    f"parallel.pp_layout={p.pp_layout or 'even split'!r} opens stage {s.index} with layer {s.layers[0]}, "
                    "which is shared in model.indexer_types (it reuses the previous layer's top-k); "
                    "start each stage on a full layer"
                )
    if p.cp > 1:
        _check_context_parallel(cfg)
    if p.fsdp:
        if p.distributed_optimizer:
            raise ConfigError(
                "parallel.fsdp=true shards the optimizer state itself; use parallel.distributed_optimizer=false"
            )
    if (p.ep > 1 or p.etp > 1) and not e.num_experts:
        raise ConfigError(f"parallel.ep={p.ep}, parallel.etp={p.etp} need MoE layers (moe.num_experts > 0); use 1")
    if e.num_experts and e.num_experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} does not divide moe.num_experts={e.num_experts}")
    if e.num_experts and e.ffn_hidden_size % p.etp:
        raise ConfigError(f"parallel.etp={p.etp} does not divide moe.ffn_hidden_size={e.ffn_hidden_size}")
    if m.expert_linear_bias and m.hidden_size % p.etp:  # models/biased_moe.py: b2 splits its hidden columns
        raise ConfigError(f"parallel.etp={p.etp} does not divide model.hidden_size={m.hidden_size}")
    if p.tp == 1:
        return
    tp = p.tp
    # Tensor parallel splits attention heads (GQA, MLA, DSA: models/attention.py, mla.py, dsa.py), gated DeltaNet
    # key heads with their value heads (models/linear_attention.py), FFN columns and the vocabulary.
    layer_types = m.layer_types or []
    checks = [
        ("model.num_attention_heads", m.num_attention_heads),
        ("model.ffn_hidden_size", m.ffn_hidden_size),
        # sequence-parallel shards (and MoE token chunks) of this CP rank's part of the sequence
        ("train.seq_length" + (" / parallel.cp" if p.cp > 1 else ""), cfg.train.seq_length // p.cp),
    ]
    if m.attention_type == "gqa":
        checks.insert(1, ("model.num_kv_heads", m.kv_heads))
    if m.attention_type == "compressed":  # DeepSeek-V4: the output projection's groups split with the heads
        checks.insert(1, ("model.o_groups", m.o_groups))
    if "linear_attention" in layer_types:
        checks.append(("model.linear_num_key_heads", m.linear_num_key_heads))
        checks.append(("model.linear_num_value_heads", m.linear_num_value_heads))
    if m.vocab_size:
        checks.append(("model.vocab_size", m.vocab_size))
    for name, value in checks:
        if value % tp:
            raise ConfigError(f"parallel.tp={tp} does not divide {name}={value}")


def validate_layout(cfg: Config, world_size: int) -> None:
    """`cfg.validate()` plus the checks that need the world size: the degrees must tile the ranks (with folding),
    this version must run the layout (`check_layout`), the batch must split over data parallel."""
    cfg.validate()
    p = cfg.parallel
    dense = p.tp * p.pp * p.cp
    if world_size % dense:
        culprit = "pp" if p.pp > 1 else "cp" if p.cp > 1 else "tp"
        raise ConfigError(
            f"parallel.{culprit}={getattr(p, culprit)} is invalid: tp*pp*cp={dense} must divide the world size {world_size}"
        )
    expert = p.etp * p.ep * p.pp
    if world_size % expert:
        culprit = "ep" if p.ep > 1 else "etp" if p.etp > 1 else "pp"
        raise ConfigError(
            f"parallel.{culprit}={getattr(p, culprit)} is invalid: etp*ep*pp={expert} must divide the world size {world_size}"
        )
    check_layout(cfg)
    dp = world_size // dense
    mb_total = cfg.train.micro_batch_size * dp
    if cfg.train.global_batch_size % mb_total:
        raise ConfigError(
            f"train.global_batch_size={cfg.train.global_batch_size} is invalid: must be a multiple of "
            f"train.micro_batch_size * data-parallel size = {mb_total}"
        )
    if p.pp > 1:  # the schedule's micro-batch rules
        check_pipeline(cfg, cfg.train.global_batch_size // mb_total)


def _check_context_parallel(cfg: Config) -> None:
    """parallel.cp > 1: the sequence splits into 2 * cp chunks (moecore/parallel/context.py); what CP covers."""
    p, m = cfg.parallel, cfg.model
    cp, seq = p.cp, cfg.train.seq_length
    if seq % (2 * cp):
        raise ConfigError(
            f"train.seq_length={seq} is not divisible by 2 * parallel.cp = {2 * cp}: context parallel cuts "
            "the sequence into 2 * cp equal chunks; use a multiple of it"
        )
    refused = [
        ("model.attention_dropout", m.attention_dropout, m.attention_dropout > 0, "0"),
    ]
    for name, value, bad, allowed in refused:
        if bad:
            raise ConfigError(f"{name}={value!r} is not supported with parallel.cp={cp} yet; allowed: {allowed}")
    heads = m.num_attention_heads // p.tp
    if p.cp_comm == "a2a" and heads % cp:  # moecore/parallel/cp_attention.py alltoall_attention
        raise ConfigError(
            f"parallel.cp_comm='a2a' splits the {heads} attention heads of a tensor-parallel rank over "
            f"parallel.cp={cp}, which does not divide them; use ring or allgather"
        )


def _check_pipeline_fsdp(cfg: Config, stages: list[StageSpec]) -> None:
    """parallel.pp > 1 with parallel.fsdp: each stage module is an FSDP2 root (moecore/parallel/fsdp.py), under every
    schedule (the split-backward ones' weight pass runs while torch's PipelineStage keeps the stage's weights
    gathered; it reduce-scatters once after the last micro-batch's weight pass)."""
    p = cfg.parallel
    shared = weights_shared_on_a_rank(cfg, stages)
    if shared is not None:
        raise ConfigError(
            f"parallel.pp_layout={p.pp_layout or 'even split'!r} puts two stages that use the {shared} weight on one "
            "pipeline rank, which parallel.fsdp=true cannot shard twice; move one of them to another rank"
        )
