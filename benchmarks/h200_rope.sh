#!/usr/bin/env bash
# Device call (session 2): RoPE layout change — GPU tests, train bench vs transformers, top kernels.
export PYTHONUNBUFFERED=1 PYTHONPATH=. COLUMNS=200
O=${OUT:-/tmp/out}
echo "== gpu tests rope / attention / mla"
timeout 90 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_rope.py tests/kernels/test_rmsnorm.py 2>&1 | tail -2
echo "== smoke tiny-deepseek-v3, tiny-qwen3-moe"
for r in tiny-deepseek-v3 tiny-qwen3-moe; do
  timeout 60 python -m moecore.cli train $r train.steps=60 train.eval_interval=1000 train.run_dir=/tmp/s-$r log.progress=false 2>&1 | grep -E "done|rror" | tail -2
done
echo "== train bench"
timeout 120 python -m moecore.cli bench train --compare hf --json $O/h200-train-F.json 2>&1 | tail -3
echo "== top kernels"
timeout 90 python benchmarks/train_top_kernels.py --top 16 --json $O/h200-train-top-kernels.json 2>&1 | grep -v Warn | tail -17
echo "== end"
