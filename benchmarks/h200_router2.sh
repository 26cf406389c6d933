#!/usr/bin/env bash
# Second device call (session 2): repeat of the MoE-layer benches (spread), train bench with the router
# A/B and a phase profile, recompute activation memory. Each step has its own timeout.
export PYTHONUNBUFFERED=1 PYTHONPATH=. COLUMNS=200
O=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
echo "== moe-layer all shapes, run C"
timeout 200 python -m moecore.cli bench moe-layer --compare hf --no-eager --phases --variants moecore,moecore-unfused-router --json $O/h200-moe-layer-C.json 2>&1 | tail -12
echo "== train bench with router A/B and phases"
timeout 150 python -m moecore.cli bench train --compare hf --phases --variants moecore,moecore-unfused-router --json $O/h200-train-C.json 2>&1 | tail -5
echo "== recompute memory"
timeout 110 python benchmarks/recompute_memory.py --json $O/h200-recompute.json 2>&1 | tail -7
echo "== end"
