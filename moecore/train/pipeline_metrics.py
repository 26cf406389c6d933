"""The logged metrics of a pipeline-parallel step, equal to the one-process run's.

Each pipeline rank holds part of them: the LM loss on the loss stage, the MTP losses on the MTP stage,
per-layer MoE statistics on every stage with MoE layers. Each rank reduces its part over its
data-parallel ranks exactly as the one-process loop does (`moe_metrics`), then the parts are gathered
over the pipeline group, so every rank (rank 0 logs) has them all.
"""

from __future__ import annotations

import torch

from moecore.parallel.pipeline import Pipeline, StepRecord
from moecore.train.runtime import Runtime

MEAN_KEYS = ("imbalance", "aux_loss", "z_loss", "seq_aux_loss", "global_aux_loss", "dropped_fraction")


def pipeline_metrics(
    pipe: Pipeline, rec: StepRecord, rt: Runtime, global_tokens: torch.Tensor, micro_batches: int, with_moe: bool
) -> dict:
    """loss, mtp_loss, mtp/depth_k_loss, indexer_loss (DSA) and (with_moe) the per-layer MoE metrics of every
    stage."""
    from moecore.train.moe_metrics import moe_metrics  # the one-process aggregation, reused per stage

    out: dict = {}
    n_mb_global = micro_batches * rt.dp_size
    if rec.lm_sums:
        out["loss"] = (rt.sum_over_dp(torch.stack(rec.lm_sums).double().sum()) / global_tokens).item()
    if rec.mtp_losses:
        out["mtp_loss"] = rt.sum_over_dp(torch.stack(rec.mtp_losses).double().sum()).item() / n_mb_global
        for d in range(len(rec.mtp_depths[0])):
            out[f"mtp/depth_{d + 1}_loss"] = rt.mean_over_dp(sum(mb[d] for mb in rec.mtp_depths) / micro_batches)
    if rec.indexer_losses:  # this rank's stages' share; the shares are summed over the pipeline below
        out["indexer_loss"] = rt.sum_over_dp(torch.stack(rec.indexer_losses).double().sum()).item() / n_mb_global
    if with_moe and rec.moe_stats:
        per_stage = [rec.moe_stats[i] for i in sorted(rec.moe_stats)]
        stats_per_mb = [[s for stage in per_stage for s in stage[mb]] for mb in range(micro_batches)]
        out.update(moe_metrics(stats_per_mb, rt))
    merged: dict = {}
    parts = pipe.gather_over_stages(out)
    for part in parts:
        merged.update({k: v for k, v in part.items() if not k.startswith("moe/mean_")})
    if any("indexer_loss" in part for part in parts):
        merged["indexer_loss"] = sum(part.get("indexer_loss", 0.0) for part in parts)
    for key in MEAN_KEYS:  # the means over layers, now over the layers of every stage
        vals = [v for k, v in merged.items() if k.startswith("moe/layer_") and k.endswith("/" + key)]
        if vals:
            merged[f"moe/mean_{key}"] = sum(vals) / len(vals)
    return merged
