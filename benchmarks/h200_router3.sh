#!/usr/bin/env bash
# Third device call (session 2): recompute table with the output-recomputing "norm" option and core_attn,
# GPU tests of the recompute path, MoE-layer Qwen3 router A/B after trimming the fused router's launches.
export PYTHONUNBUFFERED=1 PYTHONPATH=. COLUMNS=200
O=${OUT:-/tmp/out}
echo "== gpu tests"
timeout 120 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_router.py tests/moe/test_fused_router_layer.py 2>&1 | tail -3
echo "== moe-layer qwen3 A/B, run D"
timeout 100 python -m moecore.cli bench moe-layer --compare hf --no-eager --shapes qwen3_30b_a3b --variants moecore,moecore-unfused-router,moecore --json $O/h200-moe-layer-D.json 2>&1 | tail -5
echo "== recompute memory"
timeout 200 python benchmarks/recompute_memory.py --json $O/h200-recompute.json 2>&1 | tail -9
echo "== end"
echo "== swiglu tuning (Mixtral rows), current: fwd block 2x1024 w4, bwd 4x256 w4"
timeout 120 python benchmarks/swiglu_tune.py --json $O/h200-swiglu-tune.json 2>&1 | tail -9
echo "== end2"
