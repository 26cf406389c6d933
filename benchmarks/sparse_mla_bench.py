"""DeepSeek sparse attention's main attention against dense MLA attention on one GPU, forward + backward.

    PYTHONPATH=. python benchmarks/sparse_mla_bench.py [--seq 32768] [--topk 2048] [--heads 128] --json OUT

Sparse: moecore/kernels/sparse_mla.py on the absorbed form (q [1, S, n, 512 + 64], one shared kv row
[1, S, 576] per token, each query attending to `topk` tokens). Dense: scaled_dot_product_attention
(causal, flash/cuDNN/efficient) on the per-head MLA shapes q, k [1, n, S, 192], v [1, n, S, 128], i.e.
what MLAttention runs. Also times the lightning indexer's top-k selection (moecore/models/dsa.py,
`causal_topk`, PyTorch in query blocks) with DeepSeek-V3.2's indexer shape (64 heads of 128). bf16.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from moecore.kernels.sparse_mla import sparse_mla_attention
from moecore.models.attention import sdpa_backends


def timed(fn, iters: int, warmup: int) -> float:
    """Median milliseconds of fn() over `iters` runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def random_selection(s: int, k: int, device: str) -> torch.Tensor:
    """[1, S, k]: query t keeps min(k, t + 1) distinct visible tokens (the most recent ones plus random
    earlier ones is irrelevant to the kernel's speed: any distinct visible tokens)."""
    t = torch.arange(s, device=device)[:, None]
    j = torch.arange(k, device=device)[None, :]
    # spread the k picks evenly over 0..t (distinct because k <= t + 1 where kept)
    idx = (j * (t + 1)) // k
    idx = torch.where(t + 1 > k, idx, torch.where(j <= t, j, torch.full_like(j, -1)))
    return idx[None].to(torch.int32)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--block-h", default="16,32,64", help="heads per program of the sparse kernel, comma-separated")
    p.add_argument("--warps", default="4,8", help="warps per program of the sparse kernel, comma-separated")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    s, n, k = a.seq, a.heads, a.topk
    r, dr, dn = 512, 64, 128
    scale = (dn + dr) ** -0.5
    records = []

    q = torch.randn(1, s, n, r + dr, device=dev, dtype=dt, requires_grad=True)
    kv = torch.randn(1, s, r + dr, device=dev, dtype=dt, requires_grad=True)
    idx = random_selection(s, k, dev)
    g = torch.randn(1, s, n, r, device=dev, dtype=dt)

    configs = [(int(h), int(w)) for h in a.block_h.split(",") for w in a.warps.split(",")]
    for block_h, warps in configs:

        def sparse_fwd(block_h=block_h, warps=warps):
            with torch.no_grad():
                sparse_mla_attention(q, kv, idx, scale, r, block_h=block_h, num_warps=warps)

        def sparse_step(block_h=block_h, warps=warps):
            out, _ = sparse_mla_attention(q, kv, idx, scale, r, block_h=block_h, num_warps=warps)
            out.backward(g)

        for what, fn in (("fwd", sparse_fwd), ("fwd+bwd", sparse_step)):
            impl = f"sparse_mla {what} (block_h {block_h}, warps {warps})"
            try:
                records.append({"impl": impl, "ms": timed(fn, a.iters, a.warmup)})
            except Exception as err:  # a block size whose tiles exceed the GPU's shared memory or registers
                records.append({"impl": impl, "error": str(err).splitlines()[0][:200]})
                q.grad = kv.grad = None
    q = kv = g = None
    torch.cuda.empty_cache()

    qd = torch.randn(1, n, s, dn + dr, device=dev, dtype=dt, requires_grad=True)
    kd = torch.randn(1, n, s, dn + dr, device=dev, dtype=dt, requires_grad=True)
    vd = torch.randn(1, n, s, dn + dr, device=dev, dtype=dt, requires_grad=True)  # v padded to 192 for flash
    gd = torch.randn(1, n, s, dn + dr, device=dev, dtype=dt)

    def dense_fwd():
        with torch.no_grad(), sdpa_backends("auto", qd.device):
            F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)

    records.append({"impl": "dense MLA sdpa fwd", "ms": timed(dense_fwd, a.iters, a.warmup)})

    def dense_step():
        with sdpa_backends("auto", qd.device):
            out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)
        out.backward(gd)

    records.append({"impl": "dense MLA sdpa fwd+bwd", "ms": timed(dense_step, a.iters, a.warmup)})
    qd = kd = vd = gd = None
    torch.cuda.empty_cache()

    from moecore.config import ModelConfig
    from moecore.models.dsa import LightningIndexer, causal_topk

    cfg = ModelConfig(hidden_size=7168, q_lora_rank=1536, qk_rope_head_dim=64, index_n_heads=64, index_head_dim=128)
    ix = LightningIndexer(cfg).to(dev, dt)
    iq = torch.randn(1, 64, s, 128, device=dev)
    ik = torch.randn(1, s, 128, device=dev)
    iw = torch.randn(1, s, 64, device=dev)
    records.append(
        {"impl": "indexer top-k (PyTorch blocks)", "ms": timed(lambda: causal_topk(ix, iq, ik, iw, k), 2, 1)}
    )
    for rec in records:
        rec.update(seq=s, topk=k, heads=n, gpu=torch.cuda.get_device_name(), torch=torch.__version__)
        print(f"{rec['impl']:34s} " + (f"{rec['ms']:10.2f} ms" if "ms" in rec else rec["error"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=2)


if __name__ == "__main__":
    main()
