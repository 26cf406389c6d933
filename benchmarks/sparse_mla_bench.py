"""DeepSeek sparse attention's main attention against dense MLA attention on one GPU, forward + backward.

    PYTHONPATH=. python benchmarks/sparse_mla_bench.py [--seq 32768] [--topk 2048] [--heads 128] --json OUT
        [--block-h 32,64] [--warps 4,8] [--block-k 16,32] [--stages 2,3]      (forward launch sizes, all products)
        [--fwd "32,4" "64,8,32,3" ...]                                        (or forward launch sizes, listed)
        [--fwd-alone "64,8,64,2" ...]                                         (forwards timed without a backward)
        [--bwd atomic,split] [--split "" "a_stages=1" "b_block_c=64,b_warps=4" ...] [--check] [--skip dense,indexer]

Every forward configuration is timed alone and with each backward (`--bwd`; each `--split` string is one
SplitBackward of the split backward, fields as in moecore/kernels/sparse_mla.py); one printed line per
configuration (the backward's share is fwd+bwd minus fwd), all of them in the JSON. `--check` also compares each
split backward's dq and dkv with the atomic backward's at the benchmark's shape.

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
from dataclasses import asdict, fields

import torch
import torch.nn.functional as F

from moecore.kernels.sparse_mla import SplitBackward, sparse_mla_attention
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


def split_configs(specs: list[str]) -> list[SplitBackward]:
    """SplitBackward per spec "field=value,field=value" (fields of SplitBackward; "" = the defaults)."""
    out = []
    for spec in specs:
        kw = dict(item.split("=") for item in spec.split(",") if item)
        out.append(SplitBackward(**{key: int(v) if v.isdigit() else v for key, v in kw.items()}))
    return out


def describe(cfg: SplitBackward) -> str:
    """The fields of cfg that differ from the defaults ("defaults" if none)."""
    diff = [f"{f.name}={getattr(cfg, f.name)}" for f in fields(cfg) if getattr(cfg, f.name) != f.default]
    return ",".join(diff) or "defaults"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--block-h", default="16,32,64", help="heads per program of the sparse kernel, comma-separated")
    p.add_argument("--warps", default="4,8", help="warps per program of the sparse kernel, comma-separated")
    p.add_argument("--block-k", default="32", help="selected rows per tile of the forward, comma-separated")
    p.add_argument("--stages", default="", help="num_stages of the forward, comma-separated ('' = Triton's default)")
    p.add_argument(
        "--fwd",
        nargs="*",
        default=None,
        help='forward configs "block_h,warps[,block_k[,stages]]" (instead of the product of the four flags above)',
    )
    p.add_argument(
        "--fwd-alone", nargs="*", default=[], help="further forward configs (as --fwd) timed without a backward"
    )
    p.add_argument("--bwd", default="atomic", help="backwards to time with each forward: atomic, split (comma-sep.)")
    p.add_argument(
        "--split",
        nargs="*",
        default=[""],
        help='SplitBackward configs for --bwd split, each "field=value,..." (e.g. "a_stages=1 b_block_c=64,b_warps=4")',
    )
    p.add_argument("--check", action="store_true", help="compare each backward's dq, dkv with the atomic one's")
    p.add_argument("--skip", default="", help="parts not to time: dense, indexer (comma-separated)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    s, n, k = a.seq, a.heads, a.topk
    r, dr, dn = 512, 64, 128
    scale = (dn + dr) ** -0.5
    records = []
    skip = set(filter(None, a.skip.split(",")))

    q = torch.randn(1, s, n, r + dr, device=dev, dtype=dt, requires_grad=True)
    kv = torch.randn(1, s, r + dr, device=dev, dtype=dt, requires_grad=True)
    idx = random_selection(s, k, dev)
    g = torch.randn(1, s, n, r, device=dev, dtype=dt)

    ints = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
    stages = ints(a.stages) or [None]
    fwd_configs = [
        (h, w, bk, st) for h in ints(a.block_h) for w in ints(a.warps) for bk in ints(a.block_k) for st in stages
    ]
    listed = lambda specs: [tuple(ints(c) + [32, None][len(ints(c)) - 2 :]) for c in specs]  # noqa: E731
    if a.fwd:
        fwd_configs = listed(a.fwd)
    fwd_configs = [(c, True) for c in fwd_configs] + [(c, False) for c in listed(a.fwd_alone)]
    bwd_configs = [("atomic", None)] if "atomic" in a.bwd.split(",") else []
    bwd_configs += [("split", c) for c in split_configs(a.split)] if "split" in a.bwd.split(",") else []
    for (block_h, warps, block_k, st), with_bwd in fwd_configs:
        fwd_kw = dict(block_h=block_h, num_warps=warps, block_k=block_k, num_stages=st)
        fwd_name = f"block_h {block_h}, warps {warps}, block_k {block_k}, stages {st or 'default'}"

        def sparse_fwd(kw=fwd_kw):
            with torch.no_grad():
                sparse_mla_attention(q, kv, idx, scale, r, **kw)

        runs = [(f"sparse_mla fwd ({fwd_name})", {}, sparse_fwd)]
        for bwd, cfg in bwd_configs if with_bwd else []:

            def sparse_step(kw=fwd_kw, bwd=bwd, cfg=cfg):
                out, _ = sparse_mla_attention(q, kv, idx, scale, r, **kw, backward=bwd, split=cfg)
                out.backward(g)

            name = f"sparse_mla fwd+bwd ({fwd_name}; bwd {bwd}" + (f" {describe(cfg)})" if cfg else ")")
            runs.append((name, {"backward": bwd, "split": asdict(cfg) if cfg else None}, sparse_step))
        fwd_ms = ref = None
        for i, (impl, extra, fn) in enumerate(runs):
            rec = {"impl": impl, **fwd_kw, **extra}
            try:
                rec["ms"] = timed(fn, a.iters, a.warmup)
                if i == 0:
                    fwd_ms = rec["ms"]
                elif fwd_ms is not None:
                    rec["bwd_ms"] = rec["ms"] - fwd_ms
                if a.check and extra.get("backward") == "split":
                    ref = ref or grads(q, kv, idx, g, scale, r, fwd_kw, "atomic", None)
                    got = grads(q, kv, idx, g, scale, r, fwd_kw, extra["backward"], extra["split"])
                    rec["rel_err_vs_atomic"] = rel_errs(got, ref)
                    got = None
            except Exception as err:  # a block size whose tiles exceed the GPU's shared memory or registers
                rec["error"] = str(err).splitlines()[0][:200]
            q.grad = kv.grad = None
            records.append(rec)
            print(line(rec), flush=True)
    q = kv = g = None
    torch.cuda.empty_cache()
    if "dense" not in skip:
        dense(records, s, n, dn, dr, scale, a)
    if "indexer" not in skip:
        indexer(records, s, k, a)
    for rec in records:
        rec.update(seq=s, topk=k, heads=n, gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=2)


def grads(q, kv, idx, g, scale: float, r: int, fwd_kw: dict, bwd: str, split: dict | None) -> tuple:
    """(dq, dkv) in fp32 of one forward + backward configuration at the benchmark's shape."""
    qq, kk = q.detach().requires_grad_(), kv.detach().requires_grad_()
    split = SplitBackward(**split) if split else None
    out, _ = sparse_mla_attention(qq, kk, idx, scale, r, **fwd_kw, backward=bwd, split=split)
    out.backward(g)
    return qq.grad.float(), kk.grad.float()


