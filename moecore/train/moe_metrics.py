"""Per-step MoE metrics: the per-layer router statistics of a step's micro-batches, reduced over ranks."""

from __future__ import annotations

from moecore.train.runtime import Runtime


def moe_metrics(stats_per_mb: list[list[dict]], rt: Runtime) -> dict:
    """Average the per-layer MoE statistics over micro-batches (tokens summed) into flat metric keys."""
    out: dict = {}
    if not stats_per_mb or not stats_per_mb[0]:
        return out
    n = len(stats_per_mb)
    for layer_stats in zip(*stats_per_mb):
        idx = layer_stats[0]["layer"]
        prefix = f"moe/layer_{idx}/"
        counts = sum(s["tokens_per_expert"].double() for s in layer_stats)
        counts = rt.reduce_expert_counts(counts)
        out[prefix + "tokens_per_expert"] = [int(c) for c in counts.tolist()]
        mean = counts.mean().item()
        out[prefix + "imbalance"] = counts.max().item() / mean if mean > 0 else 0.0
        for key in layer_stats[0]:
            if key in ("layer", "tokens_per_expert", "imbalance"):
                continue
            val = sum(float(s[key]) for s in layer_stats) / n
            out[prefix + key] = rt.mean_over_dp(val)
    for key in ("imbalance", "aux_loss", "z_loss", "seq_aux_loss", "global_aux_loss", "dropped_fraction"):
        vals = [v for k, v in out.items() if k.endswith("/" + key)]
        if vals:
            out[f"moe/mean_{key}"] = sum(vals) / len(vals)
    return out
