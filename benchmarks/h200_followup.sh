#!/usr/bin/env bash
# One device call: GPU tests, 100-step GPU smoke runs, MoE-layer (Qwen3) and train benches vs transformers,
# recompute memory. Each step under its own timeout so one slow step cannot take the others' time.
export PYTHONUNBUFFERED=1 PYTHONPATH=. COLUMNS=200
O=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
echo "== gpu tests"
timeout 60 python -m pytest -q -p no:cacheprovider -k "cuda or gpu" tests/kernels/test_cross_entropy.py tests/moe/test_experts.py 2>&1 | tail -4
echo "== moe-layer qwen3"
timeout 40 python -m moecore.cli bench moe-layer --compare hf --no-eager --shapes qwen3_30b_a3b --json $O/h200-moe-layer-qwen3.json 2>&1 | tail -6
echo "== smoke tiny-deepseek-v3"
timeout 45 python -m moecore.cli train tiny-deepseek-v3 train.steps=100 train.eval_interval=1000 train.run_dir=/tmp/r1 log.progress=false 2>&1 | grep -E "done|rror" | tail -4
python -c "import json; m=[json.loads(l) for l in open('/tmp/r1/metrics.jsonl')]; print([(r.get('step'), round(r['tokens_per_s'])) for r in m if 'tokens_per_s' in r][-3:])"; cp /tmp/r1/metrics.jsonl $O/r1-metrics.jsonl
echo "== smoke tiny-moe"
timeout 35 python -m moecore.cli train tiny-moe train.steps=100 train.eval_interval=1000 train.run_dir=/tmp/r2 log.progress=false 2>&1 | grep -E "done|rror" | tail -4
python -c "import json; m=[json.loads(l) for l in open('/tmp/r2/metrics.jsonl')]; print([(r.get('step'), round(r['tokens_per_s'])) for r in m if 'tokens_per_s' in r][-3:])"; cp /tmp/r2/metrics.jsonl $O/r2-metrics.jsonl
echo "== recompute memory"
timeout 60 python benchmarks/recompute_memory.py --json $O/h200-recompute.json 2>&1 | tail -8
echo "== train bench"
timeout 80 python -m moecore.cli bench train --compare hf --json $O/h200-train.json 2>&1 | tail -5
echo "== end"
