"""The MoE layer's row copies at the layer bench's shapes (GPU): moecore's permute against torch's gather.

Usage: PYTHONPATH=. python benchmarks/permute_rows.py [--shapes qwen3_next,deepseek_v3,...] [--json OUT]

For random top-k routing at each `moecore bench moe-layer` shape it times, in ms (median of CUDA-event timings):
`index_select` (torch's gather x[order // K], one read of a source row per copy), `permute` (moecore's kernel:
each token's row read once and stored to its K sorted rows, the same values) and `unpermute` (the per-token
sum of its K rows). "TB/s" counts the bytes the copy must move: T*K*H written and T*H read, bf16.
"""

from __future__ import annotations

import argparse
import json

import torch

from moecore.bench.common import cuda_time_ms, env
from moecore.bench.moe_layer import SHAPES
from moecore.kernels.permute import make_permutation, permute, unpermute


def time_shape(name: str) -> dict:
    H, _, E, K, T = SHAPES[name]
    torch.manual_seed(0)
    idx = torch.rand(T, E, device="cuda").topk(K, dim=1).indices
    perm = make_permutation(idx, E)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    src = perm.order_M // K
    rows = x.index_select(0, src)
    if not torch.equal(permute(x, perm), rows):
        raise AssertionError(f"{name}: permute differs from torch's gather")
    gather = cuda_time_ms(lambda: x.index_select(0, src), 3, 20)
    ours = cuda_time_ms(lambda: permute(x, perm), 3, 20)
    back = cuda_time_ms(lambda: unpermute(rows, perm), 3, 20)
    gb = (T * K * H + T * H) * 2 / 1e9
    return {
        "shape": name,
        "index_select_ms": round(gather, 4),
        "permute_ms": round(ours, 4),
        "unpermute_ms": round(back, 4),
        "GB": round(gb, 3),
        "index_select_TBps": round(gb / gather, 2),
        "permute_TBps": round(gb / ours, 2),
        **env(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    records = []
    for name in a.shapes.split(","):
        records.append(time_shape(name))
        print(json.dumps(records[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(records, fh, indent=1)


if __name__ == "__main__":
    main()
