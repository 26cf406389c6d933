#!/usr/bin/env bash
# Fourth device call (session 2): recompute table on the DeepSeek-V2-Lite proxy (MLA, dense first layer,
# shared experts); GPU smoke runs of the recipes whose routers now go through the fused kernel.
export PYTHONUNBUFFERED=1 PYTHONPATH=. COLUMNS=200
O=${OUT:-/tmp/out}
echo "== recompute memory, dsv2lite proxy"
timeout 240 python benchmarks/recompute_memory.py --model dsv2lite --layers 4 --json $O/h200-recompute-dsv2lite.json 2>&1 | tail -10
for r in tiny-deepseek-v2 tiny-qwen3-next tiny-qwen2-moe tiny-mixtral; do
  echo "== smoke $r"
  timeout 60 python -m moecore.cli train $r train.steps=60 train.eval_interval=1000 train.run_dir=/tmp/s-$r log.progress=false 2>&1 | grep -E "done|rror" | tail -3
done
echo "== end"
