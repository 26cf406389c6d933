#!/usr/bin/env bash
# One device call (session 2): GPU tests incl. the fused router, MoE-layer benches with A/B variants,
# 100-step GPU smoke runs, recompute memory, train bench. Each step has its own timeout.
export PYTHONUNBUFFERED=1 PYTHONPATH=. COLUMNS=200
O=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
echo "== gpu tests"
timeout 170 python -m pytest -q -p no:cacheprovider -m gpu --durations=6 tests 2>&1 | tail -16
echo "== moe-layer qwen3 (A/B router fusion, phases)"
timeout 90 python -m moecore.cli bench moe-layer --compare hf --no-eager --phases --shapes qwen3_30b_a3b --variants moecore,moecore-unfused-router --json $O/h200-moe-layer-qwen3.json 2>&1 | tail -5
echo "== moe-layer mixtral + deepseek-v3"
timeout 150 python -m moecore.cli bench moe-layer --compare hf --no-eager --shapes mixtral_8x7b,deepseek_v3 --variants moecore,moecore-all-grouped --json $O/h200-moe-layer-big.json 2>&1 | tail -8
echo "== smoke tiny-deepseek-v3"
timeout 45 python -m moecore.cli train tiny-deepseek-v3 train.steps=100 train.eval_interval=1000 train.run_dir=/tmp/r1 log.progress=false 2>&1 | grep -E "done|rror" | tail -4
python -c "import json; m=[json.loads(l) for l in open('/tmp/r1/metrics.jsonl')]; print([(r.get('step'), round(r.get('loss',0),3), round(r['tokens_per_s'])) for r in m if 'tokens_per_s' in r][-2:])"; cp /tmp/r1/metrics.jsonl $O/r1-metrics.jsonl
echo "== smoke tiny-moe"
timeout 35 python -m moecore.cli train tiny-moe train.steps=100 train.eval_interval=1000 train.run_dir=/tmp/r2 log.progress=false 2>&1 | grep -E "done|rror" | tail -4
python -c "import json; m=[json.loads(l) for l in open('/tmp/r2/metrics.jsonl')]; print([(r.get('step'), round(r.get('loss',0),3), round(r['tokens_per_s'])) for r in m if 'tokens_per_s' in r][-2:])"; cp /tmp/r2/metrics.jsonl $O/r2-metrics.jsonl
echo "== train bench"
timeout 90 python -m moecore.cli bench train --compare hf --json $O/h200-train.json 2>&1 | tail -5
echo "== recompute memory"
timeout 70 python benchmarks/recompute_memory.py --json $O/h200-recompute.json 2>&1 | tail -9
echo "== end"
