"""Block sizes of the SwiGLU x probs kernels on one shape (GPU): achieved GB/s per configuration.

Usage: PYTHONPATH=. python benchmarks/swiglu_tune.py [--rows 32768] [--ffn 14336] [--json OUT]
Bytes counted: forward reads h [M, 2F] and p, writes a [M, F]; backward (with the recomputed a, as the
fused expert FFN runs it) reads h and da [M, F], writes dh [M, 2F] and a.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from moecore.bench.common import cuda_time_ms
from moecore.kernels.swiglu import _swiglu_bwd_kernel, _swiglu_fwd_kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    M, F = a.rows, a.ffn
    h = torch.randn(M, 2 * F, device="cuda", dtype=torch.bfloat16)
    p = torch.rand(M, device="cuda")
    do = torch.randn(M, F, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(M, F, device="cuda", dtype=torch.bfloat16)
    dh = torch.empty_like(h)
    dp = torch.empty(M, device="cuda")
    act = torch.empty_like(out)
    rows = []
    fwd_bytes = (M * 2 * F + M * F) * 2
    for bm, bf, w in itertools.product((1, 2, 4, 8), (512, 1024, 2048), (4, 8)):
        grid = (triton.cdiv(M, bm), triton.cdiv(F, bf))
        ms = cuda_time_ms(
            lambda grid=grid, bm=bm, bf=bf, w=w: _swiglu_fwd_kernel[grid](h, p, out, M, F, True, bm, bf, num_warps=w),
            3,
            10,
        )
        rows.append({"kernel": "fwd", "block_m": bm, "block_f": bf, "warps": w, "ms": ms, "GBps": fwd_bytes / ms / 1e6})
    bwd_bytes = (M * 2 * F + M * F + M * 2 * F + M * F) * 2
    for bm, bf, w in itertools.product((1, 2, 4, 8), (128, 256, 512, 1024), (4, 8)):
        grid = (triton.cdiv(M, bm),)
        ms = cuda_time_ms(
            lambda grid=grid, bm=bm, bf=bf, w=w: _swiglu_bwd_kernel[grid](
                h, p, do, dh, dp, act, M, F, True, True, bm, bf, num_warps=w
            ),
            3,
            10,
        )
        rows.append({"kernel": "bwd", "block_m": bm, "block_f": bf, "warps": w, "ms": ms, "GBps": bwd_bytes / ms / 1e6})
    for kind in ("fwd", "bwd"):
        best = sorted((r for r in rows if r["kernel"] == kind), key=lambda r: r["ms"])[:4]
        for r in best:
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
