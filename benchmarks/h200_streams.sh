#!/usr/bin/env bash
# Device call (session 2): the "streams" GEMM experiment for Mixtral / DeepSeek-V3.
export PYTHONUNBUFFERED=1 PYTHONPATH=. COLUMNS=200
O=${OUT:-/tmp/out}
echo "== gpu tests grouped_ffn"
timeout 90 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_grouped_ffn.py 2>&1 | tail -2
echo "== moe-layer mixtral + deepseek-v3: default vs streams"
timeout 200 python -m moecore.cli bench moe-layer --compare hf --no-eager --shapes mixtral_8x7b,deepseek_v3 --variants moecore,moecore-streams,moecore --json $O/h200-moe-layer-E.json 2>&1 | tail -8
echo "== gemm strategy mixtral"
timeout 150 python benchmarks/gemm_strategy.py --shapes mixtral_8x7b --json $O/h200-gemm-strategy-streams.json 2>&1 | grep -v "triton\"" | cut -c1-160 | tail -30
echo "== end"