def rel_errs(got: tuple, ref: tuple) -> dict:
    return {name: ((a - b).norm() / b.norm()).item() for name, a, b in zip(("dq", "dkv"), got, ref)}


def line(rec: dict) -> str:
    """One printed line per configuration."""
    if "ms" not in rec:
        return f"{rec['impl']:34s} {rec['error']}"
    bwd = f"  (bwd {rec['bwd_ms']:.2f} ms)" if "bwd_ms" in rec else ""
    err = rec.get("rel_err_vs_atomic")
    err = f"  rel. err vs atomic: dq {err['dq']:.1e}, dkv {err['dkv']:.1e}" if err else ""
    return f"{rec['impl']:34s} {rec['ms']:10.2f} ms{bwd}{err}"


def dense(records: list, s: int, n: int, dn: int, dr: int, scale: float, a) -> None:
    """Dense causal MLA attention through SDPA, fwd and fwd+bwd."""
    dev, dt = "cuda", torch.bfloat16
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
    for rec in records[-2:]:
        print(line(rec), flush=True)


def indexer(records: list, s: int, k: int, a) -> None:
    """The lightning indexer's top-k selection (PyTorch, query blocks) at DeepSeek-V3.2's indexer shape."""
    from moecore.config import ModelConfig
    from moecore.models.dsa import LightningIndexer, causal_topk

    dev, dt = "cuda", torch.bfloat16
    torch.cuda.empty_cache()
    cfg = ModelConfig(hidden_size=7168, q_lora_rank=1536, qk_rope_head_dim=64, index_n_heads=64, index_head_dim=128)
    ix = LightningIndexer(cfg).to(dev, dt)
    iq = torch.randn(1, 64, s, 128, device=dev)
    ik = torch.randn(1, s, 128, device=dev)
    iw = torch.randn(1, s, 64, device=dev)
    records.append(
        {"impl": "indexer top-k (PyTorch blocks)", "ms": timed(lambda: causal_topk(ix, iq, ik, iw, k), 2, 1)}
    )
    print(line(records[-1]), flush=True)


if __name__ == "__main__":
    main()
